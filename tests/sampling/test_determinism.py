"""A row's token depends on its logits, parameters, seed and offset only.

Not on the other rows of the batch, their order, the thread count or the memory layout; greedy
rows are the argmax; the draw is the Philox4x32-10 uniform of (seed, offset) inverted through
the filtered distribution in vocabulary order, token for token as in ``reference.sample``.
"""

import math

import pytest
import torch

import fastllm
from fastllm.ops import reference
from conftest import num_threads
from sampling_util import Row, random_logits, repeated_args, row_args

SEEDS = [0, 1, 12345, 2**32 + 5, 2**62 + 7, 2**63 - 1]
OFFSETS = [0, 1, 7, 2**32, 2**40 + 3]


def random_row():
    """Controls drawn from a palette that mixes greedy rows, every filter and extreme seeds."""
    def pick(options):
        return options[torch.randint(len(options), ()).item()]
    return Row(temperature=pick([0.0, 0.0, 0.5, 1.0, 1.0, 1.7]), top_k=pick([0, 0, 1, 5, 40, -1]),
               top_p=pick([1.0, 1.0, 0.3, 0.8, 0.95]), min_p=pick([0.0, 0.0, 0.05, 0.2]),
               seed=pick(SEEDS + [torch.randint(2**62, ()).item()]),
               offset=pick(OFFSETS + [torch.randint(10_000, ()).item()]))


def random_batch(batch, vocab):
    logits = torch.stack([random_logits(vocab, scale=2.0, n_ties=5) for _ in range(batch)])
    return logits, [random_row() for _ in range(batch)]


def draw(backend, logits, rows):
    return backend.ops.sample(logits.to(backend.device), *row_args(rows, backend.device)).cpu()


@pytest.mark.parametrize("vocab", [300, 70_000])
def test_token_independent_of_batch_order_and_threads(backend, vocab):
    batch = 32 if vocab < 1000 else 6  # few rows of a large vocabulary: split within rows
    logits, rows = random_batch(batch, vocab)
    tokens = draw(backend, logits, rows)

    perm = torch.randperm(batch)
    shuffled = draw(backend, logits[perm], [rows[i] for i in perm])
    assert torch.equal(shuffled, tokens[perm]), "row order changed tokens"

    # Embedded among other random rows, at random positions of a larger batch.
    other_logits, other_rows = random_batch(batch + 9, vocab)
    big_logits = torch.cat([logits, other_logits])
    big_rows = rows + other_rows
    order = torch.randperm(len(big_rows))
    big = draw(backend, big_logits[order], [big_rows[i] for i in order])
    position = order.argsort()
    assert torch.equal(big[position[:batch]], tokens), "other rows changed tokens"

    alone = torch.cat([draw(backend, logits[r:r + 1], rows[r:r + 1]) for r in range(batch)])
    assert torch.equal(alone, tokens), "a row sampled alone drew another token"

    with num_threads(1):
        one_thread = draw(backend, logits, rows)
        one_thread_alone = draw(backend, logits[:1], rows[:1])
    assert torch.equal(one_thread, tokens), "the thread count changed tokens"
    assert torch.equal(one_thread_alone, tokens[:1])
    assert torch.equal(draw(backend, logits, rows), tokens), "not repeatable"


def test_strided_inputs(backend):
    device = backend.device
    logits, rows = random_batch(16, 100)
    tokens = draw(backend, logits, rows)
    args = row_args(rows, device)
    wide = torch.full((16, 130), math.nan, device=device)
    wide[:, 20:120] = logits.to(device)
    every_other = torch.full((32, 100), math.nan, device=device)
    every_other[1::2] = logits.to(device)
    column_major = logits.to(device).t().contiguous().t()
    strided_args = tuple(torch.stack([a, a], dim=1)[:, 1] for a in args)  # stride 2
    for view in [wide[:, 20:120], every_other[1::2], column_major]:
        assert not view.is_contiguous()
        assert torch.equal(backend.ops.sample(view, *args).cpu(), tokens)
    assert torch.equal(backend.ops.sample(logits.to(device), *strided_args).cpu(), tokens)


def test_offsets_and_seeds_vary_the_draw(backend):
    device = backend.device
    n, vocab = 4096, 64
    flat = torch.zeros(n, vocab, device=device)
    by_offset = backend.ops.sample(flat, *repeated_args(Row(seed=42), n, device)).cpu()
    assert len(by_offset.unique()) == vocab, "offsets 0..4095 of one seed missed tokens"
    assert (by_offset[1:] != by_offset[:-1]).float().mean() > 0.9

    temperature, top_k, top_p, min_p, _, offsets = repeated_args(Row(seed=42), n, device)
    seeds = torch.arange(n, device=device) * 7919 + 3
    by_seed = backend.ops.sample(flat, temperature, top_k, top_p, min_p, seeds,
                              torch.zeros_like(offsets)).cpu()
    assert len(by_seed.unique()) == vocab, "seeds at offset 0 missed tokens"
    assert (by_seed != by_offset).float().mean() > 0.9, "the seed hardly matters"

    other_seed = backend.ops.sample(flat, *repeated_args(Row(seed=43), n, device)).cpu()
    assert (other_seed != by_offset).float().mean() > 0.9

    same = backend.ops.sample(flat, temperature, top_k, top_p, min_p,
                           torch.full_like(seeds, 42), torch.full_like(offsets, 5)).cpu()
    assert (same == by_offset[5]).all(), "one (seed, offset) drew different tokens"


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_first_argmax(backend, dtype):
    vocab = 257
    logits = torch.randn(12, vocab).to(dtype)
    logits[0] = 0.0  # all tied: token 0
    logits[1, [5, 100, 256]] = 50.0  # tie at the top: the first
    logits[2, 256] = 50.0  # the last token
    logits[3] = -math.inf
    logits[3, 77] = -3.0  # the only finite logit
    logits[4, :10] = -math.inf  # -inf before the max
    logits[5, [0, 1]] = 60.0  # tie at the very start
    if dtype != torch.float32:
        logits[6, 10:12] = logits[6].max()  # a tie made by rounding is a tie too
        logits[6, 11] = logits[6, 10].float().add(1e-4).to(dtype)
    # Filters and random numbers do not matter to a greedy row.
    rows = [Row(0.0, top_k=[0, 1, 3][r % 3], top_p=[1.0, 0.1][r % 2], min_p=[0.0, 0.5][r % 2],
                seed=SEEDS[r % len(SEEDS)], offset=r) for r in range(12)]
    tokens = draw(backend, logits, rows)
    expected = logits.double().argmax(dim=-1)
    assert torch.equal(tokens, expected), f"{tokens.tolist()} != {expected.tolist()}"
    assert tokens[:6].tolist() == [0, 5, 256, 77, expected[4].item(), 0]


def adjacent_kept(probs, a, b):
    """True when a and b are both kept and no kept token lies between them in vocabulary order:
    the only tokens a float32 cdf could swap for one another at a boundary."""
    lo, hi = min(a, b), max(a, b)
    kept = probs > 0
    return bool(kept[a] and kept[b] and not kept[lo + 1:hi].any())


# id: (batch, vocab, logits dtype)
REFERENCE_CASES = {
    "float32": (1000, 100, torch.float32),
    "bfloat16": (300, 100, torch.bfloat16),
    "float16": (300, 100, torch.float16),
    "vocab_128000": (6, 128_000, torch.float32),
}


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_equals_reference_token_for_token(backend, case):
    batch, vocab, dtype = REFERENCE_CASES[case]
    logits, rows = random_batch(batch, vocab)
    logits = logits.to(dtype)
    tokens = draw(backend, logits, rows)
    with num_threads(1):
        expected = reference.sample(logits.double(), *row_args(rows))
    mismatched = (tokens != expected).nonzero().flatten().tolist()
    # float32 against float64 may flip a draw that lands on a cdf boundary, rarely.
    assert len(mismatched) <= max(1, batch // 500), f"rows {mismatched} differ"
    for r in mismatched:
        probs = reference.filtered_probs(logits[r].double(), *rows[r].filters())
        assert adjacent_kept(probs, tokens[r].item(), expected[r].item()), (
            f"row {r} ({rows[r]}): drew {tokens[r].item()}, reference {expected[r].item()}")


EXTREME_ROWS = {  # finite logits whose quotient by a temperature < 1 overflows float32
    "tied_near_float_max": [3.0e38, 3.0e38, 0.0],
    "all_near_minus_float_max": [-3.0e38, -3.0e38, -3.0e38],
    "near_minus_float_max_and_inf": [-3.0e38, -3.1e38, -math.inf],
    "spread_to_float_max": [1.0e38, 2.0e38, 3.0e38],
}


@pytest.mark.parametrize("case", EXTREME_ROWS)
def test_extreme_finite_logits(backend, case):
    device = backend.device
    # Any finite logit is valid input: the filters must work on differences from the maximum,
    # not on logits / temperature, which overflows here.
    n = 200
    logits = torch.tensor([EXTREME_ROWS[case]]).repeat(n, 1)
    for temperature in [0.5, 1.0, 1e-20]:
        args = repeated_args(Row(temperature, seed=3), n)
        tokens = backend.ops.sample(logits.to(device), *(a.to(device) for a in args)).cpu()
        assert torch.equal(tokens, reference.sample(logits.double(), *args)), temperature


@pytest.mark.cuda_sim
def test_a_temperature_whose_reciprocal_overflows_float32_is_greedy(backend):
    # 1 / T past float32's max left the CPU kernel no token to draw (token -1, NaN logprob);
    # every device takes such a row as greedy: the first maximum, log_softmax logprobs.
    device = backend.device
    logits = torch.stack([random_logits(50) for _ in range(4)])  # ties at the top included
    tiny = [1e-39, 2.9e-39, 1e-45, 0.0]  # float32-subnormal, just under 1 / max, the least, 0
    rows = [Row(temperature=t, top_k=k, top_p=p, min_p=m, seed=7)
            for t, k, p, m in zip(tiny, [0, 5, 0, 0], [1.0, 1.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.1])]
    args = [a.to(device) for a in row_args(rows)]
    greedy = [a.to(device) for a in row_args([Row(temperature=0.0, seed=7)] * 4)]
    tokens, token_logprobs, top_ids, top_logprobs = backend.ops.sample_with_logprobs(
        logits.to(device), *args, 3)
    expected = backend.ops.sample_with_logprobs(logits.to(device), *greedy, 3)
    assert torch.equal(tokens.cpu(), logits.argmax(1))
    assert torch.equal(backend.ops.sample(logits.to(device), *args).cpu(), logits.argmax(1))
    assert torch.equal(tokens.cpu(), reference.sample(logits.double(), *row_args(rows)))
    for got, want in zip((token_logprobs, top_ids, top_logprobs), expected[1:]):
        assert torch.equal(got.cpu(), want.cpu())
    assert token_logprobs.isfinite().all()


def test_inverts_the_philox_uniform_in_vocabulary_order(backend):
    device = backend.device
    # Independent of reference.sample: token = first i with cdf[i] > u, over the kept tokens in
    # vocabulary order, with u = philox_uniform(seed, offset).
    n = 2000
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = probs.log().float()
    top_2 = torch.tensor([0, 0, 0, 3, 4]) / 7  # the two most likely, renormalized
    for row, kept_probs in [(Row(seed=2**40 + 1), probs),
                            (Row(top_k=2, seed=3, offset=2**33), top_2)]:
        tokens = backend.ops.sample(logits.to(device).repeat(n, 1), *repeated_args(row, n, device))
        u = torch.tensor([reference.philox_uniform(row.seed, row.offset + i) for i in range(n)],
                         dtype=torch.float64)
        cdf = kept_probs.double().cumsum(0)
        expected = torch.searchsorted(cdf, u, right=True)
        clear = (u[:, None] - cdf[None]).abs().min(dim=1).values > 1e-6
        assert clear.sum() > n - 5
        assert torch.equal(tokens.cpu()[clear], expected[clear])


def test_native_philox_uniform_equals_reference():
    for seed in [0, 1, 2**32 + 5, 2**63 - 1]:
        for offset in [0, 1, 2**32, 2**40 + 3]:
            got = fastllm._C.philox_uniform(seed, offset)
            expected = reference.philox_uniform(seed, offset)
            assert isinstance(got, float)
            assert got == expected, f"seed {seed}, offset {offset}: {got!r} != {expected!r}"
            assert 0.0 <= got < 1.0


def philox4x32_10(counter, key):
    """Random123's Philox4x32-10 on a full 4-word counter (the reference fixes words 2 and 3)."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def test_reference_philox_is_philox4x32_10():
    # Random123's known-answer vectors (kat_vectors: philox4x32 10 rounds).
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                         (0xA4093822, 0x299F31D0)) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420,
                                                       0x24126EA1)
    # The reference: key = the seed's words, counter = the offset's words and 0, 0; 53 bits of
    # the first two output words.
    for seed in [0, 1, 2**32 + 5, 2**63 - 1]:
        for offset in [0, 1, 2**32, 2**40 + 3]:
            w0, w1, _, _ = philox4x32_10((offset & 0xFFFFFFFF, offset >> 32, 0, 0),
                                         (seed & 0xFFFFFFFF, seed >> 32))
            expected = ((w0 >> 5) * 2.0**26 + (w1 >> 6)) / 2.0**53
            assert reference.philox_uniform(seed, offset) == expected
