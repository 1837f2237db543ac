"""The multi-LoRA benchmark's defaults (the issue's workload on the real SmolLM2, in the full
set only), and a run end to end on a tiny random model of SmolLM2's family: fastllm's greedy
tokens with adapters are HF + peft's, and the rows hold the medians' throughput and their
ratios."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from tiny_bench import import_benchmark

from fastllm.bench.timer import TimerConfig

REQUESTS, ADAPTERS, OUTPUT_TOKENS = 8, 4, 4
# One layer of hidden 72 (a multiple of SmolLM2's 9 heads), prompts of 4-12 tokens.
TINY_LORA = ["--layers", "1", "--hidden-size", "72", "--intermediate-size", "128",
             "--num-requests", str(REQUESTS), "--adapters", str(ADAPTERS), "--min-prompt-len",
             "4", "--max-prompt-len", "12", "--output-tokens", str(OUTPUT_TOKENS), "--repeats",
             "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def bench_lora() -> ModuleType:
    """benchmarks/bench_lora.py, imported by the first test that asks for it: it imports peft."""
    return import_benchmark("bench_lora")


def test_defaults_are_the_issues_workload(bench_lora: ModuleType) -> None:
    config, out = bench_lora.parse_args([])
    assert config == bench_lora.LoRABenchConfig() and out == Path("results")
    assert (config.num_requests, config.adapters, config.rank, config.alpha,
            config.output_tokens, config.min_prompt_len, config.max_prompt_len) == (
        32, 4, 16, 32, 64, 24, 48)
    assert config.real_weights and config.at_goal_size
    assert config.timer == TimerConfig(warmup=1, repeats=3, budget_s=600.0)
    assert not bench_lora.LoRABenchConfig(layers=2).real_weights


def test_in_the_full_set_only(bench_lora: ModuleType, run_all: ModuleType) -> None:
    assert run_all.BENCHMARKS["lora"] is bench_lora.main
    assert "lora" not in run_all.DEFAULT_SET


def test_bad_configs_are_refused(bench_lora: ModuleType) -> None:
    with pytest.raises(ValueError, match="multiple of 9"):
        bench_lora.LoRABenchConfig(hidden_size=64)
    with pytest.raises(ValueError, match="adapters <= num_requests"):
        bench_lora.LoRABenchConfig(num_requests=2, adapters=3)
    with pytest.raises(ValueError, match="min_prompt_len <= max_prompt_len"):
        bench_lora.LoRABenchConfig(min_prompt_len=9, max_prompt_len=8)


def test_adapter_groups_batch_each_adapters_requests(bench_lora: ModuleType) -> None:
    prompts = [[5, 6, 7], [1], [2, 3], [4, 4, 4, 4], [8, 9]]
    groups = bench_lora.adapter_groups(prompts, ["a", "b"], "cpu")
    assert [(group.name, group.requests) for group in groups] == [("a", [0, 2, 4]),
                                                                  ("b", [1, 3])]
    first = groups[0].batch  # sorted by length, left-padded
    assert [groups[0].requests[i] for i in first.indices] == [2, 4, 0]
    assert first.input_ids.tolist() == [[0, 2, 3], [0, 8, 9], [5, 6, 7]]
    assert first.attention_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1]]


def test_tiny_run_writes_rows(bench_lora: ModuleType, tmp_path: Path, smollm2_path: Path) -> None:
    document = bench_lora.main(["--out", str(tmp_path), *TINY_LORA])
    assert json.loads((tmp_path / "lora.json").read_text())["rows"] == document["rows"]
    [run, *checks] = document["rows"]
    assert (run["section"], run["weights"], run["num_requests"], run["adapters"]) == (
        "throughput", "random", REQUESTS, ADAPTERS)
    config, _ = bench_lora.parse_args(TINY_LORA)
    prompts = bench_lora.random_prompts(config, 17, 49_152)  # SmolLM2's ordinary tokens
    assert all(4 <= len(p) <= 12 and min(p) >= 17 for p in prompts)
    assert run["prompt_tokens"] == sum(len(p) for p in prompts)
    assert run["output_tokens"] == REQUESTS * OUTPUT_TOKENS
    # Throughput from each system's median call; the ratios from those.
    for name in bench_lora.SYSTEMS:
        assert run[f"{name}_call_repeats"] == 1
        assert run[f"{name}_tok_s"] == pytest.approx(
            REQUESTS * OUTPUT_TOKENS / (run[f"{name}_call_median_ms"] / 1e3))
    assert run["lora_vs_base"] == pytest.approx(run["lora_tok_s"] / run["base_tok_s"])
    assert run["lora_vs_hf_peft"] == pytest.approx(run["lora_tok_s"] / run["hf_peft_tok_s"])
    assert run["no_adapter_vs_base"] == pytest.approx(run["lora_no_adapter_tok_s"]
                                                      / run["base_tok_s"])
    # float32 on both sides: every adapter's first request gets HF + peft's tokens, alone and
    # batched; without an adapter the LoRA engine gives the base's; the adapters matter.
    assert [(row["adapter"], row["request"], row["tokens_equal"]) for row in checks] == [
        (f"adapter{i}", i, True) for i in range(ADAPTERS)]
    assert run["check_tokens_equal"] == ADAPTERS
    assert run["check_tokens_agree_min"] == OUTPUT_TOKENS
    assert run["requests_equal_hf_peft"] == REQUESTS
    assert run["no_adapter_requests_equal_base"] == REQUESTS
    assert run["requests_changed_by_adapter"] > 0
    assert run["preemptions"] == 0
    markdown = (tmp_path / "lora.md").read_text()
    assert "not measured in this run (random weights, a 1-layer model" in markdown
    assert "\n| fastllm, adapters |" in markdown and "\n| HF + peft |" in markdown


def test_goal_summary_judges_the_goal(bench_lora: ModuleType) -> None:
    config = bench_lora.LoRABenchConfig()
    for ratio, verdict in ((0.85, "0.850x (met)"), (0.5, "0.500x (NOT met)")):
        summary = bench_lora.goal_summary(config, [{"section": "throughput",
                                                    "lora_vs_base": ratio}])
        assert summary.endswith(f"base model's output tokens/s: {verdict}.")
