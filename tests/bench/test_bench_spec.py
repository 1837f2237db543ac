"""The speculative decoding benchmark's defaults, and its quick run end to end on the shipped
SmolLM2 file: rows with speedups and acceptance rates, the same tokens with and without
speculation (the run fails otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastllm.bench.timer import TimerConfig
from tiny_bench import import_benchmark

bench_spec = import_benchmark("bench_spec")


def test_defaults_are_make_benchs() -> None:
    config, out = bench_spec.parse_args([])
    assert config == bench_spec.SpecBenchConfig() and out == Path("results")
    assert (config.files, config.methods, config.tasks) == (
        ("F16", "Q8_0"), ("ngram", "draft"), ("code_edit", "summarize", "free_writing"))
    assert (config.draft_target, config.draft_file, config.k, config.draft_k,
            config.decode_tokens, config.threads) == ("F16", "Q4_0", 4, 3, 128, 2)
    assert config.timer == TimerConfig(warmup=1, repeats=3, budget_s=20.0)
    assert config.peer == "llama_cpp" and bench_spec.SpecBenchConfig.quick().peer == "none"


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="files must be some of"):
        bench_spec.SpecBenchConfig(files=("Q2_K",))
    with pytest.raises(ValueError, match="draft_target"):
        bench_spec.SpecBenchConfig(draft_file="Q3")
    with pytest.raises(ValueError, match="decode_tokens"):
        bench_spec.SpecBenchConfig(decode_tokens=0)
    with pytest.raises(ValueError, match="peer must be one of"):
        bench_spec.SpecBenchConfig(peer="ollama")


def test_quick_run_writes_rows(tmp_path: Path, smollm2_path: Path) -> None:
    config, _ = bench_spec.parse_args(["--quick"])
    assert (config.files, config.draft_target, config.draft_file, config.decode_tokens) == (
        ("Q4_1",), "Q4_1", "Q4_1", 16)
    document = bench_spec.main(["--out", str(tmp_path), "--quick", "--tasks", "code_edit",
                                "--decode-tokens", "8"])
    rows = document["rows"]
    assert [(row["file"], row["method"], row["task"]) for row in rows] == [
        ("Q4_1", "ngram", "code_edit"), ("Q4_1", "draft", "code_edit")]
    for row in rows:
        assert row["speedup"] > 0 and row["plain_decode_tok_s"] > 0
        assert row["acceptance_rate"] is None or 0 <= row["acceptance_rate"] <= 1
    assert rows[0]["acceptance_rate"] > 0  # the answer copies the prompt's code
    assert json.loads((tmp_path / "spec.json").read_text())["rows"] == rows
    assert "| speedup |" in (tmp_path / "spec.md").read_text().replace("speedup | acceptance",
                                                                       "speedup |")


@pytest.mark.llama_cpp
@pytest.mark.usefixtures("llama_cpp")
def test_quick_run_beside_llama_cpps_prompt_lookup(tmp_path: Path, smollm2_path: Path) -> None:
    document = bench_spec.main(["--out", str(tmp_path), "--quick", "--methods", "ngram",
                                "--tasks", "code_edit", "--decode-tokens", "8",
                                "--peer", "llama_cpp"])
    ngram, peer = document["rows"]
    assert (ngram["method"], peer["method"]) == ("ngram", "llama.cpp ngram")
    assert peer["speedup"] == pytest.approx(peer["spec_decode_tok_s"]
                                            / peer["plain_decode_tok_s"])
    assert ngram["vs_llama_cpp_ngram"] == pytest.approx(ngram["spec_decode_tok_s"]
                                                        / peer["spec_decode_tok_s"])
    goals = (tmp_path / "spec.md").read_text().split("## Goals")[1]
    assert "ngram code_edit" in goals and "llama.cpp" not in goals  # the peer has no goal
