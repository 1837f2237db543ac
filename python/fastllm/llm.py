"""``fastllm.LLM``: text generation with vLLM's interface.

    llm = fastllm.LLM("path/to/model", dtype="bfloat16")
    outputs = llm.generate(["Once upon a time"], fastllm.SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
    for delta in llm.stream("Once upon a time", fastllm.SamplingParams(temperature=0)):
        print(delta, end="", flush=True)

Requests run through :class:`fastllm.engine.Engine`: continuous batching over a paged KV cache,
with the KV of prompt prefixes cached across requests and long prompts prefilled in chunks.
Per step the host waits for one thing: the sampled token ids, which it needs to detokenize and
to check the stop rules. ``generate``, ``stream`` and ``chat`` may be called from several
threads at once; each call steps the shared engine, which advances every request in it.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from tqdm.auto import tqdm

from fastllm.engine import Engine, EngineConfig
from fastllm.kv_cache import PagedKVCache, plan_pool
from fastllm.model_pool import load
from fastllm.outputs import RequestOutput
from fastllm.request import Request
from fastllm.sampling import SamplingParams
from fastllm.tokenizer import Tokenizer

__all__ = ["LLM", "PromptType"]

# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
PromptType = Union[str, Sequence[int], Mapping[str, Any]]

_DEFAULT_MAX_MODEL_LEN = 8192  # cap on the default context, so the default KV pool stays modest


class LLM:
    """A model, its tokenizer and a paged KV cache, generating text for prompts.

    Args:
        model: a Hugging Face model folder (config.json, *.safetensors, tokenizer files) or a
            ``.gguf`` file. Loaded through :func:`fastllm.load`, so several ``LLM`` objects share
            one copy of the weights.
        dtype: "float32", "bfloat16" or "float16" (or a torch dtype).
        device: where the model and the KV cache live.
        tokenizer: a folder or file to read the tokenizer from, if not ``model``.
        max_model_len: the most tokens (prompt and output) one sequence may hold. Default: the
            model's context, capped at 8192.
        kv_cache_memory: bytes for the paged KV pool; the pool is what bounds how many
            requests run at once (beyond it, the newest are preempted and recomputed later).
            Default: room for one sequence of ``max_model_len`` tokens (so many shorter ones).
            What running requests do not hold keeps cached prefixes for later ones.
        block_size: tokens per KV-cache block.
        enable_prefix_caching: reuse the KV of prompt prefixes computed before.
        max_num_seqs, max_num_batched_tokens, max_prefill_chunk: the engine's scheduling limits
            (:class:`fastllm.engine.EngineConfig`).
        enforce_eager: on CUDA, never replay decode steps from CUDA graphs (as vLLM's flag).
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", tokenizer: str | os.PathLike | None = None,
                 max_model_len: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_prefill_chunk: int | None = None, enforce_eager: bool = False) -> None:
        engine_config = EngineConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     max_prefill_chunk=max_prefill_chunk,
                                     enforce_eager=enforce_eager)
        self.model = load(model, dtype, device)
        self.device = torch.device(device)
        self.tokenizer = Tokenizer.from_pretrained(model if tokenizer is None else tokenizer)
        config = self.model.config
        if max_model_len is None:
            max_model_len = min(config.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
        if not isinstance(max_model_len, int) or not \
                2 <= max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be an int in [2, {config.max_position_embeddings}"
                             f"] (the model's max_position_embeddings), got {max_model_len!r}")
        self.max_model_len = max_model_len
        spec = self.model.kv_cache_spec(block_size)
        if kv_cache_memory is None:
            plan = plan_pool(spec, max_num_seqs=1, max_model_len=max_model_len)
        else:
            plan = plan_pool(spec, memory_bytes=kv_cache_memory)
            if plan.max_tokens < max_model_len:
                raise ValueError(f"kv_cache_memory={kv_cache_memory:,} bytes hold "
                                 f"{plan.max_tokens} tokens, fewer than max_model_len="
                                 f"{max_model_len}; give it at least "
                                 f"{-(-max_model_len // block_size) * spec.bytes_per_block:,}")
        self.kv_cache = PagedKVCache(spec, plan, device=self.device,
                                     enable_prefix_caching=enable_prefix_caching)
        self.vocab_size = config.vocab_size
        self.engine = Engine(self.model, self.tokenizer, self.kv_cache, engine_config,
                             max_model_len)
        self._request_counter = itertools.count()
        self._lock = threading.RLock()  # one engine step at a time, whichever thread asks

    # ---- public API --------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates a completion for each prompt, in order.

        Args:
            prompts: one prompt or a list of them; a prompt is text (tokenized with the
                tokenizer's special tokens, e.g. BOS), a list of token ids, or a dict with
                ``"prompt"`` or ``"prompt_token_ids"``.
            sampling_params: for all prompts, or one per prompt. Default: ``SamplingParams()``.
            use_tqdm: show a progress bar over the prompts.
        """
        requests = self._make_requests(prompts, sampling_params)
        self._add(requests)
        progress = tqdm(total=len(requests), desc="Generating", unit="prompt",
                        disable=not use_tqdm or not requests)
        try:
            done = 0
            while done < len(requests):
                with self._lock:
                    if not all(r.finished for r in requests):
                        self.engine.step()
                finished = sum(r.finished for r in requests)
                progress.update(finished - done)
                done = finished
        finally:
            progress.close()
            self._abort_unfinished(requests)
        return [request.output() for request in requests]

    def stream(self, prompt: PromptType,
               sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the text of one completion as it is generated, delta by delta.

        The deltas join to ``generate``'s text for the same prompt and parameters (text that
        may start a stop string is held back until it is known not to). Closing the iterator
        early ends the request and frees its KV.
        """
        if isinstance(sampling_params, Sequence):
            raise TypeError("stream takes one prompt and one SamplingParams")
        request, = self._make_requests([prompt], sampling_params)
        self._add([request])
        try:
            while True:
                with self._lock:
                    if not request.finished:
                        self.engine.step()
                    deltas = request.take_deltas()
                yield from deltas
                if request.finished:
                    return
        finally:
            self._abort_unfinished([request])

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """``generate`` on one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, each rendered with the chat template and a generation prompt.
        ``template_kwargs`` go to the template (e.g. ``enable_thinking=False``)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [self.chat_prompt(conversation, **template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    **template_kwargs: Any) -> dict[str, list[int]]:
        """The prompt (for ``generate`` or ``stream``) of a conversation: its chat template
        rendered with a generation prompt and tokenized without adding special tokens, since
        the template holds them."""
        return {"prompt_token_ids": self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **template_kwargs)}

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for a conversation, as HF's ``apply_chat_template`` renders it (see
        :meth:`fastllm.Tokenizer.apply_chat_template`). To generate from a conversation use
        :meth:`chat` or :meth:`chat_prompt`, which tokenize it without adding a second BOS."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)

    # ---- requests ----------------------------------------------------------------------------

    def _add(self, requests: list[Request]) -> None:
        """Queues requests in the engine, all or none."""
        with self._lock:
            try:
                for request in requests:
                    self.engine.add_request(request)
            except BaseException:
                self._abort_unfinished(requests)
                raise

    def _abort_unfinished(self, requests: list[Request]) -> None:
        """Ends requests a caller no longer waits for (an error, or a stream closed early),
        freeing their KV blocks."""
        with self._lock:
            for request in requests:
                if not request.finished:
                    self.engine.abort_request(request)

    def _make_requests(self, prompts: PromptType | Sequence[PromptType],
                       sampling_params: SamplingParams | Sequence[SamplingParams] | None
                       ) -> list[Request]:
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        requests = []
        for prompt, params in zip(prompts, params_list):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got "
                                f"{type(params).__name__}")
            params.check_vocab(self.vocab_size)
            text, token_ids = self._prompt_ids(prompt)
            requests.append(Request(str(next(self._request_counter)), text, token_ids, params,
                                    self.tokenizer, self.tokenizer.eos_token_ids,
                                    self.max_model_len))
        return requests

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, its token ids), checked."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys "
                                 f"{sorted(prompt)}")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
            text = None
            token_ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
            bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are not ints in "
                                 f"[0, {self.vocab_size})")
        else:
            raise TypeError(f"a prompt is a str, a list of token ids or a dict, got "
                            f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError(f"prompt {prompt!r} has no tokens")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, which leaves no room to "
                             f"generate under max_model_len={self.max_model_len}")
        return text, token_ids

    def __repr__(self) -> str:
        return (f"LLM({self.model.config.architecture}, dtype={self.model.embed_tokens.weight.dtype}"
                f", device={self.device}, max_model_len={self.max_model_len}, "
                f"kv_cache={self.kv_cache.num_blocks} blocks)")
