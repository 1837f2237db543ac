"""The reshape_and_cache op of every backend (conftest.py) against reference.reshape_and_cache.

The caches start as NaN, so a result equal to the reference (NaN where the reference left NaN)
shows that exactly the mapped slots were written, with exactly the token's rows: a copy is
exact in every dtype, and float32 rows written into a bfloat16 / float16 cache are rounded as
``Tensor.to`` rounds them. Negative slots (padding) write nothing.
"""

import math

import covering
import pytest
import torch

from conftest import num_threads
from fastllm.ops import reference

EXACT = dict(rtol=0, atol=0, equal_nan=True)


def random_slots(tokens, num_slots, n_padding, device):
    """int64 [tokens]: distinct slots in random order, n_padding of them negative."""
    mapping = torch.randperm(num_slots)[:tokens]
    padding = torch.randperm(tokens)[:n_padding]
    negative = torch.tensor([-1, -7, -(2**62)] * n_padding, dtype=torch.long)
    mapping[padding] = negative[:n_padding]
    return mapping.to(device)


def make_caches(layout, num_blocks, block_size, n_kv_heads, head_dim, dtype, device):
    """NaN caches [num_blocks, block_size, n_kv_heads, head_dim] (views, for some layouts) and
    the storage they live in, with NaN outside them too."""
    shape = (num_blocks, block_size, n_kv_heads, head_dim)

    @num_threads(1)
    def nan(*size):
        return torch.full(size, math.nan, dtype=dtype, device=device)

    if layout == "contiguous":
        k_cache, v_cache = nan(*shape), nan(*shape)
        return k_cache, v_cache, [k_cache, v_cache]
    if layout == "fused_kv_pool":  # [num_blocks, block_size, 2, n_kv_heads, head_dim]
        pool = nan(num_blocks, block_size, 2, n_kv_heads, head_dim)
        return pool[:, :, 0], pool[:, :, 1], [pool]
    if layout == "head_dim_slice":  # K and V side by side in each row, then 3 unused channels
        pool = nan(num_blocks, block_size, n_kv_heads, 2 * head_dim + 3)
        return pool[..., :head_dim], pool[..., head_dim:2 * head_dim], [pool]
    if layout == "head_dim_stride_2":
        k_pool, v_pool = nan(*shape[:3], 2 * head_dim), nan(*shape[:3], 2 * head_dim)
        return k_pool[..., ::2], v_pool[..., 1::2], [k_pool, v_pool]
    assert layout == "heads_major"  # [num_blocks, n_kv_heads, block_size, head_dim] storage
    heads_major = (num_blocks, n_kv_heads, block_size, head_dim)
    k_pool, v_pool = nan(*heads_major), nan(*heads_major)
    return k_pool.transpose(1, 2), v_pool.transpose(1, 2), [k_pool, v_pool]


def check(backend, key, value, k_cache, v_cache, slot_mapping):
    """Writes on `backend` and compares the caches with the reference's, exactly.

    Only the kernels run with the caller's threads, as they do in use; everything else (the
    composite, what MPS runs, included) runs on one: on the CPU, small ATen ops would wait on
    descheduled workers when the machine's cores are shared."""
    with num_threads(1):
        expected_k, expected_v = reference.reshape_and_cache(key, value, k_cache, v_cache,
                                                             slot_mapping)
    with num_threads(1 if backend.name == "composite" else None):
        result = backend.ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    assert result is None
    with num_threads(1):
        torch.testing.assert_close(k_cache, expected_k, **EXACT)
        torch.testing.assert_close(v_cache, expected_v, **EXACT)


@covering.grid(dtype=[torch.float32, torch.bfloat16, torch.float16], block_size=[1, 16],
               rows=[(1, 0), (37, 5), (300, 20)])
def test_matches_reference(backend, dtype, block_size, rows):
    """Every pair of backend, dtype, block size and (tokens, padding) meets in some case
    (tests/covering.py)."""
    device = backend.device
    tokens, n_padding = rows
    n_kv_heads, head_dim, num_slots = 2, 32, 320  # 300 tokens: several parallel chunks
    key = torch.randn(tokens, n_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    k_cache, v_cache, _ = make_caches("contiguous", num_slots // block_size, block_size,
                                      n_kv_heads, head_dim, dtype, device)
    slot_mapping = random_slots(tokens, num_slots, n_padding, device)
    check(backend, key, value, k_cache, v_cache, slot_mapping)
    with num_threads(1):
        for cache in (k_cache, v_cache):  # the mapped slots were written, each entirely
            written = cache.flatten(0, 1).isnan().flatten(1).logical_not().all(1)
            assert written.sum() == tokens - n_padding


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fused_kv_pool", "head_dim_slice", "head_dim_stride_2",
                                    "heads_major"])
def test_strided_rows_and_caches(backend, dtype, layout):
    device = backend.device
    # key and value are slices of a fused QKV projection; the caches views of bigger storage.
    tokens, n_heads, n_kv_heads, head_dim, block_size = 23, 4, 2, 32, 4
    qkv = torch.randn(tokens, n_heads + 2 * n_kv_heads, head_dim, dtype=dtype, device=device)
    _, key, value = qkv.split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    k_cache, v_cache, storage = make_caches(layout, 9, block_size, n_kv_heads, head_dim, dtype,
                                            device)
    assert not any(t.is_contiguous() for t in (key, value, k_cache, v_cache))
    slot_mapping = random_slots(tokens, 9 * block_size, 3, device)
    if layout == "head_dim_stride_2" and backend.name in ("cuda", "cuda_sim"):
        # The CUDA kernel's layout contract: the caches' head_dim is dense.
        with pytest.raises(ValueError, match="dense head_dim"):
            backend.ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    before = [s.clone() for s in storage]
    check(backend, key, value, k_cache, v_cache, slot_mapping)

    # Nothing was written outside the cache views.
    for s, b in zip(storage, before):
        inside = torch.zeros(s.shape, dtype=torch.bool, device=device)
        for cache in (k_cache, v_cache):
            if cache.untyped_storage().data_ptr() == s.untyped_storage().data_ptr():
                inside.as_strided(cache.shape, cache.stride(),
                                  cache.storage_offset() - s.storage_offset()).fill_(True)
        torch.testing.assert_close(s[~inside], b[~inside], **EXACT)


def rounding_rows(tokens, n_kv_heads, head_dim, device):
    """float32 rows [tokens, n_kv_heads, head_dim] that exercise rounding to 16 bits: ties,
    values past float16's range and below its normal range, signed zeros, inf and NaN."""
    rows = torch.randn(tokens, n_kv_heads, head_dim, device=device)
    rows *= torch.logspace(-9, 6, head_dim, device=device)  # subnormal to overflowing
    special = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65520.0,
                            -0.0, math.inf, -math.inf, math.nan], device=device)
    rows.view(-1)[:len(special)] = special
    return rows


@pytest.mark.cuda_sim
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "fused_kv_pool", "head_dim_stride_2"])
def test_float32_rows_into_narrower_cache(backend, cache_dtype, layout):
    device = backend.device
    # kv_cache_dtype: float32 K/V (slices of a fused QKV output) rounded into 16-bit caches.
    tokens, n_heads, n_kv_heads, head_dim, block_size = 37, 4, 2, 32, 4
    qkv = torch.cat([torch.randn(tokens, n_heads, head_dim, device=device),
                     rounding_rows(tokens, 2 * n_kv_heads, head_dim, device)], dim=1)
    _, key, value = qkv.split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    k_cache, v_cache, _ = make_caches(layout, 12, block_size, n_kv_heads, head_dim, cache_dtype,
                                      device)
    slot_mapping = random_slots(tokens, 12 * block_size, 4, device)
    if layout == "head_dim_stride_2" and backend.name in ("cuda", "cuda_sim"):
        return  # the CUDA layout contract (test_strided_rows_and_caches)
    check(backend, key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0  # and independently of the reference: the rows as .to rounds them
    slots = slot_mapping[keep]
    written = k_cache[slots // block_size, slots % block_size]
    torch.testing.assert_close(written, key[keep].to(cache_dtype), **EXACT)


@pytest.mark.cuda_sim
def test_overwrites_and_keeps_previous_values(backend):
    device = backend.device
    # Finite previous contents: written slots get the new rows, every other slot keeps its own.
    key, value = torch.randn(6, 2, 8, device=device), torch.randn(6, 2, 8, device=device)
    k_cache, v_cache = torch.randn(4, 4, 2, 8, device=device), torch.randn(4, 4, 2, 8,
                                                                           device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.tensor([15, -1, 0, 6, -1, 5], device=device)
    check(backend, key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache[3, 3], key[0]) and torch.equal(v_cache[1, 2], value[3])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[15, 0, 6, 5]] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], k_before.flatten(0, 1)[untouched])
    assert torch.equal(v_cache.flatten(0, 1)[untouched], v_before.flatten(0, 1)[untouched])


@pytest.mark.cuda_sim
@pytest.mark.parametrize("slot_mapping", [[], [-1, -1, -3]], ids=["no_tokens", "all_padding"])
def test_nothing_to_write(backend, slot_mapping):
    device = backend.device
    key = torch.randn(len(slot_mapping), 2, 8, device=device)
    k_cache, v_cache = torch.randn(3, 4, 2, 8, device=device), torch.randn(3, 4, 2, 8,
                                                                           device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    backend.ops.reshape_and_cache(key, key.clone(), k_cache, v_cache,
                               torch.tensor(slot_mapping, dtype=torch.long, device=device))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


# id: (tokens, n_kv_heads, head_dim, num_blocks, block_size, dtype, padding, layout)
OPCHECK_CASES = {
    "f32": (7, 2, 16, 4, 4, torch.float32, 0, "contiguous"),
    "bf16_padding": (9, 1, 24, 3, 16, torch.bfloat16, 3, "contiguous"),
    "f16_block_size_1_strided": (5, 2, 8, 12, 1, torch.float16, 1, "fused_kv_pool"),
    "f32_into_f16": (7, 2, 16, 4, 4, (torch.float32, torch.float16), 2, "contiguous"),
    "f32_into_bf16_strided": (6, 2, 8, 5, 2, (torch.float32, torch.bfloat16), 1,
                              "fused_kv_pool"),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_reshape_and_cache(backend, case):
    device = backend.device
    tokens, n_kv_heads, head_dim, num_blocks, block_size, dtypes, padding, layout = \
        OPCHECK_CASES[case]
    dtype, cache_dtype = dtypes if isinstance(dtypes, tuple) else (dtypes, dtypes)
    key = torch.randn(tokens, n_kv_heads, head_dim, dtype=dtype, device=device)
    k_cache, v_cache, _ = make_caches(layout, num_blocks, block_size, n_kv_heads, head_dim,
                                      cache_dtype, device)
    k_cache.zero_(), v_cache.zero_()  # opcheck compares caches with ==, which NaN never passes
    slot_mapping = random_slots(tokens, num_blocks * block_size, padding, device)
    torch.library.opcheck(backend.ops.reshape_and_cache.default,
                          (key, torch.randn_like(key), k_cache, v_cache, slot_mapping))


def write_inputs():
    """A valid call: 5 tokens (one padding) into 4 blocks of 16 slots, 2 kv heads, head_dim 8."""
    return dict(key=torch.randn(5, 2, 8), value=torch.randn(5, 2, 8),
                k_cache=torch.zeros(4, 16, 2, 8), v_cache=torch.zeros(4, 16, 2, 8),
                slot_mapping=torch.tensor([0, 5, -1, 63, 17]))


_ONE_CACHE = torch.zeros(4, 16, 2, 8)  # passed as both caches, or as a cache and an input
_POOL = torch.zeros(7, 16, 2, 8)  # k_cache = blocks 0-3, v_cache = blocks 3-6: block 3 in both

# id: (changes to the valid call, exception, pattern its message must match)
WRITE_ERRORS = {
    # Slots 0 and 5 come before the bad one: a kernel that wrote as it checked would change them.
    "slot_past_cache": (dict(slot_mapping=torch.tensor([0, 5, -1, 64, 17])), ValueError,
                        r"slot_mapping\[3\]=64 is past the cache's 64 slots"),
    "slot_far_past_cache": (dict(slot_mapping=torch.tensor([0, 5, -1, 6, 2**40])), ValueError,
                            rf"slot_mapping\[4\]={2**40} is past the cache's 64 slots"),
    "slot_mapping_int32": (dict(slot_mapping=torch.tensor([0, 5, -1, 6, 17], dtype=torch.int32)),
                           TypeError, "slot_mapping must be torch.int64, got torch.int32"),
    "slot_mapping_length": (dict(slot_mapping=torch.tensor([0, 5, -1, 6])), ValueError,
                            "slot_mapping has 4 slots but key has 5 tokens"),
    "slot_mapping_rank_2": (dict(slot_mapping=torch.tensor([[0, 5, -1, 6, 17]])), ValueError,
                            r"slot_mapping must be \[tokens\], got shape \[1, 5\]"),
    "key_value_tokens": (dict(value=torch.randn(6, 2, 8)), ValueError,
                         r"key and value must have the same shape, got \[5, 2, 8\] and "
                         r"\[6, 2, 8\]"),
    "key_value_heads": (dict(value=torch.randn(5, 1, 8)), ValueError,
                        r"key and value must have the same shape, got \[5, 2, 8\] and "
                        r"\[5, 1, 8\]"),
    "heads_vs_cache": (dict(key=torch.randn(5, 1, 8), value=torch.randn(5, 1, 8)), ValueError,
                       r"key rows \[n_kv_heads, head_dim\] = \[1, 8\] do not match the cache's "
                       r"\[2, 8\]"),
    "head_dim_vs_cache": (dict(key=torch.randn(5, 2, 4), value=torch.randn(5, 2, 4)), ValueError,
                          r"key rows \[n_kv_heads, head_dim\] = \[2, 4\] do not match the "
                          r"cache's \[2, 8\]"),
    "key_dtype": (dict(key=torch.randn(5, 2, 8, dtype=torch.bfloat16)), TypeError,
                  "value has dtype torch.float32 but key has dtype torch.bfloat16"),
    "value_dtype": (dict(value=torch.randn(5, 2, 8, dtype=torch.float16)), TypeError,
                    "value has dtype torch.float16 but key has dtype torch.float32"),
    # Another cache dtype than key's is a narrower one under float32 rows, nothing else.
    "cache_wider_than_key": (dict(key=torch.randn(5, 2, 8, dtype=torch.bfloat16),
                                  value=torch.randn(5, 2, 8, dtype=torch.bfloat16)), TypeError,
                             "k_cache has dtype torch.float32 but key has dtype torch.bfloat16; "
                             "a cache of another dtype than key's must be torch.bfloat16 or "
                             "torch.float16 under torch.float32 key"),
    "bf16_rows_into_f16_cache": (dict(key=torch.randn(5, 2, 8, dtype=torch.bfloat16),
                                      value=torch.randn(5, 2, 8, dtype=torch.bfloat16),
                                      k_cache=torch.zeros(4, 16, 2, 8, dtype=torch.float16),
                                      v_cache=torch.zeros(4, 16, 2, 8, dtype=torch.float16)),
                                 TypeError, "k_cache has dtype torch.float16 but key has dtype "
                                            "torch.bfloat16"),
    "key_float64": (dict(key=torch.randn(5, 2, 8).double(), value=torch.randn(5, 2, 8).double()),
                    TypeError, "key must be torch.float32, torch.bfloat16 or torch.float16, got "
                               "torch.float64"),
    "v_cache_dtype": (dict(v_cache=torch.zeros(4, 16, 2, 8, dtype=torch.float16)), TypeError,
                      "v_cache has dtype torch.float16 but k_cache has dtype torch.float32"),
    "float64": (dict(key=torch.randn(5, 2, 8).double(), value=torch.randn(5, 2, 8).double(),
                     k_cache=torch.zeros(4, 16, 2, 8).double(),
                     v_cache=torch.zeros(4, 16, 2, 8).double()), TypeError,
                "k_cache must be torch.float32, torch.bfloat16 or torch.float16, got "
                "torch.float64"),
    "cache_shapes": (dict(v_cache=torch.zeros(4, 8, 2, 8)), ValueError,
                     r"k_cache and v_cache must have the same shape, got \[4, 16, 2, 8\] and "
                     r"\[4, 8, 2, 8\]"),
    "key_rank_2": (dict(key=torch.randn(5, 16)), ValueError,
                   r"key must be \[tokens, n_kv_heads, head_dim\], got shape \[5, 16\]"),
    "k_cache_rank_3": (dict(k_cache=torch.zeros(64, 2, 8)), ValueError,
                       r"k_cache must be \[num_blocks, block_size, n_kv_heads, head_dim\], "
                       r"got shape \[64, 2, 8\]"),
    "key_on_meta": (dict(key=torch.randn(5, 2, 8, device="meta")), ValueError,
                    "key is on meta but k_cache is on cpu"),
    "v_cache_on_meta": (dict(v_cache=torch.zeros(4, 16, 2, 8, device="meta")), ValueError,
                        "v_cache is on meta but k_cache is on cpu"),
    "slot_mapping_on_meta": (dict(slot_mapping=torch.tensor([0, 5, -1, 6, 17], device="meta")),
                             ValueError, "slot_mapping is on meta but k_cache is on cpu"),
    # Written in place: the V rows would overwrite the K rows, or a slot be reached twice.
    "v_cache_is_k_cache": (dict(k_cache=_ONE_CACHE, v_cache=_ONE_CACHE), ValueError,
                           "k_cache and v_cache must not share memory"),
    "v_cache_overlaps_k_cache": (dict(k_cache=_POOL[:4], v_cache=_POOL[3:]), ValueError,
                                 "k_cache and v_cache must not share memory"),
    "k_cache_expanded": (dict(k_cache=torch.zeros(1, 16, 2, 8).expand(4, 16, 2, 8)), ValueError,
                         r"k_cache must not have overlapping elements \(e.g. an expanded "
                         r"tensor\)"),
    "v_cache_expanded": (dict(v_cache=torch.zeros(4, 1, 2, 8).expand(4, 16, 2, 8)), ValueError,
                         "v_cache must not have overlapping elements"),
    "key_inside_k_cache": (dict(k_cache=_ONE_CACHE, key=_ONE_CACHE[1, :5]), ValueError,
                           "k_cache and key must not share memory"),
    "value_inside_v_cache": (dict(v_cache=_ONE_CACHE, value=_ONE_CACHE[0, 3:8]), ValueError,
                             "v_cache and value must not share memory"),
}


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", WRITE_ERRORS)
def test_reshape_and_cache_bad_input_leaves_caches_unchanged(backend, case):
    changes, error, match = WRITE_ERRORS[case]
    inputs = write_inputs()
    backend.ops.reshape_and_cache(*inputs.values())  # the valid call passes
    inputs |= changes
    caches = [c for c in (inputs["k_cache"], inputs["v_cache"]) if not c.is_meta]
    before = [c.clone() for c in caches]
    with pytest.raises(error, match=match):
        backend.ops.reshape_and_cache(*inputs.values())
    for cache, b in zip(caches, before):
        assert torch.equal(cache, b), "a rejected call wrote into the cache"
