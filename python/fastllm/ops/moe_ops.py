"""The mixture-of-experts MLP block, :func:`moe` (``csrc/moe``)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["moe"]


def moe(
    x: Tensor,
    router_logits: Tensor,
    gate_up: Tensor,
    down: Tensor,
    top_k: int,
    renormalize: bool,
    *,
    gate_up_type: int | None = None,
    down_type: int | None = None,
) -> Tensor:
    """A mixture-of-experts MLP block (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, Mixtral's
    ``MixtralSparseMoeBlock``) after its router's linear layer, with HF's eager arithmetic.

    Each token's routing weights are ``softmax(router_logits)`` in float32; it goes to the
    ``top_k`` most likely experts (as ``torch.topk`` picks them, ties included, on the CPU and
    in the composite; on CUDA a tie goes to the lower expert id), whose weights are divided by
    their sum if ``renormalize`` (Qwen3's ``norm_topk_prob``; Mixtral always), then rounded to
    x's dtype. Expert ``e`` computes ``down[e] @ (silu(gate) * up)`` with
    ``gate | up = gate_up[e] @ x[t]``, in x's dtype with the eager roundings (each linear's
    output, silu, the product); each token's expert outputs times their weights are added in
    increasing expert order, each product and sum rounded to x's dtype (HF's ``index_add_``).
    Mixtral's block multiplies by the float32 weight instead (one rounding less under
    bfloat16 / float16; the same in float32).

    Args:
        x: ``[tokens, hidden]``, float32, bfloat16 or float16.
        router_logits: ``[tokens, num_experts]`` float32 / bfloat16 / float16: the router's
            linear output, computed by the caller.
        gate_up: every expert's gate rows then up rows, ``[num_experts, 2 * intermediate,
            hidden]`` in x's dtype (or bfloat16 / float16 under float32 x: converted exactly
            as :func:`linear` converts them), rows contiguous; or, with ``gate_up_type``,
            blocks uint8 ``[num_experts, 2 * intermediate, row bytes]`` as
            :func:`quantized_linear` takes a weight (:data:`BLOCK_FORMATS`, or fastllm's FP8
            blocks :data:`FP8_E4M3`).
        down: ``[num_experts, hidden, intermediate]``, or blocks with ``down_type``; its format
            may differ from gate_up's.
        top_k: experts per token, in ``[1, num_experts]``.
        renormalize: divide the chosen experts' probabilities by their sum.
        gate_up_type, down_type: ggml type ids or :data:`FP8_E4M3` of quantized experts, None
            for float ones.

    Returns ``[tokens, hidden]`` in x's dtype. On the CPU the (token, expert) pairs are
    grouped by expert; an expert with few rows (every expert of a decode step: up to the
    few-row limits of :func:`linear` and :func:`quantized_linear`) streams only its own weight
    rows, once, and all of them share one parallel region; an expert with more rows runs a
    GEMM over its rows. FP8 experts run as :func:`quantized_linear` runs FP8 weights (float32
    activations; streamed codes decoded in registers). Under :func:`batch_invariant` a token's
    result does not depend on the others. On CUDA up to 8 tokens (or while a CUDA graph is
    captured) a GEMV per (token, expert) reads the chosen experts' rows without any host sync;
    more tokens wait once for the per-expert counts and run one cuBLAS GEMM (quantized:
    :func:`quantized_linear`'s path) per expert that has tokens.
    """
    return torch.ops.fastllm.moe.default(
        x, router_logits, gate_up, down, int(top_k), bool(renormalize),
        gate_up_type=None if gate_up_type is None else int(gate_up_type),
        down_type=None if down_type is None else int(down_type))


@fake_kernel("moe")
def _moe_fake(x, router_logits, gate_up, down, top_k, renormalize, *, gate_up_type=None,
              down_type=None):
    check_one_device(x=x, router_logits=router_logits, gate_up=gate_up, down=down)
    return x.new_empty(x.shape)
