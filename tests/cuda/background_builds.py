"""The CUDA tests' slow builds (the simulator, nvcc's compile checks: minutes each on a cold
checkout), started when a session has collected the tests that need them and run one after the
other in a background thread at the lowest CPU priority. The rest of the suite leaves a core
idle much of the time; the builds take that time, and take none from the tests while those run.
A test that needs a build waits for it (and fails with its error); one never started runs where
the test asks for it.

The thread's priority (``nice`` 19) is a Linux thread's own, and the compilers it starts, and
the threads those start, inherit it. The compilers stay in pytest's session: a new one (setsid)
is a new scheduling autogroup on Linux, which shares the CPU equally with pytest's whatever the
nice values."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

Build = Callable[[], object]


class _Job:
    def __init__(self, build: Build) -> None:
        self.build = build
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.build()
        except BaseException as error:  # re-raised in the test that waits for it
            self.error = error
        finally:
            self.done.set()


_lock = threading.Lock()
_jobs: dict[str, _Job] = {}
_running: set[subprocess.Popen] = set()
_stopped = threading.Event()


def start(builds: Sequence[tuple[str, Build]]) -> None:
    """Runs ``builds`` (name, function), in order, in a background thread at nice 19."""
    with _lock:
        queued = [(name, _Job(build)) for name, build in builds if name not in _jobs]
        _jobs.update(queued)
    if not queued:
        return

    def work() -> None:
        if hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for _, job in queued:
            if _stopped.is_set():
                job.error = RuntimeError("background builds stopped with the session")
                job.done.set()
            else:
                job.run()

    # A daemon: stop() ends its compiler at the session's end, so no build outlives pytest.
    threading.Thread(target=work, name="background-builds", daemon=True).start()


def result(name: str, build: Build) -> object:
    """``build()``'s value: the background one's (waited for) if ``name`` was started, else
    ``build()`` run now."""
    with _lock:
        job = _jobs.get(name)
    if job is None:
        return build()
    job.done.wait()
    if job.error is not None:
        raise job.error
    return job.value


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``lock_file`` (created if missing) for the block: one process
    at a time builds a given content (pytest-xdist's workers each start the builds), the others
    wait and then find it built."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def sources_digest(units: Iterable[Path], include_dirs: Sequence[Path], text: str = "") -> str:
    """SHA-256 over the files ``units`` and ``text`` (a unit's own code) include with quotes,
    transitively, and the units themselves: what a build of them reads besides the system's and
    torch's headers, which a build's key takes by version. An include is looked up beside the
    file that includes it and in ``include_dirs``; every file found counts (the one the
    compiler takes among them included), so a CPU kernel's header, which no CUDA unit includes,
    leaves the CUDA builds' keys alone."""
    seen: dict[Path, bytes] = {}
    pending = [(None, name) for name in _QUOTED_INCLUDE.findall(text)]
    pending += [(None, str(unit)) for unit in units]
    while pending:
        includer, name = pending.pop()
        folders = [includer.parent] if includer is not None else []
        for path in [Path(name)] if Path(name).is_absolute() else [
                folder / name for folder in [*folders, *include_dirs]]:
            path = path.resolve()
            if path in seen or not path.is_file():
                continue
            seen[path] = path.read_bytes()
            pending += [(path, found) for found in
                        _QUOTED_INCLUDE.findall(seen[path].decode(errors="replace"))]
    digest = hashlib.sha256(text.encode())
    for path in sorted(seen):
        digest.update(str(path).encode())
        digest.update(seen[path])
    return digest.hexdigest()


def run(command: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)``, ended with the processes
    it starts (nvcc's cicc and ptxas: its process group) by :func:`stop`."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          process_group=0) as process:
        with _lock:
            _running.add(process)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(process)
            raise
        finally:
            with _lock:
                _running.discard(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stop() -> None:
    """Starts no more builds and kills the compilers running (the session is over)."""
    _stopped.set()
    with _lock:
        running = list(_running)
    for process in running:
        _kill(process)


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
