"""fastllm's filters and penalties mean what HF transformers' logits processors mean.

On the same logits, the tokens HF's chain temperature -> top-k -> top-p -> min-p leaves finite
are the tokens fastllm can sample, with the same probabilities; the ops never sample outside
that set. The one intended difference: tokens tied at the top-p boundary stay together in
fastllm (their mass above is the same), where HF keeps whichever of them its sort put first.
Repetition penalty equals ``RepetitionPenaltyLogitsProcessor`` on prompt + output ids.
"""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastllm.ops import reference
from sampling_util import Row, conditioned_logits, random_logits, repeated_args

NO_IDS = torch.zeros(1, 1, dtype=torch.int64)  # the warpers ignore input_ids


def hf_scores(logits, temperature, top_k, top_p, min_p):
    """HF's processed scores of one row (float64 ``[vocab]``), warpers in HF's order; a filter
    that is off is left out of the chain, as GenerationConfig does."""
    scores = logits.double().cpu()[None]
    scores = TemperatureLogitsWarper(float(temperature))(NO_IDS, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(int(top_k))(NO_IDS, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(float(top_p))(NO_IDS, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(float(min_p))(NO_IDS, scores)
    return scores[0]


def kept(probs_or_scores, *, scores=False):
    mask = probs_or_scores > -math.inf if scores else probs_or_scores > 0
    return set(mask.nonzero().flatten().tolist())


def straddling_tie(logits, row):
    """True when HF's order-dependent top-p would split a tie group: the group starts below
    top_p - 1e-4 but would not fit whole."""
    if row.top_p >= 1:
        return False
    x = logits.double() / row.temperature
    if 0 < row.top_k < x.numel():
        x = x.masked_fill(x < x.topk(row.top_k).values[-1], -math.inf)
    probs = x.softmax(-1)
    for value in probs[probs > 0].unique():
        group = (probs == value).sum().item()
        above = probs[probs > value].sum().item()
        if group > 1 and above < row.top_p and above + (group - 1) * value >= row.top_p - 1e-4:
            return True
    return False


def hf_friendly_logits(vocab, row):
    """Random logits with ties and -inf, away from every threshold and with no tie group split
    by the top-p boundary (where HF is order-dependent by design)."""
    def make():
        while True:
            logits = random_logits(vocab, scale=2.0, n_ties=4)
            if not straddling_tie(logits, row):
                return logits
    return conditioned_logits(make, row)


# id: (temperature, top_k, top_p, min_p)
CHAINS = {
    "t1": (1.0, 0, 1.0, 0.0),
    "t0.6": (0.6, 0, 1.0, 0.0),
    "t1.7_k1": (1.7, 1, 1.0, 0.0),
    "k5": (1.0, 5, 1.0, 0.0),
    "k_vocab": (1.0, 50, 1.0, 0.0),
    "k_past_vocab": (1.0, 80, 1.0, 0.0),
    "p0.3": (1.0, 0, 0.3, 0.0),
    "p0.5": (1.0, 0, 0.5, 0.0),
    "p0.9": (1.0, 0, 0.9, 0.0),
    "m0.05": (1.0, 0, 1.0, 0.05),
    "m0.3": (1.0, 0, 1.0, 0.3),
    "t0.6_k20_p0.9": (0.6, 20, 0.9, 0.0),
    "t1.7_k20_p0.5_m0.05": (1.7, 20, 0.5, 0.05),
    "t1.7_p0.9_m0.3": (1.7, 0, 0.9, 0.3),
    "t0.6_k5_m0.05": (0.6, 5, 1.0, 0.05),
    "t1_k20_p0.9_m0.05": (1.0, 20, 0.9, 0.05),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_filtered_distribution_equals_hf_chain(chain):
    row = Row(*CHAINS[chain])
    for _ in range(6):
        logits = hf_friendly_logits(50, row)
        ours = reference.filtered_probs(logits.double(), *row.filters())
        theirs = hf_scores(logits, *row.filters())
        assert kept(ours) == kept(theirs, scores=True), f"logits {logits.tolist()}"
        torch.testing.assert_close(ours, theirs.softmax(-1), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("chain", ["t1_k20_p0.9_m0.05", "t1.7_k20_p0.5_m0.05", "t0.6_k5_m0.05",
                                   "p0.3", "m0.3", "t1.7_k1"])
def test_op_samples_exactly_the_hf_set(backend, chain):
    device = backend.device
    n = 3000
    row = Row(*CHAINS[chain], seed=31)
    logits = hf_friendly_logits(50, row)
    hf_probs = hf_scores(logits, *row.filters()).softmax(-1)
    tokens = backend.ops.sample(logits.to(device).repeat(n, 1), *repeated_args(row, n, device))
    drawn = set(tokens.cpu().tolist())
    assert drawn <= kept(hf_probs), f"drew {drawn - kept(hf_probs)}, outside HF's set"
    likely = kept(hf_probs >= 20 / n)  # each misses all n draws with probability < e^-20
    assert likely <= drawn, f"never drew {likely - drawn}, which HF keeps"


def tie_at_top_p_boundary(positions):
    """Logits 2, 1, 1, 1, 0 at ``positions`` (the rest -inf): probabilities 0.447, 3 x 0.164,
    0.060, so top_p = 0.6 falls inside the tie group."""
    logits = torch.full((16,), -math.inf)
    for position, value in zip(positions, [2.0, 1.0, 1.0, 1.0, 0.0]):
        logits[position] = value
    return logits


@pytest.mark.parametrize("positions", [(0, 1, 2, 3, 4), (9, 14, 2, 6, 0), (3, 15, 1, 8, 12)],
                         ids=["in_order", "shuffled", "shuffled_top_before_ties"])
def test_tie_at_top_p_boundary_stays_together(backend, positions):
    device = backend.device
    # The intended difference from HF: the three tokens tied at the top-p boundary have the same
    # mass above them (0.447 < 0.6), so fastllm keeps all three; HF keeps the ones its sort
    # put first until the mass reaches top_p, a subset.
    logits = tie_at_top_p_boundary(positions)
    row = Row(1.0, 0, 0.6, 0.0, seed=8)
    top, tie_group = positions[0], set(positions[1:4])
    ours = kept(reference.filtered_probs(logits.double(), *row.filters()))
    theirs = kept(hf_scores(logits, *row.filters()), scores=True)
    assert ours == {top} | tie_group
    assert top in theirs and theirs < ours, f"HF kept {theirs}, fastllm {ours}"

    n = 3000
    tokens = backend.ops.sample(logits.to(device).repeat(n, 1), *repeated_args(row, n, device))
    counts = torch.bincount(tokens.cpu(), minlength=16)
    assert set(counts.nonzero().flatten().tolist()) == ours
    # Each tied token has probability 0.164 / 0.940 = 0.175 of the draws.
    for token in tie_group:
        assert 0.13 * n < counts[token] < 0.22 * n, counts.tolist()


def test_tie_at_top_k_boundary_is_kept_by_both():
    # Top-k ties are no difference: both keep every token tied with the k-th value.
    logits = torch.tensor([3.0, 1.0, 2.0, 1.0, 0.5, 1.0, -math.inf, 0.0])
    row = Row(1.0, 3, 1.0, 0.0)
    expected = {0, 1, 2, 3, 5}
    assert kept(reference.filtered_probs(logits.double(), *row.filters())) == expected
    assert kept(hf_scores(logits, *row.filters()), scores=True) == expected


def penalty_inputs(batch, vocab, prompt_len=12, output_len=9):
    """Logits of both signs (and some exact zeros), and per row random prompt / output ids with
    repeats: returns logits, prompt_mask, output_counts and each row's HF input_ids."""
    logits = torch.randn(batch, vocab) * 3
    logits[:, :3] = 0.0
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool)
    output_counts = torch.zeros(batch, vocab, dtype=torch.int32)
    input_ids = []
    for r in range(batch):
        prompt = torch.randint(0, vocab, (prompt_len,))
        output = torch.randint(0, vocab // 2, (output_len,))  # repeats likely
        prompt[0], output[0] = 1, 2  # a zero logit in each
        prompt_mask[r, prompt] = True
        output_counts[r] = torch.bincount(output, minlength=vocab).int()
        input_ids.append(torch.cat([prompt, output]))
    return logits, prompt_mask, output_counts, input_ids


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_repetition_penalty_equals_hf(backend, dtype):
    device = backend.device
    penalties = [0.5, 1.0, 1.3, 2.0]
    logits, prompt_mask, output_counts, input_ids = penalty_inputs(len(penalties), 40)
    logits = logits.to(dtype)
    zeros = torch.zeros(len(penalties), device=device)
    got = logits.to(device, copy=True)  # modified in place
    backend.ops.apply_penalties(got, prompt_mask.to(device), output_counts.to(device),
                             torch.tensor(penalties, device=device), zeros, zeros.clone(), None)
    assert got.dtype == dtype
    for r, penalty in enumerate(penalties):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids[r][None],
                                                             logits[r:r + 1].clone())[0]
        seen = prompt_mask[r] | (output_counts[r] > 0)
        assert torch.equal(got[r].cpu()[~seen], logits[r][~seen]), "changed unseen tokens"
        # x / p against x * (1 / p): one rounding apart at most.
        torch.testing.assert_close(got[r].cpu(), expected, atol=0,
                                   rtol=2 * torch.finfo(dtype).eps, msg=f"penalty {penalty}")


def hand_penalties(logits, prompt_mask, output_counts, rep, freq, pres, bias):
    """The docstring's four steps, element by element, in float64."""
    out = torch.empty(logits.shape, dtype=torch.float64)
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            v = float(logits[r, t])
            count = int(output_counts[r, t])
            if bias is not None:
                v += float(bias[r, t])
            if prompt_mask[r, t] or count > 0:
                v = v / float(rep[r]) if v > 0 else v * float(rep[r])
            v -= float(freq[r]) * count
            v -= float(pres[r]) * (count > 0)
            out[r, t] = v
    return out


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_frequency_presence_and_bias(backend, dtype, with_bias):
    device = backend.device
    batch, vocab = 5, 33
    logits, prompt_mask, output_counts, _ = penalty_inputs(batch, vocab)
    logits[1, 7] = -math.inf
    output_counts[1, 7] = 2
    # Rows: everything at once, negative penalties (rewards), off, frequency only, presence only.
    rep = torch.tensor([1.3, 0.8, 1.0, 1.0, 1.0])
    freq = torch.tensor([0.5, -0.25, 0.0, 0.75, 0.0])
    pres = torch.tensor([0.4, -1.0, 0.0, 0.0, 1.5])
    bias = (torch.randn(batch, vocab) * 2).masked_fill(torch.rand(batch, vocab) < 0.6, 0.0)
    bias = bias if with_bias else None
    logits = logits.to(dtype)

    got = logits.to(device, copy=True)
    backend.ops.apply_penalties(got, prompt_mask.to(device), output_counts.to(device),
                             rep.to(device), freq.to(device), pres.to(device),
                             None if bias is None else bias.to(device))
    got = got.cpu()
    assert got.dtype == dtype
    hand = hand_penalties(logits, prompt_mask, output_counts, rep, freq, pres, bias)
    plain = reference.apply_penalties(logits, prompt_mask, output_counts, rep, freq, pres, bias)
    if with_bias is False:
        assert torch.equal(got[2], logits[2]), "a row with every penalty off changed"
    assert torch.equal(got.isinf(), hand.isinf()) and not got.isnan().any()
    finite = hand.isfinite()
    if dtype == torch.float32:
        torch.testing.assert_close(got, plain)
        torch.testing.assert_close(got[finite].double(), hand[finite], rtol=1e-6, atol=1e-5)
    else:
        # At most twice the error of the plain composition in the same dtype, plus one rounding.
        err = (got[finite].double() - hand[finite]).abs()
        plain_err = (plain[finite].double() - hand[finite]).abs()
        slack = torch.finfo(dtype).eps * hand[finite].abs()
        assert (err <= 2 * plain_err.max() + slack).all(), f"max error {err.max():.3g}"


@pytest.mark.cuda_sim
@pytest.mark.parametrize("layout", ["column_slice", "column_major"])
def test_penalties_in_place_on_strided_logits(backend, layout):
    device = backend.device
    logits, prompt_mask, output_counts, _ = penalty_inputs(4, 20)
    args = (prompt_mask.to(device), output_counts.to(device), torch.full((4,), 1.3, device=device),
            torch.full((4,), 0.5, device=device), torch.full((4,), 0.2, device=device),
            torch.randn(4, 20, device=device))
    expected = reference.apply_penalties(logits, *(a.cpu() for a in args))
    buffer = torch.full((4, 30), 7.0, device=device)
    if layout == "column_slice":
        view = buffer[:, 5:25]
        view.copy_(logits)
    else:
        view = logits.to(device).t().contiguous().t()
    assert not view.is_contiguous()
    backend.ops.apply_penalties(view, *args)
    torch.testing.assert_close(view.cpu(), expected)
    if layout == "column_slice":
        assert (buffer[:, :5] == 7).all() and (buffer[:, 25:] == 7).all(), "wrote outside"
