"""The serving benchmark's defaults, its speedup table and, where llama-cpp-python's server is
installed (``make bench`` installs it), its quick run end to end against both servers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import find_model
from tiny_bench import import_benchmark

bench_serve = import_benchmark("bench_serve")


def test_defaults_are_make_benchs() -> None:
    config, out = bench_serve.parse_args([])
    assert config == bench_serve.ServeBenchConfig() and out == Path("results")
    assert config.concurrencies == (1, 8, 32)  # the levels, with its goals at 1 and 32
    assert set(bench_serve.GOALS) <= set(config.concurrencies)
    assert all(rate > 0 and not math.isinf(rate) for rate in config.request_rates)
    assert (config.prompt_len, config.output_tokens, config.threads) == (128, 64, 2)


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
