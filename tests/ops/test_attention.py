"""The attention ops of every backend (conftest.py) against reference.attention.

Every case goes through ``check``: the op writes into a NaN-poisoned ``out`` (every element must
be written), the functional op must equal its ``out=`` op bit for bit, queries that see no key
must be exactly 0, and the result is judged against a float64 run of the reference: tight in
float32, flash-attention's 2x rule in bfloat16/float16.

The grids are covering arrays (tests/covering.py) over the backend and the case's parameters:
every pair of values meets in some case, so each backend runs every head dim, GQA group, mask
shape, mask, soft-cap, dtype, layout, length and thread count at least once. Always in: every
causal/window combination on the chunked-prefill shape for each backend (masks are where the
kernels differ most), and the CPU kernel's key splits (few tiles, thousands of keys) on one and
on the default threads for each shape. The simulator runs the tests marked ``cuda_sim``: its rows
of test_empty's array (every empty case, both masks) and the exact checks (window 0, a tiny
soft-cap, strided outputs) whole.
"""

import itertools
import math

import covering
import pytest
import torch

from conftest import Backend, assert_within_twice_plain_error, blind_rows, num_threads
from fastllm import ops
from fastllm.ops import reference

F32_TOL = 2e-5  # float32 kernel vs the float64 reference, atol and rtol
# Logit soft-cap: off, and Gemma 2's tanh cap at a value that bends the scores of unit-variance
# q and k (the scaled scores reach 3-5; with scale 0.5 well past the cap).
SOFTCAPS = [0.0, 5.0]


def make_inputs(lens_q, lens_k, n_heads, n_kv_heads, head_dim, dtype=torch.float32,
                device="cpu"):
    """Packed q [total_q, n_heads, head_dim], k and v, cu_seqlens and max lengths."""
    q = torch.randn(sum(lens_q), n_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), n_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return (q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device),
            max(lens_q, default=0), max(lens_k, default=0))


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def run(backend, q, k, v, cu_q, cu_k, max_q, max_k, *, out, **kwargs):
    """Runs the backend's attention writing into `out`; returns `out`."""
    backend.ops.attention_out(q, k, v, cu_q, cu_k, max_q, max_k, out=out, **kwargs)
    return out


def check(backend, q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """Runs one case on `backend` and checks it every way described in the module docstring."""
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    poisoned = torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device)
    out = run(backend, *args, out=poisoned, **kwargs)
    assert not out.isnan().any(), "some output elements were never written"
    assert torch.equal(backend.ops.attention(*args, **kwargs), out), "functional != out= result"

    # The oracle's ops are small; on one thread they do not wait on a descheduled worker when
    # the machine's cores are shared. The op under test ran above with the default threads.
    with num_threads(1):
        got = out.cpu().double()
        blind = blind_rows(cu_q.diff().tolist(), cu_k.diff().tolist(), kwargs.get("causal", True),
                           kwargs.get("window_left", -1))
        assert (got[blind] == 0).all(), "a query that sees no key must output exactly 0"

        expected = reference.attention(q.cpu().double(), k.cpu().double(), v.cpu().double(),
                                       cu_q.cpu(), cu_k.cpu(), max_q, max_k, **kwargs)
        if q.dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=F32_TOL, rtol=F32_TOL)
        else:
            plain = reference.attention(*args, **kwargs).cpu().double()
            assert_within_twice_plain_error(got, plain, expected)
    return out


@covering.grid(softcap=SOFTCAPS, head_dim=[64, 80, 128, 256, 67], group=[1, 2, 4, 7])
def test_head_dims_and_gqa(backend, head_dim, group, softcap):
    # Per sequence: 1 query against 9 keys (decode), 17 and 40 (prefill), 0 queries, 3 keys.
    check(backend, *make_inputs([1, 17, 0, 40], [9, 17, 3, 40], group * 2, 2, head_dim,
                                device=backend.device), softcap=softcap)


MASK_SHAPES = {  # (lens_q, lens_k)
    "prefill": ([17, 1, 0, 70], [17, 1, 0, 70]),
    "chunked_prefill": ([5, 17, 0, 30], [40, 17, 9, 100]),
    "decode": ([1, 1, 1, 1], [1, 90, 0, 17]),
    # Rows above the bottom-right diagonal, and a sequence with no keys at all, see nothing.
    "more_queries_than_keys": ([20, 9, 4], [5, 0, 4]),
}


@covering.grid(softcap=SOFTCAPS, shape=list(MASK_SHAPES), causal=[True, False],
               window_left=[-1, 0, 5, 64],
               edges=[dict(backend=backend, shape="chunked_prefill", causal=causal,
                           window_left=window_left)
                      for backend in ("cpu", "composite", "cuda") for causal in (True, False)
                      for window_left in (-1, 0, 5, 64)])
def test_causal_and_window_masks(backend, shape, causal, window_left, softcap):
    lens_q, lens_k = MASK_SHAPES[shape]
    check(backend, *make_inputs(lens_q, lens_k, 4, 2, 40, device=backend.device), causal=causal,
          window_left=window_left, softcap=softcap)


@pytest.mark.cuda_sim
def test_window_zero_copies_the_diagonal_value_of_the_kv_head(backend):
    # Independent of the reference: with window_left=0 each query sees exactly its diagonal key,
    # so its output is that key's value row, of kv head h // group, exactly.
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs([5, 3], [9, 3], 6, 2, 16,
                                                    device=backend.device)
    out = run(backend, q, k, v, cu_q, cu_k, max_q, max_k, window_left=0,
              out=torch.full_like(q, math.nan))
    diagonal_keys = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11], device=backend.device)
    expected = v[diagonal_keys].repeat_interleave(3, dim=1)  # head h reads kv head h // 3
    assert torch.equal(out, expected)


def test_queries_above_the_diagonal_are_zero(backend):
    # 3 queries, 1 key: bottom-right alignment lets only the last query see it.
    q, k, v, cu_q, cu_k, _, _ = make_inputs([3], [1], 2, 1, 8, device=backend.device)
    out = run(backend, q, k, v, cu_q, cu_k, 3, 1, out=torch.full_like(q, math.nan))
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.equal(out[2], v[0].expand(2, 8))


MASKS_64 = {"causal": (True, -1), "full": (False, -1), "window64": (True, 64)}


@covering.grid(softcap=SOFTCAPS, mask=list(MASKS_64))
def test_mixed_lengths_up_to_513(backend, mask, softcap):
    causal, window_left = MASKS_64[mask]
    check(backend, *make_inputs([513, 0, 17, 1], [513, 1, 17, 513], 4, 2, 128,
                                device=backend.device), causal=causal, window_left=window_left,
          softcap=softcap)


@covering.grid(softcap=[*SOFTCAPS, 0.5], scale=[0.0, 0.05, 0.5, -0.3])
def test_custom_scale(backend, scale, softcap):
    check(backend, *make_inputs([17, 30], [20, 30], 4, 2, 64, device=backend.device), scale=scale,
          softcap=softcap)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("causal, window_left", [(True, -1), (False, -1), (True, 5)])
def test_tiny_softcap_averages_the_visible_values(backend, causal, window_left):
    # Independent of the reference: softcap * tanh(s / softcap) is within softcap of 0, so with
    # a softcap of 1e-30 every visible key weighs the same and each query's output is the mean
    # of the value rows it sees (of kv head h // group).
    lens_q, lens_k = [5, 1, 3], [9, 1, 70]
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(lens_q, lens_k, 6, 2, 32,
                                                    device=backend.device)
    out = run(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_left=window_left,
              softcap=1e-30, scale=3.0, out=torch.full_like(q, math.nan))
    expected = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
        k0 = int(cu_k[b])
        for i in range(len_q):
            diag = i + len_k - len_q
            last = min(len_k - 1, diag) if causal else len_k - 1
            first = max(0, diag - window_left) if window_left >= 0 else 0
            if first <= last:
                mean = v[k0 + first:k0 + last + 1].cpu().double().mean(0)  # [n_kv, head_dim]
                expected[row] = mean.repeat_interleave(3, dim=0)
            row += 1
    torch.testing.assert_close(out.cpu().double(), expected, atol=F32_TOL, rtol=F32_TOL)


@covering.grid(softcap=SOFTCAPS, dtype=[torch.float32, torch.bfloat16],
               layout=["fused_qkv", "strided_head_dim", "heads_major"])
def test_strided_inputs(backend, dtype, layout, softcap):
    lens = [17, 1, 0, 40]
    n_heads, n_kv_heads, head_dim, tokens = 8, 2, 64, sum(lens)

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=backend.device)

    if layout == "fused_qkv":  # slices of one QKV projection output
        qkv = randn(tokens, n_heads + 2 * n_kv_heads, head_dim)
        q, k, v = qkv.split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    elif layout == "strided_head_dim":  # head_dim stride 2 and 3
        q = randn(tokens, n_heads, 2 * head_dim)[..., ::2]
        k = randn(tokens, n_kv_heads, 3 * head_dim)[..., 1::3]
        v = randn(tokens, n_kv_heads, 2 * head_dim)[..., 1::2]
    else:  # [heads, tokens, head_dim] storage
        q = randn(n_heads, tokens, head_dim).transpose(0, 1)
        k = randn(n_kv_heads, tokens, head_dim).transpose(0, 1)
        v = randn(n_kv_heads, tokens, head_dim).transpose(0, 1)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    cu = cu_seqlens(lens, backend.device)
    check(backend, q, k, v, cu, cu, max(lens), max(lens), softcap=softcap)


# (buffer shape, view of the buffer) given the output's shape (tokens, heads, head_dim)
OUT_VIEWS = {
    "slice": (lambda t, h, d: (t + 6, h + 2, d + 5),
              lambda b, t, h, d: b[3:t + 3, 1:h + 1, 2:d + 2]),
    "every_other": (lambda t, h, d: (t, h, 2 * d), lambda b, t, h, d: b[..., 1::2]),
    "heads_major": (lambda t, h, d: (h, t, d), lambda b, t, h, d: b.transpose(0, 1)),
}


@pytest.mark.cuda_sim
@pytest.mark.parametrize("view", OUT_VIEWS)
def test_out_into_strided_view(backend, view):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs([17, 1, 0, 40], [20, 1, 3, 40], 4, 2, 48,
                                                    device=backend.device)
    buffer_shape, take_view = OUT_VIEWS[view]
    buffer = torch.full(buffer_shape(*q.shape), math.nan, device=backend.device)
    out = take_view(buffer, *q.shape)
    run(backend, q, k, v, cu_q, cu_k, max_q, max_k, out=out)

    inside = torch.zeros(buffer.shape, dtype=torch.bool, device=backend.device)
    take_view(inside, *q.shape).fill_(True)
    assert buffer[~inside].isnan().all(), "wrote outside the out view"
    assert not out.isnan().any()
    expected = reference.attention(q.cpu().double(), k.cpu().double(), v.cpu().double(),
                                   cu_q.cpu(), cu_k.cpu(), max_q, max_k)
    torch.testing.assert_close(out.cpu().double(), expected, atol=F32_TOL, rtol=F32_TOL)


EMPTY = {  # (lens_q, lens_k)
    "zero_tokens": ([0, 0], [0, 0]),
    "no_sequences": ([], []),  # cu_seqlens = [0]
    "no_queries": ([0, 0], [5, 3]),
    "no_keys": ([3, 2], [0, 0]),  # every query sees nothing: all zeros
}


@pytest.mark.cuda_sim
@covering.grid(softcap=SOFTCAPS, case=list(EMPTY), causal=[True, False])
def test_empty(backend, case, causal, softcap):
    lens_q, lens_k = EMPTY[case]
    out = check(backend, *make_inputs(lens_q, lens_k, 4, 2, 32, device=backend.device),
                causal=causal, softcap=softcap)
    assert out.shape == (sum(lens_q), 4, 32)


LONG_KEYS = {"decode_batch1": ([1], [3000]), "decode_batch3": ([1, 1, 1], [3000, 0, 2500]),
             "chunk40": ([40], [3000])}  # (lens_q, lens_k)


@covering.grid(threads=[1, None], shape=list(LONG_KEYS), window_left=[-1, 1500],
               softcap=SOFTCAPS,
               ids={"threads": lambda threads: "default_threads" if threads is None
                    else f"{threads}_thread"},
               edges=[dict(backend="cpu", threads=threads, shape=shape)
                      for threads in (1, None) for shape in LONG_KEYS])
def test_long_keys_few_tiles(backend, threads, shape, window_left, softcap):
    # Few (sequence, kv head) tiles with thousands of keys: the CPU kernel splits the keys across
    # threads and merges partial softmaxes, in a way that depends on the thread count.
    lens_q, lens_k = LONG_KEYS[shape]
    with num_threads(threads):
        check(backend, *make_inputs(lens_q, lens_k, 4, 1, 64, device=backend.device),
              window_left=window_left, softcap=softcap)


MASKS_100 = {"causal": (True, -1), "full": (False, -1), "window100": (True, 100)}


@covering.grid(softcap=SOFTCAPS, mask=list(MASKS_100))
def test_prefill_spanning_several_tiles(backend, mask, softcap):
    causal, window_left = MASKS_100[mask]
    # 600 positions x 2 heads: several query tiles, each against several key tiles.
    check(backend, *make_inputs([600], [600], 2, 1, 64, device=backend.device), causal=causal,
          window_left=window_left, softcap=softcap)


LOW_PRECISION_SHAPES = {  # (lens_q, lens_k, head_dim)
    "prefill": ([0, 1, 17, 100], [0, 1, 17, 100], 64),
    "chunked_and_above_diagonal": ([5, 20, 3], [40, 3, 0], 67),
    "decode": ([1, 1], [3000, 700], 128),
}
MASKS_5 = {"causal": (True, -1), "full": (False, -1), "window5": (True, 5)}


@covering.grid(softcap=SOFTCAPS, dtype=[torch.bfloat16, torch.float16],
               shape=list(LOW_PRECISION_SHAPES), mask=list(MASKS_5))
def test_low_precision(backend, dtype, shape, mask, softcap):
    lens_q, lens_k, head_dim = LOW_PRECISION_SHAPES[shape]
    causal, window_left = MASKS_5[mask]
    check(backend, *make_inputs(lens_q, lens_k, 4, 2, head_dim, dtype=dtype,
                                device=backend.device), causal=causal, window_left=window_left,
          softcap=softcap)


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, window_left, dtype, softcap", [
    (9, 3, 64, -1, torch.bfloat16, 0.0),     # SmolLM2's heads
    (16, 8, 128, 100, torch.float32, 0.0),   # Qwen3's, a sliding window
    (4, 4, 64, -1, torch.float16, 0.0),
    (4, 2, 8, 37, torch.bfloat16, 0.0),      # head_dim below a vector: the GEMM tiles
    (8, 4, 256, 50, torch.bfloat16, 5.0),    # Gemma 2's heads: a window and a soft-cap
], ids=str)
def test_batch_invariant_rows_equal_prefill_batch_and_decode(n_heads, n_kv_heads, head_dim,
                                                             window_left, dtype, softcap):
    """Under ops.batch_invariant() a query row's output is bit for bit the same whether its
    sequence is prefilled in one call, sits in a batch with others, or the row is decoded alone
    (its one query against its keys so far); and the batch is still reference-close."""
    lens = [300, 37, 600, 5]  # one prefill each; 600 keys cross key blocks of 256
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(lens, lens, n_heads, n_kv_heads, head_dim,
                                                    dtype)
    cpu = Backend("cpu", torch.ops.fastllm, torch.device("cpu"))
    kwargs = dict(causal=True, window_left=window_left, softcap=softcap)
    with ops.batch_invariant():
        batch = check(cpu, q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        for b, length in enumerate(lens):
            start = int(cu_q[b])
            rows = slice(start, start + length)
            alone = ops.attention(q[rows], k[rows], v[rows], cu_seqlens([length]),
                                  cu_seqlens([length]), length, length, **kwargs)
            assert torch.equal(alone, batch[rows])
            for p in (0, length // 2, length - 1):  # decoded: one query, keys 0..p
                one = ops.attention(q[start + p:start + p + 1], k[start:start + p + 1],
                                    v[start:start + p + 1], cu_seqlens([1]),
                                    cu_seqlens([p + 1]), 1, p + 1, **kwargs)
                assert torch.equal(one[0], batch[start + p]), (b, p)
