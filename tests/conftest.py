"""Fixtures shared by every test: a reproducible seed per test and the devices to run on; and
``num_threads``, which test modules import (``from conftest import num_threads``)."""

import contextlib
import zlib

import pytest
import torch

# "cpu" always; "cuda" reported as skipped where there is no GPU, so a CPU-only run says what it
# did not cover; "mps" only where it exists (there is no mps in a CPU-only torch to speak of).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
]
if torch.backends.mps.is_available():
    DEVICES.append("mps")


@pytest.fixture(autouse=True)
def _seed(request):
    """Seeds torch from the test's id: fresh inputs per test, the same ones on every run."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device present; tests taking it run once per device."""
    return torch.device(request.param)


@contextlib.contextmanager
def num_threads(n: int | None):
    """Runs the block with ``n`` intra-op threads (None: leave the default), then restores."""
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
