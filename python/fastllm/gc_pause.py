"""Python's cyclic garbage collector paused around work that only makes long-lived objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Pauses the cyclic garbage collector inside the block and resumes it after, if it ran
    before.

    For imports and model loads: they make hundreds of thousands of objects that live as long
    as the process or the model (modules, a vocabulary and its merges, the model's modules) and
    no garbage cycles, and each collection they trigger walks the heap again (torch's whole
    heap in a full one). Allocation counts go on, so the collector runs at its next trigger
    after the block.

    With ``freeze`` (for imports: modules, classes and functions live as long as the process),
    everything alive is moved to the collector's permanent generation (``gc.freeze``) before it
    resumes, so that no later collection walks what the block made: each of the first
    collections after a large import (torch's) would walk all of it, young and then old.
    Freezing takes every object alive at the time, the caller's too: reference counting still
    frees those, but a garbage cycle among them is never collected (``gc.unfreeze()`` gives
    them back).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
