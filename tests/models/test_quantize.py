"""Quantizing float checkpoints at load (``quantization="int8" | "int4"``): the quantizer against
the gguf package's (an independent encoder of ggml's Q8_0 and Q4_1), byte for byte, on random
and adversarial rows; and models quantized at load against their float selves."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import prefill_logits
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file
from tiny_hf import random_hf_model, save_hf_model

from fastllm import LLM, Tokenizer, _C, ops
from fastllm.models import load_model
from fastllm.models.decoder import Linear
from fastllm.models.quantized import QuantizedEmbedding, QuantizedLinear, quantize_weight

transformers.logging.set_verbosity_error()

TYPES = {"Q8_0": QT.Q8_0, "Q4_1": QT.Q4_1}
# Bytes per 32 values: Q8_0 an fp16 scale and 32 int8; Q4_1 fp16 scale and minimum, 32 nibbles.
BLOCK_BYTES = {QT.Q8_0: 34, QT.Q4_1: 20}


def ggml_type(weight_type: int) -> int:
    """The ggml type of a kept weight's blocks, in the CPU's interleaved decode layout
    (ops.cpu_decode_layout) or not."""
    return weight_type % ops.INTERLEAVED_TYPES


def rows_of(case: str, rng: np.random.Generator) -> np.ndarray:
    """float32 ``[rows, 96]`` (three blocks per row) of one kind."""
    normal = rng.standard_normal((9, 96)).astype(np.float32)
    if case == "normal":
        return normal
    if case == "bf16":  # 8-bit mantissas: products that land exactly on a rounding tie are common
        return torch.from_numpy(normal).bfloat16().float().numpy()
    if case == "ties":
        # Q8_0: amax 127 makes the scale 1, so k + 0.5 is a tie (ggml rounds it away from 0).
        # Q4_1: min 0 and max 15 make the scale 1, so k + 0.5 lands on trunc's edge.
        q8_0 = np.concatenate([[127.0], np.arange(-15.5, 15.5)])
        q4_1 = np.concatenate([[0.0, 15.0], np.arange(0.5, 15.5), np.arange(0.5, 15.5)])
        return np.stack([np.concatenate([q8_0, q4_1, -q8_0])]).astype(np.float32)
    if case == "zeros":
        return np.zeros((2, 96), np.float32)
    if case == "constant":
        return np.array([[3.0] * 96, [-2.5] * 96, [1e-3] * 96], np.float32)
    if case == "outliers":  # one large value per block squeezes the others into a few steps
        normal[:, ::32] = 1000.0
        return normal
    if case == "huge":  # near the largest block scale fp16 holds for both formats
        return normal / np.abs(normal).max() * 6e4
    if case == "small":  # scales from ordinary to fp16-subnormal to zero
        return normal * np.logspace(-2, -12, 9, dtype=np.float32)[:, None]
    if case == "tiny":  # float32 handles the reciprocal scale; fp16 flushes the scale to 0
        return normal * np.float32(1e-30)
    raise AssertionError(case)


CASES = ["normal", "bf16", "ties", "zeros", "constant", "outliers", "huge", "small", "tiny"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("type_name", TYPES)
def test_quantized_bytes_equal_gguf(type_name, case):
    weight_type = TYPES[type_name]
    values = rows_of(case, np.random.default_rng(len(case)))
    got = quantize_weight(torch.from_numpy(values), weight_type)
    assert got.weight_type == weight_type and got.data.dtype == torch.uint8
    np.testing.assert_array_equal(got.data.numpy(), gguf.quants.quantize(values, weight_type))
    # The input dtype does not matter beyond its values: bf16 weights quantize as their floats.
    if case == "bf16":
        half = quantize_weight(torch.from_numpy(values).bfloat16(), weight_type)
        assert torch.equal(half.data, got.data)


@pytest.mark.parametrize("type_name", TYPES)
def test_signed_zeros_differ_from_gguf_only_in_the_sign_of_a_zero_field(type_name):
    """Which of ``-0.0`` and ``0.0`` a min or max reduction returns is unspecified (ggml's C loop
    keeps the first, numpy here the last, torch its own), so a Q4_1 block whose minimum (or
    range) is zero may store it with the other sign. Only that sign bit differs, and the values
    decode equal: ``d * q + m`` with ``d, q >= 0``."""
    weight_type = TYPES[type_name]
    rng = np.random.default_rng(0)
    zeros = np.where(rng.integers(0, 2, (64, 64)) == 1, np.float32(-0.0), np.float32(0.0))
    positives = rng.uniform(0, 1, (64, 64)).astype(np.float32)
    values = np.where(rng.uniform(0, 1, (64, 64)) < 0.3, positives, zeros)
    values[:8] = zeros[:8]  # blocks of zeros only
    got = quantize_weight(torch.from_numpy(values), weight_type)
    expected = gguf.quants.quantize(values, weight_type)
    fields = got.data.numpy().reshape(64, 2, -1).copy(), expected.reshape(64, 2, -1).copy()
    if weight_type == QT.Q4_1:  # the fp16 scale and minimum: clear the sign of a zero
        for blocks in fields:
            halves = blocks[..., :4].view(np.float16)
            halves[halves == 0] = 0.0
    np.testing.assert_array_equal(*fields)
    assert torch.equal(ops.dequantize(got.data, weight_type),
                       torch.from_numpy(gguf.quants.dequantize(expected, weight_type)))


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_too_small_for_a_float32_reciprocal_decode_as_ggml_s(type_name):
    """Below an absolute maximum of about 4e-37, ``1 / scale`` overflows float32 and ggml's quants
    are undefined (a NaN or infinity cast to an integer); ours are clamped. Both scales are 0 in
    fp16, so both decode to the same values: zeros (Q8_0) or the block's minimum (Q4_1)."""
    weight_type = TYPES[type_name]
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    values *= np.array([1e-38, 1e-40, 1e-44], np.float32)[:, None]  # normal and subnormal
    got = quantize_weight(torch.from_numpy(values), weight_type)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = gguf.quants.quantize(values, weight_type)
    fields = 2 if weight_type == QT.Q8_0 else 4  # fp16 scale (and minimum) lead each block
    per_block = got.data.numpy().reshape(3, 2, -1)
    np.testing.assert_array_equal(per_block[..., :fields],
                                  expected.reshape(3, 2, -1)[..., :fields])
    assert torch.equal(ops.dequantize(got.data, weight_type),
                       torch.from_numpy(gguf.quants.dequantize(expected, weight_type)))


@pytest.mark.parametrize(("weight", "weight_type", "match"), [
    (torch.ones(4, 48), QT.Q8_0, "positive multiple of 32 values, got 48"),
    (torch.ones(4, 0), QT.Q4_1, "positive multiple of 32 values, got 0"),
    (torch.ones(64), QT.Q8_0, r"2-D float tensor, got torch.float32 \(64,\)"),
    (torch.ones(2, 32, dtype=torch.int32), QT.Q8_0, "2-D float tensor, got torch.int32"),
    (torch.ones(2, 32), QT.Q4_0, r"Q8_0 \(8\), Q4_1 \(3\), got <GGMLQuantizationType.Q4_0"),
    (torch.full((2, 32), 1e7), QT.Q8_0, r"too large for fp16 block scales.*\[1e\+07, 1e\+07\]"),
    (torch.full((2, 32), -7e4), QT.Q4_1, "too large for fp16 block scales"),  # the minimum
    (torch.tensor([[0.0] * 31 + [float("nan")]]), QT.Q8_0, "non-finite"),
    (torch.tensor([[0.0] * 31 + [float("inf")]]), QT.Q4_1, "non-finite"),
])
def test_bad_weights_raise(weight, weight_type, match):
    with pytest.raises(ValueError, match=match):
        quantize_weight(weight, weight_type)


def test_q4_1_rounds_real_weights_closer_than_q4_0(model_path):
    """Why int4 is Q4_1 (5 bits per weight) rather than Q4_0 (4.5): a block's own minimum and
    range fit its values better than a scale symmetric about 0: on stories260K's quantizable
    matrices Q4_1's relative RMS error is below Q4_0's."""
    weights = [w.float() for w in load_file(model_path("stories260K_hf") / "model.safetensors")
               .values() if w.dim() == 2 and w.shape[1] % 32 == 0]

    def relative_error(weight_type, quantize) -> float:
        error = sum(((ops.dequantize(quantize(w), weight_type) - w) ** 2).sum() for w in weights)
        return float((error / sum((w ** 2).sum() for w in weights)).sqrt())

    q4_1 = relative_error(QT.Q4_1, lambda w: quantize_weight(w, QT.Q4_1).data)
    q4_0 = relative_error(QT.Q4_0, lambda w: torch.from_numpy(
        gguf.quants.quantize(w.numpy(), QT.Q4_0)))
    assert q4_1 < 0.97 * q4_0 < 0.1


# ---- models quantized at load --------------------------------------------------------------

# Teacher-forced text in the style stories260K was trained on (TinyStories).
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play in the park "
         "with her red ball. One day, she saw a big dog near the tree. The dog was sad because "
         "he lost his toy. Lily wanted to help him, so she looked under the bench and behind "
         "the slide. At last she found the toy in the grass. The dog was very happy and wagged "
         "his tail. Lily and the dog played together all day, and they became best friends. "
         "When the sun went down, Lily went home and told her mom about her new friend.")


@pytest.fixture(scope="module")
def stories(model_path) -> tuple:
    """stories260K (a real trained model): its folder, the float32 model and :data:`STORY`'s
    tokens."""
    folder = model_path("stories260K_hf")
    return folder, load_model(folder), Tokenizer.from_pretrained(folder).encode(STORY)


# quantization -> (least cosine similarity of a position's logits with float32's, least share
# of positions whose argmax (the greedy token) is float32's, most mean KL(float || quantized))
# over STORY's 195 positions, on stories260K, a 260K-parameter model whose 64-wide rows make
# 4-bit blocks coarse.
TOLERANCES = {"int8": (0.999, 0.97, 1e-3), "int4": (0.9, 0.85, 0.1)}


@pytest.mark.parametrize("quantization", TOLERANCES)
def test_quantized_stories_logits_stay_close_to_float(stories, quantization):
    folder, model, tokens = stories
    quantized = load_model(folder, quantization=quantization)
    expected, got = prefill_logits(model, tokens), prefill_logits(quantized, tokens)
    min_cosine, min_agreement, max_kl = TOLERANCES[quantization]
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() >= min_cosine
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= min_agreement
    log_p, log_q = expected.log_softmax(-1), got.log_softmax(-1)
    assert (log_p.exp() * (log_p - log_q)).sum(-1).mean() <= max_kl


@pytest.mark.parametrize(("quantization", "projections"), [("int8", QT.Q8_0), ("int4", QT.Q4_1)])
def test_stories_layers_become_quantized_where_rows_allow(stories, quantization, projections):
    folder, _, _ = stories
    model = load_model(folder, quantization=quantization)
    layer = model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert isinstance(module, QuantizedLinear) and ggml_type(module.weight_type) == projections
    # down_proj's rows are 172 values long, not a multiple of 32: it stays float.
    assert type(layer.mlp.down_proj) is Linear
    assert layer.mlp.down_proj.weight.dtype == torch.float32
    # Tied embeddings are the LM head too: Q8_0 under both.
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert ggml_type(model.embed_tokens.weight_type) == QT.Q8_0
    assert layer.input_layernorm.weight.dtype == torch.float32


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """A tiny random Qwen2 (q/k/v biases, an untied LM head) with every row a multiple of 32."""
    hf = random_hf_model("qwen2", seed=3, vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False)
    return save_hf_model(hf, tmp_path_factory.mktemp("qwen2"))


@pytest.mark.parametrize(("quantization", "projections"), [("int8", QT.Q8_0), ("int4", QT.Q4_1)])
def test_every_projection_is_quantized_and_sized_as_its_blocks(qwen2_folder, quantization,
                                                                projections):
    model = load_model(qwen2_folder, dtype=torch.bfloat16, quantization=quantization)
    kept = {name: module for name, module in model.named_modules()
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding))}
    # Where the CPU kernels have an interleaved kernel for a type, its projections and the head
    # (every weight here is whole groups of 16 rows) are interleaved for them; the untied
    # embedding keeps its rows.
    for name, module in kept.items():
        interleaved = module.weight_type >= ops.INTERLEAVED_TYPES
        ggml = module.weight_type - ops.INTERLEAVED_TYPES if interleaved else module.weight_type
        assert interleaved == (ggml in _C.cpu_interleaved_types()
                               and name != "embed_tokens"), name
    types = {name: ggml_type(module.weight_type) for name, module in kept.items()}
    # The untied input embedding is a lookup, quantized as the projections are; the LM head
    # keeps 8 bits, as in llama.cpp's 4-bit files.
    assert types.pop("lm_head") == QT.Q8_0 and types.pop("embed_tokens") == projections
    assert len(types) == 4 * 2 and set(types.values()) == {projections}
    assert not any(isinstance(module, Linear) for module in model.modules())
    # Each weight takes its blocks' bytes: 34/64 (Q8_0) or 20/64 (Q4_1) of its bf16 size.
    float_model = load_model(qwen2_folder, dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            bf16_bytes = float_model.get_submodule(name).weight.nbytes
            assert module.weight.nbytes * 64 == bf16_bytes * BLOCK_BYTES[ggml_type(
                module.weight_type)]
    # Biases and norms stay in the model's dtype, and it runs.
    assert model.layers[0].self_attn.qkv_proj.bias.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.bfloat16
    tokens = list(range(1, 40))
    got, expected = prefill_logits(model, tokens), prefill_logits(float_model, tokens)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    if quantization == "int8":  # 4 bits scramble random weights; the trained model checks them
        assert torch.nn.functional.cosine_similarity(got.float(), expected.float(),
                                                     dim=-1).min() >= 0.99


def test_a_float_gguf_is_quantized(model_path):
    # The fixture's rows are 8 values long except ffn_down's (32): only down_proj is quantized.
    model = load_model(model_path("gguf/llama-2-tiny-random.gguf"), quantization="int8")
    quantized = [name for name, module in model.named_modules()
                 if isinstance(module, (QuantizedLinear, QuantizedEmbedding))]
    assert quantized == ["layers.0.mlp.down_proj"]


def test_a_quantized_gguf_is_refused(tmp_path):
    """Quantizing blocks again would only add error; the file is refused before anything loads
    (this one holds nothing but a Q8_0 tensor)."""
    path = tmp_path / "q8_0.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight",
                      gguf.quants.quantize(np.ones((4, 32), np.float32), QT.Q8_0),
                      raw_dtype=QT.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"already quantized \(token_embd.weight is Q8_0\); "
                                         r"load it without quantization='int4'"):
        load_model(path, quantization="int4")


def test_bad_quantization_raises(stories):
    folder, _, _ = stories
    for bad in ("int3", "INT8", 8):
        with pytest.raises(ValueError, match=f"quantization must be None, 'int8' or 'int4', "
                                              f"got {bad!r}"):
            load_model(folder, quantization=bad)
    with pytest.raises(ValueError, match="got 'fp8'"):
        LLM(folder, quantization="fp8")
