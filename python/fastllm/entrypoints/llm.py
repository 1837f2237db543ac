"""``fastllm.LLM``: text generation with vLLM's interface.

    llm = fastllm.LLM("path/to/model", dtype="bfloat16")
    outputs = llm.generate(["Once upon a time"], fastllm.SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
    for delta in llm.stream("Once upon a time", fastllm.SamplingParams(temperature=0)):
        print(delta, end="", flush=True)

Requests run through :class:`fastllm.engine.Engine` (held by an
:class:`~fastllm.entrypoints.client.EngineClient`): continuous batching over a paged KV cache,
with the KV of prompt prefixes cached across requests and long prompts prefilled in chunks.
Per step the host waits for one thing: the sampled token ids, which it needs to detokenize and
to check the stop rules. ``generate``, ``stream`` and ``chat`` may be called from several
threads at once; each call steps the shared engine, which advances every request in it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from fastllm.engine.chunked_prompt import ChunkedPrompt
from fastllm.engine.outputs import EmbeddingOutput, RequestOutput
from fastllm.entrypoints.client import (EngineClient, PromptType, chat_prompt, is_one_prompt,
                                        per_prompt)
from fastllm.entrypoints.data_parallel import (LLMReplicas, assign_prompts,
                                               check_data_parallel_size)
from fastllm.lora import LoRARequest
from fastllm.sampling import SamplingParams
from fastllm.tokenizer import Tokenizer

__all__ = ["LLM", "PromptType"]

# Data parallelism: prompts whose first this many tokens agree (and their adapter) go to one
# replica, whose prefix cache then serves them all.
_AFFINITY_TOKENS = 64


class LLM:
    """A model, its tokenizer and a paged KV cache, generating text for prompts.

    Args:
        model: a Hugging Face model folder (config.json, *.safetensors, tokenizer files), a
            ``.gguf`` file, or a model on the Hugging Face Hub by name: ``org/name`` (a
            safetensors repo), ``org/name:Q4_K_M`` or ``org/name/file.gguf`` (a GGUF repo, as
            llama.cpp's ``-hf`` takes them), downloaded into huggingface_hub's cache
            (:mod:`fastllm.hub`). Loaded through :func:`fastllm.load`, so several ``LLM``
            objects share one copy of the weights.
        revision: the hub model's branch, tag or commit (default: its main branch).
        dtype: "float32", "bfloat16" or "float16" (or a torch dtype).
        quantization: None, "int8" or "int4": quantize a float checkpoint's weights at load,
            weight-only, in blocks of 32 values per row (ggml's Q8_0; Q4_1 with the LM head in
            Q8_0), run by the quantized matmul. Norms, biases and layers whose rows are not a
            multiple of 32 long stay in ``dtype``, as do the activations. A GGUF file already
            quantized loads as it is, without this argument.
        device: where the model and the KV cache live.
        tokenizer: a folder, file or hub name to read the tokenizer from, if not ``model``, or
            a loaded :class:`fastllm.Tokenizer` to share (reading a large vocabulary takes
            seconds).
        tokenizer_revision: the hub tokenizer's branch, tag or commit.
        max_model_len: the most tokens (prompt and output) one sequence may hold. Default: the
            model's context, capped at 8192.
        kv_cache_memory: bytes for the paged KV pool; the pool is what bounds how many
            requests run at once (beyond it, the newest are preempted and recomputed later).
            Default: a share of the free memory (:func:`fastllm.kv_cache.default_kv_cache_memory`:
            a quarter of the host's available memory up to 2 GiB; half a GPU's free memory), no
            more than ``max_num_seqs`` sequences of ``max_model_len`` tokens need and at least
            one. The plan is logged (logger "fastllm", INFO). What running requests do not hold
            keeps cached prefixes for later ones.
        block_size: tokens per KV-cache block.
        enable_prefix_caching: reuse the KV of prompt prefixes computed before.
        max_num_seqs, max_num_batched_tokens, max_prefill_chunk: the engine's scheduling limits
            (:class:`fastllm.engine.EngineConfig`).
        enforce_eager: on CUDA, never replay decode steps from CUDA graphs (as vLLM's flag).
        chunk_store_memory: bytes for the store of encoded independent chunks; setting it (0
            keeps none) lets ``generate`` take :class:`fastllm.ChunkedPrompt` prompts and makes
            the KV cache position-independent (keys cached before RoPE, rotated as attention
            reads them). Default None: no chunked prompts.
        kv_cache_dtype: what the KV cache stores, as vLLM's option: "auto" (default: the
            model's ``dtype``), "float32", "bfloat16" or "float16". Under a float32 model a
            16-bit cache holds twice the tokens in ``kv_cache_memory`` and halves the bytes
            decode attention reads (llama.cpp's default cache is float16), at the cost of
            rounding K/V once (:class:`fastllm.engine.EngineConfig`). CPU only.
        batch_invariant: compute each request the same way whatever else runs with it
            (:func:`fastllm.ops.batch_invariant`): a seeded request's tokens are the same alone,
            in any batch and after a preemption, in every dtype; prefill is slower. CPU only.
        speculative: speculative decoding (:mod:`fastllm.engine.speculative`), a dict such as
            ``{"method": "ngram", "num_speculative_tokens": 4}`` (prompt lookup: drafts copied
            from earlier in the request's own tokens) or ``{"method": "draft", "model": PATH}``
            (a small model sharing the tokenizer drafts). Each decoding request's drafts are
            checked in one model step; the tokens are the ones generation gives without it,
            greedy or seeded sampling. None (default): no speculation.
        tensor_parallel_size: shard the model over this many ranks, one process per device
            (:mod:`fastllm.engine.executor`): Megatron-style tensor parallelism on
            ``torch.distributed`` (gloo on the CPU, where the ranks share the cores; NCCL on
            CUDA, ranks on ``cuda:0`` .. ``cuda:N-1``), the same tokens as one process. Under
            ``torchrun`` every rank runs the script, and the ranks but 0 serve inside this
            constructor, then exit. :meth:`shutdown` (or dropping the object) stops the ranks.
        enable_lora: serve LoRA adapters (peft folders or hub repos, named per request by a
            :class:`fastllm.LoRARequest`) on the base model, as vLLM does: each token of a
            step adds its own adapter's two small matmuls to every projection it targets.
        max_loras: adapters in one step at most (each holds a slot of weights on the device);
            requests of other adapters wait for a slot.
        max_lora_rank: the largest rank ``r`` an adapter may have.
        max_cpu_loras: adapters kept loaded on the host (default: ``max_loras``); others are
            read from their files again when they run.
        kv_events_config: publish the prefix cache's changes for prefix-aware routers, as
            vLLM's ``--kv-events-config`` (:mod:`fastllm.engine.kv_events`: ZMQ, vLLM's wire
            format, documented block hashes), e.g. ``{"enable_kv_cache_events": True,
            "endpoint": "tcp://*:5557"}``.
        data_parallel_size: run this many replicas of the engine, each in a process of its own
            (:mod:`fastllm.entrypoints.data_parallel`; each tensor-parallel in turn with
            ``tensor_parallel_size``), started as the tensor-parallel ranks are. On the CPU the
            replicas share the threads torch would use; on CUDA replica r takes its own
            devices (``cuda:r*tp`` .. of those visible). :meth:`generate` and :meth:`chat`
            split their prompts between the replicas (prompts with the same first tokens on the
            same replica, for its prefix cache; the rest balanced by prompt tokens) and return
            the outputs in order: the same tokens as one engine gives them (greedy,
            ``batch_invariant``). :meth:`chat_prompt`, :meth:`apply_chat_template` and
            :meth:`shutdown` work as ever; :meth:`embed` and :meth:`stream` are refused (a
            ValueError), and ``client``, ``engine``, ``model`` and ``kv_cache`` are None: they
            live in the replicas' processes.
    """

    def __init__(self, model: str | os.PathLike, *, revision: str | None = None,
                 dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                 tokenizer: str | os.PathLike | Tokenizer | None = None,
                 tokenizer_revision: str | None = None,
                 max_model_len: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 max_prefill_chunk: int | None = None, enforce_eager: bool = False,
                 chunk_store_memory: int | None = None, quantization: str | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto",
                 batch_invariant: bool = False,
                 speculative: Mapping[str, Any] | None = None,
                 tensor_parallel_size: int = 1, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None,
                 kv_events_config: Mapping[str, Any] | None = None,
                 data_parallel_size: int = 1) -> None:
        self.data_parallel_size = check_data_parallel_size(data_parallel_size)
        self._replicas: LLMReplicas | None = None
        if data_parallel_size > 1:
            # This process prepares the prompts: it holds the tokenizer, not the model.
            if isinstance(tokenizer, Tokenizer):
                self.tokenizer = tokenizer
            elif tokenizer is None:  # the model's, at tokenizer_revision if given
                self.tokenizer = Tokenizer.from_pretrained(
                    model, revision=tokenizer_revision or revision)
            else:
                self.tokenizer = Tokenizer.from_pretrained(tokenizer, revision=tokenizer_revision)
            self._replicas = LLMReplicas(model, data_parallel_size, dict(
                revision=revision, dtype=dtype, device=device, tokenizer=tokenizer,
                tokenizer_revision=tokenizer_revision, max_model_len=max_model_len,
                kv_cache_memory=kv_cache_memory, block_size=block_size,
                enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_prefill_chunk=max_prefill_chunk, enforce_eager=enforce_eager,
                chunk_store_memory=chunk_store_memory, quantization=quantization,
                kv_cache_dtype=kv_cache_dtype, batch_invariant=batch_invariant,
                speculative=speculative, tensor_parallel_size=tensor_parallel_size,
                enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras, kv_events_config=kv_events_config))
            self.client = self.model = self.kv_cache = self.engine = None
            self.device = torch.device(device)
            self.max_model_len = self._replicas.max_model_len
            self._model_name = str(model)
            self._request_counter = itertools.count()
            return
        self.client = EngineClient(
            model, revision=revision, dtype=dtype, device=device, tokenizer=tokenizer,
            tokenizer_revision=tokenizer_revision, max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_prefill_chunk=max_prefill_chunk,
            enforce_eager=enforce_eager, chunk_store_memory=chunk_store_memory,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            batch_invariant=batch_invariant, speculative=speculative,
            tensor_parallel_size=tensor_parallel_size, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            kv_events_config=kv_events_config)
        self.model, self.tokenizer = self.client.model, self.client.tokenizer
        self.kv_cache, self.engine = self.client.kv_cache, self.client.engine
        self.device, self.max_model_len = self.client.device, self.client.max_model_len

    # ---- public API --------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates a completion for each prompt, in order.

        Args:
            prompts: one prompt or a list of them; a prompt is text (tokenized with the
                tokenizer's special tokens, e.g. BOS), token ids (a list of ints, or a 1-D
                integer tensor or array), a dict with ``"prompt"`` or ``"prompt_token_ids"``,
                or a :class:`fastllm.ChunkedPrompt` (with ``chunk_store_memory`` set), all
                batched together. Anything else is a TypeError naming its type; a token id
                outside the vocabulary a ValueError naming it.
            sampling_params: for all prompts, or one per prompt. Default: ``SamplingParams()``.
            use_tqdm: show a progress bar over the prompts.
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the base
                model), with ``enable_lora``. An adapter's files are read and checked against
                the model the first time its ``lora_int_id`` is used.

        A bad prompt or parameter raises before anything runs. A request that fails inside a
        step (e.g. its penalties overflow its logits) ends alone, with finish_reason "error"
        and the exception in its output's ``error``; the other prompts complete as if it had
        not been there.
        """
        if self._replicas is not None:
            return self._generate_data_parallel(prompts, sampling_params, use_tqdm, lora_request)
        requests = self.client.make_requests(prompts, sampling_params, lora_request)
        states = self.client.follow(requests)
        with tqdm(total=len(requests), desc="Generating", unit="prompt",
                  disable=not use_tqdm or not requests) as progress:
            self.client.run(requests, progress.update)
        return [state.output() for state in states]

    def _generate_data_parallel(self, prompts: PromptType | Sequence[PromptType],
                                sampling_params: SamplingParams | Sequence[SamplingParams] |
                                None, use_tqdm: bool,
                                lora_request: LoRARequest | Sequence[LoRARequest | None] | None
                                ) -> list[RequestOutput]:
        """``generate`` over the replicas: each prompt's parameters and adapter travel with it;
        the replicas check them (every replica's share before any runs)."""
        prompts = [prompts] if is_one_prompt(prompts) else prompts
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        params = per_prompt("sampling_params", sampling_params, SamplingParams, len(prompts),
                            "SamplingParams")
        loras = per_prompt("lora_request", lora_request, LoRARequest, len(prompts),
                           "LoRA requests")
        token_ids = [self._prompt_token_ids(prompt) for prompt in prompts]
        keys = [(lora.lora_int_id if lora is not None else 0, tuple(ids[:_AFFINITY_TOKENS]))
                for lora, ids in zip(loras, token_ids)]
        ranks = assign_prompts(keys, [len(ids) for ids in token_ids], self.data_parallel_size)
        with tqdm(total=len(prompts), desc="Generating", unit="prompt",
                  disable=not use_tqdm or not prompts) as progress:
            outputs = self._replicas.generate(ranks, prompts, params, loras, progress.update)
        for output in outputs:  # numbered here, as one engine numbers its requests
            output.request_id = str(next(self._request_counter))
        return outputs

    def _prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """What this process reads of a prompt to place it: its token ids (text tokenized),
        or none for a prompt of a kind the replica will refuse."""
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        elif isinstance(prompt, ChunkedPrompt):
            prompt = prompt.token_ids
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if hasattr(prompt, "tolist"):
            prompt = prompt.tolist()
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return []

    def _refuse_data_parallel(self, method: str) -> None:
        if self._replicas is not None:
            raise ValueError(f"LLM.{method} does not run with data_parallel_size="
                             f"{self.data_parallel_size}: only generate and chat share their "
                             "prompts between the replicas (data_parallel_size=1 has it)")

    def embed(self, prompts: PromptType | Sequence[PromptType], *, pooling: str = "last",
              use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingOutput]:
        """Each prompt's embedding, in order: its final hidden states pooled ("last": the last
        token's, as decoder embedding models such as Qwen3-Embedding are read; "mean": their
        mean) and L2-normalized, as vLLM's pooling runner gives them. The prompts are
        prompt-only requests of the running batch (a last-token prompt may start from the
        prefix cache). ``lora_request`` as :meth:`generate` takes it."""
        self._refuse_data_parallel("embed")
        requests = self.client.make_embedding_requests(prompts, pooling, lora_request)
        with tqdm(total=len(requests), desc="Embedding", unit="prompt",
                  disable=not use_tqdm or not requests) as progress:
            self.client.run(requests, progress.update)
        for request in requests:
            if request.error is not None:
                raise request.error
        return [EmbeddingOutput(request.request_id, list(request.prompt_token_ids),
                                request.embedding.tolist()) for request in requests]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[str]:
        """Yields the text of one completion as it is generated, delta by delta.

        The deltas join to ``generate``'s text for the same prompt and parameters (text that
        may start a stop string is held back until it is known not to). Closing the iterator
        early ends the request and frees its KV. A request that fails inside a step raises its
        error here, after the deltas it had produced.
        """
        self._refuse_data_parallel("stream")
        if isinstance(sampling_params, Sequence):
            raise TypeError("stream takes one prompt and one SamplingParams")
        client = self.client
        request, = client.make_requests([prompt], sampling_params, lora_request)
        state, = client.follow([request])
        client.add([request])
        try:
            while True:
                with client.lock:
                    finished = client.step_until(lambda: state.finished)
                    deltas = state.take_deltas()
                yield from deltas
                if state.error is not None:
                    raise state.error
                if finished:
                    return
        finally:
            client.abort_unfinished([request])

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """``generate`` on one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, each rendered with the chat template and a generation prompt.
        ``template_kwargs`` go to the template (e.g. ``enable_thinking=False``)."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts (or a list "
                            f"of such lists), got {type(messages).__name__}")
        one = not messages or isinstance(messages[0], (str, Mapping)) or not isinstance(
            messages[0], Sequence)
        conversations = [messages] if one else messages
        prompts = [self.chat_prompt(conversation, **template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    **template_kwargs: Any) -> dict[str, list[int]]:
        """The prompt (for ``generate`` or ``stream``) of a conversation: its chat template
        rendered with a generation prompt and tokenized without adding special tokens, since
        the template holds them."""
        return chat_prompt(self.tokenizer, messages, **template_kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for a conversation, as HF's ``apply_chat_template`` renders it (see
        :meth:`fastllm.Tokenizer.apply_chat_template`). To generate from a conversation use
        :meth:`chat` or :meth:`chat_prompt`, which tokenize it without adding a second BOS."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks and data-parallel replicas, if any; the object
        generates nothing after."""
        if self._replicas is not None:
            self._replicas.shutdown()
        else:
            self.client.shutdown()

    def __repr__(self) -> str:
        if self._replicas is not None:
            return (f"LLM({self._model_name}, data_parallel_size={self.data_parallel_size}, "
                    f"device={self.device}, max_model_len={self.max_model_len})")
        return (f"LLM({self.model.config.architecture}, dtype={self.model.dtype}"
                f", device={self.device}, max_model_len={self.max_model_len}, "
                f"kv_cache={self.kv_cache.num_blocks} blocks)")
