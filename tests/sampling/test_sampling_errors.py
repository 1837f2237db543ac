"""Bad inputs to the sampling ops raise ValueError/TypeError naming the offending tensor, row or
value; apply_penalties then leaves the logits unchanged. Empty batches are not errors."""

import math

import pytest
import torch



BATCH, VOCAB = 4, 10


def sample_inputs():
    """A valid call: 4 rows of 10 logits, every filter off."""
    return dict(logits=torch.randn(BATCH, VOCAB), temperature=torch.ones(BATCH),
                top_k=torch.zeros(BATCH, dtype=torch.int32), top_p=torch.ones(BATCH),
                min_p=torch.zeros(BATCH), seeds=torch.arange(BATCH) + 11,
                offsets=torch.zeros(BATCH, dtype=torch.int64))


def setting(name, index, value, **also):
    """Changes to the valid call: a copy of ``name`` with ``[index] = value`` (plus ``also``)."""
    def change(inputs):
        t = inputs[name].clone()
        t[index] = value
        return {name: t, **{k: f(inputs) for k, f in also.items()}}
    return change


def replacing(**tensors):
    return lambda inputs: tensors


def greedy_row(row):
    return lambda inputs: inputs["temperature"].index_fill(0, torch.tensor([row]), 0.0)


# id: (changes to the valid call, exception, pattern its message must match)
SAMPLE_ERRORS = {
    "nan_row_2": (setting("logits", (2, 5), math.nan), ValueError, r"logits row 2 contains NaN"),
    "nan_in_greedy_row_1": (setting("logits", (1, 0), math.nan, temperature=greedy_row(1)),
                            ValueError, r"logits row 1 contains NaN"),
    "nan_in_top_k_filtered_token": (
        lambda a: {"logits": a["logits"].index_put((torch.tensor(3), torch.tensor(9)),
                                                   torch.tensor(math.nan)),
                   "top_k": a["top_k"].fill_(1)}, ValueError, r"logits row 3 contains NaN"),
    "pos_inf_row_0": (setting("logits", (0, 3), math.inf), ValueError,
                      r"logits row 0 contains \+inf"),
    "all_neg_inf_row_1": (setting("logits", 1, -math.inf), ValueError,
                          r"logits row 1 has no finite value"),
    "all_neg_inf_greedy_row_3": (setting("logits", 3, -math.inf, temperature=greedy_row(3)),
                                 ValueError, r"logits row 3 has no finite value"),
    "logits_int64": (replacing(logits=torch.randint(0, 5, (BATCH, VOCAB))), TypeError,
                     r"logits must be torch.float32, torch.bfloat16 or torch.float16, got "
                     r"torch.int64"),
    "logits_float64": (replacing(logits=torch.randn(BATCH, VOCAB, dtype=torch.float64)),
                       TypeError, r"logits must be .*got torch.float64"),
    "temperature_float64": (replacing(temperature=torch.ones(BATCH, dtype=torch.float64)),
                            TypeError, r"temperature must be torch.float32, got torch.float64"),
    "top_p_float16": (replacing(top_p=torch.ones(BATCH, dtype=torch.float16)), TypeError,
                      r"top_p must be torch.float32, got torch.float16"),
    "min_p_int32": (replacing(min_p=torch.zeros(BATCH, dtype=torch.int32)), TypeError,
                    r"min_p must be torch.float32, got torch.int32"),
    "top_k_int64": (replacing(top_k=torch.zeros(BATCH, dtype=torch.int64)), TypeError,
                    r"top_k must be torch.int32, got torch.int64"),
    "top_k_float": (replacing(top_k=torch.zeros(BATCH)), TypeError,
                    r"top_k must be torch.int32, got torch.float32"),
    "seeds_int32": (replacing(seeds=torch.zeros(BATCH, dtype=torch.int32)), TypeError,
                    r"seeds must be torch.int64, got torch.int32"),
    "offsets_float": (replacing(offsets=torch.zeros(BATCH)), TypeError,
                      r"offsets must be torch.int64, got torch.float32"),
    "logits_1d": (replacing(logits=torch.randn(VOCAB)), ValueError,
                  r"logits must be \[batch, vocab\], got shape \[10\]"),
    "logits_3d": (replacing(logits=torch.randn(BATCH, 1, VOCAB)), ValueError,
                  r"logits must be \[batch, vocab\], got shape \[4, 1, 10\]"),
    "empty_vocab": (replacing(logits=torch.randn(BATCH, 0)), ValueError,
                    r"logits must have a non-empty vocabulary, got shape \[4, 0\]"),
    "temperature_length_3": (replacing(temperature=torch.ones(3)), ValueError,
                             r"temperature has 3 rows but logits has 4"),
    "top_k_length_5": (replacing(top_k=torch.zeros(5, dtype=torch.int32)), ValueError,
                       r"top_k has 5 rows but logits has 4"),
    "seeds_2d": (replacing(seeds=torch.zeros(BATCH, 1, dtype=torch.int64)), ValueError,
                 r"seeds must be \[batch\], got shape \[4, 1\]"),
    "offsets_length_1": (replacing(offsets=torch.zeros(1, dtype=torch.int64)), ValueError,
                         r"offsets has 1 rows? but logits has 4"),
    "negative_temperature": (setting("temperature", 3, -1.0), ValueError,
                             r"temperature\[3\]=-1 must be >= 0"),
    "nan_temperature": (setting("temperature", 1, math.nan), ValueError,
                        r"temperature\[1\]=nan must be >= 0"),
    "top_p_0": (setting("top_p", 2, 0.0), ValueError, r"top_p\[2\]=0 must be in \(0, 1\]"),
    "top_p_1.5": (setting("top_p", 0, 1.5), ValueError, r"top_p\[0\]=1.5 must be in \(0, 1\]"),
    "top_p_nan": (setting("top_p", 1, math.nan), ValueError, r"top_p\[1\]=nan must be in \(0, 1\]"),
    "min_p_negative": (setting("min_p", 1, -0.25), ValueError,
                       r"min_p\[1\]=-0.25 must be in \[0, 1\]"),
    "min_p_1.5": (setting("min_p", 2, 1.5), ValueError, r"min_p\[2\]=1.5 must be in \[0, 1\]"),
    "temperature_on_meta": (replacing(temperature=torch.ones(BATCH, device="meta")), ValueError,
                            r"temperature is on meta but logits is on cpu"),
    "seeds_on_meta": (replacing(seeds=torch.zeros(BATCH, dtype=torch.int64, device="meta")),
                      ValueError, r"seeds is on meta but logits is on cpu"),
}


def call(op, backend, inputs, num_logprobs=3):
    args = [inputs[name] for name in ("logits", "temperature", "top_k", "top_p", "min_p",
                                      "seeds", "offsets")]
    if op == "sample":
        return backend.ops.sample(*args)
    return backend.ops.sample_with_logprobs(*args, num_logprobs)


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("op", ["sample", "sample_with_logprobs"])
@pytest.mark.parametrize("case", SAMPLE_ERRORS)
def test_sample_bad_input(backend, op, case):
    change, error, match = SAMPLE_ERRORS[case]
    inputs = sample_inputs()
    call(op, backend, inputs)  # valid before the change
    inputs |= change(inputs)
    with pytest.raises(error, match=match):
        call(op, backend, inputs)


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("num_logprobs", [-1, -7])
def test_negative_num_logprobs(backend, num_logprobs):
    with pytest.raises(ValueError, match=rf"num_logprobs must be >= 0, got {num_logprobs}"):
        call("sample_with_logprobs", backend, sample_inputs(), num_logprobs)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch(backend, dtype):
    device = backend.device
    inputs = {name: t[:0].to(device) for name, t in sample_inputs().items()}
    inputs["logits"] = inputs["logits"].to(dtype)
    tokens = call("sample", backend, inputs)
    assert tokens.dtype == torch.int64 and tokens.shape == (0,)
    assert tokens.device.type == device.type
    tokens, token_logprobs, top_ids, top_logprobs = call("sample_with_logprobs", backend, inputs, 4)
    assert tokens.dtype == torch.int64 and tokens.shape == (0,)
    assert token_logprobs.dtype == torch.float32 and token_logprobs.shape == (0,)
    assert top_ids.dtype == torch.int64 and top_ids.shape == (0, 4)
    assert top_logprobs.dtype == torch.float32 and top_logprobs.shape == (0, 4)
    penalty_args = {name: t[:0].to(device) for name, t in penalty_inputs().items()}
    penalty_args["logits"] = penalty_args["logits"].to(dtype)
    backend.ops.apply_penalties(*penalty_args.values())


def penalty_inputs():
    """A valid call with every penalty on."""
    return dict(logits=torch.randn(BATCH, VOCAB),
                prompt_mask=torch.rand(BATCH, VOCAB) < 0.3,
                output_counts=torch.randint(0, 3, (BATCH, VOCAB), dtype=torch.int32),
                repetition_penalty=torch.full((BATCH,), 1.2),
                frequency_penalty=torch.full((BATCH,), 0.5),
                presence_penalty=torch.full((BATCH,), 0.25),
                logit_bias=torch.randn(BATCH, VOCAB))


PENALTY_ERRORS = {
    "logits_int32": (replacing(logits=torch.randint(0, 5, (BATCH, VOCAB), dtype=torch.int32)),
                     TypeError, r"logits must be torch.float32, torch.bfloat16 or torch.float16, "
                     r"got torch.int32"),
    "prompt_mask_uint8": (replacing(prompt_mask=torch.zeros(BATCH, VOCAB, dtype=torch.uint8)),
                          TypeError, r"prompt_mask must be torch.bool, got torch.uint8"),
    "output_counts_int64": (replacing(output_counts=torch.zeros(BATCH, VOCAB, dtype=torch.int64)),
                            TypeError, r"output_counts must be torch.int32, got torch.int64"),
    "repetition_penalty_float64": (
        replacing(repetition_penalty=torch.ones(BATCH, dtype=torch.float64)), TypeError,
        r"repetition_penalty must be torch.float32, got torch.float64"),
    "frequency_penalty_float16": (
        replacing(frequency_penalty=torch.zeros(BATCH, dtype=torch.float16)), TypeError,
        r"frequency_penalty must be torch.float32, got torch.float16"),
    "presence_penalty_int32": (replacing(presence_penalty=torch.zeros(BATCH, dtype=torch.int32)),
                               TypeError, r"presence_penalty must be torch.float32, got "
                               r"torch.int32"),
    "logit_bias_float64": (replacing(logit_bias=torch.zeros(BATCH, VOCAB, dtype=torch.float64)),
                           TypeError, r"logit_bias must be torch.float32, got torch.float64"),
    "logits_1d": (replacing(logits=torch.randn(VOCAB)), ValueError,
                  r"logits must be \[batch, vocab\], got shape \[10\]"),
    "prompt_mask_shape": (replacing(prompt_mask=torch.zeros(BATCH, VOCAB - 1, dtype=torch.bool)),
                          ValueError,
                          r"prompt_mask must have logits' shape \[4, 10\], got \[4, 9\]"),
    "output_counts_shape": (replacing(output_counts=torch.zeros(BATCH - 1, VOCAB,
                                                                dtype=torch.int32)),
                            ValueError,
                            r"output_counts must have logits' shape \[4, 10\], got \[3, 10\]"),
    "logit_bias_shape": (replacing(logit_bias=torch.zeros(BATCH, VOCAB + 1)), ValueError,
                         r"logit_bias must have logits' shape \[4, 10\], got \[4, 11\]"),
    "repetition_penalty_length": (replacing(repetition_penalty=torch.ones(BATCH + 1)),
                                  ValueError, r"repetition_penalty has 5 rows but logits has 4"),
    "presence_penalty_2d": (replacing(presence_penalty=torch.zeros(BATCH, 1)), ValueError,
                            r"presence_penalty must be \[batch\], got shape \[4, 1\]"),
    "repetition_penalty_0": (setting("repetition_penalty", 2, 0.0), ValueError,
                             r"repetition_penalty\[2\]=0 must be > 0"),
    "repetition_penalty_negative": (setting("repetition_penalty", 1, -1.0), ValueError,
                                    r"repetition_penalty\[1\]=-1 must be > 0"),
    "repetition_penalty_nan": (setting("repetition_penalty", 3, math.nan), ValueError,
                               r"repetition_penalty\[3\]=nan must be > 0"),
    "frequency_penalty_nan": (setting("frequency_penalty", 0, math.nan), ValueError,
                              r"frequency_penalty\[0\]=nan must be finite"),
    "presence_penalty_inf": (setting("presence_penalty", 2, math.inf), ValueError,
                             r"presence_penalty\[2\]=inf must be finite"),
    "prompt_mask_on_meta": (replacing(prompt_mask=torch.zeros(BATCH, VOCAB, dtype=torch.bool,
                                                              device="meta")),
                            ValueError, r"prompt_mask is on meta but logits is on cpu"),
    "logit_bias_on_meta": (replacing(logit_bias=torch.zeros(BATCH, VOCAB, device="meta")),
                           ValueError, r"logit_bias is on meta but logits is on cpu"),
    # One row seen four times: its penalties would apply four times.
    "logits_expanded": (replacing(logits=torch.randn(1, VOCAB).expand(BATCH, VOCAB)), ValueError,
                        r"logits must not have overlapping elements \(e.g. an expanded tensor\)"),
    "logits_rows_overlapping": (replacing(logits=torch.randn(2 * VOCAB).as_strided(
        (BATCH, VOCAB), (1, 1))), ValueError, r"logits must not have overlapping elements"),
}


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", PENALTY_ERRORS)
def test_apply_penalties_bad_input_leaves_logits_unchanged(backend, case):
    change, error, match = PENALTY_ERRORS[case]
    inputs = penalty_inputs()
    valid = {name: t.clone() for name, t in inputs.items()}
    backend.ops.apply_penalties(*valid.values())  # valid before the change
    assert not torch.equal(valid["logits"], inputs["logits"])
    inputs |= change(inputs)
    logits_before = inputs["logits"].clone()
    with pytest.raises(error, match=match):
        backend.ops.apply_penalties(*inputs.values())
    assert torch.equal(inputs["logits"], logits_before), "a rejected call changed the logits"
