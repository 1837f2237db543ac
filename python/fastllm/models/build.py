"""One owner of how a checkpoint becomes a :class:`~fastllm.models.decoder.DecoderLM`: the HF
name -> fastllm name map (which also fuses q/k/v and gate/up) and :func:`build_model`, which
builds the model (or one tensor-parallel rank's shard of it) on the meta device and
materializes it once. Both loaders use it: safetensors (:mod:`fastllm.models.loader`) and GGUF
(:mod:`fastllm.models.gguf`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor, nn

from fastllm import _C, ops
from fastllm.models.config import ModelConfig
from fastllm.models.decoder import DecoderLM
from fastllm.models.quantized import (QuantizedEmbedding, QuantizedLinear, QuantizedWeight,
                                      Quantization, SegmentedQuantizedLinear, check_quantization,
                                      quantize_weight)
from fastllm.models.tensor_parallel import ShardLayout, TensorParallel, TensorSlice

__all__ = ["HFTensor", "TensorReader", "build_model", "fused_rows", "hf_weight_map"]

# One HF tensor: its checkpoint name and the shape it must have.
HFTensor = tuple[str, tuple[int, ...]]
# read(hf_name, shape, part): the checkpoint's tensor hf_name (checked to have shape), or only
# the part of it a tensor-parallel rank holds, as floats or blocks.
TensorReader = Callable[[str, tuple[int, ...], TensorSlice | None], Tensor | QuantizedWeight]


def hf_weight_map(config: ModelConfig) -> dict[str, list[HFTensor]]:
    """fastllm parameter name -> the HF tensors it is made of, concatenated along dim 0 (an
    expert weight's parts, expert by expert, then viewed as ``[experts, rows, cols]``), as the
    family's record (:mod:`fastllm.models.families`) names them."""
    family = config.family
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.n_heads * d, config.n_kv_heads * d
    names: dict[str, list[HFTensor]] = {
        "embed_tokens.weight": [("model.embed_tokens.weight", (config.vocab_size, h))],
        "norm.weight": [("model.norm.weight", (h,))],
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = [("lm_head.weight", (config.vocab_size, h))]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        for role, hf_name in family.norm_names.items():
            names[f"{dst}{role}.weight"] = [(f"{src}{hf_name}.weight", (h,))]
        for kind, parts in (("weight", ((q, h), (kv, h), (kv, h))),
                            ("bias", ((q,), (kv,), (kv,)))):
            if kind == "bias" and not config.qkv_bias:
                continue
            if family.fused_checkpoint:
                names[f"{dst}self_attn.qkv_proj.{kind}"] = [
                    (f"{attn}qkv_proj.{kind}", (q + 2 * kv, *parts[0][1:]))]
            else:
                names[f"{dst}self_attn.qkv_proj.{kind}"] = [
                    (f"{attn}{proj}.{kind}", shape)
                    for proj, shape in zip(("q_proj", "k_proj", "v_proj"), parts)]
        if family.qk_norm is not None:
            per_head = family.qk_norm == "head"
            names[dst + "self_attn.q_norm.weight"] = [(attn + "q_norm.weight", (d if per_head
                                                                                else q,))]
            names[dst + "self_attn.k_norm.weight"] = [(attn + "k_norm.weight", (d if per_head
                                                                                else kv,))]
        names[dst + "self_attn.o_proj.weight"] = [(attn + "o_proj.weight", (h, q))]
        if config.o_bias:
            names[dst + "self_attn.o_proj.bias"] = [(attn + "o_proj.bias", (h,))]
        if config.moe_layers[i]:
            moe, experts = family.moe, range(config.num_experts)
            expert_inter = config.moe_intermediate_size
            names[dst + "mlp.router.weight"] = [(f"{src}{moe.router}.weight",
                                                 (config.num_experts, h))]
            names[dst + "mlp.gate_up_proj"] = [
                (f"{src}{name.format(e=e)}.weight", (expert_inter, h))
                for e in experts for name in (moe.gate, moe.up)]
            names[dst + "mlp.down_proj"] = [(f"{src}{moe.down.format(e=e)}.weight",
                                             (h, expert_inter)) for e in experts]
            continue
        if family.fused_checkpoint:
            names[dst + "mlp.gate_up_proj.weight"] = [(mlp + "gate_up_proj.weight",
                                                       (2 * inter, h))]
        else:
            names[dst + "mlp.gate_up_proj.weight"] = [
                (mlp + "gate_proj.weight", (inter, h)), (mlp + "up_proj.weight", (inter, h))]
        names[dst + "mlp.down_proj.weight"] = [(mlp + "down_proj.weight", (h, inter))]
        if config.mlp_bias:
            names[dst + "mlp.gate_up_proj.bias"] = [
                (mlp + "gate_proj.bias", (inter,)), (mlp + "up_proj.bias", (inter,))]
            names[dst + "mlp.down_proj.bias"] = [(mlp + "down_proj.bias", (h,))]
    return names


def fused_rows(config: ModelConfig, name: str) -> list[int] | None:
    """The rows of each sub-module (q, k, v; or gate, up) of fastllm parameter ``name`` when
    the checkpoint stores it as one tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``); None for
    any other."""
    if not config.family.fused_checkpoint:
        return None
    module = name.rsplit(".", 2)[-2]
    if module == "qkv_proj":
        kv = config.n_kv_heads * config.head_dim
        return [config.n_heads * config.head_dim, kv, kv]
    if module == "gate_up_proj":
        return [config.intermediate_size] * 2
    return None


def build_model(config: ModelConfig, read: TensorReader, *, dtype: torch.dtype,
                device: torch.device | str, quantization: str | None = None,
                tensor_parallel: TensorParallel | None = None,
                norms_folded: bool = False) -> DecoderLM:
    """Builds a :class:`DecoderLM` on the meta device and materializes it once.

    ``read(hf_name, shape, part)`` returns the checkpoint's tensor ``hf_name``, already checked
    to have ``shape``, as floats or as a :class:`QuantizedWeight`: all of it for ``part`` None,
    else its indices ``[part.start, part.stop)`` along ``part.dim``. The parts of each fused
    parameter are concatenated in :func:`hf_weight_map`'s order. A weight whose parts are all
    blocks stays quantized: its layer becomes a :class:`QuantizedLinear` or
    :class:`QuantizedEmbedding`, or, when its parts are in different formats (a Q4_K_M file's
    Q6_K ``attn_v`` beside Q4_K q and k), a :class:`SegmentedQuantizedLinear`. The experts'
    stacked weights stay in their blocks (uint8 ``[experts, rows, row bytes]``, with the
    :class:`~fastllm.models.decoder.Experts` module's ``gate_up_type`` / ``down_type``) when
    all their parts share one format (a ggml format, or :data:`fastllm.ops.FP8_E4M3`). The
    others are cast to ``dtype``. Everything is placed on
    ``device``; there a projection's or LM head's blocks (a tied embedding's too) take
    :func:`fastllm.ops.cpu_decode_layout`'s order (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K
    interleaved by 16 rows on AVX-512; Q4_0, Q4_1, Q5_0 and Q8_0 on AVX2). On the CPU, float32
    models keep 16-bit projection, embedding and LM-head weights (a float16 GGUF, a bfloat16
    checkpoint) in 16 bits: the linear op converts them exactly as it reads them, so the sums
    are the upcast weights' from half the bytes. On the CPU the blocks written at load
    (interleaved, joined or quantized) are moved into one arena of transparent huge pages.

    ``quantization`` ("int8", "int4"; see :data:`~fastllm.models.quantized.QUANTIZATIONS`)
    quantizes the float weights of every projection (the experts' too, but not their router),
    the embedding and the LM head at load, weight-only in blocks of 32 per row: int8 writes
    Q8_0 everywhere; int4 writes Q4_1, but Q8_0 for the LM head (the embedding when tied), as
    llama.cpp's 4-bit files keep it at higher precision. A weight whose rows are not a multiple
    of 32 values long stays float, as do the norms and biases.

    With ``tensor_parallel`` the model is that rank's shard
    (:class:`~fastllm.models.tensor_parallel.ShardLayout`): only its parts are read, and its
    vocabulary rows past the end padded with zeros. A model whose heads or MLP features do not
    divide among the ranks is a ValueError naming the numbers.

    A family whose norms scale by ``norm_offset + w`` (Gemma) has the offset added to its norm
    weights here, in float32 as HF computes it, unless ``norms_folded`` says the checkpoint
    already holds ``norm_offset + w`` (llama.cpp's converter adds it), which is then kept as is.
    """
    scheme = check_quantization(quantization)
    shard = ShardLayout.of(config, tensor_parallel)
    state: dict[str, Tensor] = {}
    quantized: dict[str, int] = {}  # parameter name -> ggml type of its blocks
    segmented: dict[str, list[tuple[Tensor, int]]] = {}  # parameter name -> its format runs
    made_blocks: list[str] = []  # state names of blocks written at load (not a file's pages)
    for name, parts in hf_weight_map(config).items():
        slices = shard.slices(name, parts)
        if slices is None:  # not held by this rank
            continue
        if len(slices) > len(parts):  # one fused tensor (Phi-3), cut sub-module by sub-module
            (hf_name, shape), = parts
            starts = itertools.accumulate(fused_rows(config, name), initial=0)
            tensors = [read(hf_name, shape, TensorSlice(0, start + cut.start, start + cut.stop))
                       for start, cut in zip(starts, slices)]
        else:
            tensors = [read(hf_name, shape, part) for (hf_name, shape), part in zip(parts, slices)]
        if _VOCABULARY.search(name):
            tensors = [_pad_rows(t, shard.vocab_rows) for t in tensors]
        if (_EXPERTS.search(name) and all(isinstance(t, QuantizedWeight) for t in tensors)
                and len({t.weight_type for t in tensors}) == 1):
            blocks = torch.cat([t.data for t in tensors])  # [experts * rows, row bytes]
            state[name] = blocks.view(config.num_experts, -1, blocks.shape[-1]).to(device)
            quantized[name] = tensors[0].weight_type
            made_blocks.append(name)
            continue
        if all(isinstance(t, QuantizedWeight) for t in tensors) and _QUANTIZABLE.search(name):
            runs = [_decode_layout(name, data, weight_type, config)
                    for data, weight_type in _format_runs(tensors, device)]
            if len(runs) == 1:
                state[name], quantized[name] = runs[0]
                names = [name]
            else:  # parts in different formats: each run of rows stays in its own
                segmented[name] = runs
                module = name.rsplit(".", 1)[0]
                names = [f"{module}.segment{i}" for i in range(len(runs))]
                state.update(zip(names, (data for data, _ in runs)))
            as_read = {id(t.data) for t in tensors}
            made_blocks += [n for n in names if id(state[n]) not in as_read]
            continue
        tensors = [ops.dequantize(t.data, t.weight_type, torch.float32)
                   if isinstance(t, QuantizedWeight) else t for t in tensors]
        fused = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        if _EXPERTS.search(name):  # [experts * rows, cols] -> [experts, rows, cols]
            fused = fused.view(config.num_experts, -1, fused.shape[-1])
        if config.family.norm_offset and not norms_folded and _NORM.search(name):
            # Gemma scales by (1 + w): folded in float32, as HF computes it.
            fused = fused.float() + config.family.norm_offset
        weight_type = None if scheme is None else _quantized_type(name, scheme, config)
        if weight_type is not None and fused.shape[-1] % _block_values(weight_type) == 0:
            try:  # experts' rows quantized as one [experts * rows, cols] matrix
                weight = quantize_weight(fused.reshape(-1, fused.shape[-1]), weight_type)
            except ValueError as error:
                raise ValueError(f"cannot quantize {name} ({quantization}): {error}") from error
            data = weight.data.view(*fused.shape[:-1], -1).to(device)
            if not _EXPERTS.search(name):
                data, weight_type = _decode_layout(name, data, weight.weight_type, config)
            state[name], quantized[name] = data, weight_type
            if not (_EMBEDDING.search(name) and not config.tie_word_embeddings):
                made_blocks.append(name)  # an untied embedding's rows are looked up, not streamed
            continue
        stored = _storage_dtype(name, fused.dtype, dtype, torch.device(device))
        state[name] = _cast(fused, stored, device)
    if torch.device(device).type == "cpu":
        _move_to_huge_pages(state, made_blocks)

    with torch.device("meta"):
        model = DecoderLM(config, tensor_parallel)
        for name, weight_type in quantized.items():
            if _EXPERTS.search(name):
                _quantize_experts(model, name, state[name], weight_type)
            else:
                _quantize_module(model, name, state[name], weight_type, dtype)
        for name, runs in segmented.items():
            _segment_module(model, name, runs)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_rope_cache()
    return model.eval()


# The weights that may be (or stay) quantized: every projection, the embedding and the LM head.
_QUANTIZABLE = re.compile(r"(_proj|embed_tokens|lm_head)\.weight$")
# The experts' stacked weights, [experts, rows, cols].
_EXPERTS = re.compile(r"\.mlp\.(gate_up|down)_proj$")
# RMSNorm weights: the layers' and the final norm, q/k norms.
_NORM = re.compile(r"norm\.weight$")
# The embedding table (also the LM head when tied).
_EMBEDDING = re.compile(r"^embed_tokens\.weight$")
# The weights whose rows are the vocabulary, split among tensor-parallel ranks.
_VOCABULARY = re.compile(r"^(embed_tokens|lm_head)\.weight$")


# Where each weight starts in the arena: a cache line, so no two share one.
_ARENA_ALIGNMENT = 64


def _move_to_huge_pages(state: dict[str, Tensor], names: list[str]) -> None:
    """Replaces the CPU weight blocks ``names``, written at load (repacked into the decode
    layout, joined, or quantized), with contiguous copies in one arena of transparent huge
    pages: a decode step streams them all, and with 4 KiB pages it misses the TLB every 4 KiB.
    Blocks still in a mapped file's pages stay there (a copy would cost the load a pass and the
    memory a second copy). Each original is dropped once copied, so the copies add at most one
    tensor to the memory the weights take."""
    sizes = [state[name].numel() * state[name].element_size() for name in names]
    starts = list(itertools.accumulate(
        (-(-nbytes // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT for nbytes in sizes), initial=0))
    if starts[-1] == 0:
        return
    arena = _C.zeros_huge_pages([starts[-1]], torch.uint8)
    for name, start, nbytes in zip(names, starts, sizes):
        tensor = state[name]
        state[name] = arena[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
        state[name].copy_(tensor)


def _pad_rows(weight: Tensor | QuantizedWeight, rows: int) -> Tensor | QuantizedWeight:
    """``weight`` with zero rows appended up to ``rows`` (all-zero blocks decode to zeros in
    every ggml format: their scales are 0)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(_pad_rows(weight.data, rows), weight.weight_type)
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _storage_dtype(name: str, stored: torch.dtype, dtype: torch.dtype,
                   device: torch.device) -> torch.dtype:
    """The dtype parameter ``name`` is kept in: 16-bit weights of a float32 model on the CPU
    stay 16-bit (ops.linear reads them so); everything else is cast to ``dtype``."""
    keep = (device.type == "cpu" and dtype == torch.float32
            and stored in (torch.float16, torch.bfloat16) and _QUANTIZABLE.search(name))
    return stored if keep else dtype


# Elements a step of a cast between float16 and bfloat16: ATen casts between the two an element
# at a time but to and from float32 a vector at a time, so the cast goes through float32 in
# chunks that stay in L2.
_CAST_CHUNK = 1 << 18
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _cast(weight: Tensor, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``weight.to(device=device, dtype=dtype)``: between float16 and bfloat16 on the CPU,
    through float32 a chunk at a time (the same values)."""
    if not (torch.device(device).type == weight.device.type == "cpu"
            and {weight.dtype, dtype} == set(_SIXTEEN_BIT)):
        return weight.to(device=device, dtype=dtype)
    cast = torch.empty(weight.shape, dtype=dtype)
    source, target = weight.reshape(-1), cast.view(-1)
    for start in range(0, source.numel(), _CAST_CHUNK):
        target[start:start + _CAST_CHUNK] = source[start:start + _CAST_CHUNK].float()
    return cast


def _quantized_type(name: str, scheme: Quantization, config: ModelConfig) -> int | None:
    """The ggml type ``scheme`` writes parameter ``name`` in; None: it stays float."""
    if not (_QUANTIZABLE.search(name) or _EXPERTS.search(name)):
        return None
    is_head = name == "lm_head.weight" or (name == "embed_tokens.weight"
                                           and config.tie_word_embeddings)
    return scheme.head if is_head else scheme.projections


def _block_values(weight_type: int) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType(weight_type)][0]


def _decode_layout(name: str, data: Tensor, weight_type: int,
                   config: ModelConfig) -> tuple[Tensor, int]:
    """Parameter ``name``'s blocks in :func:`fastllm.ops.cpu_decode_layout`'s order, but for an
    embedding table that is not also the LM head: it keeps the file's blocks (mapped, where the
    file is), as only its looked-up rows are read."""
    if _EMBEDDING.search(name) and not config.tie_word_embeddings:
        return data, weight_type
    return ops.cpu_decode_layout(data, weight_type)


def _format_runs(parts: list[QuantizedWeight],
                 device: torch.device | str) -> list[tuple[Tensor, int]]:
    """Consecutive parts of one format concatenated: ``(blocks, ggml type)`` per run."""
    runs: list[tuple[list[Tensor], int]] = []
    for part in parts:
        if runs and runs[-1][1] == part.weight_type:
            runs[-1][0].append(part.data)
        else:
            runs.append(([part.data], part.weight_type))
    # A run of one part is taken as it is: a copy would cost a pass over its bytes.
    return [(data[0].to(device) if len(data) == 1 else torch.cat(data).to(device), weight_type)
            for data, weight_type in runs]


def _segment_module(model: DecoderLM, name: str, runs: list[tuple[Tensor, int]]) -> None:
    """Swaps the float linear owning ``name`` for a :class:`SegmentedQuantizedLinear` of
    ``runs`` (on the meta device, as :func:`_quantize_module`)."""
    parent_path, _, attr = name.rsplit(".", 1)[0].rpartition(".")
    parent = model.get_submodule(parent_path)
    module = getattr(parent, attr)
    bias = None if module.bias is None else torch.empty_like(module.bias)
    placeholders = [(torch.empty(data.shape, dtype=torch.uint8), weight_type)
                    for data, weight_type in runs]
    setattr(parent, attr, SegmentedQuantizedLinear(placeholders, bias))


def _quantize_module(model: DecoderLM, name: str, weight: Tensor, weight_type: int,
                     dtype: torch.dtype) -> None:
    """Swaps the float module owning ``name`` for its quantized kind (on the meta device; the
    state dict's tensors are assigned after)."""
    path, _ = name.rsplit(".", 1)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    module = getattr(parent, attr)
    placeholder = torch.empty(weight.shape, dtype=torch.uint8)
    if isinstance(module, nn.Embedding):
        setattr(parent, attr, QuantizedEmbedding(placeholder, weight_type, dtype))
    else:
        bias = None if module.bias is None else torch.empty_like(module.bias)
        setattr(parent, attr, QuantizedLinear(placeholder, weight_type, bias))


def _quantize_experts(model: DecoderLM, name: str, weight: Tensor, weight_type: int) -> None:
    """Makes the experts' float parameter ``name`` (``mlp.gate_up_proj`` or ``mlp.down_proj``) a
    placeholder for ``weight``'s blocks (uint8 ``[experts, rows, row bytes]``, on the meta
    device, as :func:`_quantize_module`) and sets their type (``gate_up_type``, ``down_type``)."""
    path, attr = name.rsplit(".", 1)
    experts = model.get_submodule(path)
    placeholder = torch.empty(weight.shape, dtype=torch.uint8)
    setattr(experts, attr, nn.Parameter(placeholder, requires_grad=False))
    setattr(experts, attr.removesuffix("_proj") + "_type", weight_type)
