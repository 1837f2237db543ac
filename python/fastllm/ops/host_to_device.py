"""Host data to the device without a host sync.

A copy from pageable host memory to a CUDA device synchronizes the stream first (CUDA's
documented behaviour), so a decode step built from Python lists would wait for the previous
step's kernels at every ``torch.tensor(..., device="cuda")``. Staging through pinned memory with
``non_blocking=True`` queues the copy behind them instead; torch's pinned-memory allocator keeps
the staging buffer alive until the copy has run. Other devices take a plain ``.to``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["device_tensor", "to_device"]


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor`` (on the host) on ``device``, queued behind the device's work on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def device_tensor(values, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``torch.tensor(values, dtype=dtype)`` built on the host and moved by :func:`to_device`."""
    return to_device(torch.tensor(values, dtype=dtype), device)
