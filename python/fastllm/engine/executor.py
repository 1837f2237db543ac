"""Executors: what runs a :class:`~fastllm.engine.scheduler_output.SchedulerOutput` on the
model's devices and gives back its :class:`~fastllm.engine.scheduler_output.ModelRunnerOutput`.

:class:`UniProcExecutor` runs one :class:`~fastllm.engine.worker.Worker` in this process.
:class:`MultiprocExecutor` shards the model over ``tensor_parallel_size`` ranks, one process per
device, with ``torch.distributed``: this process is rank 0 (the scheduler, tokenizer and server
stay here, and its worker samples), and each other rank runs its shard of every step. A step
reaches the other ranks as one broadcast over a gloo group; the model's own collectives (an
all-reduce after each row-parallel layer, the vocabulary-parallel embedding and LM head) run on
a second group, gloo for CPU tensors and NCCL for CUDA ones, inside the one call each rank makes
per step.

Ranks are started here, forked where that is safe (Linux, no CUDA context in this process yet),
as vLLM starts its workers, so that a plain script runs as written; spawned elsewhere (or with
``FASTLLM_WORKER_MULTIPROC_METHOD=spawn``), which runs the script again in each rank: a script
that would then start ranks again is refused at once, naming the line to put under
``if __name__ == "__main__":``. Or, under ``torchrun`` (its
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` / ``LOCAL_RANK`` set, e.g. across
nodes), every rank runs the caller's script: rank 0 goes on as the driver, and the others serve
rank 0's steps inside the constructor and exit when it shuts down.

A worker that dies or fails ends the executor: the step raises :class:`ExecutorError` (a dead
rank breaks the model's collectives at once, and every collective has a timeout, so nothing
waits for it), the other ranks are stopped and no process is left behind.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import socket
import sys
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fastllm.engine.speculative import SpeculativeConfig
from fastllm.engine.worker import Worker
from fastllm.kv_cache import KVPoolPlan, PagedKVCache
from fastllm.lora.slots import LoRAConfig
from fastllm.models import DecoderLM, TensorParallel
from fastllm.models.pool import load

__all__ = ["Executor", "ExecutorError", "MultiprocExecutor", "ParallelConfig",
           "UniProcExecutor", "make_worker", "start_method"]

logger = logging.getLogger("fastllm")

# The model's collectives: ranks run a step in lockstep, so a wait this long means a rank is
# gone (a dead rank's closed connections usually end the wait at once).
COLLECTIVE_TIMEOUT = timedelta(seconds=20)
# How long the other ranks wait for rank 0's next step: an idle server may wait for days.
_IDLE_TIMEOUT = timedelta(days=365)


class ExecutorError(RuntimeError):
    """The executor's ranks stopped (a worker died or failed): no step can run any more."""


def make_worker(model: DecoderLM, kv_cache: PagedKVCache, *, max_model_len: int,
                max_num_seqs: int, enforce_eager: bool,
                speculative: SpeculativeConfig | None = None, samples: bool = True,
                lora: LoRAConfig | None = None) -> Worker:
    """A worker for ``model`` over ``kv_cache``; on CUDA its decode steps replay CUDA graphs
    unless ``enforce_eager`` (steps with LoRA adapters run eagerly)."""
    decode_graphs = (DecodeGraphs(model, kv_cache, max_batch=max_num_seqs,
                                  max_model_len=max_model_len)
                     if kv_cache.k_cache.device.type == "cuda" and not enforce_eager else None)
    return Worker(model, kv_cache, max_model_len=max_model_len, decode_graphs=decode_graphs,
                  speculative=speculative, samples=samples, lora=lora)


class Executor(ABC):
    """Runs steps; ``worker`` is this process's (the one that samples)."""

    worker: Worker

    @property
    def model(self) -> DecoderLM:
        return self.worker.model

    @property
    def kv_cache(self) -> PagedKVCache:
        """This process's KV cache: its block manager is the scheduler's."""
        return self.worker.kv_cache

    @abstractmethod
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step on every rank; returns what it gave."""

    def shutdown(self) -> None:
        """Stops whatever the executor started (idempotent)."""


class UniProcExecutor(Executor):
    """One worker, in this process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(step)


@dataclass(frozen=True)
class ParallelConfig:
    """What each rank needs to build its worker (sent to started ranks).

    Attributes:
        model: the checkpoint (HF folder or ``.gguf`` file).
        dtype, quantization: as :func:`fastllm.models.pool.load` takes them.
        device_type: "cpu" or "cuda" (rank r uses ``cuda:r``, or ``cuda:LOCAL_RANK`` under
            torchrun).
        tensor_parallel_size: ranks.
        max_num_seqs, enforce_eager: the engine's.
        batch_invariant: every rank runs its steps under :func:`fastllm.ops.batch_invariant`.
        block_size, cache_dtype: each rank's KV cache blocks.
        pre_rope: each rank's KV cache holds keys before RoPE (independent-chunk prompts).
        lora: each rank's LoRA adapter slots, or None without LoRA.
    """

    model: str
    dtype: torch.dtype
    quantization: str | None
    device_type: str
    tensor_parallel_size: int
    max_num_seqs: int
    enforce_eager: bool
    batch_invariant: bool
    block_size: int
    cache_dtype: torch.dtype
    pre_rope: bool = False
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism runs on CPU or CUDA devices, got "
                             f"{self.device_type!r}")
        launched = _torchrun_rank() is not None
        if launched and int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size={size}, but the launcher started "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
        if self.device_type == "cuda" and not launched \
                and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, this "
                             f"machine has {torch.cuda.device_count()}")

    def device(self, rank: int) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        local = os.environ.get("LOCAL_RANK") if _torchrun_rank() is not None else None
        return torch.device("cuda", int(local) if local is not None else rank)


@dataclass
class _Groups:
    model: dist.ProcessGroup  # the model's collectives
    control: dist.ProcessGroup  # gloo: steps broadcast from rank 0


def _torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting its variables) started
    it, else None."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and "WORLD_SIZE" in os.environ else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_groups(config: ParallelConfig, rank: int, init_method: str) -> _Groups:
    if config.device_type == "cuda":
        torch.cuda.set_device(config.device(rank))
    dist.init_process_group("nccl" if config.device_type == "cuda" else "gloo",
                            init_method=init_method, rank=rank,
                            world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return _Groups(dist.group.WORLD, control)


def _rank_worker(config: ParallelConfig, rank: int, model: DecoderLM, max_model_len: int,
                 num_blocks: int, *, enable_prefix_caching: bool = False,
                 speculative: SpeculativeConfig | None = None) -> Worker:
    model.reserve_positions(max_model_len)
    spec = model.kv_cache_spec(config.block_size, config.cache_dtype)
    kv_cache = PagedKVCache(spec, num_blocks, device=config.device(rank),
                            enable_prefix_caching=enable_prefix_caching,
                            pre_rope=config.pre_rope)
    return make_worker(model, kv_cache, max_model_len=max_model_len,
                       max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager,
                       speculative=speculative, samples=rank == 0, lora=config.lora)


def _load_shard(config: ParallelConfig, rank: int, groups: _Groups) -> DecoderLM:
    return load(config.model, config.dtype, config.device(rank), config.quantization,
                tensor_parallel=TensorParallel(rank, config.tensor_parallel_size,
                                               groups.model.group_name))


def _broadcast(value: object, groups: _Groups) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=groups.control)
    return box[0]


def _serve(config: ParallelConfig, rank: int, groups: _Groups) -> None:
    """A rank other than 0: builds its worker, then runs each step rank 0 broadcasts until it
    broadcasts None. A step that raises here raises on rank 0 too (every rank checks the same
    inputs), which runs it again in parts: this rank goes on."""
    model = _load_shard(config, rank, groups)
    max_model_len, num_blocks = _broadcast(None, groups)
    worker = _rank_worker(config, rank, model, max_model_len, num_blocks)
    dist.barrier(group=groups.control)
    while (step := _broadcast(None, groups)) is not None:
        try:
            with torch.inference_mode(), ops.batch_invariant(config.batch_invariant):
                worker.execute_model(step)
        except Exception as error:
            if isinstance(error, dist.DistError):
                raise
            logger.debug("rank %d: the step raised (rank 0 handles it): %s", rank, error)


def start_method(option: str, process: str) -> str:
    """How to start processes that ``option`` asks for (``tensor_parallel_size=2``'s ranks,
    ``data_parallel_size=2``'s replicas; ``process`` names one): forked where that is safe (see
    the module's docstring), else spawned, after checking that the script's rerun in each will
    not start them again."""
    method = os.environ.get("FASTLLM_WORKER_MULTIPROC_METHOD")
    if method is None:
        if not sys.platform.startswith("linux"):
            method, why = "spawn", f"{sys.platform} has no safe fork"
        elif torch.cuda.is_initialized():
            method, why = "spawn", "CUDA is initialized in this process, and a fork cannot use it"
        else:
            return "fork"
    elif method not in ("fork", "spawn"):
        raise ValueError(f"FASTLLM_WORKER_MULTIPROC_METHOD must be fork or spawn, got {method!r}")
    else:
        why = f"FASTLLM_WORKER_MULTIPROC_METHOD={method}"
    unguarded = _unguarded_main_line() if method == "spawn" else None
    if unguarded is not None:
        file, line = unguarded
        raise RuntimeError(
            f"{option} starts its {process}s with spawn here ({why}), which runs {file} again "
            f"in each {process}, and line {line} would start {process}s again: put the code "
            f"that makes the LLM under `if __name__ == \"__main__\":`")
    return method


def _unguarded_main_line() -> tuple[str, int] | None:
    """The running ``__main__`` script and the line of its top-level code, outside ``if
    __name__ == "__main__":``, that is starting the ranks; None when the call comes from
    guarded code, or there is no script file (``python -c``, a notebook)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_code.co_filename == main_file):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    with open(main_file, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    for node in tree.body:
        if isinstance(node, ast.If) and node.lineno <= line <= node.end_lineno and \
                ast.unparse(node.test).replace("'", '"') in ('__name__ == "__main__"',
                                                             '"__main__" == __name__'):
            return None
    return main_file, line


def _rank_main(config: ParallelConfig, rank: int, init_method: str, threads: int,
                  errors: mp.SimpleQueue) -> None:
    """A started rank's process."""
    torch.set_num_threads(threads)
    try:
        _serve(config, rank, _init_groups(config, rank, init_method))
    except BaseException as error:
        errors.put(f"rank {rank}: {type(error).__name__}: {error}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Ranks:
    """What a :class:`MultiprocExecutor` started: its started ranks, its process groups and
    this process's thread count before; :meth:`stop` undoes it (its finalizer: no reference
    back to the executor)."""

    def __init__(self, threads: int) -> None:
        self.processes: list[mp.Process] = []
        self.groups: _Groups | None = None
        self.threads = threads

    def stop(self) -> None:
        """Stops the started ranks (they hold no state worth a goodbye) or, under torchrun,
        tells the others to stop; leaves the process groups and gives this process its
        threads back."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        if self.groups is not None and dist.is_initialized():
            if not self.processes and dist.get_rank() == 0:  # torchrun: they wait for a word
                try:
                    _broadcast(None, self.groups)
                except Exception:  # they are gone already
                    pass
            dist.destroy_process_group()
        # The groups' C++ objects go now: left to the interpreter's exit, gloo's threads may
        # free what they hold after Python can no longer take it back (an abort).
        self.groups = None
        torch.set_num_threads(self.threads)


class MultiprocExecutor(Executor):
    """Tensor parallelism over ``config.tensor_parallel_size`` ranks (see the module's
    docstring). ``plan_cache(model)`` gives, from rank 0's shard, the context length and the
    KV pool every rank holds."""

    def __init__(self, config: ParallelConfig,
                 plan_cache: Callable[[DecoderLM], tuple[int, KVPoolPlan]], *,
                 enable_prefix_caching: bool = True,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.config = config
        self.broadcast_s = 0.0  # rank 0's time sending steps to the other ranks
        self._errors: mp.SimpleQueue | None = None
        self._dead: ExecutorError | None = None
        rank = _torchrun_rank()
        threads = torch.get_num_threads()
        self._ranks = ranks = _Ranks(threads)
        self._finalizer = weakref.finalize(self, ranks.stop)
        if rank is None:
            rank, init_method = 0, f"tcp://127.0.0.1:{_free_port()}"
            context = mp.get_context(start_method(
                f"tensor_parallel_size={config.tensor_parallel_size}", "rank"))
            self._errors = context.SimpleQueue()
            # CPU ranks share this machine's cores.
            share = max(1, threads // config.tensor_parallel_size) \
                if config.device_type == "cpu" else threads
            for other in range(1, config.tensor_parallel_size):
                process = context.Process(
                    target=_rank_main, name=f"fastllm-rank{other}", daemon=True,
                    args=(config, other, init_method, share, self._errors))
                process.start()
                ranks.processes.append(process)
            torch.set_num_threads(share)
        else:
            init_method = "env://"
        try:
            ranks.groups = groups = _init_groups(config, rank, init_method)
            if rank != 0:
                try:
                    _serve(config, rank, groups)
                finally:
                    self._finalizer()
                sys.exit(0)
            model = _load_shard(config, 0, groups)
            max_model_len, plan = plan_cache(model)
            _broadcast((max_model_len, plan.num_blocks), groups)
            self.worker = _rank_worker(config, 0, model, max_model_len, plan.num_blocks,
                                       enable_prefix_caching=enable_prefix_caching,
                                       speculative=speculative)
            dist.barrier(group=groups.control)
        except Exception as error:
            # This rank's own error (every rank checks the same model) says it best; when a
            # collective failed, the rank that stopped says why.
            stopped = self._stopped_rank(wait_s=2.0) if isinstance(error, dist.DistError) \
                else None
            self._finalizer()
            if stopped is not None:
                raise ExecutorError(f"a tensor-parallel rank failed to start: {stopped}") \
                    from error
            raise

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise self._dead
        try:
            started = time.perf_counter()
            # The other ranks run the model only: what sampling reads stays here.
            _broadcast(dataclasses.replace(step, new_requests=[], grammar_bitmask=None,
                                           constrained_request_ids=[]), self._ranks.groups)
            self.broadcast_s += time.perf_counter() - started
            return self.worker.execute_model(step)
        except Exception as error:
            stopped = self._stopped_rank(wait_s=2.0)
            if stopped is None and not isinstance(error, dist.DistError):
                raise  # this step's own error: every rank raised it and goes on
            self._dead = ExecutorError(
                f"tensor parallelism stopped: {stopped or error}; no step can run any more")
            self._finalizer()
            raise self._dead from error

    def _stopped_rank(self, wait_s: float = 0.0) -> str | None:
        """What stopped a started rank (its error, or its exit code), waiting up to ``wait_s``
        for one to show; None while every rank runs."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._errors is not None and not self._errors.empty():
                return self._errors.get()
            dead = [p for p in self._ranks.processes if not p.is_alive()]
            if dead:
                return f"{dead[0].name} exited with code {dead[0].exitcode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = ExecutorError("the executor was shut down")
        self._finalizer()

