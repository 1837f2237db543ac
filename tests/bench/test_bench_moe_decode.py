"""The mixture-of-experts benchmark end to end at tiny sizes: fastllm and HF generate the same
greedy tokens in float32, and the row's byte counts are the model's."""

from __future__ import annotations

import json

import pytest
from conftest import find_model

from tiny_bench import import_benchmark

bench_moe_decode = import_benchmark("bench_moe_decode")

TINY = ["--layers", "1", "--hidden-size", "64", "--moe-intermediate-size", "32",
        "--num-experts", "8", "--experts-per-token", "2", "--prompt-len", "8",
        "--decode-tokens", "4", "--copy-mib", "8", "--dtypes", "float32", "--repeats", "1",
        "--warmup", "0"]


def test_defaults_are_a_qwen3_30b_a3b_layer_pair() -> None:
    config, _ = bench_moe_decode.parse_args([])
    assert (config.layers, config.hidden_size, config.num_experts, config.experts_per_token,
            config.moe_intermediate_size, config.dtypes) == (2, 2048, 128, 8, 768,
                                                             ("bfloat16",))


def test_tiny_run(bench_run) -> None:
    models_dir = find_model("qwen3_tokenizer").parent
    document, out = bench_run("moe_decode", [*TINY, "--models-dir", str(models_dir)])
    [row] = document["rows"]
    assert row["fastllm_tokens"] == row["hf_tokens"]  # float32: the same greedy tokens
    assert row["tokens_agree"] == 5
    # One layer: attention (q 4096 + k 512 + v 512 rows, o 64 x 4096; q/k norms), two of the
    # eight experts (3 x 64 x 32 each), the router (8 x 64), two norms, the final norm and the
    # LM head (151,936 x 64); the embedding is looked up, not read.
    attention = (4096 + 2 * 512) * 64 + 64 * 4096 + 2 * 128
    experts = 3 * 64 * 32
    head = 151_936 * 64
    other = 8 * 64 + 3 * 64
    assert row["step_read_gb"] * 1e9 == pytest.approx(4 * (attention + 2 * experts + head + other))
    assert row["dense_equivalent_gb"] * 1e9 == pytest.approx(
        4 * (attention + 8 * experts + 2 * head + other))
    assert row["fastllm_decode_tok_s"] > 0 and row["dense_equivalent_tok_s"] > 0
    assert json.loads((out / "moe_decode.json").read_text())["rows"] == document["rows"]
    assert "dense-equivalent tok/s bound" in (out / "moe_decode.md").read_text()
