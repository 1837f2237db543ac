"""One request's state in the engine: its tokens, token-level stop rules and metrics.

The scheduler hands each sampled token to :meth:`Request.append_token`, which applies the
token-level stop rules (EOS and stop token ids, a completed grammar, ``max_tokens``, the
model's context). Text, stop strings and formatted logprobs are the front end's
(:mod:`fastllm.engine.output_processor`), made from the tokens and raw logprobs kept here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torch import Tensor

from fastllm.engine.chunked_prompt import ChunkedPrompt
from fastllm.engine.outputs import RequestMetrics
from fastllm.engine.scheduler_output import NewRequest, SampledLogprobs
from fastllm.engine.structured_output import GrammarMatcher
from fastllm.lora.adapter import LoRARequest
from fastllm.sampling import SamplingParams, resolve_seed

__all__ = ["Request"]


class Request:
    """A prompt, its sampling parameters and everything generated for it so far.

    Args:
        request_id: the caller's name for it.
        prompt: the prompt text, or None when the prompt came as token ids.
        prompt_token_ids: the prompt's ids.
        params: how to sample, and when to stop.
        eos_token_ids: ids that end generation unless ``params.ignore_eos``.
        max_model_len: the most tokens, prompt and output, the sequence may hold.
        chunked_prompt: the prompt under block attention (its ``token_ids`` are
            ``prompt_token_ids``), for independent-chunk prefill.
        score_token_ids: makes the request prompt-only: it generates nothing and finishes once
            its prompt is computed, with ``scores`` the logits of these tokens at the prompt's
            last position (an empty tuple: none; the prompt's KV is only computed and cached).
        pooling: makes the request prompt-only too, its ``embedding`` the prompt's final
            hidden states pooled ("last": the last token's; "mean": their mean) and
            L2-normalized, as vLLM's pooling runner gives a decoder model's embedding.
        lora_request: the LoRA adapter the request runs with (None: the base model).

    The scheduler keeps its state of the request here too, and is the one writer of it: the
    sequence id the request holds in the block manager (None while waiting or preempted), its
    grammar matcher, and the tokens drafted for its next step. Its seed is resolved once, so a
    preempted request resumes the same random stream.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int],
                 params: SamplingParams, eos_token_ids: Sequence[int], max_model_len: int, *,
                 chunked_prompt: ChunkedPrompt | None = None,
                 score_token_ids: Sequence[int] | None = None,
                 pooling: str | None = None, lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.chunked_prompt = chunked_prompt
        if chunked_prompt is not None and chunked_prompt.token_ids != self.prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids are not the chunked "
                             "prompt's tokens")
        if pooling not in (None, "last", "mean"):
            raise ValueError(f"pooling must be None, 'last' or 'mean', got {pooling!r}")
        self.pooling = pooling
        self._pooled: Tensor | None = None  # the pooled rows' sum so far
        self.num_pooled = 0  # prompt positions pooled so far (from the first)
        if score_token_ids is None and (params.max_tokens == 0 or pooling is not None):
            score_token_ids = ()  # the prompt alone: computed (and its logprobs), then done
        self.score_token_ids = None if score_token_ids is None else tuple(score_token_ids)
        self.scores: Tensor | None = None
        self.params = params
        self.max_model_len = max_model_len
        self.metrics = RequestMetrics(arrival_time=time.perf_counter(),
                                      num_prompt_tokens=len(self.prompt_token_ids))
        self.output_token_ids: list[int] = []
        # With logprobs: per output token, its position's logprobs as sampled.
        self.logprobs: list[SampledLogprobs | None] | None = [] if params.logprobs is not None \
            else None
        # The prompt's logprobs so far (the first token's is None): a prefill fills them in.
        self.prompt_logprobs: list[SampledLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: Exception | None = None  # why it failed (finish_reason "error")
        self._end_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._end_ids.update(eos_token_ids)
        self.seed = resolve_seed(params)
        self.seq_id: int | None = None
        self.grammar: GrammarMatcher | None = None  # with structured outputs only
        self.draft_token_ids: list[int] = []  # speculative decoding: drafts for its next step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def end_token_ids(self) -> list[int]:
        """The tokens that end it: its stop token ids, and EOS unless ignored."""
        return sorted(self._end_ids)

    def runner_record(self) -> NewRequest:
        """What a worker keeps of the request to sample it."""
        return NewRequest(self.request_id, list(self.prompt_token_ids), self.params, self.seed,
                          self.end_token_ids)

    def finish_prompt(self) -> None:
        """Ends a prompt-only request once its prompt is computed."""
        self._finish("length", None)

    def abort(self) -> None:
        """Ends the request without finishing it (cancelled): finish_reason "abort"."""
        if not self.finished:
            self._finish("abort", None)

    def fail(self, error: Exception) -> None:
        """Ends the request on an error of its own: finish_reason "error", ``error`` kept."""
        if not self.finished:
            self.error = error
            self._finish("error", None)

    def append_token(self, token_id: int, logprobs: SampledLogprobs | None = None) -> None:
        """Adds a sampled token (with its position's ``logprobs`` when the request asked for
        them) and ends the request if a token-level rule says so."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished "
                               f"({self.finish_reason})")
        now = time.perf_counter()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.output_token_ids.append(token_id)
        self.metrics.num_generated_tokens += 1
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        # The constraint sees every token (an EOS it allowed completes it).
        constraint_done = self.grammar is not None and self.grammar.advance(token_id)
        if token_id in self._end_ids:
            self._finish("stop", None if token_id not in self.params.stop_token_ids else token_id)
        elif constraint_done:
            self._finish("stop", None)
        elif (len(self.output_token_ids) >= self.params.max_tokens
              or self.num_tokens >= self.max_model_len):
            self._finish("length", None)

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether a step must compute every prompt token of this request (prompt logprobs,
        mean pooling) rather than take some from the prefix cache."""
        return self.next_prompt_logprob is not None or (
            self.pooling == "mean" and self.num_pooled < len(self.prompt_token_ids))

    def add_pooled(self, rows_sum: Tensor, num_rows: int) -> None:
        """Adds the sum of the next ``num_rows`` pooled rows' hidden states."""
        self._pooled = rows_sum if self._pooled is None else self._pooled + rows_sum
        self.num_pooled += num_rows

    @property
    def embedding(self) -> Tensor | None:
        """The pooled, L2-normalized float32 embedding, once the prompt is computed."""
        if self._pooled is None or not self.finished:
            return None
        pooled = self._pooled.float() / (1 if self.pooling == "last" else self.num_pooled)
        return pooled / pooled.norm().clamp_min(1e-12)

    @property
    def next_prompt_logprob(self) -> int | None:
        """The prompt position whose logprob comes next (None when none is wanted)."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_token_ids):
            return None
        return len(self.prompt_logprobs)

    def add_prompt_logprobs(self, logprobs: Sequence[SampledLogprobs]) -> None:
        """The logprobs of the next prompt tokens, in order."""
        self.prompt_logprobs.extend(logprobs)

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = time.perf_counter()
