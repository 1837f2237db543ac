"""The KV-cache benchmark end to end at tiny sizes, and its paged pool holds the same keys."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fastllm import reference

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import bench_kv_cache
finally:
    sys.path.remove(str(REPO / "benchmarks"))


def test_bench_kv_cache_writes_rows(tmp_path: Path, model_path) -> None:
    models_dir = model_path("stories260K_hf").parent
    document = bench_kv_cache.main([
        "--out", str(tmp_path), "--models", "qwen3-0.6b", "--dtypes", "float32",
        "--decode-batches", "2", "--decode-len-k", "40", "--repeats", "1", "--warmup", "0",
        "--prefill-layers", "1", "--ttft-prompt-len", "40", "--ttft-cached-len", "32",
        "--chunk-prefix-len", "5", "--num-chunks", "2", "--chunk-len", "16",
        "--chunk-suffix-len", "3", "--drift-prompts", "2", "--models-dir", str(models_dir)])
    written = json.loads((tmp_path / "kv_cache.json").read_text())
    assert written["rows"] == document["rows"]
    decode, ttft, reused, encoded, *drift, memory = written["rows"]
    assert (decode["batch"], decode["keys"], decode["contiguous_repeats"]) == (2, 40, 1)
    assert decode["paged_vs_contiguous"] == pytest.approx(decode["contiguous_median_ms"]
                                                          / decode["paged_median_ms"])
    # 32 cached tokens are 2 blocks of 16: the prefix cache served both.
    assert (ttft["method"], ttft["reused_tokens"]) == ("prefix cache hit", 32)
    assert (reused["method"], reused["reused_tokens"]) == ("chunks reused", 32)
    assert (encoded["method"], encoded["reused_tokens"]) == ("chunks encoded", 0)
    for row in (ttft, reused, encoded):
        assert row["speedup"] == pytest.approx(row["peer_ms"] / row["method_ms"])
    assert [row["prompt"] for row in drift] == [0, 1]
    assert all(row["kl_full_to_chunks"] >= 0 and 0 <= row["greedy_tokens_agreeing"] <= 32
               for row in drift)
    # Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 4 bytes x (K and V).
    assert memory["bytes_per_token"] == 2 * 28 * 8 * 128 * 4
    report = (tmp_path / "kv_cache.md").read_text()
    for title in ("paged pool vs contiguous", "prefix cache and independent chunks",
                  "Block attention vs causal attention on stories260K"):
        assert title in report


@pytest.mark.parametrize("len_k, block_size", [(40, 16), (7, 1), (33, 32)])
def test_paged_pool_holds_the_packed_keys(len_k: int, block_size: int) -> None:
    k, v = torch.randn(3 * len_k, 2, 8), torch.randn(3 * len_k, 2, 8)
    paged = bench_kv_cache.to_paged(k, v, 3, len_k, block_size)
    assert torch.equal(reference.gather_paged(paged.k_cache, paged.block_tables, paged.seq_lens), k)
    assert torch.equal(reference.gather_paged(paged.v_cache, paged.block_tables, paged.seq_lens), v)
