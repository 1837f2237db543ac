"""Python's cyclic garbage collector paused around work that only makes long-lived objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector inside the block and resumes it after, if it ran
    before.

    For imports and model loads: they make hundreds of thousands of objects that live as long
    as the process or the model (modules, a vocabulary and its merges, the model's modules) and
    no garbage cycles, and each collection they trigger walks the heap again (torch's whole
    heap in a full one). Allocation counts go on, so the collector runs at its next trigger
    after the block.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
