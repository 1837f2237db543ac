"""The W4A16 checkpoint benchmark's defaults (the issue's Qwen3-0.6B shape, in the full set
only), its refusals, and a run end to end on a one-layer model: fastllm holds the checkpoint's
projections as Q4_0 blocks and the row holds each system's medians and the ratios."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from tiny_bench import import_benchmark

from fastllm.bench.timer import TimerConfig

bench_checkpoints = import_benchmark("bench_checkpoints")

TINY = ["--layers", "1", "--hidden-size", "128", "--intermediate-size", "256", "--prompt-len",
        "12", "--decode-tokens", "3", "--repeats", "1", "--warmup", "0"]


def test_defaults_are_the_issues_workload() -> None:
    config, out = bench_checkpoints.parse_args([])
    assert config == bench_checkpoints.CheckpointBenchConfig() and out == Path("results")
    assert (config.layers, config.hidden_size, config.intermediate_size, config.group_size,
            config.prompt_len, config.dtype) == (28, 1024, 3072, 128, 512, "bfloat16")
    assert config.at_goal_size and config.systems == ("w4a16", "q4_0_gguf", "hf", "hf_float32")
    assert config.timer == TimerConfig(warmup=1, repeats=3, budget_s=60.0)
    float32, _ = bench_checkpoints.parse_args(["--dtype", "float32"])
    assert float32.systems == ("w4a16", "q4_0_gguf", "hf")


def test_in_the_full_set_only(run_all: ModuleType) -> None:
    assert run_all.BENCHMARKS["checkpoints"] is bench_checkpoints.main
    assert "checkpoints" not in run_all.DEFAULT_SET


@pytest.mark.parametrize("change, match", [
    (dict(dtype="float16"), "dtype must be float32 or bfloat16"),
    (dict(group_size=48), "group_size must be a multiple of 32"),
    (dict(hidden_size=96), r"hidden_size \(96\) must be a multiple of group_size \(128\)"),
    (dict(decode_tokens=0), "must be >= 1")])
def test_bad_configs_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench_checkpoints.CheckpointBenchConfig(**change)


def test_tiny_run_writes_its_row(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ["--out", str(tmp_path), "--cache-dir", str(cache), *TINY]
    document = bench_checkpoints.main(args)
    assert json.loads((tmp_path / "checkpoints.json").read_text())["rows"] == document["rows"]
    [row] = document["rows"]
    assert row["w4a16_weight_types"] == ["Q4_0"]  # groups of 128 as blocks of 32, exactly
    for name in ("w4a16", "q4_0_gguf", "hf", "hf_float32"):
        assert row[f"{name}_decode_tok_s"] > 0 and len(row[f"{name}_tokens"]) == 4
    assert row["decode_vs_q4_0"] == row["w4a16_decode_tok_s"] / row["q4_0_gguf_decode_tok_s"]
    assert row["decode_vs_hf"] == (row["w4a16_decode_tok_s"]
                                   / row[f"{row['best_hf']}_decode_tok_s"])
    assert "not measured in this run" in (tmp_path / "checkpoints.md").read_text()
    made = sorted(path.name for path in cache.iterdir())
    assert len(made) == 2 and not any(name.endswith(".partial") for name in made)
    bench_checkpoints.main(args)  # the cached files serve a second run
    assert sorted(path.name for path in cache.iterdir()) == made
