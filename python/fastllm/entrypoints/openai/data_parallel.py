"""``fastllm serve --data-parallel-size N``: N replica servers behind one router on the user's
port (SGLang's ``--dp-size`` router, vLLM's internal load balancing, done over HTTP).

The front process starts N ``fastllm serve`` processes, rank r with ``--data-parallel-rank r``,
each listening on a unix socket of its own, with its share of the CPU threads or its own CUDA
devices (:mod:`fastllm.entrypoints.data_parallel`); each may be tensor-parallel in turn. The
router passes each request to one replica as it came and its answer back as it comes (a stream
event by event, status codes and headers kept, plus ``x-data-parallel-rank``), so every endpoint
works as one server's does. It picks the replica by its requests in flight, with prefix
affinity: a request whose prompt begins as an earlier one's (the first characters of its
``prompt`` / ``messages`` / ``input``, and its model) goes to the replica that served that one,
whose prefix cache holds it, unless that replica has ``affinity_margin`` more requests in flight
than the least busy one (``--no-data-parallel-prefix-affinity``: always the least busy).
``/reset_prefix_cache`` and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` go to every
replica.

A replica that dies fails only the requests it had (a 502, or an error event in a stream,
naming its rank), leaves the routing, and shows on ``/health`` (200 with each rank's state while
one serves, else 503) and ``/metrics``. ``/metrics`` merges the replicas' metrics, each sample
labelled ``engine="<rank>"`` (vLLM's label for data-parallel engines), with
``fastllm_data_parallel_replica_up`` and ``fastllm_data_parallel_requests_in_flight`` per rank.
Stopping the front stops the replicas; a replica whose front is gone (killed) stops itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from fastllm.entrypoints.async_llm import AsyncLLM
from fastllm.entrypoints.data_parallel import (check_data_parallel_size, replica_cuda_devices,
                                               replica_threads)
from fastllm.entrypoints.openai import protocol_messages
# The server's own error shapes and disconnect handling: the router answers as a replica would.
from fastllm.entrypoints.openai.api_server import (ClientDisconnected, bind, is_anthropic_path,
                                                   json_error, until_disconnected)
from fastllm.entrypoints.openai.serving import APIError, named_event

__all__ = ["Replica", "RouterConfig", "affinity_key", "build_router_app",
           "exit_when_engine_fails", "merge_metrics", "serve_data_parallel", "watch_parent"]

logger = logging.getLogger("fastllm")

# The fields a request's prompt is in, in the order the model reads them (Anthropic's system
# prompt and the Responses API's instructions before the conversation).
_PROMPT_FIELDS = ("system", "instructions", "messages", "prompt", "input", "query")
_BROADCAST = ("/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# Headers that describe one connection, not the request or response passed on.
_HOP_BY_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-connection", "proxy-authenticate", "proxy-authorization",
               "content-length"}
_AFFINITY_ENTRIES = 1 << 16  # prefixes remembered, least recently used forgotten first


@dataclass
class RouterConfig:
    """How the router spreads requests.

    Attributes:
        data_parallel_size: replicas.
        max_body_bytes: the largest request body the router reads (past it, a 413).
        affinity_prefix_chars: a request's prompt is known by this many first characters.
        affinity_margin: requests in flight that the replica holding a prompt's prefix may
            have beyond the least busy replica's and still get it.
        prefix_affinity: whether a prompt's beginning picks the replica at all; off, every
            request goes to the least busy one (the baseline affinity is measured against).
    """

    data_parallel_size: int
    max_body_bytes: int = 4 << 20
    affinity_prefix_chars: int = 256
    affinity_margin: int = 4
    prefix_affinity: bool = True

    def __post_init__(self) -> None:
        check_data_parallel_size(self.data_parallel_size)
        for name, least in (("max_body_bytes", 1), ("affinity_prefix_chars", 1),
                            ("affinity_margin", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.prefix_affinity, bool):
            raise ValueError(f"prefix_affinity must be a bool, got {self.prefix_affinity!r}")


def affinity_key(body: bytes, prefix_chars: int) -> str | None:
    """What a request's prompt begins with, hashed: its model and the first ``prefix_chars``
    characters of its prompt fields as JSON; None for a body with no prompt."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    prompt = [request[name] for name in _PROMPT_FIELDS if name in request]
    if not prompt:
        return None
    text = json.dumps([request.get("model"), prompt], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text[:prefix_chars].encode()).hexdigest()


class Replica:
    """One replica server: its process, the client that reaches it over its unix socket, and
    what the router counts of it."""

    def __init__(self, rank: int, process: subprocess.Popen, socket_path: Path) -> None:
        self.rank, self.process, self.socket_path = rank, process, socket_path
        self.client: httpx.AsyncClient | None = None  # made on the router's event loop
        self.in_flight = 0  # requests passed on and not yet answered in full
        self.routed = 0  # requests passed on since start
        self._exit_logged = False

    @property
    def exit_code(self) -> int | None:
        """The process's exit code once it exited (logged the first time it is seen), else
        None."""
        code = self.process.poll()
        if code is not None and not self._exit_logged:
            self._exit_logged = True
            logger.warning("data-parallel rank %d exited with code %d: the other ranks serve",
                           self.rank, code)
        return code

    def open(self) -> None:
        """Makes the client (no limit on connections: the replica's own queue limit
        answers). An idle connection is dropped before the replica's server would close it
        (uvicorn's keep-alive timeout, 5 s): reused at the moment the replica closes it, a
        request fails without an answer."""
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(self.socket_path)),
            base_url="http://replica", timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=2.0))

    async def failure(self, error: Exception) -> str:
        """What a request that ``error`` ended on this replica is told: the process's exit
        when it is gone (waiting a moment for a dying one to be reaped), else the error."""
        deadline = time.monotonic() + 1.0
        while self.exit_code is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        code = self.exit_code
        if code is not None:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            return f"data-parallel rank {self.rank} failed: its process exited ({how})"
        return f"data-parallel rank {self.rank} failed: {type(error).__name__}: {error}"

    async def state(self) -> str:
        """"serving" (its /health answers 200), "unhealthy" (another status), "unreachable"
        or "exited"."""
        if self.exit_code is not None:
            return "exited"
        try:
            response = await self.client.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return "unreachable"
        return "serving" if response.status_code == 200 else "unhealthy"


class _Router:
    """Picks a replica for each request: the least busy, or (with ``prefix_affinity``) the one
    holding its prefix."""

    def __init__(self, replicas: Sequence[Replica], config: RouterConfig) -> None:
        self.replicas, self.config = list(replicas), config
        self._affinity: collections.OrderedDict[str, int] = collections.OrderedDict()

    def live(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.exit_code is None]

    def choose(self, key: str | None, exclude: set[int]) -> Replica | None:
        """The replica for a request with affinity ``key`` (None: none; ignored without
        ``prefix_affinity``), among the live ones not in ``exclude``; None when there is none.
        Counts it as routed there."""
        candidates = [r for r in self.live() if r.rank not in exclude]
        if not candidates:
            return None
        # Ties go to the replica given the fewest requests, so an idle server alternates.
        chosen = min(candidates, key=lambda r: (r.in_flight, r.routed))
        if key is not None and self.config.prefix_affinity:
            last = self._affinity.get(key)
            holder = next((r for r in candidates if r.rank == last), None)
            if holder is not None and \
                    holder.in_flight <= chosen.in_flight + self.config.affinity_margin:
                chosen = holder
            self._affinity[key] = chosen.rank
            self._affinity.move_to_end(key)
            if len(self._affinity) > _AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        chosen.routed += 1
        return chosen


class _Relayed(StreamingResponse):
    """A replica's stream passed on; ``close`` runs however the response ends (finished, the
    client gone before the first byte, an error)."""

    def __init__(self, content: AsyncIterator[bytes], close: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _stream_error(path: str, message: str) -> bytes:
    """An error event in the stream format of the API ``path`` belongs to."""
    if is_anthropic_path(path):
        return named_event("error", {"error": protocol_messages.error_body(
            502, message)["error"]}).encode()
    if path == "/v1/responses":
        return named_event("error", {"code": None, "message": message, "param": None}).encode()
    error = APIError(502, message, type="internal_server_error")
    return f"data: {json.dumps(error.body())}\n\n".encode()


def merge_metrics(expositions: dict[int, str]) -> list[Metric]:
    """The replicas' Prometheus text (rank -> exposition) as one set of families: each sample
    labelled ``engine="<rank>"`` (kept where the replica set it), each family once."""
    families: dict[str, Metric] = {}
    for rank, text in expositions.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            merged.samples += [sample._replace(labels={"engine": str(rank), **sample.labels})
                               for sample in family.samples]
    return list(families.values())


class _Families:
    """Metric families as a registry, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def build_router_app(replicas: Sequence[Replica], config: RouterConfig) -> FastAPI:
    """The router in front of ``replicas`` (which serve already)."""
    router = _Router(replicas, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for replica in replicas:
            replica.open()
        try:
            yield
        finally:
            await asyncio.gather(*(replica.client.aclose() for replica in replicas))

    app = FastAPI(title="fastllm", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    async def read_body(request: Request) -> bytes | None:
        """The body, or None past ``max_body_bytes`` (read no further)."""
        limit = config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def too_large(path: str) -> JSONResponse:
        return json_error(413, f"the request body exceeds {config.max_body_bytes} bytes",
                          "invalid_request_error", code="request_too_large", path=path)

    def none_serving(path: str) -> JSONResponse:
        states = ", ".join(f"rank {r.rank} unreachable" if r.exit_code is None
                           else f"rank {r.rank} exited with code {r.exit_code}"
                           for r in router.replicas)
        return json_error(503, f"no data-parallel replica is serving ({states})",
                          "internal_server_error", path=path, headers={"Retry-After": "1"})

    async def exchange(replica: Replica, request: Request, body: bytes
                       ) -> tuple[httpx.Response, bytes | None]:
        """Passes the request to ``replica``: its response, and its whole body unless it is
        an event stream (then the response stays open for the caller to read and close)."""
        headers = [(k, v) for k, v in request.headers.raw
                   if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        upstream = await replica.client.send(
            replica.client.build_request(request.method, request.url.path,
                                         params=request.url.query or None, headers=headers,
                                         content=body), stream=True)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return upstream, None
        try:
            return upstream, b"".join([chunk async for chunk in upstream.aiter_raw()])
        finally:
            await upstream.aclose()

    def response_headers(upstream: httpx.Response, ranks: str) -> dict[str, str]:
        # The router's server sends its own date and server headers.
        headers = {k: v for k, v in upstream.headers.items()
                   if k.lower() not in _HOP_BY_HOP and k.lower() not in ("date", "server")}
        headers["x-data-parallel-rank"] = ranks
        return headers

    async def relay(replica: Replica, upstream: httpx.Response, path: str
                    ) -> AsyncIterator[bytes]:
        """The replica's events as they come, whole (a dead replica's last partial one is
        dropped), then an error event if the replica failed."""
        pending = b""
        try:
            async for chunk in upstream.aiter_raw():
                pending += chunk
                end = pending.rfind(b"\n\n") + 2
                if end > 1:
                    yield pending[:end]
                    pending = pending[end:]
            if pending:
                yield pending
        except httpx.HTTPError as error:
            yield _stream_error(path, await replica.failure(error))

    @app.get("/health")
    async def health() -> JSONResponse:
        states = await asyncio.gather(*(replica.state() for replica in replicas))
        serving = sum(state == "serving" for state in states)
        ranks = [{"rank": r.rank, "state": state, "pid": r.process.pid,
                  "in_flight": r.in_flight, "exit_code": r.exit_code}
                 for r, state in zip(replicas, states)]
        status = "ok" if serving == len(replicas) else "degraded" if serving else "unavailable"
        return JSONResponse({"status": status, "data_parallel_size": len(replicas),
                             "ranks": ranks}, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        async def scrape(replica: Replica) -> str | None:
            if replica.exit_code is not None:
                return None
            try:
                response = await replica.client.get("/metrics", timeout=10.0)
            except httpx.HTTPError:
                return None
            return response.text if response.status_code == 200 else None

        texts = await asyncio.gather(*(scrape(replica) for replica in replicas))
        up = GaugeMetricFamily("fastllm_data_parallel_replica_up", "Whether the data-parallel "
                               "rank's process runs and its metrics were read.",
                               labels=["engine"])
        in_flight = GaugeMetricFamily("fastllm_data_parallel_requests_in_flight",
                                      "Requests the router passed to the rank and that are "
                                      "not answered yet.", labels=["engine"])
        for replica, text in zip(replicas, texts):
            up.add_metric([str(replica.rank)], float(text is not None))
            in_flight.add_metric([str(replica.rank)], replica.in_flight)
        merged = merge_metrics({r.rank: text for r, text in zip(replicas, texts)
                                if text is not None})
        return Response(generate_latest(_Families([up, in_flight, *merged])),
                        media_type=CONTENT_TYPE_LATEST)

    async def broadcast(request: Request) -> Response:
        """The request to every live replica; the first failure's answer, else the first
        replica's."""
        path = request.url.path
        body = await read_body(request)
        if body is None:
            return too_large(path)
        live = router.live()
        if not live:
            return none_serving(path)

        async def one(replica: Replica) -> tuple[Replica, httpx.Response | str, bytes]:
            try:
                upstream, content = await exchange(replica, request, body)
            except httpx.HTTPError as error:
                return replica, await replica.failure(error), b""
            return replica, upstream, content

        answers = await asyncio.gather(*(one(replica) for replica in live))
        for replica, upstream, content in answers:
            if isinstance(upstream, str):
                return json_error(502, upstream, "internal_server_error", path=path)
            if upstream.status_code >= 400:
                return Response(content, upstream.status_code,
                                response_headers(upstream, str(replica.rank)))
        _, upstream, content = answers[0]
        return Response(content, upstream.status_code, response_headers(
            upstream, ",".join(str(replica.rank) for replica, _, _ in answers)))

    for path in _BROADCAST:
        app.add_api_route(path, broadcast, methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                            "OPTIONS"])
    async def proxy(request: Request) -> Response:
        path = request.url.path
        body = await read_body(request)
        if body is None:
            return too_large(path)
        key = affinity_key(body, config.affinity_prefix_chars) if body else None
        unreachable: set[int] = set()  # replicas the request never reached: try another
        while True:
            replica = router.choose(key, unreachable)
            if replica is None:
                return none_serving(path)
            replica.in_flight += 1
            relayed = False
            try:
                upstream, content = await until_disconnected(
                    request, exchange(replica, request, body))
                if content is not None:
                    return Response(content, upstream.status_code,
                                    response_headers(upstream, str(replica.rank)))

                async def close() -> None:
                    replica.in_flight -= 1
                    await upstream.aclose()

                relayed = True
                return _Relayed(relay(replica, upstream, path), close,
                                status_code=upstream.status_code,
                                headers=response_headers(upstream, str(replica.rank)))
            except ClientDisconnected:
                return Response(status_code=499)  # nginx's "client closed request"
            except httpx.ConnectError:
                unreachable.add(replica.rank)
            except httpx.HTTPError as error:
                return json_error(502, await replica.failure(error), "internal_server_error",
                                  path=path)
            finally:
                if not relayed:
                    replica.in_flight -= 1

    return app


# ---- processes -----------------------------------------------------------------------------------

def _start_replicas(argv: Sequence[str], size: int, device: str, tensor_parallel_size: int,
                    sockets: Path) -> list[Replica]:
    """Starts ``fastllm serve`` (``argv``: the front's own arguments) as each rank, on a unix
    socket in ``sockets``, with its threads and devices."""
    threads = replica_threads(size)
    devices = [replica_cuda_devices(device, rank, size, tensor_parallel_size)
               for rank in range(size)]
    replicas: list[Replica] = []
    for rank in range(size):
        path = sockets / f"rank{rank}.sock"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if devices[rank] is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices[rank]
        process = subprocess.Popen(
            [sys.executable, "-m", "fastllm", *argv, "--data-parallel-rank", str(rank),
             "--data-parallel-socket", str(path), "--data-parallel-parent", str(os.getpid())],
            env=env, stdin=subprocess.DEVNULL)
        replicas.append(Replica(rank, process, path))
    return replicas


def _wait_until_serving(replicas: Sequence[Replica]) -> None:
    """Returns once every replica answers /health; an OSError naming the first that exited
    instead (its own error went to stderr)."""
    # One client a replica for the whole wait: making one loads the CA certificates, work
    # that would otherwise compete with the replicas' own start-up at each poll.
    clients = {replica.rank: httpx.Client(
        transport=httpx.HTTPTransport(uds=str(replica.socket_path)), timeout=5.0)
        for replica in replicas}
    try:
        waiting = list(replicas)
        while waiting:
            for replica in list(waiting):
                code = replica.process.poll()
                if code is not None:
                    raise OSError(f"data-parallel rank {replica.rank} exited with code {code} "
                                  "while starting (its error is above)")
                try:
                    if clients[replica.rank].get("http://replica/health").status_code == 200:
                        waiting.remove(replica)
                except httpx.HTTPError:
                    pass  # still loading: its socket is bound once the engine is built
            time.sleep(0.1)
    finally:
        for client in clients.values():
            client.close()


def _stop_replicas(replicas: Sequence[Replica]) -> None:
    """SIGTERM (each shuts down as a server does), then SIGKILL for those still there."""
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.terminate()
    deadline = time.monotonic() + 15
    for replica in replicas:
        try:
            replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


def serve_data_parallel(argv: Sequence[str], config: RouterConfig, host: str, port: int,
                        model_name: str, device: str = "cpu",
                        tensor_parallel_size: int = 1) -> None:
    """Runs ``config.data_parallel_size`` replicas of ``fastllm serve argv`` (each given its
    rank) and the router on ``host:port`` until the server is stopped; then stops them."""
    with tempfile.TemporaryDirectory(prefix="fastllm-dp-") as sockets:
        replicas = _start_replicas(argv, config.data_parallel_size, device,
                                   tensor_parallel_size, Path(sockets))
        try:
            _wait_until_serving(replicas)
            sock = bind(host, port)
            server = uvicorn.Server(uvicorn.Config(build_router_app(replicas, config),
                                                   log_level="warning",
                                                   timeout_graceful_shutdown=5))
            print(f"fastllm serve: {model_name} on http://{host}:{sock.getsockname()[1]}/v1 "
                  f"({config.data_parallel_size} data-parallel replicas)", flush=True)
            server.run(sockets=[sock])
        finally:
            _stop_replicas(replicas)


def bind_unix(path: str) -> socket.socket:
    """A listening unix socket at ``path``: a replica's, for its router."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(2048)
    return sock


def watch_parent(parent_pid: int) -> None:
    """Stops this process (SIGTERM: a server shuts down cleanly) once ``parent_pid`` is no
    longer its parent, i.e. the router that started it is gone, even killed; forcibly if it
    is still there seconds later."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        logger.warning("the data-parallel router (pid %d) is gone: this replica stops",
                       parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(15)
        os._exit(1)

    threading.Thread(target=watch, name="fastllm-parent-watch", daemon=True).start()


def exit_when_engine_fails(llm: AsyncLLM) -> None:
    """Ends this replica's process (status 1) once its engine has failed: no request can run
    here any more, and a replica that is gone is one the router takes out of routing (an alive
    one answering 503 on /health would keep getting requests)."""

    def watch() -> None:
        while not llm.failed:
            time.sleep(0.5)
        logger.error("this data-parallel replica's engine failed: the replica exits")
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="fastllm-engine-watch", daemon=True).start()
