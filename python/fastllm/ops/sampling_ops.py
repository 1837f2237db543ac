"""The sampling ops (``csrc/sampling``): :func:`sample`, :func:`sample_with_logprobs` and
:func:`apply_penalties`."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["apply_penalties", "sample", "sample_with_logprobs"]


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
) -> Tensor:
    """Samples one token per row of ``logits``, every control given per row.

    Row ``r`` is filtered in HF transformers' order: temperature (``0`` = greedy argmax, the
    first maximum; so is a temperature so small that its float32 reciprocal overflows, below
    about ``3e-39``), top-k (``<= 0`` or ``>= vocab`` = off; every token tied with the k-th
    value stays, as in ``TopKLogitsWarper``), top-p (``1`` = off; a token stays when the
    probability mass of the tokens strictly more likely than it is below ``top_p``, so tokens
    tied at the boundary stay together), min-p (``0`` = off; a token stays when its probability
    is at least ``min_p`` times the largest). None of them sorts the vocabulary.

    The draw is one uniform number from Philox4x32-10 keyed by ``seeds[r]`` with counter
    ``offsets[r]`` (a request's step), inverted through the filtered distribution in vocabulary
    order: a row's token depends on its logits, parameters, seed and offset only, never on the
    other rows, their order or the thread count.

    Args:
        logits: ``[batch, vocab]`` float32 / bfloat16 / float16, finite or ``-inf``.
        temperature, top_p, min_p: float32 ``[batch]``.
        top_k: int32 ``[batch]``.
        seeds, offsets: int64 ``[batch]``.

    Returns:
        int64 ``[batch]`` token ids. A row with a NaN or ``+inf`` logit, or no finite logit, is
        a ``ValueError`` naming the row.
    """
    return torch.ops.fastllm.sample.default(logits, temperature, top_k, top_p, min_p, seeds,
                                            offsets)


@fake_kernel("sample")
def _sample_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    check_one_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, seeds=seeds, offsets=offsets)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def sample_with_logprobs(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    num_logprobs: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`sample`, plus log-probabilities under the distribution each token was drawn from.

    A sampled row reports the filtered, temperature-scaled distribution (filtered-out tokens,
    and tokens whose probability underflows float32, have probability 0, so the draw can never
    pick them); a greedy row (temperature 0) reports ``log_softmax(logits)``, the distribution
    its argmax was taken of. Computed in the sampling pass, without another pass
    over the vocabulary.

    Returns:
        ``(tokens, token_logprobs, top_ids, top_logprobs)``: int64 ``[batch]``, float32
        ``[batch]``, int64 ``[batch, num_logprobs]`` and float32 ``[batch, num_logprobs]``, the
        most likely tokens first (ties by lower id); slots past the tokens that have any
        probability hold id ``-1`` and ``-inf``.
    """
    return torch.ops.fastllm.sample_with_logprobs.default(
        logits, temperature, top_k, top_p, min_p, seeds, offsets, int(num_logprobs))


@fake_kernel("sample_with_logprobs")
def _sample_with_logprobs_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets,
                               num_logprobs):
    tokens = _sample_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    batch = logits.shape[0]
    return (tokens, logits.new_empty((batch,), dtype=torch.float32),
            logits.new_empty((batch, num_logprobs), dtype=torch.int64),
            logits.new_empty((batch, num_logprobs), dtype=torch.float32))


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
    logit_bias: Tensor | None = None,
) -> None:
    """Applies logit bias and repetition / frequency / presence penalties to ``logits`` in place.

    In order, per row ``r`` and token ``t``:

    1. ``logits += logit_bias`` (when given);
    2. repetition penalty (HF / vLLM): when ``t`` is in the prompt or the output so far,
       ``logit / p`` if ``logit > 0`` else ``logit * p`` (``p = 1`` = off);
    3. ``logit -= frequency_penalty * output_counts[r, t]``;
    4. ``logit -= presence_penalty * (output_counts[r, t] > 0)`` (OpenAI / vLLM semantics).

    Args:
        logits: ``[batch, vocab]`` float32 / bfloat16 / float16, modified in place; one that
            reaches an element through several indices (an expanded tensor) is a
            ``ValueError``.
        prompt_mask: bool ``[batch, vocab]``, True for tokens in the prompt.
        output_counts: int32 ``[batch, vocab]``, occurrences in the generated tokens.
        repetition_penalty, frequency_penalty, presence_penalty: float32 ``[batch]``.
        logit_bias: float32 ``[batch, vocab]`` or None.
    """
    torch.ops.fastllm.apply_penalties.default(logits, prompt_mask, output_counts,
                                              repetition_penalty, frequency_penalty,
                                              presence_penalty, logit_bias)


@fake_kernel("apply_penalties")
def _apply_penalties_fake(logits, prompt_mask, output_counts, repetition_penalty,
                          frequency_penalty, presence_penalty, logit_bias=None):
    check_one_device(logits=logits, prompt_mask=prompt_mask, output_counts=output_counts,
                      repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                      presence_penalty=presence_penalty, logit_bias=logit_bias)
