"""The MoE benchmark end to end at tiny sizes, its defaults per device, and its peers compute
what fastllm.ops.moe computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastllm import ops
from fastllm.bench.timer import TimerConfig
from tiny_bench import import_benchmark

bench_moe = import_benchmark("bench_moe")

TINY = ["--hidden-size", "256", "--intermediate-size", "256", "--num-experts", "8", "--top-k",
        "2", "--repeats", "1", "--warmup", "0"]


def test_cpu_defaults_are_qwen3_30b_a3b() -> None:
    config, _ = bench_moe.parse_args([])
    assert config == bench_moe.MoeBenchConfig.for_device("cpu") == bench_moe.MoeBenchConfig()
    assert (config.hidden_size, config.intermediate_size, config.num_experts, config.top_k) == (
        2048, 768, 128, 8)
    assert (config.tokens, config.formats, config.device) == (
        (1, 4, 16, 64), ("bfloat16", "Q4_K", "Q8_0"), "cpu")
    assert config.timer == TimerConfig(warmup=1, repeats=10, budget_s=1.0)


def test_cuda_defaults_are_the_gpu_sizes() -> None:
    config, _ = bench_moe.parse_args(["--device", "cuda"])
    assert config == bench_moe.MoeBenchConfig.for_device("cuda")
    assert (config.tokens, config.device) == ((1, 4, 16, 64, 256, 1024), "cuda")
    config, _ = bench_moe.parse_args(["--device", "cuda", "--tokens", "8"])
    assert config.tokens == (8,)


def test_bench_moe_writes_rows(tmp_path: Path, device: torch.device) -> None:
    document = bench_moe.main(["--out", str(tmp_path), "--device", str(device), "--tokens", "1",
                               "3", "--formats", "bfloat16", "Q4_K", *TINY])
    written = json.loads((tmp_path / "moe.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    assert [(row["format"], row["tokens"]) for row in rows] == [
        ("bfloat16", 1), ("bfloat16", 3), ("Q4_K", 1), ("Q4_K", 3)]
    for row in rows:
        assert row["fastllm_median_ms"] > 0 and row["per_expert_median_ms"] > 0
        assert row["speedup_vs_per_expert"] == pytest.approx(row["per_expert_median_ms"]
                                                             / row["fastllm_median_ms"])
        has_hf = row["format"] == "bfloat16"  # transformers runs no ggml blocks
        assert (row["speedup_vs_hf"] is not None) == has_hf == ("hf_median_ms" in row)
        assert 0 < row["chosen_weight_mb"] <= 8 * (3 * 256 * 256 * 2) / 2**20
    assert "speedup vs HF" in (tmp_path / "moe.md").read_text()


@pytest.mark.parametrize("name", ["bfloat16", "Q4_K"])
def test_peers_compute_the_op(name: str) -> None:
    """The per-expert calls and HF's experts compute fastllm's result (the per-expert calls bit
    for bit on the CPU: the same kernels on the same rows)."""
    config, _ = bench_moe.parse_args(["--formats", name, "--tokens", "5", *TINY])
    torch.manual_seed(0)
    experts = bench_moe.make_experts(config, name)
    calls, _ = bench_moe.competitors(config, experts, 5)
    got = calls["fastllm"]()
    assert torch.equal(calls["per_expert"](), got)
    if "hf" in calls:
        torch.testing.assert_close(calls["hf"](), got, atol=2e-2, rtol=2e-2)
    assert not got.isnan().any() and got.abs().max() > 0
    assert experts.weight_type is None or experts.weight_type in ops.BLOCK_FORMATS
