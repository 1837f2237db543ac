"""The CUDA sources compile with nvcc wherever nvcc is installed, GPU or not: a kernel or host
file that does not compile fails CI on this CPU machine (the checks: ``nvcc_checks.py``); under
``CI=true`` a missing nvcc fails them too."""

from __future__ import annotations

import pytest

import background_builds
import nvcc_checks
from conftest import missing
from nvcc_checks import ARCHITECTURES, CSRC, HEADERS, HOST_FILES, NVCC


@pytest.fixture
def nvcc() -> str:
    if NVCC is None:
        missing("nvcc not found: the CUDA sources' compile checks cannot run")
    return NVCC


def test_there_are_cuda_sources_and_architectures():
    assert HEADERS and HOST_FILES, "no csrc/**/*_kernels.cuh or csrc/**/*_cuda.cu found"
    assert {"80", "89", "90a"} <= set(ARCHITECTURES)


@pytest.mark.usefixtures("nvcc")
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: str(h.relative_to(CSRC)))
def test_kernels_compile_for_every_architecture(header):
    name = nvcc_checks.header_check_name(header)
    background_builds.result(name, nvcc_checks.checks()[name])


@pytest.mark.usefixtures("nvcc")
def test_host_files_compile_against_torch():
    name = nvcc_checks.HOST_FILES_CHECK
    background_builds.result(name, nvcc_checks.checks()[name])
