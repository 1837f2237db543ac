"""The ops' per-thread modes, flags of ``_C`` (``csrc/common/thread_flags.cpp``):
:func:`trusted_inputs` and :func:`batch_invariant`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from fastllm import _C

__all__ = ["batch_invariant", "trusted_inputs"]


@contextlib.contextmanager
def trusted_inputs() -> Iterator[None]:
    """Within this block (on this thread) the caller vouches for the index values it passes
    to the ops: ``cu_seqlens``, ``block_tables``, ``seq_lens``, ``slot_mapping``, ``positions``
    and the sampling parameters.

    On the CPU the ops check those values anyway (it costs nothing). On a GPU, checking them
    means copying them to the host and waiting for the device, once per call: inside this block
    GPU ops skip those checks (shapes, dtypes and devices are still checked), as they do while
    a CUDA graph is being captured. Kernels never read or write out of bounds either way, but a
    bad value gives a wrong result instead of a ``ValueError``. On CUDA, ``sample`` then marks
    a row whose logits hold NaN or +inf, or no finite value, with token -1 instead of raising.
    The engine builds and checks its metadata on the host, then runs its steps in this block.
    """
    with _thread_flag(_C.set_trusted_inputs, True):
        yield


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within this block (on this thread, ``enabled``) the CPU ops compute each row the same
    way whatever the other rows of the call: ``linear`` and ``quantized_linear`` keep their
    few-row kernels for any number of rows (no switch to a GEMM), and ``attention`` /
    ``paged_attention`` give every query row the same tiles and key blocks whether it decodes
    alone, sits in a prefill chunk or in a batch, with no split over the keys. Norms, RoPE and
    sampling are per row anyway. A seeded request's tokens then do not depend on the batch, the
    chunking or a preemption, in every dtype; prefill is slower (no GEMM) and batch-1 decode
    attention runs one thread per kv head. CUDA kernels ignore it.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    with _thread_flag(_C.set_batch_invariant, enabled):
        yield


@contextlib.contextmanager
def _thread_flag(setter: Callable[[bool], bool], value: bool) -> Iterator[None]:
    """Sets one of ``_C``'s per-thread flags for the block, then restores it."""
    previous = setter(value)
    try:
        yield
    finally:
        setter(previous)
