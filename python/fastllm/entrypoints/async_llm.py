"""``fastllm.AsyncLLM``: the engine behind an asyncio interface.

    llm = fastllm.AsyncLLM("path/to/model")
    async for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(delta, end="")
    output = await llm.generate("The dog", SamplingParams(temperature=0))

A background thread builds the engine, then steps it while any request is unfinished; every
request added from any coroutine joins the running batch at the next step. Cancelling the
coroutine (or closing the ``stream`` iterator) aborts its request, whose KV blocks are freed at
once when no step is running, else before the next step. Adding and aborting never wait for a
running step: the engine thread applies what is queued before each step, so an event loop is
never blocked by the engine. A request that fails inside a step (or that the engine refuses)
raises its error in its own coroutine; the others go on, and so does the thread.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fastllm.engine.output_processor import RequestState
from fastllm.engine.outputs import Logprob, RequestOutput
from fastllm.engine.request import Request
from fastllm.entrypoints.client import EngineClient, PromptType
from fastllm.lora import LoRARequest
from fastllm.sampling import SamplingParams

__all__ = ["AsyncLLM", "StreamDelta"]


@dataclass
class StreamDelta:
    """What one engine step added to a request (:meth:`AsyncLLM.stream_outputs`).

    Attributes:
        text: text released since the previous delta ("" while held back, e.g. what may begin
            a stop string).
        token_ids: tokens generated since the previous delta.
        logprobs: their logprob entries, when the request asked for logprobs.
        finish_reason, stop_reason: set on the last delta (see :class:`CompletionOutput`).
        output: the request's output so far (its metrics, prompt token count...).
    """

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    output: RequestOutput


class AsyncLLM:
    """Continuous batching for asyncio callers; takes :class:`fastllm.LLM`'s arguments.

    Its engine client (``self.client``, the one :class:`fastllm.LLM` uses too) is built and
    stepped by a background thread; an error building it (a bad path or argument) raises here.
    Call :meth:`shutdown` (or use ``async with``) to stop the thread.
    """

    client: EngineClient

    def __init__(self, model: str | os.PathLike, **llm_kwargs: Any) -> None:
        # Each request a coroutine waits on: its loop, its queue, and what it sees of it (the
        # output processor's state; None for a prompt-only request).
        self._subscribers: dict[Request, tuple[asyncio.AbstractEventLoop, asyncio.Queue,
                                               RequestState | None]] = {}
        self._subscribers_lock = threading.Lock()  # the engine thread reads them too
        # Requests to add ("add") or abort ("abort"), applied by the engine thread before its
        # next step: an event loop never waits for a step to end (nor for the engine lock,
        # which the stepping thread would win again and again).
        self._inbox: collections.deque[tuple[str, Request]] = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._error: BaseException | None = None
        # The engine is built on its thread too, so all its parallel CPU work runs on one
        # thread: OpenMP keeps a team of workers per thread that starts parallel work, and
        # two teams on the same cores make libgomp stop spinning at barriers (it throttles
        # when it manages more threads than there are cores), which slows every step when
        # the model is loaded on the caller's thread.
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(model, llm_kwargs),
                                        name="fastllm-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued in the engine, or not yet handed to it."""
        pending = sum(action == "add" for action, _ in list(self._inbox))
        return self.client.engine.num_waiting + pending

    @property
    def failed(self) -> bool:
        """Whether the engine thread ended on an error (no request can run any more)."""
        return self._error is not None

    async def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                     *, lora_request: LoRARequest | None = None) -> AsyncIterator[str]:
        """Yields one request's text deltas as the engine produces them; raises the request's
        error if it fails."""
        async for update in self.stream_outputs(prompt, sampling_params,
                                                lora_request=lora_request):
            if update.text:
                yield update.text

    async def stream_outputs(self, prompt: PromptType,
                             sampling_params: SamplingParams | None = None, *,
                             lora_request: LoRARequest | None = None
                             ) -> AsyncIterator[StreamDelta]:
        """Yields what each engine step added to one request (text, token ids, logprobs), the
        last with its finish reason; raises the request's error if it fails. A prompt or
        parameter the engine refuses raises here, before anything is yielded. With
        ``lora_request`` it runs with that LoRA adapter (see :meth:`fastllm.LLM.generate`)."""
        request, state, queue = self._submit(prompt, sampling_params, lora_request)
        try:
            sent = 0  # output tokens already yielded
            while True:
                deltas, finished, error, num_tokens = await queue.get()
                logprobs = None if state.logprobs is None else state.logprobs[sent:num_tokens]
                yield StreamDelta(
                    "".join(deltas), state.token_ids[sent:num_tokens], logprobs,
                    state.finish_reason if finished else None,
                    state.stop_reason if finished else None, state.output())
                sent = num_tokens
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            self._forget(request)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       *, lora_request: LoRARequest | None = None) -> RequestOutput:
        """The finished output of one request (with the LoRA adapter ``lora_request``, if
        given); raises the request's error if it fails."""
        request, state, queue = self._submit(prompt, sampling_params, lora_request)
        await self._finished(request, queue)
        return state.output()

    async def score(self, token_ids: Sequence[int], score_token_ids: Sequence[int]) -> Tensor:
        """The logits of ``score_token_ids`` at the last position of the prompt ``token_ids``
        (a prompt-only request of the running batch; its full blocks enter the prefix
        cache)."""
        request = self.client.make_scoring_request(token_ids, score_token_ids)
        await self._finished(request, self._subscribe(request))
        return request.scores

    async def embed(self, token_ids: Sequence[int], pooling: str = "last", *,
                    lora_request: LoRARequest | None = None) -> Tensor:
        """The prompt ``token_ids``' embedding (see :meth:`fastllm.LLM.embed`), a prompt-only
        request of the running batch."""
        request, = self.client.make_embedding_requests([list(token_ids)], pooling,
                                                       lora_request)
        await self._finished(request, self._subscribe(request))
        return request.embedding

    async def _finished(self, request: Request, queue: asyncio.Queue) -> None:
        """Waits until a subscribed request finishes; raises its error if it fails."""
        try:
            while True:
                _, finished, error, _ = await queue.get()
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            self._forget(request)

    def _submit(self, prompt: PromptType, sampling_params: SamplingParams | None,
                lora_request: LoRARequest | None
                ) -> tuple[Request, RequestState, asyncio.Queue]:
        if isinstance(sampling_params, (list, tuple)) or isinstance(lora_request, (list, tuple)):
            raise TypeError("AsyncLLM takes one prompt, one SamplingParams and one LoRARequest "
                            "per call")
        request, = self.client.make_requests([prompt], sampling_params, lora_request)
        state, = self.client.follow([request])
        return request, state, self._subscribe(request, state)

    def _subscribe(self, request: Request, state: RequestState | None = None) -> asyncio.Queue:
        """Has the engine thread add a request before its next step; the queue hears of each
        step that updates it (and of the error, when the engine refuses it: alone)."""
        if self._error is not None:
            raise RuntimeError("the engine thread failed") from self._error
        if self._closed:
            raise RuntimeError("this AsyncLLM was shut down")
        queue: asyncio.Queue = asyncio.Queue()
        with self._subscribers_lock:
            self._subscribers[request] = (asyncio.get_running_loop(), queue, state)
        self._inbox.append(("add", request))
        self._wake.set()
        return queue

    def _forget(self, request: Request) -> None:
        """Drops a request its caller stopped waiting for and aborts it if unfinished, freeing
        its KV blocks: now if no step is running, else before the next step."""
        with self._subscribers_lock:
            self._subscribers.pop(request, None)
        if request.finished:
            return
        if self.client.lock.acquire(blocking=False):
            try:
                self._apply_inbox()  # an add queued before it must not outlive it
                self.client.abort_unfinished([request])
            finally:
                self.client.lock.release()
        else:
            self._inbox.append(("abort", request))
            self._wake.set()

    def _apply_inbox(self) -> None:
        while self._inbox:
            action, request = self._inbox.popleft()
            if action == "abort":
                self.client.abort_unfinished([request])
                continue
            if request.finished:  # failed with the engine before it was added
                continue
            try:
                self.client.engine.add_request(request)
            except Exception as error:  # e.g. a prompt the KV pool cannot hold: it alone fails
                self.client.fail_request(request, error)
                self._notify(request)

    def _run(self, model: str | os.PathLike, llm_kwargs: dict[str, Any]) -> None:
        try:
            self.client = EngineClient(model, **llm_kwargs)
        except BaseException as error:  # raised again in the caller of __init__
            self._start_error = error
            return
        finally:
            self._started.set()
        engine = self.client.engine
        while not self._closed:
            with self.client.lock:
                self._apply_inbox()
                busy = engine.has_unfinished()
                if busy:
                    try:
                        updated = self.client.step()
                    except Exception as error:  # the engine's own failure, not one request's
                        updated = self._fail_unfinished(error)
                    except BaseException as error:  # the thread ends; every waiter hears of it
                        self._error = error
                        stopped = RuntimeError("the engine thread failed")
                        stopped.__cause__ = error
                        for request in self._fail_unfinished(stopped):
                            self._notify(request)
                        return
                    for request in updated:
                        self._notify(request)
            if not busy:
                self._wake.wait()
                self._wake.clear()

    def _notify(self, request: Request) -> None:
        with self._subscribers_lock:
            subscriber = self._subscribers.get(request)
        if subscriber is not None:
            loop, queue, state = subscriber
            update = ([], request.finished, request.error, 0) if state is None else (
                state.take_deltas(), state.finished, state.error, len(state.token_ids))
            loop.call_soon_threadsafe(queue.put_nowait, update)

    def _fail_unfinished(self, error: Exception) -> list[Request]:
        """Fails every subscribed request with ``error``, freeing the engine for new ones."""
        with self._subscribers_lock:
            failed = [request for request in self._subscribers if not request.finished]
        for request in failed:
            self.client.fail_request(request, error)
        return failed

    def shutdown(self) -> None:
        """Stops the engine thread, and the tensor-parallel ranks if any; unfinished requests
        are aborted."""
        self._closed = True
        self._wake.set()
        self._thread.join()
        with self.client.lock, self._subscribers_lock:
            self._inbox.clear()
            for request, (loop, queue, state) in list(self._subscribers.items()):
                self.client.abort_unfinished([request])
                loop.call_soon_threadsafe(queue.put_nowait, (
                    [], True, None, 0 if state is None else len(state.token_ids)))
            self.client.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
