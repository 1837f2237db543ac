"""The sampling benchmark end to end at tiny sizes, and its peers sample what they claim to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import bench_sampling
finally:
    sys.path.remove(str(REPO / "benchmarks"))


def test_bench_sampling_writes_rows(tmp_path: Path) -> None:
    document = bench_sampling.main(["--out", str(tmp_path), "--vocab", "1000", "--batch", "1",
                                    "--repeats", "1", "--warmup", "0"])
    written = json.loads((tmp_path / "sampling.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    assert [row["setting"] for row in rows] == list(bench_sampling.SETTINGS)
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
