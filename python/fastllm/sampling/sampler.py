"""Sampling parameters (vLLM's names and meanings) and the batched sampling step.

A batch mixes requests with different parameters: :class:`SamplingTensors` turns their
:class:`SamplingParams`, seeds and stream positions into per-row tensors (a few host tensors,
:meth:`SamplingTensors.host_columns`, that an engine folds into its step's one copy and reads
back on the device with :meth:`SamplingTensors.from_columns`); :func:`penalize` and
:func:`draw` (or both at once, :func:`sample_next_tokens`) sample a step's logits. The engine's
target model and its speculative draft model sample through this one path, so a row keyed by
the same seed and position draws from the same random stream in both.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm import ops
from fastllm.ops.host_to_device import to_host

__all__ = ["SamplingParams", "SamplingTensors", "SampleOutput", "StructuredOutputsParams",
           "draw", "mask_tokens", "penalize", "resolve_seed", "sample_next_tokens"]

_MAX_SEED = 2**63 - 1
# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS): the scaled logits of
# smaller ones are nearly one-hot anyway, and 1 / temperature overflows float32 below ~3e-39.
_GREEDY_TEMPERATURE = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
_MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API and vLLM


def _float32(value: float) -> float:
    """``value`` as the kernels see it: rounded to float32 (+-inf past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _finite_float32(value: float) -> bool:
    return math.isfinite(_float32(value))


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema (a dict, or its JSON text) the output must validate against.
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (llguidance's dialect) the output must derive.

    The engine compiles it with llguidance when the request is added (an invalid schema,
    regex or grammar is a ValueError then) and masks, at each step, the tokens that cannot
    continue it; the request stops once the constraint is complete.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raises TypeError/ValueError naming a bad field."""
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, "
                             f"choice and grammar, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise TypeError(f"json must be a JSON schema (a dict or its JSON text), got "
                            f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        if self.choice is not None and (
                isinstance(self.choice, str) or not isinstance(self.choice, Sequence)
                or not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got "
                             f"{self.choice!r}")


@dataclass
class SamplingParams:
    """How one request picks its tokens; the names and meanings are vLLM's.

    Every value is checked here against what the sampling kernels will use (float32): a value
    that float32 cannot hold as given is a ValueError naming the field and the value.

    Attributes:
        temperature: 0 = greedy (argmax); otherwise logits are divided by it. Below 1e-5 it is
            greedy too (vLLM's rule: such temperatures leave the argmax alone anyway, and
            1 / temperature would overflow float32); at most float32's largest value.
        top_k: keep the k most likely tokens (ties with the k-th kept); <= 0 = off.
        top_p: keep the most likely tokens up to this probability mass; 1 = off.
        min_p: keep tokens at least this fraction as likely as the most likely one; 0 = off.
        repetition_penalty: HF/vLLM penalty on tokens of the prompt and the output; 1 = off. In
            float32's normal range (about [1.2e-38, 3.4e38]), so that 1 / it is finite.
        presence_penalty: subtracted once from tokens that appear in the output; 0 = off. In
            [-2, 2] (OpenAI's and vLLM's range).
        frequency_penalty: subtracted per occurrence in the output; 0 = off. In [-2, 2].
        logit_bias: token id -> value added to its logit, finite in float32.
        seed: makes the request's tokens reproducible whatever else is in the batch; None draws
            a fresh seed for the request.
        max_tokens: most tokens to generate; 0 computes the prompt alone (with
            ``prompt_logprobs``, its log-probabilities) and generates nothing.
        stop: strings that end the generation when they appear in the output.
        stop_token_ids: tokens that end the generation.
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: report this many top log-probabilities per sampled position (None = none);
            at most the vocabulary's size (checked by :meth:`check_vocab`, when the request is
            added).
        prompt_logprobs: report each prompt token's log-probability under the model given the
            tokens before it, and this many top alternatives (None = none; 0 = the token's
            alone), as vLLM: from the raw logits (no temperature, penalty or filter), in the
            prefill that runs anyway. Such a prompt is computed whole, never found in the prefix
            cache.
        structured_outputs: constrain the output to a JSON schema, any JSON object, a regex,
            a list of choices or a grammar (:class:`StructuredOutputsParams`); None = free.
        skip_special_tokens: leave special tokens out of the output text, their ids kept (a
            tool-call parser that reads a special marker such as Mistral's ``[TOOL_CALLS]``
            turns it off).
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
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.check()

    def check(self) -> None:
        """Raises TypeError/ValueError naming a bad field and its value (run on construction;
        again when a request is made, in case a field was changed since)."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if isinstance(value, int) and abs(value) > _FLOAT32_MAX:  # float() would overflow
                raise ValueError(f"{name} is outside float32's range, got {value}")
        if not isinstance(self.logit_bias, Mapping) or not all(
                isinstance(v, numbers.Real) and not isinstance(v, bool)
                for v in self.logit_bias.values()):
            raise TypeError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        checks = [
            (self.temperature >= 0 and _finite_float32(self.temperature),
             f"temperature must be >= 0 (0 = greedy) and finite in float32, got "
             f"{self.temperature}"),
            (isinstance(self.top_k, int) and not isinstance(self.top_k, bool),
             f"top_k must be an int, got {self.top_k!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (_float32(self.top_p) > 0, f"top_p must not round to 0 in float32, got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (_FLOAT32_TINY <= _float32(self.repetition_penalty) <= _FLOAT32_MAX,
             f"repetition_penalty must be > 0 (1 = off) and in float32's normal range "
             f"[{_FLOAT32_TINY:.4g}, {_FLOAT32_MAX:.4g}], got {self.repetition_penalty}"),
            (-_MAX_PENALTY <= self.presence_penalty <= _MAX_PENALTY,
             f"presence_penalty must be in [-2, 2] (0 = off), got {self.presence_penalty}"),
            (-_MAX_PENALTY <= self.frequency_penalty <= _MAX_PENALTY,
             f"frequency_penalty must be in [-2, 2] (0 = off), got {self.frequency_penalty}"),
            (all(_finite_float32(v) for v in self.logit_bias.values()),
             f"logit_bias values must be finite in float32 (|value| <= {_FLOAT32_MAX:.4g}), "
             f"got {self.logit_bias}"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= _MAX_SEED),
             f"seed must be None or an int in [0, 2**63), got {self.seed!r}"),
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and self.max_tokens >= 0,
             f"max_tokens must be an int >= 0 (0: the prompt alone), got {self.max_tokens!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be None or an int >= 0, got {self.logprobs!r}"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and not isinstance(self.prompt_logprobs, bool)
                                              and self.prompt_logprobs >= 0),
             f"prompt_logprobs must be None or an int >= 0, got {self.prompt_logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must hold non-empty strings, got {self.stop!r}"),
            (isinstance(self.skip_special_tokens, bool),
             f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError(f"structured_outputs must be StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.check()

    @property
    def is_greedy(self) -> bool:
        """Whether the request takes the argmax: temperature below 1e-5 (0 included)."""
        return self.temperature < _GREEDY_TEMPERATURE

    def needs_penalties(self) -> bool:
        """Whether sampling must run the penalties op (a penalty or a logit bias is set)."""
        return bool(self.logit_bias or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError for a token id the model does not have, or for more logprobs than
        the vocabulary has tokens."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            unknown = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
            if unknown:
                raise ValueError(f"{name} names token ids {unknown} outside the vocabulary "
                                 f"[0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, "
                                 f"got {value}")


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one when it has none."""
    return secrets.randbelow(_MAX_SEED) if params.seed is None else params.seed


# SamplingTensors' float32 columns, in the order of host_columns' "floats" rows.
_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty")


@dataclass
class SamplingTensors:
    """The per-row tensors of a batch of requests: each row's parameters and the key of its
    random stream (its request's seed and the row's position in the request's output)."""

    temperature: Tensor  # float32 [batch]
    top_k: Tensor  # int32 [batch]
    top_p: Tensor  # float32 [batch]
    min_p: Tensor  # float32 [batch]
    repetition_penalty: Tensor  # float32 [batch]
    frequency_penalty: Tensor  # float32 [batch]
    presence_penalty: Tensor  # float32 [batch]
    logit_bias: Tensor | None  # float32 [batch, vocab], None when no row has a bias
    seeds: Tensor  # int64 [batch]
    offsets: Tensor  # int64 [batch]
    wants_logprobs: bool  # some row set logprobs (0 = the sampled token's alone)
    num_logprobs: int  # the most alternatives any row asked for
    needs_penalties: bool

    @staticmethod
    def host_columns(params: Sequence[SamplingParams], vocab_size: int, seeds: Sequence[int],
                     offsets: Sequence[int]) -> dict[str, Tensor]:
        """The host tensors :meth:`from_columns` reads once they are on the device (a caller
        moves them with the rest of its step's inputs): float32 ``[6, batch]`` "floats",
        int32 "top_k", int64 "seeds" and "offsets", and the logit biases as flat int64
        "bias_index" into ``[batch, vocab]`` and float32 "bias_value" when a row has one.

        Row r draws from the random stream keyed by ``seeds[r]`` (its request's seed, drawn
        once by :func:`resolve_seed`, so it survives preemption) at counter ``offsets[r]`` (the
        tokens its request had generated before the row): the batch around it, and whether
        the position is decoded, verified or drafted, never change its draw."""
        for p in params:
            p.check_vocab(vocab_size)
        columns = {
            "floats": torch.tensor(
                [[0.0 if p.is_greedy else p.temperature for p in params],
                 *([getattr(p, name) for p in params] for name in _FLOAT_COLUMNS[1:])],
                dtype=torch.float32),
            # top_k >= vocab is off, as <= 0 is: clamped, it fits int32 whatever its value.
            "top_k": torch.tensor([min(max(p.top_k, 0), vocab_size) for p in params],
                                  dtype=torch.int32),
            "seeds": torch.tensor(list(seeds), dtype=torch.int64),
            "offsets": torch.tensor(list(offsets), dtype=torch.int64),
        }
        if any(p.logit_bias for p in params):
            entries = [(row * vocab_size + token, bias) for row, p in enumerate(params)
                       for token, bias in p.logit_bias.items()]
            columns["bias_index"] = torch.tensor([i for i, _ in entries], dtype=torch.int64)
            columns["bias_value"] = torch.tensor([b for _, b in entries], dtype=torch.float32)
        return columns

    @classmethod
    def from_columns(cls, columns: Mapping[str, Tensor], params: Sequence[SamplingParams],
                     vocab_size: int) -> SamplingTensors:
        """The tensors of :meth:`host_columns`' columns (views of them, on their device)."""
        floats = dict(zip(_FLOAT_COLUMNS, columns["floats"].unbind()))
        logit_bias = None
        if "bias_index" in columns:
            index = columns["bias_index"]
            logit_bias = torch.zeros(len(params), vocab_size, dtype=torch.float32,
                                     device=index.device)
            logit_bias.view(-1)[index] = columns["bias_value"]
        return cls(**floats, top_k=columns["top_k"], logit_bias=logit_bias,
                   seeds=columns["seeds"], offsets=columns["offsets"],
                   wants_logprobs=any(p.logprobs is not None for p in params),
                   num_logprobs=max((p.logprobs or 0 for p in params), default=0),
                   needs_penalties=any(p.needs_penalties() for p in params))

    def rows(self, index: slice) -> SamplingTensors:
        """The parameters of a slice of the rows (views), with the batch's logprobs width."""
        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]
        return dataclasses.replace(self, **{
            name: part(getattr(self, name))
            for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                         "frequency_penalty", "presence_penalty", "logit_bias", "seeds",
                         "offsets")})


@dataclass
class SampleOutput:
    """One step's tokens and, when asked for, their log-probabilities."""

    tokens: Tensor  # int64 [batch]
    token_logprobs: Tensor | None = None  # float32 [batch]
    top_ids: Tensor | None = None  # int64 [batch, num_logprobs]
    top_logprobs: Tensor | None = None  # float32 [batch, num_logprobs]

    @classmethod
    def cat(cls, outputs: Sequence[SampleOutput]) -> SampleOutput:
        """The rows of several outputs (of the same logprobs width), in order."""
        def cat(ts: list[Tensor | None]) -> Tensor | None:
            return None if ts[0] is None else torch.cat(ts)
        return cls(*(cat([getattr(o, name) for o in outputs])
                     for name in ("tokens", "token_logprobs", "top_ids", "top_logprobs")))

    def to_host(self) -> SampleOutput:
        """Every tensor on the CPU, all in one copy."""
        names = [name for name in ("tokens", "token_logprobs", "top_ids", "top_logprobs")
                 if getattr(self, name) is not None]
        return SampleOutput(**dict(zip(names, to_host(*(getattr(self, n) for n in names)))))


def penalize(logits: Tensor, tensors: SamplingTensors, prompt_mask: Tensor,
             output_counts: Tensor) -> None:
    """The penalties and logit bias of ``tensors``, in place on ``logits``: every row or, when
    it raises (the op checks all its inputs before it writes), none."""
    ops.apply_penalties(logits, prompt_mask, output_counts, tensors.repetition_penalty,
                        tensors.frequency_penalty, tensors.presence_penalty, tensors.logit_bias)


def mask_tokens(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """Sets to -inf, in place, the logits of the tokens a row may not take: ``bitmask`` is
    int32 ``[len(rows), ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set where
    token ``t`` is allowed in the row ``rows[i]`` (int64) of ``logits``; tokens past the mask's
    width are not allowed. Both on ``logits``' device: the bits are unpacked there (the mask
    travels 32 times smaller than the rows it masks)."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool()  # [rows, words * 32]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def draw(logits: Tensor, tensors: SamplingTensors, *, logprobs: bool = True) -> SampleOutput:
    """The sampling op on (penalized) ``logits``, each row from its stream at its offset; with
    log-probabilities when a row asked and ``logprobs`` (a draft model's caller reads the
    tokens alone)."""
    args = (logits, tensors.temperature, tensors.top_k, tensors.top_p, tensors.min_p,
            tensors.seeds, tensors.offsets)
    if not (logprobs and tensors.wants_logprobs):
        return SampleOutput(ops.sample(*args))
    return SampleOutput(*ops.sample_with_logprobs(*args, tensors.num_logprobs))


def sample_next_tokens(logits: Tensor, tensors: SamplingTensors, *,
                       prompt_mask: Tensor | None = None,
                       output_counts: Tensor | None = None) -> SampleOutput:
    """One sampling step: penalties (in place on ``logits``) when a row needs them, then the draw.

    Args:
        logits: ``[batch, vocab]``, modified in place when penalties apply.
        tensors: the batch's parameters and random-stream keys.
        prompt_mask, output_counts: bool / int32 ``[batch, vocab]``, needed when
            ``tensors.needs_penalties``.
    """
    if tensors.needs_penalties:
        if prompt_mask is None or output_counts is None:
            raise ValueError("this batch has penalties or logit bias: pass prompt_mask and "
                             "output_counts")
        penalize(logits, tensors, prompt_mask, output_counts)
    return draw(logits, tensors)
