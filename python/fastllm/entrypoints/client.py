"""The engine client every entry point shares: one model, tokenizer, KV cache and engine, the
prompts turned into requests, and the lock that lets several threads step one engine.

``LLM``, ``AsyncLLM`` and ``Reranker`` each hold an :class:`EngineClient` and go through its
methods; none reaches into another's state.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch

from fastllm.engine import Engine, EngineConfig
from fastllm.engine.chunked_prompt import ChunkedPrompt
from fastllm.engine.executor import (Executor, MultiprocExecutor, ParallelConfig,
                                     UniProcExecutor, make_worker)
from fastllm.engine.output_processor import OutputProcessor, RequestState
from fastllm.engine.request import Request
from fastllm.gc_pause import collector_paused
from fastllm.gguf_file import GGUFFileReader
from fastllm.hub import resolve_model, resolve_tokenizer
from fastllm.kv_cache import (ChunkIndex, KVPoolPlan, PagedKVCache, default_kv_cache_memory,
                              plan_pool)
from fastllm.lora import LoRARequest, load_adapter
from fastllm.lora.slots import LoRAConfig
from fastllm.models import DecoderLM
from fastllm.models.decoder import DEFAULT_ROPE_POSITIONS
from fastllm.models.pool import load, resolve_dtype
from fastllm.models.tensor_parallel import ShardLayout
from fastllm.sampling import SamplingParams
from fastllm.tokenizer import Tokenizer
from fastllm.tokenizer.token_ids import as_token_ids

__all__ = ["EngineClient", "PromptType", "chat_prompt", "is_one_prompt", "per_prompt"]

# A prompt: text, token ids (a list, or a 1-D integer tensor or array), vLLM's {"prompt": text} /
# {"prompt_token_ids": ids}, or a prompt of independent chunks.
PromptType = Union[str, Sequence[int], Mapping[str, Any], ChunkedPrompt]

# Cap on the default context: the RoPE table's length at load, so it need not grow.
_DEFAULT_MAX_MODEL_LEN = DEFAULT_ROPE_POSITIONS

logger = logging.getLogger("fastllm")


def _is_array(value: Any) -> bool:
    """A tensor or a NumPy array."""
    return hasattr(value, "tolist") and hasattr(value, "ndim")


def per_prompt(name: str, value: Any, kind: type, count: int, items: str) -> list[Any]:
    """The argument ``name`` of ``count`` prompts as one value each: ``value`` is one for all
    (an instance of ``kind``, or None) or a list of one each (None items allowed; ``items``
    names them in the error of a wrong count), as ``generate`` takes its ``sampling_params``
    and ``lora_request``."""
    if value is None or isinstance(value, kind):
        return [value] * count
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{name} must be a {kind.__name__}, a list of them or None, got "
                        f"{type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{len(value)} {items} for {count} prompts")
    return list(value)


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                **template_kwargs: Any) -> dict[str, list[int]]:
    """The prompt of a conversation: its chat template rendered with a generation prompt and
    tokenized without adding special tokens, since the template holds them."""
    return {"prompt_token_ids": tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **template_kwargs)}


def is_one_prompt(prompts: Any) -> bool:
    """Whether ``generate``'s ``prompts`` is one prompt rather than a list of them: a str, a
    dict, a ChunkedPrompt, a tensor or array, or a sequence of ints (bytes too: refused later
    as a prompt, not taken as a list of prompts)."""
    if isinstance(prompts, (str, bytes, bytearray, Mapping, ChunkedPrompt)) or _is_array(prompts):
        return True
    return (isinstance(prompts, Sequence) and len(prompts) > 0
            and isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool))


class EngineClient:
    """A model, its tokenizer, a paged KV cache and the engine over them, driven under one lock.

    Takes :class:`fastllm.LLM`'s arguments (see there).
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu",
                 tokenizer: str | os.PathLike | Tokenizer | None = None,
                 max_model_len: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_prefill_chunk: int | None = None, enforce_eager: bool = False,
                 chunk_store_memory: int | None = None, quantization: str | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto",
                 batch_invariant: bool = False,
                 speculative: Mapping[str, Any] | None = None,
                 tensor_parallel_size: int = 1, revision: str | None = None,
                 tokenizer_revision: str | None = None, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None,
                 kv_events_config: Mapping[str, Any] | None = None) -> None:
        if not isinstance(enable_lora, bool):
            raise TypeError(f"enable_lora must be a bool, got {enable_lora!r}")
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        engine_config = EngineConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     max_prefill_chunk=max_prefill_chunk,
                                     enforce_eager=enforce_eager, kv_cache_dtype=kv_cache_dtype,
                                     batch_invariant=batch_invariant, speculative=speculative,
                                     lora=lora, kv_events=kv_events_config)
        if chunk_store_memory is not None and (not isinstance(chunk_store_memory, int)
                                               or chunk_store_memory < 0):
            raise ValueError(f"chunk_store_memory must be None or an int >= 0, got "
                             f"{chunk_store_memory!r}")
        self.device = torch.device(device)
        self._max_model_len, self._kv_cache_memory = max_model_len, kv_cache_memory
        self._max_num_seqs, self._block_size = max_num_seqs, block_size
        self._cache_dtype = engine_config.cache_dtype
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
                or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got "
                             f"{tensor_parallel_size!r}")
        # A hub name is resolved here, once: what runs below (ranks included) reads files,
        # after the arguments are checked.
        if isinstance(tokenizer, Tokenizer) and tokenizer_revision is not None:
            raise ValueError("tokenizer_revision applies to a tokenizer named on the hub, not "
                             "to a loaded Tokenizer")
        if tokenizer is None and tokenizer_revision is not None:
            tokenizer = model  # the model's tokenizer at another revision
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = resolve_tokenizer(tokenizer, tokenizer_revision)
        model = resolve_model(model, revision)
        # A GGUF file holding the tokenizer too is parsed once, for both.
        shared_gguf = tokenizer is None and model.suffix == ".gguf" and model.is_file()
        # The collector is paused while the file is parsed, the model loaded and the tokenizer
        # built (they make only long-lived objects), not for the constructor: under torchrun
        # the other ranks serve inside it.
        with collector_paused():
            gguf_reader = GGUFFileReader(model) if shared_gguf else None
            loaded = (load(model, dtype, device, quantization, gguf_reader=gguf_reader)
                      if tensor_parallel_size == 1 else None)
        if tensor_parallel_size == 1:
            max_model_len, plan = self._plan_cache(loaded)
            kv_cache = PagedKVCache(loaded.kv_cache_spec(block_size,
                                                         self._cache_dtype(loaded.dtype)),
                                    plan, device=self.device,
                                    enable_prefix_caching=enable_prefix_caching,
                                    pre_rope=chunk_store_memory is not None)
            executor: Executor = UniProcExecutor(make_worker(
                loaded, kv_cache, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager, speculative=engine_config.speculative, lora=lora))
        else:
            torch_dtype = resolve_dtype(dtype)
            executor = MultiprocExecutor(
                ParallelConfig(model=str(model), dtype=torch_dtype, quantization=quantization,
                               device_type=self.device.type,
                               tensor_parallel_size=tensor_parallel_size,
                               max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                               batch_invariant=batch_invariant, block_size=block_size,
                               cache_dtype=engine_config.cache_dtype(torch_dtype),
                               pre_rope=chunk_store_memory is not None, lora=lora),
                self._plan_cache, enable_prefix_caching=enable_prefix_caching,
                speculative=engine_config.speculative)
        self.model, self.kv_cache = executor.model, executor.kv_cache
        self.max_model_len = executor.worker.max_model_len
        self.vocab_size = self.model.config.vocab_size
        chunk_index = None if chunk_store_memory is None else \
            ChunkIndex(chunk_store_memory, self.kv_cache.spec.bytes_per_token)
        try:
            with collector_paused():
                self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else \
                    Tokenizer.from_pretrained(model if tokenizer is None else tokenizer,
                                              gguf_reader)
            self.engine = Engine(executor, self.tokenizer, engine_config, self.max_model_len,
                                 chunk_index)
        except BaseException:
            executor.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.lock = threading.RLock()  # one engine step at a time, whichever thread asks
        self._request_counter = itertools.count()
        self.lora_config = lora
        self._checked_loras: dict[int, LoRARequest] = {}  # adapters checked, by id

    def _plan_cache(self, model: DecoderLM) -> tuple[int, KVPoolPlan]:
        """The context length and the KV pool for ``model`` (rank 0's shard under tensor
        parallelism: each rank's pool is the same size) from the client's arguments."""
        config, max_model_len = model.config, self._max_model_len
        if max_model_len is None:
            max_model_len = min(config.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
        if not isinstance(max_model_len, int) or not \
                2 <= max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be an int in [2, {config.max_position_embeddings}"
                             f"] (the model's max_position_embeddings), got {max_model_len!r}")
        model.reserve_positions(max_model_len)
        block_size = self._block_size
        spec = model.kv_cache_spec(block_size, self._cache_dtype(model.dtype))
        one_sequence = -(-max_model_len // block_size) * spec.bytes_per_block
        if self._kv_cache_memory is None:
            # A share of the free memory, no more than max_num_seqs full-length sequences need,
            # and never less than one.
            budget = min(default_kv_cache_memory(self.device),
                         self._max_num_seqs * one_sequence)
            plan = plan_pool(spec, memory_bytes=max(budget, one_sequence))
        else:
            plan = plan_pool(spec, memory_bytes=self._kv_cache_memory)
            if plan.max_tokens < max_model_len:
                raise ValueError(f"kv_cache_memory={self._kv_cache_memory:,} bytes hold "
                                 f"{plan.max_tokens} tokens, fewer than max_model_len="
                                 f"{max_model_len}; give it at least {one_sequence:,}")
        logger.info("KV cache: %s", plan.describe())
        return max_model_len, plan

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    **template_kwargs: Any) -> dict[str, list[int]]:
        """The prompt of a conversation (:func:`chat_prompt`) with this client's tokenizer."""
        return chat_prompt(self.tokenizer, messages, **template_kwargs)

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel ranks, if any (a later step raises)."""
        self.engine.shutdown()

    # ---- requests ----------------------------------------------------------------------------

    def check_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """``lora_request`` once its adapter is known to load on this model (read once per
        adapter id): a ValueError naming what is wrong with it, a FileNotFoundError for files
        that are not there, a TypeError for a value of another type."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got "
                            f"{type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked of an engine "
                             "without LoRA: LLM(..., enable_lora=True)")
        known = self._checked_loras.get(lora_request.lora_int_id)
        if known is None:
            config = self.model.config
            load_adapter(lora_request, config, ShardLayout.of(config, None),
                         max_lora_rank=self.lora_config.max_lora_rank, dtype=self.model.dtype)
            self._checked_loras[lora_request.lora_int_id] = lora_request
        elif known != lora_request:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter "
                             f"{known.lora_name!r} ({known.lora_path}); {lora_request!r} needs "
                             "an id of its own")
        return lora_request

    def reset_prefix_cache(self) -> int:
        """Forgets the KV of every cached prefix no request holds (after new weights, or to
        measure cold prompts); returns the blocks freed."""
        with self.lock:
            return self.engine.reset_prefix_cache()

    def forget_lora(self, lora_int_id: int) -> None:
        """Unloads an adapter: the engine's workers forget it, and a later request for its id
        reads its files again."""
        self._checked_loras.pop(lora_int_id, None)
        with self.lock:
            self.engine.remove_lora(lora_int_id)

    def make_requests(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                      lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                      ) -> list[Request]:
        """Checked requests for prompts (one or a list), their parameters (one for all, or
        one each; default ``SamplingParams()``) and LoRA adapters (one for all, or one each;
        default none)."""
        if is_one_prompt(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        params_list = per_prompt("sampling_params", sampling_params or SamplingParams(),
                                 SamplingParams, len(prompts), "SamplingParams")
        loras = [self.check_lora(lora) for lora in per_prompt(
            "lora_request", lora_request, LoRARequest, len(prompts), "LoRA requests")]
        requests = []
        for prompt, params, lora in zip(prompts, params_list, loras):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got "
                                f"{type(params).__name__}")
            params.check()  # again: a field may have changed since it was made
            params.check_vocab(self.vocab_size)
            text, token_ids = self._prompt_ids(prompt)
            requests.append(Request(
                str(next(self._request_counter)), text, token_ids, params,
                self.tokenizer.eos_token_ids, self.max_model_len,
                chunked_prompt=prompt if isinstance(prompt, ChunkedPrompt) else None,
                lora_request=lora))
        return requests

    def make_scoring_request(self, token_ids: Sequence[int],
                             score_token_ids: Sequence[int]) -> Request:
        """A prompt-only request: its prompt is computed (and its KV cached), nothing is
        generated, and it finishes with the logits of ``score_token_ids`` at its last token."""
        token_ids = self._check_ids(token_ids, "token_ids")
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ValueError(f"a scored prompt needs 1 to max_model_len={self.max_model_len} "
                             f"tokens, got {len(token_ids)}")
        return Request(str(next(self._request_counter)), None, token_ids, SamplingParams(), (),
                       self.max_model_len, score_token_ids=score_token_ids)

    def make_embedding_requests(self, prompts: PromptType | Sequence[PromptType],
                                pooling: str,
                                lora_request: LoRARequest | Sequence[LoRARequest | None] |
                                None = None) -> list[Request]:
        """Prompt-only requests (one prompt or a list) whose ``embedding`` is the prompt's
        final hidden states pooled ("last" or "mean") and L2-normalized."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        requests = []
        for request in self.make_requests(prompts, SamplingParams(max_tokens=0), lora_request):
            if request.chunked_prompt is not None:
                raise TypeError("an embedding's prompt is text or token ids, not a "
                                "ChunkedPrompt")
            requests.append(Request(request.request_id, request.prompt,
                                    request.prompt_token_ids, request.params, (),
                                    self.max_model_len, pooling=pooling,
                                    lora_request=request.lora_request))
        return requests

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, its token ids), checked."""
        if isinstance(prompt, ChunkedPrompt):
            return None, self._check_length(prompt, self._check_ids(prompt.token_ids, "prompt"))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                token_ids = self._check_ids(prompt["prompt_token_ids"], "prompt_token_ids")
                return None, self._check_length(prompt, token_ids)
            if "prompt" not in prompt:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys "
                                 f"{sorted(prompt)}")
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"a prompt dict's 'prompt' must be a str, got "
                                f"{type(prompt).__name__}")
        if isinstance(prompt, str):
            return prompt, self._check_length(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray)) or not (isinstance(prompt, Sequence)
                                                          or _is_array(prompt)):
            raise TypeError(f"a prompt is a str, a list of token ids, a 1-D integer tensor or "
                            f"array, a dict or a ChunkedPrompt, got {type(prompt).__name__}")
        return None, self._check_length(prompt, self._check_ids(prompt, "prompt token ids"))

    def _check_ids(self, token_ids: Any, what: str) -> list[int]:
        return as_token_ids(token_ids, limit=self.vocab_size, what=what)

    def _check_length(self, prompt: PromptType, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError(f"prompt {prompt!r} has no tokens")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, which leaves no room to "
                             f"generate under max_model_len={self.max_model_len}")
        return token_ids

    # ---- driving the engine ------------------------------------------------------------------

    def follow(self, requests: Sequence[Request]) -> list[RequestState]:
        """What callers see of generating requests (their text, deltas, logprobs, how they
        ended): the output processor's states, fed by every step from now on."""
        with self.lock:
            return [self.output_processor.add(request) for request in requests]

    def add(self, requests: Sequence[Request]) -> None:
        """Queues requests in the engine, all or none."""
        with self.lock:
            try:
                for request in requests:
                    self.engine.add_request(request)
            except BaseException:
                self.abort_unfinished(requests)
                raise

    def abort_unfinished(self, requests: Sequence[Request]) -> None:
        """Ends requests a caller no longer waits for (an error, or a stream closed early),
        freeing their KV blocks."""
        with self.lock:
            unfinished = [request for request in requests if not request.finished]
            for request in unfinished:
                self.engine.abort_request(request)
            self.output_processor.process(unfinished)

    def fail_request(self, request: Request, error: Exception) -> None:
        """Ends a request on an error of its own (finish_reason "error"), freeing its KV."""
        with self.lock:
            self.engine.fail_request(request, error)
            self.output_processor.process([request])

    def step(self) -> list[Request]:
        """One engine step, then its outputs processed: a request whose text hit a stop
        string (or could not be made text) is ended in the engine before the next step.
        Returns the requests the step updated."""
        with self.lock:
            updated = self.engine.step()
            for request, error in self.output_processor.process(updated):
                if error is None:
                    self.engine.abort_request(request)
                else:
                    self.engine.fail_request(request, error)
            return updated

    def step_until(self, done: Callable[[], bool]) -> bool:
        """One engine step unless ``done()`` already holds (checked under the lock, so a step
        another thread ran counts); returns ``done()`` after it."""
        with self.lock:
            if not done():
                self.step()
            return done()

    def run(self, requests: Sequence[Request],
            on_progress: Callable[[int], None] | None = None) -> None:
        """Adds the requests and steps the engine until all of them finished; on an error or an
        interrupt, the unfinished ones are aborted. ``on_progress(n)`` hears of each newly
        finished count."""
        self.add(requests)
        try:
            finished_before = 0
            while finished_before < len(requests):
                self.step_until(lambda: all(r.finished for r in requests))
                finished = sum(r.finished for r in requests)
                if on_progress is not None and finished > finished_before:
                    on_progress(finished - finished_before)
                finished_before = finished
        finally:
            self.abort_unfinished(requests)
