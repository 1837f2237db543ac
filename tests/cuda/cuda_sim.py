"""Builds and loads the CUDA simulator (``tests/cuda/sim``): the CUDA host files and kernel
templates of ``csrc`` compiled by the host C++ compiler, with the simulator's headers in front of
the CUDA and c10/cuda ones, into a library whose ops ``torch.ops.fastllm_sim.<op>`` run the CUDA
code paths on CPU tensors.

This runs every CUDA kernel on machines without a GPU (CI here): its indexing, tiling, masking,
key splits, pipelines and barriers, checked against the same references as the CPU kernels. What
it cannot check is the hardware: timing, registers, and the PTX instructions, which it does as the
PTX ISA describes them (``sim/include/common/cuda_ptx.cuh``).

The library is built once per content (the units and the csrc and simulator files they include,
the flags, compiler and torch versions) under ``build/cuda-sim/<key>``, replacing the build of
any older content; a warm run loads it."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

import torch
import torch.utils.cpp_extension

import background_builds

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SIM = Path(__file__).resolve().parent / "sim"
BUILDS = ROOT / "build" / "cuda-sim"

# The host files and what they call from the rest of csrc (checks, the composite fallbacks).
UNITS = [
    *sorted(CSRC.glob("**/*_cuda.cu")),
    *sorted(CSRC.glob("**/*_checks.cpp")),
    *sorted(CSRC.glob("**/*_composite.cpp")),
    CSRC / "common" / "thread_flags.cpp",
    SIM / "cuda_sim.cpp",
]


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's headers (cuda_fp16.h and friends): beside nvcc, or under CUDA_HOME."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_fp16.h").is_file()), None)


# What every unit starts with: the simulator's device side and op registration (force-included,
# in this order, ahead of the CUDA and torch headers), then torch's headers, most of a unit's
# compile time. Compiled once per build as a precompiled header.
PRELUDE = [SIM / "include" / "cuda_sim.h", SIM / "include" / "cuda_sim_torch.h", "ATen/ATen.h"]


def _flags(cuda_include: Path) -> list[str]:
    # -O1: a cold checkout's sim tests wait for this build, and -O2 would make it much longer
    # for little speed in the tests.
    flags = ["-std=c++20", "-O1", "-fPIC", "-g0", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas",
             # The kernels pun types as CUDA code does (a __half2 read as one uint32).
             "-fno-strict-aliasing",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             # The simulator's headers shadow csrc/common's PTX and launch headers and c10/cuda's.
             "-I", str(SIM / "include"), "-I", str(CSRC)]
    for path in torch.utils.cpp_extension.include_paths():
        flags += ["-I", path]
    return [*flags, "-I", sysconfig.get_paths()["include"], "-I", str(cuda_include)]


def _key(compiler: str, flags: list[str]) -> str:
    sources = background_builds.sources_digest(
        [*UNITS, *(header for header in PRELUDE if isinstance(header, Path))],
        [SIM / "include", CSRC])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256("\n".join([sources, *flags, version, torch.__version__])
                          .encode()).hexdigest()[:24]


SIMULATOR_BUILD = "the CUDA simulator"


def build() -> Path:
    """The simulator library, compiled if this content has not been yet."""
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        raise FileNotFoundError("CUDA headers (cuda_fp16.h) not found: no nvcc, CUDA_HOME or "
                                "/usr/local/cuda")
    compiler = os.environ.get("CXX", "g++")
    flags = _flags(cuda_include)
    out = BUILDS / _key(compiler, [*flags, *map(str, PRELUDE)])
    library = out / "libfastllm_cuda_sim.so"
    with background_builds.exclusive(BUILDS / f"{out.name}.lock"):
        if not library.exists():
            _compile(compiler, flags, out, library)
    return library


def _compile(compiler: str, flags: list[str], out: Path, library: Path) -> None:
    # Objects go to this build's own folder: an interrupted build of the same content never
    # leaves half-written objects for this one to link.
    work = out / f"build-{os.getpid()}-{threading.get_ident()}"
    work.mkdir(parents=True, exist_ok=True)
    prelude = work / "prelude.h"  # the compiler takes prelude.h.gch beside it in its place
    prelude.write_text("".join(f'#include "{header}"\n' if isinstance(header, Path)
                               else f"#include <{header}>\n" for header in PRELUDE))
    result = background_builds.run([compiler, *flags, "-x", "c++-header", str(prelude), "-o",
                                    f"{prelude}.gch"])
    if result.returncode != 0:
        raise RuntimeError(f"cuda sim: compiling the prelude failed:\n{result.stderr[-20000:]}")

    def compile_unit(unit: Path) -> Path:
        obj = work / (str(unit.relative_to(ROOT)).replace("/", "_") + ".o")
        result = background_builds.run([compiler, *flags, "-Winvalid-pch", "-include",
                                        str(prelude), "-x", "c++", "-c", str(unit), "-o",
                                        str(obj)])
        if result.returncode != 0:
            raise RuntimeError(f"cuda sim: compiling {unit} failed:\n{result.stderr[-20000:]}")
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_unit, UNITS))
    torch_lib = Path(torch.__file__).parent / "lib"
    partial = work / "partial.so"
    result = background_builds.run(
        [compiler, "-shared", "-o", str(partial), *map(str, objects), f"-L{torch_lib}",
         f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-Wl,--no-undefined"])
    if result.returncode != 0:
        raise RuntimeError(f"cuda sim: linking failed:\n{result.stderr[-20000:]}")
    partial.rename(library)  # only a complete library carries the final name
    for stale in BUILDS.iterdir():  # one build is kept: older contents are never loaded again
        if stale.name not in (out.name, f"{out.name}.lock"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)


def load():
    """``torch.ops.fastllm_sim``, the simulator's ops (built first if needed)."""
    import fastllm  # noqa: F401  (the fastllm::* schemas the simulator's ops copy)

    torch.ops.load_library(str(background_builds.result(SIMULATOR_BUILD, build)))
    return torch.ops.fastllm_sim


if __name__ == "__main__":
    print(build())
