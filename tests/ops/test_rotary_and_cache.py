"""rotary_and_cache of every backend (conftest.py): the same bits as the three ops it fuses
(rms_norm of q and k, rotary_embedding, reshape_and_cache) run one after the other on the same
backend, and close to its float64 twin. Caches start as NaN, so a slot written that should not
be (padding) or not written that should be shows.

test_equals_the_three_ops runs a covering array (tests/covering.py) of the backend, dtype, norms,
rope style and head/rotary dims: every pair of values meets in some case, so each backend (the
simulator included: the whole module is marked for it) runs every dtype, rope style, head shape
and norm choice at least once, and each rope style every head shape, norms and dtype.
"""

import covering
import pytest
import torch

from fastllm import ops
from fastllm.ops import reference

pytestmark = pytest.mark.cuda_sim

TOKENS, N_HEADS, N_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE = 7, 4, 2, 5, 4
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative to the float64 twin: one rounding of each low-precision step.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make_inputs(device, dtype, head_dim, rot, norms, cache_dtype=None):
    """Views of one fused projection, NaN caches, a slot mapping with padding, the table: the
    same values on every call of a test."""
    generator = torch.Generator().manual_seed(head_dim * 10 + rot)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    qkv = randn(TOKENS, (N_HEADS + 2 * N_KV_HEADS) * head_dim)
    q, k, v = qkv.view(TOKENS, -1, head_dim).split([N_HEADS, N_KV_HEADS, N_KV_HEADS], dim=1)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, head_dim)
    caches = [torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype, device=device)
              for _ in range(2)]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:TOKENS]
    slots[[1, 4]] = -1  # padding: written nowhere
    positions = torch.randint(0, 32, (TOKENS,), generator=generator)
    table = ops.rope_cos_sin_cache(32, rot, 10000.0).to(device) if rot else None
    weights = [randn(head_dim), randn(head_dim)] if norms else [None, None]
    return (positions.to(device), q, k, v, *caches, slots.to(device), table, *weights)


def three_ops(o, positions, q, k, v, k_cache, v_cache, slots, table, q_norm, k_norm, eps, *,
              is_neox, rotate_keys):
    """The unfused steps on backend namespace ``o``, in place like the fused op."""
    if q_norm is not None:
        q.copy_(o.rms_norm(q, q_norm, eps))
        k.copy_(o.rms_norm(k, k_norm, eps))
    if table is not None:
        o.rotary_embedding(positions, q, k if rotate_keys else None, table, is_neox=is_neox)
    o.reshape_and_cache(k, v, k_cache, v_cache, slots)


@covering.grid(dtype=DTYPES, norms=[True, False],
               rope=["neox", "interleaved", "keys_pre_rope", "nope"],
               dims=[(64, 64), (128, 128), (80, 32)],
               ids={"norms": lambda norms: "qk_norm" if norms else "no_norm"})
def test_equals_the_three_ops(backend, dtype, norms, rope, dims):
    head_dim, rot = dims
    inputs = (backend.device, dtype, head_dim, 0 if rope == "nope" else rot, norms)
    args, fused, unfused = (make_inputs(*inputs) for _ in range(3))
    options = dict(is_neox=rope != "interleaved", rotate_keys=rope != "keys_pre_rope")
    backend.ops.rotary_and_cache(*fused, 1e-6, **options)
    three_ops(backend.ops, *unfused, 1e-6, **options)
    for name, got, want in zip(["q", "k", "v", "k_cache", "v_cache"], fused[1:6], unfused[1:6]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), name
    assert fused[4].isnan().all(dim=(2, 3)).sum() == NUM_BLOCKS * BLOCK_SIZE - (TOKENS - 2)

    positions, q, k, v, k_cache, v_cache, slots, table, q_norm, k_norm = [
        a.cpu().double() if isinstance(a, torch.Tensor) and a.is_floating_point()
        else (a.cpu() if isinstance(a, torch.Tensor) else a) for a in args]
    want = reference.rotary_and_cache(positions, q, k, v, k_cache, v_cache, slots, table, q_norm,
                                      k_norm, 1e-6, **options)
    for got, expected in zip([fused[1], fused[2], fused[4], fused[5]], want):
        torch.testing.assert_close(got.cpu().double(), expected, atol=TOL[dtype] * 4,
                                   rtol=TOL[dtype], equal_nan=True)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_narrow_cache_under_float32(backend, cache_dtype):
    fused, unfused = (make_inputs(backend.device, torch.float32, 64, 64, True, cache_dtype)
                      for _ in range(2))
    backend.ops.rotary_and_cache(*fused, 1e-6)
    three_ops(backend.ops, *unfused, 1e-6, is_neox=True, rotate_keys=True)
    for got, want in zip(fused[1:6], unfused[1:6]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("norms", [False, True], ids=["no_norm", "qk_norm"])
def test_out_of_range_position_writes_nothing(backend, norms):
    positions, *tensors = make_inputs(backend.device, torch.float32, 64, 64, norms)
    positions[-1] = 32  # the table covers [0, 32); the last token's, after the others'
    before = [t.clone() for t in tensors[:5]]  # q, k, v and the caches
    with pytest.raises(ValueError, match="32.*outside the cos_sin_cache"):
        backend.ops.rotary_and_cache(positions, *tensors, 1e-6)
    if norms and backend.name != "cpu":
        return  # the ATen compositions normalize q and k before their rotation checks
    for got, want in zip(tensors[:5], before):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_zero_tokens(backend):
    q, k, v = (torch.randn(0, h, 64, device=backend.device) for h in (4, 2, 2))
    caches = [torch.zeros(2, 4, 2, 64, device=backend.device) for _ in range(2)]
    backend.ops.rotary_and_cache(torch.zeros(0, dtype=torch.long, device=backend.device), q, k, v,
                                 *caches, torch.zeros(0, dtype=torch.long, device=backend.device),
                                 ops.rope_cos_sin_cache(8, 64).to(backend.device))
    assert all((c == 0).all() for c in caches)


@pytest.mark.cpu_inputs
def test_bad_inputs(backend):
    o = backend.ops
    positions, q, k, v, k_cache, v_cache, slots, table, q_norm, k_norm = make_inputs(
        backend.device, torch.float32, 64, 64, True)
    with pytest.raises(ValueError, match="q_norm and k_norm must be given together"):
        o.rotary_and_cache(positions, q, k, v, k_cache, v_cache, slots, table, q_norm, None)
    with pytest.raises(ValueError, match="q and key must not share memory"):
        o.rotary_and_cache(positions, q[:, :2], q[:, 1:3], v, k_cache, v_cache, slots, table)
    with pytest.raises(ValueError, match="positions has 3 tokens but q has 7"):
        o.rotary_and_cache(positions[:3], q, k, v, k_cache, v_cache, slots, table)
    with pytest.raises(ValueError, match="weight has 32 elements"):
        o.rotary_and_cache(positions, q, k, v, k_cache, v_cache, slots, table, q_norm[:32],
                           k_norm[:32])
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]=20 is past the cache's 20 slots"):
        o.rotary_and_cache(positions, q, k, v, k_cache, v_cache, torch.full_like(slots, 20),
                           table)
    with pytest.raises(TypeError, match="q has dtype torch.float16"):
        o.rotary_and_cache(positions, q.half(), k, v, k_cache, v_cache, slots, table)


def test_opcheck():
    positions, q, k, v, k_cache, v_cache, slots, table, q_norm, k_norm = make_inputs(
        "cpu", torch.float32, 64, 64, True)
    k_cache.zero_()
    v_cache.zero_()
    torch.library.opcheck(torch.ops.fastllm.rotary_and_cache.default,
                          (positions, q.clone(), k.clone(), v, k_cache, v_cache, slots, table,
                           q_norm, k_norm, 1e-6))
