"""Data parallelism: ``fastllm serve --data-parallel-size 2`` as users start it (the ``fastllm``
command in a process of its own, its replicas its children) on the tiny random Qwen3, talked to
over HTTP: one engine's greedy answers, both replicas busy under load, prefix affinity, per-rank
metrics, a replica killed mid-stream, the router killed; a lone ``--data-parallel-rank`` server;
``LLM(data_parallel_size=2)`` against one engine; and the refusals of bad options."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from conftest import free_port, http
from prometheus_client.parser import text_string_to_metric_families

from openai_server import running_server

from fastllm import LLM, AsyncLLM, SamplingParams
from fastllm.engine.kv_events import rank_endpoint
from fastllm.entrypoints.cli import main
from fastllm.entrypoints.data_parallel import assign_prompts
from fastllm.entrypoints.openai import data_parallel
from fastllm.entrypoints.openai.data_parallel import Replica, RouterConfig, _Router

MODEL = "tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
           "Lily and Tom went to the park", "1, 2, 3, 4,", "A long time ago"]
# Long enough to be in flight while a test looks (seconds of decoding on one thread).
LONG = {"max_tokens": 120, "ignore_eos": True}
# Streams long enough (most of --max-model-len) to be mid-way when a replica is killed.
LONGEST = {"max_tokens": 480, "ignore_eos": True}


@dataclass
class Server:
    process: subprocess.Popen  # the router
    base_url: str

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return http.post(self.base_url + path, json=body, timeout=60, **kwargs)

    def health(self) -> httpx.Response:
        return http.get(self.base_url + "/health", timeout=10)

    def replica_pids(self) -> list[int]:
        return [rank["pid"] for rank in self.health().json()["ranks"]]

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """Sample (name, labels less model_name) -> value."""
        text = http.get(self.base_url + "/metrics", timeout=10).text
        return {(sample.name, frozenset((k, v) for k, v in sample.labels.items()
                                        if k != "model_name")): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples}


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextlib.contextmanager
def serve(*argv: str, startup_s: float = 180) -> Iterator[Server]:
    """``fastllm serve ARGV`` on a free port until the block ends; then SIGTERM, and no process
    of it may stay."""
    process = subprocess.Popen([sys.executable, "-m", "fastllm", "serve", *argv,
                                "--port", str(free_port())],
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout],
                     daemon=True).start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert process.poll() is None, f"the server exited with code {process.returncode}"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if " on http://" in line:
                break
        server = Server(process, line.split(" on ", 1)[1].split("/v1", 1)[0])
        if "data-parallel replicas" in line:
            pids = server.replica_pids()
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=60)
        wait_for(lambda: not any(running(pid) for pid in pids), 30,
                 "a replica outlived its router")


def serve_args(folder: Path, *extra: str) -> list[str]:
    return [str(folder), "--served-model-name", MODEL, "--max-model-len", "512",
            "--batch-invariant", *extra]


@pytest.fixture(scope="module")
def events_port() -> int:
    """Rank 0 publishes its KV events here, rank 1 on the next port."""
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_qwen3, events_port) -> Iterator[Server]:
    """The server the module's tests share."""
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}",
              "topic": "kv"}
    with serve(*serve_args(tiny_qwen3, "--data-parallel-size", "2", "--kv-events-config",
                           json.dumps(config))) as server:
        yield server


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> LLM:
    """One engine as the replicas' (batch-invariant: the tokens do not depend on the batch)."""
    return LLM(tiny_qwen3, max_model_len=512, batch_invariant=True)


def completion(server: Server, prompt: str, **body) -> httpx.Response:
    response = server.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                               "temperature": 0, "max_tokens": 12, **body})
    assert response.status_code == 200, response.text
    return response


def streamed_text(server: Server, path: str, body: dict) -> tuple[str, str]:
    """A streamed reply's joined text and the rank that served it."""
    pieces = []
    with http.stream("POST", server.base_url + path, json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice.get("text") or choice.get("delta", {}).get("content")
                              or "")
    return "".join(pieces), response.headers["x-data-parallel-rank"]


# ---- answers -------------------------------------------------------------------------------------

def test_the_replicas_give_one_engines_greedy_answers(server, reference):
    expected = [o.outputs[0].text for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]
    ranks = set()
    for prompt, text in zip(PROMPTS, expected):
        response = completion(server, prompt)
        assert response.json()["choices"][0]["text"] == text
        ranks.add(response.headers["x-data-parallel-rank"])
        streamed, rank = streamed_text(server, "/v1/completions", {
            "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 12})
        assert streamed == text
        ranks.add(rank)
    assert ranks == {"0", "1"}  # idle replicas take turns: both answered

    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS[:4]]
    expected = [o.outputs[0].text for o in reference.chat(conversations, GREEDY,
                                                          use_tqdm=False)]
    for messages, text in zip(conversations, expected):
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12}
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == text
        assert streamed_text(server, "/v1/chat/completions", body)[0] == text


def test_every_endpoint_passes_through_and_broadcasts_reach_every_replica(server):
    models = http.get(server.base_url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    tokens = server.post("/tokenize", {"model": MODEL, "prompt": "Once upon a time"})
    assert tokens.status_code == 200 and tokens.json()["count"] == 4
    # A replica's own errors come back as it gave them.
    wrong = server.post("/v1/completions", {"model": "other", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["message"]
    reset = server.post("/reset_prefix_cache", {})
    assert reset.status_code == 200 and reset.headers["x-data-parallel-rank"] == "0,1"
    too_large = server.post("/v1/completions", {"model": MODEL, "prompt": "x" * (5 << 20)})
    assert too_large.status_code == 413


def test_prefix_affinity_keeps_a_prompt_on_its_replica_until_that_one_is_busy(server):
    for prompt in PROMPTS[:3]:
        ranks = {completion(server, prompt).headers["x-data-parallel-rank"] for _ in range(4)}
        assert len(ranks) == 1, (prompt, ranks)
    # A shared beginning (a system prompt) past the characters the router reads: one replica.
    system = "You are a helpful assistant who answers in short sentences. " * 6
    ranks = {server.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]}
    ).headers["x-data-parallel-rank"] for question in PROMPTS}
    assert len(ranks) == 1
    # Many at once with the same prompt: past the margin, the other replica takes some.
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: completion(server, "Affinity under load", **LONG),
                                  range(8)))
    assert {r.headers["x-data-parallel-rank"] for r in responses} == {"0", "1"}


def test_both_replicas_serve_under_load_and_their_metrics_say_so(server):
    def served() -> dict[str, float]:
        metrics = server.metrics()
        return {rank: sum(value for (name, labels), value in metrics.items()
                          if name == "fastllm_request_success_total"
                          and ("engine", rank) in labels) for rank in ("0", "1")}

    before = served()
    seen: dict[str, float] = {"0": 0.0, "1": 0.0}
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(completion, server, f"Story number {i}:", **LONG)
                   for i in range(8)]
        while not all(f.done() for f in futures):
            for (name, labels), value in server.metrics().items():
                if name == "vllm:num_requests_running":
                    rank = dict(labels)["engine"]
                    seen[rank] = max(seen[rank], value)
            time.sleep(0.05)
        ranks = [f.result().headers["x-data-parallel-rank"] for f in futures]
    assert sorted(ranks) == ["0"] * 4 + ["1"] * 4  # least busy first: four each
    assert seen["0"] >= 1 and seen["1"] >= 1  # the router gauges moved on both ranks
    after = served()
    assert after["0"] - before["0"] == 4 and after["1"] - before["1"] == 4
    metrics = server.metrics()
    for rank in ("0", "1"):
        engine = frozenset({("engine", rank)})
        assert metrics[("vllm:num_requests_running", engine)] == 0
        assert metrics[("fastllm_data_parallel_replica_up", engine)] == 1
        assert metrics[("fastllm_data_parallel_requests_in_flight", engine)] == 0


# ---- each rank's KV events, a rank alone ---------------------------------------------------------

def test_each_rank_publishes_kv_events_on_its_own_port(server, events_port):
    context = zmq.Context()
    subscribers = []
    try:
        for rank in (0, 1):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            sub.setsockopt(zmq.RCVTIMEO, 10_000)
            sub.connect(f"tcp://127.0.0.1:{events_port + rank}")
            subscribers.append(sub)
        time.sleep(0.5)  # the subscriptions reach the publishers (ZMQ's slow joiner)
        served: set[str] = set()
        for i in range(16):  # new prompts, a block long or more, until both replicas had one
            prompt = f"Prompt {i}: once upon a time there was a little girl named Lily. " * 2
            served.add(completion(server, prompt).headers["x-data-parallel-rank"])
            if len(served) == 2:
                break
        assert served == {"0", "1"}
        for rank, sub in enumerate(subscribers):
            _, _, payload = sub.recv_multipart()
            _, events, batch_rank = msgpack.unpackb(payload)
            assert batch_rank == rank and events[0][0] == "BlockStored"
    finally:
        for sub in subscribers:
            sub.close(linger=0)
        context.term()


def test_a_rank_served_alone_labels_its_metrics_with_it(model_path):
    llm = AsyncLLM(model_path("stories260K_hf"), max_model_len=128)
    try:
        with running_server(llm, MODEL, data_parallel_rank=3) as alone:
            http.post(alone.v1 + "/completions", json={"model": MODEL, "prompt": "Once",
                                                        "max_tokens": 2}, timeout=30)
            text = http.get(alone.base_url + "/metrics", timeout=10).text
    finally:
        llm.shutdown()
    samples = [sample for family in text_string_to_metric_families(text)
               for sample in family.samples]
    assert {sample.name for sample in samples} >= {"vllm:num_requests_running",
                                                  "fastllm_request_success_total",
                                                  "fastllm_http_requests_total"}
    assert all(sample.labels.get("engine") == "3" for sample in samples)


# ---- failures ------------------------------------------------------------------------------------

def test_a_killed_replica_fails_only_its_requests_and_a_killed_router_leaves_no_replica(
        tiny_qwen3):
    """On a server of its own, which it kills: pytest-xdist may run the module's tests in any
    order, so none may depend on coming last."""
    with serve(*serve_args(tiny_qwen3, "--data-parallel-size", "2")) as server:
        kill_a_replica_then_the_router(server)


def kill_a_replica_then_the_router(server: Server) -> None:
    pids = server.replica_pids()
    started = threading.Barrier(5)
    results: dict[int, tuple[str, list[dict]]] = {}

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Stream {i}", "stream": True, **LONGEST}
        with http.stream("POST", server.base_url + "/v1/completions", json=body,
                          timeout=60) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        started.wait()
            results[i] = (response.headers["x-data-parallel-rank"], events)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)  # every stream has its first token
    os.kill(pids[1], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=60)
    by_rank = {rank: [events for r, events in results.values() if r == rank]
               for rank in ("0", "1")}
    assert len(by_rank["0"]) == len(by_rank["1"]) == 2
    for events in by_rank["1"]:  # rank 1's end on an error naming it
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["message"].startswith(
            "data-parallel rank 1 failed: its process exited (signal SIGKILL)")
    for events in by_rank["0"]:  # rank 0's finish as if nothing happened
        assert not any("error" in event for event in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    health = server.health()
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert [(r["rank"], r["state"], r["exit_code"]) for r in health.json()["ranks"]] == [
        (0, "serving", None), (1, "exited", -signal.SIGKILL)]
    metrics = server.metrics()
    assert metrics[("fastllm_data_parallel_replica_up", frozenset({("engine", "1")}))] == 0
    assert metrics[("fastllm_data_parallel_replica_up", frozenset({("engine", "0")}))] == 1
    assert not any(("engine", "1") in labels for name, labels in metrics
                   if name.startswith("vllm:"))
    for i in range(4):  # rank 1's prompts included: all on rank 0 now
        assert completion(server, f"Stream {i}").headers["x-data-parallel-rank"] == "0"

    server.process.kill()  # no goodbye: the replica sees its router gone
    server.process.wait(timeout=10)
    wait_for(lambda: not running(pids[0]), 30, "rank 0 outlived its killed router")


# ---- offline -------------------------------------------------------------------------------------

def test_llm_data_parallel_generate_and_chat_equal_one_engine(tiny_qwen3, reference):
    prompts = PROMPTS + [PROMPTS[0] + " there was", [1, 2, 3, 4, 5]]
    expected = reference.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(tiny_qwen3, max_model_len=512, batch_invariant=True, data_parallel_size=2)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == \
            [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
        assert [o.prompt for o in got] == [o.prompt for o in expected]
        assert [o.request_id for o in got] == [str(i) for i in range(len(prompts))]
        conversation = [{"role": "user", "content": "Hello"}]
        assert llm.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text == \
            reference.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text
        # A bad prompt in either replica's share stops the call before anything runs.
        with pytest.raises(TypeError, match="got float"):
            llm.generate(["fine", 3.5, "fine too"], GREEDY, use_tqdm=False)
        assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text == \
            expected[0].outputs[0].text
        with pytest.raises(ValueError, match=r"LLM.embed does not run with data_parallel_size=2"):
            llm.embed("x")
        with pytest.raises(ValueError, match=r"LLM.stream does not run with data_parallel_size=2"):
            next(llm.stream("x"))
    finally:
        llm.shutdown()


def test_prompts_are_placed_by_prefix_then_by_tokens():
    # Two prompts share a prefix (key "a"): one replica holds both, the rest balance around.
    ranks = assign_prompts(["a", "b", "a", "c", "d"], [10, 8, 10, 5, 3], 2)
    assert ranks[0] == ranks[2]
    loads = [sum(c for c, r in zip([10, 8, 10, 5, 3], ranks) if r == rank) for rank in (0, 1)]
    assert sorted(loads) == [16, 20]
    assert assign_prompts(["x"] * 4, [1] * 4, 3) == [0] * 4


class _Running:
    """A replica's process that has not exited: the router reads only ``poll``."""

    def poll(self) -> None:
        return None


def test_the_router_follows_a_prefix_only_with_affinity_on():
    def route(config: RouterConfig, keys: list[str | None]) -> list[int]:
        replicas = [Replica(rank, _Running(), Path(f"rank{rank}.sock")) for rank in range(2)]
        router = _Router(replicas, config)
        return [router.choose(key, set()).rank for key in keys]

    # Idle replicas: one prompt beginning sent four times, then another's.
    keys = ["shared", "shared", "shared", "shared", "other"]
    assert route(RouterConfig(2), keys) == [0, 0, 0, 0, 1]
    assert route(RouterConfig(2, prefix_affinity=False), keys) == [0, 1, 0, 1, 0]

    replicas = [Replica(rank, _Running(), Path(f"rank{rank}.sock")) for rank in range(2)]
    router = _Router(replicas, RouterConfig(2, affinity_margin=1, prefix_affinity=False))
    replicas[0].in_flight = 1  # the one that served "shared" is busier: off, the other gets it
    assert router.choose("shared", set()).rank == 1
    replicas[1].in_flight = 3
    assert router.choose("shared", set()).rank == 0  # off: the least busy, whatever the margin
    assert router.choose("shared", {0}).rank == 1  # a replica out of reach is passed over
    with pytest.raises(ValueError, match="prefix_affinity must be a bool, got 'no'"):
        RouterConfig(2, prefix_affinity="no")


def test_the_cli_passes_prefix_affinity_to_the_router(model_path, monkeypatch):
    folder = str(model_path("stories260K_hf"))
    configs: list[RouterConfig] = []
    monkeypatch.setattr(data_parallel, "serve_data_parallel",
                        lambda argv, config, *args: configs.append(config))
    main(["serve", folder, "-dp", "2"])
    main(["serve", folder, "-dp", "2", "--no-data-parallel-prefix-affinity"])
    main(["serve", folder, "-dp", "2", "--data-parallel-prefix-affinity"])
    assert [config.prefix_affinity for config in configs] == [True, False, True]


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["-dp", "-2"], "--data-parallel-size must be >= 1, got -2"),
    (["-dp", "2", "--data-parallel-rank", "2"],
     "--data-parallel-rank must be in [0, --data-parallel-size=2), got 2"),
    (["--data-parallel-rank", "1"],
     "--data-parallel-rank must be in [0, --data-parallel-size=1), got 1"),
    (["-dp", "2", "--data-parallel-rank", "-1"],
     "--data-parallel-rank must be in [0, --data-parallel-size=2), got -1"),
    (["-dp", "2", "--device", "cuda:1"], "give device='cuda', not 'cuda:1'"),
], ids=["size-0", "size-negative", "rank-past-size", "rank-without-size", "rank-negative",
        "one-cuda-device"])
def test_the_cli_refuses_bad_data_parallel_options(model_path, capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_path("stories260K_hf")), *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_data_parallel_arguments_are_refused(model_path):
    folder = model_path("stories260K_hf")
    for size in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
            LLM(folder, data_parallel_size=size)
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    for endpoint in ("tcp://*", "tcp://*:65535"):
        with pytest.raises(ValueError, match="data_parallel_rank=1"):
            rank_endpoint(endpoint, 1)


def test_a_replica_whose_engine_failed_exits_so_the_router_drops_it():
    """A replica process whose engine failed ends with status 1 (an alive replica answering 503
    would keep getting requests); the engine here a stand-in whose ``failed`` turns true."""
    script = ("import time, types\n"
              "from fastllm.entrypoints.openai.data_parallel import exit_when_engine_fails\n"
              "engine = types.SimpleNamespace(failed=False)\n"
              "exit_when_engine_fails(engine)\n"
              "time.sleep(0.5)\n"
              "engine.failed = True\n"
              "time.sleep(60)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30
    assert "engine failed: the replica exits" in done.stderr
