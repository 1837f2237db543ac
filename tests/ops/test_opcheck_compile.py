"""The op registrations: torch.library.opcheck on every op of every backend's namespace (schema
and mutation annotations, fake kernels against the real ones, autograd registration, AOT
dispatch), and torch.compile(fullgraph=True) graphs of rotary -> attention and of a MoE block
(router linear -> moe) equal to eager."""

import itertools
import math

import gguf
import pytest
import torch

from fastllm import ops


def cu_seqlens(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


# id: (lens_q, lens_k, n_heads, n_kv_heads, head_dim, dtype, keyword arguments)
ATTENTION_CASES = {
    "gqa_causal": ([3, 7], [3, 7], 4, 2, 16, torch.float32, {}),
    "window_chunked_scale": ([2, 5], [6, 9], 4, 1, 16, torch.float32,
                             dict(window_left=2, scale=0.3)),
    "non_causal_empty_sequence": ([4, 0, 3], [6, 2, 3], 2, 2, 8, torch.float32,
                                  dict(causal=False)),
    "bf16_odd_head_dim": ([5, 4], [5, 4], 6, 3, 24, torch.bfloat16, {}),
    "softcap_window": ([2, 5], [6, 9], 4, 2, 16, torch.float32, dict(window_left=3, softcap=5.0)),
    "bf16_softcap_scale": ([5, 4], [5, 4], 6, 3, 24, torch.bfloat16, dict(scale=0.5, softcap=2.0)),
}


def attention_args(case, device):
    lens_q, lens_k, n_heads, n_kv_heads, head_dim, dtype, kwargs = ATTENTION_CASES[case]
    q = torch.randn(sum(lens_q), n_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), n_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    args = (q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), max(lens_q),
            max(lens_k))
    return args, dict(kwargs)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_opcheck_attention(backend, case):
    device = backend.device
    args, kwargs = attention_args(case, device)
    torch.library.opcheck(backend.ops.attention.default, args, kwargs)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_opcheck_attention_out(backend, case):
    device = backend.device
    args, kwargs = attention_args(case, device)
    kwargs["out"] = torch.full_like(args[0], math.nan)
    torch.library.opcheck(backend.ops.attention_out.default, args, kwargs)


# id: (tokens, n_heads, n_kv_heads or None, head_dim, rotary_dim, dtype, positions dtype, is_neox)
ROTARY_CASES = {
    "neox_with_k": (7, 4, 2, 16, 16, torch.float32, torch.int64, True),
    "interleaved_no_k_int32": (7, 3, None, 16, 16, torch.float32, torch.int32, False),
    "bf16_partial_rotary": (5, 2, 1, 32, 16, torch.bfloat16, torch.int64, True),
}


@pytest.mark.parametrize("case", ROTARY_CASES)
def test_opcheck_rotary_embedding(backend, case):
    device = backend.device
    tokens, n_heads, n_kv_heads, head_dim, rot, dtype, pos_dtype, is_neox = ROTARY_CASES[case]
    positions = torch.randint(0, 64, (tokens,), dtype=pos_dtype, device=device)
    q = torch.randn(tokens, n_heads, head_dim, dtype=dtype, device=device)
    k = None if n_kv_heads is None else torch.randn(tokens, n_kv_heads, head_dim, dtype=dtype,
                                                    device=device)
    cache = ops.rope_cos_sin_cache(64, rot, device=device)
    torch.library.opcheck(backend.ops.rotary_embedding.default, (positions, q, k, cache),
                          dict(is_neox=is_neox, rotary_dim=rot))


@pytest.mark.parametrize("rows, dtype, with_bias", [(1, torch.float32, True),
                                                    (70, torch.float32, False),
                                                    (3, torch.bfloat16, True),
                                                    (2, torch.float16, False)])
def test_opcheck_linear(backend, rows, dtype, with_bias):
    device = backend.device
    x = torch.randn(rows, 40, dtype=dtype, device=device)
    weight = torch.randn(24, 40, dtype=dtype, device=device)
    bias = torch.randn(24, dtype=dtype, device=device) if with_bias else None
    torch.library.opcheck(backend.ops.linear.default, (x, weight, bias))


def q8_0_experts(num_experts, rows, in_features, device):
    """uint8 [num_experts, rows, row bytes]: Q8_0 blocks of random values (gguf's quantizer)."""
    values = torch.randn(num_experts * rows, in_features).numpy()
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(blocks).view(num_experts, rows, -1).to(device)


# id: (tokens, num_experts, top_k, renormalize, dtype, quantized gate_up, quantized down)
MOE_CASES = {
    "decode_float32": (1, 8, 2, True, torch.float32, False, False),
    "prefill_bf16": (70, 4, 2, False, torch.bfloat16, False, False),
    "quantized_gate_up": (3, 4, 4, True, torch.float32, True, False),
    "quantized_down_fp16": (40, 4, 2, True, torch.float16, False, True),
}


@pytest.mark.parametrize("case", MOE_CASES)
def test_opcheck_moe(backend, case):
    device = backend.device
    tokens, num_experts, top_k, renormalize, dtype, q_gate_up, q_down = MOE_CASES[case]
    x = torch.randn(tokens, 64, dtype=dtype, device=device)
    logits = torch.randn(tokens, num_experts, device=device)
    gate_up = (q8_0_experts(num_experts, 64, 64, device) if q_gate_up else
               torch.randn(num_experts, 64, 64, dtype=dtype, device=device) / 8)
    down = (q8_0_experts(num_experts, 64, 32, device) if q_down else
            torch.randn(num_experts, 64, 32, dtype=dtype, device=device) / 6)
    kwargs = dict(gate_up_type=8 if q_gate_up else None, down_type=8 if q_down else None)
    torch.library.opcheck(backend.ops.moe.default,
                          (x, logits, gate_up, down, top_k, renormalize), kwargs)


def test_compile_fullgraph_moe(device):
    gate_up = torch.randn(8, 64, 64, device=device) / 8
    down = torch.randn(8, 64, 32, device=device) / 6
    router = torch.randn(8, 64, device=device)

    def block(x):
        return ops.moe(x, ops.linear(x, router), gate_up, down, 2, True)

    x = torch.randn(5, 64, device=device)
    assert torch.equal(torch.compile(block, fullgraph=True)(x), block(x))


def test_compile_fullgraph_rotary_then_attention(device):
    lens = [3, 9, 1]
    cu = cu_seqlens(lens, device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    cache = ops.rope_cos_sin_cache(64, 32, device=device)

    def step(positions, q, k, v, out):
        ops.rotary_embedding(positions, q, k, cache)  # in place on q and k
        functional = ops.attention(q, k, v, cu, cu, 9, 9, softcap=5.0)
        ops.attention(q, k, v, cu, cu, 9, 9, window_left=2, out=out)
        return functional

    q, k = torch.randn(13, 4, 32, device=device), torch.randn(13, 2, 32, device=device)
    v = torch.randn_like(k)
    eager_q, eager_k, eager_out = q.clone(), k.clone(), torch.full_like(q, math.nan)
    expected = step(positions, eager_q, eager_k, v, eager_out)
    assert not torch.equal(eager_q, q)

    out = torch.full_like(q, math.nan)
    got = torch.compile(step, fullgraph=True)(positions, q, k, v, out)
    assert torch.equal(got, expected)
    assert torch.equal(out, eager_out)
    assert torch.equal(q, eager_q) and torch.equal(k, eager_k), "in-place rotation lost"
