"""The rotary_embedding op of every backend (conftest.py) against reference.rotary_embedding.

The op rotates q and k in place; ``check`` compares them with a float64 run of the reference on
copies of the inputs (same cos/sin table), tight in float32 and by flash-attention's 2x rule in
bfloat16/float16, and requires the channels past rotary_dim to be left bit-identical.

test_matches_reference runs a covering array (tests/covering.py) of the backend, dtype, rope
style and rotary/head dims: every pair of values meets in some case, so each backend (the
simulator included) runs every dtype, style and shape at least once.
"""

import covering
import pytest
import torch

from fastllm import ops
from fastllm.ops import reference

# Cheap on the CUDA simulator: every test runs there too.
pytestmark = pytest.mark.cuda_sim

F32_TOL = 1e-6
LOW_PRECISION_SLACK = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(backend, positions, q, k, cache, **kwargs):
    """Rotates q and k (views allowed) in place on `backend`; checks them against the
    reference."""
    q_in, k_in = q.clone(), None if k is None else k.clone()
    assert backend.ops.rotary_embedding(positions, q, k, cache, **kwargs) is None
    rot = cache.shape[1]
    expected = reference.rotary_embedding(
        positions.cpu(), q_in.cpu().double(), None if k is None else k_in.cpu().double(),
        cache.cpu().double(), **kwargs)
    plain = reference.rotary_embedding(positions, q_in, k_in, cache, **kwargs)
    for got, before, ref64, ref_plain in zip((q, k), (q_in, k_in), expected, plain):
        if got is None:
            assert ref64 is None
            continue
        assert torch.equal(got[..., rot:], before[..., rot:]), "channels past rotary_dim changed"
        got64 = got.cpu().double()
        if got.dtype == torch.float32:
            torch.testing.assert_close(got64, ref64, atol=F32_TOL, rtol=F32_TOL)
        elif got.numel():
            err = (got64 - ref64).abs().max().item()
            plain_err = (ref_plain.cpu().double() - ref64).abs().max().item()
            assert err <= 2 * plain_err + LOW_PRECISION_SLACK, (
                f"max error {err:.3g} exceeds 2x the plain composition's {plain_err:.3g}")


def random_positions(tokens, max_position, device):
    """Unsorted positions with repeats, always including 0 and the last position."""
    positions = torch.randint(0, max_position, (tokens,), device=device)
    positions[: min(tokens, 4)] = torch.tensor([max_position - 1, 0, 5, 5], device=device)[:tokens]
    return positions


@covering.grid(dtype=DTYPES, is_neox=[True, False],
               dims=[(64, 64), (128, 128), (32, 64), (16, 80), (2, 67)],
               ids={"is_neox": lambda is_neox: "neox" if is_neox else "interleaved"})
def test_matches_reference(backend, dtype, is_neox, dims):
    device = backend.device
    rot, head_dim = dims
    tokens, max_position = 37, 4096
    cache = ops.rope_cos_sin_cache(max_position, rot, 10000.0, device=device)
    q = torch.randn(tokens, 4, head_dim, dtype=dtype, device=device)
    k = torch.randn(tokens, 2, head_dim, dtype=dtype, device=device)
    check(backend, random_positions(tokens, max_position, device), q, k, cache, is_neox=is_neox)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_k_none(backend, is_neox):
    device = backend.device
    cache = ops.rope_cos_sin_cache(512, 32, 10000.0, device=device)
    q = torch.randn(20, 3, 48, device=device)
    check(backend, random_positions(20, 512, device), q, None, cache, is_neox=is_neox)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("layout", ["fused_qkv", "strided_head_dim"])
def test_strided_views_rotate_in_place(backend, dtype, is_neox, layout):
    device = backend.device
    tokens, n_heads, n_kv_heads, head_dim, rot = 19, 4, 2, 64, 48
    if layout == "fused_qkv":  # q and k slices of one QKV projection; v must not be touched
        fused = torch.randn(tokens, n_heads + 2 * n_kv_heads, head_dim, dtype=dtype, device=device)
        q, k, untouched = fused.split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    else:  # every other channel of wider buffers; the channels in between must not be touched
        fused = torch.randn(tokens, n_heads + n_kv_heads, 2 * head_dim, dtype=dtype, device=device)
        q, k = fused[:, :n_heads, ::2], fused[:, n_heads:, 1::2]
        untouched = torch.cat([fused[:, :n_heads, 1::2], fused[:, n_heads:, ::2]], dim=1)
    untouched_before = untouched.clone()
    cache = ops.rope_cos_sin_cache(256, rot, 10000.0, device=device)
    check(backend, random_positions(tokens, 256, device), q, k, cache, is_neox=is_neox)
    if layout == "strided_head_dim":
        untouched = torch.cat([fused[:, :n_heads, 1::2], fused[:, n_heads:, ::2]], dim=1)
    assert torch.equal(untouched, untouched_before)


@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_positions_unsorted_repeated_and_strided(backend, positions_dtype, is_neox):
    device = backend.device
    values = [7, 3, 3, 100, 0, 7, 4095, 3]
    positions = torch.tensor(values, dtype=positions_dtype, device=device)
    q = torch.randn(len(values), 2, 32, device=device)
    k = torch.randn(len(values), 1, 32, device=device)
    q[2], k[2], q[5], k[5] = q[1], k[1], q[0], k[0]  # same (position, input) twice
    q_in, k_in = q.clone(), k.clone()
    cache = ops.rope_cos_sin_cache(4096, 32, 10000.0, device=device)
    check(backend, positions, q, k, cache, is_neox=is_neox)
    assert torch.equal(q[2], q[1]) and torch.equal(k[2], k[1])
    assert torch.equal(q[5], q[0]) and torch.equal(k[5], k[0])
    assert torch.equal(q[4], q_in[4]) and torch.equal(k[4], k_in[4]), "position 0 is the identity"

    # The same positions read through a stride, out-of-range garbage in between.
    interleaved = torch.stack([positions, torch.full_like(positions, -1)], dim=1).flatten()
    q2, k2 = q_in.clone(), k_in.clone()
    backend.ops.rotary_embedding(interleaved[::2], q2, k2, cache, is_neox=is_neox)
    assert torch.equal(q2, q) and torch.equal(k2, k)


@pytest.mark.parametrize("with_k", [True, False])
def test_zero_tokens(backend, with_k):
    device = backend.device
    cache = ops.rope_cos_sin_cache(64, 16, 10000.0, device=device)
    q = torch.randn(0, 4, 32, device=device)
    k = torch.randn(0, 2, 32, device=device) if with_k else None
    check(backend, torch.zeros(0, dtype=torch.int64, device=device), q, k, cache)


@pytest.mark.parametrize("cache_layout", ["bfloat16", "float16", "column_major"])
def test_cache_dtype_and_layout(backend, cache_layout):
    device = backend.device
    # A float32 q/k with a cos/sin table stored differently: the op reads the table as given.
    cache = ops.rope_cos_sin_cache(300, 32, 10000.0, device=device)
    if cache_layout == "column_major":
        cache = cache.t().contiguous().t()
        assert not cache.is_contiguous()
    else:
        cache = cache.to(getattr(torch, cache_layout))
    q = torch.randn(23, 4, 64, device=device)
    k = torch.randn(23, 2, 64, device=device)
    check(backend, random_positions(23, 300, device), q, k, cache)


def test_explicit_rotary_dim_equals_default(backend):
    device = backend.device
    cache = ops.rope_cos_sin_cache(64, 16, 10000.0, device=device)
    positions = random_positions(9, 64, device)
    q = torch.randn(9, 2, 40, device=device)
    q_before, q_explicit = q.clone(), q.clone()
    backend.ops.rotary_embedding(positions, q, None, cache)
    backend.ops.rotary_embedding(positions, q_explicit, None, cache, rotary_dim=16)
    assert torch.equal(q, q_explicit)
    assert not torch.equal(q, q_before)


@pytest.mark.parametrize("bad_position, positions_dtype", [(64, torch.int64), (-1, torch.int32)])
def test_out_of_range_position_changes_nothing(backend, bad_position, positions_dtype):
    device = backend.device
    # The bad position is the last token's, so an op that checked while rotating would already
    # have rotated the others. (More bad inputs in test_errors.py.)
    fused = torch.randn(12, 4 + 2 * 2, 32, device=device)
    q, k, _ = fused.split([4, 2, 2], dim=1)
    before = fused.clone()
    positions = torch.arange(12, dtype=positions_dtype, device=device)
    positions[-1] = bad_position
    cache = ops.rope_cos_sin_cache(64, 32, 10000.0, device=device)
    with pytest.raises(ValueError, match=rf"{bad_position}.*outside the cos_sin_cache"):
        backend.ops.rotary_embedding(positions, q, k, cache)
    with pytest.raises(ValueError, match="rotary_dim=16 does not match"):
        backend.ops.rotary_embedding(positions.clamp(0, 63), q, k, cache, rotary_dim=16)
    assert torch.equal(fused, before)


@pytest.mark.parametrize("max_position, dim, base", [
    (2048, 128, 10000.0), (4096, 64, 500000.0), (16, 2, 10000.0), (100, 80, 1e6)])
def test_rope_cos_sin_cache_matches_hf(max_position, dim, base, device):
    # HF transformers' default RoPE, computed here in float64 (HF itself uses float32 angles).
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    freqs = torch.outer(torch.arange(max_position).double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's [max_position, dim] cos and sin
    expected = torch.cat([emb.cos()[:, : dim // 2], emb.sin()[:, : dim // 2]], dim=-1)

    cache64 = ops.rope_cos_sin_cache(max_position, dim, base, dtype=torch.float64, device=device)
    torch.testing.assert_close(cache64.cpu(), expected, atol=1e-12, rtol=0)
    cache = ops.rope_cos_sin_cache(max_position, dim, base, device=device)
    assert cache.dtype == torch.float32 and cache.shape == (max_position, dim)
    torch.testing.assert_close(cache.cpu().double(), expected, atol=1e-7, rtol=0)
    # Rounded once from float64, not through float32.
    assert torch.equal(ops.rope_cos_sin_cache(max_position, dim, base, dtype=torch.bfloat16,
                                              device=device), cache64.bfloat16())
