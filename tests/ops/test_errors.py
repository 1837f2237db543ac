"""Bad inputs raise ValueError/TypeError naming the offending value, and change nothing."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from fastllm import ops


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def attention_inputs():
    """A valid call: 2 sequences, 3 + 7 queries against 5 + 7 keys, GQA 2."""
    return dict(q=torch.randn(10, 4, 16), k=torch.randn(12, 2, 16), v=torch.randn(12, 2, 16),
                cu_seqlens_q=i32(0, 3, 10), cu_seqlens_k=i32(0, 5, 12), max_seqlen_q=7,
                max_seqlen_k=7)


# The soft-cap is 0 (off) or a float32 normal number: the kernels use it and its reciprocal.
SOFTCAP_ERROR = (r"softcap must be 0 \(no soft-capping\) or a positive number in float32's "
                 r"normal range \[1.17549e-38, 3.40282e\+38\], got ")

# id: (changes to the valid call, exception, pattern its message must match)
ATTENTION_ERRORS = {
    "n_heads_not_multiple": (dict(k=torch.randn(12, 3, 16), v=torch.randn(12, 3, 16)),
                             ValueError, "n_heads must be a multiple of n_kv_heads, got "
                             "n_heads=4 and n_kv_heads=3"),
    "cu_seqlens_q_int64": (dict(cu_seqlens_q=i32(0, 3, 10).long()), TypeError,
                           "cu_seqlens_q must be torch.int32, got torch.int64"),
    "cu_seqlens_k_int64": (dict(cu_seqlens_k=i32(0, 5, 12).long()), TypeError,
                           "cu_seqlens_k must be torch.int32, got torch.int64"),
    "cu_seqlens_q_decreasing": (dict(cu_seqlens_q=i32(0, 5, 3, 10), cu_seqlens_k=i32(0, 3, 5, 12)),
                                ValueError, r"cu_seqlens_q must be non-decreasing.*"
                                r"cu_seqlens_q\[2\]=3 < cu_seqlens_q\[1\]=5"),
    "cu_seqlens_k_decreasing": (dict(cu_seqlens_q=i32(0, 3, 5, 10), cu_seqlens_k=i32(0, 6, 2, 12)),
                                ValueError, r"cu_seqlens_k must be non-decreasing.*"
                                r"cu_seqlens_k\[2\]=2 < cu_seqlens_k\[1\]=6"),
    "cu_seqlens_q_short_of_tokens": (dict(cu_seqlens_q=i32(0, 3, 9)), ValueError,
                                     r"cu_seqlens_q\[-1\]=9 must equal the number of packed "
                                     r"tokens, 10"),
    "cu_seqlens_k_past_tokens": (dict(cu_seqlens_k=i32(0, 6, 13)), ValueError,
                                 r"cu_seqlens_k\[-1\]=13 must equal the number of packed "
                                 r"tokens, 12"),
    "cu_seqlens_q_not_from_0": (dict(cu_seqlens_q=i32(1, 3, 10)), ValueError,
                                r"cu_seqlens_q\[0\] must be 0, got 1"),
    "head_dim_mismatch": (dict(k=torch.randn(12, 2, 8), v=torch.randn(12, 2, 8)), ValueError,
                          "q and k must have the same head_dim, got 16 and 8"),
    "over_max_seqlen_q": (dict(cu_seqlens_q=i32(0, 9, 10)), ValueError,
                          r"sequence 0 has length 9 \(from cu_seqlens_q\), more than its "
                          r"max_seqlen 7"),
    "over_max_seqlen_k": (dict(cu_seqlens_k=i32(0, 4, 12)), ValueError,
                          r"sequence 1 has length 8 \(from cu_seqlens_k\), more than its "
                          r"max_seqlen 7"),
    "k_dtype": (dict(k=torch.randn(12, 2, 16, dtype=torch.float16)), TypeError,
                "k has dtype torch.float16 but q has dtype torch.float32"),
    "v_dtype": (dict(v=torch.randn(12, 2, 16, dtype=torch.bfloat16)), TypeError,
                "v has dtype torch.bfloat16 but q has dtype torch.float32"),
    "q_float64": (dict(q=torch.randn(10, 4, 16, dtype=torch.float64),
                       k=torch.randn(12, 2, 16, dtype=torch.float64),
                       v=torch.randn(12, 2, 16, dtype=torch.float64)), TypeError,
                  "q must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    "k_on_meta": (dict(k=torch.randn(12, 2, 16, device="meta")), ValueError,
                  "k is on meta but q is on cpu"),
    "v_on_meta": (dict(v=torch.randn(12, 2, 16, device="meta")), ValueError,
                  "v is on meta but q is on cpu"),
    "cu_seqlens_k_on_meta": (dict(cu_seqlens_k=i32(0, 5, 12).to("meta")), ValueError,
                             "cu_seqlens_k is on meta but q is on cpu"),
    "q_rank_2": (dict(q=torch.randn(10, 64)), ValueError,
                 r"q must be \[total_q, n_heads, head_dim\], got shape \[10, 64\]"),
    "k_rank_4": (dict(k=torch.randn(12, 2, 4, 4)), ValueError,
                 r"k must be \[total_k, n_kv_heads, head_dim\], got shape \[12, 2, 4, 4\]"),
    "cu_seqlens_rank_2": (dict(cu_seqlens_q=i32(0, 3, 10)[None]), ValueError,
                          r"cu_seqlens_q must be \[batch \+ 1\], got shape \[1, 3\]"),
    "batch_mismatch": (dict(cu_seqlens_k=i32(0, 12), max_seqlen_k=12), ValueError,
                       r"cu_seqlens_q and cu_seqlens_k must have the same length \(batch \+ 1\), "
                       r"got 3 and 2"),
    "k_v_shapes": (dict(v=torch.randn(11, 2, 16)), ValueError,
                   r"k and v must have the same shape, got \[12, 2, 16\] and \[11, 2, 16\]"),
    "no_offsets": (dict(cu_seqlens_q=i32(), cu_seqlens_k=i32()), ValueError,
                   r"cu_seqlens_q must hold at least one offset \(0\)"),
    "negative_max_seqlen": (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0, got -1"),
    "window_below_minus_1": (dict(window_left=-2), ValueError,
                             r"window_left must be -1 \(no window\) or >= 0, got -2"),
    "nan_scale": (dict(scale=math.nan), ValueError, "scale must be finite, got nan"),
    "inf_scale": (dict(scale=math.inf), ValueError, "scale must be finite, got inf"),
    "negative_softcap": (dict(softcap=-1.0), ValueError, SOFTCAP_ERROR + "-1"),
    "nan_softcap": (dict(softcap=math.nan), ValueError, SOFTCAP_ERROR + "nan"),
    "inf_softcap": (dict(softcap=math.inf), ValueError, SOFTCAP_ERROR + "inf"),
    "softcap_past_float32": (dict(softcap=1e39), ValueError, SOFTCAP_ERROR + r"1e\+39"),
    "subnormal_softcap": (dict(softcap=1e-39), ValueError, SOFTCAP_ERROR + "1e-39"),
}

# Errors in the preallocated output (out= paths only).
OUT_ERRORS = {
    "out_shape": (torch.empty(10, 4, 8), ValueError,
                  r"out must have q's shape \[10, 4, 16\], got \[10, 4, 8\]"),
    "out_dtype": (torch.empty(10, 4, 16, dtype=torch.float16), TypeError,
                  "out has dtype torch.float16 but q has dtype torch.float32"),
    "out_on_meta": (torch.empty(10, 4, 16, device="meta"), ValueError,
                    "out is on meta but q is on cpu"),
}


def call_attention(op, inputs, **out):
    """Calls ``op`` (``attention``, or ``attention_out`` given ``out=``) on ``inputs``."""
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v")
    cu_q, cu_k = inputs.pop("cu_seqlens_q"), inputs.pop("cu_seqlens_k")
    max_q, max_k = inputs.pop("max_seqlen_q"), inputs.pop("max_seqlen_k")
    op(q, k, v, cu_q, cu_k, max_q, max_k, **inputs, **out)


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("functional", [False, True], ids=["out", "functional"])
@pytest.mark.parametrize("case", ATTENTION_ERRORS)
def test_attention_bad_input(backend, functional, case):
    changes, error, match = ATTENTION_ERRORS[case]
    inputs = attention_inputs() | changes
    q = inputs["q"]
    out = torch.full(q.shape, math.nan, dtype=q.dtype)
    with pytest.raises(error, match=match):
        if functional:
            call_attention(backend.ops.attention, inputs)
        else:
            call_attention(backend.ops.attention_out, inputs, out=out)
    assert out.isnan().all(), "a rejected call wrote into out"


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", OUT_ERRORS)
def test_attention_bad_out(backend, case):
    out, error, match = OUT_ERRORS[case]
    with pytest.raises(error, match=match):
        call_attention(backend.ops.attention_out, attention_inputs(), out=out)


# (namespace, n_heads, n_kv_heads)
ZERO_HEADS_CASES = [(namespace, n_heads, n_kv_heads)
                    for namespace in ("fastllm", "fastllm_composite")
                    for n_heads, n_kv_heads in ((0, 1), (0, 0), (2, 0))]
ZERO_HEADS = textwrap.dedent("""
    import torch
    import fastllm
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for namespace, n_heads, n_kv_heads in {cases!r}:
        q, k = torch.randn(3, n_heads, 8), torch.randn(3, n_kv_heads, 8)
        try:
            getattr(torch.ops, namespace).attention(q, k, k.clone(), cu, cu, 3, 3)
            print(namespace, n_heads, n_kv_heads, "no error", flush=True)
        except ValueError as e:
            print(namespace, n_heads, n_kv_heads, "ValueError", e, flush=True)
""")


def test_attention_zero_heads_is_a_value_error():
    # 0 % 1 == 0 would let q without heads through the GQA check (and the native kernel once
    # divided by the group size 0): it must be a ValueError. A child process runs the calls so
    # that a crash is reported, not suffered; one child runs every case (a fresh interpreter
    # costs seconds), each printing its line before the next begins.
    child = subprocess.run([sys.executable, "-c", ZERO_HEADS.format(cases=ZERO_HEADS_CASES)],
                           capture_output=True, text=True, timeout=120)
    lines = child.stdout.splitlines()
    assert child.returncode == 0, (f"process died with code {child.returncode} after "
                                   f"{len(lines)} of the cases: {child.stdout}{child.stderr}")
    assert len(lines) == len(ZERO_HEADS_CASES), child.stdout
    for (namespace, n_heads, n_kv_heads), line in zip(ZERO_HEADS_CASES, lines):
        assert line.startswith(f"{namespace} {n_heads} {n_kv_heads} ValueError q and k need at "
                               f"least one head, got n_heads={n_heads}"), line


# The gated activations share their checks (csrc/activation/activation_checks.cpp).
GATED_ACTIVATIONS = ["silu_and_mul", "gelu_tanh_and_mul"]
# id: (x, exception, pattern its message must match)
GATED_ACTIVATION_ERRORS = {
    "odd_last_dim": (lambda: torch.randn(2, 7), ValueError,
                     r"x's last dim must be even \(gate \| up halves\), got 7"),
    "rank_1": (lambda: torch.randn(8), ValueError,
               r"x must be \[rows, 2 \* d\] \(gate \| up\), got shape \[8\]"),
    "rank_3": (lambda: torch.randn(2, 3, 8), ValueError,
               r"x must be \[rows, 2 \* d\] \(gate \| up\), got shape \[2, 3, 8\]"),
    "float64": (lambda: torch.randn(2, 8, dtype=torch.float64), TypeError,
                "x must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    "int": (lambda: torch.ones(2, 8, dtype=torch.int32), TypeError,
            "x must be torch.float32, torch.bfloat16 or torch.float16, got torch.int32"),
    "strided_last_dim": (lambda: torch.randn(8, 2).t(), ValueError,
                         r"x's last dim must be contiguous, got strides \[1, 2\]"),
}


def moe_inputs():
    """A valid call: 5 tokens of hidden size 64, 8 experts of intermediate size 32, top 2."""
    return dict(x=torch.randn(5, 64), router_logits=torch.randn(5, 8),
                gate_up=torch.randn(8, 64, 64), down=torch.randn(8, 64, 32), top_k=2,
                renormalize=True)


_Q8_0_GATE_UP = torch.zeros(8, 64, 2 * 34, dtype=torch.uint8)  # Q8_0 rows of 64 values
_FP8_GATE_UP = torch.zeros(8, 64, 2 * 36, dtype=torch.uint8)  # FP8_E4M3 rows of 64 values

MOE_ERRORS = {
    "top_k_0": (dict(top_k=0), ValueError, r"top_k must be in \[1, num_experts=8\], got 0"),
    "top_k_past_experts": (dict(top_k=9), ValueError,
                           r"top_k must be in \[1, num_experts=8\], got 9"),
    "x_rank_3": (dict(x=torch.randn(5, 1, 64)), ValueError,
                 r"x must be \[tokens, hidden\], got shape \[5, 1, 64\]"),
    "x_int": (dict(x=torch.randint(0, 3, (5, 64))), TypeError,
              "x must be torch.float32, torch.bfloat16 or torch.float16, got torch.int64"),
    "logits_tokens": (dict(router_logits=torch.randn(4, 8)), ValueError,
                      "router_logits has 4 tokens but x has 5"),
    "logits_rank_1": (dict(router_logits=torch.randn(5)), ValueError,
                      r"router_logits must be \[tokens, num_experts\], got shape \[5\]"),
    "logits_float64": (dict(router_logits=torch.randn(5, 8, dtype=torch.float64)), TypeError,
                       "router_logits must be torch.float32, torch.bfloat16 or torch.float16, "
                       "got torch.float64"),
    "no_experts": (dict(router_logits=torch.randn(5, 0)), ValueError,
                   r"router_logits must score at least one expert, got shape \[5, 0\]"),
    "gate_up_rank_2": (dict(gate_up=torch.randn(64, 64)), ValueError,
                       r"gate_up must be \[num_experts, 2 \* intermediate, hidden\], got shape "
                       r"\[64, 64\]"),
    "gate_up_experts": (dict(gate_up=torch.randn(7, 64, 64)), ValueError,
                        "gate_up has 7 experts but router_logits scores 8"),
    "gate_up_odd_rows": (dict(gate_up=torch.randn(8, 63, 64)), ValueError,
                         "gate_up must hold each expert's gate rows then its up rows, an even "
                         "number, got 63"),
    "gate_up_features": (dict(gate_up=torch.randn(8, 64, 32)), ValueError,
                         "x has 64 features but gate_up's rows hold 32"),
    "gate_up_dtype": (dict(x=torch.randn(5, 64, dtype=torch.bfloat16),
                           gate_up=torch.randn(8, 64, 64, dtype=torch.float16)), TypeError,
                      "gate_up has dtype torch.float16 but x has dtype torch.bfloat16"),
    "gate_up_float64": (dict(gate_up=torch.randn(8, 64, 64, dtype=torch.float64)), TypeError,
                        "gate_up has dtype torch.float64 but x has dtype torch.float32"),
    "gate_up_rows_strided": (dict(gate_up=torch.randn(8, 64, 64).transpose(1, 2)), ValueError,
                             "gate_up rows must be contiguous"),
    "gate_up_blocks_without_type": (dict(gate_up=_Q8_0_GATE_UP), TypeError,
                                    r"gate_up is torch.uint8 \(ggml or FP8 blocks\?\) but "
                                    "gate_up_type is None"),
    "gate_up_type_unknown": (dict(gate_up=_Q8_0_GATE_UP, gate_up_type=10), ValueError,
                             r"gate_up_type must be None \(float experts\), a ggml type id of "
                             r"Q4_0 \(2\).*Q6_K \(14\), or fastllm's FP8_E4M3 blocks \(2000\), "
                             "got 10"),
    "gate_up_type_interleaved": (dict(gate_up=_Q8_0_GATE_UP, gate_up_type=1008), ValueError,
                                 r"gate_up_type must be None \(float experts\), a ggml type id"
                                 r".*got 1008"),
    "gate_up_type_on_floats": (dict(gate_up_type=8), TypeError,
                               "gate_up must be torch.uint8, got torch.float32"),
    "gate_up_blocks_rank_2": (dict(gate_up=_Q8_0_GATE_UP[0], gate_up_type=8), ValueError,
                              r"gate_up must be \[num_experts, 2 \* intermediate, row bytes\] "
                              r"\(Q8_0 blocks\), got shape \[64, 68\]"),
    "gate_up_partial_block": (dict(gate_up=_Q8_0_GATE_UP[..., :50], gate_up_type=8), ValueError,
                              r"a Q8_0 gate_up row is whole blocks of 34 bytes \(32 values\), "
                              "got rows of 50 bytes"),
    "gate_up_fp8_partial_block": (dict(gate_up=_FP8_GATE_UP[..., :50], gate_up_type=2000),
                                  ValueError,
                                  r"a FP8_E4M3 gate_up row is whole blocks of 36 bytes \(32 "
                                  r"values\), got rows of 50 bytes"),
    "gate_up_fp8_features": (dict(gate_up=_FP8_GATE_UP[..., :36], gate_up_type=2000),
                             ValueError, "x has 64 features but gate_up's rows hold 32"),
    "gate_up_blocks_features": (dict(gate_up=_Q8_0_GATE_UP[..., :34], gate_up_type=8),
                                ValueError, "x has 64 features but gate_up's rows hold 32"),
    "down_experts": (dict(down=torch.randn(4, 64, 32)), ValueError,
                     "down has 4 experts but router_logits scores 8"),
    "down_rows": (dict(down=torch.randn(8, 60, 32)), ValueError,
                  "down has 60 rows per expert but x has 64 features"),
    "down_intermediate": (dict(down=torch.randn(8, 64, 16)), ValueError,
                          "down's rows hold 16 values but gate_up's intermediate size is 32"),
    "down_type_unknown": (dict(down_type=4), ValueError,
                          r"down_type must be None \(float experts\), a ggml type id.*got 4"),
    "down_k_quant_rows": (dict(down=torch.zeros(8, 64, 144, dtype=torch.uint8), down_type=12),
                          ValueError,
                          "down's rows hold 256 values but gate_up's intermediate size is 32"),
    "logits_on_meta": (dict(router_logits=torch.randn(5, 8, device="meta")), ValueError,
                       "router_logits is on meta but x is on cpu"),
    "down_on_meta": (dict(down=torch.randn(8, 64, 32, device="meta")), ValueError,
                     "down is on meta but x is on cpu"),
}


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", GATED_ACTIVATION_ERRORS)
@pytest.mark.parametrize("op", GATED_ACTIVATIONS)
def test_gated_activation_bad_input(backend, op, case):
    make_x, error, match = GATED_ACTIVATION_ERRORS[case]
    with pytest.raises(error, match=match):
        getattr(backend.ops, op)(make_x())


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", MOE_ERRORS)
def test_moe_bad_input(backend, case):
    changes, error, match = MOE_ERRORS[case]
    inputs = moe_inputs() | changes
    args = [inputs.pop(name) for name in ("x", "router_logits", "gate_up", "down", "top_k",
                                          "renormalize")]
    with pytest.raises(error, match=match):
        backend.ops.moe(*args, **inputs)
    if backend.name == "cpu":  # the typed wrapper: the same checks, the same errors
        with pytest.raises(error, match=match):
            ops.moe(*args, **inputs)


_QK = torch.randn(6, 4, 16)  # q, with k a view of its first heads
_HEADS = torch.randn(6, 6, 16)  # q = heads 0-3, k = heads 3-4: head 3 in both


def rotary_inputs():
    """A valid call: 6 tokens, 4 query heads, 2 kv heads, head_dim 16, rotary_dim 8."""
    return dict(positions=torch.arange(6), q=torch.randn(6, 4, 16), k=torch.randn(6, 2, 16),
                cos_sin_cache=ops.rope_cos_sin_cache(32, 8))


ROTARY_ERRORS = {
    "position_past_cache": (dict(positions=torch.tensor([0, 1, 2, 32, 4, 5])), ValueError,
                            r"32.*outside the cos_sin_cache, which covers positions \[0, 32\)"),
    "negative_position_int32": (dict(positions=torch.tensor([0, 1, -1, 3, 4, 5],
                                                            dtype=torch.int32)), ValueError,
                                r"-1.*outside the cos_sin_cache, which covers positions \[0, 32\)"),
    "rotary_dim_mismatch": (dict(rotary_dim=16), ValueError,
                            r"rotary_dim=16 does not match cos_sin_cache.shape\[1\]=8"),
    "positions_float": (dict(positions=torch.arange(6.0)), TypeError,
                        "positions must be torch.int64 or torch.int32, got torch.float32"),
    "positions_rank_2": (dict(positions=torch.arange(6)[None]), ValueError,
                         r"positions must be \[tokens\], got shape \[1, 6\]"),
    "positions_count": (dict(positions=torch.arange(5)), ValueError,
                        "positions has 5 tokens but q has 6"),
    "k_tokens": (dict(k=torch.randn(5, 2, 16)), ValueError, "k has 5 tokens but q has 6"),
    "k_head_dim": (dict(k=torch.randn(6, 2, 8)), ValueError,
                   "q and k must have the same head_dim, got 16 and 8"),
    "k_dtype": (dict(k=torch.randn(6, 2, 16, dtype=torch.float16)), TypeError,
                "k has dtype torch.float16 but q has dtype torch.float32"),
    "q_int": (dict(q=torch.randint(0, 9, (6, 4, 16)), k=None), TypeError,
              "q must be torch.float32, torch.bfloat16 or torch.float16, got torch.int64"),
    "cache_float64": (dict(cos_sin_cache=ops.rope_cos_sin_cache(32, 8, dtype=torch.float64)),
                      TypeError, "cos_sin_cache must be torch.float32, torch.bfloat16 or "
                      "torch.float16, got torch.float64"),
    "cache_odd_width": (dict(cos_sin_cache=torch.randn(32, 7)), ValueError,
                        r"cos_sin_cache.shape\[1\] \(rotary_dim\) must be even and positive, "
                        r"got 7"),
    "rotary_dim_past_head_dim": (dict(cos_sin_cache=ops.rope_cos_sin_cache(32, 18)), ValueError,
                                 "rotary_dim 18 exceeds head_dim 16"),
    "q_rank_2": (dict(q=torch.randn(6, 16), k=None), ValueError,
                 r"q must be \[tokens, n_heads, head_dim\], got shape \[6, 16\]"),
    "k_on_meta": (dict(k=torch.randn(6, 2, 16, device="meta")), ValueError,
                  r"k is on meta but \w+ is on cpu"),
    "positions_on_meta": (dict(positions=torch.arange(6, device="meta")), ValueError,
                          "positions is on meta"),
    "cache_on_meta": (dict(cos_sin_cache=torch.randn(32, 8, device="meta")), ValueError,
                      "cos_sin_cache is on meta"),
    # Rotated in place: an element reached twice would be rotated twice.
    "k_is_q": (dict(q=_QK, k=_QK[:, :2]), ValueError, "q and k must not share memory"),
    "k_overlaps_q": (dict(q=_HEADS[:, :4], k=_HEADS[:, 3:5]), ValueError,
                     "q and k must not share memory"),
    "q_expanded": (dict(q=torch.randn(6, 1, 16).expand(6, 4, 16)), ValueError,
                   r"q must not have overlapping elements \(e.g. an expanded tensor\), got "
                   r"shape \[6, 4, 16\] and strides \[16, 0, 1\]"),
    "k_expanded": (dict(k=torch.randn(1, 2, 16).expand(6, 2, 16)), ValueError,
                   "k must not have overlapping elements"),
    "q_heads_overlapping": (dict(q=torch.randn(6 * 4 * 16).as_strided((6, 4, 16), (64, 8, 1))),
                            ValueError, "q must not have overlapping elements"),
}


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", ROTARY_ERRORS)
def test_rotary_bad_input_leaves_q_and_k_unchanged(backend, case):
    changes, error, match = ROTARY_ERRORS[case]
    inputs = rotary_inputs() | changes
    q, k = inputs.pop("q"), inputs.pop("k")
    q_before = q.clone()
    k_before = None if k is None or k.is_meta else k.clone()
    with pytest.raises(error, match=match):
        backend.ops.rotary_embedding(inputs.pop("positions"), q, k, inputs.pop("cos_sin_cache"),
                                     **inputs)
    assert torch.equal(q, q_before)
    if k_before is not None:
        assert torch.equal(k, k_before)


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("q_heads, k_heads", [((0, 4), (4, 6)), ((2, 6), (0, 2)),
                                               ((0, 4), (5, 7))])
def test_rotary_q_and_k_as_views_of_one_projection(backend, tokens, q_heads, k_heads):
    # The model's layout: q and k are column slices of one fused QKV matmul (disjoint heads of
    # each row). Such views never share an element, and rotating them in place rotates each
    # once, as rotating copies does.
    qkv = torch.randn(tokens, 8, 16)
    q, k = qkv[:, slice(*q_heads)], qkv[:, slice(*k_heads)]
    positions, cache = torch.arange(tokens) + 3, ops.rope_cos_sin_cache(32, 16)
    q_expected, k_expected = q.clone(), k.clone()
    backend.ops.rotary_embedding(positions, q_expected, k_expected, cache)
    backend.ops.rotary_embedding(positions, q, k, cache)
    assert torch.equal(q, q_expected) and torch.equal(k, k_expected)


@pytest.mark.parametrize("args, match", [
    ((0, 8), "max_position=0"),
    ((8, 0), "rotary_dim=0"),
    ((8, 7), "rotary_dim=7"),
    ((8, 8, 0.0), "got 0.0"),
    ((8, 8, -1.0), "got -1.0"),
    ((8, 8, math.inf), "got inf"),
    ((8, 8, math.nan), "got nan"),
])
def test_rope_cos_sin_cache_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        ops.rope_cos_sin_cache(*args)
