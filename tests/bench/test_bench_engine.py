"""The engine benchmark end to end at tiny sizes (fastllm and HF generate the same greedy
tokens for every request in float32, and the rows hold what the report says), and its defaults
per device."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import find_model
from tiny_bench import (MIXED_OUTPUT_TOKENS, MIXED_REQUESTS, OUTPUT_TOKENS, PREFIX_LEN,
                        PREFIX_REQUESTS, REQUESTS, ROUNDS, SUFFIX_LEN, TINY_ENGINE, engine_args,
                        import_benchmark)

bench_engine = import_benchmark("bench_engine")


def test_cpu_defaults_are_make_benchs() -> None:
    config, _ = bench_engine.parse_args([])
    assert config == bench_engine.EngineBenchConfig.for_device("cpu")
    assert config == bench_engine.EngineBenchConfig()
    assert (config.dtypes, config.num_requests, config.hf_batch_size, config.device) == (
        ("bfloat16",), 64, 16, "cpu")
    # The case: 24 prompts of 10-400 tokens, 32 output tokens, a 4-layer Qwen3-0.6B.
    assert (config.mixed_requests, config.mixed_min_prompt_len, config.mixed_max_prompt_len,
            config.mixed_output_tokens, config.mixed_layers) == (24, 10, 400, 32, 4)


def test_cuda_defaults_are_the_gpu_sizes() -> None:
    config, _ = bench_engine.parse_args(["--device", "cuda"])
    assert config == bench_engine.EngineBenchConfig.for_device("cuda")
    assert (config.dtypes, config.device) == (("bfloat16",), "cuda")
    # Batch 64: fastllm serves all 64 requests at once, HF generates them as one padded batch.
    assert config.num_requests == config.hf_batch_size == 64
    assert config.at_goal_size
    config, _ = bench_engine.parse_args(["--device", "cuda", "--hf-batch-size", "32"])
    assert config.hf_batch_size == 32


def test_sections_choose_what_runs_and_what_the_report_says() -> None:
    config, _ = bench_engine.parse_args([])
    assert config.sections == bench_engine.SECTIONS
    config, _ = bench_engine.parse_args(["--sections", "throughput", "prefix"])
    assert config.sections == ("throughput", "prefix")
    with pytest.raises(ValueError, match="sections must be some of"):
        bench_engine.EngineBenchConfig(sections=("speed",))
    with pytest.raises(SystemExit):  # argparse: not a section
        bench_engine.parse_args(["--sections", "speed"])
    report = bench_engine.tables(config, [])
    left_out = [title for title, text in report.items()
                if text.endswith("Not run: --sections leaves it out.")]
    assert len(left_out) == 2 and any("batch_invariant" in title for title in left_out)
    assert any("on its defaults" in title for title in left_out)
    assert "not measured in this run" in next(iter(report.values()))


def test_bench_engine_writes_rows(bench_run, device: torch.device) -> None:
    models_dir = find_model("qwen3_tokenizer").parent
    document, out = bench_run("engine", engine_args(models_dir, str(device)))
    written = json.loads((out / "engine.json").read_text())
    assert written["rows"] == document["rows"]
    rows = written["rows"]
    runs = [row for row in rows if row["section"] == "throughput"]
    prefixes = [row for row in rows if row["section"] == "prefix"]
    assert [row["dtype"] for row in runs] == [row["dtype"] for row in prefixes] == [
        "float32", "bfloat16"]
    prompts = bench_engine.random_prompts(bench_engine.parse_args(TINY_ENGINE)[0])
    for run in runs:
        assert run["num_requests"] == REQUESTS
        assert run["prompt_tokens"] == sum(len(p) for p in prompts)
        assert run["output_tokens"] == REQUESTS * OUTPUT_TOKENS
        for name in bench_engine.COMPETITORS:
            assert run[f"{name}_call_repeats"] == 1
            assert run[f"{name}_tok_s"] == pytest.approx(
                REQUESTS * OUTPUT_TOKENS / (run[f"{name}_call_median_ms"] / 1e3))
            assert run[f"{name}_ttft_p50_ms"] <= run[f"{name}_ttft_p99_ms"]
            # Every request's first token comes within the call, after it was queued.
            assert run[f"{name}_queue_p50_ms"] <= run[f"{name}_ttft_p50_ms"]
            assert run[f"{name}_ttft_p99_ms"] <= run[f"{name}_call_median_ms"]
        assert run["throughput_speedup_vs_hf"] == pytest.approx(run["fastllm_tok_s"]
                                                                / run["hf_tok_s"])
        # Padded HF batches hold at least the prompt tokens.
        assert run["hf_padded_prompt_tokens"] >= run["prompt_tokens"]
        # Every prompt token and every output token but the last of each request is scheduled
        # once: no prefix caching, no preemption with room for all requests.
        assert run["preemptions"] == 0 and run["prefix_cache_hit_rate"] == 0
        assert run["scheduled_tokens"] == run["prompt_tokens"] + REQUESTS * (OUTPUT_TOKENS - 1)
        assert run["steps"] >= OUTPUT_TOKENS
        assert 0 < run["peak_kv_usage"] <= 1
        assert 0 < run["detokenize_s"] < run["step_s"]
        assert run["detokenize_share"] == pytest.approx(run["detokenize_s"] / run["step_s"])

        requests = [row for row in rows
                    if row["section"] == "request" and row["dtype"] == run["dtype"]]
        assert [(row["competitor"], row["request"]) for row in requests] == [
            (name, i) for name in bench_engine.COMPETITORS for i in range(REQUESTS)]
        assert [row["prompt_len"] for row in requests] == [len(p) for p in prompts] * 2
        assert all(row["cached_tokens"] == 0 for row in requests)
    float32 = runs[0]
    assert float32["requests_tokens_equal"] == REQUESTS
    assert float32["tokens_agree_min"] == OUTPUT_TOKENS
    assert all(row["tokens_agree"] == OUTPUT_TOKENS for row in rows
               if row["section"] == "request" and row["dtype"] == "float32"
               and row["competitor"] == "fastllm")

    for prefix in prefixes:
        timed = [row for row in rows
                 if row["section"] == "prefix_request" and row["dtype"] == prefix["dtype"]]
        assert len(timed) == ROUNDS * PREFIX_REQUESTS
        # The cold request finds nothing; the others find the whole system prompt.
        assert [row["cached_tokens"] for row in timed] == (
            [0] + [PREFIX_LEN] * (PREFIX_REQUESTS - 1)) * ROUNDS
        assert prefix["cached_token_share"] == pytest.approx(
            PREFIX_LEN / (PREFIX_LEN + SUFFIX_LEN))
        # Per round: each request looks up the full blocks before its last prompt token, and
        # all but the first find the system prompt's.
        blocks, shared = (PREFIX_LEN + SUFFIX_LEN - 1) // 16, PREFIX_LEN // 16
        assert prefix["prefix_cache_hit_rate"] == pytest.approx(
            shared * (PREFIX_REQUESTS - 1) / (blocks * PREFIX_REQUESTS))
        assert prefix["prefix_ttft_ratio"] == pytest.approx(prefix["cold_ttft_ms"]
                                                            / prefix["cached_ttft_ms"])
    # LLM(path) on its defaults: its KV pool holds every request, so nothing is preempted and
    # every needed token is scheduled once; float32 on both sides gives HF's greedy tokens.
    [defaults] = [row for row in rows if row["section"] == "defaults"]
    config = bench_engine.parse_args(TINY_ENGINE)[0]
    mixed = bench_engine.mixed_prompt_sets(config)
    assert len(mixed) == 1 and all(10 <= len(p) <= 40 for p in mixed[0])
    assert (defaults["num_requests"], defaults["layers"], defaults["dtype"]) == (
        MIXED_REQUESTS, 2, "float32")
    assert defaults["preemptions"] == 0
    assert defaults["prompt_tokens"] == sum(len(p) for p in mixed[0])
    assert defaults["scheduled_tokens"] == defaults["needed_tokens"] == (
        defaults["prompt_tokens"] + MIXED_REQUESTS * (MIXED_OUTPUT_TOKENS - 1))
    assert defaults["kv_pool_tokens"] >= MIXED_REQUESTS * (40 + MIXED_OUTPUT_TOKENS)
    assert defaults["max_model_len"] == 8192  # the default context cap
    assert defaults["requests_tokens_equal"] == MIXED_REQUESTS
    for name in bench_engine.COMPETITORS:
        assert defaults[f"{name}_tok_s"] == pytest.approx(
            MIXED_REQUESTS * MIXED_OUTPUT_TOKENS / (defaults[f"{name}_call_median_ms"] / 1e3))
    assert defaults["throughput_speedup_vs_hf"] == pytest.approx(
        defaults["fastllm_tok_s"] / defaults["hf_tok_s"])
    invariant = [row for row in rows if row["section"] == "batch_invariant"]
    markdown = (out / "engine.md").read_text()
    # batch_invariant=True has CPU kernels only: on CUDA the section says so instead of rows.
    invariant_runs = device.type != "cuda"
    assert [row["dtype"] for row in invariant] == (["float32", "bfloat16"] if invariant_runs
                                                      else [])
    left_out = f"Left out on {device}: {bench_engine.INVARIANT_LEFT_OUT}."
    assert (left_out in markdown) != invariant_runs
    for row in invariant:
        for name in ("fastllm", "fastllm_invariant"):
            assert row[f"{name}_tok_s"] == pytest.approx(
                REQUESTS * OUTPUT_TOKENS / (row[f"{name}_call_median_ms"] / 1e3))
            assert 0 < row[f"{name}_ttft_p50_ms"] <= row[f"{name}_call_median_ms"]
        assert row["invariant_throughput_ratio"] == pytest.approx(
            row["fastllm_invariant_tok_s"] / row["fastllm_tok_s"])
        assert 0 <= row["requests_tokens_equal"] <= REQUESTS
    assert "not measured in this run" in markdown  # scaled down from the goal's size
    assert ("| batch-invariant / default |" in markdown) == invariant_runs
    assert "Check: no preemption with LLM's default KV pool: 0 (met)." in markdown
    assert "\n| float32 |" in markdown and "\n| bfloat16 | HF |" in markdown


def test_tensor_parallel_section_gives_one_processs_tokens() -> None:
    """``--tensor-parallel-size 2``'s section at the tiny size, in float32: two ranks give every
    request one process's greedy tokens, and the report shows the section."""
    models_dir = find_model("qwen3_tokenizer").parent
    config, _ = bench_engine.parse_args([*engine_args(models_dir), "--tensor-parallel-size",
                                         "2"])
    assert config.tensor_parallel_size == 2
    prompts = bench_engine.random_prompts(config)
    with bench_engine.random_model_folder(config, "engine") as folder:
        [row] = bench_engine.tensor_parallel_rows(config, folder, "float32", prompts)
    assert (row["section"], row["tensor_parallel_size"]) == ("tensor_parallel", 2)
    assert row["requests_tokens_equal"] == REQUESTS
    assert row["tp_throughput_ratio"] == pytest.approx(row["fastllm_tp_tok_s"]
                                                       / row["fastllm_tok_s"])
    assert 0 < row["broadcast_ms_per_step"] < row["fastllm_tp_call_median_ms"]
    table = bench_engine.tables(config, [row])
    assert "| tensor-parallel / one process |" in "".join(table.values())


def test_goal_summary_judges_both_goals() -> None:
    config = bench_engine.EngineBenchConfig()
    assert config.at_goal_size and not bench_engine.EngineBenchConfig(layers=4).at_goal_size
    rows = [{"section": "throughput", "dtype": "float32", "throughput_speedup_vs_hf": 6.0},
            {"section": "prefix", "dtype": "float32", "prefix_ttft_ratio": 4.0},
            {"section": "throughput", "dtype": "bfloat16", "throughput_speedup_vs_hf": 2.0},
            {"section": "prefix", "dtype": "bfloat16", "prefix_ttft_ratio": 8.0}]
    summary = bench_engine.goal_summary(config, rows)
    assert "float32 throughput 6.00x (met), prefix TTFT 4.00x (NOT met)" in summary
    assert "bfloat16 throughput 2.00x (NOT met), prefix TTFT 8.00x (met)" in summary


def test_padded_batches_sort_and_left_pad() -> None:
    prompts = [[5, 6, 7], [1], [2, 3], [4, 4, 4, 4]]
    batches = bench_engine.padded_batches(prompts, 3, "cpu")
    assert [b.indices for b in batches] == [[1, 2, 0], [3]]
    first = batches[0]
    assert first.input_ids.tolist() == [[0, 0, 1], [0, 2, 3], [5, 6, 7]]
    assert first.attention_mask.tolist() == [[0, 0, 1], [0, 1, 1], [1, 1, 1]]
    assert batches[1].input_ids.tolist() == [[4, 4, 4, 4]]


def test_percentile() -> None:
    assert bench_engine.percentile([3.0], 99) == 3.0
    assert bench_engine.percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert bench_engine.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
