"""The KV-cache benchmark end to end at tiny sizes, its defaults per device, and its paged pool
holds the same keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastllm.ops import reference
from fastllm.bench.timer import TimerConfig
from tiny_bench import import_benchmark

bench_kv_cache = import_benchmark("bench_kv_cache")


def test_cpu_defaults_are_make_benchs() -> None:
    config, _ = bench_kv_cache.parse_args([])
    assert config == bench_kv_cache.KVCacheBenchConfig.for_device("cpu")
    assert config == bench_kv_cache.KVCacheBenchConfig()
    assert (config.models, config.dtypes, config.decode_batches, config.decode_lens_k,
            config.copy_mib, config.block_size, config.device) == (
        ("qwen3-0.6b", "llama-3-8b"), ("float32", "bfloat16"), (1, 8, 32), (4096,), 0, 16,
        "cpu")
    assert config.timer == TimerConfig(warmup=2, repeats=20, budget_s=0.5)


def test_cuda_defaults_are_the_gpu_sizes() -> None:
    config, _ = bench_kv_cache.parse_args(["--device", "cuda"])
    assert config == bench_kv_cache.KVCacheBenchConfig.for_device("cuda")
    assert (config.models, config.dtypes, config.decode_batches, config.decode_lens_k) == (
        ("qwen3-0.6b", "llama-3-8b"), ("bfloat16",), (1, 4, 16, 64), (600, 1024, 4096, 16384, 32768))
    assert config.copy_mib >= 1024  # a copy far larger than any cache
    # The largest case holds its K/V twice (back to back and in the pool): 8 GiB each.
    largest_kv = max(config.decode_batches) * max(config.decode_lens_k) * 8 * 128 * 2 * 2
    assert largest_kv == 8 * 2**30


def test_sizes_given_replace_the_devices() -> None:
    config, _ = bench_kv_cache.parse_args(["--device", "cuda", "--decode-lens-k", "2048",
                                           "--decode-batches", "8", "--copy-mib", "0"])
    assert (config.decode_lens_k, config.decode_batches, config.copy_mib) == ((2048,), (8,), 0)
    assert config.dtypes == ("bfloat16",)


def test_copy_goal_summary() -> None:
    def row(batch: int, keys: int, fraction: float) -> dict[str, object]:
        return {"batch": batch, "keys": keys, "fraction_of_copy": fraction}

    summary = bench_kv_cache.copy_goal_summary
    # Small batches and short caches are not judged.
    assert summary([row(4, 32768, 0.1), row(16, 4096, 0.85), row(64, 1024, 0.2)]).endswith(
        "worst case measured 0.85 (met).")
    assert summary([row(16, 4096, 0.85), row(64, 32768, 0.75)]).endswith("0.75 (NOT met).")
    assert "not measured in this run" in summary([{"batch": 64, "keys": 32768}])


def test_bench_kv_cache_writes_rows(tmp_path: Path, model_path, device: torch.device) -> None:
    models_dir = model_path("stories260K_hf").parent
    document = bench_kv_cache.main([
        "--out", str(tmp_path), "--device", str(device), "--models", "qwen3-0.6b",
        "--dtypes", "float32", "--decode-batches", "2", "--decode-len-k", "40", "56",
        "--copy-mib", "1", "--repeats", "1", "--warmup", "0",
        "--prefill-layers", "1", "--ttft-prompt-len", "40", "--ttft-cached-len", "32",
        "--chunk-prefix-len", "5", "--num-chunks", "2", "--chunk-len", "16",
        "--chunk-suffix-len", "3", "--drift-prompts", "2", "--models-dir", str(models_dir)])
    written = json.loads((tmp_path / "kv_cache.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    decodes, (ttft, reused, encoded), drift, memory = rows[:2], rows[2:5], rows[5:-1], rows[-1]
    for decode, keys in zip(decodes, (40, 56)):
        assert (decode["batch"], decode["keys"], decode["contiguous_repeats"]) == (2, keys, 1)
        assert decode["paged_vs_contiguous"] == pytest.approx(decode["contiguous_median_ms"]
                                                              / decode["paged_median_ms"])
        # q read and the output written (2 x 16 heads), K and V read (8 heads), float32.
        moved = (2 * 2 * 16 + 2 * 2 * keys * 8) * 128 * 4
        for name in ("contiguous", "paged"):
            assert decode[f"{name}_gbps"] == pytest.approx(
                moved / (decode[f"{name}_median_ms"] / 1e3) / 1e9)
        assert decode["copy_gbps"] == pytest.approx(
            2 * 2**20 / (decode["copy_median_ms"] / 1e3) / 1e9)
        assert decode["fraction_of_copy"] == pytest.approx(decode["paged_gbps"]
                                                           / decode["copy_gbps"])
    # 32 cached tokens are 2 blocks of 16: the prefix cache served both.
    assert (ttft["method"], ttft["reused_tokens"]) == ("prefix cache hit", 32)
    assert (reused["method"], reused["reused_tokens"]) == ("chunks reused", 32)
    assert (encoded["method"], encoded["reused_tokens"]) == ("chunks encoded", 0)
    for row in (ttft, reused, encoded):
        assert row["speedup"] == pytest.approx(row["peer_ms"] / row["method_ms"])
    assert [row["prompt"] for row in drift] == [0, 1]
    assert all(row["kl_full_to_chunks"] >= 0 and 0 <= row["greedy_tokens_agreeing"] <= 32
               and row["max_abs_logprob_diff"] >= 0 for row in drift)
    # Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 4 bytes x (K and V).
    assert memory["bytes_per_token"] == 2 * 28 * 8 * 128 * 4
    assert memory["seq_tokens"] == 56  # the longest decode case
    report = (tmp_path / "kv_cache.md").read_text()
    for title in ("paged pool vs contiguous", "prefix cache and independent chunks",
                  "Block attention vs causal attention on stories260K", "paged / copy"):
        assert title in report


@pytest.mark.parametrize("len_k, block_size", [(40, 16), (7, 1), (33, 32)])
def test_paged_pool_holds_the_packed_keys(len_k: int, block_size: int) -> None:
    k, v = torch.randn(3 * len_k, 2, 8), torch.randn(3 * len_k, 2, 8)
    paged = bench_kv_cache.to_paged(k, v, 3, len_k, block_size)
    assert torch.equal(reference.gather_paged(paged.k_cache, paged.block_tables, paged.seq_lens), k)
    assert torch.equal(reference.gather_paged(paged.v_cache, paged.block_tables, paged.seq_lens), v)
