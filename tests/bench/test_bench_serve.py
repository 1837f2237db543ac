"""The serving benchmark's defaults, its speedup tables and, where llama-cpp-python's server is
installed (``make bench`` installs it), its quick run end to end against both servers; its
data-parallel section's quick run end to end (fastllm's servers only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import find_model
from tiny_bench import import_benchmark

from fastllm.tokenizer import Tokenizer

bench_serve = import_benchmark("bench_serve")


def test_defaults_are_make_benchs() -> None:
    config, out = bench_serve.parse_args([])
    assert config == bench_serve.ServeBenchConfig() and out == Path("results")
    assert config.concurrencies == (1, 8, 32)  # the levels, with its goals at 1 and 32
    assert set(bench_serve.GOALS) <= set(config.concurrencies)
    assert all(rate > 0 and not math.isinf(rate) for rate in config.request_rates)
    assert (config.prompt_len, config.output_tokens, config.threads) == (128, 64, 2)
    assert config.sections == ("levels",)  # make bench's serve: the data-parallel part is opt-in
    assert config.max_concurrency == 32


def test_data_parallel_options() -> None:
    config, _ = bench_serve.parse_args(["--sections", "data_parallel"])
    assert config.sections == ("data_parallel",)
    assert (config.data_parallel_size, config.dp_requests, config.dp_concurrency,
            config.dp_repeats) == (2, 32, 32, 2)
    assert (config.prefix_groups, config.prefix_len, config.prefix_request_rate) == (4, 384, 8.0)
    config, _ = bench_serve.parse_args([
        "--sections", "levels", "data_parallel", "--threads", "4", "--data-parallel-size", "4",
        "--dp-requests", "8", "--dp-concurrency", "64", "--dp-repeats", "3", "--prefix-groups",
        "2", "--prefix-len", "100", "--prefix-request-rate", "inf"])
    assert config.sections == ("levels", "data_parallel") and config.data_parallel_size == 4
    assert (config.dp_requests, config.dp_concurrency, config.dp_repeats) == (8, 64, 3)
    assert (config.prefix_groups, config.prefix_len) == (2, 100)
    assert math.isinf(config.prefix_request_rate) and config.max_concurrency == 64
    quick, _ = bench_serve.parse_args(["--quick", "--sections", "data_parallel"])
    assert (quick.dp_requests, quick.prefix_groups, quick.dp_repeats) == (4, 2, 1)
    assert quick.max_concurrency == quick.dp_concurrency == 4
    server = bench_serve.data_parallel_servers(config)["dp_no_affinity"]
    assert server.options == ["--data-parallel-size", "4", "--no-data-parallel-prefix-affinity"]
    assert bench_serve.data_parallel_servers(config)["one"].options == []


DATA_PARALLEL = ("data_parallel",)


@pytest.mark.parametrize("options, message", [
    ({"sections": DATA_PARALLEL, "data_parallel_size": 1},
     r"data_parallel_size must be in \[2, threads=2\].*got 1"),
    ({"sections": DATA_PARALLEL, "data_parallel_size": 3},
     r"data_parallel_size must be in \[2, threads=2\].*got 3"),
    ({"sections": DATA_PARALLEL, "threads": 1},
     r"data_parallel_size must be in \[2, threads=1\].*got 2"),
    ({"dp_requests": 0}, "dp_requests must be >= 1, got 0"),
    ({"dp_repeats": 0}, "dp_repeats must be >= 1, got 0"),
    ({"prefix_groups": 0}, "prefix_groups must be >= 1, got 0"),
    ({"prefix_groups": 40}, "prefix_groups must be <= dp_requests=32"),
    ({"prefix_request_rate": 0.0}, "prefix_request_rate must be > 0"),
    ({"sections": ()}, "sections must be distinct ones of"),
    ({"sections": ("levels", "levels")}, "sections must be distinct ones of"),
    ({"sections": ("tensor_parallel",)}, "sections must be distinct ones of"),
])
def test_bad_data_parallel_configs(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench_serve.ServeBenchConfig(**options)


def test_bad_data_parallel_options_on_the_command_line() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be in"):
        bench_serve.parse_args(["--sections", "data_parallel", "--data-parallel-size", "4"])
    with pytest.raises(SystemExit):  # argparse: not a section
        bench_serve.parse_args(["--sections", "speculative"])
    config, _ = bench_serve.parse_args(["--threads", "1"])  # levels alone: no replicas to share
    assert config.threads == 1


def test_quick_and_bad_configs() -> None:
    config, _ = bench_serve.parse_args(["--quick", "--output-tokens", "3"])
    assert config.concurrencies == (1, 4) and config.output_tokens == 3
    with pytest.raises(ValueError, match="one value per level"):
        bench_serve.ServeBenchConfig(concurrencies=(1, 2), request_rates=(1.0,), requests=(1,))
    with pytest.raises(ValueError, match="output_tokens"):
        bench_serve.ServeBenchConfig(output_tokens=1)
    with pytest.raises(SystemExit):  # argparse: llama.cpp runs on the CPU here
        bench_serve.parse_args(["--device", "cuda"])


def test_speedups_and_goals() -> None:
    def row(engine: str, concurrency: int, tok_s: float, ttft: float) -> dict:
        return {"engine": engine, "concurrency": concurrency, "output_tok_s": tok_s,
                "ttft_p50_ms": ttft, "tpot_p50_ms": 10.0}
    rows = [row("fastllm", 1, 100, 50), row("llama_cpp", 1, 110, 100),
            row("fastllm", 32, 400, 50), row("llama_cpp", 32, 100, 100)]
    one, thirty_two = bench_serve.speedup_rows(rows)
    assert one["output_tok_s_speedup"] == pytest.approx(100 / 110) and one["met"] == "no"
    assert thirty_two["output_tok_s_speedup"] == 4 and thirty_two["met"] == "yes"
    assert one["ttft_p50_speedup"] == 2


def test_data_parallel_speedups() -> None:
    def row(workload: str, server: str, tok_s: float, ttft: float) -> dict:
        return {"workload": workload, "server": server, "output_tok_s": tok_s,
                "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "tpot_p50_ms": 10.0}
    rows = [row("distinct", "-dp 2", 150, 100), row("distinct", "one", 100, 200),
            row("shared_prefixes", "-dp 2", 120, 50), row("shared_prefixes", "none", 120, 100)]
    distinct, shared = bench_serve.data_parallel_speedup_rows(rows)
    assert distinct["comparison"] == "-dp 2 over one" and distinct["output_tok_s_speedup"] == 1.5
    assert distinct["ttft_p50_speedup"] == 2 and distinct["ttft_p99_speedup"] == 2
    assert shared["workload"] == "shared_prefixes" and shared["output_tok_s_speedup"] == 1
    assert shared["tpot_p50_speedup"] == 1


def test_shared_prefix_prompts(smollm2_path: Path) -> None:
    config = bench_serve.ServeBenchConfig(models_dir=str(find_model("rerank_eval").parent),
                                          dp_requests=6, prefix_groups=3, prefix_len=80)
    tokenizer = Tokenizer.from_pretrained(smollm2_path)
    prompts = bench_serve.shared_prefix_prompts(tokenizer, config)
    assert len(set(prompts)) == 6
    prefixes = [prompt.split("\n\nQuestion: ")[0] for prompt in prompts]
    assert sorted(prefixes.count(prefix) for prefix in set(prefixes)) == [2, 2, 2]
    assert prefixes != [prefixes[i % 3] for i in range(6)]  # shuffled, not in turn
    # The shared part is longer than the router's affinity key reads, so affinity decides.
    assert all(len(prefix) > 256 for prefix in prefixes)
    for prefix in set(prefixes):  # DL19's passages are shorter: several, joined
        assert len(tokenizer.encode(prefix, add_special_tokens=False)) == pytest.approx(80, abs=4)


@pytest.mark.llama_cpp
@pytest.mark.usefixtures("llama_cpp")
def test_quick_run_writes_rows(tmp_path: Path, smollm2_path: Path) -> None:
    models_dir = find_model("rerank_eval").parent
    document = bench_serve.main(["--quick", "--out", str(tmp_path), "--models-dir",
                                 str(models_dir)])
    written = json.loads((tmp_path / "serve.json").read_text())
    assert written["rows"] == document["rows"]
    levels = [row for row in written["rows"] if row["table"] == "levels"]
    assert sorted((row["engine"], row["concurrency"]) for row in levels) == [
        ("fastllm", 1), ("fastllm", 4), ("llama_cpp", 1), ("llama_cpp", 4)]
    for row in levels:
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["tpot_p50_ms"] > 0
        assert row["output_tok_s"] == pytest.approx(row["requests"] * 4 / row["wall_s"])
    speedups = [row for row in written["rows"] if row["table"] == "speedup"]
    assert [row["concurrency"] for row in speedups] == [1, 4]
    assert "| fastllm serve | 1 |" in (tmp_path / "serve.md").read_text()


def test_quick_data_parallel_run_writes_rows(tmp_path: Path) -> None:
    # Three fastllm servers of the real SmolLM2 GGUF (one replica, two with and without prefix
    # affinity), 4 requests of 4 output tokens a run: no llama.cpp. One request in flight at a
    # time, so that a passage's second request comes once its first is cached.
    models_dir = find_model("rerank_eval").parent
    document = bench_serve.main(["--quick", "--sections", "data_parallel", "--dp-concurrency",
                                 "1", "--out", str(tmp_path), "--models-dir", str(models_dir)])
    written = json.loads((tmp_path / "serve.json").read_text())
    assert written["rows"] == document["rows"]
    assert not [row for row in written["rows"] if row["table"] in ("levels", "speedup")]
    rows = [row for row in written["rows"] if row["table"] == "data_parallel"]
    assert [(row["workload"], row["data_parallel_size"], row["prefix_affinity"])
            for row in rows] == [("distinct", 2, True), ("distinct", 1, True),
                                 ("shared_prefixes", 2, True), ("shared_prefixes", 2, False)]
    for row in rows:
        assert row["requests"] == 4 and row["repeats"] == 1 and row["concurrency"] == 1
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["tpot_p50_ms"] > 0
        assert row["output_tok_s"] == pytest.approx(4 * 4 / row["wall_s"])
    # 16-token prompts fill no block the cache could hold: nothing looked up.
    assert rows[0]["prefix_cache_hit_rate"] is rows[1]["prefix_cache_hit_rate"] is None
    # The runs start cold; with affinity the second request of each passage goes where the
    # first was, and finds its blocks there.
    assert 0 < rows[2]["prefix_cache_hit_rate"] < 1
    assert 0 <= rows[3]["prefix_cache_hit_rate"] <= rows[2]["prefix_cache_hit_rate"]
    ratios = [row for row in written["rows"] if row["table"] == "data_parallel_speedup"]
    assert [row["comparison"] for row in ratios] == [
        "fastllm serve -dp 2 over fastllm serve, 1 replica",
        "fastllm serve -dp 2 over fastllm serve -dp 2, no prefix affinity"]
    markdown = (tmp_path / "serve.md").read_text()
    assert "| shared_prefixes | fastllm serve -dp 2, no prefix affinity | 4 |" in markdown
