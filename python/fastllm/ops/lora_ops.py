"""Batched LoRA (``csrc/lora``): :func:`add_lora` adds each token's adapter, picked by its slot,
to a projection's output (Punica's BGMV / SGMV, as vLLM serves many adapters in one batch)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["add_lora"]


def add_lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> None:
    """Adds each token's LoRA to a projection's output, in place:
    ``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` for every token ``t`` whose slot
    ``s = token_slots[t]`` is not -1; the rows of tokens of slot -1 are left as they are.

    Args:
        y: ``[tokens, out_features]``, x's dtype, unit stride in its last dim (a column slice of
            a fused projection's output will do), sharing no memory with the other arguments:
            the projection's output, updated in place.
        x: ``[tokens, in_features]``, float32 / bfloat16 / float16: the projection's input.
        lora_a: ``[slots, rank, in_features]``, x's dtype: each slot's A; ``slots >= 1`` and
            ``1 <= rank <= 1024``.
        lora_b: ``[slots, out_features, rank]``, x's dtype: each slot's B (its scaling folded
            in).
        token_slots: int32 ``[tokens]``: each token's adapter slot, or -1 for none. A value
            outside ``[-1, slots)`` is a ``ValueError`` and y is left unchanged; inside
            :func:`fastllm.ops.trusted_inputs` a GPU (or the ATen composition) does not check,
            and skips such tokens.

    The shrink ``lora_a[s] @ x[t]`` is summed in float32 and rounded to x's dtype (as peft's
    ``lora_B(lora_A(x))`` rounds it in the layer's dtype); the expand is summed in float32 and
    added into y with one rounding. On the CPU a token's result does not depend on the other
    tokens of the call.
    """
    torch.ops.fastllm.add_lora.default(y, x, lora_a, lora_b, token_slots)


@fake_kernel("add_lora")
def _add_lora_fake(y, x, lora_a, lora_b, token_slots):
    check_one_device(x=x, y=y, lora_a=lora_a, lora_b=lora_b, token_slots=token_slots)
