"""What the fake kernels of the op modules share: their registration in both namespaces of the
schemas and the one input check they repeat.

A fake kernel gives an op's output metadata to ``torch.compile``. Metadata checks stay in C++ (one
place for all devices); the one check repeated here is the device check, because mixing in a meta
tensor routes the call to the fake kernel instead of a real one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["check_one_device", "fake_kernel"]


def fake_kernel(name: str) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the fake kernel of ``name`` in both namespaces of the
    schemas (``csrc/ops.cpp``): fastllm and fastllm_composite."""

    def register(fake: Callable) -> Callable:
        for namespace in ("fastllm", "fastllm_composite"):
            torch.library.register_fake(f"{namespace}::{name}")(fake)
        return fake

    return register


def check_one_device(**tensors: Tensor | None) -> None:
    """A ValueError naming the first tensor (of those not None) on another device than the
    first one."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")
