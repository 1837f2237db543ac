"""The CUDA sources compile with nvcc wherever nvcc is installed, GPU or not: a kernel or host
file that does not compile fails CI on this CPU machine.

- The torch-free kernel templates (``csrc/**/*_kernels.cuh``) instantiate themselves for every
  storage dtype under ``FASTLLM_KERNEL_COMPILE_CHECK`` and compile to SASS for every target
  architecture in ``csrc/cuda_architectures.txt``.
- The host files (``csrc/**/*_cuda.cu``: checks, dispatch, launches, registration) compile
  against the installed torch's headers, which a CPU build of torch ships too: all of them as
  one translation unit (torch's headers, most of a host file's compile time, are read once: 2
  minutes instead of 10 on two cores), to PTX for the newest target architecture (the templates
  already go to SASS for every one).

A compile takes up to a minute; a passing one is remembered under ``build/cuda-compile-check``,
keyed by everything that can change its outcome (all of csrc, the command, nvcc's and torch's
versions), so a warm ``make test`` skips it."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
STAMPS = ROOT / "build" / "cuda-compile-check"
HEADERS = sorted(CSRC.glob("**/*_kernels.cuh"))
HOST_FILES = sorted(CSRC.glob("**/*_cuda.cu"))
ARCHITECTURES = [line.strip() for line in (CSRC / "cuda_architectures.txt").read_text().splitlines()
                 if line.strip() and not line.startswith("#")]
NVCC = shutil.which("nvcc")
# What torch's own CUDA builds use: constexpr c10 helpers called from device code.
COMMON_FLAGS = ["-std=c++20", "--expt-relaxed-constexpr", "-Werror", "all-warnings", "-I",
                str(CSRC)]


def gencode(arch: str) -> list[str]:
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


def source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(CSRC).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def compile_once(unit: Path, flags: list[str], tmp_path: Path) -> None:
    """nvcc -c unit, unless this exact compile already passed; checks kernels came out."""
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([source_digest(), unit.read_text(), *flags, version,
                                    torch.__version__]).encode()).hexdigest()
    stamp = STAMPS / key
    if stamp.exists():
        return
    obj = tmp_path / "unit.o"
    result = subprocess.run([NVCC, *flags, "-c", str(unit), "-o", str(obj)], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    nm = shutil.which("nm")
    if nm:  # the instantiations and launches produced kernels, not an empty object
        assert "_kernel" in subprocess.run([nm, str(obj)], capture_output=True, text=True).stdout
    STAMPS.mkdir(parents=True, exist_ok=True)
    stamp.touch()


def test_there_are_cuda_sources_and_architectures():
    assert HEADERS and HOST_FILES, "no csrc/**/*_kernels.cuh or csrc/**/*_cuda.cu found"
    assert {"80", "89", "90a"} <= set(ARCHITECTURES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: str(h.relative_to(CSRC)))
def test_kernels_compile_for_every_architecture(header, tmp_path):
    unit = tmp_path / "check.cu"
    unit.write_text(f'#define FASTLLM_KERNEL_COMPILE_CHECK\n'
                    f'#include "{header.relative_to(CSRC).as_posix()}"\n')
    flags = [*COMMON_FLAGS, "--threads", "0"]  # the architectures in parallel, one per core
    for arch in ARCHITECTURES:
        flags += gencode(arch)
    compile_once(unit, flags, tmp_path)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_host_files_compile_against_torch(tmp_path):
    unit = tmp_path / "host_files.cu"
    unit.write_text("".join(f'#include "{path.relative_to(CSRC).as_posix()}"\n'
                            for path in HOST_FILES))
    newest = ARCHITECTURES[-1]
    torch_includes = torch.utils.cpp_extension.include_paths()
    flags = [*COMMON_FLAGS, "-gencode", f"arch=compute_{newest},code=compute_{newest}",
             # A CPU torch lacks only the generated c10/cuda export macros (empty on Linux).
             "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
             "-I", sysconfig.get_paths()["include"]]
    for path in torch_includes:
        flags += ["-I", path]
    compile_once(unit, flags, tmp_path)
