"""Sampling parameters (vLLM's names and meanings) and the batched sampling step.

A batch mixes requests with different parameters: :class:`SamplingTensors` turns their
:class:`SamplingParams` into per-row tensors once, and :func:`sample_next_tokens` runs the
penalties op (when any row needs it) and the sampling op on a step's logits.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm import ops
from fastllm.ops.host_to_device import device_tensor, to_device

__all__ = ["SamplingParams", "SamplingTensors", "SampleOutput", "resolve_seed",
           "sample_next_tokens"]

_MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    """How one request picks its tokens; the names and meanings are vLLM's.

    Attributes:
        temperature: 0 = greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (ties with the k-th kept); <= 0 = off.
        top_p: keep the most likely tokens up to this probability mass; 1 = off.
        min_p: keep tokens at least this fraction as likely as the most likely one; 0 = off.
        repetition_penalty: HF/vLLM penalty on tokens of the prompt and the output; 1 = off.
        presence_penalty: subtracted once from tokens that appear in the output; 0 = off.
        frequency_penalty: subtracted per occurrence in the output; 0 = off.
        logit_bias: token id -> value added to its logit.
        seed: makes the request's tokens reproducible whatever else is in the batch; None draws
            a fresh seed for the request.
        max_tokens: most tokens to generate.
        stop: strings that end the generation when they appear in the output.
        stop_token_ids: tokens that end the generation.
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: report this many top log-probabilities per sampled position (None = none).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (isinstance(self.top_k, int), f"top_k must be an int, got {self.top_k!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (math.isfinite(self.presence_penalty),
             f"presence_penalty must be finite, got {self.presence_penalty}"),
            (math.isfinite(self.frequency_penalty),
             f"frequency_penalty must be finite, got {self.frequency_penalty}"),
            (all(math.isfinite(v) for v in self.logit_bias.values()),
             f"logit_bias values must be finite, got {self.logit_bias}"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= _MAX_SEED),
             f"seed must be None or an int in [0, 2**63), got {self.seed!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an int >= 1, got {self.max_tokens!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be None or an int >= 0, got {self.logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must hold non-empty strings, got {self.stop!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def needs_penalties(self) -> bool:
        """Whether sampling must run the penalties op (a penalty or a logit bias is set)."""
        return bool(self.logit_bias or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError for a token id the model does not have."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            unknown = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
            if unknown:
                raise ValueError(f"{name} names token ids {unknown} outside the vocabulary "
                                 f"[0, {vocab_size})")


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one when it has none."""
    return secrets.randbelow(_MAX_SEED) if params.seed is None else params.seed


@dataclass
class SamplingTensors:
    """The per-row tensors of a batch of requests, built once per batch composition."""

    temperature: Tensor  # float32 [batch]
    top_k: Tensor  # int32 [batch]
    top_p: Tensor  # float32 [batch]
    min_p: Tensor  # float32 [batch]
    repetition_penalty: Tensor  # float32 [batch]
    frequency_penalty: Tensor  # float32 [batch]
    presence_penalty: Tensor  # float32 [batch]
    logit_bias: Tensor | None  # float32 [batch, vocab], None when no row has a bias
    seeds: Tensor  # int64 [batch]
    wants_logprobs: bool  # some row set logprobs (0 = the sampled token's alone)
    num_logprobs: int  # the most alternatives any row asked for
    needs_penalties: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device | str = "cpu",
                    seeds: Sequence[int] | None = None) -> SamplingTensors:
        """Rows in the order of ``params``. ``seeds`` are the rows' seeds (an engine draws one
        per request once, so it survives preemption); by default a request without a seed
        gets a fresh random one."""
        for p in params:
            p.check_vocab(vocab_size)

        def column(values: list, dtype: torch.dtype) -> Tensor:
            return device_tensor(values, dtype, device)

        logit_bias = None
        if any(p.logit_bias for p in params):
            logit_bias = torch.zeros(len(params), vocab_size, dtype=torch.float32)
            for row, p in enumerate(params):
                for token, bias in p.logit_bias.items():
                    logit_bias[row, token] = bias
            logit_bias = to_device(logit_bias, device)
        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int32),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
            presence_penalty=column([p.presence_penalty for p in params], torch.float32),
            logit_bias=logit_bias,
            seeds=column(list(seeds) if seeds is not None else
                         [resolve_seed(p) for p in params], torch.int64),
            wants_logprobs=any(p.logprobs is not None for p in params),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            needs_penalties=any(p.needs_penalties() for p in params),
        )


@dataclass
class SampleOutput:
    """One step's tokens and, when asked for, their log-probabilities."""

    tokens: Tensor  # int64 [batch]
    token_logprobs: Tensor | None = None  # float32 [batch]
    top_ids: Tensor | None = None  # int64 [batch, num_logprobs]
    top_logprobs: Tensor | None = None  # float32 [batch, num_logprobs]

    def to_host(self) -> SampleOutput:
        """Every tensor on the CPU, each copied once (not one element at a time)."""
        def host(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.cpu()
        return SampleOutput(host(self.tokens), host(self.token_logprobs), host(self.top_ids),
                            host(self.top_logprobs))


def sample_next_tokens(logits: Tensor, tensors: SamplingTensors, offsets: Tensor, *,
                       prompt_mask: Tensor | None = None,
                       output_counts: Tensor | None = None) -> SampleOutput:
    """One sampling step: penalties (in place on ``logits``) when a row needs them, then the draw.

    Args:
        logits: ``[batch, vocab]``, modified in place when penalties apply.
        tensors: the batch's parameters.
        offsets: int64 ``[batch]``, each request's step (tokens it has sampled so far), the
            counter of its random stream.
        prompt_mask, output_counts: bool / int32 ``[batch, vocab]``, needed when
            ``tensors.needs_penalties``.
    """
    if tensors.needs_penalties:
        if prompt_mask is None or output_counts is None:
            raise ValueError("this batch has penalties or logit bias: pass prompt_mask and "
                             "output_counts")
        ops.apply_penalties(logits, prompt_mask, output_counts, tensors.repetition_penalty,
                            tensors.frequency_penalty, tensors.presence_penalty,
                            tensors.logit_bias)
    args = (logits, tensors.temperature, tensors.top_k, tensors.top_p, tensors.min_p,
            tensors.seeds, offsets)
    if not tensors.wants_logprobs:
        return SampleOutput(ops.sample(*args))
    return SampleOutput(*ops.sample_with_logprobs(*args, tensors.num_logprobs))
