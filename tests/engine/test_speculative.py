"""Speculative decoding: the tokens are the ones generation gives without it (greedy and seeded
sampling, mixed batches, both methods, stories260K in float32 and the real SmolLM2), sampled
tokens follow the model's distribution (chi-square), rejected drafts' KV leaves the block
manager and never reaches the prefix cache, and the metrics count what happened. Exactness runs
on each device present."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import per_device, prefill_logits
from fastllm import LLM, SamplingParams
from fastllm.engine import Engine, EngineConfig
from fastllm.engine.executor import UniProcExecutor, make_worker
from fastllm.engine.speculative import DraftLength, NgramIndex, SpeculativeConfig, StepCosts
from fastllm.kv_cache import BlockManager, PagedKVCache

STORY = ("Once upon a time, there was a little girl named Lily. She liked to play outside. "
         "One day, Lily saw a big red ball. Once upon a time, there was a little girl named")


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def stories(model_path, **kwargs) -> LLM:
    return LLM(model_path("stories260K_hf"), max_model_len=512, kv_cache_memory=8 << 20,
               **kwargs)


def mixed_batch(vocab: int) -> tuple[list, list[SamplingParams]]:
    """Repetitive and random prompts of different lengths; greedy, seeded sampling with
    penalties, logprobs, a stop string and short max_tokens side by side."""
    rng = random.Random(0)
    prompts = [STORY, "The cat sat on the mat. The cat sat on the",
               {"prompt_token_ids": [1] + [rng.randrange(3, vocab) for _ in range(45)]},
               STORY + " Lily", "Tim had a dog.", STORY[:60]]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.1, frequency_penalty=0.2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop=["park"])]
    return prompts, params


def assert_no_block_held(llm: LLM) -> None:
    stats = llm.kv_cache.block_manager.stats()
    assert stats["referenced_blocks"] == 0, stats
    if llm.engine.executor.worker.proposer is not None:  # nor any request's draft state
        assert llm.engine.executor.worker.proposer.num_held == 0


@pytest.fixture(scope="module")
def stories_references(model_path):
    """``stories_references(device)``: (prompts, params, outputs without speculation on
    ``device``) of the mixed batch, once per device."""
    def reference(device):
        plain = stories(model_path, device=device)
        prompts, params = mixed_batch(plain.model.config.vocab_size)
        return prompts, params, plain.generate(prompts, params, use_tqdm=False)

    return per_device(reference)


@pytest.fixture(scope="module")
def stories_reference(stories_references):
    return stories_references("cpu")


@pytest.fixture
def device_reference(stories_references, device):
    return stories_references(device)


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "ngram", "num_speculative_tokens": 7, "adaptive": False},
    # The model drafting for itself costs a step per draft, which never pays: adaptive drafting
    # would stop at once (or not, by the timings), so the draft method drafts k each step here.
    {"method": "draft", "num_speculative_tokens": 3, "draft_dtype": "bfloat16",
     "adaptive": False},
], ids=["ngram", "ngram-k7-fixed", "draft"])
def test_same_tokens_as_without_speculation(model_path, device_reference, device, speculative):
    prompts, params, expected = device_reference
    if speculative["method"] == "draft":
        speculative = {**speculative, "model": model_path("stories260K_hf")}
    llm = stories(model_path, device=device, speculative=speculative)
    got = llm.generate(prompts, params, use_tqdm=False)
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids, out.request_id
        assert out.outputs[0].text == want.outputs[0].text
        assert out.outputs[0].finish_reason == want.outputs[0].finish_reason
    # Logprobs of the verified positions are the decode steps' own.
    for a, b in zip(expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        for token in a:
            assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)
            assert b[token].rank == a[token].rank
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.steps < llm.engine.stats.scheduled_tokens  # fewer steps than tokens
    metrics = got[0].metrics  # the repetitive story's
    assert metrics.num_accepted_tokens > 0
    assert metrics.acceptance_rate == metrics.num_accepted_tokens / metrics.num_draft_tokens
    assert metrics.mean_accepted_length == 1 + (metrics.num_accepted_tokens
                                                / metrics.num_verify_steps)
    assert sum(o.metrics.num_draft_tokens for o in got) == stats.num_draft_tokens
    assert_no_block_held(llm)
    # The prefix cache kept only accepted tokens' KV: the same prompts again reuse it.
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.stats.prefix_cache_hits > 0


@pytest.mark.parametrize("failing", ["prepare", "propose"])
def test_a_failing_draft_model_costs_no_request(model_path, stories_reference, monkeypatch,
                                                 caplog, failing):
    """Drafting that raises (here after doing its work, on the first and every third call,
    leaving the draft KV ahead of what the engine knows) drops those requests' draft state and
    the step goes on without drafts: the same tokens, nothing held."""
    prompts, params, expected = stories_reference
    path = model_path("stories260K_hf")
    llm = stories(model_path, speculative={"method": "draft", "model": path,
                                           "num_speculative_tokens": 3, "adaptive": False})
    proposer = llm.engine.executor.worker.proposer
    original, calls = getattr(proposer, failing), []

    def flaky(*args):
        calls.append(args)
        result = original(*args)
        if len(calls) % 3 == 1:
            raise RuntimeError("draft model out of memory")
        return result

    monkeypatch.setattr(proposer, failing, flaky)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert "speculative drafting failed" in caplog.text and len(calls) > 3
    assert llm.engine.stats.num_accepted_tokens > 0  # drafting went on after the failures
    assert_no_block_held(llm)
    assert proposer.kv_cache.block_manager.stats()["referenced_blocks"] == 0


def test_streaming_and_preemption_under_speculation(model_path, device_reference, device):
    prompts, params, expected = device_reference
    # Room for about two requests: the others are preempted and recomputed.
    plain = stories(model_path, device=device)
    small = LLM(model_path("stories260K_hf"), device=device, max_model_len=192,
                kv_cache_memory=12 * plain.kv_cache.spec.bytes_per_block,
                speculative={"method": "ngram", "num_speculative_tokens": 5},
                max_num_batched_tokens=40)
    assert token_ids(small, prompts, params) == [o.outputs[0].token_ids for o in expected]
    assert small.engine.stats.preemptions > 0 and small.engine.stats.num_accepted_tokens > 0
    assert_no_block_held(small)
    deltas = list(small.stream(prompts[0], params[0]))
    assert "".join(deltas) == expected[0].outputs[0].text


def test_speculative_sampling_keeps_the_distribution(model_path):
    """Speculative sampling keeps the target distribution: the joint law of the first three
    tokens (top-2 sampling at temperature 1.5, so each position has two outcomes) over 800
    seeds against the exact one computed from the model, by a chi-square test. The second and
    third tokens come from the first two rows of verification steps (two drafts each), with
    drafts accepted and rejected."""
    llm = stories(model_path, max_num_seqs=256,
                  speculative={"method": "ngram", "num_speculative_tokens": 3,
                               "prompt_lookup_min": 1, "adaptive": False})
    prompt = llm.tokenizer.encode(STORY)
    model = llm.model

    def top2(tokens: list[int]) -> dict[int, float]:
        logits = prefill_logits(model, tokens)[-1].double() / 1.5
        values, ids = logits.topk(2)
        return dict(zip(ids.tolist(), torch.softmax(values, 0).tolist()))

    exact: dict[tuple[int, ...], float] = {}
    with torch.inference_mode():
        for t1, p1 in top2(prompt).items():
            for t2, p2 in top2(prompt + [t1]).items():
                for t3, p3 in top2(prompt + [t1, t2]).items():
                    exact[(t1, t2, t3)] = p1 * p2 * p3
    n = 800
    params = [SamplingParams(temperature=1.5, top_k=2, seed=seed, max_tokens=4,
                             ignore_eos=True) for seed in range(n)]
    counts: dict[tuple[int, ...], int] = {}
    for tokens in token_ids(llm, [{"prompt_token_ids": prompt}] * n, params):
        counts[tuple(tokens[:3])] = counts.get(tuple(tokens[:3]), 0) + 1
    assert set(counts) <= set(exact)
    stats = llm.engine.stats
    assert stats.num_accepted_tokens > 100
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 20
    cells = [key for key in exact if exact[key] * n >= 5]  # the rest pooled into one cell
    observed = [counts.get(key, 0) for key in cells] + [n - sum(counts.get(k, 0) for k in cells)]
    expected = [exact[key] * n for key in cells] + [n * (1 - sum(exact[k] for k in cells))]
    if expected[-1] < 5:
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    p_value = 1 - torch.special.gammainc(torch.tensor(dof / 2), torch.tensor(statistic / 2))
    assert p_value > 1e-3, (statistic, dof, observed, expected)


def test_a_constrained_request_does_not_speculate_beside_one_that_does(model_path, device):
    """A request under structured output takes one token a step (its grammar would need a state
    per draft); the request beside it still speculates, and both get their plain tokens."""
    from fastllm import StructuredOutputsParams

    prompts = [STORY, STORY]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, structured_outputs=(
                  StructuredOutputsParams(regex=r"(Lily|Tom) (ran|saw) [a-z]+( [a-z]+)*\\.")))]
    expected = stories(model_path, device=device).generate(prompts, params, use_tqdm=False)
    llm = stories(model_path, device=device,
                  speculative={"method": "ngram", "num_speculative_tokens": 4})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert got[1].outputs[0].text.split(" ")[0] in ("Lily", "Tom")
    assert got[0].metrics.num_draft_tokens > 0 and got[1].metrics.num_draft_tokens == 0
    assert_no_block_held(llm)


def test_seeded_sampling_reproduces(model_path, device_reference, device):
    prompts, _, _ = device_reference
    llm = stories(model_path, device=device,
                  speculative={"method": "ngram", "num_speculative_tokens": 4})
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=32, ignore_eos=True)
              for i in range(len(prompts))]
    first = token_ids(llm, prompts, params)
    alone = [token_ids(llm, [p], [q])[0] for p, q in zip(prompts, params)]
    assert first == alone == token_ids(stories(model_path, device=device), prompts, params)


def engine_tokens(llm: LLM, prompts, params, **config) -> tuple[list[list[int]], Engine]:
    """Runs an engine of its own over ``llm``'s model and tokenizer (loading SmolLM2's GGUF
    vocabulary again would cost seconds)."""
    config = EngineConfig(**config)
    worker = make_worker(llm.model, PagedKVCache(llm.kv_cache.spec, 48),
                         max_model_len=llm.max_model_len, max_num_seqs=config.max_num_seqs,
                         enforce_eager=config.enforce_eager, speculative=config.speculative)
    engine = Engine(UniProcExecutor(worker), llm.tokenizer, config, llm.max_model_len)
    requests = llm.client.make_requests(prompts, params)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return [request.output_token_ids for request in requests], engine


def test_smollm2_greedy_same_tokens(smollm2_llm):
    """The real model's quantized kernels: row-count-dependent rounding could flip an argmax
    between a verification chunk and a decode step, so both run batch-invariant."""
    code = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            "def mul(a, b):\n    return a * b\n")
    prompts = [smollm2_llm.chat_prompt([{"role": "user", "content": "Rewrite this Python code, "
                                         "adding a docstring to each function:\n\n" + code}]),
               "Write one sentence about the sea."]
    params = [SamplingParams(temperature=0, max_tokens=28), SamplingParams(temperature=0,
                                                                            max_tokens=6)]
    expected, _ = engine_tokens(smollm2_llm, prompts, params, batch_invariant=True)
    got, engine = engine_tokens(smollm2_llm, prompts, params, batch_invariant=True,
                                speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert got == expected
    assert engine.stats.num_accepted_tokens > 8
    assert engine.stats.steps < 24
    assert engine.scheduler.block_manager.stats()["referenced_blocks"] == 0


def test_truncate_drops_blocks_and_keeps_them_out_of_the_prefix_cache():
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10, 16))  # 6 tokens: one full block and a partial one
    manager.allocate(0, prompt)
    manager.mark_computed(0, 6)
    manager.append_tokens(0, [1, 2, 3, 4, 5, 6, 7])  # drafts up to 13 tokens: 4 blocks
    assert len(manager.block_table(0)) == 4
    free = manager.num_free_blocks
    manager.truncate(0, 7)  # one draft kept
    manager.mark_computed(0, 7)
    assert len(manager.block_table(0)) == 2 and manager.num_free_blocks == free + 2
    assert manager.num_tokens(0) == manager.num_computed_tokens(0) == 7
    manager.append_tokens(0, [9, 9])  # the sequence goes on after the kept draft
    manager.mark_computed(0, 9)
    # The rejected drafts' tokens were never cached: a prompt holding them finds only the
    # blocks that are really computed.
    hits = manager.stats()["hits"]
    manager.allocate(1, prompt + [1, 2, 3, 4, 5, 6, 7])
    assert manager.stats()["hits"] == hits + 1
    with pytest.raises(ValueError, match="truncate"):
        manager.truncate(0, 3)  # into a block offered to the prefix cache
    with pytest.raises(ValueError, match="truncate"):
        manager.truncate(0, 10)
    manager.free(0)
    manager.free(1)
    assert manager.stats()["referenced_blocks"] == 0


def test_ngram_lookup():
    def lookup(tokens: list[int], k: int) -> list[int]:
        return NgramIndex(1, 3).lookup(tokens, k)

    assert lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]  # the latest occurrence
    assert lookup([1, 2, 3, 4], 2) == []
    assert lookup([7, 7], 3) == [7]


def _lookup_by_scanning(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by rescanning every earlier window: the reference for NgramIndex."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 4)])
def test_ngram_index_grown_token_by_token_agrees_with_a_rescan(min_n: int, max_n: int):
    rng = random.Random(min_n * 10 + max_n)
    index = NgramIndex(min_n, max_n)
    tokens: list[int] = []
    for step in range(300):
        # Small vocabulary: repeats of every length; several tokens at once now and then
        # (accepted drafts), lookups of 1-5 drafts.
        tokens += [rng.randrange(4) for _ in range(rng.choice([1, 1, 1, 3]))]
        k = rng.randrange(1, 6)
        assert index.lookup(tokens, k) == _lookup_by_scanning(tokens, k, min_n, max_n), step


def test_draft_length_turns_down_and_pauses():
    cheap = [1.0, 1.05, 1.1, 1.15, 1.2]  # a step's seconds with k = 0 .. 4 drafts
    length = DraftLength(limit=4)
    assert length.next_k(None) == 0  # no plain step measured yet: nothing to compare with
    assert length.next_k(cheap) == 4  # cheap drafts, optimistic prior
    medium = [1.0, 1.3, 1.6, 1.9, 2.2]
    assert length.next_k(medium) in (2, 3)
    for _ in range(3):
        length.update(4, 1)
    assert length.next_k(medium) == 1  # a lower acceptance: fewer
    length.update(1, 1)
    # Drafts that keep failing: fewer, until none pays; then a pause and a probe of one.
    drafted = []
    while (k := length.next_k(cheap)) > 0:
        drafted.append(k)
        length.update(k, 0)
    assert drafted == sorted(drafted, reverse=True) and 2 <= len(drafted) <= 12, drafted
    assert [length.next_k(cheap) for _ in range(5)] == [0, 0, 0, 0, 1]
    length.update(1, 0)  # the probe failed: the next pause is twice as long
    assert [length.next_k(cheap) for _ in range(10)] == [0] * 9 + [1]
    for _ in range(3):  # accepted probes: back to choosing by the estimate
        length.update(1, 1)
        k = length.next_k(cheap)
        while k == 0:
            k = length.next_k(cheap)
    assert k >= 1
    length.update(k, k)  # drafts that pay, accepted: the pauses start over
    assert length.pause == 0
    # Drafting that costs about a step per token never pays: it pauses.
    costly = [1.0, 1.9, 2.8, 3.7, 4.6]
    fresh = DraftLength(limit=4)
    assert [fresh.next_k(costly) for _ in range(5)] == [0, 0, 0, 0, 0]
    assert fresh.next_k(costly) == 1  # the probe
    fresh.update(1, 1)  # accepted, yet drafting still does not pay: a longer pause
    assert [fresh.next_k(costly) for _ in range(10)] == [0] * 9 + [1]
    fixed = DraftLength(limit=3, adaptive=False)
    fixed.update(3, 0)
    fixed.update(3, 0)
    assert fixed.next_k(None) == fixed.next_k(costly) == 3


def test_drafts_right_half_the_time_keep_drafting_when_they_pay():
    """Acceptance near 1/2 with cheap verification rows (summarizing with n-gram drafts):
    two failures in a row now and then do not pause drafting that pays on average."""
    cheap = [1.0, 1.05, 1.1, 1.15, 1.2]
    length = DraftLength(limit=4)
    rng = random.Random(0)
    steps = drafting = 0
    for _ in range(200):
        k = length.next_k(cheap)
        steps += 1
        if k:
            drafting += 1
            accepted = 0
            while accepted < k and rng.random() < 0.5:
                accepted += 1
            length.update(k, accepted)
    assert drafting > 0.75 * steps, (drafting, steps)  # a two-miss pause rule: 0.2-0.45


def test_a_draft_model_stops_for_good_when_drafting_does_not_pay():
    """A proposer that reads every token (a draft model) probes with all its drafts, and stops
    at the second pause before drafting paid; one whose drafts pay goes on through pauses."""
    dear = [1.0, 1.6, 2.2, 2.8, 3.4]  # pays only when most drafts are accepted
    length = DraftLength(limit=4, gives_up=True)
    assert length.next_k(dear) == 4  # the first drafts are a probe, of all k
    length.update(4, 0)
    assert [length.next_k(dear) for _ in range(6)] == [0] * 5 + [4]  # a pause, a probe
    length.update(4, 0)
    assert not length.stopped
    assert length.next_k(dear) == 0 and length.stopped  # the second pause: for good
    assert [length.next_k([1.0] * 5) for _ in range(100)] == [0] * 100
    # Drafting about a step per token: not even drafts all accepted would pay, so it stops
    # without a probe.
    costly = [1.0, 1.9, 2.8, 3.7, 4.6]
    hopeless = DraftLength(limit=4, gives_up=True)
    assert hopeless.next_k(costly) == 0 and hopeless.stopped
    medium = [1.0, 1.3, 1.6, 1.9, 2.2]
    paying = DraftLength(limit=4, gives_up=True)
    drafting = 0
    for step in range(60):  # drafts that pay, with runs of failures that pause drafting
        k = paying.next_k(medium)
        if k:
            drafting += 1
            paying.update(k, 0 if step % 20 < 6 else k)
    assert not paying.stopped and 30 < drafting < 60
    assert DraftLength(limit=4).next_k(costly) == 0  # n-gram: cheap probes, no first one


def test_a_draft_model_that_does_not_pay_leaves_its_requests(model_path, monkeypatch):
    """When drafting stops for a request, the draft model's state for it goes at once, and
    the request verifies no more drafts; once the engine knows no draft can pay, the draft
    model does not read new requests' prompts."""
    monkeypatch.setattr(DraftLength, "MARGIN", 100.0)  # no drafts ever pay
    llm = stories(model_path, speculative={"method": "draft", "num_speculative_tokens": 3,
                                           "model": model_path("stories260K_hf")})
    worker = llm.engine.executor.worker
    proposer = worker.proposer
    released_running = []
    release = proposer.release

    def recording_release(request):
        # A request the worker still keeps has not finished.
        if request in proposer._seq_ids and request.request_id in worker.requests:
            released_running.append(request.request_id)
        release(request)

    monkeypatch.setattr(proposer, "release", recording_release)
    [out] = llm.generate([STORY], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                         use_tqdm=False)
    assert released_running == [out.request_id]
    assert out.metrics.num_verify_steps == 0  # not even a probe: no acceptance would pay
    assert not proposer._seq_ids and proposer.kv_cache.block_manager.stats()[
        "referenced_blocks"] == 0
    # The engine has measured its steps now: the next request's prompt is not even read.
    prepared = []
    prepare = proposer.prepare
    monkeypatch.setattr(proposer, "prepare",
                        lambda requests: (prepared.extend(requests), prepare(requests)))
    [again] = llm.generate([STORY], SamplingParams(temperature=0, max_tokens=60,
                                                   ignore_eos=True), use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert prepared == [] and again.metrics.num_verify_steps == 0
    assert proposer.num_held == 0


def test_a_draft_models_first_probe_is_measured(model_path, monkeypatch):
    """A request's first probe drafts from the prompt the draft model has read, so its cost
    is drafting's and is measured (so that drafting that cannot pay is seen before later
    requests probe); a probe after a pause also reads the missed tokens, and is not."""
    length = DraftLength(limit=3, gives_up=True)
    assert length.probing and not length.resuming  # the first probe
    length.update(3, 0)
    assert [length.next_k([1.0, 1.6, 2.2, 2.8]) for _ in range(6)] == [0] * 5 + [3]
    assert length.probing and length.resuming  # a probe after a pause
    update = DraftLength.update

    def probe_only(self, num_drafted, num_accepted):  # the request's first probe, no more
        update(self, num_drafted, num_accepted)
        self.stopped = True

    monkeypatch.setattr(DraftLength, "update", probe_only)
    llm = stories(model_path, speculative={"method": "draft", "num_speculative_tokens": 3,
                                           "model": model_path("stories260K_hf")})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [first] = llm.generate([STORY], params, use_tqdm=False)
    assert first.metrics.num_verify_steps == 1
    assert llm.engine.executor.worker._step_costs.draft[3] is not None


def test_step_costs_estimate_what_was_not_measured():
    costs = StepCosts(limit=3)
    assert costs.step_s() is None
    costs.record_step(0, 1.0)
    assert costs.step_s() == pytest.approx([1.0, 1.1, 1.2, 1.3])
    costs.record_step(3, 2.0)
    costs.record_drafting(3, 0.6)  # 0.2 s a drafted token
    assert costs.step_s() == pytest.approx([1.0, 1.1 + 0.2, 1.2 + 0.4, 2.0 + 0.6])


def test_step_costs_are_not_held_by_one_slow_step():
    costs = StepCosts(limit=1)
    costs.record_step(0, 5.0)  # e.g. the first decode step after a prefill
    for _ in range(StepCosts.WINDOW // 2):
        costs.record_step(0, 1.0)
    assert costs.step_s()[0] == 1.0
    for _ in range(StepCosts.WINDOW):  # and a cost that changed is followed
        costs.record_step(0, 2.0)
    assert costs.step_s()[0] == 2.0


def test_low_acceptance_turns_speculation_off(model_path):
    """Random prompts and sampling at a high temperature: drafts fail, and the requests stop
    drafting almost entirely."""
    llm = stories(model_path, speculative={"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_min": 1})
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(200)]}
               for _ in range(2)]
    params = SamplingParams(temperature=2.0, seed=0, max_tokens=120, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats
    assert stats.num_verify_steps < 0.3 * 2 * 120, stats


@pytest.mark.parametrize("bad, error", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft"}, "model"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"k": 3}, "unknown keys"),
])
def test_bad_config(bad, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.of(bad)
    with pytest.raises(TypeError, match="speculative"):
        SpeculativeConfig.of(["ngram"])
