"""``fastllm.AsyncLLM``: the engine behind an asyncio interface.

    llm = fastllm.AsyncLLM("path/to/model")
    async for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(delta, end="")
    output = await llm.generate("The dog", SamplingParams(temperature=0))

A background thread steps the engine while any request is unfinished; every request added from
any coroutine joins the running batch at the next step. Cancelling the coroutine (or closing
the ``stream`` iterator) aborts its request, whose KV blocks are freed at once. A request that
fails inside a step raises its error in its own coroutine; the others go on, and so does the
thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastllm.engine.outputs import RequestOutput
from fastllm.engine.request import Request
from fastllm.entrypoints.client import EngineClient, PromptType
from fastllm.sampling import SamplingParams

__all__ = ["AsyncLLM"]


class AsyncLLM:
    """Continuous batching for asyncio callers; takes :class:`fastllm.LLM`'s arguments.

    Its engine client (``self.client``, the one :class:`fastllm.LLM` uses too) is stepped by a
    background thread. Call :meth:`shutdown` (or use ``async with``) to stop the thread.
    """

    def __init__(self, model: str | os.PathLike, **llm_kwargs: Any) -> None:
        self.client = EngineClient(model, **llm_kwargs)
        self._subscribers: dict[Request, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fastllm-engine", daemon=True)
        self._thread.start()

    async def stream(self, prompt: PromptType,
                     sampling_params: SamplingParams | None = None) -> AsyncIterator[str]:
        """Yields one request's text deltas as the engine produces them; raises the request's
        error if it fails."""
        request, queue = self._submit(prompt, sampling_params)
        try:
            while True:
                deltas, finished, error = await queue.get()
                for delta in deltas:
                    yield delta
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            self._forget(request)

    async def generate(self, prompt: PromptType,
                       sampling_params: SamplingParams | None = None) -> RequestOutput:
        """The finished output of one request; raises the request's error if it fails."""
        request, queue = self._submit(prompt, sampling_params)
        try:
            while True:
                _, finished, error = await queue.get()
                if error is not None:
                    raise error
                if finished:
                    return request.output()
        finally:
            self._forget(request)

    def _submit(self, prompt: PromptType, sampling_params: SamplingParams | None
                ) -> tuple[Request, asyncio.Queue]:
        if self._error is not None:
            raise RuntimeError("the engine thread failed") from self._error
        if self._closed:
            raise RuntimeError("this AsyncLLM was shut down")
        if isinstance(sampling_params, (list, tuple)):
            raise TypeError("AsyncLLM takes one prompt and one SamplingParams per call")
        request, = self.client.make_requests([prompt], sampling_params)
        queue: asyncio.Queue = asyncio.Queue()
        with self.client.lock:
            self.client.add([request])  # a bad request fails here, alone
            self._subscribers[request] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        return request, queue

    def _forget(self, request: Request) -> None:
        """Drops a request its caller stopped waiting for; aborts it if unfinished."""
        with self.client.lock:
            self._subscribers.pop(request, None)
            self.client.abort_unfinished([request])

    def _run(self) -> None:
        engine = self.client.engine
        while not self._closed:
            with self.client.lock:
                busy = engine.has_unfinished()
                if busy:
                    try:
                        updated = engine.step()
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
        subscriber = self._subscribers.get(request)
        if subscriber is not None:
            loop, queue = subscriber
            loop.call_soon_threadsafe(queue.put_nowait, (
                request.take_deltas(), request.finished, request.error))

    def _fail_unfinished(self, error: Exception) -> list[Request]:
        """Fails every subscribed request with ``error``, freeing the engine for new ones."""
        failed = [request for request in self._subscribers if not request.finished]
        for request in failed:
            self.client.engine.fail_request(request, error)
        return failed

    def shutdown(self) -> None:
        """Stops the engine thread; unfinished requests are aborted."""
        self._closed = True
        self._wake.set()
        self._thread.join()
        with self.client.lock:
            for request, (loop, queue) in list(self._subscribers.items()):
                self.client.abort_unfinished([request])
                loop.call_soon_threadsafe(queue.put_nowait, ([], True, None))

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
