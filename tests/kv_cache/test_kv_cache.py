"""fastllm.kv_cache: pool sizing, StaticKVCache and PagedKVCache."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from fastllm.kv_cache import (KVCacheSpec, KVPoolPlan, PagedKVCache, StaticKVCache, plan_pool,
                              zeros_pool)

QWEN3_0_6B = KVCacheSpec(num_layers=28, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
SMALL = KVCacheSpec(num_layers=3, n_kv_heads=2, head_dim=5, dtype=torch.float32, block_size=4)


def test_bytes_per_token_and_block():
    assert QWEN3_0_6B.bytes_per_token == 114_688  # 2 * 28 * 8 * 128 * 2
    assert QWEN3_0_6B.block_size == 16 and QWEN3_0_6B.bytes_per_block == 16 * 114_688
    assert SMALL.bytes_per_token == 2 * 3 * 2 * 5 * 4


@pytest.mark.parametrize("field, value, match", [
    ("num_layers", 0, "num_layers must be a positive int, got 0"),
    ("n_kv_heads", -1, "n_kv_heads must be a positive int, got -1"),
    ("head_dim", 2.0, "head_dim must be a positive int, got 2.0"),
    ("block_size", 0, "block_size must be a positive int, got 0"),
    ("dtype", "bfloat16", "dtype must be a torch.dtype, got 'bfloat16'"),
])
def test_bad_spec(field, value, match):
    fields = dict(num_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=16)
    with pytest.raises(ValueError, match=match):
        KVCacheSpec(**{**fields, field: value})


def test_plan_from_workload_rounds_each_sequence_up_to_blocks():
    plan = plan_pool(QWEN3_0_6B, max_num_seqs=4, max_model_len=100)  # 100 tokens: 7 blocks
    assert plan == KVPoolPlan(num_blocks=28, block_size=16, nbytes=28 * 16 * 114_688,
                              bytes_per_token=114_688, max_tokens=448)
    assert plan.describe() == ("28 blocks x 16 tokens = 448 tokens of KV at 114,688 bytes each: "
                               "49.00 MiB (51,380,224 bytes)")
    assert plan_pool(QWEN3_0_6B, max_num_seqs=1, max_model_len=32).num_blocks == 2


def test_plan_from_memory_budget():
    block = QWEN3_0_6B.bytes_per_block
    plan = plan_pool(QWEN3_0_6B, memory_bytes=10 * block + block - 1)
    assert plan.num_blocks == 10 and plan.nbytes == 10 * block and plan.max_tokens == 160
    big = plan_pool(QWEN3_0_6B, memory_bytes=8 * 2**30)
    assert big.num_blocks == 8 * 2**30 // block and big.describe().endswith(
        f"{big.nbytes / 2**30:.2f} GiB ({big.nbytes:,} bytes)")


@pytest.mark.parametrize("kwargs, match", [
    ({}, "either max_num_seqs and max_model_len, or memory_bytes"),
    ({"max_num_seqs": 2, "max_model_len": 64, "memory_bytes": 2**30}, "either"),
    ({"max_num_seqs": 2, "memory_bytes": 2**30}, "either"),
    ({"max_num_seqs": 2}, "needs both max_num_seqs and max_model_len"),
    ({"max_model_len": 64}, "needs both"),
    ({"max_num_seqs": 0, "max_model_len": 64}, "must be positive, got max_num_seqs=0"),
    ({"max_num_seqs": 2, "max_model_len": -1}, "must be positive.*max_model_len=-1"),
    ({"memory_bytes": 1_835_007}, "memory_bytes=1835007 holds no block of 1,835,008 bytes"),
])
def test_bad_plan(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_pool(QWEN3_0_6B, **kwargs)


def test_static_cache_writes_in_place(device):
    cache = StaticKVCache(SMALL, max_batch=2, max_len=8, device=device)
    assert cache.nbytes == 2 * 3 * 2 * 8 * 2 * 5 * 4
    assert cache.k_cache.shape == (3, 2, 8, 2, 5) and cache.k_cache.device.type == device.type
    pointers = (cache.k_cache.data_ptr(), cache.v_cache.data_ptr())
    k, v = torch.randn(2, 8, 2, 5, device=device), torch.randn(2, 8, 2, 5, device=device)
    for batch_index in (0, 1):
        cache.write(1, batch_index, 0, k[batch_index, :5], v[batch_index, :5])  # a prefill
    for position in (5, 6):  # decode steps in row 1
        cache.write(1, 1, position, k[1, position:position + 1], v[1, position:position + 1])
    assert cache.lengths == [5, 7]
    assert torch.equal(cache.keys(1, 0), k[0, :5]) and torch.equal(cache.values(1, 1), v[1, :7])
    assert torch.equal(cache.keys(1, 1, 3), k[1, :3])
    assert (cache.k_cache.data_ptr(), cache.v_cache.data_ptr()) == pointers
    assert cache.keys(1, 1).data_ptr() == cache.k_cache[1, 1].data_ptr()  # a view
    assert cache.k_cache[0].abs().sum() == 0 and cache.k_cache[2].abs().sum() == 0

    # Overwriting from an earlier position (a rejected draft, say) keeps the longer length.
    cache.write(1, 1, 2, k[0, :2], v[0, :2])
    assert cache.lengths == [5, 7] and torch.equal(cache.keys(1, 1, 4)[2:], k[0, :2])
    cache.reset(1)
    assert cache.lengths == [5, 0] and cache.keys(1, 1).shape == (0, 2, 5)
    cache.write(0, 1, 0, k[0], v[0])  # the whole row
    assert cache.lengths == [5, 8] and torch.equal(cache.keys(0, 1), k[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrower_caches_take_float32_rows_rounded(dtype):
    spec = dataclasses.replace(SMALL, dtype=dtype)
    assert spec.bytes_per_token * 2 == SMALL.bytes_per_token  # twice the tokens per byte
    cache = StaticKVCache(spec, max_batch=1, max_len=8)
    k, v = torch.randn(4, 2, 5) * 1e3, torch.randn(4, 2, 5)
    cache.write(2, 0, 0, k, v)
    assert torch.equal(cache.keys(2, 0), k.to(dtype)) and torch.equal(cache.values(2, 0),
                                                                        v.to(dtype))
    with pytest.raises(TypeError, match=f"the {dtype} cache serves"):
        cache.write(2, 0, 0, k.double(), v.double())


def test_static_cache_errors():
    cache = StaticKVCache(SMALL, max_batch=2, max_len=8)
    kv = torch.zeros(3, 2, 5)
    cache.write(0, 0, 0, kv, kv)
    cache.write(0, 0, 3, kv, kv)
    with pytest.raises(ValueError, match="writing 3 positions at 6 reaches 9, past max_len=8"):
        cache.write(0, 0, 6, kv, kv)
    with pytest.raises(ValueError, match=r"start=7 must be in \[0, 6\]"):
        cache.write(0, 0, 7, kv[:1], kv[:1])
    with pytest.raises(ValueError, match=r"k and v must be \[n, 2, 5\] alike, got \(3, 5, 2\)"):
        cache.write(0, 0, 0, kv.transpose(1, 2), kv.transpose(1, 2))
    with pytest.raises(ValueError, match=r"got \(3, 2, 5\) and \(2, 2, 5\)"):
        cache.write(0, 0, 0, kv, kv[:2])
    with pytest.raises(ValueError, match=r"got \(2, 5\)"):
        cache.write(0, 0, 0, kv[0], kv[0])
    with pytest.raises(TypeError, match=r"share a dtype the torch.float32 cache serves \(its own, "
                                        r"or float32 for a 16-bit cache\), got torch.float64"):
        cache.write(0, 0, 0, kv.double(), kv.double())
    with pytest.raises(TypeError, match="got torch.bfloat16 and torch.bfloat16"):
        cache.write(0, 0, 0, kv.bfloat16(), kv.bfloat16())  # wider cache: no
    with pytest.raises(TypeError, match="got torch.float32 and torch.float16"):
        cache.write(0, 0, 0, kv, kv.half())
    with pytest.raises(ValueError, match=r"layer 3 is not in \[0, 3\)"):
        cache.write(3, 0, 0, kv, kv)
    with pytest.raises(ValueError, match=r"batch_index 2 is not in \[0, 2\)"):
        cache.keys(0, 2)
    with pytest.raises(ValueError, match=r"batch_index -1 is not in \[0, 2\)"):
        cache.reset(-1)
    with pytest.raises(ValueError, match=r"length=7 must be in \[0, 6\]"):
        cache.values(0, 0, 7)
    with pytest.raises(ValueError, match="max_batch and max_len must be positive"):
        StaticKVCache(SMALL, max_batch=0, max_len=8)
    assert cache.lengths == [6, 0]


def test_paged_cache_from_plan_or_block_count():
    plan = plan_pool(SMALL, max_num_seqs=2, max_model_len=10)
    cache = PagedKVCache(SMALL, plan)
    assert cache.num_blocks == 6 and cache.nbytes == plan.nbytes
    assert cache.k_cache.shape == cache.v_cache.shape == (3, 6, 4, 2, 5)
    assert cache.block_manager.block_size == 4 and cache.block_manager.enable_prefix_caching
    plain = PagedKVCache(SMALL, 5, enable_prefix_caching=False)
    assert plain.num_blocks == 5 and not plain.block_manager.enable_prefix_caching
    with pytest.raises(ValueError, match="was not made for"):
        PagedKVCache(QWEN3_0_6B, plan)


def test_copy_blocks_copies_every_layer(device):
    cache = PagedKVCache(SMALL, 6, device=device)
    cache.k_cache.copy_(torch.randn_like(cache.k_cache))
    cache.v_cache.copy_(torch.randn_like(cache.v_cache))
    k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()
    cache.copy_blocks([(1, 4), (0, 2)])
    for pool, before in ((cache.k_cache, k_before), (cache.v_cache, v_before)):
        assert torch.equal(pool[:, 4], before[:, 1]) and torch.equal(pool[:, 2], before[:, 0])
        for block in (0, 1, 3, 5):
            assert torch.equal(pool[:, block], before[:, block])
    cache.copy_blocks([])
    assert torch.equal(cache.k_cache, k_before.index_copy(1, torch.tensor([4, 2], device=device),
                                                          k_before[:, [1, 0]]))
    with pytest.raises(ValueError, match=r"block copy \(0, 6\) is outside \[0, 6\)"):
        cache.copy_blocks([(0, 6)])


def test_fork_and_copy_on_write_keep_the_parent_kv():
    # The caller's loop: allocate, write KV through the block table, fork, append, copy.
    cache = PagedKVCache(SMALL, 4)
    manager, block_size = cache.block_manager, SMALL.block_size

    def write(seq_id, start, kv):  # kv [n, n_kv_heads, head_dim], same for K and V here
        table = manager.block_table(seq_id)
        for i, position in enumerate(range(start, start + kv.shape[0])):
            block, offset = table[position // block_size], position % block_size
            cache.k_cache[:, block, offset] = kv[i]
            cache.v_cache[:, block, offset] = -kv[i]

    def read(seq_id):
        table, n = manager.block_table(seq_id), manager.num_tokens(seq_id)
        return torch.stack([cache.k_cache[:, table[p // block_size], p % block_size]
                            for p in range(n)], dim=1)  # [layers, n, n_kv_heads, head_dim]

    prompt_kv = torch.randn(6, 2, 5)
    parent_kv, child_kv = torch.randn(1, 2, 5), torch.randn(1, 2, 5)
    manager.allocate(1, list(range(6)))
    write(1, 0, prompt_kv)
    manager.fork(1, 2)
    copies = manager.append_tokens(2, [100])
    assert copies == [(1, 2)]
    cache.copy_blocks(copies)
    write(2, 6, child_kv)
    assert manager.append_tokens(1, [200]) == []
    write(1, 6, parent_kv)
    for layer in range(SMALL.num_layers):
        assert torch.equal(read(1)[layer], torch.cat([prompt_kv, parent_kv]))
        assert torch.equal(read(2)[layer], torch.cat([prompt_kv, child_kv]))
    assert torch.equal(cache.v_cache[:, 2, :2], -prompt_kv[4:6].expand(3, -1, -1, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_pools_are_zeroed_huge_page_aligned_and_own_their_memory(dtype):
    shape = (2, 3, 16, 2, 64)
    pool = zeros_pool(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % (2 << 20) == 0
    assert not pool.any()
    pool.fill_(1)
    view = pool[1]
    del pool
    assert view.sum().item() == view.numel()  # the memory lives while a view does
    assert zeros_pool((0, 16), dtype, "cpu").shape == (0, 16)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(),
                    reason="Linux only: the pool is an anonymous mapping committed as written "
                           "only there (elsewhere it is zeroed at once), and /proc measures it")
def test_a_cpu_pool_costs_memory_only_as_it_is_written():
    """A pool is as large as memory allows, so it is committed as sequences fill it: zeroing
    gigabytes of K/V at load would slow the load."""
    before = resident_bytes()
    pool = zeros_pool((16, 1024, 16, 8, 128), torch.float32, "cpu")  # 1 GiB
    assert resident_bytes() - before < (64 << 20)
    pool[:4].fill_(1)  # a quarter of it
    assert resident_bytes() - before > (200 << 20)
    assert not pool[4:].any()
