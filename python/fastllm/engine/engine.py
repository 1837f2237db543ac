"""The engine: continuous batching over a paged KV cache with prefix caching and chunked prefill.

Each :meth:`Engine.step` asks the :class:`~fastllm.engine.scheduler.Scheduler` (the one owner of
KV state and the one writer of requests) for a
:class:`~fastllm.engine.scheduler_output.SchedulerOutput`, has an
:class:`~fastllm.engine.executor.Executor` run it (the model, then sampling, draft acceptance
and the next drafts, on one process or on tensor-parallel ranks) and hands the scheduler the
step's :class:`~fastllm.engine.scheduler_output.ModelRunnerOutput`. A preempted request's random
stream is keyed by its own seed and token count, so its output does not change when it is
recomputed.

With ``speculative`` set (:mod:`fastllm.engine.speculative`), a decoding request's step also
verifies the tokens drafted for it: they are sampled row by row as plain decode steps would
sample them, the leading ones that match are kept, and the scheduler drops the rest's KV.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastllm import ops
from fastllm.engine.executor import Executor, ExecutorError
from fastllm.engine.outputs import spec_acceptance_rate, spec_mean_accepted_length
from fastllm.engine.request import Request
from fastllm.engine.scheduler import Scheduler, SchedulerConfig
from fastllm.engine.scheduler_output import (ModelRunnerOutput, SchedulerOutput,
                                             request_error)
from fastllm.engine.speculative import SpeculativeConfig
from fastllm.engine.structured_output import GrammarCompiler
from fastllm.engine.kv_events import KVEventPublisher, KVEventsConfig
from fastllm.kv_cache import ChunkIndex
from fastllm.lora.slots import LoRAConfig
from fastllm.models.pool import resolve_dtype
from fastllm.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineStats"]


@dataclass
class EngineConfig:
    """Scheduling limits and the KV cache's dtype.

    Attributes:
        max_num_seqs: most requests in a step's batch.
        max_num_batched_tokens: most tokens (decode tokens plus prefill chunks) in a step.
        max_prefill_chunk: most prompt tokens one request prefills in a step; None = as many
            as the token budget leaves.
        enforce_eager: on CUDA, run decode steps op by op instead of replaying CUDA graphs
            (:mod:`fastllm.engine.decode_graphs`); other devices always run eagerly.
        kv_cache_dtype: what the KV cache stores, as vLLM's option: "auto" (the model's
            dtype), or "float32", "bfloat16", "float16" (or a torch dtype). A float32 model may
            keep K/V in bfloat16 or float16, half the memory and half the bytes decode
            attention reads (as llama.cpp's default F16 cache); K/V are rounded once as they
            are cached and attention always reads them back from the cache, so whether a
            sequence's keys came from this step or an earlier one (chunked prefill, prefix
            hits, preemption) moves its result no more than rounding noise. Not on CUDA, whose
            cache is in the model's dtype.
        batch_invariant: run every step under :func:`fastllm.ops.batch_invariant`: each
            request's arithmetic does not depend on the others in its steps, on how its prompt
            was chunked or on a preemption, so a seeded request gives the same tokens alone or
            in any batch, in every dtype (without it that holds in float32 decode batches, not
            across prefill and decode or in 16 bits). Costs prefill speed (no GEMM); CPU only.
        speculative: speculative decoding, a :class:`~fastllm.engine.speculative.
            SpeculativeConfig` or a dict of its fields, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4}`` or ``{"method": "draft", "model": PATH}``; None
            (default) drafts nothing. Tokens are the same with it as without.
        lora: serve LoRA adapters (:class:`fastllm.lora.LoRAConfig`: how many in a step, their
            largest rank, how many kept loaded); None (default): the base model alone.
        kv_events: publish the prefix cache's changes for routers
            (:class:`~fastllm.engine.kv_events.KVEventsConfig` or a dict of its fields, vLLM's
            ``--kv-events-config``); None (default): none.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    enforce_eager: bool = False
    kv_cache_dtype: str | torch.dtype = "auto"
    batch_invariant: bool = False
    speculative: SpeculativeConfig | Mapping[str, Any] | None = None
    lora: LoRAConfig | None = None
    kv_events: KVEventsConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self.kv_events = KVEventsConfig.of(self.kv_events)
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise TypeError(f"lora must be a LoRAConfig or None, got {self.lora!r}")
        self.speculative = SpeculativeConfig.of(self.speculative)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_prefill_chunk is not None and (
                not isinstance(self.max_prefill_chunk, int) or self.max_prefill_chunk < 1):
            raise ValueError(f"max_prefill_chunk must be None or an int >= 1, got "
                             f"{self.max_prefill_chunk!r}")
        for name in ("enforce_eager", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.cache_dtype(torch.float32)  # a bad name fails here, before anything is loaded

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype for a model whose activations are ``model_dtype``."""
        if isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype == "auto":
            return model_dtype
        try:
            return resolve_dtype(self.kv_cache_dtype)
        except ValueError:
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or "
                             f"'float16', got {self.kv_cache_dtype!r}") from None


@dataclass
class EngineStats:
    """Counters since the engine started."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    peak_kv_usage: float = 0.0  # the largest fraction of KV blocks held by running requests
    step_s: float = 0.0  # wall time in step()
    prefix_cache_hits: int = 0  # prompt blocks reused (the block manager's counters)
    prefix_cache_queries: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_verify_steps: int = 0  # request-steps that verified drafts
    propose_s: float = 0.0  # of step_s: drafting

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafted ones, all requests (None before any draft)."""
        return spec_acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step gave a request on average, its own included (None
        before any)."""
        return spec_mean_accepted_length(self.num_accepted_tokens, self.num_verify_steps)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0


class Engine:
    """Runs many requests at once on one model (one process's, or sharded by ``executor``)
    and one paged KV cache. Not thread-safe: one caller at a time (``fastllm.LLM`` and
    ``fastllm.AsyncLLM`` hold a lock around it)."""

    def __init__(self, executor: Executor, tokenizer: Tokenizer, config: EngineConfig,
                 max_model_len: int, chunk_index: ChunkIndex | None = None) -> None:
        model, kv_cache = executor.model, executor.kv_cache
        self.executor, self.tokenizer = executor, tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.device = kv_cache.k_cache.device
        # The model's spec for the configured dtype: a pairing the ops refuse fails here.
        cache_dtype = model.kv_cache_spec(kv_cache.spec.block_size,
                                          config.cache_dtype(model.dtype)).dtype
        if kv_cache.spec.dtype != cache_dtype:
            raise ValueError(f"the KV cache stores {kv_cache.spec.dtype} but kv_cache_dtype="
                             f"{config.kv_cache_dtype!r} asks for {cache_dtype} (model: "
                             f"{model.dtype})")
        if self.device.type == "cuda" and cache_dtype != model.dtype:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r}: on CUDA the KV cache "
                             f"must be in the model's dtype ({model.dtype}); paged attention's "
                             f"CUDA kernels read no other")
        if self.device.type == "cuda" and config.batch_invariant:
            raise ValueError("batch_invariant=True: only the CPU kernels have a batch-invariant "
                             "mode")
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            kv_cache, SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                      max_num_batched_tokens=config.max_num_batched_tokens,
                                      max_prefill_chunk=config.max_prefill_chunk,
                                      max_loras=None if config.lora is None
                                      else config.lora.max_loras),
            max_model_len, chunk_index)
        self._grammars: GrammarCompiler | None = None  # built for the first constrained request
        events = config.kv_events
        self.kv_events: KVEventPublisher | None = None
        if events is not None and events.enable_kv_cache_events:
            self.scheduler.record_cache_events()
            self.kv_events = KVEventPublisher(events, kv_cache.spec.block_size)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request; a prompt that cannot fit the context or the KV pool is a
        ValueError for this request alone, as is a structured output constraint that does
        not compile."""
        grammar = None
        if request.params.structured_outputs is not None and request.score_token_ids is None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            grammar = self._grammars.matcher(request.params.structured_outputs)
        self.scheduler.add_request(request, grammar)

    def abort_request(self, request: Request) -> None:
        """Ends a request now ("abort"): its KV blocks are freed at once."""
        self.scheduler.abort_request(request)
        self._release_finished()

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the LoRA adapters of the running requests, and of the waiting ones
        (those not running too)."""
        running = {r.lora_request.lora_name for r in list(self.scheduler.running)
                   if r.lora_request is not None}
        waiting = {r.lora_request.lora_name for r in list(self.scheduler.waiting)
                   if r.lora_request is not None}
        return sorted(running), sorted(waiting - running)

    def reset_prefix_cache(self) -> int:
        """Drops every cached prefix block no request holds; returns how many."""
        dropped = self.scheduler.reset_prefix_cache()
        self._publish_cache_events()
        return dropped

    def _publish_cache_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_cache_events())

    def remove_lora(self, lora_int_id: int) -> None:
        """Has the workers forget a LoRA adapter (unloaded by its server) from the next
        step."""
        self.scheduler.remove_lora(lora_int_id)

    def fail_request(self, request: Request, error: Exception) -> None:
        """Ends a request that cannot go on (finish_reason "error", ``error`` kept on it): its
        KV blocks are freed at once."""
        self.scheduler.fail_request(request, error)
        self._release_finished()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for their first (or, after a preemption, next) schedule."""
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """The fraction of KV blocks held by requests now."""
        return self.scheduler.usage

    def shutdown(self) -> None:
        """Stops the executor's ranks and closes the KV-event sockets; the engine runs no
        step after."""
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Schedules and runs one step; returns the requests that got a token or finished
        (their text is the output processor's to make; finished ones have left the
        engine).

        A request that fails in the step fails alone (:meth:`fail_request`): when the model
        step raises, each request's share is run again alone; when sampling raises, each row is
        sampled alone. The others go on as if it had not been there. When the executor's ranks
        stop (:class:`~fastllm.engine.executor.ExecutorError`), every request fails with its
        error, which the step raises."""
        started = time.perf_counter()
        step = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        if step is None:
            return []
        step.started = started
        updated: list[Request] = []
        with torch.inference_mode(), ops.batch_invariant(self.config.batch_invariant):
            parts = self._execute(step, updated)
        for part, output in parts:
            updated += self.scheduler.update_from_output(part, output)
            self.stats.propose_s += output.propose_s
        self.stats.steps += 1
        self.stats.scheduled_tokens += step.num_tokens
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.scheduler.usage)
        for name in ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps"):
            setattr(self.stats, name, getattr(self.scheduler, name))
        counters = self.scheduler.prefix_cache_counters()
        self.stats.prefix_cache_hits = counters["hits"]
        self.stats.prefix_cache_queries = counters["queries"]
        self._release_finished()
        self._publish_cache_events()
        self.stats.step_s += time.perf_counter() - started
        return list(dict.fromkeys(updated))

    def _execute(self, step: SchedulerOutput, failed: list[Request]
                 ) -> list[tuple[SchedulerOutput, ModelRunnerOutput]]:
        """The step run: whole or, when it raises, each request's share run alone (nothing was
        marked computed yet, so a share runs again as it was), the ones that raise again
        failed (added to ``failed``)."""
        try:
            return [(step, self.executor.execute_model(step))]
        except ExecutorError as error:
            self._fail_all(error)
            raise
        except Exception as error:  # not KeyboardInterrupt: that ends the caller's requests
            parts = self.scheduler.split(step)
            if len(parts) == 1:
                self._fail(parts[0][0], error, failed)
                return []
        done = []
        for request, part in parts:
            try:
                done.append((part, self.executor.execute_model(part)))
            except ExecutorError as error:
                self._fail_all(error)
                raise
            except Exception as error:
                self._fail(request, error, failed)
        return done

    def _fail(self, request: Request, error: Exception, failed: list[Request]) -> None:
        self.scheduler.fail_request(request, request_error(
            "the model step failed on this request", error))
        failed.append(request)

    def _fail_all(self, error: ExecutorError) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.fail_request(request, error)

    def _release_finished(self) -> None:
        """Once the engine is idle, tells the workers at once which requests left and which
        chunk encodings to forget (while it runs, the next step tells them)."""
        if not self.scheduler.has_unfinished():
            step = self.scheduler.idle_step()
            if step is not None:
                try:
                    self.executor.execute_model(step)
                except ExecutorError:
                    pass  # nothing is kept on ranks that stopped
