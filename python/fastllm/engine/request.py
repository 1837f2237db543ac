"""One generation request's state: its tokens, text, stop conditions and metrics.

The generation loop samples a token per step and hands it to :meth:`Request.append_token`,
which detokenizes it incrementally, applies the stop rules (EOS, stop token ids, stop strings,
``max_tokens``, the model's context) and returns the text the caller may show now. Text that
could be the start of a stop string is held back until it is known not to be one, so a stop
string never reaches a stream.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torch import Tensor

from fastllm.engine.chunked_prompt import ChunkedPrompt
from fastllm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from fastllm.engine.scheduler_output import NewRequest, SampledLogprobs
from fastllm.engine.structured_output import GrammarMatcher
from fastllm.sampling import SamplingParams, resolve_seed
from fastllm.tokenizer import Tokenizer

__all__ = ["Request"]


class Request:
    """A prompt, its sampling parameters and everything generated for it so far.

    Args:
        request_id: the caller's name for it.
        prompt: the prompt text, or None when the prompt came as token ids.
        prompt_token_ids: the prompt's ids.
        params: how to sample, and when to stop.
        tokenizer: turns the output into text.
        eos_token_ids: ids that end generation unless ``params.ignore_eos``.
        max_model_len: the most tokens, prompt and output, the sequence may hold.
        chunked_prompt: the prompt under block attention (its ``token_ids`` are
            ``prompt_token_ids``), for independent-chunk prefill.
        score_token_ids: makes the request prompt-only: it generates nothing and finishes once
            its prompt is computed, with ``scores`` the logits of these tokens at the prompt's
            last position (an empty tuple: none; the prompt's KV is only computed and cached).

    The scheduler keeps its state of the request here too, and is the one writer of it: the
    sequence id the request holds in the block manager (None while waiting or preempted), its
    grammar matcher, and the tokens drafted for its next step. Its seed is resolved once, so a
    preempted request resumes the same random stream.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int],
                 params: SamplingParams, tokenizer: Tokenizer,
                 eos_token_ids: Sequence[int], max_model_len: int, *,
                 chunked_prompt: ChunkedPrompt | None = None,
                 score_token_ids: Sequence[int] | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.chunked_prompt = chunked_prompt
        if chunked_prompt is not None and chunked_prompt.token_ids != self.prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids are not the chunked "
                             "prompt's tokens")
        self.score_token_ids = None if score_token_ids is None else tuple(score_token_ids)
        self.scores: Tensor | None = None
        self.params = params
        self.max_model_len = max_model_len
        self.metrics = RequestMetrics(arrival_time=time.perf_counter(),
                                      num_prompt_tokens=len(self.prompt_token_ids))
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None \
            else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: Exception | None = None  # why it failed (finish_reason "error")
        self._end_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._end_ids.update(eos_token_ids)
        self._tokenizer = tokenizer
        self._detokenizer = tokenizer.detokenizer(
            skip_special_tokens=params.skip_special_tokens, prompt_ids=self.prompt_token_ids)
        self._text = ""  # generated text (cut at a stop string once one is found)
        self._emitted = 0  # characters of _text already handed out
        self._deltas: list[str] = []  # released text not yet taken by a consumer
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
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def runner_record(self) -> NewRequest:
        """What a worker keeps of the request to sample it."""
        return NewRequest(self.request_id, list(self.prompt_token_ids), self.params, self.seed,
                          sorted(self._end_ids))

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

    def take_deltas(self) -> list[str]:
        """The text released since the last call, in order."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def append_token(self, token_id: int, logprobs: SampledLogprobs | None = None) -> str:
        """Adds a sampled token; returns the text that may be shown now ("" while held back).

        ``logprobs`` are the position's when the request asked for logprobs.
        """
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished "
                               f"({self.finish_reason})")
        entry = (self._logprob_entry(token_id, logprobs)
                 if self.logprobs is not None and logprobs is not None else None)
        now = time.perf_counter()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.output_token_ids.append(token_id)
        self.metrics.num_generated_tokens += 1
        if entry is not None:
            self.logprobs.append(entry)
            self.cumulative_logprob += entry[token_id].logprob

        # The constraint sees every token (an EOS it allowed completes it).
        constraint_done = self.grammar is not None and self.grammar.advance(token_id)
        ends = token_id in self._end_ids
        if ends:
            self._finish("stop", None if token_id not in self.params.stop_token_ids else token_id)
        elif constraint_done:
            self._finish("stop", None)
        elif (len(self.output_token_ids) >= self.params.max_tokens
              or self.num_tokens >= self.max_model_len):
            self._finish("length", None)
        delta = "" if ends else self._detokenizer.add(token_id)  # an end token has no text
        if self.finished:
            delta += self._detokenizer.flush()
        self._text += delta
        self._find_stop_string(len(delta))
        released = self._take_text()
        if released:
            self._deltas.append(released)
        return released

    def _logprob_entry(self, token: int, logprobs: SampledLogprobs) -> dict[int, Logprob]:
        """The sampled token's logprob, then the most likely tokens'."""
        ranks = {token_id: rank for rank, token_id in enumerate(logprobs.top_ids, 1)
                 if token_id >= 0}
        decode = self._tokenizer.decode
        entry = {token: Logprob(logprobs.token_logprob, ranks.get(token),
                                decode([token], skip_special_tokens=False))}
        for token_id, logprob in zip(logprobs.top_ids, logprobs.top_logprobs):
            if token_id >= 0 and token_id != token:
                entry[token_id] = Logprob(logprob, ranks[token_id],
                                          decode([token_id], skip_special_tokens=False))
        return entry

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = time.perf_counter()

    def _find_stop_string(self, num_new_chars: int) -> None:
        """Cuts the text before the earliest stop string that the new characters complete."""
        found = None
        for stop in self.params.stop:
            # Only a match ending in the new characters is new.
            start = max(0, len(self._text) - num_new_chars - len(stop) + 1)
            index = self._text.find(stop, start)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is not None:
            self._text = self._text[:found[0]]
            self._finish("stop", found[1])

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        if self.finished:
            return 0
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _take_text(self) -> str:
        end = len(self._text) - self._held_back()
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def output(self) -> RequestOutput:
        """The request's output so far; its text is what has been released (all once
        finished)."""
        completion = CompletionOutput(
            index=0, text=self._text[:self._emitted], token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids), outputs=[completion],
                             finished=self.finished, metrics=self.metrics, error=self.error)
