"""Fixtures shared by every test: a reproducible seed per test and the devices to run on; and
helpers that test modules import (``from conftest import num_threads``): a thread-count
context, and the attention oracles' row and tolerance checks."""

import contextlib
import os
import zlib
from pathlib import Path

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


LOW_PRECISION_SLACK = 1e-5  # added to 2 * (plain error) for bfloat16/float16


def blind_rows(lens_q, lens_k, causal: bool, window_left: int) -> torch.Tensor:
    """Bool [total_q]: the queries that see no key, whose output must be exactly 0."""
    rows = []
    for len_q, len_k in zip(lens_q, lens_k):
        for i in range(len_q):
            diag = i + len_k - len_q  # the last key query i may see under the causal mask
            first = max(0, diag - window_left) if window_left >= 0 else 0
            last = min(len_k - 1, diag) if causal else len_k - 1
            rows.append(first > last)
    return torch.tensor(rows, dtype=torch.bool)


def assert_within_twice_plain_error(got, plain, expected) -> None:
    """flash-attention's rule: the kernel errs at most twice as much as plain PyTorch does in
    the same dtype (all three arguments float64 copies on the CPU)."""
    if expected.numel() == 0:
        return
    err = (got - expected).abs().max().item()
    plain_err = (plain - expected).abs().max().item()
    assert err <= 2 * plain_err + LOW_PRECISION_SLACK, (
        f"max error {err:.3g} vs the float64 reference exceeds 2x the plain composition's "
        f"{plain_err:.3g}")


MODELS_DIR = Path(os.environ.get("FASTLLM_MODELS_DIR",
                                 Path(__file__).resolve().parents[1].parent / "shared" / "models"))


def find_model(relative: str) -> Path:
    """The file or folder ``relative`` under ``$FASTLLM_MODELS_DIR`` (default
    ``<repo>/../shared/models``). A missing one skips the test, but fails it when ``CI=true``:
    there a missing model is a broken setup, not an optional extra."""
    path = MODELS_DIR / relative
    if not path.exists():
        message = f"model file {path} is missing (set FASTLLM_MODELS_DIR)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def model_path():
    """``model_path(name)`` -> the folder of a small real model (see :func:`find_model`)."""
    return find_model
