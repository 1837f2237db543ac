"""SamplingParams validation, SamplingTensors (host columns, one copy, read on the device) and
the sample_next_tokens step."""

import math

import pytest
import torch

from fastllm import SampleOutput, SamplingParams, SamplingTensors, sample_next_tokens
from fastllm.ops import reference
from fastllm.ops.host_to_device import StagingBuffer
from fastllm.sampling import resolve_seed

def sampling_tensors(params, vocab_size, device="cpu", seeds=None) -> SamplingTensors:
    """The rows' tensors on ``device`` as an engine builds them: host columns (each request's
    seed, row r at output position 3 + r), moved in one copy, read back on the device."""
    seeds = [resolve_seed(p) for p in params] if seeds is None else seeds
    columns = SamplingTensors.host_columns(params, vocab_size, seeds,
                                           [3 + row for row in range(len(params))])
    return SamplingTensors.from_columns(StagingBuffer(device).send(columns)[0], params,
                                        vocab_size)


# id: (keyword arguments, pattern the ValueError must match: the field and the value)
BAD_PARAMS = {
    "negative_temperature": (dict(temperature=-0.5), r"temperature.*-0\.5"),
    "nan_temperature": (dict(temperature=math.nan), r"temperature.*nan"),
    "inf_temperature": (dict(temperature=math.inf), r"temperature.*inf"),
    "top_p_0": (dict(top_p=0.0), r"top_p.*got 0\.0"),
    "top_p_1.5": (dict(top_p=1.5), r"top_p.*1\.5"),
    "min_p_-0.1": (dict(min_p=-0.1), r"min_p.*-0\.1"),
    "min_p_1.1": (dict(min_p=1.1), r"min_p.*1\.1"),
    "repetition_penalty_0": (dict(repetition_penalty=0.0), r"repetition_penalty.*got 0\.0"),
    "repetition_penalty_-1": (dict(repetition_penalty=-1.0), r"repetition_penalty.*-1\.0"),
    "seed_-1": (dict(seed=-1), r"seed.*-1"),
    "seed_2**63": (dict(seed=2**63), r"seed.*9223372036854775808"),
    "max_tokens_negative": (dict(max_tokens=-1), r"max_tokens.*got -1"),
    "prompt_logprobs_negative": (dict(prompt_logprobs=-1), r"prompt_logprobs.*got -1"),
    "logprobs_-1": (dict(logprobs=-1), r"logprobs.*-1"),
    "frequency_penalty_nan": (dict(frequency_penalty=math.nan), r"frequency_penalty.*nan"),
    "logit_bias_inf": (dict(logit_bias={3: math.inf}), r"logit_bias.*inf"),
    # Finite in Python, but not as the float32 the kernels use:
    "logit_bias_past_float32": (dict(logit_bias={5: 1e39}), r"logit_bias.*float32.*1e\+39"),
    "repetition_penalty_float32_subnormal": (dict(repetition_penalty=1e-45),
                                             r"repetition_penalty.*normal range.*got 1e-45"),
    "repetition_penalty_float32_zero": (dict(repetition_penalty=1e-300),
                                        r"repetition_penalty.*got 1e-300"),
    "repetition_penalty_past_float32": (dict(repetition_penalty=1e39),
                                        r"repetition_penalty.*got 1e\+39"),
    "temperature_past_float32": (dict(temperature=1e39), r"temperature.*float32.*1e\+39"),
    "top_p_float32_zero": (dict(top_p=1e-50), r"top_p.*float32.*1e-50"),
    # vLLM's (and OpenAI's) range, in which penalty * count never overflows float32:
    "presence_penalty_past_float32": (dict(presence_penalty=-1e39),
                                      r"presence_penalty must be in \[-2, 2\].*-1e\+39"),
    "frequency_penalty_overflowing": (dict(frequency_penalty=-1e38),
                                      r"frequency_penalty must be in \[-2, 2\].*-1e\+38"),
    "presence_penalty_2.5": (dict(presence_penalty=2.5), r"presence_penalty.*2\.5"),
    "huge_int_temperature": (dict(temperature=10**400), r"temperature.*float32's range"),
}

BAD_TYPES = {
    "temperature_str": (dict(temperature="0.5"), "temperature must be a number, got str"),
    "top_p_none": (dict(top_p=None), "top_p must be a number, got NoneType"),
    "repetition_penalty_bool": (dict(repetition_penalty=True),
                                "repetition_penalty must be a number, got bool"),
    "logit_bias_list": (dict(logit_bias=[1.0]), "logit_bias must map token ids to numbers"),
    "logit_bias_str_value": (dict(logit_bias={1: "2"}), "logit_bias must map token ids to numbers"),
}


@pytest.mark.parametrize("case", BAD_PARAMS)
def test_bad_params(case):
    kwargs, match = BAD_PARAMS[case]
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("case", BAD_TYPES)
def test_bad_types(case):
    kwargs, match = BAD_TYPES[case]
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=0.0, seed=0, max_tokens=1, logprobs=0)
    SamplingParams(min_p=1.0, seed=2**63 - 1, top_k=-1, repetition_penalty=0.01,
                   presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(repetition_penalty=1.2e-38, logit_bias={0: 3.4e38, 1: -3.4e38},
                   temperature=3.4e38, top_p=1e-40, top_k=2**40)
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300, 9.9e-6])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    # vLLM's rule (a vLLM user gets the argmax): 1 / temperature would overflow float32 below
    # about 3e-39, and above it the scaled logits are nearly one-hot anyway.
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    tensors = sampling_tensors([params, SamplingParams(temperature=0.5)], 10)
    assert tensors.temperature.tolist() == [0.0, 0.5]


def test_a_changed_field_is_checked_again_when_the_request_is_made():
    params = SamplingParams()
    params.logit_bias = {5: 1e39}
    with pytest.raises(ValueError, match="logit_bias"):
        params.check()


def test_logprobs_are_capped_at_the_vocabulary():
    SamplingParams(logprobs=50).check_vocab(50)
    for logprobs in [51, 2**40]:
        with pytest.raises(ValueError, match=rf"logprobs must be at most the vocabulary size 50, "
                                             rf"got {logprobs}"):
            SamplingParams(logprobs=logprobs).check_vocab(50)
        with pytest.raises(ValueError, match="logprobs"):
            sampling_tensors([SamplingParams(logprobs=logprobs)], 50)


def test_top_k_of_any_size_fits_the_int32_column():
    # top_k >= vocab is off, like <= 0: clamped into [0, vocab].
    params = [SamplingParams(top_k=k) for k in (2**40, -2**40, 3, 10, -1)]
    assert sampling_tensors(params, 10).top_k.tolist() == [10, 0, 3, 10, 0]


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_unknown_token_ids_are_named(field):
    def with_ids(ids):
        return SamplingParams(**{field: {t: 1.0 for t in ids} if field == "logit_bias" else ids})

    with_ids([3, 50, 49]).check_vocab(51)  # 50 exists in a vocabulary of 51
    params = with_ids([3, 50, -1, 49])
    with pytest.raises(ValueError, match=rf"{field}.*\[-1\]"):
        params.check_vocab(51)
    with pytest.raises(ValueError, match=rf"{field}.*\[50, -1\]"):
        params.check_vocab(50)
    with pytest.raises(ValueError, match=rf"{field}.*\[50, -1\].*\[0, 50\)"):
        sampling_tensors([SamplingParams(), params], vocab_size=50)


def test_columns_on_the_device(device):
    vocab = 10
    params = [
        SamplingParams(temperature=0.0, seed=7),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=2**63 - 1,
                       logprobs=3, logit_bias={2: 1.5, 9: -4.0}),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.25,
                       logprobs=1),
    ]
    t = sampling_tensors(params, vocab, device, seeds=[7, 2**63 - 1, 5])
    columns = dict(temperature=(torch.float32, [0.0, 0.8, 1.0]),
                   top_k=(torch.int32, [0, 5, 0]), top_p=(torch.float32, [1.0, 0.9, 1.0]),
                   min_p=(torch.float32, [0.0, 0.05, 0.0]),
                   repetition_penalty=(torch.float32, [1.0, 1.0, 1.2]),
                   frequency_penalty=(torch.float32, [0.0, 0.0, 0.5]),
                   presence_penalty=(torch.float32, [0.0, 0.0, -0.25]))
    for name, (dtype, values) in columns.items():
        column = getattr(t, name)
        assert column.dtype == dtype and column.device.type == device.type, name
        assert torch.equal(column.cpu(), torch.tensor(values, dtype=dtype)), name
    for name, values in [("seeds", [7, 2**63 - 1, 5]), ("offsets", [3, 4, 5])]:
        column = getattr(t, name)
        assert column.dtype == torch.int64 and column.device.type == device.type, name
        assert column.tolist() == values, name
    bias = torch.zeros(3, vocab)
    bias[1, 2], bias[1, 9] = 1.5, -4.0
    assert t.logit_bias.dtype == torch.float32 and t.logit_bias.device.type == device.type
    assert torch.equal(t.logit_bias.cpu(), bias)
    assert t.num_logprobs == 3 and t.needs_penalties

    plain = sampling_tensors([SamplingParams(), SamplingParams(temperature=0.0)], vocab, device)
    assert plain.logit_bias is None and not plain.needs_penalties and plain.num_logprobs == 0
    for one in [dict(repetition_penalty=0.9), dict(frequency_penalty=0.1),
                dict(presence_penalty=0.1), dict(logit_bias={0: 0.0})]:
        assert sampling_tensors([SamplingParams(), SamplingParams(**one)],
                                vocab).needs_penalties, one


def test_unseeded_requests_get_fresh_seeds():
    seeds = torch.tensor([resolve_seed(SamplingParams()) for _ in range(64)])
    assert ((seeds >= 0) & (seeds < 2**63 - 1)).all()
    assert len(seeds.unique()) == 64


def step_inputs(batch, vocab, device):
    logits = torch.randn(batch, vocab, device=device) * 2
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    output_counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
    return logits, prompt_mask, output_counts


def test_sample_next_tokens_without_penalties(device):
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.0),
              SamplingParams(top_k=3, seed=2)]
    tensors = sampling_tensors(params, 20, device)
    logits, _, _ = step_inputs(3, 20, device)
    before = logits.clone()
    out = sample_next_tokens(logits, tensors)
    assert isinstance(out, SampleOutput)
    assert out.token_logprobs is None and out.top_ids is None and out.top_logprobs is None
    assert torch.equal(logits, before), "logits changed without penalties"
    expected = reference.sample(logits.cpu().double(), tensors.temperature.cpu(),
                                tensors.top_k.cpu(), tensors.top_p.cpu(), tensors.min_p.cpu(),
                                tensors.seeds.cpu(), tensors.offsets.cpu())
    assert torch.equal(out.tokens.cpu(), expected)
    assert out.tokens[1] == logits[1].argmax()


def test_sample_next_tokens_needs_masks_for_penalties(device):
    tensors = sampling_tensors([SamplingParams(), SamplingParams(presence_penalty=1.0)], 20,
                               device)
    logits, prompt_mask, output_counts = step_inputs(2, 20, device)
    for kwargs in [{}, dict(prompt_mask=prompt_mask), dict(output_counts=output_counts)]:
        with pytest.raises(ValueError, match="prompt_mask and output_counts"):
            sample_next_tokens(logits, tensors, **kwargs)


def test_sample_next_tokens_applies_penalties(device):
    vocab = 16
    logits, prompt_mask, output_counts = step_inputs(4, vocab, device)
    top = logits.argmax(-1)
    output_counts[2, top[2]] = 1000  # penalized by 2 each time
    output_counts[2, 5] = 3
    prompt_mask[3, top[3]] = True
    params = [SamplingParams(logit_bias={7: 100.0}, seed=11),  # forced even at temperature 1
              SamplingParams(temperature=0.0),  # no penalty: untouched
              SamplingParams(temperature=0.0, frequency_penalty=2.0),  # the argmax is penalized
              SamplingParams(temperature=0.0, repetition_penalty=1e4, logprobs=2)]
    tensors = sampling_tensors(params, vocab, device)
    before = logits.clone()
    out = sample_next_tokens(logits, tensors, prompt_mask=prompt_mask,
                             output_counts=output_counts)
    penalized = reference.apply_penalties(before.cpu(), prompt_mask.cpu(), output_counts.cpu(),
                                          tensors.repetition_penalty.cpu(),
                                          tensors.frequency_penalty.cpu(),
                                          tensors.presence_penalty.cpu(),
                                          tensors.logit_bias.cpu())
    torch.testing.assert_close(logits.cpu(), penalized)  # in place
    assert torch.equal(logits[1], before[1])
    assert out.tokens[0] == 7
    assert out.tokens[1] == top[1]
    assert out.tokens[2] != top[2] and out.tokens[2] == penalized[2].argmax()
    assert out.tokens[3] == penalized[3].argmax()
    if before[3, top[3]] > 1e-3:  # divided by 1e4: now about 0, below any positive logit left
        assert out.tokens[3] != top[3]
    assert out.top_ids.shape == (4, 2) and out.top_logprobs.shape == (4, 2)
    assert out.token_logprobs.shape == (4,)
    # Row 0's bias makes token 7 all but certain: log-probability about 0.
    assert out.top_ids[0, 0] == 7 and abs(out.token_logprobs[0].item()) < 1e-5

    # The same seeds and offsets draw the same tokens again.
    again = sample_next_tokens(before.clone(), tensors, prompt_mask=prompt_mask,
                               output_counts=output_counts)
    assert torch.equal(again.tokens, out.tokens)


def test_a_forced_token_wins_every_draw(device):
    # logit_bias +100 on one token at temperature 1, over 200 seeds: always that token.
    params = [SamplingParams(logit_bias={5: 100.0}, seed=s) for s in range(200)]
    tensors = sampling_tensors(params, 12, device)
    logits, prompt_mask, output_counts = step_inputs(200, 12, device)
    out = sample_next_tokens(logits, tensors, prompt_mask=prompt_mask,
                             output_counts=output_counts)
    assert (out.tokens == 5).all()


def test_logprobs_zero_reports_the_token_logprob(device):
    # vLLM's meaning (which SamplingParams adopts): logprobs=0 asks for the sampled token's
    # log-probability and no alternatives; only None asks for nothing.
    params = [SamplingParams(seed=1, logprobs=0), SamplingParams(seed=2)]
    tensors = sampling_tensors(params, 20, device)
    logits, _, _ = step_inputs(2, 20, device)
    out = sample_next_tokens(logits, tensors)
    assert out.token_logprobs is not None and out.token_logprobs.shape == (2,)
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)


def test_each_row_alone_draws_what_the_batch_draws(device):
    # What the engine relies on when a batch cannot be sampled: each row sampled alone (its
    # SamplingTensors.rows) gets the batch's token and log-probabilities.
    params = [SamplingParams(seed=1, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(top_k=3, seed=2, logit_bias={4: 2.0}, repetition_penalty=1.3)]
    tensors = sampling_tensors(params, 20, device)
    logits, prompt_mask, output_counts = step_inputs(3, 20, device)
    prompt_mask[2, :10] = True
    batch = sample_next_tokens(logits.clone(), tensors, prompt_mask=prompt_mask,
                               output_counts=output_counts)
    rows = [sample_next_tokens(logits[r:r + 1].clone(), tensors.rows(slice(r, r + 1)),
                               prompt_mask=prompt_mask[r:r + 1],
                               output_counts=output_counts[r:r + 1]) for r in range(3)]
    joined = SampleOutput.cat(rows)
    for name in ("tokens", "token_logprobs", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name
