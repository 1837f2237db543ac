"""Position-independent (pre-RoPE) caches: paged_attention with ``rotary_cos_sin_cache`` rotates
each cached key by its position as it reads it.

The reference of that mode is the ordinary (post-RoPE) mode: the same keys rotated by their
positions before they are written. Both must agree, for decode and chunked prefill, both
channel pairings, partial rotary, every kernel path (direct decode tiles, packed prefill tiles,
odd head_dim) and block sizes, and the float64 reference twin. Pools come from
``paged_util.make_case``: NaN in every slot no sequence owns, so a key read from the wrong
place, or rotated with a row of the table past the sequence, shows up.

test_pre_rope_equals_post_rope runs a covering array (tests/covering.py) of the backend, shape,
head/rotary dims, channel pairing and block size: every pair of values meets in some case, so
each backend runs every shape, every rotary layout, both pairings and both block sizes at least
once, and each shape every rotary layout.
"""

import covering
import pytest
import torch

from conftest import assert_within_twice_plain_error, num_threads
from fastllm import ops
from fastllm.ops import reference
from paged_util import F32_TOL, SOFTCAPS, make_case, slots


def post_rope_caches(case, cos_sin, is_neox):
    """The case's caches with every owned key rotated by its position (float64, rounded once)."""
    k_cache = case.k_cache.clone()
    block_size = k_cache.shape[1]
    flat = k_cache.view(-1, *k_cache.shape[2:])
    for row, length, start in zip(case.block_tables.tolist(), case.seq_lens.tolist(),
                                  [0, *case.seq_lens.cumsum(0).tolist()]):
        positions = torch.arange(length, device=k_cache.device)
        keys = case.k[start:start + length].double()
        rotated, _ = reference.rotary_embedding(positions, keys, None, cos_sin, is_neox=is_neox)
        flat[torch.tensor(slots(row, range(length), block_size), dtype=torch.long,
                          device=k_cache.device)] = rotated.to(k_cache.dtype)
    return k_cache, case.v_cache


SHAPES = {  # (lens_q, seq_lens)
    "decode": ([1, 1, 1], [300, 1, 33]),
    "chunked_prefill": ([7, 1, 0, 30], [57, 100, 12, 30]),
    "prefill": ([40], [40]),
}


ROTARY_DIMS = {"full": (64, 64), "partial": (128, 64), "odd_head_dim": (67, 32),
               "odd_half": (32, 18)}  # (head_dim, rotary_dim)


@covering.grid(shape=list(SHAPES), dims=list(ROTARY_DIMS), is_neox=[True, False],
               block_size=[1, 16],
               ids={"is_neox": lambda is_neox: "neox" if is_neox else "interleaved"})
def test_pre_rope_equals_post_rope(backend, shape, dims, is_neox, block_size):
    device = backend.device
    head_dim, rotary_dim = ROTARY_DIMS[dims]
    lens_q, seq_lens = SHAPES[shape]
    case = make_case(lens_q, seq_lens, 8, 2, head_dim, block_size, device=device)
    cos_sin = ops.rope_cos_sin_cache(400, rotary_dim, device=device)
    post_k, post_v = post_rope_caches(case, cos_sin, is_neox)
    op = backend.ops.paged_attention
    with num_threads(1 if backend.name == "composite" else None):
        got = op(*case.args(), rotary_cos_sin_cache=cos_sin, rotary_is_neox=is_neox)
        expected = op(case.q, post_k, post_v, *case.args()[3:])
    assert not got.isnan().any(), "NaN: a key was read from an unowned slot"
    # The kernel rotates in float32 where the post-RoPE keys were rotated in float64.
    torch.testing.assert_close(got, expected, atol=F32_TOL, rtol=F32_TOL)

    with num_threads(1):
        doubled = [t.double() if t.is_floating_point() else t for t in case.args()[:6]]
        oracle = reference.paged_attention(*doubled, case.max_seqlen_q,
                                           rotary_cos_sin_cache=cos_sin.double(),
                                           rotary_is_neox=is_neox)
    torch.testing.assert_close(got.double(), oracle, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["decode", "chunked_prefill"])
def test_pre_rope_low_precision(backend, dtype, shape, softcap):
    device = backend.device
    lens_q, seq_lens = SHAPES[shape]
    case = make_case(lens_q, seq_lens, 4, 2, 128, 16, dtype=dtype, device=device)
    cos_sin = ops.rope_cos_sin_cache(512, 128, base=1e6, device=device)
    with num_threads(1 if backend.name == "composite" else None):
        got = backend.ops.paged_attention(*case.args(), rotary_cos_sin_cache=cos_sin,
                                          softcap=softcap)
    with num_threads(1):
        plain = reference.paged_attention(*case.args(), rotary_cos_sin_cache=cos_sin,
                                          softcap=softcap)
        doubled = [t.double() if t.is_floating_point() else t for t in case.args()[:6]]
        oracle = reference.paged_attention(*doubled, case.max_seqlen_q,
                                           rotary_cos_sin_cache=cos_sin.double(),
                                           softcap=softcap)
    assert_within_twice_plain_error(got.double(), plain.double(), oracle)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ["decode", "chunked_prefill"])
def test_pre_rope_narrower_cache(backend, cache_dtype, shape):
    device = backend.device
    # float32 q over 16-bit pre-RoPE caches: each stored key is rotated in float32 as it is read,
    # never rounded again, so the result is float32-tight against the float64 oracle.
    lens_q, seq_lens = SHAPES[shape]
    case = make_case(lens_q, seq_lens, 8, 2, 64, 16, cache_dtype=cache_dtype, device=device)
    cos_sin = ops.rope_cos_sin_cache(400, 64, device=device)
    if backend.name in ("cuda", "cuda_sim"):
        with pytest.raises(TypeError, match="paged_attention on CUDA needs caches of q's dtype"):
            backend.ops.paged_attention(*case.args(), rotary_cos_sin_cache=cos_sin)
        return
    with num_threads(1 if backend.name == "composite" else None):
        got = backend.ops.paged_attention(*case.args(), rotary_cos_sin_cache=cos_sin)
    with num_threads(1):
        doubled = [t.double() if t.is_floating_point() else t for t in case.args()[:6]]
        oracle = reference.paged_attention(*doubled, case.max_seqlen_q,
                                           rotary_cos_sin_cache=cos_sin.double())
    assert not got.isnan().any(), "NaN: a key was read from an unowned slot"
    torch.testing.assert_close(got.double(), oracle, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_pre_rope_with_window_and_long_split_decode(backend, softcap):
    device = backend.device
    # 3000 keys, one query: the native kernel splits the keys over threads; each split must
    # rotate its keys by their own positions. A window skips the early keys altogether.
    case = make_case([1, 1], [3000, 2000], 8, 2, 128, 16, device=device)
    cos_sin = ops.rope_cos_sin_cache(4096, 128, device=device)
    post_k, post_v = post_rope_caches(case, cos_sin, True)
    op = backend.ops.paged_attention
    for window_left in [-1, 700]:
        kwargs = dict(window_left=window_left, softcap=softcap)
        with num_threads(1 if backend.name == "composite" else None):
            got = op(*case.args(), rotary_cos_sin_cache=cos_sin, **kwargs)
            expected = op(case.q, post_k, post_v, *case.args()[3:], **kwargs)
        torch.testing.assert_close(got, expected, atol=F32_TOL, rtol=F32_TOL)


def test_cached_chunk_moves_with_its_block_table(device):
    # The point of the mode: the same pre-RoPE K/V rows, reached through two block tables that
    # place them at different offsets, attend as keys rotated by the offsets they appear at.
    n_kv_heads, head_dim, block_size = 2, 32, 4
    chunk = make_case([0], [8], 4, n_kv_heads, head_dim, block_size, extra_blocks=0,
                      extra_columns=0, device=device)
    prefix = torch.randn(12, n_kv_heads, head_dim, device=device)  # 3 blocks, then the chunk
    pool_k = torch.cat([chunk.k_cache, prefix.view(3, block_size, n_kv_heads, head_dim)])
    pool_v = torch.cat([chunk.v_cache, torch.randn_like(prefix).view(3, block_size, n_kv_heads,
                                                                      head_dim)])
    chunk_blocks = chunk.block_tables[0].tolist()
    cos_sin = ops.rope_cos_sin_cache(64, head_dim, device=device)
    q = torch.randn(1, 4, head_dim, device=device)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for table in ([*chunk_blocks], [2, 3, 4, *chunk_blocks]):  # at offset 0, then at offset 12
        tables = torch.tensor([table], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([4 * len(table)], dtype=torch.int32, device=device)
        got = ops.paged_attention(q, pool_k, pool_v, tables, seq_lens, cu_q, 1,
                                  rotary_cos_sin_cache=cos_sin)
        keys = reference.gather_paged(pool_k, tables, seq_lens)
        rotated, _ = reference.rotary_embedding(torch.arange(len(keys), device=device), keys,
                                                None, cos_sin)
        values = reference.gather_paged(pool_v, tables, seq_lens)
        expected = ops.attention(q, rotated, values, cu_q, torch.tensor([0, len(keys)],
                                 dtype=torch.int32, device=device), 1, len(keys))
        torch.testing.assert_close(got, expected, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("bad, error, match", [
    (lambda t: t[:29], ValueError, r"seq_lens\[1\]=30 reaches past rotary_cos_sin_cache"),
    (lambda t: t.half(), TypeError, "rotary_cos_sin_cache must be torch.float32"),
    (lambda t: torch.zeros(64, 18), ValueError, "rotary_dim 18 exceeds head_dim 16"),
    (lambda t: t[:, :7], ValueError, r"shape\[1\] \(rotary_dim\) must be even"),
    (lambda t: t[0], ValueError, "rotary_cos_sin_cache must be"),
], ids=["too_few_positions", "half_table", "wider_than_head", "odd_rotary_dim", "rank_1"])
def test_bad_rotary_table(backend, bad, error, match):
    q = torch.randn(4, 4, 16)
    k_cache, v_cache = torch.randn(8, 16, 2, 16), torch.randn(8, 16, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32)
    cu_q = torch.tensor([0, 1, 4], dtype=torch.int32)
    table = ops.rope_cos_sin_cache(64, 16)
    with pytest.raises(error, match=match):
        backend.ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu_q, 3,
                                 rotary_cos_sin_cache=bad(table))


@pytest.mark.parametrize("dtype, is_neox", [(torch.float32, True), (torch.bfloat16, False)])
def test_opcheck_pre_rope(backend, dtype, is_neox):
    device = backend.device
    case = make_case([2, 1, 0], [9, 17, 3], 4, 2, 16, 4, dtype=dtype, device=device)
    torch.library.opcheck(backend.ops.paged_attention.default, case.args(),
                          dict(rotary_cos_sin_cache=ops.rope_cos_sin_cache(32, 16, device=device),
                               rotary_is_neox=is_neox, window_left=4))
