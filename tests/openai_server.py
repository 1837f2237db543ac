"""A real ``fastllm serve`` server for tests: uvicorn on 127.0.0.1, on a free port, in a thread
of the test process (so a test can look at the engine behind it), shut down cleanly; and what
tests read of it (its finished requests, an idle engine)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from conftest import http

from fastllm import AsyncLLM
from fastllm.entrypoints.openai.api_server import ServerConfig, bind, build_server


@dataclass
class RunningServer:
    llm: AsyncLLM
    base_url: str  # http://127.0.0.1:PORT
    model: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


@contextlib.contextmanager
def running_server(llm: AsyncLLM, model: str = "test-model",
                   **config: object) -> Iterator[RunningServer]:
    """Serves ``llm`` until the block ends (the AsyncLLM is the caller's to shut down)."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = build_server(llm, ServerConfig(port=port, **config), model)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(llm, f"http://127.0.0.1:{port}", model)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the test server did not stop")


def finished(server: RunningServer) -> dict[str, float]:
    """The server's count of finished requests by reason (its /metrics)."""
    counts = {"length": 0.0, "stop": 0.0, "abort": 0.0}
    for line in http.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith("fastllm_request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


def wait_idle(llm: AsyncLLM, seconds: float = 5.0) -> None:
    """Until no request holds a KV block (fails after ``seconds``)."""
    engine = llm.client.engine
    deadline = time.monotonic() + seconds
    while engine.num_running or engine.num_waiting or engine.kv_usage:
        assert time.monotonic() < deadline, (engine.num_running, engine.num_waiting,
                                             engine.kv_usage)
        time.sleep(0.005)
