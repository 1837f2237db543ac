"""The paged_attention op of every backend (conftest.py): attention over keys read through block
tables, against the same backend's contiguous attention and the float64 reference.

Every pool is built by ``paged_util.make_case``: shuffled block ids, extra blocks no sequence
owns, partial last blocks, NaN in every slot no sequence owns and junk (-1, +-2**31, ids of NaN
blocks) in the table columns past each sequence's blocks. Reading any of it shows up as NaN or
a crash. ``check`` then asserts: no NaN; bit-equal to the same backend's ``attention`` on the
gathered contiguous K/V in q's dtype (the paged kernel is that attention with a different key
layout, and reads a narrower cache back exactly);
queries that see no key are exactly 0; and float64-reference agreement, tight in float32,
flash-attention's 2x rule in bfloat16/float16.

The grids are covering arrays (tests/covering.py) over the backend and the case's parameters:
every pair of values meets in some case, so each backend runs every block size, GQA group, head
dim, batch, shape, mask, scale, soft-cap and dtype at least once. Always in: every causal/window
combination on the mixed chunked batch for the CPU kernel and CUDA's (the simulator, and a GPU
where there is one), since masks are where the kernels differ most. The simulator runs the
tests marked ``cuda_sim`` on its rows of those arrays (each value of each parameter at least
once, the mask edges above) plus the unparametrized checks whole.
"""

import dataclasses
import math

import covering
import pytest
import torch

from conftest import num_threads
from fastllm import ops
from fastllm.ops import reference
from conftest import assert_within_twice_plain_error, blind_rows
from paged_util import F32_TOL, SOFTCAPS, cu_seqlens, i32, make_case, slots


def check(backend, case, *, exact=True, **kwargs):
    """Runs `case` on `backend` and checks it every way described in the module docstring;
    exact=False skips the bit-equality with contiguous attention (for caches whose strides
    send the kernel down another path than contiguous K/V do)."""
    # The composite (what MPS runs) on one thread: on the CPU its many small ATen ops would wait
    # on descheduled workers when the machine's cores are shared. The kernels run with the
    # caller's threads, as they do in use.
    with num_threads(1 if backend.name == "composite" else None):
        out = backend.ops.paged_attention(*case.args(), **kwargs)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        assert not out.isnan().any(), "NaN in the output: unowned slots or blocks were read"
        seq_lens = case.seq_lens.tolist()
        # Bit-equality holds where both ops are one kernel (the CPU's) or one composition; in
        # CUDA, paged decode and packed prefill are separate kernels (float64 still rules).
        exact = exact and backend.name not in ("cuda", "cuda_sim")
        if exact:  # with the op's thread count: the kernel's key splits depend on it
            with num_threads(1):
                k, v = (reference.gather_paged(cache, case.block_tables, case.seq_lens)
                        .to(case.q.dtype) for cache in (case.k_cache, case.v_cache))
            contiguous = backend.ops.attention(case.q, k, v, case.cu_seqlens_q,
                                               cu_seqlens(seq_lens, k.device), case.max_seqlen_q,
                                               max(seq_lens, default=0), **kwargs)
            assert torch.equal(out, contiguous), "paged != attention on the gathered K/V"

    with num_threads(1):  # the oracle's ops are small too
        got = out.cpu().double()
        lens_q = case.cu_seqlens_q.diff().tolist()
        blind = blind_rows(lens_q, seq_lens, kwargs.get("causal", True),
                           kwargs.get("window_left", -1))
        assert (got[blind] == 0).all(), "a query that sees no key must output exactly 0"

        doubled = [t.cpu().double() if t.is_floating_point() else t.cpu() for t in case.args()[:6]]
        expected = reference.paged_attention(*doubled, case.max_seqlen_q, **kwargs)
        if case.q.dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=F32_TOL, rtol=F32_TOL)
        else:
            plain = reference.paged_attention(*case.args(), **kwargs).cpu().double()
            assert_within_twice_plain_error(got, plain, expected)
    return out


@covering.grid(softcap=SOFTCAPS, block_size=[1, 16, 32], group=[1, 2, 4, 7])
def test_block_sizes_and_gqa(backend, block_size, group, softcap):
    device = backend.device
    # Per sequence: decode against 9 keys, a 17-token prefill, 0 queries against 3 cached keys,
    # a chunk of 7 against 33 cached + itself, and a 1-token prefill.
    check(backend, make_case([1, 17, 0, 7, 1], [9, 17, 3, 40, 1], group * 2, 2, 64, block_size,
                          device=device), softcap=softcap)


@covering.grid(softcap=SOFTCAPS, head_dim=[64, 128, 67], block_size=[1, 16])
def test_head_dims(backend, head_dim, block_size, softcap):
    device = backend.device
    check(backend, make_case([1, 5, 0], [33, 21, 0], 8, 2, head_dim, block_size, device=device),
          softcap=softcap)


@covering.grid(softcap=SOFTCAPS, block_size=[1, 16, 32], batch=[1, 3, 8])
def test_decode(backend, block_size, batch, softcap):
    device = backend.device
    # One query per sequence; lengths from 1 (the query's own key only) to a few hundred, with
    # 1 and a multiple of the block size (a full last block) in every batch of several.
    seq_lens = torch.randint(1, 300, (batch,)).tolist()
    if batch > 1:
        seq_lens[:2] = [1, 2 * block_size]
    check(backend, make_case([1] * batch, seq_lens, 8, 2, 64, block_size, device=device),
          softcap=softcap)


CHUNKED = {  # (lens_q, seq_lens)
    "7_new_after_50_cached": ([7], [57]),
    "mixed_batch": ([7, 1, 0, 30, 16], [57, 100, 12, 30, 48]),
    "empty_sequence": ([3, 0, 2], [20, 0, 2]),  # seq_len 0 with len_q 0 in the middle
    "no_sequences": ([], []),
    "only_empty_sequences": ([0, 0], [0, 5]),
    "more_queries_than_keys": ([4, 2], [2, 0]),  # rows above the diagonal see nothing
}


@pytest.mark.cuda_sim
@covering.grid(softcap=SOFTCAPS, shape=list(CHUNKED), causal=[True, False],
               window_left=[-1, 0, 5, 64],
               edges=[dict(backend=backend, shape="mixed_batch", causal=causal,
                           window_left=window_left)
                      for backend in ("cpu", "cuda_sim", "cuda") for causal in (True, False)
                      for window_left in (-1, 0, 5, 64)])
def test_chunked_prefill_and_masks(backend, shape, causal, window_left, softcap):
    device = backend.device
    lens_q, seq_lens = CHUNKED[shape]
    out = check(backend, make_case(lens_q, seq_lens, 4, 2, 40, 16, device=device), causal=causal,
                window_left=window_left, softcap=softcap)
    assert out.shape == (sum(lens_q), 4, 40)


@pytest.mark.cuda_sim
def test_window_zero_copies_the_diagonal_value_of_the_kv_head(backend):
    device = backend.device
    # Independent of the reference: with window_left=0 each query sees exactly its diagonal key,
    # so its output is that key's value row, of kv head h // group, exactly.
    case = make_case([3, 1], [10, 4], 6, 2, 16, 4, device=device)
    out = backend.ops.paged_attention(*case.args(), window_left=0)
    diagonal_keys = torch.tensor([7, 8, 9, 13], device=device)  # packed: sequence 1 from 10
    assert torch.equal(out, case.v[diagonal_keys].repeat_interleave(3, dim=1))


@pytest.mark.cuda_sim
@covering.grid(softcap=[*SOFTCAPS, 0.5], scale=[0.0, 0.5, -0.3])
def test_custom_scale(backend, scale, softcap):
    device = backend.device
    check(backend, make_case([5, 1], [20, 30], 4, 2, 64, 16, device=device), scale=scale,
          softcap=softcap)


LOW_PRECISION_SHAPES = {  # (lens_q, seq_lens, head_dim)
    "decode": ([1, 1, 1], [300, 1, 77], 128),
    "chunked_prefill": ([7, 0, 20], [57, 9, 20], 67),
}
MASKS = {"causal": (True, -1), "full": (False, -1), "window5": (True, 5)}  # (causal, window_left)


@covering.grid(softcap=SOFTCAPS, dtype=[torch.bfloat16, torch.float16],
               shape=list(LOW_PRECISION_SHAPES), mask=list(MASKS))
def test_low_precision(backend, dtype, shape, mask, softcap):
    device = backend.device
    lens_q, seq_lens, head_dim = LOW_PRECISION_SHAPES[shape]
    causal, window_left = MASKS[mask]
    check(backend, make_case(lens_q, seq_lens, 4, 2, head_dim, 16, dtype=dtype, device=device),
          causal=causal, window_left=window_left, softcap=softcap)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fused_kv_pool", "head_dim_slice", "mixed",
                                    "head_dim_stride_2"])
def test_strided_caches_queries_and_tables(backend, dtype, layout):
    device = backend.device
    # The caches as views of a bigger pool, q a slice of a fused QKV output, the block table a
    # column slice of a preallocated [max_batch, max_blocks] table: the op follows the strides.
    lens_q, seq_lens, n_heads, n_kv_heads, head_dim = [1, 7, 0], [40, 7, 5], 8, 2, 64
    case = make_case(lens_q, seq_lens, n_heads, n_kv_heads, head_dim, 16, dtype=dtype,
                     device=device)
    nan = math.nan
    if layout == "fused_kv_pool":  # [num_blocks, block_size, 2, n_kv_heads, head_dim]
        pool = torch.stack([case.k_cache, case.v_cache], dim=2)
        k_cache, v_cache = pool[:, :, 0], pool[:, :, 1]
    elif layout == "head_dim_slice":  # K and V side by side in each row, plus padding
        pool = torch.full((*case.k_cache.shape[:3], 2 * head_dim + 3), nan, dtype=dtype,
                          device=device)
        k_cache, v_cache = pool[..., :head_dim], pool[..., head_dim:2 * head_dim]
        k_cache.copy_(case.k_cache), v_cache.copy_(case.v_cache)
    elif layout == "mixed":  # K heads-major, V a slice of wider rows: different strides
        k_cache = case.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
        v_cache = torch.full((*case.v_cache.shape[:3], head_dim + 7), nan, dtype=dtype,
                             device=device)[..., 5:5 + head_dim].copy_(case.v_cache)
    else:
        k_cache = torch.full((*case.k_cache.shape[:3], 2 * head_dim), nan, dtype=dtype,
                             device=device)[..., ::2].copy_(case.k_cache)
        v_cache = torch.full((*case.v_cache.shape[:3], 2 * head_dim), nan, dtype=dtype,
                             device=device)[..., 1::2].copy_(case.v_cache)
    qkv = torch.randn(case.q.shape[0], n_heads + 2 * n_kv_heads, head_dim, dtype=dtype,
                      device=device)
    q = qkv[:, :n_heads].copy_(case.q)
    wide = torch.full((5, case.block_tables.shape[1] + 4), -1, dtype=torch.int32, device=device)
    tables = wide[1:4, 2:2 + case.block_tables.shape[1]]
    tables.copy_(case.block_tables)
    assert not any(t.is_contiguous() for t in (q, k_cache, v_cache, tables))

    check(backend, dataclasses.replace(case, q=q, k_cache=k_cache, v_cache=v_cache,
                                    block_tables=tables), exact=layout != "head_dim_stride_2")


@pytest.mark.cuda_sim
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_chunked_prefill_through_reshape_and_cache_equals_one_shot(backend, block_size):
    device = backend.device
    # Two sequences prefilled chunk by chunk, then decoded: each step writes its new tokens'
    # K/V with reshape_and_cache (padding tokens with slot -1 mixed in) and attends to the
    # cache. The outputs, concatenated, must be those of one-shot attention over the whole
    # sequences, since each query sees the same keys.
    chunks = [[16, 7, 20, 7, 1, 1], [5, 0, 30, 15, 1, 0]]  # new tokens per step and sequence
    totals = [sum(c) for c in chunks]
    n_heads, n_kv_heads, head_dim = 4, 2, 32
    q_all = [torch.randn(n, n_heads, head_dim, device=device) for n in totals]
    k_all = [torch.randn(n, n_kv_heads, head_dim, device=device) for n in totals]
    v_all = [torch.randn(n, n_kv_heads, head_dim, device=device) for n in totals]

    # Block tables for the whole sequences, allocated up front: columns past the keys written so
    # far name blocks that are still NaN.
    layout = make_case([0, 0], totals, n_heads, n_kv_heads, head_dim, block_size, device=device)
    k_cache = torch.full_like(layout.k_cache, math.nan)
    v_cache = torch.full_like(layout.v_cache, math.nan)
    tables = layout.block_tables.tolist()
    written = [0, 0]
    outs = [[], []]
    for step in range(len(chunks[0])):
        new = [chunks[b][step] for b in range(2)]
        pad = 2  # padding tokens after the real ones: their slot is -1, they write nothing
        key = torch.cat([*(k_all[b][written[b]:written[b] + new[b]] for b in range(2)),
                         torch.randn(pad, n_kv_heads, head_dim, device=device)])
        value = torch.cat([*(v_all[b][written[b]:written[b] + new[b]] for b in range(2)),
                           torch.randn(pad, n_kv_heads, head_dim, device=device)])
        slot_mapping = torch.tensor(
            [s for b in range(2)
             for s in slots(tables[b], range(written[b], written[b] + new[b]), block_size)]
            + [-1] * pad, dtype=torch.long, device=device)
        backend.ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        q = torch.cat([q_all[b][written[b]:written[b] + new[b]] for b in range(2)])
        written = [written[b] + new[b] for b in range(2)]
        out = backend.ops.paged_attention(q, k_cache, v_cache, layout.block_tables,
                                       i32(*written, device=device), cu_seqlens(new, device),
                                       max(new))
        outs[0].append(out[:new[0]])
        outs[1].append(out[new[0]:])
    assert written == totals

    got = torch.cat([o for seq in outs for o in seq])
    expected = ops.attention(torch.cat(q_all), torch.cat(k_all), torch.cat(v_all),
                             cu_seqlens(totals, device), cu_seqlens(totals, device),
                             max(totals), max(totals))
    torch.testing.assert_close(got, expected, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window_left", [-1, 1500])
def test_long_decode_splits_keys_across_threads(backend, window_left, softcap):
    device = backend.device
    # One sequence, one query, 3000 keys in blocks of 16: few (sequence, kv head) tiles, so the
    # native CPU kernel splits the keys across threads and merges partial softmaxes. The result
    # must not depend on the thread count (4 oversubscribes a small machine: the split still
    # runs). `check` runs the composite on one thread whatever the count.
    case = make_case([1], [3000], 8, 2, 128, 16, device=device)
    outs = {}
    for threads in [1, None, 4] if backend.name == "cpu" else [None]:
        with num_threads(threads):
            outs[threads] = check(backend, case, window_left=window_left, softcap=softcap)
    for threads, out in outs.items():
        torch.testing.assert_close(out, outs[None], atol=F32_TOL, rtol=F32_TOL,
                                   msg=lambda m: f"{threads} threads vs the default: {m}")


NARROWER_CACHE = {  # (lens_q, seq_lens, head_dim): decode tiles read rows in place, others pack
    "decode": ([1, 1, 1], [600, 1, 77], 64),  # 600 keys: split over 2 threads
    "chunked_prefill": ([7, 0, 20, 1], [57, 9, 20, 33], 64),
    "odd_head_dim": ([1, 5], [300, 40], 67),
    "verification": ([5, 2], [300, 41], 64),  # drafts checked over long histories: packed
}


@pytest.mark.cuda_sim
@covering.grid(softcap=SOFTCAPS, cache_dtype=[torch.float16, torch.bfloat16],
               shape=list(NARROWER_CACHE))
def test_narrower_cache(backend, cache_dtype, shape, softcap):
    device = backend.device
    # float32 q over bfloat16 / float16 caches (kv_cache_dtype): the result is float32 attention
    # on the stored values (check: bit-equal to attention on them converted, float32-tight
    # against the float64 reference on them), whatever the thread count. GQA 4.
    lens_q, seq_lens, head_dim = NARROWER_CACHE[shape]
    case = make_case(lens_q, seq_lens, 8, 2, head_dim, 16, cache_dtype=cache_dtype,
                     device=device)
    if backend.name in ("cuda", "cuda_sim"):
        with pytest.raises(TypeError, match="paged_attention on CUDA needs caches of q's dtype"):
            backend.ops.paged_attention(*case.args(), softcap=softcap)
        return
    outs = {}
    for threads in [1, 2] if backend.name == "cpu" else [None]:
        with num_threads(threads):
            outs[threads] = check(backend, case, softcap=softcap)
    if len(outs) == 2:
        torch.testing.assert_close(outs[1], outs[2], atol=F32_TOL, rtol=F32_TOL)


# id: (lens_q, seq_lens, n_heads, n_kv_heads, head_dim, block_size, dtype, keyword arguments)
OPCHECK_CASES = {
    "gqa_decode": ([1, 1, 1], [9, 17, 1], 4, 2, 16, 16, torch.float32, {}),
    "window_chunked_scale": ([2, 5, 0], [6, 9, 3], 4, 1, 16, 4, torch.float32,
                             dict(window_left=2, scale=0.3)),
    "non_causal_block_size_1": ([3, 2], [5, 2], 2, 2, 8, 1, torch.float32, dict(causal=False)),
    "bf16_gqa_window": ([5, 1], [5, 20], 6, 3, 24, 16, torch.bfloat16, dict(window_left=3)),
    "f16_cache_decode": ([1, 1], [40, 3], 4, 2, 32, 16, (torch.float32, torch.float16), {}),
    "bf16_cache_chunked": ([4, 2], [9, 2], 4, 1, 16, 4, (torch.float32, torch.bfloat16),
                           dict(window_left=5)),
    "softcap_chunked_window": ([4, 1], [9, 30], 4, 2, 16, 4, torch.float32,
                               dict(window_left=5, softcap=5.0)),
    "bf16_softcap_decode": ([1, 1], [40, 3], 8, 4, 32, 16, torch.bfloat16, dict(softcap=2.0)),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_paged_attention(backend, case):
    device = backend.device
    lens_q, seq_lens, n_heads, n_kv_heads, head_dim, block_size, dtypes, kwargs = \
        OPCHECK_CASES[case]
    dtype, cache_dtype = dtypes if isinstance(dtypes, tuple) else (dtypes, dtypes)
    if cache_dtype != dtype and backend.name in ("cuda", "cuda_sim"):
        pytest.skip("paged_attention on CUDA reads caches of q's dtype only")
    paged = make_case(lens_q, seq_lens, n_heads, n_kv_heads, head_dim, block_size, dtype=dtype,
                      cache_dtype=cache_dtype, device=device)
    torch.library.opcheck(backend.ops.paged_attention.default, paged.args(), kwargs)


def test_compile_fullgraph_cache_write_then_paged_attention(device):
    # A chunk's K/V written into the cache, then its queries attend to cached prefix + chunk.
    case = make_case([3, 1], [10, 6], 4, 2, 32, 4, device=device)
    key = torch.randn(4, 2, 32, device=device)
    value = torch.randn_like(key)
    tables = case.block_tables.tolist()
    slot_mapping = torch.tensor(slots(tables[0], range(7, 10), 4) + slots(tables[1], [5], 4),
                                dtype=torch.long, device=device)

    def step(q, key, value, k_cache, v_cache):
        ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return ops.paged_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens,
                                   case.cu_seqlens_q, 3, window_left=5, softcap=5.0)

    eager_k, eager_v = case.k_cache.clone(), case.v_cache.clone()
    expected = step(case.q, key, value, eager_k, eager_v)
    assert not torch.equal(eager_k[~eager_k.isnan()], case.k_cache[~case.k_cache.isnan()])

    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    got = torch.compile(step, fullgraph=True)(case.q, key, value, k_cache, v_cache)
    assert torch.equal(got, expected)
    for cache, eager in [(k_cache, eager_k), (v_cache, eager_v)]:
        torch.testing.assert_close(cache, eager, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"the compiled cache write differs: {m}")


def paged_inputs():
    """A valid call: 2 sequences, 1 + 3 queries against 20 + 30 keys in blocks of 16, GQA 2,
    8 blocks in the pool."""
    return dict(q=torch.randn(4, 4, 16), k_cache=torch.randn(8, 16, 2, 16),
                v_cache=torch.randn(8, 16, 2, 16), block_tables=i32([0, 1], [2, 3]),
                seq_lens=i32(20, 30), cu_seqlens_q=i32(0, 1, 4), max_seqlen_q=3)


SOFTCAP_ERROR = (r"softcap must be 0 \(no soft-capping\) or a positive number in float32's "
                 r"normal range \[1.17549e-38, 3.40282e\+38\], got ")

# id: (changes to the valid call, exception, pattern its message must match)
PAGED_ERRORS = {
    "table_too_short": (dict(seq_lens=i32(20, 40)), ValueError,
                        r"seq_lens\[1\]=40 needs 3 blocks of 16 but block_tables has 2 columns"),
    "block_id_past_pool": (dict(block_tables=i32([0, 99], [2, 3])), ValueError,
                           r"block_tables\[0\]\[1\]=99 is not a block of the cache "
                           r"\(num_blocks=8\)"),
    "block_id_negative": (dict(block_tables=i32([0, 1], [-1, 3])), ValueError,
                          r"block_tables\[1\]\[0\]=-1 is not a block of the cache "
                          r"\(num_blocks=8\)"),
    "negative_seq_len": (dict(seq_lens=i32(20, -1)), ValueError,
                         r"seq_lens\[1\]=-1 must be >= 0"),
    "block_tables_int64": (dict(block_tables=i32([0, 1], [2, 3]).long()), TypeError,
                           "block_tables must be torch.int32, got torch.int64"),
    "seq_lens_int64": (dict(seq_lens=i32(20, 30).long()), TypeError,
                       "seq_lens must be torch.int32, got torch.int64"),
    "cu_seqlens_q_int64": (dict(cu_seqlens_q=i32(0, 1, 4).long()), TypeError,
                           "cu_seqlens_q must be torch.int32, got torch.int64"),
    "q_rank_2": (dict(q=torch.randn(4, 64)), ValueError,
                 r"q must be \[total_q, n_heads, head_dim\], got shape \[4, 64\]"),
    "k_cache_rank_3": (dict(k_cache=torch.randn(8, 16, 32)), ValueError,
                       r"k_cache must be \[num_blocks, block_size, n_kv_heads, head_dim\], "
                       r"got shape \[8, 16, 32\]"),
    "v_cache_rank_5": (dict(v_cache=torch.randn(8, 16, 2, 4, 4)), ValueError,
                       r"v_cache must be \[num_blocks, block_size, n_kv_heads, head_dim\], "
                       r"got shape \[8, 16, 2, 4, 4\]"),
    "block_tables_rank_1": (dict(block_tables=i32(0, 1)), ValueError,
                            r"block_tables must be \[batch, max_blocks_per_seq\], "
                            r"got shape \[2\]"),
    "seq_lens_rank_2": (dict(seq_lens=i32([20, 30])), ValueError,
                        r"seq_lens must be \[batch\], got shape \[1, 2\]"),
    "cache_shapes": (dict(v_cache=torch.randn(9, 16, 2, 16)), ValueError,
                     r"k_cache and v_cache must have the same shape, got \[8, 16, 2, 16\] and "
                     r"\[9, 16, 2, 16\]"),
    "head_dim_mismatch": (dict(k_cache=torch.randn(8, 16, 2, 8), v_cache=torch.randn(8, 16, 2, 8)),
                          ValueError, "same head_dim, got 16 and 8"),
    "n_heads_not_multiple": (dict(k_cache=torch.randn(8, 16, 3, 16),
                                  v_cache=torch.randn(8, 16, 3, 16)), ValueError,
                             "n_heads must be a multiple of n_kv_heads, got n_heads=4 and "
                             "n_kv_heads=3"),
    "cu_seqlens_q_length": (dict(cu_seqlens_q=i32(0, 4)), ValueError,
                            r"cu_seqlens_q must have batch \+ 1 = 3 entries \(seq_lens has 2\), "
                            r"got 2"),
    "cu_seqlens_q_short_of_tokens": (dict(cu_seqlens_q=i32(0, 1, 3)), ValueError,
                                     r"cu_seqlens_q\[-1\]=3 must equal the number of packed "
                                     r"tokens, 4"),
    "over_max_seqlen_q": (dict(max_seqlen_q=2), ValueError,
                          r"sequence 1 has length 3 \(from cu_seqlens_q\), more than its "
                          r"max_seqlen 2"),
    "block_tables_rows": (dict(block_tables=i32([0, 1], [2, 3], [4, 5])), ValueError,
                          "block_tables has 3 rows but seq_lens has 2"),
    "k_cache_dtype": (dict(k_cache=torch.randn(8, 16, 2, 16, dtype=torch.bfloat16)), TypeError,
                      "v_cache has dtype torch.float32 but k_cache has dtype torch.bfloat16"),
    "v_cache_dtype": (dict(v_cache=torch.randn(8, 16, 2, 16, dtype=torch.float16)), TypeError,
                      "v_cache has dtype torch.float16 but k_cache has dtype torch.float32"),
    # A cache of another dtype than q's is a narrower one under float32 q, nothing else.
    "cache_wider_than_q": (dict(q=torch.randn(4, 4, 16, dtype=torch.bfloat16)), TypeError,
                           "k_cache has dtype torch.float32 but q has dtype torch.bfloat16; a "
                           "cache of another dtype than q's must be torch.bfloat16 or "
                           "torch.float16 under torch.float32 q"),
    "f16_cache_under_bf16_q": (dict(q=torch.randn(4, 4, 16, dtype=torch.bfloat16),
                                    k_cache=torch.randn(8, 16, 2, 16, dtype=torch.float16),
                                    v_cache=torch.randn(8, 16, 2, 16, dtype=torch.float16)),
                               TypeError, "k_cache has dtype torch.float16 but q has dtype "
                                          "torch.bfloat16"),
    "f64_cache": (dict(k_cache=torch.randn(8, 16, 2, 16, dtype=torch.float64),
                       v_cache=torch.randn(8, 16, 2, 16, dtype=torch.float64)), TypeError,
                  "k_cache must be torch.float32, torch.bfloat16 or torch.float16, got "
                  "torch.float64"),
    "q_float64": (dict(q=torch.randn(4, 4, 16, dtype=torch.float64),
                       k_cache=torch.randn(8, 16, 2, 16, dtype=torch.float64),
                       v_cache=torch.randn(8, 16, 2, 16, dtype=torch.float64)), TypeError,
                  "q must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    "block_size_0": (dict(k_cache=torch.randn(8, 0, 2, 16), v_cache=torch.randn(8, 0, 2, 16)),
                     ValueError, "block_size must be positive, got 0"),
    "window_below_minus_1": (dict(window_left=-2), ValueError,
                             r"window_left must be -1 \(no window\) or >= 0, got -2"),
    "softcap_negative": (dict(softcap=-1.0), ValueError, SOFTCAP_ERROR + "-1"),
    "softcap_nan": (dict(softcap=math.nan), ValueError, SOFTCAP_ERROR + "nan"),
    "softcap_inf": (dict(softcap=math.inf), ValueError, SOFTCAP_ERROR + "inf"),
    "softcap_past_float32": (dict(softcap=1e39), ValueError, SOFTCAP_ERROR + r"1e\+39"),
    "softcap_subnormal": (dict(softcap=1e-39), ValueError, SOFTCAP_ERROR + "1e-39"),
    "k_cache_on_meta": (dict(k_cache=torch.randn(8, 16, 2, 16, device="meta")), ValueError,
                        "k_cache is on meta but q is on cpu"),
    "v_cache_on_meta": (dict(v_cache=torch.randn(8, 16, 2, 16, device="meta")), ValueError,
                        "v_cache is on meta but q is on cpu"),
    "block_tables_on_meta": (dict(block_tables=i32([0, 1], [2, 3]).to("meta")), ValueError,
                             "block_tables is on meta but q is on cpu"),
    "seq_lens_on_meta": (dict(seq_lens=i32(20, 30).to("meta")), ValueError,
                         "seq_lens is on meta but q is on cpu"),
}


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", PAGED_ERRORS)
def test_paged_attention_bad_input(backend, case):
    changes, error, match = PAGED_ERRORS[case]
    inputs = paged_inputs()
    backend.ops.paged_attention(*inputs.values())  # the valid call passes
    inputs |= changes
    args = [inputs.pop(name) for name in ["q", "k_cache", "v_cache", "block_tables", "seq_lens",
                                          "cu_seqlens_q", "max_seqlen_q"]]
    with pytest.raises(error, match=match):
        backend.ops.paged_attention(*args, **inputs)
