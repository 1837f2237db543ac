"""The samplers draw from the exact filtered distribution.

Each case gives the op one row of logits N times over (same parameters and seed, offsets
0 .. N-1): N independent draws from one distribution, which also runs the op on a large batch.
The draws are judged against ``reference.filtered_probs`` computed in float64: a token the
filters remove must never appear, and the counts must pass a chi-square goodness-of-fit test
(p > 1e-3). Seeds are fixed, so every case is deterministic: a pass stays a pass.

The filter and dtype grids are covering arrays (tests/covering.py): every pair of backend,
filter case and vocabulary (or dtype) meets in some case, so each backend runs every filter and
every vocabulary, and each filter runs on every vocabulary.
"""

import math
import zlib

import covering
import pytest
import torch

from fastllm.ops import reference
from sampling_util import (Row, chi_square_pvalue, conditioned_logits, random_logits,
                           repeated_args)

P_MIN = 1e-3
N_DRAWS = 6000
VOCABS = [8, 13, 64]

# id: (temperature, top_k, top_p, min_p); top_k "V" is the vocabulary size, "V+7" past it.
FILTERS = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "greedy_filters_ignored": (0.0, 3, 0.3, 0.2),
    "t0.5": (0.5, 0, 1.0, 0.0),
    "t1": (1.0, 0, 1.0, 0.0),
    "t2": (2.0, 0, 1.0, 0.0),
    "top_k1": (1.0, 1, 1.0, 0.0),
    "top_k3": (1.0, 3, 1.0, 0.0),
    "top_k_vocab": (1.0, "V", 1.0, 0.0),
    "top_k_past_vocab": (1.0, "V+7", 1.0, 0.0),
    "top_k_negative": (1.0, -1, 1.0, 0.0),
    "top_p0.3": (1.0, 0, 0.3, 0.0),
    "top_p0.9": (1.0, 0, 0.9, 0.0),
    "top_p1": (1.0, 0, 1.0, 0.0),
    "min_p0.05": (1.0, 0, 1.0, 0.05),
    "min_p0.2": (1.0, 0, 1.0, 0.2),
    "t0.7_k5_p0.9_m0.05": (0.7, 5, 0.9, 0.05),
    "t2_k3_p0.9": (2.0, 3, 0.9, 0.0),
    "t0.5_p0.3_m0.2": (0.5, 0, 0.3, 0.2),
    "t1.5_p0.95_m0.05": (1.5, 0, 0.95, 0.05),
    "t1_kV_p0.6_m0.2": (1.0, "V", 0.6, 0.2),
}


def make_row(case, vocab, seed=None):
    """The case's Row; its seed differs per case and vocabulary unless given."""
    temperature, top_k, top_p, min_p = FILTERS[case]
    if seed is None:
        seed = zlib.crc32(f"{case}/{vocab}".encode())
    top_k = {"V": vocab, "V+7": vocab + 7}.get(top_k, top_k)
    return Row(temperature, top_k, top_p, min_p, seed=seed, offset=0)


def draw_and_check(backend, logits_row, row, n):
    """Draws n tokens of ``logits_row`` under ``row`` on ``backend`` and checks them against the
    float64 filtered distribution; returns the distribution."""
    vocab = logits_row.numel()
    probs = reference.filtered_probs(logits_row.double().cpu(), *row.filters())
    batch = logits_row.to(backend.device).repeat(n, 1)
    tokens = backend.ops.sample(batch, *repeated_args(row, n, backend.device))
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    tokens = tokens.cpu()
    assert ((tokens >= 0) & (tokens < vocab)).all(), f"token ids out of range: {tokens.unique()}"
    counts = torch.bincount(tokens, minlength=vocab)
    forbidden = (probs == 0) & (counts > 0)
    assert not forbidden.any(), (
        f"drew tokens the filters remove: {forbidden.nonzero().flatten().tolist()} "
        f"(counts {counts[forbidden].tolist()}); kept: {(probs > 0).nonzero().flatten().tolist()}")
    p, df, stat = chi_square_pvalue(counts, probs)
    assert p > P_MIN, (f"counts do not fit the filtered distribution: chi2={stat:.1f}, df={df}, "
                       f"p={p:.2e}\ncounts:   {counts.tolist()}\nexpected: "
                       f"{[round(v, 1) for v in (probs * n).tolist()]}")
    return probs


@covering.grid(case=list(FILTERS), vocab=VOCABS)
def test_draws_follow_the_filtered_distribution(backend, vocab, case):
    row = make_row(case, vocab)
    logits = conditioned_logits(lambda: random_logits(vocab), row)
    probs = draw_and_check(backend, logits, row, N_DRAWS)
    if row.temperature == 0:  # one-hot on the first maximum
        assert probs.argmax().item() == logits.argmax().item()


@covering.grid(dtype=[torch.bfloat16, torch.float16],
               case=["t1", "t0.7_k5_p0.9_m0.05", "t0.5_p0.3_m0.2", "top_k1"])
def test_low_precision_logits(backend, dtype, case):
    # The distribution is that of the low-precision values themselves (exact in float64).
    row = make_row(case, 48, seed=77)
    logits = conditioned_logits(lambda: random_logits(48).to(dtype), row)
    draw_and_check(backend, logits, row, N_DRAWS)


@pytest.mark.parametrize("filters", [(1.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.02), (1.3, 0, 0.5, 0.0)],
                         ids=["unfiltered", "t0.8_k50_p0.9_m0.02", "t1.3_p0.5"])
def test_vocab_1000(backend, filters):
    # Many tokens expect fewer than 5 draws: the chi-square test merges them.
    row = Row(*filters, seed=5)
    logits = conditioned_logits(lambda: random_logits(1000, scale=2.5, n_ties=20), row)
    draw_and_check(backend, logits, row, 8000)


def test_two_finite_tokens(backend):
    # Everything but two tokens at -inf, one of them far less likely.
    logits = torch.full((32,), -math.inf)
    logits[3], logits[30] = 0.0, -3.0
    for filters in [(1.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.06), (3.0, 1, 1.0, 0.0)]:
        probs = draw_and_check(backend, logits, Row(*filters, seed=9), 4000)
        assert (probs > 0).sum() == (2 if filters == (1.0, 0, 1.0, 0.0) else 1)


def test_chi_square_rejects_a_wrong_distribution():
    # The test above can fail: counts drawn from one distribution are rejected against one that
    # differs by a few percent, and accepted against the right one.
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5], dtype=torch.float64)
    wrong = torch.tensor([0.06, 0.1, 0.15, 0.2, 0.49], dtype=torch.float64)
    counts = torch.bincount(torch.multinomial(probs, 40000, replacement=True), minlength=5)
    assert chi_square_pvalue(counts, probs)[0] > P_MIN
    assert chi_square_pvalue(counts, wrong)[0] < P_MIN
    # A token with probability 0 is outside the test: it is checked separately.
    assert chi_square_pvalue(torch.tensor([10, 0, 30]), torch.tensor([0.25, 0.0, 0.75]))[0] > 0.5
