"""Quantized checkpoints loaded as they are stored (fastllm.models.formats): compressed-tensors
folders written by the real library, against transformers' dequantization of them; block FP8,
GPTQ and AWQ folders packed here from their documented layouts, against a float64
dequantization. Weights repacked into ggml blocks must decode to the reference bit for bit, and
every model's greedy tokens must be HF's on the reference weights. Then tensor parallelism, and
every refusal."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file
from conftest import assert_within_twice_plain_error, cpu_isa, find_model, prefill_logits
from tiny_hf import random_hf_model
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from fastllm import LLM, SamplingParams, ops
from fastllm.models import TensorParallel, load_model
from fastllm.models.decoder import DecoderLM
from fastllm.models.formats.integers import IntegerWeight

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationScheme

transformers.logging.set_verbosity_error()
# transformers' note that dequantize=True overrides the folder's own quantization_config.
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

# Tiny models over stories260K's 512-token vocabulary (its tokenizer serves LLM); no special
# tokens, so HF's greedy decoding never stops early.
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
# Every token runs every expert (weighted by the router), so that each expert's rows are all a
# sequence's, over 32: see assert_greedy_like_hf.
MOE = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True)
# One length, so that HF runs them as one batch; long enough that each prompt with its
# continuation is over 32 rows (see assert_greedy_like_hf).
PROMPTS = torch.randint(3, 512, (3, 20), generator=torch.Generator().manual_seed(0)).tolist()
NEW_TOKENS = 16
ATOL = 1e-4  # float32 logits, fastllm vs HF eager on the same weights
# How far below HF's largest logit a generated token's may be: a few times the logit error of
# the decode kernels' int16 activations, so that only a near tie may flip.
TIE = 2e-3


# ---- references ------------------------------------------------------------------------------

def fastllm_greedy(folder: Path) -> list[list[int]]:
    """fastllm.LLM's greedy continuations of the prompts, the folder loaded as a user loads it
    (with stories260K's tokenizer). One prompt at a time: each step's rows (at most 20) are
    the decode kernels'. Past 32 rows a CPU with AVX512-BF16 takes oneDNN's bfloat16 GEMM,
    whose error the op tests bound (test_quantized_linear's gemm_error_bound)."""
    llm = LLM(folder, tokenizer=find_model("stories260K_hf"), max_model_len=64,
              kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            for prompt in PROMPTS]


def float_weights(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as float32, blocks dequantized (an expert's too)."""
    weights = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("cos_sin_cache"):
            continue
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path)
        weight_type = (getattr(module, "weight_type", None) if attr == "weight"
                       else getattr(module, attr.removesuffix("_proj") + "_type", None))
        if weight_type is not None:  # [..., rows, row bytes] blocks
            rows = tensor.reshape(-1, tensor.shape[-1])
            tensor = ops.dequantize(rows, weight_type).view(*tensor.shape[:-1], -1)
        weights[name] = tensor.float()
    return weights


# The CPU's interleaved types -> the ggml type of their blocks.
INTERLEAVED_BLOCKS = {ops.INTERLEAVED_TYPES + t: t for t in ops.BLOCK_FORMATS}


def weight_types(model: DecoderLM) -> dict[str, int | None]:
    """Each projection's ggml type or ops.FP8_E4M3 (None: float), interleaving aside."""
    types = {}
    for name, module in model.named_modules():
        if name.endswith(("_proj", "lm_head")) and hasattr(module, "weight"):
            weight_type = getattr(module, "weight_type", None)
            types[name] = INTERLEAVED_BLOCKS.get(weight_type, weight_type)
        for attr in ("gate_up", "down"):
            if hasattr(module, f"{attr}_type"):
                types[f"{name}.{attr}_proj"] = getattr(module, f"{attr}_type")
    return types


def save_float_twin(hf: transformers.PreTrainedModel, folder: Path) -> Path:
    """``hf``'s weights saved as a plain float32 folder (no quantization_config)."""
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    twin = AutoModelForCausalLM.from_config(type(hf.config).from_dict(config),
                                            attn_implementation="eager", dtype=torch.float32)
    twin.load_state_dict(hf.state_dict())
    twin.save_pretrained(folder)
    return folder


def assert_loads_like(folder: Path, reference: Path, types: dict[str, int | None]) -> None:
    """``folder`` loads with each projection named in ``types`` of that ggml type (None: float),
    every weight equal to those of the float folder ``reference``, and greedy tokens HF's on
    ``reference`` (:func:`assert_greedy_like_hf`)."""
    model, expected = load_model(folder), load_model(reference)
    got_types = weight_types(model)
    for name, weight_type in types.items():
        assert got_types[name] == weight_type, name
    got, want = float_weights(model), float_weights(expected)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    hf = AutoModelForCausalLM.from_pretrained(reference, attn_implementation="eager",
                                              dtype=torch.float32)
    assert_greedy_like_hf(folder, model, hf, QT.Q4_0 in got_types.values())


def assert_greedy_like_hf(folder: Path, model: DecoderLM, hf: transformers.PreTrainedModel,
                          byte_activations: bool) -> None:
    """HF's greedy tokens are fastllm's: each prompt and its continuation, teacher-forced, have
    HF's logits (float32, within ATOL) and argmax, through the CPU's float32 GEMM (the scalar
    kernels' prefill path, past 32 rows); and every token ``fastllm.LLM(folder)`` generates
    with this CPU's own decode kernels is HF's argmax on the same tokens, or within TIE of it.
    Those kernels quantize activations on the fly per block of 32 values, to int16, but to
    int8 for Q4_0 (``byte_activations``), as llama.cpp does: in these random tiny models that
    moves logits by up to 0.2 (of spread 1.3), so a model with Q4_0 weights is held to the
    first check only."""
    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, output_logits=True,
                          return_dict_in_generate=True)
    expected = out.sequences[:, ids.shape[1]:].tolist()
    logits = torch.stack(out.logits, dim=1)  # [prompts, NEW_TOKENS, vocab]: each step's
    for prompt, tokens, step_logits in zip(PROMPTS, expected, logits):
        with cpu_isa("scalar"):
            got = prefill_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
        torch.testing.assert_close(got, step_logits, atol=ATOL, rtol=0)
        assert got.argmax(-1).tolist() == tokens
    if byte_activations:
        return
    generated = fastllm_greedy(folder)
    with torch.no_grad():
        logits = hf(torch.tensor([p + g for p, g in zip(PROMPTS, generated)])).logits
    logits = logits[:, ids.shape[1] - 1:-1]  # [prompts, NEW_TOKENS, vocab]: each token's
    chosen = logits.gather(-1, torch.tensor(generated).unsqueeze(-1)).squeeze(-1)
    gaps = logits.max(-1).values - chosen
    assert gaps.max().item() <= TIE, (generated, expected)


# ---- compressed-tensors, through the real library -----------------------------------------------

def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` significant bits."""
    mantissa, exponent = torch.frexp(x.double())
    return torch.ldexp(torch.round(mantissa * 2 ** bits) / 2 ** bits, exponent).to(x.dtype)


# How the test sets the scales the observer computes: as fp16 values (what a float16 or
# bfloat16 model's are), with 7 significant bits (so that Q4_1's minima -scale * zero, at most
# 11 bits, are fp16s), or left float32 (not fp16: dequantized).
ROUNDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp16": lambda s: s.half().float(), "7 bits": lambda s: round_mantissa(s.half().float(), 7),
    "float32": lambda s: s}


def observed_qparams(weight: torch.Tensor, scheme: QuantizationScheme, rounding: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' min-max scale and zero point of ``weight`` under ``scheme``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    if args.strategy == "group":
        low, high = weight.unflatten(-1, (-1, args.group_size)).aminmax(dim=-1)
    elif args.strategy == "channel":
        low, high = weight.aminmax(dim=-1, keepdim=True)
    else:
        low, high = weight.aminmax()
    scale, zero_point = calculate_qparams(low, high, args)
    return ROUNDINGS[rounding](scale), zero_point


def compressed_tensors_folder(folder: Path, model_type: str, scheme: dict, rounding: str,
                              seed: int, **config) -> transformers.PreTrainedModel:
    """A tiny random HF model quantized by compressed-tensors (every Linear but the LM head and
    a router; a mixture of experts' experts too, compressed one by one with its compressor, as
    older transformers held them as Linears), saved to ``folder``; returns transformers'
    dequantization of the folder, the reference."""
    # compressed-tensors imports much of transformers: on use, not at collection.
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    hf = random_hf_model(model_type, seed, **{**SHAPE, **config})
    quantization = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=["lm_head", "re:.*mlp.gate$"])
    apply_quantization_config(hf, quantization)
    for module in hf.modules():
        if hasattr(module, "quantization_scheme"):
            scale, zero_point = observed_qparams(module.weight.data, module.quantization_scheme,
                                                 rounding)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(
                    zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(folder)
    compressor.update_config(folder)
    if "num_experts" in config:
        tensors = load_file(folder / "model.safetensors")
        expert_scheme = QuantizationScheme(targets=["Linear"], **scheme)
        # The format compressed-tensors gives the Linears: packed integers, or FP8 as it is.
        expert_compressor = (FloatQuantizationCompressor if expert_scheme.weights.type == "float"
                             else PackedQuantizationCompressor)
        for name in [n for n in tensors if ".experts." in n]:
            weight = tensors.pop(name)
            scale, zero_point = observed_qparams(weight, expert_scheme, rounding)
            module = name.removesuffix(".weight")
            compressed = expert_compressor.compress(
                {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point},
                expert_scheme)
            tensors.update({f"{module}.{key}": value for key, value in compressed.items()})
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=True),
        attn_implementation="eager", dtype=torch.float32)


W4 = dict(num_bits=4, type="int", strategy="group")
# name -> (model_type, weights scheme (plus input_activations), scale rounding, config
# overrides, the ggml type a projection's blocks take (None: dequantized to floats))
CT_CASES = {
    "w4a16-g32-llama": ("llama", dict(weights=dict(W4, symmetric=True, group_size=32)), "fp16",
                        {}, QT.Q4_0),
    "w4a16-g128-qwen3": ("qwen3", dict(weights=dict(W4, symmetric=True, group_size=128)),
                         "fp16", dict(hidden_size=128, head_dim=32), QT.Q4_0),
    # Zero points: minima -scale * zero that fp16 holds go in Q4_1; else Q8_0 holds q - zero.
    "w4a16-g32-asym-qwen3": ("qwen3", dict(weights=dict(W4, symmetric=False, group_size=32)),
                             "7 bits", {}, QT.Q4_1),
    "w4a16-g128-asym-llama": ("llama", dict(weights=dict(W4, symmetric=False, group_size=128)),
                              "fp16", dict(hidden_size=128, head_dim=32), QT.Q8_0),
    # float32 scales fp16 cannot hold: dequantized, still exactly.
    "w4a16-g32-float32-scales": ("llama", dict(weights=dict(W4, symmetric=True, group_size=32)),
                                 "float32", {}, None),
    "w8a16-channel-llama": ("llama", dict(weights=dict(num_bits=8, type="int",
                                                       strategy="channel", symmetric=True)),
                            "fp16", {}, QT.Q8_0),
    "w8a8-int-qwen3": ("qwen3", dict(
        weights=dict(num_bits=8, type="int", strategy="channel", symmetric=True),
        input_activations=dict(num_bits=8, type="int", strategy="token", symmetric=True,
                               dynamic=True)), "fp16", {}, QT.Q8_0),
    # FP8 stays in its byte: fastllm's FP8 blocks, a float32 scale per 32 values.
    "fp8-channel-llama": ("llama", dict(
        weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True),
        input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                               dynamic=True)), "float32", {}, ops.FP8_E4M3),
    "fp8-tensor-qwen3": ("qwen3", dict(
        weights=dict(num_bits=8, type="float", strategy="tensor", symmetric=True)),
        "fp16", {}, ops.FP8_E4M3),
    # transformers dequantizes experts without zero points only.
    "w4a16-g32-qwen3-moe": ("qwen3_moe", dict(weights=dict(W4, symmetric=True, group_size=32)),
                            "fp16", MOE, QT.Q4_0),
    # FP8 experts stay FP8 too: the MoE op takes FP8_E4M3 blocks.
    "fp8-channel-qwen3-moe": ("qwen3_moe", dict(
        weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True),
        input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                               dynamic=True)), "float32", MOE, ops.FP8_E4M3),
}


@pytest.fixture(scope="module")
def ct_folders(tmp_path_factory) -> Callable[[str], tuple[Path, Path]]:
    """``get(case)``: (its compressed-tensors folder, the float folder of transformers'
    dequantization of it), made once."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            model_type, scheme, rounding, config, _ = CT_CASES[case]
            folder = tmp_path_factory.mktemp(case)
            reference = compressed_tensors_folder(folder, model_type, scheme, rounding,
                                                  seed=len(case), **config)
            made[case] = folder, save_float_twin(reference, tmp_path_factory.mktemp("ref"))
        return made[case]

    return get


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_load_as_transformers_dequantizes_them(ct_folders, case):
    folder, reference = ct_folders(case)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    weight_type = CT_CASES[case][-1]
    projections = ["layers.0.self_attn.qkv_proj", "layers.1.self_attn.o_proj",
                   "layers.1.mlp.down_proj"]  # a mixture of experts': the experts'
    if case.endswith("moe"):
        projections.append("layers.0.mlp.gate_up_proj")
    # The ignored LM head stays float.
    assert_loads_like(folder, reference, {**dict.fromkeys(projections, weight_type),
                                          "lm_head": None})


# ---- FP8, GPTQ and AWQ, packed here from their documented layouts -------------------------------

def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[n, m * bits / 32]`` of the unsigned ``bits``-bit integers ``codes``
    ``[n, m]``, ``32 / bits`` a word in order from its least significant bits."""
    per = 32 // bits
    grouped = codes.to(torch.int64).view(codes.shape[0], -1, per)
    words = (grouped << (bits * torch.arange(per))).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


# AWQ's GEMM packing: nibble i of a word holds row 8 w + AWQ_ORDER[i].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def random_groups(rows: int, cols: int, bits: int, group: int, symmetric: bool,
                  scale_bits: int | None, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(codes [rows, cols], zeros [rows, groups], scales fp16 [rows, groups])`` whose
    weights ``scale * (q - zero)`` are about 0.15 * N(0, 1), scales rounded to ``scale_bits``
    significant bits (None: fp16's)."""
    groups = -(-cols // group)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=generator)
    zeros = (torch.full((rows, groups), 1 << (bits - 1)) if symmetric
             else torch.randint(0, 1 << bits, (rows, groups), generator=generator))
    # q - zero's standard deviation: a uniform code's, and a uniform zero point's
    spread = (1 << bits) / 12 ** 0.5 * (1 if symmetric else 2 ** 0.5)
    scales = (0.15 / spread * (0.5 + torch.rand(rows, groups, generator=generator))).half()
    if scale_bits is not None:
        scales = round_mantissa(scales.float(), scale_bits).half()
    return codes, zeros, scales


def dequantized(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor) -> torch.Tensor:
    """``scale * (q - zero)`` in float64, each column in its group ``g_idx``."""
    return scales.double()[:, g_idx] * (codes - zeros[:, g_idx]).double()


def gptq_tensors(module: str, rows: int, cols: int, settings: dict,
                 generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A GPTQ Linear's tensors (settings: bits, group_size, sym, checkpoint_format, desc_act)
    and its float64 weight."""
    bits, group = settings["bits"], settings["group_size"]
    group = cols if group == -1 else group
    codes, zeros, scales = random_groups(rows, cols, bits, group, settings["sym"],
                                         settings.get("scale_bits"), generator)
    g_idx = torch.arange(cols) // group
    if settings["desc_act"]:  # columns quantized in another order: their groups shuffled
        g_idx = g_idx[torch.randperm(cols, generator=generator)]
    stored = zeros - 1 if settings["checkpoint_format"] == "gptq" else zeros
    tensors = {"qweight": pack_words(codes, bits).T.contiguous(),  # packed along the inputs
               "qzeros": pack_words(stored.T % (1 << bits), bits),
               "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}
    return ({f"{module}.{k}": v for k, v in tensors.items()},
            dequantized(codes, zeros, scales, g_idx))


def awq_tensors(module: str, rows: int, cols: int, settings: dict,
                generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An AWQ GEMM Linear's tensors and its float64 weight."""
    group = settings["group_size"]
    codes, zeros, scales = random_groups(rows, cols, 4, group, False,
                                         settings.get("scale_bits"), generator)

    def pack(values: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [n, rows / 8] words
        transposed = values.T.contiguous()
        return pack_words(transposed.view(transposed.shape[0], -1, 8)[..., AWQ_ORDER]
                          .flatten(1), 4)

    tensors = {"qweight": pack(codes), "qzeros": pack(zeros), "scales": scales.T.contiguous()}
    return ({f"{module}.{k}": v for k, v in tensors.items()},
            dequantized(codes, zeros, scales, torch.arange(cols) // group))


def fp8_tensors(module: str, rows: int, cols: int, settings: dict,
                generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An fp8 Linear's ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (per block of
    ``weight_block_size``, or one), and its float64 weight."""
    block = settings.get("weight_block_size") or [rows, cols]
    weight = (8 * torch.randn(rows, cols, generator=generator)).to(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = (0.01 + 0.02 * torch.rand(grid, generator=generator)).to(settings["scale_dtype"])
    per_value = (scales.double().repeat_interleave(block[0], 0)[:rows]
                 .repeat_interleave(block[1], 1)[:, :cols])
    if not settings.get("weight_block_size"):
        scales = scales.reshape(())
    return ({f"{module}.weight": weight, f"{module}.weight_scale_inv": scales},
            weight.double() * per_value)


WRITERS = {"gptq": gptq_tensors, "awq": awq_tensors, "fp8": fp8_tensors}


def packed_folder(folder: Path, twin: Path, model_type: str, config: dict, seed: int,
                  **shape) -> None:
    """A tiny random HF model whose projections (a mixture of experts' experts too) are stored
    in ``config``'s method (``quant_method`` plus the writer's settings), in ``folder``; and in
    ``twin``, the same model with each projection's float64 weight as float32 (the
    reference)."""
    settings = {k: v for k, v in config.items() if k not in ("quant_method", "scale_bits",
                                                             "scale_dtype")}
    hf = random_hf_model(model_type, seed, **{**SHAPE, **shape})
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
                stored, weight = WRITERS[config["quant_method"]](
                    name, *module.weight.shape, config, generator)
                tensors.update(stored)
                module.weight.copy_(weight)  # float64 -> float32, rounded once
    hf.save_pretrained(twin)
    plain = load_file(twin / "model.safetensors")
    # HF holds the experts stacked, not as Linears, but saves each expert's weights apart:
    # those are quantized here, and the twin saved again with their float64 weights.
    experts = [name for name in plain if ".experts." in name]
    for name in experts:
        stored, weight = WRITERS[config["quant_method"]](
            name.removesuffix(".weight"), *plain[name].shape, config, generator)
        tensors.update(stored)
        plain[name] = weight.float()
    if experts:
        save_file(plain, twin / "model.safetensors", metadata={"format": "pt"})
    quantized = {name.rsplit(".", 1)[0] for name in tensors}  # their modules
    tensors.update({name: value for name, value in plain.items()
                    if name.removesuffix(".weight") not in quantized})
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((twin / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": config["quant_method"], **settings}
    (folder / "config.json").write_text(json.dumps(hf_config))


GPTQ_V1 = dict(quant_method="gptq", bits=4, group_size=32, desc_act=False, sym=True,
               checkpoint_format="gptq")
AWQ_GEMM = dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm")
FP8_BLOCK = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
                 weight_block_size=[128, 128], scale_dtype=torch.float32)
# name -> (model_type, quantization_config (plus the writer's scale_bits / scale_dtype), config
# overrides, the ggml type or ops.FP8_E4M3 of the projections' blocks (None: dequantized to
# floats))
PACKED_CASES = {
    "gptq-4bit-sym-g32-llama": ("llama", GPTQ_V1, {}, QT.Q4_0),
    # Zero points: Q4_1 where the minima are fp16s, else Q8_0.
    "gptq-v2-4bit-g32-qwen3": ("qwen3", dict(GPTQ_V1, sym=False, checkpoint_format="gptq_v2",
                                             scale_bits=7), {}, QT.Q4_1),
    "gptq-4bit-g128-llama": ("llama", dict(GPTQ_V1, sym=False, group_size=128),
                             dict(hidden_size=128, head_dim=32), QT.Q8_0),
    "gptq-8bit-channel-qwen3": ("qwen3", dict(GPTQ_V1, bits=8, group_size=-1), {}, QT.Q8_0),
    # Activation order: no block layout keeps its column permutation.
    "gptq-4bit-desc-act-llama": ("llama", dict(GPTQ_V1, desc_act=True), {}, None),
    "awq-g32-qwen3": ("qwen3", dict(AWQ_GEMM, scale_bits=7), {}, QT.Q4_1),
    "awq-g64-llama": ("llama", dict(AWQ_GEMM, group_size=64), {}, QT.Q8_0),
    # FP8 blocks wherever every 32 columns share a scale; else dequantized.
    "fp8-block-qwen3": ("qwen3", FP8_BLOCK, dict(hidden_size=128, head_dim=32,
                                                 intermediate_size=384), ops.FP8_E4M3),
    "fp8-tensor-bf16-scales-llama": ("llama", dict(FP8_BLOCK, weight_block_size=None,
                                                   scale_dtype=torch.bfloat16), {},
                                     ops.FP8_E4M3),
    "fp8-block-16-columns-llama": ("llama", dict(FP8_BLOCK, weight_block_size=[16, 16],
                                                 scale_dtype=torch.float16), {}, None),
    # The experts' too: the MoE op takes FP8_E4M3 blocks.
    "fp8-block-qwen3-moe": ("qwen3_moe", FP8_BLOCK, dict(MOE, hidden_size=128, head_dim=32),
                            ops.FP8_E4M3),
}


@pytest.fixture(scope="module")
def packed_folders(tmp_path_factory) -> Callable[[str], tuple[Path, Path]]:
    """``get(case)``: (its quantized folder, its float32 twin), made once."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            model_type, config, shape, _ = PACKED_CASES[case]
            root = tmp_path_factory.mktemp(case)
            packed_folder(root / "quantized", root / "twin", model_type, config,
                          seed=len(case), **shape)
            made[case] = root / "quantized", root / "twin"
        return made[case]

    return get


@pytest.mark.parametrize("case", PACKED_CASES)
def test_packed_checkpoints_load_as_their_float64_dequantization(packed_folders, case):
    folder, twin = packed_folders(case)
    weight_type = PACKED_CASES[case][-1]
    projections = ["layers.0.self_attn.qkv_proj", "layers.1.self_attn.o_proj",
                   "layers.0.mlp.gate_up_proj", "layers.1.mlp.down_proj"]
    assert_loads_like(folder, twin, {**dict.fromkeys(projections, weight_type),
                                     "lm_head": None})


# ---- bfloat16 ----------------------------------------------------------------------------------

# Every block format a checkpoint becomes (and the dequantized one), Llama, Qwen3 and the MoE.
BF16_CASES = {"ct:w4a16-g128-qwen3": QT.Q4_0, "ct:w4a16-g32-qwen3-moe": QT.Q4_0,
              "ct:w8a16-channel-llama": QT.Q8_0, "packed:gptq-v2-4bit-g32-qwen3": QT.Q4_1,
              "packed:fp8-block-qwen3": ops.FP8_E4M3,
              "packed:gptq-4bit-desc-act-llama": None}


@pytest.mark.parametrize("case", BF16_CASES)
def test_bfloat16_errs_at_most_twice_as_much_as_hf_in_bfloat16(ct_folders, packed_folders,
                                                                case):
    """bfloat16's rule: against HF's float64 logits on the reference weights, fastllm's
    bfloat16 model of the quantized folder errs at most twice as much as HF in bfloat16 on the
    same reference, for a prompt read by the decode kernels (up to 32 rows) and one read by the
    prefill GEMM (past 32)."""
    kind, name = case.split(":")
    folder, reference = (ct_folders if kind == "ct" else packed_folders)(name)
    model = load_model(folder, dtype=torch.bfloat16)
    assert weight_types(model)["layers.0.self_attn.o_proj"] == BF16_CASES[case]
    # Eager experts: the grouped GEMM of HF's default takes no float64.
    hf = {dtype: AutoModelForCausalLM.from_pretrained(reference, attn_implementation="eager",
                                                      experts_implementation="eager",
                                                      dtype=dtype)
          for dtype in (torch.float64, torch.bfloat16)}
    for tokens in (PROMPTS[0], PROMPTS[1] + PROMPTS[2]):
        with torch.no_grad():
            expected, plain = (hf[dtype](torch.tensor([tokens])).logits[0].double()
                               for dtype in (torch.float64, torch.bfloat16))
        got = prefill_logits(model, tokens).double()
        assert_within_twice_plain_error(got, plain, expected)


# ---- repacking integers into ggml blocks --------------------------------------------------------

def integer_weight(bits: int, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                   group: int = 32, **fields) -> IntegerWeight:
    """Random ``bits``-bit integers [16, 64] (with 0, the most negative) under ``scales``."""
    codes = torch.randint(0, 1 << bits, (16, 64), generator=torch.Generator().manual_seed(0))
    codes[0, 0] = 0
    return IntegerWeight(codes.to(torch.uint8), bits, scales, zeros, group, **fields)


def scales_of(dtype: torch.dtype, groups: int = 2, bits: int | None = None) -> torch.Tensor:
    scales = 0.001 + 0.05 * torch.rand(16, groups, generator=torch.Generator().manual_seed(1))
    return (scales if bits is None else round_mantissa(scales, bits)).to(dtype)


ZEROS = torch.randint(0, 16, (16, 2), generator=torch.Generator().manual_seed(2)).to(torch.uint8)
# case -> (weight, the ggml type that holds it exactly; None: none does, it is dequantized)
REPACKS = {
    "int4 bf16 scales": (integer_weight(4, scales_of(torch.bfloat16)), QT.Q4_0),
    "int4 fp16 scales": (integer_weight(4, scales_of(torch.float16)), QT.Q4_0),
    "int4 float32 scales": (integer_weight(4, scales_of(torch.float32)), None),
    "int4 scale beyond fp16": (integer_weight(4, scales_of(torch.bfloat16) * 1e7), None),
    "int4 zero points 8": (integer_weight(4, scales_of(torch.float16), torch.full_like(ZEROS, 8)),
                           QT.Q4_0),
    "int4 fp16 minima": (integer_weight(4, scales_of(torch.float16, bits=7), ZEROS), QT.Q4_1),
    "int4 minima beyond fp16": (integer_weight(4, scales_of(torch.float16), ZEROS), QT.Q8_0),
    "int8 per channel": (integer_weight(8, scales_of(torch.bfloat16, groups=1), group=64),
                         QT.Q8_0),
    "int8 zero points": (integer_weight(8, scales_of(torch.float16),
                                        torch.full_like(ZEROS, 200)), None),
    "groups of 16": (integer_weight(4, scales_of(torch.float16, groups=4), group=16), None),
    "activation order": (integer_weight(4, scales_of(torch.float16),
                                        group_index=torch.randperm(64) // 32), None),
}


@pytest.mark.parametrize("case", REPACKS)
def test_integers_become_blocks_only_where_exact(case):
    weight, weight_type = REPACKS[case]
    blocks = weight.blocks()
    assert (None if blocks is None else blocks.weight_type) == weight_type
    zeros = (torch.full(weight.scales.shape, 1 << (weight.bits - 1)) if weight.zeros is None
             else weight.zeros.long())
    groups = (torch.arange(64) // weight.group if weight.group_index is None
              else weight.group_index)
    expected = dequantized(weight.codes.long(), zeros, weight.scales, groups).float()
    assert torch.equal(weight.dequantize(), expected)
    if blocks is not None:
        assert torch.equal(ops.dequantize(blocks.data, blocks.weight_type), expected)


# ---- tensor parallelism --------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["w4a16-g32-llama", "fp8-tensor-bf16-scales-llama"])
def test_tensor_parallel_shards_put_together_are_the_whole(ct_folders, packed_folders, case):
    """Two ranks' shards of a W4A16 model (groups of 32) and of an FP8 one (a scale per
    tensor): q/k/v and gate/up rows, o and down columns (cut between groups), each still in
    its blocks (Q4_0, FP8), together are the whole model."""
    folder, _ = ct_folders(case) if case in CT_CASES else packed_folders(case)
    weight_type = (CT_CASES if case in CT_CASES else PACKED_CASES)[case][-1]
    whole = float_weights(load_model(folder))
    shards = [load_model(folder, tensor_parallel=TensorParallel(rank, 2, "unused"))
              for rank in range(2)]
    for shard in shards:
        types = weight_types(shard)
        assert types["layers.1.mlp.down_proj"] == types["layers.0.self_attn.qkv_proj"] == (
            weight_type)
    parts = [float_weights(shard) for shard in shards]
    for layer in range(SHAPE["num_hidden_layers"]):
        name = f"layers.{layer}."
        for module in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: columns
            key = f"{name}{module}.weight"
            assert torch.equal(torch.cat([p[key] for p in parts], dim=1), whole[key])
        key = f"{name}self_attn.qkv_proj.weight"  # q, k, v rows of each rank's heads
        split = [p[key].split([32, 16, 16]) for p in parts]
        assert torch.equal(torch.cat([s[i] for i in range(3) for s in split]), whole[key])
        key = f"{name}mlp.gate_up_proj.weight"  # gate, up rows of each rank's features
        split = [p[key].split(64) for p in parts]
        assert torch.equal(torch.cat([s[i] for i in range(2) for s in split]), whole[key])


def test_a_column_cut_inside_a_group_is_refused(packed_folders):
    folder, _ = packed_folders("fp8-block-qwen3")  # down_proj: 384 columns, blocks of 128
    with pytest.raises(ValueError, match=r"tensor parallelism over 2 ranks cuts the columns of "
                                         r"model\.layers\.0\.mlp\.down_proj\.weight \(384\) at "
                                         r"192, inside a quantization group \(fp8: groups of 128 "
                                         r"columns\)"):
        load_model(folder, tensor_parallel=TensorParallel(0, 2, "unused"))


# ---- refusals ------------------------------------------------------------------------------------

def group_weights(config: dict) -> dict:
    return config["config_groups"]["group_0"]["weights"]


# (folder, edit of quantization_config, exception, message)
CONFIG_REFUSALS = [
    ("ct", lambda q: group_weights(q).update(num_bits=2), ValueError,
     r"config_groups\.group_0\.weights\.num_bits is 2: fastllm loads int weights of 4 or 8"),
    ("ct", lambda q: group_weights(q).update(num_bits=3), ValueError,
     r"config_groups\.group_0\.weights\.num_bits is 3"),
    ("ct", lambda q: group_weights(q).update(type="float", num_bits=4), ValueError,
     r"config_groups\.group_0\.weights\.num_bits is 4: fastllm loads float weights of 8 bits"),
    ("ct", lambda q: group_weights(q).update(type="float", num_bits=8, symmetric=False),
     ValueError, r"config_groups\.group_0\.weights\.symmetric is False"),
    ("ct", lambda q: group_weights(q).update(strategy="tensor_group"), ValueError,
     r"config_groups\.group_0\.weights\.strategy is 'tensor_group'"),
    ("ct", lambda q: group_weights(q).update(group_size=None), ValueError,
     r"config_groups\.group_0\.weights\.group_size is None"),
    ("ct", lambda q: group_weights(q).update(actorder="bogus"), ValueError,
     r"config_groups\.group_0\.weights\.actorder is 'bogus'"),
    ("ct", lambda q: group_weights(q).update(num_bits="4"), TypeError,
     r"config_groups\.group_0\.weights\.num_bits must be of type int, got '4'"),
    ("ct", lambda q: q["config_groups"]["group_0"].update(targets=["Embedding"]), ValueError,
     r"config_groups\.group_0\.targets is \['Embedding'\]"),
    ("ct", lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     ValueError, r"config_groups\.group_0\.format is 'nvfp4-pack-quantized': fastllm loads int "
                 r"weights stored as pack-quantized, int-quantized, naive-quantized"),
    ("ct", lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8}),
     ValueError, r"config_groups\.group_0\.output_activations is"),
    ("ct", lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask",
                                               "sparsity_structure": "2:4"}),
     ValueError, r"sparsity_config is 'sparse-24-bitmask'"),
    ("ct", lambda q: q.update(transform_config={"config_groups": {"R1": {}}}), ValueError,
     r"transform_config is"),
    ("ct", lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), ValueError,
     r"kv_cache_scheme is"),
    ("ct", lambda q: q.update(config_groups={}), ValueError,
     r"config_groups is empty"),
    ("gptq", lambda q: q.update(bits=2), ValueError,
     r"bits is 2: fastllm loads GPTQ weights of 4 or 8 bits"),
    ("gptq", lambda q: q.update(bits=3), ValueError, r"bits is 3"),
    ("gptq", lambda q: q.update(checkpoint_format="marlin"), ValueError,
     r"checkpoint_format is 'marlin'"),
    ("gptq", lambda q: q.update(format="bitblas"), ValueError,
     r"format is 'bitblas'"),
    ("gptq", lambda q: q.update(is_marlin_format=True), ValueError,
     r"is_marlin_format is True"),
    ("gptq", lambda q: q.update(group_size=0), ValueError,
     r"group_size is 0"),
    *[("awq", lambda q, v=version: q.update(version=v), ValueError,
       rf"version is '{version}': fastllm loads AutoAWQ's GEMM layout")
      for version in ("gemv", "gemv_fast", "marlin", "exllama")],
    ("awq", lambda q: q.update(bits=8), ValueError, r"bits is 8"),
    ("awq", lambda q: q.update(zero_point=False), ValueError,
     r"zero_point is False"),
    ("awq", lambda q: q.update(backend="llm-awq"), ValueError,
     r"backend is 'llm-awq'"),
    ("fp8", lambda q: q.update(activation_scheme="static"), ValueError,
     r"activation_scheme is 'static'"),
    ("fp8", lambda q: q.update(fmt="e5m2"), ValueError, r"fmt is 'e5m2'"),
    ("fp8", lambda q: q.update(weight_block_size=[128]), ValueError,
     r"weight_block_size is \[128\]"),
    *[("fp8", lambda q, m=method: q.update(quant_method=m), ValueError,
       rf"quant_method is '{method}': fastllm loads compressed-tensors, "
       r"fp8, gptq, awq checkpoints")
      for method in ("bitsandbytes", "hqq", "torchao")],
]
REFUSAL_FOLDERS = {"ct": "w4a16-g32-llama", "gptq": "gptq-4bit-sym-g32-llama",
                   "awq": "awq-g32-qwen3", "fp8": "fp8-tensor-bf16-scales-llama"}


@pytest.fixture
def copy_of(ct_folders, packed_folders, tmp_path) -> Callable[[str], Path]:
    """``copy(kind)``: a copy of the kind's folder (:data:`REFUSAL_FOLDERS`) to edit."""
    def copy(kind: str) -> Path:
        case = REFUSAL_FOLDERS[kind]
        folder = (ct_folders if kind == "ct" else packed_folders)(case)[0]
        return shutil.copytree(folder, tmp_path / "model")
    return copy


def edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind, edit, error, match", CONFIG_REFUSALS)
def test_settings_fastllm_does_not_load_are_refused_by_name(copy_of, kind, edit, error, match):
    with pytest.raises(error, match=r"config\.json: quantization_config\." + match):
        load_model(edit_config(copy_of(kind), edit))


def edit_tensors(folder: Path, edit: Callable[[dict], None]) -> Path:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


Q_PROJ = "model.layers.0.self_attn.q_proj"


def test_checkpoint_tensors_are_checked_by_their_format(copy_of):
    folder = edit_tensors(copy_of("ct"), lambda t: t.pop(f"{Q_PROJ}.weight_scale"))
    with pytest.raises(ValueError, match=rf"lacks {Q_PROJ}\.weight_scale \(part of a "
                                         r"compressed-tensors pack-quantized weight; 1 missing"):
        load_model(folder)
    shutil.rmtree(folder)
    folder = edit_tensors(copy_of("gptq"), lambda t: t.update(
        {f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"].float()}))
    with pytest.raises(ValueError, match=rf"tensor {Q_PROJ}\.qweight is stored as F32; GPTQ "
                                         r"stores it as \(I32\)"):
        load_model(folder)
    shutil.rmtree(folder)
    folder = edit_tensors(copy_of("awq"), lambda t: t.update(
        {f"{Q_PROJ}.scales": t[f"{Q_PROJ}.scales"][:1]}))
    with pytest.raises(ValueError, match=rf"tensor {Q_PROJ}\.scales has shape \(1, 64\), "
                                         r"expected \(2, 64\) as AWQ stores a weight of shape "
                                         r"\(64, 64\)"):
        load_model(folder)
    shutil.rmtree(folder)
    folder = edit_tensors(copy_of("gptq"), lambda t: t[f"{Q_PROJ}.g_idx"].fill_(7))
    with pytest.raises(ValueError, match=rf"tensor {Q_PROJ}\.g_idx holds groups outside "
                                         r"\[0, 2\)"):
        load_model(folder)
    shutil.rmtree(folder)
    folder = edit_tensors(copy_of("ct"), lambda t: t[f"{Q_PROJ}.weight_shape"].fill_(32))
    with pytest.raises(ValueError, match=rf"tensor {Q_PROJ}\.weight_shape holds \[32, 32\], "
                                         r"expected \[64, 64\]"):
        load_model(folder)


def test_ignored_layers_must_be_stored_unquantized(copy_of):
    folder = edit_config(copy_of("ct"), lambda q: q["ignore"].append("re:.*q_proj$"))
    with pytest.raises(ValueError, match=rf"holds {Q_PROJ}\.weight_scale, but its "
                                         r"compressed-tensors quantization_config leaves "
                                         rf"{Q_PROJ} unquantized"):
        load_model(folder)


def test_a_quantized_checkpoint_is_not_quantized_again(ct_folders):
    folder, _ = ct_folders("w4a16-g32-llama")
    with pytest.raises(ValueError, match=r"is already quantized \(model\.layers\.0\.self_attn\."
                                         r"q_proj is compressed-tensors pack-quantized\); load "
                                         r"it without quantization='int8'"):
        load_model(folder, quantization="int8")
