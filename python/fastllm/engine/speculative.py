"""Speculative decoding: cheap drafts of a request's next tokens, checked by the model in one step.

A proposer guesses up to k next tokens of a decoding request: :class:`NgramProposer` looks the
request's last n tokens up earlier in its own tokens (prompt lookup, as vLLM's ``ngram``
method) and proposes what followed them; :class:`DraftModelProposer` runs a small model that
shares the tokenizer. The scheduler appends the drafts to the request's sequence and schedules
``[last token, d_1 .. d_k]`` as one short prefill chunk through paged attention; the model
runner gives logits at each of its k + 1 rows.

Verification (:func:`accepted_length`): every row is sampled exactly as a plain decode step
samples that position (same penalties, same seeded random stream keyed by the request's seed
and output position), and the drafts are kept while they equal those samples; the first sample
that differs, or the one after the last draft, is the step's own token. A request's tokens are
therefore the ones it gets without speculation, greedy or sampled, whatever was drafted. For a
draft that is a token rather than a distribution (n-gram, or a draft model's own seeded draw)
this is Leviathan et al.'s rejection sampling: draft d is kept with probability p(d), and a
rejected position's token follows p restricted to the other tokens, the normalized residual
max(0, p - q) for a one-hot q. The draft model draws its drafts with the same seeded stream at
the same positions (a Gumbel-max coupling of its distribution with the target's), so on
sampled requests it is accepted where both draws agree: with probability at least
(1 - TV) / (1 + TV) for the two distributions' total variation distance TV, a little under
rejection sampling's 1 - TV, in exchange for output that never depends on the drafts.

The KV of rejected drafts is dropped from the block manager (:meth:`BlockManager.truncate`)
before it is ever marked computed, so no block holding it enters the prefix cache.

Speculation turns itself down per request (:class:`DraftLength`): each request drafts the
number of tokens that pays best for its recent acceptance and the engine's measured cost of
steps that draft and verify that many (:class:`StepCosts`: a verification row costs a small
share of a decode step on float weights, a larger one on quantized ones), and stops
drafting for a while, longer each time, when none pays or its drafts keep failing.
"""

from __future__ import annotations

import collections
import itertools
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastllm.engine.model_runner import ModelRunner
from fastllm.kv_cache import KVCacheFullError, PagedKVCache
from fastllm.models import DecoderLM
from fastllm.ops.host_to_device import to_host
from fastllm.sampling import SamplingParams, SamplingTensors, draw

__all__ = ["DraftLength", "DraftModelProposer", "DraftingRequest", "NgramIndex",
           "NgramProposer", "SpeculativeConfig", "StepCosts", "accepted_length"]

_METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    """How an engine speculates (``LLM(..., speculative={...})`` takes these keys).

    Attributes:
        method: "ngram" (prompt lookup in the request's own tokens) or "draft" (a small model).
        num_speculative_tokens: the most tokens drafted for a request per step (k).
        prompt_lookup_max, prompt_lookup_min: "ngram": the longest and shortest suffix of the
            request's tokens looked up in its earlier tokens; the longest match wins. Down to
            single tokens by default, as HF transformers' prompt lookup: on a SmolLM2 summary
            they drafted the next token right at 68 of 129 positions, against 53 from pairs
            on.
        model: "draft": the draft model, what :func:`fastllm.load` reads (a Hugging Face
            folder, a GGUF file or a hub name) with the target's tokenizer (same vocabulary).
        revision: "draft": the hub draft model's branch, tag or commit.
        draft_dtype: "draft": the draft model's activation dtype; None = the target's.
        adaptive: shrink and pause drafting for requests whose drafts are rejected
            (:class:`DraftLength`); False drafts k tokens whenever the proposer has them.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | os.PathLike | None = None
    revision: str | None = None
    draft_dtype: str | torch.dtype | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"speculative method must be one of {_METHODS}, got "
                             f"{self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min={self.prompt_lookup_min} is above "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"speculative adaptive must be a bool, got {self.adaptive!r}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative 'model' is the draft method's draft model: give it "
                             f"with method='draft' (and only then), got method={self.method!r}, "
                             f"model={self.model!r}")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None
           ) -> SpeculativeConfig | None:
        """A config from ``LLM``'s ``speculative`` argument (a dict of these fields)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative must be None, a dict or a SpeculativeConfig, got "
                            f"{type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass
class DraftLength:
    """A request's adaptive draft length: how many tokens to draft for its next step.

    It estimates the request's acceptance probability per drafted token (alpha: accepted
    drafts over accepted drafts plus rejections, decayed so that recent steps count most,
    starting from an optimistic prior) and drafts the k in ``[0, limit]`` that maximizes the
    expected tokens per second, ``(1 + alpha + ... + alpha^k) / step_s[k]``, with ``step_s[k]``
    what a step drafting and verifying k tokens costs as the engine measured it
    (:class:`StepCosts`), where that beats a plain step's by ``MARGIN``. When no k > 0 pays,
    drafting pauses for ``pause`` steps, doubled at each pause (up to ``MAX_PAUSE``) and reset
    when drafts chosen because they pay are accepted; then it probes with one draft (an
    accepted probe lets the estimate choose again: when drafting still does not pay, the next
    pause is longer). So a request whose text does not repeat, or an engine where drafting
    costs more than it gives, runs almost as without speculation. Failed drafts pause it only
    through the estimate: drafts right only part of the time often fail twice in a row, and
    pay all the same, so a rule pausing after failed verifications would stop drafting that
    pays.

    ``gives_up``: for a proposer that reads every token the request emits, drafting or not (a
    draft model), a pause saves nothing of that reading, and resuming reads the paused tokens
    first (a probe after a long pause costs several plain steps); so the second pause before
    drafting has paid again stops drafting for the rest of the request (:attr:`stopped`), as
    does a step cost that no acceptance could repay (k drafts all accepted, k + 1 tokens, not
    worth a step drafting k: a draft model almost as slow as its target). Its probes, the
    request's first drafts included, draft ``limit`` tokens: their cost is mostly that reading,
    and they teach alpha ``limit`` times as fast.

    ``adaptive=False``: always ``limit``.
    """

    limit: int
    adaptive: bool = True
    gives_up: bool = False
    stopped: bool = False
    accepted: float = 3.0  # decayed counts; the prior: alpha = 0.75
    rejected: float = 1.0
    pause: int = 0
    paused_for: int = 0
    probing: bool = False

    DECAY = 0.8
    # Drafting must promise this much more than a plain step's tokens per second: alpha and
    # the costs are estimates, and near the break-even a wrong bet loses more than a right one
    # gains.
    MARGIN = 0.1
    FIRST_PAUSE = 4
    MAX_PAUSE = 64

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def resuming(self) -> bool:
        """Whether this step's drafts are a probe after a pause (a draft model reads the
        tokens it missed first, so the step costs more than drafting); a request's first
        probe is not."""
        return self.probing and self.pause > 0

    def next_k(self, step_s: Sequence[float] | None = None) -> int:
        """Drafts wanted this step; ``step_s[k]`` is a step's cost with k drafts (k = 0 ..
        limit), None when the engine has not measured a plain step yet (then none). Counts a
        paused step down."""
        if not self.adaptive:
            return self.limit
        if step_s is None or self.gives_up_if_hopeless(step_s):
            return 0
        if self.paused_for > 0:
            self.paused_for -= 1
            if self.paused_for == 0:
                self.probing = True
            return 0
        if self.probing:
            return self.limit if self.gives_up else 1
        best_k, best, tokens = 0, (1 + self.MARGIN) / step_s[0], 1.0
        for k in range(1, self.limit + 1):
            tokens += self.alpha ** k
            if tokens / step_s[k] > best:
                best_k, best = k, tokens / step_s[k]
        if best_k == 0:
            self._pause()
        return best_k

    def gives_up_if_hopeless(self, step_s: Sequence[float]) -> bool:
        """Whether drafting stopped for good, stopping it now for a proposer that gives up
        where not even drafts all accepted would pay: k drafts giving k + 1 tokens are worth no
        step drafting k (by ``MARGIN``, as :meth:`next_k` judges). No probe can change that."""
        if self.adaptive and self.gives_up and not self.stopped:
            plain = (1 + self.MARGIN) / step_s[0]
            self.stopped = all((k + 1) / step_s[k] <= plain for k in range(1, self.limit + 1))
        return self.stopped

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Learns from a verification of ``num_drafted`` drafts."""
        if not self.adaptive or num_drafted == 0:
            return
        probe, self.probing = self.probing, False
        self.accepted = self.DECAY * self.accepted + num_accepted
        self.rejected = self.DECAY * self.rejected + (num_accepted < num_drafted)
        if num_accepted > 0 and not probe:  # drafting that paid was accepted
            self.pause = 0

    def __post_init__(self) -> None:
        self.probing = self.gives_up  # its first drafts are a probe

    def _pause(self) -> None:
        if self.gives_up and self.pause > 0:  # paused before, and drafting has not paid since
            self.stopped = True
        self.pause = min(self.MAX_PAUSE, max(self.FIRST_PAUSE, 2 * self.pause))
        self.paused_for = self.pause


class StepCosts:
    """What decode steps cost, measured: ``verify[k]``, a step whose longest draft was k tokens
    (k = 0: a plain decode step); ``draft[k]``, drafting k tokens. Each is the median of its
    ``WINDOW`` latest samples (a step is slower now and then, e.g. the first after a prefill,
    and one such sample must not decide for long). Unmeasured lengths are estimated from the
    measured ones (a verification row at ``ROW_COST`` of a step, drafting linear in k) so each
    gets tried."""

    ROW_COST = 0.1
    WINDOW = 8

    def __init__(self, limit: int) -> None:
        self._verify = [collections.deque(maxlen=self.WINDOW) for _ in range(limit + 1)]
        self._draft = [collections.deque(maxlen=self.WINDOW) for _ in range(limit + 1)]

    def record_step(self, k: int, seconds: float) -> None:
        self._verify[k].append(seconds)

    def record_drafting(self, k: int, seconds: float) -> None:
        self._draft[k].append(seconds)

    @property
    def verify(self) -> list[float | None]:
        return [statistics.median(samples) if samples else None for samples in self._verify]

    @property
    def draft(self) -> list[float | None]:
        return [0.0] + [statistics.median(samples) if samples else None
                        for samples in self._draft[1:]]

    def step_s(self) -> list[float] | None:
        """Each k's cost: verifying plus drafting (None before a plain step was measured)."""
        verify, draft = self.verify, self.draft
        base = verify[0]
        if base is None:
            return None
        per_draft = [d / k for k, d in enumerate(draft) if k and d is not None]
        draft_per_token = min(per_draft, default=0.0)
        return [(base * (1 + k * self.ROW_COST) if v is None else v)
                + (draft_per_token * k if d is None else d)
                for k, (v, d) in enumerate(zip(verify, draft))]


class DraftingRequest(Protocol):
    """What a proposer reads of a request (a worker's record of it; hashable by identity)."""

    params: SamplingParams
    seed: int

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


def accepted_length(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions: ``sampled[i]`` is
    the token drawn at the row before ``drafts[i]`` (``len(sampled) == len(drafts) + 1``)."""
    return _common_prefix(drafts, sampled)


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's
    last n tokens, for the longest n in ``[prompt_lookup_min, prompt_lookup_max]`` that
    occurs.

    Each request's n-grams are indexed as its tokens arrive (:class:`NgramIndex`), so a lookup
    costs a few dictionary probes whatever the request's length: rescanning every token each
    step would cost a share of every step of free writing, where nothing repeats. An index holds
    (max - min + 1) entries per token of its request and goes when the request leaves the engine
    (:meth:`release`)."""

    reads_every_token = False  # it looks tokens up only when asked for drafts

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._indexes: dict[DraftingRequest, NgramIndex] = {}

    def propose(self, requests: Sequence[DraftingRequest], lengths: Sequence[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` drafts for each request (possibly none)."""
        drafts = []
        for request, k in zip(requests, lengths):
            index = self._indexes.get(request)
            if index is None and k > 0:
                index = self._indexes[request] = NgramIndex(self.min_n, self.max_n)
            drafts.append(index.lookup(request.all_token_ids, k) if k > 0 else [])
        return drafts

    def prepare(self, requests: Sequence[DraftingRequest]) -> None:
        """Nothing to prepare: a request's index is built at its first lookup."""

    def release(self, request: DraftingRequest) -> None:
        """Drops the request's n-gram index (it finished, failed or stopped drafting)."""
        self._indexes.pop(request, None)

    @property
    def num_held(self) -> int:
        """Requests whose index it holds (none once every request left)."""
        return len(self._indexes)


class NgramIndex:
    """The latest start of each n-gram (n in ``[min_n, max_n]``) of a growing token sequence,
    over the n-grams that end before its last token: those the sequence's last n tokens can
    be found at. Tokens are only ever appended (a request's tokens), so each lookup indexes
    just the n-grams the new tokens complete."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._starts: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams starting before this are indexed (each n up to its end)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        of ``tokens`` found (``tokens`` extends those of the previous call)."""
        total = len(tokens)
        for n, starts in self._starts.items():
            # Starts up to total - 1 - n: the n-gram ends before the last token.
            for start in range(max(0, self._indexed - n), total - n):
                starts[tuple(tokens[start:start + n])] = start
        self._indexed = total
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self._starts[n].get(tuple(tokens[total - n:]))
            if start is not None:
                return list(tokens[start + n:start + n + k])
        return []


class DraftModelProposer:
    """Drafts with a small model in a paged KV cache of its own (its own block manager, owned
    here: the scheduler never sees it; no prefix caching, so dropping drafted tokens' KV never
    touches a cached block). Each step it computes the request's tokens it lacks, then draws
    k tokens one step at a time with the request's sampling parameters and seeded stream at
    those positions (penalties aside: drafts need not be exact to keep the output exact). Its
    steps run through a :class:`ModelRunner` as the target's do
    (:meth:`ModelRunner.execute_placed_sequences`, its cache placed here), and its draws
    through the target's sampling path (:class:`SamplingTensors`, :func:`draw`)."""

    reads_every_token = True  # its KV must hold every token before it drafts the next

    def __init__(self, model: DecoderLM, device: torch.device, num_blocks: int,
                 block_size: int, max_model_len: int) -> None:
        self.model = model
        spec = model.kv_cache_spec(block_size, model.dtype)
        self.kv_cache = PagedKVCache(spec, num_blocks, device=device,
                                     enable_prefix_caching=False)
        model.reserve_positions(max_model_len)
        self.runner = ModelRunner(model, self.kv_cache)
        self.vocab_size = model.config.vocab_size
        self._seq_ids: dict[DraftingRequest, int] = {}
        self._held: dict[DraftingRequest, list[int]] = {}  # the tokens each draft sequence holds
        self._next_id = itertools.count()

    def release(self, request: DraftingRequest) -> None:
        """Drops the request's draft KV (it finished or failed)."""
        seq_id = self._seq_ids.pop(request, None)
        self._held.pop(request, None)
        if seq_id is not None:
            self.kv_cache.block_manager.free(seq_id)

    @property
    def num_held(self) -> int:
        """Requests whose draft KV it holds (none once every request left)."""
        return len(self._seq_ids)

    def prepare(self, requests: Sequence[DraftingRequest]) -> None:
        """Prefills the draft model on the tokens of the requests it has not seen, but their
        last (left for :meth:`propose` to give logits): a one-time cost per request, kept out
        of the drafting cost the engine measures."""
        manager = self.kv_cache.block_manager
        new, prompts = [], []
        for request in requests:
            if request in self._seq_ids:
                continue
            tokens = request.all_token_ids
            seq_id = next(self._next_id)
            try:
                manager.allocate(seq_id, tokens)
            except KVCacheFullError:
                continue
            self._seq_ids[request], self._held[request] = seq_id, list(tokens)
            new.append(seq_id)
            prompts.append(tokens[:-1])
        if new:
            self.runner.execute_placed_sequences(new, prompts, starts=[0] * len(new),
                                                 logits=False)

    def propose(self, requests: Sequence[DraftingRequest], lengths: Sequence[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` drafts for each request (none where the draft KV pool is
        full)."""
        manager = self.kv_cache.block_manager
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[int] = []  # indices into requests still drafting
        new_tokens: list[list[int]] = []
        for i, (request, k) in enumerate(zip(requests, lengths)):
            if k <= 0:
                continue
            tokens = request.all_token_ids
            try:
                computed = self._place(request, tokens)
            except KVCacheFullError:
                self.release(request)
                continue
            active.append(i)
            new_tokens.append(tokens[computed:])
        step = 0
        while active:
            picked = [requests[i] for i in active]
            seq_ids = [self._seq_ids[r] for r in picked]
            params = [r.params for r in picked]
            # The seeded stream at the positions the target samples them: a coupled draw.
            inputs = SamplingTensors.host_columns(
                params, self.vocab_size, [r.seed for r in picked],
                [len(r.output_token_ids) + step for r in picked])
            # The sampler's inputs ride along in the step's one copy.
            output = self.runner.execute_placed_sequences(seq_ids, new_tokens, inputs)
            tensors = SamplingTensors.from_columns(output.extra, params, self.vocab_size)
            tokens, = to_host(draw(output.logits, tensors, logprobs=False).tokens)
            tokens = tokens.tolist()
            still, new_tokens = [], []
            for i, request, seq_id, token in zip(active, picked, seq_ids, tokens):
                drafts[i].append(token)
                if len(drafts[i]) == lengths[i]:
                    continue
                try:
                    manager.append_tokens(seq_id, [token])
                except KVCacheFullError:
                    continue
                self._held[request].append(token)
                still.append(i)
                new_tokens.append([token])
            active = still
            step += 1
        return drafts

    def _place(self, request: DraftingRequest, tokens: list[int]) -> int:
        """Makes the request's draft sequence hold ``tokens``, keeping the KV of the leading
        tokens it already computed (its earlier drafts that were accepted); returns how many
        are computed."""
        manager = self.kv_cache.block_manager
        seq_id = self._seq_ids.get(request)
        if seq_id is None:
            seq_id = next(self._next_id)
            manager.allocate(seq_id, tokens)
            self._seq_ids[request], self._held[request] = seq_id, list(tokens)
            return 0
        held = self._held[request]
        # Computed and still the request's, with one left to give logits.
        agree = min(_common_prefix(held, tokens), manager.num_computed_tokens(seq_id),
                    len(tokens) - 1)
        manager.truncate(seq_id, agree)
        self._held[request] = held[:agree]
        manager.append_tokens(seq_id, tokens[agree:])
        self._held[request] = list(tokens)
        return agree


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
