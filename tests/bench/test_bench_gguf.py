"""The GGUF benchmark's defaults and report; where llama-cpp-python is installed (``make bench``
installs it), its quick run end to end, with rows holding what the report says and the keys of
the stored sample the notebook test plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import find_model

from fastllm.bench.timer import TimerConfig
from tiny_bench import import_benchmark

REPO = Path(__file__).resolve().parents[2]
bench_gguf = import_benchmark("bench_gguf")

SAMPLE = REPO / "tests" / "data" / "bench_gguf_quick.json"


def test_defaults_are_make_benchs() -> None:
    config, out = bench_gguf.parse_args([])
    assert config == bench_gguf.GGUFBenchConfig() and out == Path("results")
    assert config.files == bench_gguf.FILES and len(config.files) == 7
    assert (config.prompt_len, config.decode_tokens, config.agree_tokens, config.threads,
            config.n_ctx, config.n_batch, config.qwen3_layers) == (512, 128, 32, 2, 1024, 512, 28)
    assert config.timer == TimerConfig(warmup=1, repeats=5, budget_s=60.0)
    assert config.dtypes == ("float32", "bfloat16") and config.load_repeats == 3
    assert config.at_goal_size


def test_quick_is_one_short_call_on_the_shipped_file() -> None:
    config, _ = bench_gguf.parse_args(["--quick"])
    assert config == bench_gguf.GGUFBenchConfig.quick()
    assert config.files == ("smollm2:Q4_1",) and not config.at_goal_size
    assert config.dtypes == ("float32", "bfloat16") and config.load_repeats == 1
    config, _ = bench_gguf.parse_args(["--quick", "--decode-tokens", "4", "--files",
                                       "qwen3-0.6b:Q8_0", "--dtypes", "float16"])
    assert (config.files, config.decode_tokens, config.prompt_len, config.dtypes) == (
        ("qwen3-0.6b:Q8_0",), 4, 32, ("float16",))


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="files must be some of"):
        bench_gguf.GGUFBenchConfig(files=("smollm2:Q2_K",))
    with pytest.raises(ValueError, match="cannot hold the prompt"):
        bench_gguf.GGUFBenchConfig(prompt_len=1000)
    for dtypes in ((), ("float32", "float32"), ("float64",)):
        with pytest.raises(ValueError, match="dtypes must be distinct names"):
            bench_gguf.GGUFBenchConfig(dtypes=dtypes)
    with pytest.raises(ValueError, match="load_repeats"):
        bench_gguf.GGUFBenchConfig(load_repeats=0)
    with pytest.raises(SystemExit):  # argparse: llama.cpp runs on the CPU here
        bench_gguf.parse_args(["--device", "cuda"])


def test_goal_summary_judges_every_file_and_dtype() -> None:
    config = bench_gguf.GGUFBenchConfig()
    met = {"decode_speedup": 1.3, "ttft_speedup": 1.5, "load_ratio": 3.0}
    rows = [{"file": "a", "dtype": "float32", **met},
            {"file": "a", "dtype": "bfloat16", **met, "decode_speedup": 1.29},
            {"file": "b", "dtype": "float32", **met, "ttft_speedup": 1.4},
            {"file": "c", "dtype": "bfloat16", **met, "load_ratio": 3.1},
            # 16-bit files are held to the read bandwidth too.
            {"file": "m:F16", "dtype": "float32", **met, "fastllm_read_fraction": 0.79},
            {"file": "m:BF16", "dtype": "bfloat16", **met, "fastllm_read_fraction": 0.8}]
    assert bench_gguf.goal_summary(config, rows).endswith(
        "NOT met on a bfloat16, b float32, c bfloat16, m:F16 float32.")
    assert bench_gguf.goal_summary(config, rows[:1]).endswith("met on every file.")
    quick = bench_gguf.GGUFBenchConfig.quick()
    assert bench_gguf.goal_summary(quick, rows).endswith("not measured in this run (sizes "
                                                         "scaled down).")


def test_fastllm_keeps_kv_in_float16_as_llama_cpp_does() -> None:
    config = bench_gguf.GGUFBenchConfig()
    assert bench_gguf.fastllm_kv_cache_dtype("float32") == "float16"
    caption = bench_gguf.tables(config, [])[
        "Batch-1 generation from GGUF files, fastllm against llama.cpp"]
    assert ("fastllm in float32 with its KV cache in float16, in bfloat16 with its KV cache in "
            "bfloat16 (llama.cpp's default cache: F16)") in caption
    # A 16-bit dtype keeps its own: a cache of another dtype serves float32 activations only.
    assert bench_gguf.fastllm_kv_cache_dtype("bfloat16") == "bfloat16"
    assert bench_gguf.fastllm_options(config, "bfloat16")["kv_cache_dtype"] == "bfloat16"


@pytest.mark.llama_cpp
@pytest.mark.usefixtures("llama_cpp")
def test_quick_run_writes_rows(tmp_path: Path, smollm2_path: Path) -> None:
    models_dir = find_model("rerank_eval").parent
    document = bench_gguf.main(["--quick", "--out", str(tmp_path), "--models-dir",
                                str(models_dir), "--cache-dir", str(tmp_path / "cache")])
    written = json.loads((tmp_path / "gguf.json").read_text())
    assert written["rows"] == document["rows"]
    assert written["machine"]["torch_threads"] == 2
    rows = written["rows"]
    assert [(row["file"], row["dtype"]) for row in rows] == [("smollm2:Q4_1", "float32"),
                                                             ("smollm2:Q4_1", "bfloat16")]
    # Both dtypes were measured against the same llama.cpp calls.
    assert rows[0]["llama_cpp_decode_median_ms"] == rows[1]["llama_cpp_decode_median_ms"]
    row = rows[0]
    assert (row["file"], row["path"]) == ("smollm2:Q4_1", smollm2_path.name)
    assert not (tmp_path / "cache").exists()  # the shipped file needs nothing made
    # Tied embeddings: the whole file is read per token (the LM head is the embedding table).
    assert row["bytes_per_token"] == row["tensor_bytes"] == 96_576_768
    assert row["tensor_types"] == "Q4_1 210, F32 61, Q8_0 1"
    assert row["fastllm_bytes_per_token"] <= 1.1 * row["bytes_per_token"]  # kept in blocks
    for name in bench_gguf.COMPETITORS:
        assert row[f"{name}_call_repeats"] == row[f"{name}_ttft_repeats"] == 1
        assert len(row[f"{name}_tokens"]) == 9  # the first token and 8 decoded
        assert row[f"{name}_decode_tok_s"] == pytest.approx(
            8 / (row[f"{name}_decode_median_ms"] / 1e3))
        assert row[f"{name}_weight_gbps"] == pytest.approx(
            row["bytes_per_token"] * row[f"{name}_decode_tok_s"] / 1e9)
        assert (row[f"{name}_ttft_median_ms"] + row[f"{name}_decode_median_ms"]
                <= row[f"{name}_call_median_ms"])
    assert row["decode_speedup"] == pytest.approx(row["fastllm_decode_tok_s"]
                                                  / row["llama_cpp_decode_tok_s"])
    assert row["ttft_speedup"] == pytest.approx(row["llama_cpp_ttft_median_ms"]
                                                / row["fastllm_ttft_median_ms"])
    assert 0 <= row["tokens_agree"] <= 8
    assert row["copy_gbps"] > 0 and row["copy_1t_gbps"] > 0 and row["read_gbps"] > 0
    for name in bench_gguf.COMPETITORS:
        assert row[f"{name}_read_fraction"] == pytest.approx(row[f"{name}_weight_gbps"]
                                                            / row["read_gbps"])
    for each in rows:  # fresh processes loaded the file
        assert each["fastllm_load_s"] > 0 and each["llama_cpp_load_s"] > 0
        assert each["load_ratio"] == pytest.approx(each["fastllm_load_s"]
                                                   / each["llama_cpp_load_s"])
    # The decode step by part adds up to the measured step; the weights take time.
    parts = row["fastllm_step_ms"]
    assert list(parts) == [*bench_gguf.STEP_PARTS, "other ops", "Python and framework"]
    assert sum(parts.values()) == pytest.approx(row["fastllm_decode_median_ms"] / 8)
    assert parts["weights"] > 0 and min(parts.values()) >= 0
    markdown = (tmp_path / "gguf.md").read_text()
    assert "not measured in this run" in markdown
    assert "\n| smollm2:Q4_1 | float32 |" in markdown and "\n| smollm2:Q4_1 | bfloat16 |" in markdown
    assert "with its KV cache in float16" in markdown
    # The stored sample that tests/test_notebooks.py plots is still what a run writes.
    sample = json.loads(SAMPLE.read_text())
    assert sample["rows"][0].keys() == row.keys()
    assert sample["config"].keys() == written["config"].keys()
    assert sample["machine"].keys() == written["machine"].keys()
