"""Runs a function on N processes joined in a gloo process group: the harness of the
tensor-parallel tests (``from distributed import run_on_ranks``).

Each rank is a fresh process (``torch.multiprocessing``, spawn) with one intra-op thread, so N
ranks fit N cores; the group's rendezvous is a free TCP port on 127.0.0.1. A rank that raises
fails the call with its traceback, one that dies fails it at once, and one that hangs (a
collective some other rank never joins) fails it after ``timeout`` seconds; the ranks left are
killed, so nothing hangs the tests or outlives them.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
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
    default (world) group, initialized before ``fn`` runs and destroyed after. Results travel
    back pickled: tensors should be on the CPU.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(rank, size, port, timeout, fn, args,
                                                          results), daemon=True)
                 for rank in range(size)]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                if any(process.exitcode not in (None, 0) for rank, process in
                       enumerate(processes) if rank not in outcomes):
                    break  # a rank died without a word (a crash): no use waiting
                continue
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok:
                # The others may wait on it in a collective, or fail for its sake (a closed
                # connection): take what they report in a moment, not more.
                deadline = min(deadline, time.monotonic() + 2.0)
        missing = {rank: processes[rank].exitcode for rank in range(size) if rank not in outcomes}
    finally:
        for process in processes:
            process.join(timeout=0 if len(outcomes) < size else 10)
            if process.is_alive():
                process.kill()
                process.join()
    failures = [f"rank {rank} of {size} failed:\n{value}"
                for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    failures += [f"rank {rank} of {size} died (exit code {code})"
                 for rank, code in missing.items() if code not in (None, 0)]
    if failures:
        raise RuntimeError("\n".join(failures))
    if missing:
        raise TimeoutError(f"ranks {sorted(missing)} gave no result within {timeout} s")
    return [outcomes[rank][1] for rank in range(size)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, timeout: float, fn: Callable[..., Any],
               args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # The timeout bounds every collective too: a rank left alone in one raises.
        dist.init_process_group("gloo", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout))
        try:
            tensor_parallel = TensorParallel(rank, size, dist.group.WORLD.group_name)
            # Pickled here, with the tensors' data: a queue would pass shared memory, which
            # this process takes with it when it exits.
            results.put((rank, True, pickle.dumps(fn(tensor_parallel, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
