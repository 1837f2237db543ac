"""The generation benchmark end to end at tiny sizes (fastllm and HF generate the same greedy
tokens in float32, and the rows hold what the report says), and its defaults per device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import find_model

from fastllm.bench.timer import TimerConfig
from tiny_bench import import_benchmark

bench_generate = import_benchmark("bench_generate")

VOCAB, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 151_936, 64, 192, 16, 8, 128


def test_cpu_defaults_are_make_benchs() -> None:
    config, _ = bench_generate.parse_args([])
    assert config == bench_generate.GenerateBenchConfig.for_device("cpu")
    assert config == bench_generate.GenerateBenchConfig()
    assert (config.dtypes, config.prompt_len, config.decode_tokens, config.device) == (
        ("float32", "bfloat16"), 512, 64, "cpu")
    assert config.timer == TimerConfig(warmup=1, repeats=3, budget_s=30.0)
    assert config.at_goal_size


def test_cuda_defaults_are_the_gpu_sizes() -> None:
    config, _ = bench_generate.parse_args(["--device", "cuda"])
    assert config == bench_generate.GenerateBenchConfig.for_device("cuda")
    assert (config.dtypes, config.device) == (("bfloat16",), "cuda")
    assert config.profile_tokens == 32  # where a decode step's time goes, on a GPU only
    assert bench_generate.GenerateBenchConfig.for_device("cpu").profile_tokens == 0
    assert config.at_goal_size  # the whole Qwen3-0.6B shape and its 512-token prompt
    assert config.decode_tokens >= 64
    config, _ = bench_generate.parse_args(["--device", "cuda", "--layers", "2"])
    assert (config.layers, config.dtypes) == (2, ("bfloat16",))


def test_bench_generate_writes_rows(tmp_path: Path, device: torch.device) -> None:
    models_dir = find_model("qwen3_tokenizer").parent
    document = bench_generate.main([
        "--out", str(tmp_path), "--device", str(device), "--layers", "1",
        "--hidden-size", str(HIDDEN),
        "--intermediate-size", str(MLP), "--prompt-len", "8", "--decode-tokens", "2",
        "--dtypes", "float32", "bfloat16", "--repeats", "1", "--warmup", "0",
        "--copy-mib", "8", "--models-dir", str(models_dir)])
    written = json.loads((tmp_path / "generate.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    assert [row["dtype"] for row in rows] == ["float32", "bfloat16"]
    # One layer plus the tied embedding counted once and the final norm.
    layer = (HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2  # q, o; k, v
             + 2 * HEAD_DIM + 2 * HIDDEN + 3 * HIDDEN * MLP)  # q/k norms, 2 norms, MLP
    params = VOCAB * HIDDEN + layer + HIDDEN
    for row, itemsize in zip(rows, (4, 2)):
        assert (row["layers"], row["prompt_len"], row["decode_tokens"]) == (1, 8, 2)
        assert row["weight_bytes"] == params * itemsize
        for name in bench_generate.COMPETITORS:
            assert row[f"{name}_call_repeats"] == row[f"{name}_ttft_repeats"] == 1
            assert len(row[f"{name}_tokens"]) == 3  # the first token and 2 decoded
            assert row[f"{name}_prefill_tok_s"] == pytest.approx(
                8 / (row[f"{name}_ttft_median_ms"] / 1e3))
            assert row[f"{name}_decode_tok_s"] == pytest.approx(
                2 / (row[f"{name}_decode_median_ms"] / 1e3))
            assert row[f"{name}_decode_ms_per_token"] == pytest.approx(
                row[f"{name}_decode_median_ms"] / 2)
            assert row[f"{name}_weight_gbps"] == pytest.approx(
                row["weight_bytes"] * row[f"{name}_decode_tok_s"] / 1e9)
            # TTFT and the decode steps happen inside the timed call.
            assert (row[f"{name}_ttft_median_ms"] + row[f"{name}_decode_median_ms"]
                    <= row[f"{name}_call_median_ms"])
        assert row["decode_speedup_vs_hf"] == pytest.approx(row["fastllm_decode_tok_s"]
                                                            / row["hf_decode_tok_s"])
        assert row["ttft_vs_hf"] == pytest.approx(row["fastllm_ttft_median_ms"]
                                                  / row["hf_ttft_median_ms"])
        assert row["copy_gbps"] == pytest.approx(2 * 8 * 2**20 / (row["copy_median_ms"] / 1e3)
                                                 / 1e9)
    float32 = rows[0]
    assert float32["fastllm_tokens"] == float32["hf_tokens"]
    assert float32["tokens_agree"] == 3
    markdown = (tmp_path / "generate.md").read_text()
    assert "not measured in this run" in markdown  # scaled down from the goal's size
    assert "\n| float32 |" in markdown and "\n| bfloat16 |" in markdown


def test_goal_summary_judges_both_goals() -> None:
    config = bench_generate.GenerateBenchConfig()
    assert config.at_goal_size
    rows = [{"dtype": "float32", "decode_speedup_vs_hf": 2.5, "ttft_vs_hf": 0.5},
            {"dtype": "bfloat16", "decode_speedup_vs_hf": 2.5, "ttft_vs_hf": 0.9},
            {"dtype": "float16", "decode_speedup_vs_hf": 1.5, "ttft_vs_hf": 0.5}]
    summary = bench_generate.goal_summary(config, rows)
    assert "float32 decode 2.50x, TTFT 0.500x (met)" in summary
    assert "bfloat16 decode 2.50x, TTFT 0.900x (NOT met)" in summary
    assert "float16 decode 1.50x, TTFT 0.500x (NOT met)" in summary


def test_leading_agreement() -> None:
    assert bench_generate.leading_agreement([1, 2, 3], [1, 2, 3]) == 3
    assert bench_generate.leading_agreement([1, 2, 3], [1, 5, 3]) == 1
    assert bench_generate.leading_agreement([1, 2], [1, 2, 3]) == 2
