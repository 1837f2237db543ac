"""sample_with_logprobs: the tokens of sample, and log-probabilities under the distribution each
token was drawn from (the filtered one; log_softmax of the logits for greedy rows), most likely
first with ties by lower id, unused slots -1 / -inf."""

import math

import pytest
import torch

from fastllm.ops import reference
from sampling_util import Row, conditioned_logits, random_logits, row_args

ATOL = 1e-5  # float32 outputs against the float64 reference


def quantized_logits(vocab):
    """Logits on a 1/16 grid: many exact ties, distinct values far apart in float32."""
    return (random_logits(vocab, scale=2.0, n_ties=6) * 16).round() / 16


def mixed_rows(batch, vocab):
    palette = [Row(), Row(0.0), Row(0.7, 5), Row(1.3, 0, 0.8), Row(1.0, 0, 1.0, 0.1),
               Row(0.5, 20, 0.9, 0.05), Row(1.0, 2), Row(2.0, -1, 0.3), Row(0.0, 3, 0.5, 0.2)]
    rows, logits = [], []
    for r in range(batch):
        p = palette[r % len(palette)]
        row = Row(p.temperature, p.top_k, p.top_p, p.min_p, seed=r * 1009 + 17, offset=r)
        rows.append(row)
        logits.append(conditioned_logits(lambda: quantized_logits(vocab), row))
    return torch.stack(logits), rows


def check_outputs(result, batch, num_logprobs):
    tokens, token_logprobs, top_ids, top_logprobs = result
    assert tokens.dtype == torch.int64 and tokens.shape == (batch,)
    assert token_logprobs.dtype == torch.float32 and token_logprobs.shape == (batch,)
    assert top_ids.dtype == torch.int64 and top_ids.shape == (batch, num_logprobs)
    assert top_logprobs.dtype == torch.float32 and top_logprobs.shape == (batch, num_logprobs)
    return tuple(t.cpu() for t in result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_logprobs", [1, 8, 40])
def test_equals_reference(backend, dtype, num_logprobs):
    device = backend.device
    batch, vocab = 36, 40
    logits, rows = mixed_rows(batch, vocab)
    logits = logits.to(dtype)  # the 1/16 grid is exact in bfloat16 for |x| < 16
    args = (logits.to(device), *row_args(rows, device))
    got = check_outputs(backend.ops.sample_with_logprobs(*args, num_logprobs), batch, num_logprobs)
    tokens, token_logprobs, top_ids, top_logprobs = got
    assert torch.equal(tokens, backend.ops.sample(*args).cpu()), "tokens differ from sample's"

    expected = reference.sample_with_logprobs(logits.double(), *row_args(rows), num_logprobs)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(token_logprobs.double(), expected[1], atol=ATOL, rtol=0)
    assert torch.equal(top_ids, expected[2])
    assert torch.equal(top_logprobs.isinf(), expected[3].isinf())
    torch.testing.assert_close(top_logprobs.double(), expected[3], atol=ATOL, rtol=0)
    # The token's logprob is finite, and where it is listed, listed with the same value.
    assert token_logprobs.isfinite().all()
    for r in range(batch):
        listed = (top_ids[r] == tokens[r]).nonzero().flatten()
        if len(listed):
            assert top_logprobs[r, listed[0]] == token_logprobs[r]


@pytest.mark.cuda_sim
@pytest.mark.parametrize("n", [6, 0])
def test_greedy_rows_report_log_softmax(backend, n):
    device = backend.device
    batch, vocab = 4, 50
    logits = torch.randn(batch, vocab) * 3
    logits[1, 10:20] = -math.inf
    logits[2, [4, 9]] = logits[2].max() + 1  # tied argmax
    rows = [Row(0.0, top_k=[0, 1, 5, 0][r], top_p=[1.0, 0.5, 1.0, 0.2][r], seed=r) for r in
            range(batch)]
    tokens, token_logprobs, top_ids, top_logprobs = check_outputs(
        backend.ops.sample_with_logprobs(logits.to(device), *row_args(rows, device), n), batch, n)
    log_softmax = logits.double().log_softmax(-1)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[2] == 4
    torch.testing.assert_close(token_logprobs.double(), log_softmax.max(-1).values, atol=ATOL,
                               rtol=0)
    # The filters do not apply: the top n of the whole distribution.
    order = torch.sort(-log_softmax, dim=-1, stable=True).indices[:, :n]
    assert torch.equal(top_ids, order)
    if n:
        assert top_ids[2, :2].tolist() == [4, 9]
    torch.testing.assert_close(top_logprobs.double(), log_softmax.gather(1, order), atol=ATOL,
                               rtol=0)


@pytest.mark.cuda_sim
def test_slots_past_the_kept_tokens(backend):
    device = backend.device
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, 0.0, -math.inf, 1.5],
                           [0.5, 3.0, -1.0, 2.0, 1.0, 0.0, -math.inf, 1.5],
                           [-math.inf, -math.inf, 1.0, -math.inf, -math.inf, -math.inf, 0.0,
                            -math.inf]])
    rows = [Row(1.0, 2, seed=3), Row(0.0, seed=3), Row(1.0, seed=4)]
    tokens, token_logprobs, top_ids, top_logprobs = check_outputs(
        backend.ops.sample_with_logprobs(logits.to(device), *row_args(rows, device), 10), 3, 10)
    # top_k=2 keeps tokens 1 and 3: probabilities e^3 / (e^3 + e^2) and e^2 / (e^3 + e^2).
    assert top_ids[0].tolist() == [1, 3] + [-1] * 8
    assert tokens[0].item() in (1, 3)
    expected = torch.tensor([3.0, 2.0], dtype=torch.float64) - math.log(math.exp(3) + math.exp(2))
    torch.testing.assert_close(top_logprobs[0, :2].double(), expected, atol=ATOL, rtol=0)
    assert (top_logprobs[0, 2:] == -math.inf).all()
    # Greedy: every finite token (7), then the empty slots.
    assert top_ids[1].tolist() == [1, 3, 7, 4, 0, 5, 2, -1, -1, -1]
    assert (top_logprobs[1, :7] > -math.inf).all() and (top_logprobs[1, 7:] == -math.inf).all()
    # Two finite tokens only.
    assert top_ids[2].tolist() == [2, 6] + [-1] * 8
    assert (top_logprobs[2, 2:] == -math.inf).all()


def test_num_logprobs_zero(backend):
    device = backend.device
    logits, rows = mixed_rows(5, 20)
    args = (logits.to(device), *row_args(rows, device))
    tokens, token_logprobs, top_ids, top_logprobs = check_outputs(
        backend.ops.sample_with_logprobs(*args, 0), 5, 0)
    assert torch.equal(tokens, backend.ops.sample(*args).cpu())
    expected = reference.sample_with_logprobs(logits.double(), *row_args(rows), 0)[1]
    torch.testing.assert_close(token_logprobs.double(), expected, atol=ATOL, rtol=0)


@pytest.mark.cuda_sim
def test_unfiltered_top_logprobs_are_a_sorted_distribution(backend):
    device = backend.device
    vocab = 30
    logits = torch.randint(-3, 3, (3, vocab)).float()  # 6 values: large tie groups
    rows = [Row(seed=1), Row(0.5, seed=2), Row(2.0, seed=3)]
    for n in [5, vocab]:
        tokens, token_logprobs, top_ids, top_logprobs = check_outputs(
            backend.ops.sample_with_logprobs(logits.to(device), *row_args(rows, device), n), 3, n)
        for r in range(3):
            total = top_logprobs[r].double().exp().sum().item()
            assert total <= 1 + 1e-5
            if n == vocab:
                assert abs(total - 1) < 1e-5
                assert sorted(top_ids[r].tolist()) == list(range(vocab))
            values = top_logprobs[r]
            assert (values[:-1] >= values[1:]).all(), "not most likely first"
            ids = top_ids[r]
            tied = values[:-1] == values[1:]
            assert (ids[:-1][tied] < ids[1:][tied]).all(), "ties not by lower id"
            # Descending probability is descending logit.
            assert (logits[r, ids[:-1]] >= logits[r, ids[1:]]).all()
