"""Host data to the device and back, one copy each way a step.

A copy from pageable host memory to a CUDA device synchronizes the stream first (CUDA's
documented behaviour), so a decode step built from Python lists would wait for the previous
step's kernels at every ``torch.tensor(..., device="cuda")``. Staging through pinned memory with
``non_blocking=True`` queues the copy behind them instead. Each copy also costs a
``cudaMemcpyAsync`` call (and each fresh pinned tensor a ``pin_memory``), so
:class:`StagingBuffer` packs all of a step's host inputs into one reused pinned buffer and moves
them in one copy; :func:`to_host` reads several results back in one copy.

``transfers`` counts the copies made here. Every copy of an engine step's host data and samples
goes through this module, so a test on any device can count a step's copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["StagingBuffer", "Transfers", "to_device", "to_host", "transfers"]

_ALIGN = 16  # each dtype's run starts here: every element size, and 16-byte loads, divide it


@dataclass
class Transfers:
    """Copies made by this module since the process started."""

    host_to_device: int = 0
    device_to_host: int = 0


transfers = Transfers()


class StagingBuffer:
    """Moves groups of host tensors to ``device`` in one copy: the tensors are packed into a
    pinned host buffer (one run per dtype, each run 16-byte aligned, written by one ``cat``),
    the used bytes go to a device buffer in one non-blocking copy, and each tensor comes back as
    a view of that buffer, of its own dtype and shape. Off CUDA the host buffer is plain memory
    and the copy a plain copy.

    The views are valid until the next :meth:`send`, which overwrites the device buffer (on
    CUDA after the kernels queued before it, which read them): they serve one step. State that
    outlives the step takes :func:`to_device`.

    Two host buffers alternate, each with a CUDA event recorded after its copy: a buffer is
    refilled only once its last copy has run (in a decode loop long done: each step waits for
    its sampled tokens). The buffers grow to the largest send so far, rounded up to a power of
    two, and never shrink. An engine step is bounded by its limits (``max_num_batched_tokens``,
    ``max_num_seqs``, ``max_model_len``): 24 bytes a token (ids, positions, slots), ``4 x (2 +
    max blocks)`` a sequence (seq_lens, cu_seqlens, block table), about 50 a sampled row
    (parameters, seed, offset, row index), 12 a logit-bias entry: tens of KiB at the defaults.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._host = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if self._pinned else []
        self._next = 0  # the host buffer the next send fills
        self._staged = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._typed: dict[torch.dtype, Tensor] = {}  # _staged viewed as each dtype

    def send(self, *groups: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """Each group's host tensors on the device (same names, dtypes and shapes), all in one
        copy."""
        flat = [tensor for group in groups for tensor in group.values()]
        runs: dict[torch.dtype, list[int]] = {}  # dtype -> indices into flat
        for i, tensor in enumerate(flat):
            runs.setdefault(tensor.dtype, []).append(i)
        starts = [0] * len(flat)  # each tensor's first element, in its dtype's elements
        layout, total = [], 0  # (dtype, indices, byte offset, elements) per run
        for dtype, indices in runs.items():
            size, count = flat[indices[0]].element_size(), 0
            for i in indices:
                starts[i] = total // size + count
                count += flat[i].numel()
            layout.append((dtype, indices, total, count))
            total = -(-(total + count * size) // _ALIGN) * _ALIGN
        index, self._next = self._next, self._next ^ 1
        host = self._host_buffer(index, total)
        for dtype, indices, offset, count in layout:
            run = host[offset:offset + count * flat[indices[0]].element_size()].view(dtype)
            torch.cat([flat[i] if flat[i].dim() == 1 else flat[i].reshape(-1) for i in indices],
                      out=run)
        if self._staged.numel() < total:
            self._staged, self._typed = _empty(host.numel(), self.device), {}
        if total:
            self._staged[:total].copy_(host[:total], non_blocking=self._pinned)
            transfers.host_to_device += 1
            if self._pinned:
                self._events[index].record()
        views: list[Tensor] = [None] * len(flat)  # type: ignore[list-item]
        for dtype, indices, _, _ in layout:
            typed = self._typed.get(dtype)
            if typed is None:
                typed = self._typed[dtype] = self._staged.view(dtype)
            for i in indices:
                shape = flat[i].shape
                views[i] = typed.as_strided(shape, _contiguous_strides(shape), starts[i])
        it = iter(views)
        return [{name: next(it) for name in group} for group in groups]

    def _host_buffer(self, index: int, nbytes: int) -> Tensor:
        """Host buffer ``index``, once its last copy has run, at least ``nbytes`` long."""
        if self._pinned:
            self._events[index].synchronize()
        if self._host[index].numel() < nbytes:
            size = 1 << max(nbytes - 1, 255).bit_length()
            self._host[index] = _empty(size, torch.device("cpu"), pin_memory=self._pinned)
        return self._host[index]


def _empty(nbytes: int, device: torch.device, pin_memory: bool = False) -> Tensor:
    # Not an inference tensor, even when made in inference mode: a later send outside it may
    # write it.
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    if len(shape) == 1:
        return (1,)
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor`` (on the host) on ``device`` in a buffer of its own, queued behind the device's
    work on CUDA: for state that outlives a step (a request's prompt mask)."""
    return StagingBuffer(device).send({"tensor": tensor})[0]["tensor"]


def to_host(*tensors: Tensor) -> list[Tensor]:
    """``tensors`` (on one device) on the host, in one copy: this waits for the device."""
    transfers.device_to_host += 1
    if len(tensors) == 1 or tensors[0].device.type == "cpu":
        return [tensor.cpu() for tensor in tensors]
    # Widest elements first: every piece then starts aligned to its element size.
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    pieces = [tensors[i].contiguous().view(-1).view(torch.uint8) for i in order]
    host = torch.cat(pieces).cpu()
    out: list[Tensor] = [torch.empty(0)] * len(tensors)
    offset = 0
    for i in order:
        nbytes = tensors[i].numel() * tensors[i].element_size()
        out[i] = host[offset:offset + nbytes].view(tensors[i].dtype).view(tensors[i].shape)
        offset += nbytes
    return out
