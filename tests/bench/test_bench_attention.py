"""The attention benchmark: its defaults per device, its SDPA peer's backend and K/V layout, and
a run at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastllm.bench.timer import TimerConfig
from fastllm.bench.workloads import MODEL_SHAPES, make_attention_inputs
from tiny_bench import import_benchmark

bench_attention = import_benchmark("bench_attention")

GPU_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def test_cpu_defaults_are_make_benchs() -> None:
    config, out = bench_attention.parse_args([])
    assert config == bench_attention.AttentionBenchConfig.for_device("cpu")
    assert config == bench_attention.AttentionBenchConfig()
    assert (config.models, config.dtypes, config.prefill_lengths, config.decode_batches,
            config.decode_len_k, config.memcpy_mb, config.device, config.sdpa_backend) == (
        ("qwen3-0.6b", "llama-3-8b"), ("float32", "bfloat16"), (512, 2048, 8192), (1, 8),
        4096, 256, "cpu", "auto")
    assert config.timer == TimerConfig(warmup=2, repeats=10, budget_s=1.0)
    assert out == Path("results")


def test_cuda_defaults_are_the_gpu_sizes() -> None:
    config, _ = bench_attention.parse_args(["--device", "cuda"])
    assert config == bench_attention.AttentionBenchConfig.for_device("cuda")
    assert config.device == "cuda"
    assert config.dtypes == ("bfloat16", "float16")  # the flash backend takes no float32
    assert config.sdpa_backend == "flash"
    assert config.prefill_lengths == GPU_LENGTHS
    assert {(MODEL_SHAPES[m].n_heads, MODEL_SHAPES[m].n_kv_heads, MODEL_SHAPES[m].head_dim)
            for m in config.models} == {(16, 8, 128), (32, 8, 128)}
    cases = config.cases()
    assert len(cases) == 2 * 2 * len(GPU_LENGTHS)
    assert all(case.phase == "prefill" and case.batch == 1 and case.len_q == case.len_k
               for case in cases)  # paged decode is bench_kv_cache's
    assert config.timer.repeats > bench_attention.AttentionBenchConfig().timer.repeats


def test_sizes_given_replace_the_devices() -> None:
    config, _ = bench_attention.parse_args(["--device=cuda:0", "--prefill-lengths", "1024",
                                            "--dtypes", "bfloat16", "--sdpa-backend", "cudnn"])
    assert (config.device, config.prefill_lengths, config.dtypes, config.sdpa_backend) == (
        "cuda:0", (1024,), ("bfloat16",), "cudnn")
    cuda = bench_attention.AttentionBenchConfig.for_device("cuda")
    assert (config.models, config.decode_batches, config.timer) == (
        cuda.models, cuda.decode_batches, cuda.timer)


def test_config_rejects_an_unknown_sdpa_backend() -> None:
    with pytest.raises(ValueError, match="sdpa_backend"):
        bench_attention.AttentionBenchConfig(sdpa_backend="fastest")


def test_forced_sdpa_backend_computes_what_torchs_choice_does() -> None:
    # The CPU's flash backend takes enable_gqa, so the forced peer reads the shared heads too.
    inputs = make_attention_inputs(MODEL_SHAPES["llama-3-8b"], batch=2, len_q=24, len_k=24,
                                   dtype=torch.float32, device="cpu")
    auto, auto_kv = bench_attention.sdpa_competitor(inputs, 4, causal=True, backend="auto")
    flash, flash_kv = bench_attention.sdpa_competitor(inputs, 4, causal=True, backend="flash")
    assert auto_kv == flash_kv == "gqa"
    torch.testing.assert_close(flash(), auto())


def test_sdpa_peer_expands_kv_once_where_the_backend_refuses_gqa(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plain = F.scaled_dot_product_attention

    def without_gqa(q, k, v, *, enable_gqa: bool = False, **kwargs):
        if enable_gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        return plain(q, k, v, **kwargs)

    inputs = make_attention_inputs(MODEL_SHAPES["qwen3-0.6b"], batch=2, len_q=8, len_k=8,
                                   dtype=torch.float32, device="cpu")
    expected = plain(inputs.q_bhld, inputs.k_bhld, inputs.v_bhld, is_causal=True,
                     enable_gqa=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", without_gqa)
    call, kv = bench_attention.sdpa_competitor(inputs, 2, causal=True, backend="flash")
    assert kv == "expanded"

    def no_copy_in_the_timed_call(*args):
        raise AssertionError("K/V expanded inside the timed call")

    monkeypatch.setattr(bench_attention, "repeat_kv", no_copy_in_the_timed_call)
    torch.testing.assert_close(call(), expected)


def test_bench_attention_writes_rows(tmp_path: Path, device: torch.device) -> None:
    len_q, batch, len_k = 32, 2, 48
    document = bench_attention.main([
        "--out", str(tmp_path), "--device", str(device), "--models", "qwen3-0.6b",
        "--prefill-lengths", str(len_q), "--decode-batches", str(batch),
        "--decode-len-k", str(len_k), "--repeats", "1", "--warmup", "0"])
    written = json.loads((tmp_path / "attention.json").read_text())
    assert written["rows"] == document["rows"]
    defaults = bench_attention.AttentionBenchConfig.for_device(str(device))
    rows = written["rows"]
    assert [(row["dtype"], row["phase"]) for row in rows] == [
        (dtype, phase) for dtype in defaults.dtypes for phase in ("prefill", "decode")]
    heads, kv_heads, head_dim = 16, 8, 128
    for row in rows:
        assert row["sdpa_backend"] == defaults.sdpa_backend
        assert row["sdpa_kv"] in ("gqa", "expanded")
        assert row["speedup_vs_sdpa"] == pytest.approx(row["sdpa_median_ms"]
                                                       / row["fastllm_median_ms"])
        itemsize = getattr(torch, row["dtype"]).itemsize
        if row["phase"] == "prefill":
            flops = 2 * heads * head_dim * len_q * len_q
            for name in ("fastllm", "sdpa"):
                assert row[f"{name}_tflops"] == pytest.approx(
                    flops / (row[f"{name}_median_ms"] / 1e3) / 1e12)
        else:
            moved = (2 * batch * heads + 2 * batch * len_k * kv_heads) * head_dim * itemsize
            assert row["fastllm_gbps"] == pytest.approx(
                moved / (row["fastllm_median_ms"] / 1e3) / 1e9)
            assert row["memcpy_gbps"] == pytest.approx(
                2 * 256 * 2**20 / (row["memcpy_median_ms"] / 1e3) / 1e9)
            assert row["fraction_of_memcpy"] == pytest.approx(row["fastllm_gbps"]
                                                              / row["memcpy_gbps"])
    markdown = (tmp_path / "attention.md").read_text()
    assert "SDPA TFLOP/s" in markdown and "SDPA backend" in markdown
