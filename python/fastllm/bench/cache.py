"""Files and folders the benchmarks make once (models, adapters, GGUF rewrites) and keep in
their cache folder (``build/bench-models``) between runs."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["cached"]


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def cached(path: Path, make: Callable[[Path], None], benchmark: str) -> Path:
    """``path`` (a file or a folder), made by ``make`` under a temporary name first if it is
    not there yet, so that an interrupted ``make`` never leaves a partial one under the real
    name; says so on stdout, prefixed with the ``benchmark``'s name."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    _remove(partial)
    started = time.perf_counter()
    try:
        make(partial)
        os.replace(partial, path)
    finally:
        _remove(partial)
    print(f"{benchmark}: made {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return path
