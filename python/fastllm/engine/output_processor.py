"""The output processor: what callers see of a request, made from the tokens the engine gives it
(vLLM v1's ``OutputProcessor``, on the front end's side of the engine).

The engine's scheduler appends each request's sampled tokens and ends it on token-level rules
(EOS and stop token ids, ``max_tokens``, the context, a completed grammar). The processor then
reads each updated request's new tokens (it never writes a request): it detokenizes them
incrementally, looks for stop strings, formats logprobs, and releases text to streams, holding
back text that could be the start of a stop string until it is known not to be one, so a stop
string never reaches a stream. A request whose text hit a stop string ends there: its tokens
are cut after the one that completed the string, and the processor tells its caller, which
aborts the request in the engine before the next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from fastllm.engine.request import Request
from fastllm.engine.scheduler_output import SampledLogprobs, request_error
from fastllm.tokenizer import Tokenizer

__all__ = ["OutputProcessor", "RequestState"]


class RequestState:
    """One request as its caller sees it: its text, released deltas, formatted logprobs and
    how it ended. Made by :meth:`OutputProcessor.add`, fed by :meth:`OutputProcessor.process`
    while the request runs; readable after."""

    def __init__(self, request: Request, tokenizer: Tokenizer) -> None:
        self.request = request
        params = request.params
        self._tokenizer = tokenizer
        self._detokenizer = tokenizer.detokenizer(
            skip_special_tokens=params.skip_special_tokens, prompt_ids=request.prompt_token_ids)
        self._end_ids = set(request.end_token_ids)
        self.token_ids: list[int] = []  # the request's tokens taken so far (cut at a stop)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None \
            else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self._text = ""  # generated text (cut at a stop string once one is found)
        self._emitted = 0  # characters of _text already handed out
        self._deltas: list[str] = []  # released text not yet taken by a consumer
        self.stopped_by: str | None = None  # the stop string that ended it
        self._failure: Exception | None = None  # its tokens could not be made text
        self.finished = False

    @property
    def error(self) -> Exception | None:
        """Why it failed (finish_reason "error"): in a step, or here."""
        return self._failure or self.request.error

    @property
    def finish_reason(self) -> str | None:
        if not self.finished:
            return None
        if self.stopped_by is not None:
            return "stop"
        return "error" if self._failure is not None else self.request.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.stopped_by if self.stopped_by is not None else self.request.stop_reason

    def take_deltas(self) -> list[str]:
        """The text released since the last call, in order."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def output(self) -> RequestOutput:
        """The request's output so far; its text is what has been released (all once
        finished)."""
        request = self.request
        completion = CompletionOutput(
            index=0, text=self._text[:self._emitted], token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason if self.finished
            else None)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=list(request.prompt_token_ids),
                             outputs=[completion], finished=self.finished,
                             metrics=request.metrics, error=self.error,
                             prompt_logprobs=None if self.prompt_logprobs is None
                             else list(self.prompt_logprobs))

    # ---- fed by the processor ----------------------------------------------------------------

    def _take(self) -> bool:
        """Takes the request's new tokens and prompt logprobs; True when the text hit a stop
        string (the state is finished, the request is not yet)."""
        request = self.request
        if self.prompt_logprobs is not None:
            for position in range(len(self.prompt_logprobs), len(request.prompt_logprobs)):
                self.prompt_logprobs.append(self._logprob_entry(
                    request.prompt_token_ids[position], request.prompt_logprobs[position]))
        new = request.output_token_ids[len(self.token_ids):]
        for j, token_id in enumerate(new, len(self.token_ids)):
            self.token_ids.append(token_id)
            if self.logprobs is not None and request.logprobs[j] is not None:
                entry = self._logprob_entry(token_id, request.logprobs[j])
                self.logprobs.append(entry)
                self.cumulative_logprob += entry[token_id].logprob
            last = request.finished and j == request.num_output_tokens - 1
            # An end token has no text.
            delta = "" if last and token_id in self._end_ids else \
                self._detokenizer.add(token_id)
            if last:
                delta += self._detokenizer.flush()
            self._text += delta
            if self._find_stop_string(len(delta)):
                self._detokenizer.flush()
                self.finished = True
                break
        self.finished = self.finished or request.finished
        released = self._take_text()
        if released:
            self._deltas.append(released)
        return self.stopped_by is not None

    def _logprob_entry(self, token: int, logprobs: SampledLogprobs) -> dict[int, Logprob]:
        """The sampled token's logprob, then the most likely tokens'."""
        ranks = {token_id: rank for rank, token_id in enumerate(logprobs.top_ids, 1)
                 if token_id >= 0}
        text = self._tokenizer.token_text
        entry = {token: Logprob(logprobs.token_logprob, ranks.get(token), text(token))}
        for token_id, logprob in zip(logprobs.top_ids, logprobs.top_logprobs):
            if token_id >= 0 and token_id != token:
                entry[token_id] = Logprob(logprob, ranks[token_id], text(token_id))
        return entry

    def _find_stop_string(self, num_new_chars: int) -> bool:
        """Cuts the text before the earliest stop string that the new characters complete."""
        found = None
        for stop in self.request.params.stop:
            # Only a match ending in the new characters is new.
            start = max(0, len(self._text) - num_new_chars - len(stop) + 1)
            index = self._text.find(stop, start)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return False
        self._text = self._text[:found[0]]
        self.stopped_by = found[1]
        return True

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        if self.finished:
            return 0
        held = 0
        for stop in self.request.params.stop:
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


class OutputProcessor:
    """The states of the requests that run, fed from each engine step's updated requests."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[Request, RequestState] = {}
        self.process_s = 0.0  # time taken by process(): detokenizing, stop strings, logprobs

    def add(self, request: Request) -> RequestState:
        """Starts following a generating request."""
        state = self._states[request] = RequestState(request, self.tokenizer)
        return state

    def process(self, requests: Sequence[Request]
                ) -> list[tuple[Request, Exception | None]]:
        """Takes what a step (or an abort) gave each of ``requests``; returns those the caller
        must end in the engine: ``(request, None)`` when its text hit a stop string, ``(request,
        error)`` when its tokens could not be made text. A state stops being fed once
        finished."""
        started = time.perf_counter()
        ended = []
        for request in requests:
            state = self._states.get(request)
            if state is None:
                continue
            try:
                stopped = state._take()
            except Exception as error:  # e.g. its tokenizer cannot decode a token
                state._failure = request_error("this request's tokens cannot be made text",
                                               error)
                state.finished, stopped = True, False
            if state.finished:
                del self._states[request]
            if not request.finished and state._failure is not None:
                ended.append((request, state._failure))
            elif not request.finished and stopped:
                ended.append((request, None))
        self.process_s += time.perf_counter() - started
        return ended
