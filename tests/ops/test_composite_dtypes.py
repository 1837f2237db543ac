"""The ATen compositions use only dtypes MPS has: MPS runs them, and it has no float64 and no
complex dtypes.

Every op of ``torch.ops.fastllm_composite`` runs here on the CPU under a dispatch mode that fails
on any tensor of such a dtype that one of the composition's ATen ops receives or produces, so the
MPS path is checked without a Mac."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastllm import ops


def check_dtypes(func, what: str, tensors) -> None:
    lacking = sorted({str(t.dtype) for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)
                      and (t.dtype == torch.float64 or t.is_complex())})
    assert not lacking, f"{func} {what} {', '.join(lacking)}, which MPS lacks"


class MpsDtypesOnly(TorchDispatchMode):
    """Fails on a float64 or complex tensor in or out of any ATen op; records the ops seen."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fastllm_composite":
            # A mode is off while it handles an op: run the composition's CPU kernel with the
            # mode back on, so that its ATen ops come here too.
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args,
                                       **kwargs)
        self.seen.append(func)
        check_dtypes(func, "receives", (args, kwargs))
        out = func(*args, **kwargs)
        check_dtypes(func, "produces", out)
        return out


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def sampling_args(dtype):
    """Rows covering every filter: plain, greedy, top-k, top-p (with a tie), min-p, all four."""
    logits = (torch.randn(6, 50) * 2).to(dtype)
    logits[3, [4, 9]] = logits[3].max()
    logits[:, 7] = -math.inf
    return (logits, torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.8]), i32(0, 3, 5, 0, 0, 10),
            torch.tensor([1.0, 1.0, 1.0, 0.6, 1.0, 0.9]),
            torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.05]), torch.arange(6) * 7919,
            torch.arange(6))


def attention_args(dtype):
    q = torch.randn(8, 4, 16, dtype=dtype)
    k, v = torch.randn(9, 2, 16, dtype=dtype), torch.randn(9, 2, 16, dtype=dtype)
    return q, k, v, i32(0, 1, 8), i32(0, 5, 9), 7, 5


def paged_args(dtype):
    k_cache, v_cache = torch.randn(4, 4, 2, 16, dtype=dtype), torch.randn(4, 4, 2, 16, dtype=dtype)
    return (torch.randn(8, 4, 16, dtype=dtype), k_cache, v_cache, i32([2, 0], [1, 3]), i32(5, 7),
            i32(0, 1, 8), 7)


def quantized_weight(rows, in_features, weight_type):
    """uint8 [rows, row bytes]: random blocks of ggml type ``weight_type``."""
    _, values, block_bytes = ops.BLOCK_FORMATS[weight_type]
    return torch.randint(0, 256, (rows, in_features // values * block_bytes), dtype=torch.uint8)


# op name: inputs (args, kwargs) for a dtype, built outside the mode.
CASES = {
    "attention": lambda dtype: (attention_args(dtype), dict(window_left=3, softcap=5.0)),
    "attention_out": lambda dtype: (attention_args(dtype),
                                    dict(causal=False, out=torch.empty(8, 4, 16, dtype=dtype))),
    "paged_attention": lambda dtype: (paged_args(dtype), dict(
        rotary_cos_sin_cache=ops.rope_cos_sin_cache(16, 16), rotary_is_neox=False, softcap=5.0)),
    "reshape_and_cache": lambda dtype: ((torch.randn(3, 2, 16, dtype=dtype),
                                         torch.randn(3, 2, 16, dtype=dtype),
                                         torch.zeros(4, 4, 2, 16, dtype=dtype),
                                         torch.zeros(4, 4, 2, 16, dtype=dtype),
                                         torch.tensor([5, -1, 12])), {}),
    "linear": lambda dtype: ((torch.randn(3, 16, dtype=dtype), torch.randn(5, 16, dtype=dtype),
                              torch.randn(5, dtype=dtype)), {}),
    "rotary_embedding": lambda dtype: ((torch.tensor([3, 0, 9]), torch.randn(3, 4, 16, dtype=dtype),
                                        torch.randn(3, 2, 16, dtype=dtype),
                                        ops.rope_cos_sin_cache(16, 8)), dict(is_neox=True)),
    "rotary_and_cache": lambda dtype: ((torch.tensor([3, 0, 9]), torch.randn(3, 4, 16, dtype=dtype),
                                        torch.randn(3, 2, 16, dtype=dtype),
                                        torch.randn(3, 2, 16, dtype=dtype),
                                        torch.zeros(4, 4, 2, 16, dtype=dtype),
                                        torch.zeros(4, 4, 2, 16, dtype=dtype),
                                        torch.tensor([5, -1, 12]), ops.rope_cos_sin_cache(16, 8),
                                        torch.randn(16, dtype=dtype),
                                        torch.randn(16, dtype=dtype)), {}),
    # Random block bytes: the dtypes matter here, not the values. Q6_K has int8 scales, Q5_K
    # both fp16 fields, the packed 6-bit scales and the bits of qh.
    "quantized_linear": lambda dtype: ((torch.randn(3, 256, dtype=dtype),
                                        quantized_weight(5, 256, 14), 14,
                                        torch.randn(5, dtype=dtype)), {}),
    "dequantize": lambda dtype: ((quantized_weight(5, 256, 13), 13, dtype), {}),
    "rms_norm": lambda dtype: ((torch.randn(3, 4, 16, dtype=dtype), torch.randn(16, dtype=dtype),
                                1e-6), {}),
    "add_rms_norm": lambda dtype: ((torch.randn(3, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype),
                                    torch.randn(16, dtype=dtype), 1e-6), {}),
    "add_lora": lambda dtype: ((torch.randn(4, 24, dtype=dtype), torch.randn(4, 16, dtype=dtype),
                                torch.randn(3, 8, 16, dtype=dtype),
                                torch.randn(3, 24, 8, dtype=dtype),
                                torch.tensor([2, -1, 0, 2], dtype=torch.int32)), {}),
    "silu_and_mul": lambda dtype: ((torch.randn(3, 32, dtype=dtype),), {}),
    "gelu_tanh_and_mul": lambda dtype: ((torch.randn(3, 32, dtype=dtype),), {}),
    # Q4_K gate|up experts (random blocks), float down experts.
    "moe": lambda dtype: ((torch.randn(5, 256, dtype=dtype), torch.randn(5, 4),
                           quantized_weight(4 * 64, 256, 12).view(4, 64, -1),
                           torch.randn(4, 256, 32, dtype=dtype), 2, True),
                          dict(gate_up_type=12)),
    "sample": lambda dtype: (sampling_args(dtype), {}),
    "sample_with_logprobs": lambda dtype: ((*sampling_args(dtype), 4), {}),
    "apply_penalties": lambda dtype: ((torch.randn(6, 50, dtype=dtype),
                                       torch.rand(6, 50) < 0.2,
                                       torch.randint(0, 3, (6, 50), dtype=torch.int32),
                                       torch.full((6,), 1.2), torch.full((6,), 0.5),
                                       torch.full((6,), 0.25), torch.randn(6, 50)), {}),
}


def test_every_composite_op_has_a_case():
    names = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("fastllm_composite::")}
    assert names == set(CASES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", CASES)
def test_composite_uses_only_mps_dtypes(op, dtype):
    args, kwargs = CASES[op](dtype)
    mode = MpsDtypesOnly()
    with mode:
        getattr(torch.ops.fastllm_composite, op)(*args, **kwargs)
    assert mode.seen, "the composition's ATen ops were not seen"


def test_the_mode_fails_on_float64():
    with pytest.raises(AssertionError, match="produces torch.float64, which MPS lacks"):
        with MpsDtypesOnly():
            torch.ones(3).double()
