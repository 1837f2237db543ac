"""GGUF loading: the llama.cpp fixture against transformers' own GGUF reader; round trips of tiny
random HF models of each family written as convert_hf_to_gguf.py writes them (its tensor names,
Gemma's 1 + w norms, Phi-3's fused tensors, stacked experts, each family's metadata keys;
checked against transformers' GGUF reader where it reads the family), in every supported tensor
type (loaded onto each device present); what llama.cpp fixes rather than stores (Gemma's
attention scale, window pattern, local RoPE; Qwen3-MoE's renormalized experts); Llama 3.1 RoPE
scaling given as ``rope_freqs.weight``; and every refusal."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import assert_logits_close, cpu_isa, model_device, prefill_logits
import transformers
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from fastllm import _C, ops
from fastllm.engine.model_runner import ModelRunner
from fastllm.kv_cache import PagedKVCache
from fastllm.gguf_file import GGUFFileReader
from fastllm.models import DecoderLM, ModelConfig, hf_weight_map, load_model
from fastllm.models.gguf import (config_from_gguf, gguf_tensor_name, gguf_tensor_part,
                                 load_gguf)
from fastllm.models.decoder import DEFAULT_ROPE_POSITIONS, Experts
from fastllm.models.quantized import SegmentedQuantizedLinear, quantize_weight
from tiny_hf import randomize_

transformers.logging.set_verbosity_error()

ATOL = 1e-4  # float32 logits, fastllm vs HF eager on the weights the file encodes
FIXTURE = "llama-2-tiny-random.gguf"
NEW_TOKENS = 8

# K-quants pack 256 values per block along a row, so every row length here is a multiple of 256.
BASE = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None,
            tie_word_embeddings=False)

# The round trips' prompt for experts: long enough that each expert of a block-quantized file
# gets more than FEW_ROWS of the tokens (2 of 4 experts a token; checked), so that it runs the
# float32 GEMM rather than the few-row kernel's integer activations, which can flip a close
# routing choice in the next layer (see test_round_trip).
MOE_PROMPT = 160
FEW_ROWS = 32

# name -> (model_type, overrides of BASE)
CASES = {
    # GQA; q/k/v/o biases, so the q/k permutation is undone on biases too; linear RoPE scaling,
    # written as rope.scaling.* metadata.
    "llama": ("llama", dict(attention_bias=True, rope_parameters=dict(
        rope_type="linear", factor=2.0, rope_theta=10000.0))),
    # q/k/v biases, tied embeddings (no output.weight).
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    # q/k norms; head_dim 128 != hidden / heads, written as attention.key_length.
    "qwen3": ("qwen3", dict(head_dim=128)),
    # Sandwich norms, stored as 1 + w; tied embeddings; soft-caps below the defaults, so that
    # they bite; layer 0 slides, layer 1 does not. head_dim 32 != hidden / heads: llama.cpp
    # scales attention by head_dim ** -0.5 (query_pre_attn_scalar = head_dim).
    "gemma2": ("gemma2", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                              attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                              tie_word_embeddings=True)),
    # Per-head q/k norms (1 + w too); five sliding layers with local RoPE, then a full one
    # whose RoPE is linearly scaled (rope.scaling.*).
    "gemma3": ("gemma3_text", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, num_hidden_layers=6,
        tie_word_embeddings=True, rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=500.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0)))),
    # test_parity's phi3-partial-rotary: q|k|v and gate|up fused (attn_qkv, ffn_up); half of
    # each head rotated (rope.dimension_count); every layer slides.
    "phi3": ("phi3", dict(sliding_window=8, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # test_parity's olmo2: norms on the sublayers' outputs only; q/k norms over all heads.
    "olmo2": ("olmo2", dict()),
    # Four experts, two a token, renormalized (as llama.cpp runs qwen3moe), in every layer
    # (llama.cpp's qwen3moe has no dense ones); expert rows of 256 values, for K-quant blocks.
    # head_dim given: HF's config class has no default for it.
    "qwen3moe": ("qwen3_moe", dict(head_dim=64, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=256, norm_topk_prob=True,
                                   max_position_embeddings=MOE_PROMPT + NEW_TOKENS)),
    # Mixtral, written as llama with experts: q/k rows permuted; experts intermediate_size wide.
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=MOE_PROMPT + NEW_TOKENS)),
}
# model_type -> general.architecture, as convert_hf_to_gguf.py's classes name them.
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2", "qwen3_moe": "qwen3moe",
             "mixtral": "llama"}
# HF's fused experts (transformers 5's modules) -> the projections convert_hf_to_gguf.py
# splits them into, each stacked over the experts.
FUSED_EXPERTS = {"mlp.experts.gate_up_proj": ("mlp.experts.gate_proj", "mlp.experts.up_proj"),
                 "mlp.experts.down_proj": ("mlp.experts.down_proj",)}
# The converter's Gemma2Model and Gemma3Model store every norm weight as 1 + w.
NORMS_PLUS_ONE = ("gemma2", "gemma3_text")

# Types gguf.quants can quantize are made from the HF weights; the K-quants, which it can only
# dequantize, are random blocks with sane scales, and the HF twin takes what they encode.
QUANTIZED_FROM_HF = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0")
RANDOM_BLOCKS = ("Q4_K", "Q5_K", "Q6_K")
# A file of several types, as llama.cpp's Q4_K_M: each weight's type by its HF module (down
# experts in Q6_K, gate and up experts in Q4_K, as in llama.cpp's MoE Q4_K_M files).
MIXED = {"Q4_K_M": lambda module: ("Q6_K" if module in ("v_proj", "down_proj") else
                                   "Q5_0" if module == "embed_tokens" else "Q4_K")}
# Every type on llama (whose q/k rows the file permutes), a few on the others. (Gemma's o_proj
# rows of 4 * 32 values are too short for K-quant blocks.)
ROUND_TRIPS = [*(("llama", qtype) for qtype in (*QUANTIZED_FROM_HF, *RANDOM_BLOCKS, *MIXED)),
               ("qwen2", "F32"), ("qwen2", "Q4_0"), ("qwen2", "Q6_K"),
               ("qwen3", "F32"), ("qwen3", "Q8_0"), ("qwen3", "Q4_K"),
               ("gemma2", "F32"), ("gemma2", "Q8_0"), ("gemma3", "F32"), ("gemma3", "Q8_0"),
               ("phi3", "F32"), ("phi3", "Q8_0"), ("phi3", "Q4_K"),
               ("olmo2", "F32"), ("olmo2", "Q8_0"),
               ("qwen3moe", "F32"), ("qwen3moe", "Q8_0"), ("qwen3moe", "Q6_K"),
               ("mixtral", "F32"), ("mixtral", "F16"), ("mixtral", "Q4_K_M")]
# Loose bound when the file holds HF's weights rounded: the least cosine similarity of a
# position's logits with HF's.
MIN_COSINE = {"F16": 0.99999, "BF16": 0.9999, "Q8_0": 0.999, "Q4_0": 0.85}
# Gemma's norms after each branch bring its output to unit RMS whatever its weights' scale, so
# every layer's rounding reaches the logits undamped; the logits still equal the HF twin's on
# the rounded weights.
MIN_COSINE_POST_NORMS = {"Q8_0": 0.95}


# Milder than test_parity's weights: 4-bit rounding of larger random weights scrambles the logits.
WEIGHT_SCALE = 0.05


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: HF half-split RoPE rows -> interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_by_index(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute`, found by where each row went (independent of the
    loader's reshape-based inverse)."""
    moved_from = permute(np.arange(w.shape[0]), n_head)  # file row r holds HF row moved_from[r]
    out = np.empty_like(w)
    out[moved_from] = w
    return out


def random_blocks(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols]`` of random K-quant blocks whose fp16 scales give values of ~0.1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin (fp16) lead the block: d * sc * q - dmin * m
        data[..., 0:2] = np.array([4e-4], np.float16).view(np.uint8)
        data[..., 2:4] = np.array([3e-3], np.float16).view(np.uint8)
    else:  # Q6_K: d (fp16) ends the block: value = d * scale * q
        data[..., -2:] = np.array([7e-5], np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def encode(w: np.ndarray, kind: QT, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what a file of type ``kind`` stores for ``w`` ``[..., cols]``, what that decodes to):
    ``w`` quantized, or random blocks of its shape for the K-quants."""
    if kind.name in RANDOM_BLOCKS:
        data = random_blocks(math.prod(w.shape[:-1]), w.shape[-1], kind, rng)
        data = data.reshape(*w.shape[:-1], -1)
    else:
        data = gguf.quants.quantize(w, kind)
    return data, gguf.quants.dequantize(data, kind)


def gguf_tensors(hf: torch.nn.Module, model_type: str, qtype: str, seed: int = 0
                 ) -> tuple[dict[str, tuple[np.ndarray, QT]], dict[str, torch.Tensor]]:
    """(llama.cpp name -> (stored array, type), HF name -> the float32 weight the file encodes),
    as convert_hf_to_gguf.py writes ``hf``: names by gguf-py's map for the architecture (the
    converter's ``map_tensor_name``), llama q/k rows permuted, Gemma's norms stored as 1 + w
    (in float32), 1-D tensors and the experts' router kept F32, HF's fused gate|up experts
    split into gate and up, each ``[experts, rows, cols]``. A Gemma norm encodes the HF weight
    ``w`` itself."""
    rng = np.random.default_rng(seed)
    config = hf.config
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == GGUF_ARCH[model_type])
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    stored: dict[str, tuple[np.ndarray, QT]] = {}
    encoded: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        layer, _, fused = hf_name.partition(".mlp.experts.")
        if fused:  # [experts, rows, cols]: gate rows then up rows, or down
            projections = FUSED_EXPERTS[f"mlp.experts.{fused}"]
            decoded = []
            for projection, part in zip(projections, np.split(w, len(projections), axis=1)):
                kind = QT[MIXED[qtype](projection.rsplit(".", 1)[-1]) if qtype in MIXED
                          else qtype]
                data, part_decoded = encode(part, kind, rng)
                stored[f"{name_map.get_name(f'{layer}.{projection}')}.weight"] = (data, kind)
                decoded.append(part_decoded)
            encoded[hf_name] = torch.from_numpy(np.concatenate(decoded, axis=1))
            continue
        module, kind_name = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(module)}.{kind_name}"
        if model_type in NORMS_PLUS_ONE and hf_name.endswith("norm.weight"):
            stored[gguf_name] = (w + np.float32(1), QT.F32)
            encoded[hf_name] = torch.from_numpy(w.copy())
            continue
        if hf_name.endswith(".mlp.gate.weight"):  # the router: the converter keeps it F32
            stored[gguf_name] = (w, QT.F32)
            encoded[hf_name] = torch.from_numpy(w.copy())
            continue
        module = module.rsplit(".", 1)[-1]
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        permuted = GGUF_ARCH[model_type] == "llama" and module in heads
        kind = QT.F32 if w.ndim == 1 else QT[MIXED[qtype](module) if qtype in MIXED else qtype]
        data, decoded = encode(permute(w, heads[module]) if permuted else w, kind, rng)
        # Blocks run along a row, so quantizing commutes with permuting rows: a quantized file
        # encodes dequantize(quantize(w)) in HF's row order.
        expected = unpermute_by_index(decoded, heads[module]) if permuted else decoded
        stored[gguf_name] = (data, kind)
        encoded[hf_name] = torch.from_numpy(np.array(expected, dtype=np.float32))
    return stored, encoded


def write_gguf(path: Path, model_type: str, config: transformers.PretrainedConfig,
               tensors: dict[str, tuple[np.ndarray, QT]], **metadata) -> Path:
    """Writes a GGUF with the metadata convert_hf_to_gguf.py's class for ``model_type`` writes
    for ``config``; ``metadata`` adds or replaces ``{arch}.``-relative keys or ``tokenizer.``
    ones (a value of None drops the key; ``architecture`` replaces general.architecture).

    The converter's classes: TextModel's common keys, the expert counts among them
    (LlamaModel, Mixtral's too, adds rope.dimension_count; Qwen2MoeModel, Qwen3-MoE's base, the
    experts' width);
    Gemma2Model writes its own, without rope.freq_base, with key_length, the soft-caps and the
    window; Gemma3Model adds to TextModel's the global layers' RoPE base and scaling, key_length,
    a truthy final soft-cap, and the window unless sliding_window_pattern is 1; Phi3MiniModel
    writes its own, with rope.dimension_count, the window (0 for none) and the original
    context; Olmo2Model is TextModel's."""
    arch = metadata.pop("architecture", GGUF_ARCH[model_type])
    writer = gguf.GGUFWriter(path, arch)
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: its global layers'
    kv = {"block_count": config.num_hidden_layers,
          "context_length": config.max_position_embeddings,
          "embedding_length": hidden,
          "feed_forward_length": config.intermediate_size,
          "attention.head_count": heads,
          "attention.head_count_kv": config.num_key_value_heads,
          "attention.layer_norm_rms_epsilon": config.rms_norm_eps}
    if model_type != "gemma2":
        kv["rope.freq_base"] = rope["rope_theta"]
    if GGUF_ARCH[model_type] == "llama":
        kv["rope.dimension_count"] = head_dim
    if model_type in ("qwen3_moe", "mixtral"):
        kv["expert_count"] = getattr(config, "num_experts", None) or config.num_local_experts
        kv["expert_used_count"] = config.num_experts_per_tok
    if model_type == "qwen3_moe":
        kv["expert_feed_forward_length"] = config.moe_intermediate_size
    if model_type in NORMS_PLUS_ONE or head_dim != hidden // heads:
        kv["attention.key_length"] = kv["attention.value_length"] = head_dim
    if rope.get("rope_type") == "linear" and model_type not in ("gemma2", "phi3"):
        kv["rope.scaling.type"], kv["rope.scaling.factor"] = "linear", rope["factor"]
    if model_type == "gemma2":
        kv["attn_logit_softcapping"] = config.attn_logit_softcapping
        kv["final_logit_softcapping"] = config.final_logit_softcapping
        kv["attention.sliding_window"] = config.sliding_window
    if model_type == "gemma3_text":
        if config.final_logit_softcapping:
            kv["final_logit_softcapping"] = config.final_logit_softcapping
        if getattr(config, "sliding_window_pattern", None) != 1:
            kv["attention.sliding_window"] = config.sliding_window
    if model_type == "phi3":
        kv["rope.dimension_count"] = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        kv["attention.sliding_window"] = config.sliding_window or 0
        kv["rope.scaling.original_context_length"] = config.original_max_position_embeddings
    kv["tokenizer.ggml.bos_token_id"] = config.bos_token_id
    kv["tokenizer.ggml.eos_token_id"] = config.eos_token_id
    for key, value in {**kv, **metadata}.items():
        key = key if key.startswith("tokenizer.") else f"{arch}.{key}"
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_models() -> dict[str, torch.nn.Module]:
    """Case name -> a tiny random HF model in float32."""
    models = {}
    for seed, (name, (model_type, overrides)) in enumerate(CASES.items()):
        config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
        models[name] = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32).eval()
        randomize_(models[name], seed, scale=WEIGHT_SCALE)
    return models


def twin_tensor(twin_state: dict[str, torch.Tensor], name: str,
                parts: list[tuple[str, tuple[int, ...]]]) -> torch.Tensor:
    """The HF model's weights that make fastllm parameter ``name`` (``parts``: its checkpoint
    tensors, as hf_weight_map lists them), concatenated. transformers 5 holds a layer's experts
    fused (``mlp.experts.gate_up_proj`` ``[experts, 2 * intermediate, hidden]``, gate rows
    first, as fastllm's; ``mlp.experts.down_proj``) and Mixtral's router as ``mlp.gate``, not
    under their checkpoint names."""
    layer, _, rest = name.partition(".mlp.")
    moe = {"router.weight": "gate.weight", "gate_up_proj": "experts.gate_up_proj",
           "down_proj": "experts.down_proj"}
    if rest in moe:
        return twin_state[f"model.{layer}.mlp.{moe[rest]}"]
    return torch.cat([twin_state[n] for n, _ in parts])


@contextlib.contextmanager
def expert_tokens(hf: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within this block, each forward of the HF mixture of experts ``hf`` appends to the list
    yielded, per layer, how many tokens each expert runs (its router's top-k choices)."""
    counts: list[torch.Tensor] = []

    def count(router: torch.nn.Module, inputs: tuple[torch.Tensor], _) -> None:
        logits = inputs[0].flatten(0, -2) @ router.weight.T  # [tokens, experts]
        chosen = logits.topk(hf.config.num_experts_per_tok, dim=-1).indices
        counts.append(torch.bincount(chosen.flatten(), minlength=logits.shape[1]))

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in hf.model.layers]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [len, vocab]


def greedy(model: DecoderLM, prompt: list[int]) -> list[int]:
    cache = PagedKVCache(model.kv_cache_spec(4), 64, device=model_device(model))
    runner = ModelRunner(model, cache)
    cache.block_manager.allocate(0, prompt)
    step, out = prompt, []
    for _ in range(NEW_TOKENS):
        out.append(int(runner.execute_placed_sequences([0], [step]).logits[0].argmax()))
        step = out[-1:]
        cache.copy_blocks(cache.block_manager.append_tokens(0, step))
    return out


def hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def prompt(vocab: int, n: int = 13, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the llama.cpp fixture --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_models(model_path) -> tuple[torch.nn.Module, DecoderLM]:
    """(transformers' load of the fixture, fastllm's). transformers' from_pretrained(gguf_file=)
    needs accelerate, which is not installed, so its GGUF reader is called directly: its own
    metadata map, tensor name map and q/k un-permutation (LlamaTensorProcessor)."""
    path = model_path("gguf") / FIXTURE
    with pytest.MonkeyPatch.context() as patch:
        # Both calls parse the file's 32k-token vocabulary, a pure read: once is enough.
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        config = AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                              dtype=torch.float32).eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                       model_to_load=hf)["tensors"]
    hf.load_state_dict(tensors, strict=True)
    return hf, load_model(path)


def test_fixture_config(fixture_models):
    config = fixture_models[1].config
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size,
            config.num_layers, config.n_heads, config.n_kv_heads, config.head_dim) == (
        "LlamaForCausalLM", 32000, 8, 32, 1, 2, 2, 4)
    # float32 metadata read back as the decimal the HF config held
    assert (config.rms_norm_eps, config.rope_theta, config.rope_scaling) == (1e-5, 1e4, None)
    assert (config.max_position_embeddings, config.tie_word_embeddings) == (4096, False)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (False,) * 3
    assert config.family.qk_norm is None


def test_fixture_matches_transformers_gguf_reader(fixture_models):
    hf, model = fixture_models
    hf_state = hf.state_dict()
    for name, parts in hf_weight_map(model.config).items():
        expected = torch.cat([hf_state[hf_name] for hf_name, _ in parts])
        assert torch.equal(model.state_dict()[name], expected), name
    tokens = prompt(32000, n=20)
    torch.testing.assert_close(prefill_logits(model, tokens), hf_logits(hf, tokens), atol=ATOL,
                               rtol=0)
    assert greedy(model, tokens) == hf_greedy(hf, tokens)


# --- round trips ------------------------------------------------------------------------------


def float32_gemm():
    """Prefill rows of block-quantized weights through the float32 GEMM (the scalar kernels'),
    not AVX2's byte GEMM of Q4_0 and the K-quants nor the bfloat16 one of AVX-512 CPUs with
    AVX512-BF16, so logits compare at float32 precision (test_quantized_linear bounds the
    others)."""
    return cpu_isa("scalar")


@pytest.mark.parametrize("case, qtype", ROUND_TRIPS, ids=[f"{c}-{q}" for c, q in ROUND_TRIPS])
def test_round_trip(hf_models, tmp_path, case, qtype, device):
    """A tiny HF model written as llama.cpp's converter writes it, loaded back onto ``device``:

    - every parameter equals the file's dequantized tensors in HF's row order (for quantized
      types, gguf.quants.dequantize(gguf.quants.quantize(w)) of the HF weight, exactly; Gemma's
      norms 1 + w, as fastllm folds them);
    - logits equal those of an HF twin holding those weights (greedy tokens too, in F32);
    - logits stay close to the HF model's own when the file holds its weights rounded.
    """
    hf, model_type = hf_models[case], CASES[case][0]
    tensors, encoded = gguf_tensors(hf, model_type, qtype)
    model = load_model(write_gguf(tmp_path / "model.gguf", model_type, hf.config, tensors),
                       device=device)
    twin = copy.deepcopy(hf)
    twin.load_state_dict(encoded, strict=False)  # a tied lm_head follows embed_tokens
    twin_state, state = twin.state_dict(), model.state_dict()
    if qtype not in ("F32", "F16", "BF16"):  # block formats stay in their blocks
        down = next(n for n in state if n.endswith(("down_proj.weight", "mlp.down_proj")))
        assert state[down].dtype == torch.uint8
    offset = model.config.family.norm_offset
    for name, parts in hf_weight_map(model.config).items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, SegmentedQuantizedLinear) and name.endswith(".weight"):
            # parts in different formats
            weight = torch.cat([ops.dequantize(getattr(module, f"segment{i}"), weight_type)
                                for i, weight_type in enumerate(module.weight_types)])
        elif isinstance(module, Experts) and not name.endswith("router.weight"):
            weight = state[name]  # [experts, rows, cols], or blocks [experts, rows, row bytes]
            weight_type = getattr(module, name.rsplit(".", 1)[1].removesuffix("_proj") + "_type")
            if weight_type is not None:
                weight = ops.dequantize(weight.flatten(0, 1), weight_type).view(
                    weight.shape[0], weight.shape[1], -1)
        else:
            weight = state[name]
            if weight.dtype == torch.uint8:  # kept in its blocks
                weight = ops.dequantize(weight, module.weight_type)
        expected = twin_tensor(twin_state, name, parts)
        if name.endswith("norm.weight"):
            expected = expected + offset  # as the converter stored it (and fastllm folds it)
        assert torch.equal(weight.cpu(), expected), name
    if qtype in MIXED:  # q and k in Q4_K, v in Q6_K: each part streams in its own format
        qkv = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, SegmentedQuantizedLinear)
        # (The CPU's decode layout of Q4_K where the kernels run AVX-512: the same blocks.)
        assert [ops.block_format(t)[0].split()[0] for t in qkv.weight_types] == ["Q4_K", "Q6_K"]
    for layer in model.layers:  # experts kept in the file's blocks, each projection's own
        if isinstance(layer.mlp, Experts):
            kinds = (layer.mlp.gate_up_type, layer.mlp.down_type)
            assert kinds == ((None, None) if qtype in ("F32", "F16", "BF16") else
                             (QT.Q4_K, QT.Q6_K) if qtype in MIXED else (QT[qtype],) * 2)

    # Up to 32 rows the CPU's quantized kernel streams with integer activations; past them (33
    # tokens here) prefill rows through the float32 GEMM compare at float32 precision (CUDA's
    # dequantizes past 8 rows and multiplies in float32 with cuBLAS). An expert's rows are its
    # tokens only.
    tokens = prompt(model.config.vocab_size, n=MOE_PROMPT if model.config.num_experts else 33)
    with float32_gemm():
        got = prefill_logits(model, tokens)
    if not model.config.num_experts:
        # The default path (on AVX2, Q4_0's and the K-quants' byte GEMM: 8-bit activations, as
        # llama.cpp's) stays close to them; experts: see below.
        default = prefill_logits(model, tokens).cpu()
        assert torch.cosine_similarity(default, got.cpu(), dim=-1).min() >= 0.99
    block_experts = model.config.num_experts and qtype not in ("F32", "F16", "BF16")
    with expert_tokens(twin) if block_experts else contextlib.nullcontext([]) as counts:
        expected = hf_logits(twin, tokens)
    if counts:
        fewest = min(c.min().item() for c in counts)
        assert fewest > FEW_ROWS, f"an expert runs {fewest} tokens: pick a longer prompt"
    assert_logits_close(got, expected, ATOL)
    bounds = MIN_COSINE_POST_NORMS if model_type in NORMS_PLUS_ONE else MIN_COSINE
    # Experts: rounding the random router's weights flips some close top-2 choices, and with
    # them whole positions' logits (Q8_0: a cosine of 0.61), so no bound holds position-wise.
    if qtype in bounds and not model.config.num_experts:
        cosine = torch.cosine_similarity(got.cpu(), hf_logits(hf, tokens), dim=-1).min().item()
        assert cosine >= bounds[qtype], cosine
    if qtype == "F32":
        assert greedy(model, tokens) == hf_greedy(hf, tokens)


def zero_experts(kind: QT) -> tuple[np.ndarray, QT]:
    """A stacked expert tensor of the qwen3moe case's shape, [4, 256, 256], in ``kind``."""
    return gguf.quants.quantize(np.zeros((4, 256, 256), np.float32), kind), kind


@pytest.mark.parametrize("edit, match", [
    ({"blk.1.ffn_up_exps.weight": None}, r"lacks blk\.1\.ffn_up_exps\.weight"),
    ({"blk.0.ffn_gate_inp.weight": None}, r"lacks blk\.0\.ffn_gate_inp\.weight"),
    ({"blk.0.ffn_gate_exps.weight": (np.zeros((3, 256, 256), np.float32), QT.F32)},
     r"blk\.0\.ffn_gate_exps\.weight has shape \(3, 256, 256\) \(ggml \[256, 256, 3\]\), "
     r"expected \(4, 256, 256\)"),
    ({"blk.0.ffn_down_exps.weight": zero_experts(QT.MXFP4)},
     r"blk\.0\.ffn_down_exps\.weight is MXFP4, which fastllm does not dequantize"),
    ({"blk.1.ffn_gate_exps.weight": zero_experts(QT.Q8_0),
      "blk.1.ffn_up_exps.weight": zero_experts(QT.Q4_0)},
     r"blk\.1\.ffn_gate_exps\.weight is Q8_0 but blk\.1\.ffn_up_exps\.weight is Q4_0; fastllm "
     "runs each expert's gate and up as one projection, so they must share one type"),
], ids=["missing-experts", "missing-router", "expert-count", "expert-type", "gate-up-types"])
def test_expert_refusals(hf_models, tmp_path, edit, match):
    """A qwen3moe file whose experts are missing, of another count, of a type fastllm does not
    read, or whose gate and up experts differ in type, is refused naming the tensor."""
    hf = hf_models["qwen3moe"]
    tensors = {**gguf_tensors(hf, "qwen3_moe", "F32")[0], **edit}
    tensors = {name: value for name, value in tensors.items() if value is not None}
    path = write_gguf(tmp_path / "model.gguf", "qwen3_moe", hf.config, tensors)
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_quantization_of_a_float_moe_file(hf_models, tmp_path):
    """quantization= quantizes a float file's experts too, each expert's rows as quantize_weight
    writes them (int8: Q8_0), and keeps its router float."""
    hf = hf_models["qwen3moe"]
    path = write_gguf(tmp_path / "model.gguf", "qwen3_moe", hf.config,
                      gguf_tensors(hf, "qwen3_moe", "F32")[0])
    full, int8 = load_model(path), load_model(path, quantization="int8")
    for float_layer, layer in zip(full.layers, int8.layers):
        assert (layer.mlp.gate_up_type, layer.mlp.down_type) == (QT.Q8_0, QT.Q8_0)
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(float_layer.mlp, name)  # [experts, rows, cols]
            blocks = quantize_weight(weight.flatten(0, 1), QT.Q8_0).data
            assert torch.equal(getattr(layer.mlp, name), blocks.view(*weight.shape[:2], -1))
        assert torch.equal(layer.mlp.router.weight, float_layer.mlp.router.weight)
    tokens = prompt(full.config.vocab_size, n=MOE_PROMPT)
    cosine = torch.cosine_similarity(prefill_logits(int8, tokens), prefill_logits(full, tokens),
                                     dim=-1)
    # On average: a flipped close routing choice moves a few positions far.
    assert cosine.mean().item() >= 0.99, cosine


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` of this process (Linux: /proc/self/maps), else None."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, _, *name = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return name[0] if name else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps")
def test_kept_blocks_are_mapped_from_the_file(hf_models, tmp_path):
    """A weight kept in its blocks as stored is the file's pages, not a copy; a fused one is a
    copy, and so is one in the CPU's interleaved decode layout (ops.cpu_decode_layout: Q8_0 with
    AVX-512). The mapping is copy-on-write: writing the weight changes the model, not the file."""
    tensors, _ = gguf_tensors(hf_models["qwen3"], "qwen3", "Q8_0")
    path = write_gguf(tmp_path / "model.gguf", "qwen3", hf_models["qwen3"].config, tensors)
    stored = path.read_bytes()
    model = load_model(path)
    down, gate_up = model.layers[0].mlp.down_proj.weight, model.layers[0].mlp.gate_up_proj.weight
    interleaved = model.layers[0].mlp.down_proj.weight_type == ops.INTERLEAVED_Q8_0
    assert interleaved == (QT.Q8_0 in _C.cpu_interleaved_types())
    assert mapped_file(gate_up.data_ptr()) != str(path)
    assert (mapped_file(down.data_ptr()) == str(path)) != interleaved
    with cpu_isa("scalar"):  # kernels without an interleaved layout: the blocks as stored
        down = load_model(path).layers[0].mlp.down_proj.weight
    assert mapped_file(down.data_ptr()) == str(path)
    down.zero_()
    assert path.read_bytes() == stored


def test_blocks_written_at_load_share_one_huge_page_arena(hf_models, tmp_path):
    """Blocks the load writes (fused, interleaved) are views of one arena aligned to a 2 MiB
    huge page, each starting on its own cache line; blocks kept as stored stay the file's."""
    tensors, _ = gguf_tensors(hf_models["qwen3"], "qwen3", "Q8_0")
    path = write_gguf(tmp_path / "model.gguf", "qwen3", hf_models["qwen3"].config, tensors)
    with cpu_isa("scalar"):  # nothing interleaved: only the fused weights are written
        model = load_model(path)
    written = [layer.mlp.gate_up_proj.weight for layer in model.layers]
    arena = written[0].untyped_storage()
    assert all(w.untyped_storage().data_ptr() == arena.data_ptr() for w in written)
    assert arena.data_ptr() % (2 << 20) == 0
    assert all(w.data_ptr() % 64 == 0 for w in written)
    assert len({w.data_ptr() for w in written}) == len(written)
    kept = model.layers[0].mlp.down_proj.weight
    assert kept.untyped_storage().data_ptr() != arena.data_ptr()
    if Path("/proc/self/maps").exists():
        assert mapped_file(kept.data_ptr()) == str(path)
        assert mapped_file(written[0].data_ptr()) != str(path)


def test_dtype_cast(hf_models, tmp_path):
    """F16 weights load exactly into float16 and bfloat16 models (F16 -> float32 -> dtype)."""
    tensors, _ = gguf_tensors(hf_models["qwen3"], "qwen3", "F16")
    path = write_gguf(tmp_path / "model.gguf", "qwen3", hf_models["qwen3"].config, tensors)
    full = load_gguf(str(path)).state_dict()
    for dtype in (torch.float16, torch.bfloat16):
        model = load_model(path, dtype=dtype)
        assert model.cos_sin_cache.dtype == torch.float32
        for name, p in model.state_dict().items():
            assert p.dtype == dtype and torch.equal(p, full[name].to(dtype)), name


def test_name_map_agrees_with_gguf_package():
    """gguf_tensor_name against gguf-py's own HF -> llama.cpp map, for every architecture and
    every checkpoint tensor fastllm reads (one expert's weight: the converter's stacked tensor,
    which gguf-py names from the experts' module without the expert's index), and
    gguf_tensor_part's expert index; every name is one of the architecture's tensors in gguf-py
    (gguf.MODEL_TENSORS)."""
    for model_type, overrides in CASES.values():
        hf_config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_config)
        config = ModelConfig.from_hf_config({**hf_config.to_dict(),
                                             "architectures": [type(hf).__name__]})
        family = config.family
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items()
                    if name == family.gguf.architecture)
        package_map = gguf.get_tensor_name_map(arch, config.num_layers)
        known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch]
                 for i in range(config.num_layers)}
        for parts in hf_weight_map(config).values():
            for hf_name, _ in parts:
                module, kind = hf_name.rsplit(".", 1)
                expert = re.search(r"\.experts\.(\d+)\.", module)
                stacked = module if expert is None else module.replace(expert[0], ".experts.")
                name = gguf_tensor_name(family, hf_name)
                assert name == f"{package_map.get_name(stacked)}.{kind}", hf_name
                assert gguf_tensor_part(family, hf_name) == (
                    name, None if expert is None else int(expert[1])), hf_name
                assert name.rsplit(".", 1)[0] in known, name


@pytest.mark.parametrize("case", CASES)
def test_f32_file_is_the_safetensors_model(hf_models, tmp_path, case):
    """An F32 file loads into exactly the model fastllm loads from the HF folder: the same
    config, and every parameter bit for bit (Gemma's stored 1 + w is the norm fastllm folds)."""
    hf, model_type = hf_models[case], CASES[case][0]
    path = write_gguf(tmp_path / "model.gguf", model_type, hf.config,
                      gguf_tensors(hf, model_type, "F32")[0])
    hf.save_pretrained(tmp_path / "hf")
    expected, model = load_model(tmp_path / "hf"), load_model(path)
    assert model.config == expected.config
    assert model.config == ModelConfig.from_hf_config(hf.config.to_dict())
    state, expected_state = model.state_dict(), expected.state_dict()
    assert state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(state[name], tensor), name


# The architectures transformers' GGUF reader loads (it reads no olmo2).
TRANSFORMERS_READS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")


@pytest.mark.parametrize("case", TRANSFORMERS_READS)
def test_transformers_reads_the_writer_s_files(hf_models, tmp_path, case):
    """transformers' own GGUF reader (its metadata map, name map and tensor processors: llama's
    q/k un-permutation, Gemma's - 1) reads what this module's writer writes back into the HF
    model: an independent check of the writer's conventions. It reads neither llama's biases
    nor Phi-3's rope.dimension_count and window, and gives Gemma's norms as (1 + w) - 1."""
    hf, model_type = hf_models[case], CASES[case][0]
    path = write_gguf(tmp_path / "model.gguf", model_type, hf.config,
                      gguf_tensors(hf, model_type, "F32")[0])
    parsed = load_gguf_checkpoint(str(path))["config"]
    expected = hf.config.to_dict()
    rope = hf.config.rope_parameters
    expected["rope_theta"] = rope.get("full_attention", rope)["rope_theta"]
    assert parsed.pop("model_type") == model_type
    assert np.float32(parsed.pop("rms_norm_eps")) == np.float32(expected["rms_norm_eps"])
    # getattr: num_experts is an alias (transformers 5's Qwen3-MoE config holds
    # num_local_experts).
    assert parsed == {key: expected[key] if key in expected else getattr(hf.config, key)
                      for key in parsed}
    with torch.device("meta"):  # the reader reads only the skeleton's names and shapes
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **parsed))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    state = hf.state_dict()
    unread = {name for name in state if name.endswith(".bias") and model_type == "llama"}
    if hf.config.tie_word_embeddings:
        unread.add("lm_head.weight")
    assert tensors.keys() == state.keys() - unread
    for name, tensor in tensors.items():
        if model_type in NORMS_PLUS_ONE and name.endswith("norm.weight"):
            assert torch.equal(tensor + 1, state[name] + 1), name  # the stored 1 + w
        else:
            assert torch.equal(tensor, state[name]), name


def gemma_switches(scale: float, softcap: float | None = None) -> dict:
    """A Gemma config's layer switches: GELU-tanh, ``scale``, and ``softcap`` if any (None:
    scores not capped)."""
    return dict(activation="gelu_tanh", scale=scale,
                **({} if softcap is None else dict(softcap=softcap)))


def metadata_file(path: Path, case: str, **metadata) -> Path:
    """A file of ``case``'s metadata (``metadata`` added or replaced) and only token_embd:
    enough for config_from_gguf."""
    model_type, overrides = CASES[case]
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    embedding = np.zeros((config.vocab_size, config.hidden_size), np.float32)
    return write_gguf(path, model_type, config, {"token_embd.weight": (embedding, QT.F32)},
                      **metadata)


@pytest.mark.parametrize("case, metadata, expected", [
    # The 27B sizes (Gemma 2: 46 layers, Gemma 3: 62) scale attention by (hidden / heads) **
    # -0.5, every other by head_dim ** -0.5.
    ("gemma2", {}, dict(layer_switches=gemma_switches(32 ** -0.5, softcap=20.0))),
    ("gemma2", {"block_count": 46}, dict(layer_switches=gemma_switches(64 ** -0.5, softcap=20.0))),
    ("gemma3", {"block_count": 62}, dict(layer_switches=gemma_switches(64 ** -0.5))),
    ("gemma3", {"block_count": 46}, dict(layer_switches=gemma_switches(32 ** -0.5))),
    # Gemma 2's window defaults to llama.cpp's 4096, its soft-caps to 50 and 30.
    ("gemma2", {"attention.sliding_window": None, "attn_logit_softcapping": None,
                "final_logit_softcapping": None},
     dict(sliding_window=4096, sliding_layers=(True, False),
          layer_switches=gemma_switches(32 ** -0.5, softcap=50.0),
          final_softcap=30.0)),
    # Gemma 3 without a window (or with 0) has none: every layer is full.
    ("gemma3", {"attention.sliding_window": None},
     dict(sliding_window=None, sliding_layers=(False,) * 6, rope_local_theta=10000.0)),
    ("gemma3", {"attention.sliding_window": 0}, dict(sliding_window=None,
                                                      sliding_layers=(False,) * 6)),
    ("gemma3", {"final_logit_softcapping": 30.0},
     dict(final_softcap=30.0, layer_switches=gemma_switches(32 ** -0.5))),
    # Phi-4 writes a window of 0: none.
    ("phi3", {"attention.sliding_window": 0}, dict(sliding_window=None,
                                                    sliding_layers=(False, False))),
    ("phi3", {}, dict(sliding_window=8, sliding_layers=(True, True), rotary_dim=32)),
    # int(44 * (30 / 44)) is 29: the file's rotary size is taken as it is.
    ("phi3", {"attention.key_length": 44, "attention.value_length": 44,
              "rope.dimension_count": 30}, dict(head_dim=44, rotary_dim=30)),
    # The converter writes no norm_topk_prob for Qwen3-MoE: llama.cpp renormalizes, unless
    # the file says otherwise; every layer routes.
    ("qwen3moe", {}, dict(architecture="Qwen3MoeForCausalLM", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                          moe_layers=(True, True))),
    ("qwen3moe", {"expert_weights_norm": False}, dict(norm_topk_prob=False)),
    ("qwen3moe", {"expert_feed_forward_length": 512}, dict(moe_intermediate_size=512)),
    # llama with experts is Mixtral: its experts feed_forward_length wide, always renormalized.
    ("mixtral", {"feed_forward_length": 512}, dict(
        architecture="MixtralForCausalLM", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=512, norm_topk_prob=True, sliding_window=None)),
    ("llama", {"expert_count": 0}, dict(architecture="LlamaForCausalLM", num_experts=0)),
], ids=["gemma2-scale", "gemma2-27b-scale", "gemma3-27b-scale", "gemma3-46-layers",
        "gemma2-defaults", "gemma3-no-window", "gemma3-window-0", "gemma3-final-softcap",
        "phi4-window-0", "phi3-window", "phi3-rotary-30-of-44", "qwen3moe",
        "qwen3moe-not-renormalized", "qwen3moe-expert-width", "mixtral", "llama-0-experts"])
def test_what_llama_cpp_fixes(tmp_path, case, metadata, expected):
    """Gemma's attention scale, window pattern and local RoPE base, and Qwen3-MoE's
    renormalized experts, are not in the file: llama.cpp fixes them per family, and so does
    fastllm."""
    config = config_from_gguf(GGUFFileReader(metadata_file(tmp_path / "m.gguf", case,
                                                           **metadata)))
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize("case, edit, metadata, match", [
    ("phi3", {"rope_factors_long.weight": (np.ones(16, np.float32), QT.F32),
              "rope_factors_short.weight": (np.ones(16, np.float32), QT.F32)}, {},
     r"rope_factors_long\.weight, Phi-3's longrope RoPE scaling .* not support"),
    # an OLMo 3 file: olmo2, with sliding layers
    ("olmo2", {}, {"attention.sliding_window": 4096},
     r"olmo2\.attention\.sliding_window=4096 makes layers slide, which fastllm's "
     "Olmo2ForCausalLM does not"),
    ("phi3", {}, {"rope.dimension_count": 96},
     r"partial_rotary_factor must be a number in \(0, 1\], got 1\.5"),
    ("qwen2", {}, {"expert_count": 8},
     r"metadata qwen2\.expert_count is 8; fastllm reads qwen2 files without experts only"),
    ("qwen3moe", {}, {"expert_count": None},
     r"metadata qwen3moe\.expert_count is None; fastllm reads qwen3moe files with experts only"),
    ("qwen3moe", {}, {"expert_used_count": None},
     r"lacks metadata qwen3moe\.expert_used_count"),
    # Mixtral as converted before llama.cpp stacked the experts (early 2024).
    ("mixtral", {"blk.0.ffn_gate.0.weight": (np.zeros((256, 256), np.float32), QT.F32)}, {},
     r"tensor blk\.0\.ffn_gate\.0\.weight is one expert's own, .* fastllm reads only stacked "
     "experts"),
], ids=["phi3-longrope", "olmo3", "phi3-rotary-past-head", "qwen2-experts", "qwen3moe-no-experts",
        "qwen3moe-no-top-k", "mixtral-per-expert-tensors"])
def test_family_refusals(tmp_path, case, edit, metadata, match):
    path = metadata_file(tmp_path / "m.gguf", case, **metadata)
    if edit:
        reader = GGUFFileReader(path)
        tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
        model_type, overrides = CASES[case]
        config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
        path = write_gguf(tmp_path / "edited.gguf", model_type, config, {**tensors, **edit},
                          **metadata)
    with pytest.raises(ValueError, match=match):
        load_model(path)


def llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float,
                    original: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.generate_extra_tensors``: Llama 3.1's scaling as a
    divisor per RoPE frequency, in float32 like the converter."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


@pytest.fixture(scope="module")
def llama31(tmp_path_factory) -> tuple[torch.nn.Module, dict, Path]:
    """(a tiny Llama with Llama 3.1's RoPE scaling, its F32 tensors, a folder to write in).
    head_dim 16 and theta 5e5 put RoPE wavelengths in all three llama3 bands."""
    rope = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = AutoConfig.for_model("llama", **{**BASE, "hidden_size": 64,
                                              "intermediate_size": 96, "rope_parameters": rope})
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                          dtype=torch.float32).eval()
    randomize_(hf, seed=3, scale=WEIGHT_SCALE)
    return hf, gguf_tensors(hf, "llama", "F32")[0], tmp_path_factory.mktemp("llama31")


def test_llama31_rope_freqs(llama31):
    hf, tensors, folder = llama31
    divisors = llama3_divisors(16, 5e5, 8.0, 1.0, 4.0, 8192)
    assert len(set(divisors.tolist())) > 2  # kept, interpolated and divided frequencies
    path = write_gguf(folder / "ok.gguf", "llama", hf.config,
                      {**tensors, "rope_freqs.weight": (divisors, QT.F32)})
    model = load_model(path)
    assert model.config.rope_scaling.rope_type == "llama3"
    tokens = prompt(model.config.vocab_size, n=40)
    torch.testing.assert_close(prefill_logits(model, tokens), hf_logits(hf, tokens), atol=ATOL,
                               rtol=0)


def test_rope_freqs_other_than_llama3_are_refused(llama31):
    hf, tensors, folder = llama31
    divisors = llama3_divisors(16, 5e5, 8.0, 2.0, 4.0, 8192)  # low_freq_factor 2, not 1
    path = write_gguf(folder / "bad.gguf", "llama", hf.config,
                      {**tensors, "rope_freqs.weight": (divisors, QT.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight holds per-frequency RoPE divisors"):
        load_model(path)


# --- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_f32(tmp_path_factory) -> tuple[transformers.PretrainedConfig, dict]:
    """A tiny Llama's config and its F32 tensors, as the converter writes them."""
    config = AutoConfig.for_model("llama", **{**BASE, "hidden_size": 64,
                                              "intermediate_size": 96})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return config, gguf_tensors(hf, "llama", "F32")[0]


@pytest.mark.parametrize("edit, metadata, match", [
    ({}, dict(architecture="gpt2"), "unsupported GGUF architecture 'gpt2'"),
    ({"blk.1.ffn_up.weight": None}, {}, r"lacks blk\.1\.ffn_up\.weight"),
    ({"blk.0.attn_q_norm.weight": (np.ones(16, np.float32), QT.F32)}, {},
     r"unexpected tensor blk\.0\.attn_q_norm\.weight"),
    # MXFP4: a type gguf.quants dequantizes, but fastllm does not take
    ({"blk.0.ffn_down.weight": (gguf.quants.quantize(np.zeros((64, 96), np.float32), QT.MXFP4),
                                QT.MXFP4)}, {},
     r"blk\.0\.ffn_down\.weight is MXFP4, which fastllm does not dequantize"),
    ({"blk.0.attn_k.weight": (np.zeros((16, 64), np.float32), QT.F32)}, {},
     r"blk\.0\.attn_k\.weight has shape \(16, 64\) \(ggml \[64, 16\]\), expected \(32, 64\)"),
    ({}, {"rope.dimension_count": 8}, "partial rotary embedding is not supported"),
    ({}, {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0},
     "unsupported RoPE scaling type 'yarn'"),
    # a typo cannot make the loader allocate the machine
    ({}, {"block_count": 10**9},
     r"model\.gguf: .*num_hidden_layers must be an int in \[1, 1024\], got 1000000000"),
    ({}, {"context_length": 2**32 - 1}, r"max_position_embeddings must be an int in \[1, "),
    ({}, {"rope.freq_base": float("nan")}, "rope_theta must be a positive number, got nan"),
], ids=["architecture", "missing", "unexpected", "tensor-type", "shape", "partial-rotary",
        "yarn", "layers", "context", "rope-theta"])
def test_refusals(llama_f32, tmp_path, edit, metadata, match):
    """``edit``: tensors to replace, or to drop (None); ``metadata``: keys to add."""
    config, tensors = llama_f32
    tensors = {**tensors, **edit}
    tensors = {name: value for name, value in tensors.items() if value is not None}
    path = write_gguf(tmp_path / "model.gguf", "llama", config, tensors, **metadata)
    with pytest.raises(ValueError, match=match):
        load_model(path)


@pytest.mark.parametrize("metadata, match", [
    ({"block_count": "2"}, r"metadata llama\.block_count must be a GGUF integer, got '2'"),
    ({"rope.freq_base": "1e4"}, r"metadata llama\.rope\.freq_base must be a GGUF float"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": "2"},
     r"llama\.rope\.scaling\.factor must be a GGUF float"),
    ({"tokenizer.ggml.eos_token_id": "2"},
     r"metadata tokenizer\.ggml\.eos_token_id must be a GGUF integer, got '2'"),
])
def test_metadata_of_the_wrong_type(llama_f32, tmp_path, metadata, match):
    config, tensors = llama_f32
    path = write_gguf(tmp_path / "model.gguf", "llama", config, tensors, **metadata)
    with pytest.raises(TypeError, match=match):
        load_model(path)


def test_end_of_generation_ids(llama_f32, tmp_path):
    """eos, then llama.cpp's other end-of-generation tokens (eot, eom), without repeats."""
    config, tensors = llama_f32
    path = write_gguf(tmp_path / "model.gguf", "llama", config, tensors,
                      **{"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2})
    model = load_model(path)
    assert (model.config.bos_token_id, model.config.eos_token_ids) == (1, (2, 7))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(ValueError, match=r"not a GGUF file \(it starts with b'PK"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_gguf(tmp_path / "absent.gguf")


# --- bad files: each a ValueError naming the file and the tensor or key, before any read --------


def edit_tensor_info(path: Path, name: str, *, raw_type: int | None = None,
                     offset_delta: int = 0) -> None:
    """Rewrites tensor ``name``'s header entry in place, through the reader's writable map."""
    reader = gguf.GGUFReader(path, "r+")
    field = next(t.field for t in reader.tensors if t.name == name)
    _, _, _, _, type_part, offset_part = field.parts
    if raw_type is not None:
        type_part[0] = raw_type
    offset_part[0] += offset_delta
    reader.data.flush()


@pytest.fixture
def llama_file(llama_f32, tmp_path) -> Path:
    """The tiny F32 Llama as a file of its own, to corrupt."""
    config, tensors = llama_f32
    return write_gguf(tmp_path / "model.gguf", "llama", config, tensors)


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="no transparent huge pages (Linux only)")
def test_the_file_mapping_asks_for_huge_pages(llama_file):
    """The mapping the tensors are read through is advised for huge pages (VmFlags "hg"), so
    data read from disk comes in 2 MiB folios that the mapping maps whole."""
    reader = GGUFFileReader(llama_file)  # the mapping lives as long as the reader
    address = reader.data.ctypes.data
    inside, flags = False, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line: its range
            start, end = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None and "hg" in flags, flags


def test_unknown_tensor_type(llama_file):
    edit_tensor_info(llama_file, "blk.1.ffn_up.weight", raw_type=200)
    with pytest.raises(ValueError, match=r"model\.gguf: tensor blk\.1\.ffn_up\.weight has "
                                         "unknown ggml type 200"):
        load_model(llama_file)


def test_misaligned_tensor_offset(llama_file):
    """An offset off the file's alignment once loaded NaN weights that failed only at
    generation."""
    edit_tensor_info(llama_file, "blk.0.attn_q.weight", offset_delta=4)
    with pytest.raises(ValueError, match=r"tensor blk\.0\.attn_q\.weight starts at offset \d+ "
                                         "of the data section, not a multiple of the file's "
                                         "alignment 32"):
        load_model(llama_file)


def test_tensor_past_the_end_of_the_file(llama_file):
    """A truncated file names the tensor whose data it cut."""
    last = max(gguf.GGUFReader(llama_file).tensors, key=lambda t: t.data_offset)
    size = llama_file.stat().st_size
    with llama_file.open("r+b") as file:
        file.truncate(last.data_offset + last.n_bytes // 2)
    with pytest.raises(ValueError, match=rf"model\.gguf: tensor {re.escape(last.name)} \(F32, "
                                         rf"ggml shape .*past the end of the file"):
        load_model(llama_file)
    assert last.data_offset + last.n_bytes == size  # the cut was inside that tensor


def test_file_truncated_in_its_header(llama_file):
    with llama_file.open("r+b") as file:
        file.truncate(200)
    with pytest.raises(ValueError, match=r"model\.gguf is truncated: the metadata after "
                                         r"'[\w.]+' reads bytes up to \d+, past the end"):
        load_model(llama_file)


def test_corrupt_metadata_value_type(llama_file):
    """A reader error (here, an unknown GGUF value type) is a ValueError naming the field it
    follows."""
    field = gguf.GGUFReader(llama_file).fields["llama.block_count"]
    type_offset = field.offset + 8 + len("llama.block_count")  # after the key's length and bytes
    with llama_file.open("r+b") as file:
        file.seek(type_offset)
        file.write((99).to_bytes(4, "little"))
    with pytest.raises(ValueError, match=r"model\.gguf: cannot read the metadata after "
                                         r"'general\.architecture': .*99\)? is not a valid "
                                         "GGUFValueType"):
        load_model(llama_file)


def metadata_arrays_file(path: Path) -> Path:
    """A GGUF file of metadata arrays only: every scalar element type, strings (empty,
    multi-byte) and an array of arrays (gguf's writer writes no empty array)."""
    writer = gguf.GGUFWriter(path, "llama")
    for kind in (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64,
                 VT.INT64, VT.FLOAT32, VT.FLOAT64):
        writer.add_key_value(f"test.{kind.name.lower()}", [0, 1, 2, 127], VT.ARRAY, kind)
    writer.add_key_value("test.bool", [True, False, True], VT.ARRAY, VT.BOOL)
    writer.add_key_value("test.float_values", [0.1, -2.5, 1e-5], VT.ARRAY, VT.FLOAT32)
    writer.add_key_value("test.strings", ["a", "", "\u2581h\u00e9llo", "\u65e5\u672c", "a b"],
                         VT.ARRAY, VT.STRING)
    writer.add_key_value("test.nested", [[1, 2], [3]], VT.ARRAY, VT.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_arrays_read_as_gguf_reads_them(model_path, tmp_path):
    """The reader reads arrays whole, not value by value as gguf's does: the same values, by
    index and slice too (a real 32,000-token vocabulary, and every element type)."""
    for path in (model_path("gguf") / FIXTURE, metadata_arrays_file(tmp_path / "arrays.gguf")):
        ours, theirs = GGUFFileReader(path).fields, gguf.GGUFReader(path).fields
        assert list(ours) == list(theirs)
        for key, field in theirs.items():
            assert ours[key].contents() == field.contents(), key
            if field.types[0] == VT.ARRAY and field.contents():
                assert ours[key].types == field.types, key
                for index in (0, -1, slice(1, 3), slice(None, None, 2)):
                    assert ours[key].contents(index) == field.contents(index), (key, index)


def test_file_truncated_in_a_string_array(tmp_path):
    path = metadata_arrays_file(tmp_path / "arrays.gguf")
    field = gguf.GGUFReader(path).fields["test.strings"]
    with path.open("r+b") as file:
        file.truncate(field.offset + sum(int(part.nbytes) for part in field.parts) - 3)
    with pytest.raises(ValueError, match=r"arrays\.gguf is truncated: the metadata after "
                                         r"'test\.float_values': string 4 of the array at byte "
                                         r"\d+ reads bytes up to \d+, past the end"):
        GGUFFileReader(path)


def test_string_array_count_past_the_end_of_the_file(tmp_path):
    """A string array's count the file cannot hold fails before anything is read or allocated
    (2**60 strings would take 8 EiB of lengths alone)."""
    path = metadata_arrays_file(tmp_path / "arrays.gguf")
    field = gguf.GGUFReader(path).fields["test.strings"]
    count_offset = field.offset + 8 + len("test.strings") + 4 + 4  # key, type, element type
    with path.open("r+b") as file:
        file.seek(count_offset)
        file.write((2**60).to_bytes(8, "little"))
    with pytest.raises(ValueError, match=r"arrays\.gguf is truncated: the metadata after "
                                         r"'test\.float_values': an array of 1152921504606846976 "
                                         r"strings at byte \d+ needs 8 bytes a string at least"):
        GGUFFileReader(path)


def test_string_that_is_not_utf8(tmp_path):
    """A metadata string that is not UTF-8 (GGUF's strings are) is a ValueError naming where,
    raised as the file is read."""
    path = metadata_arrays_file(tmp_path / "arrays.gguf")
    data = path.read_bytes()
    at = data.index("\u65e5\u672c".encode())
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(ValueError, match=r"arrays\.gguf: cannot read the metadata after "
                                         r"'test\.float_values': 'utf-8' codec can't decode "
                                         r"byte 0xff"):
        GGUFFileReader(path)


def test_a_long_context_builds_the_rope_table_it_is_asked_for(llama_f32, tmp_path):
    """context_length 2**31 - 1 loads: the table covers DEFAULT_ROPE_POSITIONS until an engine
    reserves more, and never more than the context."""
    config, tensors = llama_f32
    path = write_gguf(tmp_path / "model.gguf", "llama", config, tensors,
                      context_length=2**31 - 1)
    model = load_model(path)
    assert model.config.max_position_embeddings == 2**31 - 1
    assert model.cos_sin_cache.shape == (DEFAULT_ROPE_POSITIONS, 16)
    first = model.cos_sin_cache.clone()
    model.reserve_positions(10_000)
    assert model.cos_sin_cache.shape == (10_000, 16)
    assert torch.equal(model.cos_sin_cache[:DEFAULT_ROPE_POSITIONS], first)
    model.reserve_positions(100)  # never shrinks: other engines may share the model
    assert model.cos_sin_cache.shape[0] == 10_000
