"""Loads a llama.cpp GGUF checkpoint into a :class:`~fastllm.models.decoder.DecoderLM`.

The file is memory-mapped with ``gguf.GGUFReader`` (:class:`fastllm.gguf_file.GGUFFileReader`).
Its metadata (``{arch}.block_count``, ...) is translated into the HF ``config.json`` keys it came
from, so :meth:`ModelConfig.from_hf_config` applies the same per-architecture rules as for a HF
folder. Each tensor is dequantized to float32 with ``gguf.quants`` and handed to the safetensors
loader's :func:`build_model` under its HF name, so the fused q/k/v and gate/up layout and the
meta-device build are the same code. What differs by family (llama.cpp's tensor names, what
llama.cpp fixes rather than stores) is read from its record
(:class:`~fastllm.models.families.GGUFConventions`).

Conventions of llama.cpp's ``convert_hf_to_gguf.py`` undone here:

- ggml lists a tensor's dimensions innermost first, so a torch ``[out, in]`` weight is ggml
  ``[in, out]``; the reader's ``tensor.data`` is already in numpy (torch) order.
- Norms are named by where they sit (``attn_norm``, ``post_attention_norm``, ``ffn_norm``,
  ``post_ffw_norm``: :data:`~fastllm.models.families.GGUF_NORM_NAMES`), whatever HF calls them.
- For the ``llama`` architecture, q/k rows (weights and biases) are permuted from HF's
  half-split RoPE pairs ``(j, j + d/2)`` to interleaved pairs ``(2j, 2j + 1)``, because
  llama.cpp rotates llama with its "normal" (GPT-J) RoPE. fastllm rotates HF's way (neox), so
  the rows are permuted back. The other families are converted without the permutation:
  llama.cpp runs them with neox RoPE, which already is HF's layout.
- Gemma's norm weights are stored as ``1 + w``, the scale its RMSNorm applies: fastllm folds
  the same offset at load, so they are kept as they are (``build_model(norms_folded=True)``).
- Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` are kept fused (``attn_qkv``, and ``ffn_up``
  holding the gate rows, then the up rows), as in its HF checkpoint.
- A mixture of experts' projections are stacked, one tensor per projection and layer
  (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``: ``[experts, rows, cols]`` in torch
  order, each expert's ``[out, in]`` weight as in HF); the router is ``ffn_gate_inp``. Mixtral
  is written as ``llama`` with experts (``llama.expert_count``), its q/k rows permuted as
  Llama's. Each expert's gate and up weights become its rows of the fused ``gate_up_proj``.

What llama.cpp does not store, it fixes per family, and so does this reader: Gemma's attention
scale (``query_pre_attn_scalar``: ``head_dim``, but ``hidden_size / heads`` for the 27B models),
its window pattern and Gemma 3's local RoPE base, and that Qwen3-MoE renormalizes its experts'
top-k weights (``norm_topk_prob``; HF's config class defaults to False). One difference is
kept on purpose: llama.cpp runs Phi-3 without its sliding window, HF with it; this reader
follows HF, as the safetensors loader does, so a model is the same from either file.

A file is checked before any tensor is read: every read the reader makes lies within the file,
each tensor's type, offset (aligned, relative to the data section) and extent agree with its
header entry and the file's size, and its shape with the config. What fails is a ValueError
naming the file and the metadata key or the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from torch import Tensor

from fastllm import ops
from fastllm.gguf_file import GGUFFileReader
from fastllm.models.build import HFTensor, build_model, hf_weight_map
from fastllm.models.config import ModelConfig
from fastllm.models.decoder import DecoderLM
from fastllm.models.families import FAMILIES, GGUF_EXPERT_NAMES, GGUF_GLOBAL_NAMES, Family
from fastllm.models.quantized import QuantizedWeight, check_quantization
from fastllm.models.rope import rope_inv_freq
from fastllm.models.tensor_parallel import ShardLayout, TensorParallel, TensorSlice

__all__ = ["GGUF_ARCHITECTURES", "GGUF_TENSOR_TYPES", "config_from_gguf", "gguf_tensor_name",
           "gguf_tensor_part", "load_gguf"]


def _gguf_architectures() -> dict[str, dict[bool, str]]:
    architectures: dict[str, dict[bool, str]] = {}
    for family in FAMILIES.values():
        if family.gguf is not None:
            architectures.setdefault(family.gguf.architecture, {})[
                family.moe is not None] = family.architecture
    return architectures


# general.architecture -> {whether the file has experts (a nonzero {arch}.expert_count): the HF
# architecture whose conventions it keeps}; llama with experts is Mixtral.
GGUF_ARCHITECTURES = _gguf_architectures()

# The tensor types fastllm reads: weights in ops.BLOCK_FORMATS (all of these but F32, F16 and
# BF16) stay quantized, the others are dequantized at load (through gguf.quants.dequantize).
GGUF_TENSOR_TYPES = tuple(GGMLQuantizationType[name] for name in
                          ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                           "Q4_K", "Q5_K", "Q6_K"))

# The types quantization= may quantize further: plain floats.
_FLOAT_TYPES = tuple(GGMLQuantizationType[name] for name in ("F32", "F16", "BF16"))

# 16-bit tensor types, read exactly into these dtypes (build_model may keep them so).
_SIXTEEN_BIT = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}

# Llama 3.1 RoPE scaling: convert_hf_to_gguf.py stores it as per-frequency divisors in this
# tensor, [head_dim / 2] F32, rather than as metadata.
_ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x's llama3 scaling parameters (also the converter's defaults), all but the factor.
_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
# Phi-3's longrope scaling (the 128k-context models): per-frequency factors for long and short
# contexts, which fastllm does not implement.
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")
# One expert's own tensor (blk.{i}.ffn_gate.{e}.weight): how llama.cpp stored experts before it
# stacked them (Mixtral files of early 2024).
_PER_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def gguf_tensor_name(family: Family, hf_name: str) -> str:
    """llama.cpp's name for the tensor holding the HF tensor ``hf_name`` of ``family``:
    ``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``; Gemma's
    ``model.layers.3.post_attention_layernorm.weight`` -> ``blk.3.post_attention_norm.weight``
    but Llama's -> ``blk.3.ffn_norm.weight`` (norms are named by role); one expert's weight ->
    the tensor stacking every expert's (see :func:`gguf_tensor_part`)."""
    return gguf_tensor_part(family, hf_name)[0]


def gguf_tensor_part(family: Family, hf_name: str) -> tuple[str, int | None]:
    """Where llama.cpp keeps the HF tensor ``hf_name`` of ``family``: the tensor's name, and
    for one expert's weight its index along the stacked tensor's first dimension (else None):
    ``model.layers.3.mlp.experts.5.up_proj.weight`` -> ``("blk.3.ffn_up_exps.weight", 5)``."""
    module, kind = hf_name.rsplit(".", 1)  # kind: weight or bias
    if module in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[module]}.{kind}", None
    _, _, layer, rest = module.split(".", 3)  # "model", "layers", "{i}", rest
    if rest in family.gguf_names:
        return f"blk.{layer}.{family.gguf_names[rest]}.{kind}", None
    for pattern, name in family.gguf_expert_names.items():  # "mlp.experts.{e}.up_proj", ...
        before, after = pattern.split("{e}")
        expert = rest.removeprefix(before).removesuffix(after)
        if rest == f"{before}{expert}{after}" and expert.isdigit():
            return f"blk.{layer}.{name}.{kind}", int(expert)
    raise KeyError(f"{family.architecture} has no GGUF tensor for {hf_name}")


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file, from its metadata and its tensor list.

    The file's facts are written as the HF ``config.json`` keys llama.cpp's converter read them
    from; what the metadata leaves out takes what llama.cpp fixes for the family (its
    :class:`~fastllm.models.families.GGUFConventions`), else the HF config class's default, as
    for a HF folder. The vocabulary size is ``token_embd``'s row count, tied embeddings mean no
    ``output.weight``, biases are present when their tensors are, and the eos ids are
    llama.cpp's end-of-generation set (``eos``, ``eot``, ``eom``). RoPE scaling is
    ``rope.scaling.*`` metadata (linear; Gemma 3: its global layers), or Llama 3.1's
    ``rope_freqs.weight``, read as llama3 scaling and checked to reproduce it. Sliding windows,
    soft-caps, Gemma's attention scale and the mixture of experts are read as the family's
    record says (see :func:`_family_keys`); a ``llama`` file with experts is Mixtral. A bad
    value is a ValueError or TypeError naming the file and the key.
    """
    path = Path(reader.data.filename)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r:.80}; fastllm loads "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: the GGUF file lacks token_embd.weight")
    if len(tensors["token_embd.weight"].shape) != 2:
        raise ValueError(f"{path}: tensor token_embd.weight has ggml shape "
                         f"{tensors['token_embd.weight'].shape.tolist()}, not [hidden, vocab]")
    longrope = [name for name in _LONGROPE if name in tensors]
    if longrope:
        raise ValueError(f"{path}: the GGUF file has {longrope[0]}, Phi-3's longrope RoPE "
                         "scaling (its 128k-context models), which fastllm does not support")
    per_expert = next((name for name in tensors if _PER_EXPERT_TENSOR.fullmatch(name)), None)
    if per_expert is not None:
        raise ValueError(f"{path}: tensor {per_expert} is one expert's own, as llama.cpp stored "
                         "experts before it stacked each layer's into one tensor "
                         f"({', '.join(list(GGUF_EXPERT_NAMES.values())[1:])}); fastllm reads "
                         "only stacked experts: convert the model again with a current "
                         "convert_hf_to_gguf.py")

    def get(key: str, kind: type = int) -> Any:
        """Metadata ``{arch}.{key}``, None when absent; a value not of ``kind`` (an int, a
        float, a str or a bool) is a TypeError naming it."""
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            return None
        kinds = (int, float) if kind is float else (kind,)  # an integer serves as a float
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kinds):
            raise TypeError(f"{path}: metadata {arch}.{key} must be a GGUF "
                            f"{'integer' if kind is int else kind.__name__}, got {value!r:.80}")
        return value

    expert_count = get("expert_count")
    families = GGUF_ARCHITECTURES[arch]
    if bool(expert_count) not in families:
        raise ValueError(f"{path}: metadata {arch}.expert_count is {expert_count}; fastllm reads "
                         f"{arch} files with{'out' if expert_count else ''} experts only")
    family = FAMILIES[families[bool(expert_count)]]

    n_heads, hidden = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length")
    if head_dim is None and n_heads and hidden is not None:
        head_dim = hidden // n_heads
    value_dim = get("attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise ValueError(f"{path}: attention.value_length={value_dim} differs from key_length="
                         f"{head_dim}; fastllm needs one head_dim")
    tokens = {kind: _field(reader, f"tokenizer.ggml.{kind}_token_id")
              for kind in ("bos", "eos", "eot", "eom")}
    for kind, token in tokens.items():
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            raise TypeError(f"{path}: metadata tokenizer.ggml.{kind}_token_id must be a GGUF "
                            f"integer, got {token!r:.80}")
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ggml [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(f"blk.0.{name}.bias" in tensors for name in ("attn_q", "attn_qkv")),
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
        "bos_token_id": tokens["bos"],
        "eos_token_id": list(dict.fromkeys(  # llama.cpp's end-of-generation set
            tokens[kind] for kind in ("eos", "eot", "eom") if tokens[kind] is not None)),
    }
    # Keys the metadata may leave out: absent, the HF class default applies.
    for key, hf_key, kind in (("context_length", "max_position_embeddings", int),
                              ("rope.freq_base", "rope_theta", float)):
        if (value := get(key, kind)) is not None:
            hf[hf_key] = value
    rotary_dim = get("rope.dimension_count")
    if rotary_dim is not None and head_dim and rotary_dim != head_dim:
        if family.gguf.permuted_qk:  # its q/k rows are permuted for whole-head rotation
            raise ValueError(f"{path}: partial rotary embedding is not supported in a {arch} "
                             f"file (rope.dimension_count={rotary_dim}, head_dim={head_dim})")
        # HF rotates int(head_dim * factor) channels: the float just above rotary_dim / head_dim
        # gives rotary_dim back, where the quotient itself may give one less (30 of 44).
        hf["partial_rotary_factor"] = math.nextafter(rotary_dim / head_dim, math.inf)
    hf.update(_family_keys(path, family, get, hidden, n_heads, head_dim))
    scaling = get("rope.scaling.type", str)
    if scaling is not None and scaling != "none":
        hf["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor", float)}
    rope_divisors = _dequantize(path, tensors[_ROPE_FREQS]) if _ROPE_FREQS in tensors else None
    if rope_divisors is not None:
        if "rope_scaling" in hf:
            raise ValueError(f"{path}: the GGUF file has both rope.scaling.type={scaling!r} and "
                             f"{_ROPE_FREQS}")
        if rope_divisors.ndim != 1 or rope_divisors.size == 0:
            raise ValueError(f"{path}: tensor {_ROPE_FREQS} has shape {rope_divisors.shape}, "
                             "not [head_dim / 2]")
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": float(rope_divisors.max()),
                              **_LLAMA3_ROPE}
    try:
        config = ModelConfig.from_hf_config(hf)
    except (TypeError, ValueError) as error:  # named by its config.json key
        kind = ValueError if isinstance(error, ValueError) else TypeError
        raise kind(f"{path}: the GGUF metadata gives a bad config: {error}") from error
    if rope_divisors is not None:
        _check_llama3_divisors(path, config, rope_divisors)
    return config


def _family_keys(path: Path, family: Family, get, hidden: int | None, n_heads: int | None,
                 head_dim: int | None) -> dict[str, Any]:
    """The HF config keys of ``family``'s sliding windows, soft-caps, attention scale, local
    RoPE and mixture of experts, from the file's metadata (``get``) and what llama.cpp fixes for
    the family.

    ``attention.sliding_window`` 0 means no window (Phi-4 writes 0). Families whose layers all
    slide (Phi-3) take it as is; Gemma's slide in its fixed pattern, with llama.cpp's default
    window when the key is absent (Gemma 2: 4096; Gemma 3: none, every layer full). A family
    without sliding layers refuses a window (an OLMo 3 file is ``olmo2`` with one), and the
    others (Qwen2, Qwen3) ignore it, as llama.cpp does.

    Experts: ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length`` (absent
    for Mixtral, whose experts are ``feed_forward_length`` wide); whether the top-k weights are
    renormalized, where the family's config says so, is ``expert_weights_norm`` or, absent
    (the converter writes none for Qwen3-MoE), what llama.cpp fixes.
    """
    conventions, keys = family.gguf, {}
    window = get("attention.sliding_window")
    if family.windows == "none" and window:
        raise ValueError(f"{path}: metadata {conventions.architecture}.attention.sliding_window="
                         f"{window} makes layers slide, which fastllm's "
                         f"{family.architecture} does not")
    if family.windows == "every":
        keys["sliding_window"] = window or None
    elif family.windows == "layer_types":
        window = conventions.default_window if window is None else window or None
        keys["sliding_window"] = window
        keys["sliding_window_pattern"] = conventions.window_pattern if window else 1
    # Absent: the HF defaults, which are llama.cpp's.
    for switch in family.layer_switches.values():
        if switch.gguf is not None and (value := get(*switch.gguf)) is not None:
            keys[switch.key] = value
    if family.final_softcap and (value := get("final_logit_softcapping", float)) is not None:
        keys["final_logit_softcapping"] = value
    if conventions.hidden_scalar_layers is not None and n_heads and hidden is not None:
        # llama.cpp scales queries by 1 / sqrt(head_dim), but the 27B's by 1 / sqrt(hidden /
        # heads), as Google's reference code does.
        wide = get("block_count") == conventions.hidden_scalar_layers
        keys["query_pre_attn_scalar"] = hidden // n_heads if wide else head_dim
    if family.local_rope:
        keys["rope_local_base_freq"] = conventions.local_rope_theta
    if family.moe is not None:
        top_k = get("expert_used_count")
        if top_k is None:  # llama.cpp refuses it too
            raise ValueError(f"{path}: the GGUF file lacks metadata "
                             f"{conventions.architecture}.expert_used_count")
        keys[family.moe.experts_keys[0]] = get("expert_count")
        keys["num_experts_per_tok"] = top_k
        if (width := get("expert_feed_forward_length")) is not None:
            keys["moe_intermediate_size"] = width
        if family.moe.renormalize_key is not None:
            renormalize = get("expert_weights_norm", bool)
            keys[family.moe.renormalize_key] = (conventions.expert_weights_norm
                                                if renormalize is None else renormalize)
    return keys


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", quantization: str | None = None,
              tensor_parallel: TensorParallel | None = None,
              reader: GGUFFileReader | None = None) -> DecoderLM:
    """Loads the GGUF file ``path`` (architectures :data:`GGUF_ARCHITECTURES`).

    Weights in a block format of :data:`fastllm.ops.BLOCK_FORMATS` (Q4_0 ... Q8_0, Q4_K, Q5_K,
    Q6_K) stay in their blocks (run by the quantized ops; experts by :func:`fastllm.ops.moe`,
    each layer's down experts in their format, its gate and up experts in theirs, which must be
    one); every other tensor (types :data:`GGUF_TENSOR_TYPES`) is dequantized to float32, then
    cast to ``dtype``. Everything is placed on ``device``. On the CPU, blocks kept as the file
    stores them (not unpermuted, not fused from several tensors) are mapped from it, not copied,
    as llama.cpp maps them: copy-on-write, so the model never writes the file, but the file must
    not be rewritten in place while the model lives (a new file replacing it, as downloads and
    converters write one, is safe). A bad file (truncated, corrupt, a
    tensor that is missing, unexpected, wrongly shaped or of another type) is a ``ValueError``
    naming the file and the tensor or metadata key, raised before any tensor is read.

    ``quantization`` ("int8", "int4") quantizes a float file (F32 / F16 / BF16 tensors only) at
    load, as for safetensors (experts included); a file already quantized is a ``ValueError``,
    since quantizing its weights again would only add error.

    With ``tensor_parallel``, the model is that rank's shard (see
    :mod:`fastllm.models.tensor_parallel`) and only its rows or columns of each tensor are read.
    Blocks are split whole: a row-parallel weight (o_proj, down_proj) whose rows do not split
    among the ranks at block boundaries is a ``ValueError`` naming the sizes.

    ``reader``: the file ``path`` already parsed (an entry point reading its tokenizer from the
    same file parses it once), else it is parsed here.
    """
    path = Path(path)
    if reader is None:
        reader = GGUFFileReader(path)
    if check_quantization(quantization) is not None:
        packed = [t for t in reader.tensors if t.tensor_type not in _FLOAT_TYPES]
        if packed:
            raise ValueError(f"{path} is already quantized ({packed[0].name} is "
                             f"{packed[0].tensor_type.name}); load it without quantization="
                             f"{quantization!r}, or quantize a float checkpoint")
    config = config_from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    family = config.family
    weight_map = hf_weight_map(config)
    shapes: dict[str, tuple[int, ...]] = {}  # llama.cpp name -> torch shape
    for parts in weight_map.values():
        for hf_name, shape in parts:
            name, expert = gguf_tensor_part(family, hf_name)
            shapes[name] = shape if expert is None else (config.num_experts, *shape)
    _check_tensors(path, config, tensors, shapes)
    _check_fused_experts(path, family, tensors, weight_map)
    shard = ShardLayout.of(config, tensor_parallel)
    if tensor_parallel is not None:
        for name, parts in weight_map.items():
            for (hf_name, _), part in zip(parts, shard.slices(name, parts) or []):
                _check_split(path, tensors[gguf_tensor_name(family, hf_name)], part,
                             tensor_parallel.size)
    permuted = family.gguf.permuted_qk

    def read(hf_name: str, shape: tuple[int, ...],
             part: TensorSlice | None) -> Tensor | QuantizedWeight:
        name, expert = gguf_tensor_part(family, hf_name)
        tensor = tensors[name]
        kept = int(tensor.tensor_type) in ops.BLOCK_FORMATS and len(shape) == 2
        if expert is not None:  # its [rows, cols] of the stacked [experts, rows, cols]
            encoded = tensor.data[expert]  # (tensor parallelism splits no experts)
        else:
            encoded = tensor.data if part is None else _encoded_part(tensor, part)
        # Kept blocks and 16-bit values (build_model keeps 16 bits or converts them once) stay
        # views of the mapped file; only a column part (tensor parallelism) is copied, to be
        # contiguous. BF16 arrives as bytes: as uint16, whole values for the unpermuting.
        sixteen_bit = tensor.tensor_type in _SIXTEEN_BIT
        values = (np.ascontiguousarray(encoded) if kept or sixteen_bit
                  else _dequantize(path, tensor, encoded))
        if sixteen_bit and values.dtype == np.uint8:
            values = values.view(np.uint16)
        module = hf_name.rsplit(".", 2)[-2]  # q_proj, k_proj, ...
        if permuted and module in ("q_proj", "k_proj"):
            # Per head, so a rank's whole heads unpermute alone.
            values = _unpermute_rope_rows(values, values.shape[0] // config.head_dim)
        if kept:  # [rows, row bytes]
            return QuantizedWeight(torch.from_numpy(values).reshape(values.shape[0], -1),
                                   int(tensor.tensor_type))
        if sixteen_bit:
            return torch.from_numpy(values).view(_SIXTEEN_BIT[tensor.tensor_type])
        return torch.from_numpy(values)

    # The converter stored Gemma's norms as 1 + w, already folded.
    return build_model(config, read, dtype=dtype, device=device, quantization=quantization,
                       tensor_parallel=tensor_parallel, norms_folded=True)


def _check_fused_experts(path: Path, family: Family, tensors: dict[str, ReaderTensor],
                         weight_map: dict[str, list[HFTensor]]) -> None:
    """Refuses experts whose gate and up weights (fused into one ``gate_up_proj``, run as one
    projection of one format) are in different types, one of them a block format: their
    blocks cannot be kept, and dequantizing a model's experts would take several times its
    memory."""
    for parts in weight_map.values():
        located = [gguf_tensor_part(family, hf_name) for hf_name, _ in parts]
        stacked = list(dict.fromkeys(name for name, expert in located if expert is not None))
        types = [tensors[name].tensor_type for name in stacked]
        if len(set(types)) > 1 and any(int(t) in ops.BLOCK_FORMATS for t in types):
            raise ValueError(f"{path}: tensor {stacked[0]} is {types[0].name} but {stacked[1]} is "
                             f"{types[1].name}; fastllm runs each expert's gate and up as one "
                             "projection, so they must share one type")


def _check_split(path: Path, tensor: ReaderTensor, part: TensorSlice | None, size: int) -> None:
    """Refuses a split of ``tensor``'s rows (``part`` along dim 1) that cuts its blocks."""
    if part is None or part.dim != 1:
        return
    block_values = GGML_QUANT_SIZES[tensor.tensor_type][0]
    if part.start % block_values or part.stop % block_values:
        raise ValueError(f"{path}: tensor parallelism over {size} ranks splits the rows of "
                         f"{tensor.name} ({int(tensor.shape[0])} values, in "
                         f"{tensor.tensor_type.name} blocks of {block_values}) into parts of "
                         f"{part.stop - part.start} values, not whole blocks")


def _encoded_part(tensor: ReaderTensor, part: TensorSlice) -> np.ndarray:
    """``part`` of ``tensor``, still encoded: a view of the memory-mapped file (rows, or a
    column range of whole blocks; 16-bit and float32 values are their own blocks)."""
    data = tensor.data
    if part.dim == 0:
        return data[part.start:part.stop]
    if data.dtype != np.uint8:  # F32, F16: values
        return data[:, part.start:part.stop]
    block_values, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]  # BF16 and blocks: bytes
    return data[:, part.start // block_values * block_bytes:part.stop // block_values * block_bytes]


def _check_tensors(path: Path, config: ModelConfig, tensors: dict[str, ReaderTensor],
                   shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuses the file unless it holds exactly the tensors ``config`` needs (``shapes``: name
    -> torch shape; ``rope_freqs.weight`` may come too), each of that shape and of a type
    fastllm reads. Runs before any tensor is read."""
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise ValueError(f"{path}: the GGUF file lacks {missing[0]} ({len(missing)} missing "
                         f"tensor(s) for a {config.architecture})")
    unexpected = sorted(set(tensors) - set(shapes) - {_ROPE_FREQS})
    if unexpected:
        raise ValueError(f"{path}: unexpected tensor {unexpected[0]} in the GGUF file "
                         f"({len(unexpected)} unexpected for a {config.architecture})")
    for name, shape in shapes.items():
        tensor = tensors[name]
        _check_type(path, tensor)
        ggml_shape = [int(n) for n in tensor.shape]
        torch_shape = tuple(reversed(ggml_shape))  # ggml lists the innermost dimension first
        if torch_shape != shape:
            raise ValueError(f"{path}: tensor {name} has shape {torch_shape} (ggml {ggml_shape}), "
                             f"expected {shape} from the metadata")


def _check_type(path: Path, tensor: ReaderTensor) -> None:
    if tensor.tensor_type not in GGUF_TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, which "
                         f"fastllm does not dequantize; supported: "
                         f"{', '.join(t.name for t in GGUF_TENSOR_TYPES)}")


def _field(reader: GGUFReader, key: str) -> Any:
    """Metadata value ``key`` as a Python value, None when absent.

    GGUF floats are float32; the shortest decimal that rounds to one is taken, which recovers
    the value the HF config held (1e-05, not 9.999999747378752e-06).
    """
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except UnicodeDecodeError as error:
        raise ValueError(f"{reader.data.filename}: metadata {key} is not UTF-8 text: "
                         f"{error}") from error
    if field.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def _dequantize(path: Path, tensor: ReaderTensor, encoded: np.ndarray | None = None
                ) -> np.ndarray:
    """A fresh, writable float32 array of ``tensor`` (torch order), or of its ``encoded`` part,
    whatever its GGUF type."""
    _check_type(path, tensor)
    # np.array copies: F32 dequantizes to a read-only view of the memory-mapped file.
    return np.array(dequantize(tensor.data if encoded is None else encoded, tensor.tensor_type),
                    dtype=np.float32)


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's ``LlamaModel.permute``: per head, rows in llama.cpp's
    interleaved pair order (0, d/2, 1, d/2 + 1, ...) go back to HF's half-split order.

    ``w`` is a q/k weight ``[n_heads * head_dim, hidden]`` or bias ``[n_heads * head_dim]``.
    """
    # [n_heads, head_dim / 2, 2, ...] -> [n_heads, 2, head_dim / 2, ...]; reshape copies
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_llama3_divisors(path: Path, config: ModelConfig, rope_divisors: np.ndarray) -> None:
    """Refuses a ``rope_freqs.weight`` that the llama3 scaling read from it does not reproduce
    (llama.cpp divides each RoPE frequency by its entry)."""
    base = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))  # float64 [d / 2]
    if (rope_divisors.shape != tuple(base.shape) or not torch.allclose(
            rope_inv_freq(config), base / torch.from_numpy(rope_divisors), rtol=1e-5, atol=0)):
        raise ValueError(f"{path}: {_ROPE_FREQS} holds per-frequency RoPE divisors that Llama "
                         f"3's llama3 scaling (factor {config.rope_scaling.factor}, "
                         f"{_LLAMA3_ROPE}) does not reproduce; fastllm supports no other scaling "
                         "given this way")
