"""Data parallelism: ``data_parallel_size`` replicas of the engine, each in a process of its own
(and each may be tensor-parallel in turn), sharing the work.

- :class:`LLMReplicas`: ``LLM(model, data_parallel_size=N)``'s processes, each holding an
  engine (an :class:`~fastllm.entrypoints.client.EngineClient`, as one ``LLM`` does);
  :func:`assign_prompts` splits a call's prompts between them.
- ``fastllm serve --data-parallel-size N``: N servers behind an HTTP router
  (:mod:`fastllm.entrypoints.openai.data_parallel`).

Both split the machine the same way (:func:`replica_threads`, :func:`replica_cuda_devices`): on
the CPU each replica gets its share of the threads torch would use; on CUDA replica r gets devices
``r * tp`` .. ``r * tp + tp - 1`` of those visible (``CUDA_VISIBLE_DEVICES``), as vLLM places its
data-parallel ranks.
"""

from __future__ import annotations

import heapq
import multiprocessing.connection
import os
import pickle
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from fastllm.engine.executor import start_method
from fastllm.engine.outputs import RequestOutput
from fastllm.entrypoints.client import EngineClient
from fastllm.lora import LoRARequest
from fastllm.sampling import SamplingParams

__all__ = ["LLMReplicas", "ReplicaError", "assign_prompts", "check_data_parallel_size",
           "replica_cuda_devices", "replica_threads"]

# How often an idle replica checks that the process that started it is still there.
_PARENT_POLL_S = 1.0


def check_data_parallel_size(size: Any, name: str = "data_parallel_size") -> int:
    """``size`` when it is an int >= 1, else a ValueError naming ``name``."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name} must be an int >= 1, got {size!r}")
    return size


def replica_threads(data_parallel_size: int) -> int:
    """Each replica's CPU threads: its share of those torch uses in this process (the cores,
    or ``OMP_NUM_THREADS``), at least one; a tensor-parallel replica splits its share again."""
    return max(1, torch.get_num_threads() // data_parallel_size)


def replica_cuda_devices(device: str | torch.device, rank: int, data_parallel_size: int,
                         tensor_parallel_size: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for replica ``rank`` (its ``tensor_parallel_size`` devices), or
    None off CUDA. A ValueError when the machine has too few devices, or when ``device`` names
    one (the replicas cannot all use it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is not None:
        raise ValueError(f"data_parallel_size={data_parallel_size} gives each replica devices "
                         f"of its own: give device='cuda', not {str(device)!r}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = ([d for d in visible.split(",") if d.strip()] if visible is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    needed = data_parallel_size * tensor_parallel_size
    if len(devices) < needed:
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
                         f"{tensor_parallel_size} needs {needed} CUDA devices, this machine "
                         f"has {len(devices)} visible")
    first = rank * tensor_parallel_size
    return ",".join(devices[first:first + tensor_parallel_size])


def assign_prompts(keys: Sequence[Hashable], costs: Sequence[int],
                   data_parallel_size: int) -> list[int]:
    """Each prompt's replica: prompts with the same key (their prefix) go to the same replica,
    so its prefix cache serves them all; groups are placed largest first on the replica with
    the least cost (prompt tokens) so far."""
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    by_cost = sorted(groups.values(), key=lambda members: -sum(costs[i] for i in members))
    loads = [(0, rank) for rank in range(data_parallel_size)]  # (cost so far, rank): a heap
    ranks = [0] * len(keys)
    for members in by_cost:
        load, rank = heapq.heappop(loads)
        for index in members:
            ranks[index] = rank
        heapq.heappush(loads, (load + sum(costs[i] for i in members), rank))
    return ranks


def _send(connection: multiprocessing.connection.Connection, kind: str, value: Any) -> None:
    """Sends ``(kind, value)``; an error that does not pickle goes as a RuntimeError with its
    text."""
    try:
        connection.send((kind, value))
    except (pickle.PicklingError, TypeError, AttributeError):
        if not isinstance(value, BaseException):
            raise
        connection.send((kind, RuntimeError(f"{type(value).__name__}: {value}")))


def _replica_main(rank: int, model: Any, llm_kwargs: dict[str, Any], threads: int,
                  cuda_devices: str | None, parent_pid: int,
                  connection: multiprocessing.connection.Connection) -> None:
    """A replica's process: builds its engine client from ``LLM``'s arguments, then answers
    jobs until told to stop (None) or until the process that started it is gone.

    A job is checked first, then run only when every replica's share checked: ``("check",
    prompts, params, loras)`` is answered ``("checked", None)`` or ``("error", error)``, then
    ``"run"`` (answered by ``("progress", n)`` messages and ``("done", outputs)``) or
    ``"drop"``."""
    if cuda_devices is not None:  # before anything touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    torch.set_num_threads(threads)
    try:
        client = EngineClient(model, **llm_kwargs)
    except BaseException as error:
        _send(connection, "error", error)
        return
    connection.send(("ready", client.max_model_len))

    def next_message() -> Any:
        while not connection.poll(_PARENT_POLL_S):
            if os.getppid() != parent_pid:
                return None
        try:
            return connection.recv()
        except EOFError:
            return None

    try:
        while (job := next_message()) is not None:
            _, prompts, params, loras = job
            try:
                requests = client.make_requests(prompts, params, loras)
            except Exception as error:
                _send(connection, "error", error)
                continue
            connection.send(("checked", None))
            if next_message() != "run":
                continue
            try:
                states = client.follow(requests)
                client.run(requests, lambda n: connection.send(("progress", n)))
                connection.send(("done", [state.output() for state in states]))
            except Exception as error:
                _send(connection, "error", error)
    finally:
        client.shutdown()


class ReplicaError(RuntimeError):
    """A data-parallel replica's process exited; the replicas are stopped."""


class LLMReplicas:
    """``data_parallel_size`` processes, each holding the engine ``LLM(model, **llm_kwargs)``
    would (started as the tensor-parallel ranks are: forked where safe, else spawned), sharing
    each call's prompts. A replica that fails to start raises its error here. :meth:`shutdown` (or dropping
    the object) stops them; a replica also stops when the process that started it is gone."""

    def __init__(self, model: Any, data_parallel_size: int, llm_kwargs: Mapping[str, Any]
                 ) -> None:
        size = check_data_parallel_size(data_parallel_size)
        device = llm_kwargs.get("device", "cpu")
        tensor_parallel_size = llm_kwargs.get("tensor_parallel_size", 1)
        devices = [replica_cuda_devices(device, rank, size, tensor_parallel_size)
                   for rank in range(size)]
        context = mp.get_context(start_method(f"data_parallel_size={size}", "replica"))
        self.size = size
        self._processes: list[mp.Process] = []
        self._connections: list[multiprocessing.connection.Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._connections)
        threads = replica_threads(size)
        try:
            for rank in range(size):
                parent_end, child_end = context.Pipe()
                # Not a daemon: a tensor-parallel replica starts processes of its own.
                process = context.Process(
                    target=_replica_main, name=f"fastllm-dp{rank}", daemon=False,
                    args=(rank, model, dict(llm_kwargs), threads, devices[rank], os.getpid(),
                          child_end))
                process.start()
                child_end.close()
                self._processes.append(process)
                self._connections.append(parent_end)
            ready = [self._receive(rank) for rank in range(size)]
        except BaseException:
            self._finalizer()
            raise
        errors = [(rank, value) for rank, (kind, value) in enumerate(ready) if kind == "error"]
        if errors:
            self._finalizer()
            raise errors[0][1]
        self.max_model_len: int = ready[0][1]

    def _receive(self, rank: int) -> tuple[str, Any]:
        """Replica ``rank``'s next message; a ReplicaError (and every replica stopped) when it
        exited instead."""
        connection, process = self._connections[rank], self._processes[rank]
        multiprocessing.connection.wait([connection, process.sentinel])
        if connection.poll():
            try:
                return connection.recv()
            except EOFError:
                pass
        process.join(timeout=5)
        self._finalizer()
        raise ReplicaError(f"data-parallel replica {rank} exited with code {process.exitcode}; "
                           "the replicas are stopped")

    def generate(self, ranks: Sequence[int], prompts: Sequence[Any],
                 params: Sequence[SamplingParams | None], loras: Sequence[LoRARequest | None],
                 on_progress: Callable[[int], None]) -> list[RequestOutput]:
        """Generates prompt i on replica ``ranks[i]``; returns the outputs in the prompts'
        order. Every replica checks its share first, and nothing runs unless all pass (the
        first error raises). ``on_progress(n)`` hears of each newly finished count."""
        if not self._finalizer.alive:
            raise ReplicaError("the data-parallel replicas are stopped")
        shares = {rank: [i for i, r in enumerate(ranks) if r == rank] for rank in set(ranks)}
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        errors: list[BaseException] = []  # the replicas' own, raised once all are between jobs
        try:
            for rank, share in shares.items():
                self._connections[rank].send(
                    ("check", [prompts[i] for i in share],
                     [params[i] or SamplingParams() for i in share], [loras[i] for i in share]))
            answers = {rank: self._receive(rank) for rank in shares}
            errors += [value for kind, value in answers.values() if kind == "error"]
            for rank, (kind, _) in answers.items():
                if kind == "checked":
                    self._connections[rank].send("drop" if errors else "run")
            pending = set() if errors else set(shares)
            while pending:
                owners = {self._connections[rank]: rank for rank in pending}
                owners.update({self._processes[rank].sentinel: rank for rank in pending})
                for ready in multiprocessing.connection.wait(list(owners)):
                    rank = owners[ready]
                    if rank not in pending:
                        continue  # its connection and its sentinel both woke
                    kind, value = self._receive(rank)
                    if kind == "progress":
                        on_progress(value)
                    elif kind == "error":
                        errors.append(value)
                        pending.discard(rank)
                    else:
                        for index, output in zip(shares[rank], value):
                            outputs[index] = output
                        pending.discard(rank)
        except ReplicaError:
            raise
        except BaseException:
            # An interrupt, or a message that would not go: the replicas are out of step with
            # this call, and none can take another job.
            self._finalizer()
            raise
        if errors:
            raise errors[0]
        return outputs

    def shutdown(self) -> None:
        """Stops the replicas (idempotent)."""
        self._finalizer()


def _stop(processes: list[mp.Process],
          connections: list[multiprocessing.connection.Connection]) -> None:
    """Asks each replica to stop, then ends those that do not within seconds."""
    for connection in connections:
        try:
            connection.send(None)
        except (OSError, ValueError):  # gone already
            pass
    deadline = time.monotonic() + 10
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    for connection in connections:
        connection.close()
