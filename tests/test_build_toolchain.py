"""The build refuses a compiler whose C++ library is not the one torch runs with.

fastllm built by a GCC with a libstdc++ of its own and loaded beside the system's can crash the
process in every error message with a number in it: iostreams code compiled into _C reads the
other library's internal data.
CMakeLists.txt compares the two libraries at configure time; here a compiler that reports a
copy of the runtime's library as its own must stop the configure with a message naming both.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CMAKE = shutil.which("cmake")
GXX = shutil.which("g++")


def runtime_libstdcxx() -> Path | None:
    """The libstdc++ this process (which imported torch) runs with."""
    import torch  # noqa: F401

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libstdc++.so" in line}
    return Path(next(iter(paths))) if paths else None


@pytest.mark.skipif(CMAKE is None or GXX is None or not sys.platform.startswith("linux"),
                    reason="needs cmake and g++ on Linux")
def test_configure_refuses_another_libstdcxx(tmp_path):
    runtime = runtime_libstdcxx()
    assert runtime is not None, "torch runs without libstdc++?"
    # A compiler whose own library is another file (the same bytes: only the path matters).
    own = tmp_path / "gcc" / "lib64" / "libstdc++.so"
    own.parent.mkdir(parents=True)
    shutil.copy(runtime, own)
    wrapper = tmp_path / "gcc" / "g++"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = "-print-file-name=libstdc++.so" ] && '
                       f'{{ echo "{own}"; exit 0; }}\nexec "{GXX}" "$@"\n')
    wrapper.chmod(0o755)
    result = subprocess.run(
        [CMAKE, "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DCMAKE_CXX_COMPILER={wrapper}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    message = " ".join(result.stderr.split())
    assert f"builds against {own}" in message, result.stderr
    assert f"but torch runs with {runtime.resolve()}" in message, result.stderr
