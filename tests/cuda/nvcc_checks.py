"""nvcc's compile checks of the CUDA sources (tests/cuda/test_kernels_compile.py), one build
each (``background_builds``: a cold checkout starts them ahead of the tests):

- The torch-free kernel templates (``csrc/**/*_kernels.cuh``) instantiate themselves for every
  storage dtype under ``FASTLLM_KERNEL_COMPILE_CHECK``: all of them as one translation unit,
  compiled to SASS for the oldest and the newest target architecture in
  ``csrc/cuda_architectures.txt``. The device code has no per-architecture branch, and each
  architecture's instruction set holds the older ones' (sm_90a's holds sm_89's, which holds
  sm_80's), so code the oldest and the newest assemble, those between assemble too.
- The host files (``csrc/**/*_cuda.cu``: checks, dispatch, launches, registration) compile
  against the installed torch's headers, which a CPU build of torch ships too: all of them as
  one translation unit (torch's headers, most of a host file's compile time, are read once), to
  PTX for the newest target architecture (the templates already go to SASS).

A compile takes up to a few minutes; a passing one is remembered under
``build/cuda-compile-check``, keyed by everything that can change its outcome (the unit and the
csrc files it includes, the command, nvcc's and torch's versions), so a warm ``make test``
skips it, and so does one after a change to CPU code alone."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch.utils.cpp_extension

import background_builds

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
HOST_FILES_CHECK = "nvcc: the host files"
KERNEL_TEMPLATES_CHECK = "nvcc: the kernel templates"
# Device code unoptimized (NVVM and ptxas at -O0): every line is still parsed, instantiated,
# lowered to PTX and, for the templates, assembled to SASS for each architecture, which is what
# is checked, in far less time; optimizing the code is the real build's job.
UNOPTIMIZED = ["-Xcicc", "-O0", "-Xptxas", "-O0"]


def gencode(arch: str) -> list[str]:
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


def compile_once(source: str, flags: list[str], symbols: list[str]) -> None:
    """nvcc -c of a unit holding ``source``, unless this exact compile already passed; checks
    that the object defines each of ``symbols``."""
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([background_builds.sources_digest([], [CSRC], source),
                                    *flags, version, torch.__version__]).encode()).hexdigest()
    stamp = STAMPS / key
    with background_builds.exclusive(STAMPS / f"{key}.lock"):
        if not stamp.exists():
            _compile(source, flags, symbols, stamp)


def _compile(source: str, flags: list[str], symbols: list[str], stamp: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        unit, obj = Path(folder) / "check.cu", Path(folder) / "check.o"
        unit.write_text(source)
        result = background_builds.run([NVCC, *flags, "-c", str(unit), "-o", str(obj)],
                                       timeout=900)
        assert result.returncode == 0, result.stdout + result.stderr
        nm = shutil.which("nm")
        if nm:  # the instantiations and launches produced kernels, not an empty object
            defined = subprocess.run([nm, "--defined-only", str(obj)], capture_output=True,
                                     text=True).stdout
            missing = [symbol for symbol in symbols if symbol not in defined]
            assert not missing, f"no kernel in the object for {missing}"
    stamp.touch()


def kernel_names(header: Path) -> list[str]:
    """The ``__global__`` functions ``header`` declares (each named ``*_kernel``)."""
    return sorted(set(re.findall(r"__global__[^;{]*?\b(\w+_kernel)\s*\(", header.read_text(),
                                 re.S)))


def check_kernel_templates() -> None:
    """Every kernel template compiles to SASS for the oldest and the newest architecture, and
    each of its kernels is instantiated."""
    source = "#define FASTLLM_KERNEL_COMPILE_CHECK\n" + "".join(
        f'#include "{header.relative_to(CSRC).as_posix()}"\n' for header in HEADERS)
    flags = [*COMMON_FLAGS, *UNOPTIMIZED, "--threads", "0"]  # the architectures in parallel
    for arch in dict.fromkeys([ARCHITECTURES[0], ARCHITECTURES[-1]]):
        flags += gencode(arch)
    compile_once(source, flags, [name for header in HEADERS for name in kernel_names(header)])


def check_host_files() -> None:
    """The host files compile together against torch's headers, to PTX for the newest
    architecture."""
    source = "".join(f'#include "{path.relative_to(CSRC).as_posix()}"\n' for path in HOST_FILES)
    newest = ARCHITECTURES[-1]
    flags = [*COMMON_FLAGS, *UNOPTIMIZED,
             "-gencode", f"arch=compute_{newest},code=compute_{newest}",
             # A CPU torch lacks only the generated c10/cuda export macros (empty on Linux).
             "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
             "-I", sysconfig.get_paths()["include"]]
    for path in torch.utils.cpp_extension.include_paths():
        flags += ["-I", path]
    compile_once(source, flags, ["_kernel"])


def checks() -> dict[str, Callable[[], None]]:
    """Every check by name, the host files first (the longer)."""
    return {HOST_FILES_CHECK: check_host_files, KERNEL_TEMPLATES_CHECK: check_kernel_templates}
