"""The fastllm ops: typed, documented wrappers of ``torch.ops.fastllm.*``.

Every op is declared once in C++ (``csrc/ops.cpp``) and implemented per device (a native CPU
kernel; an ATen composite for MPS, which ``torch.ops.fastllm_composite.*`` runs on any device).
Input checks live in C++, in one place shared by every
device, so the wrappers, direct ``torch.ops.fastllm`` callers and ``torch.compile`` graphs all get
the same ``ValueError``/``TypeError`` naming the offending value. Each op has a fake kernel beside
its wrapper for ``torch.compile(fullgraph=True)`` and a plain-PyTorch twin in
:mod:`fastllm.ops.reference`. The wrappers live in one module per kernel family of ``csrc/``
(``attention_ops``, ``linear_ops``, ``lora_ops``, ``quantized_ops`` with the ggml block formats
and the CPU's weight layout, ``rotary_ops``, ``sampling_ops``, ``norm_ops``, ``activation_ops``,
``moe_ops``); :func:`trusted_inputs` and :func:`batch_invariant` (:mod:`fastllm.ops.thread_flags`)
set the ops' per-thread modes. This package re-exports them all.

:class:`DecoderLayers` (:mod:`fastllm.ops.decoder_layers`) runs whole decoder layers of these
ops from C++, one Python call a step; :func:`all_reduce` and :func:`all_gather`
(:mod:`fastllm.ops.collectives`) join a tensor-parallel model's shards.
"""

from __future__ import annotations

from fastllm.ops.activation_ops import gelu_tanh_and_mul, silu_and_mul
from fastllm.ops.attention_ops import attention, paged_attention, reshape_and_cache
from fastllm.ops.collectives import all_gather, all_reduce
from fastllm.ops.decoder_layers import (DecoderLayer, DecoderLayers, DecoderStep, Experts,
                                       ProjectionLoRA, ProjectionPart)
from fastllm.ops.linear_ops import linear
from fastllm.ops.lora_ops import add_lora
from fastllm.ops.moe_ops import moe
from fastllm.ops.norm_ops import add_rms_norm, rms_norm
from fastllm.ops.quantized_ops import (BLOCK_FORMATS, FP8_E4M3, INTERLEAVED_Q4_0,
                                       INTERLEAVED_Q4_1, INTERLEAVED_Q4_K, INTERLEAVED_Q5_0,
                                       INTERLEAVED_Q6_K, INTERLEAVED_Q8_0, INTERLEAVED_TYPES,
                                       block_format, cpu_decode_layout, dequantize,
                                       quantized_linear, quantized_rows)
from fastllm.ops.rotary_ops import rope_cos_sin_cache, rotary_and_cache, rotary_embedding
from fastllm.ops.sampling_ops import apply_penalties, sample, sample_with_logprobs
from fastllm.ops.thread_flags import batch_invariant, trusted_inputs

__all__ = ["BLOCK_FORMATS", "DecoderLayer", "DecoderLayers", "DecoderStep", "Experts",
           "FP8_E4M3", "INTERLEAVED_Q4_0", "INTERLEAVED_Q4_1", "INTERLEAVED_Q4_K",
           "INTERLEAVED_Q5_0", "INTERLEAVED_Q6_K", "INTERLEAVED_Q8_0", "INTERLEAVED_TYPES",
           "ProjectionLoRA",
           "ProjectionPart",
           "add_lora", "add_rms_norm", "all_gather", "all_reduce", "apply_penalties", "attention",
           "batch_invariant", "block_format", "cpu_decode_layout", "dequantize",
           "gelu_tanh_and_mul", "linear", "moe", "paged_attention", "quantized_linear",
           "quantized_rows", "reshape_and_cache", "rms_norm", "rope_cos_sin_cache",
           "rotary_and_cache", "rotary_embedding", "sample", "sample_with_logprobs", "silu_and_mul",
           "trusted_inputs"]
