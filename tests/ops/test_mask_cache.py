"""fastllm.MaskCache: values, aliasing, growth, limits and thread safety."""

import random
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fastllm
from fastllm.ops import reference

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def storage_ptr(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_values_match_reference(dtype, device):
    pairs = [(0, 0), (0, 5), (1, 1), (3, 3), (1, 64), (64, 64), (1, 65), (17, 200), (300, 300),
             (2, 3), (130, 131), (0, 129)]
    random.Random(0).shuffle(pairs)  # growth happens between calls, in no particular order
    cache = fastllm.MaskCache()
    for len_q, len_k in pairs:
        mask = cache.get(len_q, len_k, dtype, device)
        expected = reference.causal_mask(len_q, len_k, dtype=dtype, device=device)
        assert mask.dtype == dtype and mask.device.type == device.type
        assert torch.equal(mask, expected), (len_q, len_k)


def test_default_arguments_and_device_spellings():
    cache = fastllm.MaskCache()
    assert cache.max_bytes == 1 << 30 and cache.nbytes == 0
    mask = cache.get(2, 5)
    assert mask.dtype == torch.float32 and mask.device.type == "cpu"
    assert torch.equal(mask, reference.causal_mask(2, 5))
    same = cache.get(2, 5, torch.float32, torch.device("cpu"))
    assert storage_ptr(same) == storage_ptr(mask)


def test_side_accepts_the_device_spellings_get_accepts():
    cache = fastllm.MaskCache()
    cache.get(1, 1, torch.float32, "cpu")
    assert cache.side(torch.float32, torch.device("cpu")) == 64
    assert cache.side(torch.float32, "cpu") == 64


def test_results_are_views_of_one_buffer(device):
    cache = fastllm.MaskCache()
    views = [cache.get(len_q, len_k, torch.float32, device)
             for len_q, len_k in [(64, 64), (3, 10), (0, 5), (1, 64), (20, 40)]]
    assert len({storage_ptr(v) for v in views}) == 1
    assert views[0].untyped_storage().nbytes() == 64 * 64 * 4 == cache.nbytes
    assert views[0].data_ptr() == storage_ptr(views[0])  # [64, 64] is the whole buffer
    # Bottom-right aligned rows: a [3, 10] request starts at row 7 of the buffer.
    assert views[1].data_ptr() == storage_ptr(views[1]) + 7 * 64 * 4


def test_growth_by_doubling(device):
    cache = fastllm.MaskCache()
    f32, bf16 = torch.float32, torch.bfloat16
    assert cache.side(f32, device) == 0 and cache.nbytes == 0
    for len_k, side in [(1, 64), (64, 64), (65, 128), (100, 128), (129, 256), (1000, 1024),
                        (3, 1024)]:
        cache.get(min(len_k, 2), len_k, f32, device)
        assert cache.side(f32, device) == side, len_k
        assert cache.nbytes == side * side * 4
    cache.get(1, 10, bf16, device)
    assert cache.side(bf16, device) == 64 and cache.side(f32, device) == 1024
    assert cache.nbytes == 1024 * 1024 * 4 + 64 * 64 * 2


def test_old_views_stay_valid_after_growth_and_clear(device):
    cache = fastllm.MaskCache()
    old = cache.get(5, 10, torch.float32, device)
    expected = reference.causal_mask(5, 10, device=device)
    cache.get(1, 500, torch.float32, device)
    grown = cache.get(5, 10, torch.float32, device)
    assert storage_ptr(grown) != storage_ptr(old)
    assert torch.equal(old, expected) and torch.equal(grown, expected)
    cache.clear()
    assert cache.nbytes == 0 and cache.side(torch.float32, device) == 0
    assert torch.equal(old, expected) and torch.equal(grown, expected)
    cache.get(1, 1, torch.float32, device)
    assert cache.side(torch.float32, device) == 64 and cache.nbytes == 64 * 64 * 4


def test_one_buffer_per_dtype(device):
    cache = fastllm.MaskCache()
    masks = {dtype: cache.get(4, 9, dtype, device) for dtype in FLOAT_DTYPES}
    assert len({storage_ptr(m) for m in masks.values()}) == len(FLOAT_DTYPES)
    for dtype, mask in masks.items():
        assert mask.dtype == dtype
        assert torch.equal(mask, reference.causal_mask(4, 9, dtype=dtype, device=device))
    cache.get(1, 200, torch.bfloat16, device)  # grows bfloat16 only
    assert [cache.side(d, device) for d in FLOAT_DTYPES] == [64, 256, 64, 64]
    assert cache.nbytes == 64 * 64 * (4 + 2 + 8) + 256 * 256 * 2


def test_limit_raises_and_leaves_the_cache_unchanged():
    cpu = torch.device("cpu")
    cache = fastllm.MaskCache(max_bytes=64 * 64 * 4 + 64 * 64 * 2)
    assert cache.max_bytes == 64 * 64 * 6
    kept = cache.get(3, 64, torch.float32, cpu)
    cache.get(1, 1, torch.bfloat16, cpu)
    before = cache.nbytes
    with pytest.raises(ValueError, match=r"len_k=65 .*max_bytes=24576"):
        cache.get(1, 65, torch.float32, cpu)  # would grow float32 to 128 x 128
    with pytest.raises(ValueError, match=r"torch.float16 .*max_bytes=24576"):
        cache.get(1, 1, torch.float16, cpu)  # a new buffer past the limit
    assert cache.nbytes == before
    assert cache.side(torch.float32, cpu) == 64 and cache.side(torch.float16, cpu) == 0
    again = cache.get(3, 64, torch.float32, cpu)
    assert storage_ptr(again) == storage_ptr(kept) and torch.equal(again, kept)

    # Growth is capped at what the limit allows: 100 bytes hold a 5 x 5 float32 buffer, not 64.
    tiny = fastllm.MaskCache(max_bytes=100)
    assert torch.equal(tiny.get(1, 3), reference.causal_mask(1, 3))
    assert tiny.side(torch.float32, cpu) == 5 and tiny.nbytes == 100
    with pytest.raises(ValueError, match="len_k=6 .*max_bytes=100"):
        tiny.get(1, 6)
    assert tiny.nbytes == 100 and torch.equal(tiny.get(5, 5), reference.causal_mask(5, 5))


def test_len_k_too_large_for_the_size_arithmetic_is_a_limit_error():
    # 2**30 + 1 keys need a 2**31-sided buffer, 2**64 float32 bytes: that must be the limit's
    # ValueError, and the cache must stay usable.
    cache = fastllm.MaskCache()
    cache.get(1, 10)
    with pytest.raises(ValueError, match="max_bytes"):
        cache.get(0, 2**30 + 1)
    assert cache.nbytes == 64 * 64 * 4
    assert torch.equal(cache.get(2, 3), reference.causal_mask(2, 3))


def test_failed_allocation_leaves_the_cache_unchanged():
    # Within max_bytes but past any address space (2**61 bytes): the allocation fails. The
    # failure must leave the cache as it was, bfloat16 buffer still absent and nbytes readable.
    cache = fastllm.MaskCache(max_bytes=2**62)
    cache.get(1, 10)
    with pytest.raises((RuntimeError, MemoryError, ValueError)):
        cache.get(0, 2**29 + 1, torch.bfloat16)
    assert cache.side(torch.bfloat16, torch.device("cpu")) == 0
    assert cache.nbytes == 64 * 64 * 4
    assert repr(cache) == f"MaskCache(nbytes={64 * 64 * 4}, max_bytes={2**62})"


def test_huge_len_k_returns_promptly():
    # A len_k near 2**63 must raise, not loop forever doubling the side. Run in a child process
    # that SIGALRM ends if the call takes 2 s, since a hang inside C++ cannot be interrupted from
    # here; the alarm is cancelled once the call returns, so the interpreter's own exit (slow
    # on a loaded machine) is not timed with it.
    code = textwrap.dedent("""
        import signal, fastllm
        cache = fastllm.MaskCache()
        signal.alarm(2)
        try:
            cache.get(0, 2**62 + 1)
        except ValueError as e:
            print("ValueError", e)
        finally:
            signal.alarm(0)
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode != -signal.SIGALRM, "MaskCache.get(0, 2**62 + 1) hung"
    assert child.returncode == 0 and child.stdout.startswith("ValueError"), child.stderr


@pytest.mark.parametrize("args, error, match", [
    ((-1, 3), ValueError, "len_q=-1"),
    ((0, -2), ValueError, "len_k=-2"),
    ((5, 3), ValueError, "len_q=5, len_k=3"),
    ((1, 1, torch.int32), TypeError, "torch.int32"),
    ((1, 1, torch.bool), TypeError, "torch.bool"),
])
def test_bad_get_arguments(args, error, match):
    cache = fastllm.MaskCache()
    with pytest.raises(error, match=match):
        cache.get(*args)
    assert cache.nbytes == 0


@pytest.mark.parametrize("max_bytes", [0, -1])
def test_bad_max_bytes(max_bytes):
    with pytest.raises(ValueError, match=f"max_bytes must be positive, got {max_bytes}"):
        fastllm.MaskCache(max_bytes=max_bytes)


def test_thread_safety(device):
    # 8 threads ask for masks of growing sizes at once, so buffers grow while other threads read
    # views of them; every mask handed out must be right.
    cache = fastllm.MaskCache()
    dtypes = [torch.float32, torch.bfloat16]
    start = threading.Barrier(8)
    failures = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            start.wait()
            for i in range(60):
                len_k = rng.randint(0, 8 * (i + 1))  # up to 480: sides 64 .. 512
                len_q = rng.randint(0, len_k)
                dtype = rng.choice(dtypes)
                mask = cache.get(len_q, len_k, dtype, device)
                expected = reference.causal_mask(len_q, len_k, dtype=dtype, device=device)
                if not torch.equal(mask, expected):
                    failures.append((len_q, len_k, dtype))
        except Exception as e:  # reported below; an exception in a thread fails nothing itself
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    sides = [cache.side(d, device) for d in dtypes]
    assert all(side in (64, 128, 256, 512) for side in sides)
    assert cache.nbytes == sides[0] ** 2 * 4 + sides[1] ** 2 * 2
