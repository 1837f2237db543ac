"""The torch-free CUDA kernel templates (``csrc/**/*_kernels.cuh``) compile with nvcc for every
target architecture, wherever nvcc is installed, GPU or not: a kernel that does not compile
fails CI on this CPU machine. Each header instantiates its templates for every storage dtype
under ``FASTLLM_KERNEL_COMPILE_CHECK``, so nvcc compiles them to SASS, not just parses them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
HEADERS = sorted(CSRC.glob("**/*_kernels.cuh"))
# sm_80 (A100), sm_89 (L4 / RTX 40), sm_90a (H100 / H200, with its architecture-specific
# instructions).
ARCHITECTURES = [("compute_80", "sm_80"), ("compute_89", "sm_89"), ("compute_90a", "sm_90a")]
NVCC = shutil.which("nvcc")


def test_there_are_kernel_headers():
    assert HEADERS, "no csrc/**/*_kernels.cuh found"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: str(h.relative_to(CSRC)))
def test_kernels_compile_for_every_architecture(header, tmp_path):
    unit = tmp_path / "check.cu"
    unit.write_text(f'#define FASTLLM_KERNEL_COMPILE_CHECK\n'
                    f'#include "{header.relative_to(CSRC).as_posix()}"\n')
    command = [NVCC, "-std=c++17", "-I", str(CSRC), "-c", str(unit), "-o",
               str(tmp_path / "check.o"), "-Werror", "all-warnings"]
    for virtual, real in ARCHITECTURES:
        command += ["-gencode", f"arch={virtual},code={real}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    nm = shutil.which("nm")
    if nm:  # the instantiations produced kernels, not an empty object
        symbols = subprocess.run([nm, str(tmp_path / "check.o")], capture_output=True,
                                 text=True).stdout
        assert "_kernel" in symbols
