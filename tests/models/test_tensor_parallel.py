"""Tensor parallelism (fastllm.models.tensor_parallel): two gloo ranks, each loading its shard,
run a prefill of prompts of mixed lengths in one batch and decode steps, and must give the
unsharded model's logits (float32: the same greedy tokens, logits within a summation-order
tolerance) on every rank. Models: the real stories260K, tiny random Qwen3-shaped GQA and MQA
(key/value heads replicated) and Llama models with biases and a vocabulary that does not split
evenly, the F16 GGUF fixture and a GGUF of Q8_0 and Q4_0 blocks written here. Plus the shards'
contents, the refusals, and the collectives a decode step makes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import OpLog, metadata_for
from distributed import run_on_ranks
from gguf import GGMLQuantizationType as QT
from tiny_hf import random_hf_model, save_hf_model

from fastllm import ops
from fastllm.ops import reference
from fastllm.engine.model_runner import ModelRunner
from fastllm.kv_cache import PagedKVCache
from fastllm.models import TensorParallel, load_model
from fastllm.models.pool import ModelPool
from fastllm.models.quantized import QuantizedEmbedding, SegmentedQuantizedLinear
from fastllm.models.tensor_parallel import ShardLayout

SIZE = 2
BLOCK_SIZE = 4  # small, so the prompts span several blocks
PROMPT_LENGTHS = (5, 1, 12)
DECODE_STEPS = 3
ATOL = 1e-4  # float32 logits: the all-reduces sum the partial products in another order
# Block-quantized projections quantize their input to 8-bit blocks as they read it: a value that
# summed in another order can round to its neighbouring step.
QUANTIZED_ATOL = 1e-3

# A vocabulary of 101 tokens: 51 rows a rank, the last padded with one zero row.
HF_BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, head_dim=16, max_position_embeddings=128,
               rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# name -> (model_type, overrides of HF_BASE)
HF_CASES = {
    # GQA, 1 key/value head a rank; q/k/v and o biases (o's added once), untied head.
    "qwen3-gqa": ("qwen3", dict(num_key_value_heads=2, attention_bias=True,
                                tie_word_embeddings=False)),
    # MQA: the key/value head replicated on both ranks; the tied embedding shared by the head.
    "qwen3-mqa": ("qwen3", dict(num_key_value_heads=1, attention_bias=True,
                                tie_word_embeddings=True)),
    # MLP biases: gate/up's split with their rows, down's added once.
    "llama-mlp-bias": ("llama", dict(num_key_value_heads=2, mlp_bias=True,
                                     tie_word_embeddings=False)),
}
# GGUF written here: llama layout (q/k rows permuted per head), Q4_0 and Q8_0 mixed in the
# fused QKV projection (a segmented layer); 32-value blocks, so every split falls on a block.
GGUF_SHAPE = dict(vocab=97, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128)
GGUF_TYPES = {"token_embd": QT.Q4_0, "output": QT.Q8_0, "attn_q": QT.Q4_0, "attn_k": QT.Q4_0,
              "attn_v": QT.Q8_0, "attn_output": QT.Q8_0, "ffn_gate": QT.Q4_0, "ffn_up": QT.Q4_0,
              "ffn_down": QT.Q8_0}


def write_quantized_gguf(path: Path, intermediate: int, seed: int = 0) -> Path:
    """A 2-layer llama GGUF of :data:`GGUF_SHAPE` (MLP ``intermediate`` wide), random weights
    quantized by the gguf package into :data:`GGUF_TYPES`, norms F32."""
    s, rng = GGUF_SHAPE, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    q, kv = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    shapes = {"token_embd": (s["vocab"], s["hidden"]), "output_norm": (s["hidden"],),
              "output": (s["vocab"], s["hidden"])}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm": (s["hidden"],), f"blk.{i}.attn_q": (q, s["hidden"]),
                       f"blk.{i}.attn_k": (kv, s["hidden"]), f"blk.{i}.attn_v": (kv, s["hidden"]),
                       f"blk.{i}.attn_output": (s["hidden"], q),
                       f"blk.{i}.ffn_norm": (s["hidden"],),
                       f"blk.{i}.ffn_gate": (intermediate, s["hidden"]),
                       f"blk.{i}.ffn_up": (intermediate, s["hidden"]),
                       f"blk.{i}.ffn_down": (s["hidden"], intermediate)})
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(f"{name}.weight", 1 + 0.1 * rng.standard_normal(shape, np.float32))
            continue
        kind = GGUF_TYPES[name.rsplit(".", 1)[-1]]
        values = rng.standard_normal(shape, np.float32) * shape[1] ** -0.5 * 2
        writer.add_tensor(f"{name}.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_path) -> dict[str, Path]:
    """Case name -> the checkpoint (HF folder or GGUF file)."""
    paths = {"stories260K": model_path("stories260K_hf"),
             "gguf-f16": model_path("gguf") / "llama-2-tiny-random.gguf"}
    for seed, (name, (model_type, overrides)) in enumerate(HF_CASES.items()):
        hf = random_hf_model(model_type, seed, **{**HF_BASE, **overrides})
        paths[name] = save_hf_model(hf, tmp_path_factory.mktemp(name))
    paths["gguf-q8_0-q4_0"] = write_quantized_gguf(
        tmp_path_factory.mktemp("gguf") / "q.gguf", GGUF_SHAPE["intermediate"])
    return paths


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def step_logits(tensor_parallel: TensorParallel | None, path: Path,
                decode_tokens: list[list[int]] | None) -> torch.Tensor:
    """``[1 + DECODE_STEPS, len(PROMPT_LENGTHS), vocab]`` logits of the model at ``path`` (the
    rank's shard): a prefill of every prompt in one batch, then decode steps feeding
    ``decode_tokens[step]`` (None: the greedy tokens)."""
    model = load_model(path, tensor_parallel=tensor_parallel)
    cache = PagedKVCache(model.kv_cache_spec(BLOCK_SIZE), 32)
    runner = ModelRunner(model, cache)
    seqs = prompts(model.config.vocab_size)
    seq_ids = list(range(len(seqs)))
    for seq_id, prompt in enumerate(seqs):
        cache.block_manager.allocate(seq_id, prompt)
    steps = [runner.execute_placed_sequences(seq_ids, seqs).logits]
    for step in range(DECODE_STEPS):
        tokens = (steps[-1].argmax(-1).tolist() if decode_tokens is None
                  else decode_tokens[step])
        for seq_id, token in zip(seq_ids, tokens):
            cache.copy_blocks(cache.block_manager.append_tokens(seq_id, [token]))
        steps.append(runner.execute_placed_sequences(seq_ids, [[t] for t in tokens]).logits)
    return torch.stack(steps)


def sharded_logits(tensor_parallel: TensorParallel, cases: list[tuple[str, Path, list]]
                   ) -> dict[str, torch.Tensor]:
    """:func:`step_logits` of every case on this rank (one process group for all: spawning
    ranks costs seconds)."""
    return {name: step_logits(tensor_parallel, path, tokens) for name, path, tokens in cases}


@pytest.fixture(scope="module")
def logits(checkpoints) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """Case name -> (the unsharded model's logits, each rank's)."""
    whole = {name: step_logits(None, path, None) for name, path in checkpoints.items()}
    cases = [(name, path, whole[name][:-1].argmax(-1).tolist())
             for name, path in checkpoints.items()]
    ranks = run_on_ranks(sharded_logits, cases, size=SIZE)
    return {name: (whole[name], [rank[name] for rank in ranks]) for name in checkpoints}


@pytest.mark.parametrize("case", ["stories260K", *HF_CASES, "gguf-f16", "gguf-q8_0-q4_0"])
def test_every_rank_gets_the_unsharded_logits(logits, case):
    whole, ranks = logits[case]
    for rank, got in enumerate(ranks):
        assert got.shape == whole.shape, f"rank {rank}"
        assert torch.equal(got.argmax(-1), whole.argmax(-1)), f"rank {rank}: greedy tokens differ"
        atol = QUANTIZED_ATOL if case == "gguf-q8_0-q4_0" else ATOL
        torch.testing.assert_close(got, whole, atol=atol, rtol=0, msg=f"rank {rank}")


def test_shards_hold_their_rows(checkpoints):
    """Loaded without a group (loading communicates nothing): each rank's heads, replicated
    key/value head, MLP features and vocabulary rows (padded), the row-parallel bias on rank 0,
    a KV cache of its heads, and the whole model's config."""
    whole = load_model(checkpoints["qwen3-mqa"])
    state = whole.state_dict()
    d, q_rows = whole.config.head_dim, whole.config.n_heads * whole.config.head_dim
    for rank in range(SIZE):
        shard = load_model(checkpoints["qwen3-mqa"],
                           tensor_parallel=TensorParallel(rank, SIZE, "unused"))
        assert shard.config == whole.config
        assert shard.kv_cache_spec(BLOCK_SIZE).n_kv_heads == 1
        qkv = shard.layers[0].self_attn.qkv_proj.weight  # 2 query heads, k, v
        heads = slice(rank * 2 * d, (rank + 1) * 2 * d)
        full = state["layers.0.self_attn.qkv_proj.weight"]
        torch.testing.assert_close(qkv, torch.cat([full[heads], full[q_rows:]]), rtol=0, atol=0)
        o = shard.layers[0].self_attn.o_proj
        torch.testing.assert_close(o.weight, state["layers.0.self_attn.o_proj.weight"][:, heads],
                                   rtol=0, atol=0)
        assert (o.bias is not None) == (rank == 0)
        inter = whole.config.intermediate_size // SIZE
        torch.testing.assert_close(shard.layers[0].mlp.down_proj.weight,
                                   state["layers.0.mlp.down_proj.weight"][:, rank * inter:
                                                                          (rank + 1) * inter],
                                   rtol=0, atol=0)
        embed = shard.embed_tokens.weight  # [51, hidden]: rows 0-50, then 51-100 and a zero row
        rows = state["embed_tokens.weight"][rank * 51:(rank + 1) * 51]
        assert embed.shape[0] == 51 and shard.lm_head is None  # tied: the head reads the shard
        torch.testing.assert_close(embed[:len(rows)], rows, rtol=0, atol=0)
        assert not embed[len(rows):].any()


def test_the_pool_keeps_each_rank_apart(checkpoints):
    pool, path = ModelPool(4), checkpoints["qwen3-gqa"]
    shards = [pool.load(path, tensor_parallel=TensorParallel(rank, SIZE, "unused"))
              for rank in range(SIZE)]
    whole = pool.load(path)
    assert shards[0] is not shards[1] and whole not in shards
    assert pool.load(path, tensor_parallel=TensorParallel(1, SIZE, "unused")) is shards[1]
    assert (path, "float32", "cpu", None, TensorParallel(0, SIZE, "unused")) in pool
    assert shards[1].kv_cache_spec().n_kv_heads == 1 and whole.kv_cache_spec().n_kv_heads == 2
    with pytest.raises(TypeError, match="tensor_parallel must be a TensorParallel or None"):
        pool.load(path, tensor_parallel=(0, 2, "unused"))


def test_quantized_shards_split_whole_blocks(checkpoints):
    shard = load_model(checkpoints["gguf-q8_0-q4_0"],
                       tensor_parallel=TensorParallel(1, SIZE, "unused"))
    assert isinstance(shard.layers[0].self_attn.qkv_proj, SegmentedQuantizedLinear)
    assert isinstance(shard.embed_tokens, QuantizedEmbedding)
    # 97 tokens: 49 rows a rank, the last one zero blocks.
    assert shard.embed_tokens.weight.shape[0] == 49
    assert not shard.embed_tokens.weight[-1].any()


def test_a_row_split_inside_a_block_is_refused(tmp_path):
    path = write_quantized_gguf(tmp_path / "q.gguf", intermediate=96)  # 48 values a rank
    with pytest.raises(ValueError, match=r"splits the rows of blk\.0\.ffn_down\.weight \(96 "
                                         r"values, in Q8_0 blocks of 32\) into parts of 48"):
        load_model(path, tensor_parallel=TensorParallel(0, SIZE, "unused"))


def test_layouts_that_do_not_divide_are_refused(checkpoints):
    config = load_model(checkpoints["qwen3-gqa"]).config  # 4 heads, 2 kv heads, 96 features
    with pytest.raises(ValueError, match=r"attention heads \(4\) to be a multiple of 3"):
        ShardLayout.of(config, TensorParallel(0, 3, "g"))
    with pytest.raises(ValueError, match=r"key/value heads \(3\) to be a multiple of 2"):
        ShardLayout.of(dataclasses.replace(config, n_heads=6, n_kv_heads=3),
                       TensorParallel(0, 2, "g"))
    with pytest.raises(ValueError, match=r"key/value heads \(3\) to be a multiple of 4, or to "
                                         r"divide 4"):
        ShardLayout.of(dataclasses.replace(config, n_heads=12, n_kv_heads=3),
                       TensorParallel(0, 4, "g"))
    with pytest.raises(ValueError, match=r"intermediate size \(97\) to be a multiple of 2"):
        ShardLayout.of(dataclasses.replace(config, intermediate_size=97),
                       TensorParallel(0, 2, "g"))
    with pytest.raises(ValueError, match=r"attention heads \(4\) to be a multiple of 3"):
        load_model(checkpoints["qwen3-gqa"], tensor_parallel=TensorParallel(0, 3, "g"))


@pytest.mark.parametrize("rank, size, group_name, error", [
    (2, 2, "g", ValueError), (-1, 2, "g", ValueError), (0, 0, "g", ValueError),
    (0, True, "g", TypeError), (0.0, 2, "g", TypeError), (0, 2, "", ValueError),
    (0, 2, None, ValueError)])
def test_tensor_parallel_is_checked(rank, size, group_name, error):
    with pytest.raises(error):
        TensorParallel(rank, size, group_name)


def test_decoder_layers_take_a_group_name_or_none(model_path):
    model = load_model(model_path("stories260K_hf"))
    layers = [model.layers[0].record()]
    for bad in ("", 0):
        with pytest.raises(ValueError, match="group_name must be a process group's name or "
                                             "None"):
            ops.DecoderLayers(layers, model.rope_tables(), bad)


def decode_ops(tensor_parallel: TensorParallel, path: Path, token_ids: list[int]) -> dict:
    """One decode step of two sequences through the rank's shard: the ops the first decoder
    layer calls run alone (as :class:`fastllm.ops.DecoderLayers`) and its output, with its
    float64 twin's; the ops of the whole model's step, and its logits: all of them at
    ``token_ids``, and only those."""
    model = load_model(path, tensor_parallel=tensor_parallel)
    cache = PagedKVCache(model.kv_cache_spec(BLOCK_SIZE), 8)
    for seq_id in range(2):
        cache.block_manager.allocate(seq_id, [1, 2, 3])
    ModelRunner(model, cache).execute_placed_sequences([0, 1], [[1, 2, 3], [1, 2, 3]])
    for seq_id in range(2):
        cache.copy_blocks(cache.block_manager.append_tokens(seq_id, [4]))
    step = metadata_for(cache, [0, 1], [1, 1])
    layers = [model.layers[0].record()]
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = ops.DecoderLayers(layers, model.rope_tables(), tensor_parallel.group_name)
    layer_input, caches = x.clone(), (cache.k_cache[:1], cache.v_cache[:1])
    with OpLog() as layer_log:
        out, _ = layer(layer_input, None, step, *caches, pre_rope=False)
    want, _, _, _ = reference.decoder_layers(layers, x, None, step, *caches,
                                             rope_tables=model.rope_tables(), pre_rope=False,
                                             group_name=tensor_parallel.group_name)
    with OpLog() as model_log:
        hidden = model(torch.tensor([4, 4]), step, cache)
        logits = model.compute_logits(hidden)
    return dict(layer_ops=layer_log.names, layer_out=out, reference_out=want,
                model_ops=model_log.names,
                at_ids=logits[:, token_ids], scores=model.compute_logits(
                    hidden, torch.tensor(token_ids)))


def test_a_decode_layer_all_reduces_twice(model_path):
    """One all-reduce (then its wait) after each row-parallel projection, before the residual
    add, from C++ and in the float64 twin alike; the step adds one for the embedding and one
    gather of the logits. Logits of chosen tokens (both ranks' rows) are the full logits'
    columns."""
    path = model_path("stories260K_hf")
    reduce = ["_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]
    expected = ["fastllm::rms_norm", "fastllm::linear", "fastllm::rotary_and_cache",
                "fastllm::paged_attention", "fastllm::linear", *reduce, "fastllm::add_rms_norm",
                "fastllm::linear", "fastllm::silu_and_mul", "fastllm::linear", *reduce]
    num_layers = load_model(path).config.num_layers
    token_ids = [0, 255, 256, 511, 7]  # rank 0 holds rows 0-255, rank 1 256-511
    for result in run_on_ranks(decode_ops, path, token_ids, size=SIZE):
        assert result["layer_ops"] == expected
        # The float64 twin sums over the group too.
        torch.testing.assert_close(result["layer_out"].double(), result["reference_out"],
                                   atol=1e-4, rtol=1e-4)
        model_ops = result["model_ops"]
        assert model_ops.count("_c10d_functional::all_reduce") == 2 * num_layers + 1
        assert model_ops.count("_c10d_functional::all_gather_into_tensor") == 1
        assert model_ops.count("_c10d_functional::wait_tensor") == 2 * num_layers + 2
        torch.testing.assert_close(result["scores"], result["at_ids"], atol=1e-6, rtol=0)
