"""The CUDA sources compile with nvcc wherever nvcc is installed, GPU or not: a kernel or host
file that does not compile fails CI on this CPU machine (the checks: ``nvcc_checks.py``); under
``CI=true`` a missing nvcc fails them too."""

from __future__ import annotations

import pytest

import background_builds
import nvcc_checks
from conftest import missing
from nvcc_checks import ARCHITECTURES, HEADERS, HOST_FILES, NVCC


@pytest.fixture
def nvcc() -> str:
    if NVCC is None:
        missing("nvcc not found: the CUDA sources' compile checks cannot run")
    return NVCC


def test_there_are_cuda_sources_and_architectures():
    assert HEADERS and HOST_FILES, "no csrc/**/*_kernels.cuh or csrc/**/*_cuda.cu found"
    assert {"80", "89", "90a"} <= set(ARCHITECTURES)


def test_every_kernel_template_names_its_kernels():
    for header in HEADERS:
        assert nvcc_checks.kernel_names(header), f"{header} declares no __global__ *_kernel"


@pytest.mark.usefixtures("nvcc")
def test_kernel_templates_compile():
    """To SASS for the oldest and the newest architecture, each kernel instantiated."""
    name = nvcc_checks.KERNEL_TEMPLATES_CHECK
    background_builds.result(name, nvcc_checks.checks()[name])


@pytest.mark.usefixtures("nvcc")
def test_host_files_compile_against_torch():
    name = nvcc_checks.HOST_FILES_CHECK
    background_builds.result(name, nvcc_checks.checks()[name])


def test_a_build_is_keyed_by_the_files_its_units_include(tmp_path):
    """The CUDA builds (these checks, the simulator) are made again when a file their units
    include changes, however deep, and not for a file they do not include (a CPU kernel's)."""
    include = tmp_path / "include"
    (include / "sub").mkdir(parents=True)
    unit = tmp_path / "unit.cu"
    unit.write_text('#include "sub/first.h"\n')
    (include / "sub" / "first.h").write_text('#include "second.h"\n')  # found beside first.h
    second = include / "sub" / "second.h"
    second.write_text("int second;\n")
    other = include / "other.h"
    other.write_text("int other;\n")

    def keys() -> tuple[str, str]:
        return (background_builds.sources_digest([unit], [include]),
                background_builds.sources_digest([], [include], '#include "sub/first.h"\n'))

    before = keys()
    other.write_text("int other = 1;\n")
    assert keys() == before
    second.write_text("int second = 1;\n")
    assert all(a != b for a, b in zip(keys(), before))
    changed = keys()
    unit.write_text('#include "sub/first.h"\nint unit;\n')
    assert keys()[0] != changed[0]
