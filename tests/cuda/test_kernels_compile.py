"""The CUDA sources compile with nvcc wherever nvcc is installed, GPU or not: a kernel or host
file that does not compile fails CI on this CPU machine (the checks: ``nvcc_checks.py``)."""

from __future__ import annotations

import pytest

import background_builds
import nvcc_checks
from nvcc_checks import ARCHITECTURES, CSRC, HEADERS, HOST_FILES, NVCC


def test_there_are_cuda_sources_and_architectures():
    assert HEADERS and HOST_FILES, "no csrc/**/*_kernels.cuh or csrc/**/*_cuda.cu found"
    assert {"80", "89", "90a"} <= set(ARCHITECTURES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: str(h.relative_to(CSRC)))
def test_kernels_compile_for_every_architecture(header):
    name = nvcc_checks.header_check_name(header)
    background_builds.result(name, nvcc_checks.checks()[name])


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_host_files_compile_against_torch():
    name = nvcc_checks.HOST_FILES_CHECK
    background_builds.result(name, nvcc_checks.checks()[name])
