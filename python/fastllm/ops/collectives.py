"""The collectives of tensor parallelism, as ops: torch's functional collectives
(``torch.ops._c10d_functional``), which run on any ``torch.distributed`` backend (gloo for CPU
tensors, NCCL for CUDA ones), need no host synchronization, and which CUDA graphs and
``torch.compile`` capture. :class:`fastllm.ops.DecoderLayers` calls the same ``all_reduce``
from C++. Every rank of the group must make the same calls in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["all_gather", "all_reduce"]


def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """The sum of ``x`` over the ranks of the process group named ``group_name`` (a new
    tensor)."""
    collectives = torch.ops._c10d_functional
    return collectives.wait_tensor(collectives.all_reduce(x, "sum", group_name))


def all_gather(x: Tensor, size: int, group_name: str) -> Tensor:
    """Every rank's ``x`` ``[n, ...]`` stacked in rank order, ``[size * n, ...]``, over the
    ``size`` ranks of the process group named ``group_name``."""
    collectives = torch.ops._c10d_functional
    return collectives.wait_tensor(
        collectives.all_gather_into_tensor(x.contiguous(), size, group_name))
