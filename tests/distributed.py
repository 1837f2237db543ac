"""Runs a function on N processes joined in a gloo process group: the harness of the
tensor-parallel tests (``from distributed import run_on_ranks``).

The ranks of a size are started at the first call and kept for the test session (starting them,
each importing torch and fastllm, costs seconds), so every call of that size runs on one group.
Each rank is a process (``torch.multiprocessing``, spawn) with one intra-op thread, so N ranks
fit N cores; the group's rendezvous is a free TCP port on 127.0.0.1. A rank that raises fails the
call with its traceback, one that dies fails it at once, and one that hangs (a collective some
other rank never joins) fails it after ``timeout`` seconds; then the group's ranks are killed and
the next call starts a new group, so no broken group reaches another test and nothing hangs the
tests or outlives them.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastllm.models import TensorParallel

T = TypeVar("T")

__all__ = ["run_on_ranks"]


def run_on_ranks(fn: Callable[..., T], *args: Any, size: int = 2,
                 timeout: float = 120.0) -> list[T]:
    """``[fn(tensor_parallel, *args) on rank r for r in range(size)]``.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function of an importable
    module); ``tensor_parallel`` is the rank's :class:`fastllm.models.TensorParallel` over the
    default (world) group. Results travel back pickled: tensors should be on the CPU.
    """
    group = _groups.get(size)
    if group is None:
        group = _groups[size] = _Group(size)
    try:
        return group.run(fn, args, timeout)
    except BaseException:
        del _groups[size]
        group.stop()
        raise


class _Group:
    def __init__(self, size: int) -> None:
        context = mp.get_context("spawn")
        self.size = size
        self.tasks = [context.Queue() for _ in range(size)]
        self.results = context.Queue()
        # Imported here, not by the module, which every spawned rank imports again.
        from conftest import free_port

        port = free_port()
        self.processes = [context.Process(target=_rank_main, name=f"test-rank-{rank}",
                                          args=(rank, size, port, self.tasks[rank], self.results),
                                          daemon=True)
                          for rank in range(size)]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable[..., T], args: tuple, timeout: float) -> list[T]:
        # The caller's sys.path goes along: a test module's folder, where fn lives, may have
        # joined it after the ranks started.
        task = (timeout, list(sys.path), pickle.dumps((fn, args)))
        for tasks in self.tasks:
            tasks.put(task)
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.size and time.monotonic() < deadline:
            try:
                rank, ok, value = self.results.get(timeout=0.5)
            except queue.Empty:
                if any(process.exitcode is not None for rank, process in
                       enumerate(self.processes) if rank not in outcomes):
                    break  # a rank died without a word (a crash): no use waiting
                continue
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok:
                # The others may wait on it in a collective, or fail for its sake (a closed
                # connection): take what they report in a moment, not more.
                deadline = min(deadline, time.monotonic() + 2.0)
        failures = [f"rank {rank} of {self.size} failed:\n{value}"
                    for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        missing = [rank for rank in range(self.size) if rank not in outcomes]
        failures += [f"rank {rank} of {self.size} died (exit code {code})" for rank in missing
                     if (code := self.processes[rank].exitcode) is not None]
        if failures:
            raise RuntimeError("\n".join(failures))
        if missing:
            raise TimeoutError(f"ranks {missing} gave no result within {timeout} s")
        return [outcomes[rank][1] for rank in range(self.size)]

    def stop(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


_groups: dict[int, _Group] = {}


@atexit.register
def _stop_groups() -> None:
    while _groups:
        _groups.popitem()[1].stop()


def _rank_main(rank: int, size: int, port: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tensor_parallel = None
    try:
        while (task := tasks.get()) is not None:
            timeout, path, payload = task
            sys.path[:] = path
            try:
                if tensor_parallel is None:
                    # The first call's timeout bounds every collective too: a rank left alone
                    # in one raises.
                    dist.init_process_group("gloo", rank=rank, world_size=size,
                                            timeout=timedelta(seconds=timeout))
                    tensor_parallel = TensorParallel(rank, size, dist.group.WORLD.group_name)
                fn, args = pickle.loads(payload)
                # Pickled here, with the tensors' data: a queue would pass shared memory, which
                # this process may free before the caller reads it.
                results.put((rank, True, pickle.dumps(fn(tensor_parallel, *args))))
            except BaseException:  # noqa: BLE001 - reported to the caller, which raises it
                results.put((rank, False, traceback.format_exc()))
    finally:
        if tensor_parallel is not None:
            dist.destroy_process_group()
