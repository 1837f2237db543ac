"""A worker: one rank's side of a step, from a :class:`SchedulerOutput` to a
:class:`ModelRunnerOutput`.

The :class:`~fastllm.engine.model_runner.ModelRunner` runs the model; then, on the rank that
samples (the only one, under tensor parallelism: every rank holds the same full-vocabulary
logits), the worker samples each row with its request's parameters, penalties and grammar
mask, keeps the drafts that match the samples at their rows, and drafts the next tokens of the
requests that speculate. It keeps what sampling needs of each request (penalty counts, the
tokens a proposer reads, the adaptive draft length) from the request's first step until the
scheduler says it left.

Every move of KV tensors runs here, on each rank's own cache, from the step's fields (block
copies, chunk encodings loaded, saved and forgotten): the scheduler holds block and entry ids
only. The host waits for the device once per step, for the sampled ids. A step's host data (the
model's inputs and the sampler's parameters) reach the device in one copy, and its samples come
back in one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from fastllm import ops
from fastllm.engine.decode_graphs import DecodeGraphs
from fastllm.engine.model_runner import ModelRunner
from fastllm.engine.scheduler_output import (ModelRunnerOutput, NewRequest, SampledLogprobs,
                                             ScheduledSequence, SchedulerOutput, request_error)
from fastllm.engine.speculative import (DraftLength, DraftModelProposer, NgramProposer,
                                        SpeculativeConfig, StepCosts, accepted_length)
from fastllm.kv_cache import ChunkKVStore, PagedKVCache
from fastllm.lora.slots import LoRAConfig, LoRASlots
from fastllm.models import DecoderLM
from fastllm.models.pool import load
from fastllm.ops.host_to_device import StagingBuffer, to_host
from fastllm.sampling import SampleOutput, SamplingTensors, draw, mask_tokens, penalize

__all__ = ["RunnerRequest", "Worker"]

logger = logging.getLogger("fastllm")
T = TypeVar("T")


class RunnerRequest:
    """What a worker keeps of a sampling request: its parameters and seed, its tokens (the
    prompt, then each token the worker sampled for it), and, with penalties, its prompt's
    tokens and output counts on the device."""

    def __init__(self, new: NewRequest, vocab_size: int, device: torch.device) -> None:
        self.request_id = new.request_id
        self.params = new.params
        self.seed = new.seed
        self.all_token_ids = list(new.prompt_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.end_token_ids = set(new.end_token_ids)
        # With penalties only: bool [vocab] its prompt's tokens (sent with its first step's
        # inputs) and int32 [vocab] its output counts, on the device.
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        if new.params.needs_penalties():
            self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.draft_length: DraftLength | None = None  # made at its first draft

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def ended(self) -> bool:
        """Whether its last token ends it (an end token, or ``max_tokens``): the scheduler
        finishes it, so it drafts nothing more."""
        outputs = len(self.all_token_ids) - self.num_prompt_tokens
        return outputs >= self.params.max_tokens or (
            outputs > 0 and self.all_token_ids[-1] in self.end_token_ids)


class Worker:
    """Runs ``model`` over steps whose K/V live in ``kv_cache``; with ``samples`` (the driver
    rank), samples them and drafts under ``speculative``."""

    def __init__(self, model: DecoderLM, kv_cache: PagedKVCache, *, max_model_len: int,
                 decode_graphs: DecodeGraphs | None = None,
                 speculative: SpeculativeConfig | None = None, samples: bool = True,
                 lora: LoRAConfig | None = None) -> None:
        # This rank's adapter slots (its shard of each adapter), with LoRA.
        self.lora = None if lora is None else LoRASlots(model, lora)
        self.runner = ModelRunner(model, kv_cache, decode_graphs, self.lora)
        self.model, self.kv_cache = model, kv_cache
        self.device = kv_cache.k_cache.device
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        self.samples = samples
        self.speculative = speculative
        self.requests: dict[str, RunnerRequest] = {}
        self.chunks = ChunkKVStore()  # this rank's share of the stored chunk encodings
        # Constrained rows' bitmasks: sent once the model step is queued, in a copy of their own.
        self._mask_staging = StagingBuffer(self.device)
        self.proposer = self._make_proposer(speculative) if samples else None
        self._step_costs = None if speculative is None else \
            StepCosts(speculative.num_speculative_tokens)

    def _make_proposer(self, config: SpeculativeConfig | None
                       ) -> NgramProposer | DraftModelProposer | None:
        if config is None:
            return None
        if config.method == "ngram":
            return NgramProposer(config)
        draft = load(config.model, config.draft_dtype or self.model.dtype, self.device,
                     revision=config.revision)
        if draft.config.vocab_size != self.vocab_size:
            raise ValueError(f"speculative model {config.model} has a vocabulary of "
                             f"{draft.config.vocab_size} tokens, the model {self.vocab_size}: "
                             "a draft model must share the tokenizer")
        return DraftModelProposer(draft, self.device, self.kv_cache.num_blocks,
                                  self.kv_cache.spec.block_size, self.max_model_len)

    # ---- the step ----------------------------------------------------------------------------

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step; without ``samples``, the model alone (its output is empty)."""
        started = step.started or time.perf_counter()
        self._update_requests(step)
        self._move_kv(step)
        output = ModelRunnerOutput()
        if not step.sequences:
            return output
        if not self.samples:
            self.runner.execute(step)
            self._save_chunks(step)
            return output
        sampling = [(self.requests[s.request_id], s) for s in step.sequences if s.samples]
        # The sampler's inputs travel with the model's, in the step's one copy.
        inputs = self._sampling_inputs(sampling)
        masking = [r for r, _ in sampling if r.output_counts is not None and r.prompt_mask is None]
        for request in masking:
            mask = inputs[f"prompt_mask {request.request_id}"] = torch.zeros(
                self.vocab_size, dtype=torch.bool)
            mask[request.all_token_ids[:request.num_prompt_tokens]] = True
        logits = self.runner.execute(step, inputs)
        self._save_chunks(step)
        for request in masking:  # the staged copy lasts one step
            request.prompt_mask = logits.extra[f"prompt_mask {request.request_id}"].clone()
        output.scores = logits.scores
        output.prompt_logprobs = _prompt_logprobs(logits.prompt_logprobs, step)
        output.pooled = logits.pooled
        if not sampling:
            return output
        # SamplingParams checked every value on the host.
        with ops.trusted_inputs():
            sampling, sampled = self._sample(logits.logits, sampling, logits.extra, step,
                                             output.errors)
        if sampled is None:
            return output
        if self.proposer is not None:
            # The draft model reads a prompt when the target has read it, before the first
            # token: a one-time cost of the prompt (its TTFT), not of decoding.
            output.propose_s += self._prepare_drafts(
                [request for request, _ in sampling if not request.output_token_ids])
        self._accept(sampling, sampled, output)
        if self.proposer is not None:
            if all(len(s.token_ids) == 1 + s.num_draft_tokens for s in step.sequences):
                self._step_costs.record_step(max(s.num_draft_tokens for s in step.sequences),
                                             time.perf_counter() - started)
            output.propose_s += self._propose([request for request, _ in sampling], output)
        return output

    def _move_kv(self, step: SchedulerOutput) -> None:
        """The step's moves of KV that come before the model: chunk encodings forgotten,
        copy-on-write block copies, then stored chunk encodings written where they now sit."""
        self.chunks.drop(step.chunk_drops)
        self.kv_cache.copy_blocks(step.block_copies)
        for sequence in step.sequences:
            for entry_id, slots in sequence.chunk_loads:
                self.kv_cache.write_rows(slots.to(self.device), *self.chunks.load(entry_id))

    def _save_chunks(self, step: SchedulerOutput) -> None:
        """Keeps the chunk encodings the model step completed (their K/V copied out)."""
        for sequence in step.sequences:
            if sequence.chunk_save is not None:
                entry_id, slots = sequence.chunk_save
                self.chunks.save(entry_id, *self.kv_cache.read_rows(slots.to(self.device)))

    def _update_requests(self, step: SchedulerOutput) -> None:
        if self.lora is not None:
            for lora_int_id in step.removed_lora_ids:
                self.lora.remove(lora_int_id)
        for request_id in step.finished_request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None and self.proposer is not None:
                self.proposer.release(request)
        if self.samples:
            for new in step.new_requests:
                if new.request_id not in self.requests:  # a step run again in parts
                    self.requests[new.request_id] = RunnerRequest(new, self.vocab_size,
                                                                  self.device)

    def _sampling_inputs(self, sampling: list[tuple[RunnerRequest, ScheduledSequence]]
                         ) -> dict[str, torch.Tensor]:
        """The host tensors that sampling ``sampling``'s rows reads: the rows' parameters and
        random-stream keys (:meth:`SamplingTensors.host_columns`, each row at its output
        position) and, in a verification step, "draft_ids" (every sequence's drafts, in
        order)."""
        if not sampling:
            return {}
        counts = [1 + sequence.num_draft_tokens for _, sequence in sampling]
        rows = [request for (request, _), n in zip(sampling, counts) for _ in range(n)]
        inputs = SamplingTensors.host_columns(
            [r.params for r in rows], self.vocab_size, [r.seed for r in rows],
            [sequence.num_output_tokens + j
             for (_, sequence), n in zip(sampling, counts) for j in range(n)])
        drafts = [t for _, sequence in sampling for t in sequence.draft_token_ids]
        if drafts:
            inputs["draft_ids"] = torch.tensor(drafts, dtype=torch.int64)
        return inputs

    def _sample(self, logits: torch.Tensor,
                sampling: list[tuple[RunnerRequest, ScheduledSequence]],
                staged: dict[str, torch.Tensor], step: SchedulerOutput,
                errors: dict[str, Exception]
                ) -> tuple[list[tuple[RunnerRequest, ScheduledSequence]], SampleOutput | None]:
        """A token for each logits row (``1 + num_draft_tokens`` rows per request, the rows of
        a verification step sampled as the plain decode steps at those positions would);
        returns the requests that got theirs and their rows. When the batch cannot be sampled
        (the CPU sampler raises on a row whose logits hold NaN or +inf, e.g. after its
        penalties overflowed), each request's rows are sampled alone and the requests whose
        rows still fail go to ``errors``. A row's draw never depends on the other rows, so the
        others get the tokens the batch would have given them. ``staged`` is
        :meth:`_sampling_inputs` on the device."""
        counts = [1 + sequence.num_draft_tokens for _, sequence in sampling]
        rows = [request for (request, _), n in zip(sampling, counts) for _ in range(n)]
        tensors = SamplingTensors.from_columns(staged, [r.params for r in rows], self.vocab_size)
        prompt_mask = output_counts = None
        if tensors.needs_penalties:
            zeros_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            prompt_mask = torch.stack([zeros_mask if r.prompt_mask is None else r.prompt_mask
                                       for r in rows])
            row_counts, start = [], 0
            for request, sequence in sampling:
                end = start + sequence.num_draft_tokens
                row_counts.append(self._output_counts(
                    request, staged["draft_ids"][start:end] if end > start else None))
                start = end
            output_counts = torch.cat(row_counts)
        if step.grammar_bitmask is not None:
            # Before the penalties: a disallowed token stays -inf whatever they add.
            row_of = {request.request_id: row for row, request in enumerate(rows)}
            masks = self._mask_staging.send({
                "rows": torch.tensor([row_of[i] for i in step.constrained_request_ids],
                                     dtype=torch.int64),
                "bitmask": step.grammar_bitmask})[0]
            mask_tokens(logits, masks["rows"], masks["bitmask"])
        penalized = not tensors.needs_penalties
        try:
            if not penalized:
                penalize(logits, tensors, prompt_mask, output_counts)
                penalized = True  # every row: the op raises before it writes, or not at all
            return sampling, draw(logits, tensors)
        except Exception:
            kept, parts, start = [], [], 0
            for (request, sequence), n in zip(sampling, counts):
                part, start = slice(start, start + n), start + n
                try:
                    if not penalized:
                        penalize(logits[part], tensors.rows(part), prompt_mask[part],
                                 output_counts[part])
                    parts.append(draw(logits[part], tensors.rows(part)))
                except Exception as error:
                    errors[request.request_id] = request_error(
                        "this request's logits (after its penalties and logit_bias) cannot be "
                        "sampled", error)
                    continue
                kept.append((request, sequence))
            return kept, SampleOutput.cat(parts) if parts else None

    def _output_counts(self, request: RunnerRequest, drafts: torch.Tensor | None
                       ) -> torch.Tensor:
        """int32 ``[1 + len(drafts), vocab]``: the request's output counts at each row of its
        step, row j counting the first j ``drafts`` (int64, on the device) as generated."""
        n = 1 if drafts is None else 1 + drafts.shape[0]
        if request.output_counts is None:
            return torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
        counts = request.output_counts.expand(n, -1)
        if n == 1:
            return counts
        drafted = torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
        drafted[torch.arange(1, n, device=self.device), drafts] = 1
        return counts + drafted.cumsum(0, dtype=torch.int32)

    def _accept(self, sampling: list[tuple[RunnerRequest, ScheduledSequence]],
                sampled: SampleOutput, output: ModelRunnerOutput) -> None:
        """Gives each request its sampled token or, after a verification step, the drafts that
        match the samples at their rows and the sample that follows them."""
        on_device = sampled.tokens
        sampled = sampled.to_host()  # the step's one wait for the device
        tokens = sampled.tokens.tolist()
        row = 0
        for request, sequence in sampling:
            first, row = row, row + 1 + sequence.num_draft_tokens
            drafts = sequence.draft_token_ids
            accepted = accepted_length(drafts, tokens[first:row])
            got = tokens[first:first + accepted + 1]
            output.sampled_token_ids[request.request_id] = got
            num_logprobs = request.params.logprobs
            if num_logprobs is not None:
                output.logprobs[request.request_id] = [
                    SampledLogprobs(float(sampled.token_logprobs[r]),
                                    sampled.top_ids[r, :num_logprobs].tolist(),
                                    sampled.top_logprobs[r, :num_logprobs].tolist())
                    for r in range(first, first + len(got))]
            if drafts:
                request.draft_length.update(len(drafts), accepted)
            # A token < 0 (a GPU sampler's bad row) fails the request: none after it counts.
            valid = next((i for i, token in enumerate(got) if token < 0), len(got))
            request.all_token_ids += got[:valid]
            if request.output_counts is not None and valid:  # from the device's copy
                request.output_counts.index_put_(
                    (on_device[first:first + valid],),
                    torch.ones(valid, dtype=torch.int32, device=self.device), accumulate=True)

    # ---- drafting ----------------------------------------------------------------------------

    def _speculates(self, request: RunnerRequest) -> bool:
        """Whether a request may draft: going on and unconstrained (a constrained request's
        verified rows would each need the grammar's state after the drafts before them)."""
        return not request.ended and request.params.structured_outputs is None

    def _prepare_drafts(self, requests: list[RunnerRequest]) -> float:
        """Has the proposer read the prompts of requests that will speculate, but where the
        step costs measured so far say no draft could pay for a proposer that reads every
        token (:meth:`DraftLength.gives_up_if_hopeless`): those requests never draft, and the
        draft model reads nothing of theirs. Returns the seconds it took."""
        going = [r for r in requests if self._speculates(r) and r.params.max_tokens > 1]
        if going and self.proposer.reads_every_token:
            step_s = self._step_costs.step_s()
            if step_s is not None:
                going = [r for r in going
                         if not self._draft_length(r).gives_up_if_hopeless(step_s)]
        if not going:
            return 0.0
        started = time.perf_counter()
        self._draft_or_drop(going, lambda: self.proposer.prepare(going))
        return time.perf_counter() - started

    def _draft_length(self, request: RunnerRequest) -> DraftLength:
        """The request's adaptive draft length, made at its first use."""
        if request.draft_length is None:
            config = self.speculative
            request.draft_length = DraftLength(config.num_speculative_tokens, config.adaptive,
                                               self.proposer.reads_every_token)
        return request.draft_length

    def _draft_or_drop(self, requests: Sequence[RunnerRequest],
                       work: Callable[[], T]) -> T | None:
        """``work()`` (the proposer's, for ``requests``) under inference mode; when it raises,
        their draft state is dropped and None returned: drafts are an optimization, no request
        fails for one."""
        try:
            with torch.inference_mode():
                return work()
        except Exception as error:
            logger.warning("speculative drafting failed, this step goes without: %s", error)
            for request in requests:
                self.proposer.release(request)
            return None

    def _propose(self, requests: list[RunnerRequest], output: ModelRunnerOutput) -> float:
        """Drafts the next tokens of the requests that just got tokens and go on, as many as
        each one's adaptive draft length allows and its limits leave room for, into
        ``output.draft_token_ids``; returns the seconds it took."""
        started = time.perf_counter()
        step_s = self._step_costs.step_s()
        going, lengths, resuming = [], [], False
        for request in requests:
            if request.request_id in output.errors or not self._speculates(request):
                continue
            # Room for the drafts and the verification step's own token.
            room = min(request.params.max_tokens - len(request.output_token_ids),
                       self.max_model_len - request.num_tokens) - 1
            k = min(self._draft_length(request).next_k(step_s), room)
            if request.draft_length.stopped:  # for good: its draft state can go now
                self.proposer.release(request)
            if k > 0:
                going.append(request)
                lengths.append(k)
                resuming |= request.draft_length.resuming
        if going:
            def draft() -> tuple[float, list[list[int]]]:
                self.proposer.prepare(going)  # a request readmitted after preemption
                return time.perf_counter(), self.proposer.propose(going, lengths)

            drafted = self._draft_or_drop(going, draft)
            if drafted is None:
                return time.perf_counter() - started
            drafting, drafts = drafted
            for request, tokens in zip(going, drafts):
                output.draft_token_ids[request.request_id] = tokens
            if not resuming:  # a draft model resuming after a pause first reads what it missed
                self._step_costs.record_drafting(max(lengths), time.perf_counter() - drafting)
        return time.perf_counter() - started



def _prompt_logprobs(found: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     step: SchedulerOutput) -> dict[int, list[SampledLogprobs]]:
    """The step's prompt logprobs on the host (one copy), each sequence's alternatives cut to
    the number it asked for."""
    if not found:
        return {}
    on_host = iter(to_host(*(t for entry in found.values() for t in entry)))
    entries = {}
    for index in found:
        token_logprobs, top_ids, top_logprobs = next(on_host), next(on_host), next(on_host)
        k = step.sequences[index].num_prompt_logprobs
        entries[index] = [SampledLogprobs(logprob, ids[:k], logprobs[:k]) for logprob, ids, logprobs
                          in zip(token_logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist())]
    return entries
