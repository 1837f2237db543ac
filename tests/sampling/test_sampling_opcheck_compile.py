"""The sampling ops' registrations: torch.library.opcheck on every backend's namespace (schema and
mutation annotations, fake kernels against the real ones, autograd registration, AOT dispatch),
and a torch.compile(fullgraph=True) graph of apply_penalties -> sample equal to eager."""

import pytest
import torch

from fastllm import ops
from sampling_util import Row, row_args

ROWS = [Row(), Row(0.0), Row(0.7, 5, 0.9, 0.05, seed=2**63 - 1, offset=2**40 + 3),
        Row(1.5, 1, 0.3, seed=7, offset=1), Row(1.0, -1, 1.0, 0.2, seed=3, offset=9)]


def sample_args(dtype, vocab, device):
    logits = (torch.randn(len(ROWS), vocab) * 2).to(dtype=dtype, device=device)
    logits[1, 3] = float("-inf")
    return (logits, *row_args(ROWS, device))


def penalty_args(dtype, vocab, device, with_bias):
    batch = len(ROWS)
    return (torch.randn(batch, vocab, dtype=dtype, device=device),
            torch.rand(batch, vocab, device=device) < 0.3,
            torch.randint(0, 3, (batch, vocab), dtype=torch.int32, device=device),
            torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0], device=device),
            torch.tensor([0.0, 0.5, -0.2, 0.0, 1.0], device=device),
            torch.tensor([0.0, 0.25, 0.0, 1.0, -0.5], device=device),
            torch.randn(batch, vocab, device=device) if with_bias else None)


@pytest.mark.parametrize("dtype, vocab", [(torch.float32, 37), (torch.bfloat16, 300),
                                          (torch.float16, 8)])
def test_opcheck_sample(backend, dtype, vocab):
    device = backend.device
    torch.library.opcheck(backend.ops.sample.default, sample_args(dtype, vocab, device))


@pytest.mark.parametrize("dtype, vocab, num_logprobs", [(torch.float32, 37, 4),
                                                        (torch.bfloat16, 300, 1),
                                                        (torch.float32, 8, 0)])
def test_opcheck_sample_with_logprobs(backend, dtype, vocab, num_logprobs):
    device = backend.device
    torch.library.opcheck(backend.ops.sample_with_logprobs.default,
                          (*sample_args(dtype, vocab, device), num_logprobs))


@pytest.mark.parametrize("dtype, with_bias", [(torch.float32, True), (torch.float32, False),
                                              (torch.bfloat16, True)])
def test_opcheck_apply_penalties(backend, dtype, with_bias):
    device = backend.device
    torch.library.opcheck(backend.ops.apply_penalties.default,
                          penalty_args(dtype, 37, device, with_bias))


def test_compile_fullgraph_penalties_then_sample(device):
    def step(logits, prompt_mask, output_counts, rep, freq, pres, bias, *sampling):
        ops.apply_penalties(logits, prompt_mask, output_counts, rep, freq, pres, bias)
        tokens = ops.sample(logits, *sampling)
        return tokens, ops.sample_with_logprobs(logits, *sampling, 3)

    penalties = penalty_args(torch.float32, 37, device, with_bias=True)
    sampling = row_args(ROWS, device)
    eager_logits = penalties[0].clone()
    expected = step(eager_logits, *penalties[1:], *sampling)
    assert not torch.equal(eager_logits, penalties[0])

    compiled_logits = penalties[0].clone()
    got = torch.compile(step, fullgraph=True)(compiled_logits, *penalties[1:], *sampling)
    assert torch.equal(compiled_logits, eager_logits), "in-place penalties lost or different"
    assert torch.equal(got[0], expected[0])
    for g, e in zip(got[1], expected[1]):
        assert torch.equal(g, e)
