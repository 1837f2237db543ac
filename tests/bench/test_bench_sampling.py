"""The sampling benchmark end to end at tiny sizes, its defaults per device, and its peers
sample what they claim to."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastllm import ops
from fastllm.bench.timer import TimerConfig
from tiny_bench import import_benchmark

bench_sampling = import_benchmark("bench_sampling")


def test_cpu_defaults_are_make_benchs() -> None:
    config, _ = bench_sampling.parse_args([])
    assert config == bench_sampling.SamplingBenchConfig.for_device("cpu")
    assert config == bench_sampling.SamplingBenchConfig()
    assert (config.vocabs, config.batches, config.settings, config.device) == (
        (32_000, 151_936), (1, 16, 64), tuple(bench_sampling.SETTINGS), "cpu")
    assert config.timer == TimerConfig(warmup=1, repeats=20, budget_s=0.5)


def test_cuda_defaults_are_the_gpu_sizes() -> None:
    config, _ = bench_sampling.parse_args(["--device", "cuda"])
    assert config == bench_sampling.SamplingBenchConfig.for_device("cuda")
    assert (config.vocabs, config.batches, config.device) == (
        (151_936,), (1, 4, 16, 64, 256), "cuda")
    assert config.settings == ("top_k", "top_p", "top_k_top_p")
    # The headline goal's cases are among them.
    assert {(case.vocab, case.setting, case.batch) for case in config.cases()} >= {
        (bench_sampling.GOAL_VOCAB, bench_sampling.GOAL_SETTING, batch)
        for batch in bench_sampling.GOAL_BATCHES}
    config, _ = bench_sampling.parse_args(["--device", "cuda", "--batches", "8"])
    assert (config.vocabs, config.batches) == ((151_936,), (8,))


def test_bench_sampling_writes_rows(tmp_path: Path, device: torch.device) -> None:
    document = bench_sampling.main(["--out", str(tmp_path), "--device", str(device),
                                    "--vocab", "1000", "--batch", "1", "--repeats", "1",
                                    "--warmup", "0"])
    written = json.loads((tmp_path / "sampling.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    defaults = bench_sampling.SamplingBenchConfig.for_device(str(device))
    assert [row["setting"] for row in rows] == list(defaults.settings)
    for row in rows:
        assert (row["vocab"], row["batch"]) == (1000, 1)
        for name in bench_sampling.COMPETITORS:
            assert row[f"{name}_median_ms"] > 0 and row[f"{name}_repeats"] == 1
        assert row["speedup_vs_hf"] == pytest.approx(row["hf_median_ms"]
                                                     / row["fastllm_median_ms"])
        assert row["speedup_vs_sort"] == pytest.approx(row["sort_median_ms"]
                                                       / row["fastllm_median_ms"])
    markdown = (tmp_path / "sampling.md").read_text()
    assert "not measured in this run" in markdown  # the goal's vocab and batches were not run
    assert markdown.count("\n| 1000 |") == len(rows)


@pytest.mark.parametrize("key", ["greedy", "top_k", "top_k_top_p", "min_p", "penalties"])
def test_peers_sample_from_the_filtered_set(key: str) -> None:
    """Every competitor's tokens lie in its setting's allowed set, on well-separated logits."""
    setting = bench_sampling.SETTINGS[key]
    inputs = bench_sampling.make_sampling_inputs(setting, batch=4, vocab=1000, prompt_len=16,
                                                 output_len=8, device=torch.device("cpu"))
    # The top 50 logits per row stand far above the rest: top-k, top-p, min-p and the
    # penalties all keep a subset of them.
    top = inputs.logits.topk(50, dim=-1).indices
    inputs.logits.scatter_(1, top, 100.0 + torch.rand(4, 50))
    allowed = torch.zeros(4, 1000, dtype=torch.bool).scatter_(1, top, True)
    for name, competitor in bench_sampling.sampling_competitors(setting, inputs).items():
        tokens = competitor()
        assert tokens.shape == (4,) and tokens.dtype == torch.int64, name
        if setting.params.is_greedy:
            assert torch.equal(tokens, inputs.logits.argmax(dim=-1)), name
        assert allowed.gather(1, tokens[:, None]).all(), name


def host_syncs(call: Callable[[], object]) -> int:
    """How many synchronizing CUDA operations one call of ``call`` makes, after a warm-up call
    (one-time set-up may synchronize)."""
    call()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(warning.message) for warning in caught)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("key", ["top_k", "top_p", "top_k_top_p"])
def test_fastllm_syncs_no_more_than_the_sort_peer(key: str) -> None:
    setting = bench_sampling.SETTINGS[key]
    inputs = bench_sampling.make_sampling_inputs(setting, batch=16, vocab=151_936,
                                                 prompt_len=16, output_len=8,
                                                 device=torch.device("cuda"))
    competitors = bench_sampling.sampling_competitors(setting, inputs)
    with ops.trusted_inputs():  # as the benchmark times them (and the engine calls the op)
        assert host_syncs(competitors["fastllm"]) <= host_syncs(competitors["sort"])
