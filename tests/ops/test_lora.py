"""fastllm.ops.add_lora on every backend (conftest.py) against its float64 twin
(reference.add_lora).

Token counts cover an empty call, one token, a decode step (7) and a prefill chunk (70: more
than one of the CPU's 16-token tasks per slot); slot patterns every token without an adapter,
random slots with -1 among them, runs of one slot (a prefill's sequences) and consecutive tokens
of other slots (a decode step's); ranks 1, 16, 33 and 48 (on CUDA the expand's one lane per
output row, half a warp, and a whole warp with a partial last pass over the rank; the shrink's
blocks of 8 rank rows full and partly used); features of whole SIMD vectors, odd ones with
tails, and more outputs than the CPU's 256-column tasks. float32 is held tight to the
float64 result; bfloat16 / float16 to flash-attention's 2x rule against the plain composition
(peft's eager ``lora_B(lora_A(x))`` per slot in that dtype, added to the output).

The grid is a covering array (tests/covering.py) over the backend and the case's parameters:
every pair of values meets in some case, so each backend (the simulator and a GPU included) runs
every dtype, token count, slot pattern, rank, size and output layout at least once. Always in:
on the CPU each dtype in a prefill chunk of runs and in a decode step of interleaved slots, and
each of those steps on the simulator and a GPU.
"""

from __future__ import annotations

import math

import covering
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_within_twice_plain_error

from fastllm import ops
from fastllm.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32_TOL = 2e-5
MAX_RANK = 1024
PATTERNS = ["none", "mixed", "runs", "interleaved"]


def slot_pattern(pattern: str, tokens: int, slots: int) -> torch.Tensor:
    """int32 [tokens]: each token's slot, -1 for none."""
    if pattern == "none":
        return torch.full((tokens,), -1, dtype=torch.int32)
    if pattern == "mixed":
        return torch.randint(-1, slots, (tokens,), dtype=torch.int32)
    if pattern == "runs":  # sequences of 1 to 30 tokens, each of one slot (or none)
        runs = []
        while sum(map(len, runs)) < tokens:
            length = int(torch.randint(1, 31, ()))
            runs.append(torch.full((length,), int(torch.randint(-1, slots, ())),
                                   dtype=torch.int32))
        return torch.cat(runs)[:tokens] if runs else torch.empty(0, dtype=torch.int32)
    # interleaved: -1, 0, 1, ..., slots - 1, -1, 0, ...
    return (torch.arange(tokens, dtype=torch.int32) % (slots + 1)) - 1


def lora_inputs(tokens: int, slots: int, rank: int, features: tuple[int, int], pattern: str,
                dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """(y, x, lora_a, lora_b, token_slots), scaled so that the LoRA term is O(1)."""
    in_features, out_features = features
    x = torch.randn(tokens, in_features)
    lora_a = torch.randn(slots, rank, in_features) / in_features**0.5
    lora_b = torch.randn(slots, out_features, rank) / rank**0.5
    y = torch.randn(tokens, out_features)
    token_slots = slot_pattern(pattern, tokens, slots)
    return (*(t.to(device=device, dtype=dtype) for t in (y, x, lora_a, lora_b)),
            token_slots.to(device))


def plain(y, x, lora_a, lora_b, token_slots) -> torch.Tensor:
    """peft's eager arithmetic in the inputs' dtype, slot by slot: ``lora_B(lora_A(x))``, each
    product rounded to the dtype, added to the output."""
    out = y.clone()
    for s in range(lora_a.shape[0]):
        rows = (token_slots == s).nonzero().squeeze(1)
        out[rows] += F.linear(F.linear(x[rows], lora_a[s]), lora_b[s])
    return out


def judge(got, inputs, expected, dtype) -> None:
    """float32 tight against float64; bfloat16/float16 flash-attention's 2x rule."""
    assert not got.isnan().any(), "NaN in the output"
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu().double(), expected, atol=F32_TOL, rtol=F32_TOL)
    else:
        assert_within_twice_plain_error(got.cpu().double(), plain(*inputs).cpu().double(),
                                        expected)


def check(add_lora, y, x, lora_a, lora_b, token_slots, *, strided_y: bool = False) -> None:
    """add_lora into y (or into a column slice of a NaN buffer holding y) against the twin: the
    inputs and every row of slot -1 are left as they are, and nothing outside y is written."""
    tokens, out_features = y.shape
    inputs = [t.clone() for t in (x, lora_a, lora_b, token_slots)]
    if strided_y:
        buffer = torch.full((tokens, out_features + 8), math.nan, dtype=y.dtype, device=y.device)
        target = buffer[:, 4:out_features + 4]
        target.copy_(y)
    else:
        target = y.clone()
    add_lora(target, x, lora_a, lora_b, token_slots)
    assert all(torch.equal(t, saved) for t, saved in
               zip((x, lora_a, lora_b, token_slots), inputs)), "an input was written"
    if strided_y:
        assert buffer[:, :4].isnan().all() and buffer[:, out_features + 4:].isnan().all(), \
            "an element outside y was written"
    untouched = (token_slots < 0).cpu()
    assert torch.equal(target.cpu()[untouched], y.cpu()[untouched]), "a row of slot -1 changed"
    expected = reference.add_lora(y.cpu(), x.cpu(), lora_a.cpu(), lora_b.cpu(),
                                  token_slots.cpu())
    judge(target, (y, x, lora_a, lora_b, token_slots), expected, y.dtype)


STRIDED_IDS = {"strided_y": lambda strided: "y_slice" if strided else "y_dense"}


@pytest.mark.cuda_sim
@covering.grid(dtype=DTYPES, tokens=[0, 1, 7, 70], slots=[1, 4], rank=[1, 16, 33, 48],
               features=[(64, 96), (57, 31), (1, 9), (576, 300)], pattern=PATTERNS,
               strided_y=[False, True], ids=STRIDED_IDS,
               edges=[*(dict(backend="cpu", dtype=dtype, tokens=70, slots=4, pattern="runs")
                        for dtype in DTYPES),
                      *(dict(backend="cpu", dtype=dtype, tokens=7, slots=4,
                             pattern="interleaved") for dtype in DTYPES),
                      *(dict(backend=backend, tokens=tokens, slots=4, pattern=pattern)
                        for backend in ("cuda_sim", "cuda")
                        for tokens, pattern in ((7, "interleaved"), (70, "runs")))])
def test_matches_float64(backend, dtype, tokens, slots, rank, features, pattern, strided_y):
    inputs = lora_inputs(tokens, slots, rank, features, pattern, dtype, backend.device)
    check(backend.ops.add_lora, *inputs, strided_y=strided_y)


def test_the_wrapper_runs_the_op_in_place():
    y, x, lora_a, lora_b, token_slots = lora_inputs(7, 4, 16, (64, 96), "interleaved",
                                                    torch.float32, "cpu")
    expected = reference.add_lora(y, x, lora_a, lora_b, token_slots)
    assert ops.add_lora(y, x, lora_a, lora_b, token_slots) is None
    torch.testing.assert_close(y.double(), expected, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_token_does_not_depend_on_the_batch_on_the_cpu(dtype):
    """A token's result is bit for bit its result alone, in a batch of other slots and in a
    run of its own slot longer than one task."""
    y, x, lora_a, lora_b, token_slots = lora_inputs(40, 3, 33, (70, 40), "runs", dtype, "cpu")
    token_slots[:20] = 1
    batch = y.clone()
    ops.add_lora(batch, x, lora_a, lora_b, token_slots)
    for t in (0, 7, 19, 20, 39):
        alone = y[t:t + 1].clone()
        ops.add_lora(alone, x[t:t + 1], lora_a, lora_b, token_slots[t:t + 1])
        assert torch.equal(alone, batch[t:t + 1]), t


@pytest.mark.cuda_sim
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_x(backend, dtype):
    """x column-major (a transposed view) or a column slice of a wider activation."""
    y, x, lora_a, lora_b, token_slots = lora_inputs(9, 3, 16, (40, 24), "mixed", dtype,
                                                    backend.device)
    check(backend.ops.add_lora, y, x.t().contiguous().t(), lora_a, lora_b, token_slots)
    wide = torch.randn(9, 50, device=backend.device).to(dtype)
    wide[:, 5:45] = x
    check(backend.ops.add_lora, y, wide[:, 5:45], lora_a, lora_b, token_slots)


def test_the_largest_rank(backend):
    check(backend.ops.add_lora, *lora_inputs(3, 2, MAX_RANK, (40, 24), "mixed", torch.float32,
                                             backend.device))


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def valid_inputs() -> dict[str, torch.Tensor]:
    """A valid call: 3 tokens, 2 slots of rank 4, 8 -> 6 features."""
    return dict(y=torch.zeros(3, 6), x=torch.randn(3, 8), lora_a=torch.randn(2, 4, 8),
                lora_b=torch.randn(2, 6, 4), token_slots=i32(1, -1, 0))


# id: (changes to the valid call, exception, pattern its message must match)
BAD_INPUTS = {
    "x_3d": (dict(x=torch.randn(3, 2, 4)), ValueError,
             r"x must be \[tokens, in_features\], got shape \[3, 2, 4\]"),
    "lora_a_2d": (dict(lora_a=torch.randn(4, 8)), ValueError,
                  r"lora_a must be \[slots, rank, in_features\]"),
    "lora_b_2d": (dict(lora_b=torch.randn(6, 4)), ValueError,
                  r"lora_b must be \[slots, out_features, rank\]"),
    "token_slots_2d": (dict(token_slots=i32(1, -1, 0).view(3, 1)), ValueError,
                       r"token_slots must be \[tokens\]"),
    "x_int": (dict(x=torch.ones(3, 8, dtype=torch.int64)), TypeError,
              "x must be torch.float32, torch.bfloat16 or torch.float16, got torch.int64"),
    "y_dtype": (dict(y=torch.zeros(3, 6, dtype=torch.bfloat16)), TypeError,
                "y has dtype torch.bfloat16 but x has dtype torch.float32"),
    "lora_a_dtype": (dict(lora_a=torch.randn(2, 4, 8, dtype=torch.float16)), TypeError,
                     "lora_a has dtype torch.float16 but x has dtype torch.float32"),
    "lora_b_dtype": (dict(lora_b=torch.randn(2, 6, 4, dtype=torch.bfloat16)), TypeError,
                     "lora_b has dtype torch.bfloat16 but x has dtype torch.float32"),
    "token_slots_int64": (dict(token_slots=torch.tensor([1, -1, 0])), TypeError,
                          "token_slots must be torch.int32, got torch.int64"),
    "y_rows": (dict(y=torch.zeros(4, 6)), ValueError, "y has 4 rows but x has 3 tokens"),
    "token_slots_length": (dict(token_slots=i32(0, 0)), ValueError,
                           "token_slots has 2 slots but x has 3 tokens"),
    "no_slots": (dict(lora_a=torch.randn(0, 4, 8), lora_b=torch.randn(0, 6, 4)), ValueError,
                 "lora_a must hold at least one adapter slot"),
    "rank_0": (dict(lora_a=torch.randn(2, 0, 8), lora_b=torch.randn(2, 6, 0)), ValueError,
               r"the LoRA rank \(lora_a's dim 1\) must be in \[1, 1024\], got 0"),
    "rank_past_the_limit": (dict(lora_a=torch.randn(2, MAX_RANK + 1, 8),
                                 lora_b=torch.randn(2, 6, MAX_RANK + 1)), ValueError,
                            r"must be in \[1, 1024\], got 1025"),
    "lora_a_features": (dict(lora_a=torch.randn(2, 4, 9)), ValueError,
                        r"lora_a \[slots, rank, in_features\] = \[2, 4, 9\] does not match "
                        "x's 8 features"),
    "lora_b_out": (dict(lora_b=torch.randn(2, 7, 4)), ValueError,
                   r"lora_b must be \[slots, out_features, rank\] = \[2, 6, 4\]"),
    "lora_b_rank": (dict(lora_b=torch.randn(2, 6, 5)), ValueError,
                    r"lora_b must be \[slots, out_features, rank\] = \[2, 6, 4\]"),
    "lora_b_slots": (dict(lora_b=torch.randn(3, 6, 4)), ValueError,
                     r"lora_b must be \[slots, out_features, rank\] = \[2, 6, 4\]"),
    "y_column_major": (dict(y=torch.zeros(6, 3).t()), ValueError,
                       "y's last dim must be contiguous"),
    "y_expanded": (dict(y=torch.zeros(1, 6).expand(3, 6)), ValueError,
                   "y must not have overlapping elements"),
    "slot_past_the_adapters": (dict(token_slots=i32(1, 2, 0)), ValueError,
                               r"token_slots\[1\]=2 is outside \[-1, 2\)"),
    "slot_below_minus_one": (dict(token_slots=i32(-2, 0, 0)), ValueError,
                             r"token_slots\[0\]=-2 is outside \[-1, 2\)"),
    "y_on_meta": (dict(y=torch.zeros(3, 6, device="meta")), ValueError,
                  "y is on meta but x is on cpu"),
    "lora_b_on_meta": (dict(lora_b=torch.randn(2, 6, 4, device="meta")), ValueError,
                       "lora_b is on meta but x is on cpu"),
    "token_slots_on_meta": (dict(token_slots=i32(1, -1, 0).to("meta")), ValueError,
                            "token_slots is on meta but x is on cpu"),
}


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_raise_and_change_nothing(backend, case):
    changes, error, match = BAD_INPUTS[case]
    inputs = valid_inputs() | changes
    y = inputs["y"]
    before = None if y.is_meta else y.clone()
    with pytest.raises(error, match=match):
        backend.ops.add_lora(**inputs)
    if before is not None:
        assert torch.equal(y, before), "a rejected call wrote y"


@pytest.mark.cpu_inputs
@pytest.mark.parametrize("other", ["x", "lora_a", "lora_b", "token_slots"])
def test_y_sharing_memory_with_an_input_raises(backend, other):
    """y is written in place: an input in its memory would change under the op."""
    inputs = valid_inputs()
    storage = torch.zeros(200)
    inputs["y"] = storage[:18].view(3, 6)
    shape = inputs[other].shape
    inputs[other] = (storage.view(torch.int32)[10:13] if other == "token_slots"
                     else storage[10:10 + shape.numel()].view(shape))
    with pytest.raises(ValueError, match=f"y and {other} must not share memory"):
        backend.ops.add_lora(**inputs)


def test_a_trusted_call_with_bad_slots_reads_no_adapter_past_the_end(backend):
    """Inside ops.trusted_inputs() the CPU kernel checks anyway; the ATen composition (MPS) and
    a GPU do not check, and leave the tokens of bad slots as they are."""
    y, x, lora_a, lora_b, _ = lora_inputs(6, 2, 16, (64, 96), "mixed", torch.float32,
                                          backend.device)
    token_slots = torch.tensor([0, 2, -1, 1, 2**30, -7], dtype=torch.int32, device=y.device)
    target = y.clone()
    with ops.trusted_inputs():
        if backend.name == "cpu":
            with pytest.raises(ValueError, match=r"token_slots\[1\]=2 is outside \[-1, 2\)"):
                backend.ops.add_lora(target, x, lora_a, lora_b, token_slots)
            return
        backend.ops.add_lora(target, x, lora_a, lora_b, token_slots)
    valid = torch.where((token_slots >= 0) & (token_slots < 2), token_slots, -1)
    expected = reference.add_lora(y.cpu(), x.cpu(), lora_a.cpu(), lora_b.cpu(), valid.cpu())
    bad = (valid < 0).cpu()
    assert torch.equal(target.cpu()[bad], y.cpu()[bad]), "a token of a bad slot changed"
    torch.testing.assert_close(target.cpu().double(), expected, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, pattern", [(0, "mixed"), (5, "interleaved"), (20, "runs")])
def test_opcheck(backend, dtype, tokens, pattern):
    y, x, lora_a, lora_b, token_slots = lora_inputs(tokens, 3, 8, (24, 40), pattern, dtype,
                                                    backend.device)
    torch.library.opcheck(backend.ops.add_lora.default, (y, x, lora_a, lora_b, token_slots))
