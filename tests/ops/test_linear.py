"""The linear op of every backend (conftest.py) against a float64 product.

Row counts cover both CPU paths (the weight-streaming kernel for few rows, a GEMM past its
threshold: 64 rows in float32, 8 in bfloat16, 4 in float16; ATen's, or converted panels of a
16-bit weight) and their edges; feature counts cover whole SIMD vectors, tails shorter than one,
and tiles of weight rows with a remainder.
Every dtype is held to flash-attention's 2x rule against a float64 product of the same inputs
(the plain composition: the float32 product, rounded to the dtype).

The grids are covering arrays (tests/covering.py) over the backend, dtype, row count, feature
shape and bias: every pair of values meets in some case, so each backend (the simulator and a
GPU included) runs every row count, shape, dtype and bias at least once; the CPU kernels'
switches (a dtype's last streamed row count and the first past it) and CUDA's biased product in
each dtype (float32's goes to ATen, 16-bit ones accumulate onto the bias) are always in.
"""

import threading

import covering
import pytest
import torch
from conftest import assert_within_twice_plain_error

from fastllm import _C, ops
from fastllm.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(linear, x, weight, bias):
    inputs = [t.clone() for t in (x, weight, bias) if t is not None]
    got = linear(x, weight, bias)
    assert all(torch.equal(t, saved) for t, saved in
               zip([t for t in (x, weight, bias) if t is not None], inputs)), "an input was written"
    assert got.shape == (x.shape[0], weight.shape[0]) and got.dtype == x.dtype
    expected = torch.nn.functional.linear(
        x.cpu().double(), weight.cpu().double(), None if bias is None else bias.cpu().double())
    plain = reference.linear(x, weight, bias).cpu().double()
    assert_within_twice_plain_error(got.cpu().double(), plain, expected)


# The CPU's last row count that streams the weights, and the first that takes a GEMM, per dtype
# (bfloat16 streams 8 rows where the CPU has a bfloat16 dot product, else 4).
CPU_SWITCHES = [(torch.float32, 64), (torch.float32, 65), (torch.bfloat16, 4),
                (torch.bfloat16, 5), (torch.bfloat16, 8), (torch.bfloat16, 9),
                (torch.float16, 4), (torch.float16, 5)]
BIAS_IDS = {"with_bias": lambda with_bias: "bias" if with_bias else "no_bias"}


@pytest.mark.cuda_sim
@covering.grid(dtype=DTYPES, rows=[0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 65],
               shape=[(64, 24), (1, 9), (7, 3), (33, 17), (1077, 70)],
               with_bias=[False, True], ids=BIAS_IDS,
               edges=[*(dict(backend="cpu", dtype=dtype, rows=rows)
                        for dtype, rows in CPU_SWITCHES),
                      *(dict(backend=backend, dtype=dtype, with_bias=True)
                        for backend in ("cuda_sim", "cuda") for dtype in DTYPES)])
def test_matches_float64(backend, dtype, rows, shape, with_bias):
    in_features, out_features = shape
    x = torch.randn(rows, in_features, dtype=dtype, device=backend.device)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=backend.device)
    bias = torch.randn(out_features, dtype=dtype, device=backend.device) if with_bias else None
    check(backend.ops.linear, x, weight, bias)


@covering.grid(weight_dtype=[torch.bfloat16, torch.float16], rows=[0, 1, 3, 4, 5, 16, 17, 40],
               shape=[(64, 24), (7, 3), (1077, 70)],
               edges=[dict(backend="cpu", weight_dtype=weight_dtype, rows=rows)
                      for weight_dtype in (torch.bfloat16, torch.float16) for rows in (16, 17)])
def test_16_bit_weights_under_float32(backend, weight_dtype, rows, shape):
    """A float16 GGUF or a bfloat16 checkpoint run in float32 keeps its weights in 16 bits: the
    result is the float32 product with the upcast weight (exact conversion), both paths (the
    CPU streams up to 16 rows: both sides of that always)."""
    in_features, out_features = shape
    x = torch.randn(rows, in_features, device=backend.device)
    weight = torch.randn(out_features, in_features, device=backend.device).to(weight_dtype)
    bias = torch.randn(out_features, device=backend.device)
    got = backend.ops.linear(x, weight, bias)
    assert got.dtype == torch.float32
    check(backend.ops.linear, x, weight, bias)
    if backend.name == "cpu" and rows <= 16:  # the streaming kernel: the upcast weight's sums
        torch.testing.assert_close(got, ops.linear(x, weight.float(), bias), atol=1e-5,
                                   rtol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_many_row_product_with_16_bit_weights_does_not_depend_on_the_other_rows(
        weight_dtype):
    """float32 rows past the streaming kernel's 16 against 16-bit weights take the CPU's
    converted weight panels: a row's result is bitwise the same in any batch that takes it (its
    sums run over k in the same blocks whatever its tile)."""
    weight = torch.randn(70, 1029).to(weight_dtype)
    bias = torch.randn(70)
    x = torch.randn(90, 1029)
    together = ops.linear(x, weight, bias)
    for first, rows in ((0, 17), (7, 40), (45, 45)):
        part = ops.linear(x[first:first + rows], weight, bias)
        assert torch.equal(part, together[first:first + rows]), (first, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(dtype, device):
    """Row-strided weights (a slice of a fused matrix) and non-contiguous activations."""
    fused = torch.randn(96, 80, dtype=dtype, device=device)
    weight = fused[10:50, 8:72]  # rows contiguous, stride 80
    x = torch.randn(64, 3, dtype=dtype, device=device).t()  # [3, 64], column-major
    check(ops.linear, x, weight, None)


def test_no_output_features(device):
    x = torch.randn(2, 8, device=device)
    assert ops.linear(x, torch.randn(0, 8, device=device)).shape == (2, 0)
    assert torch.equal(ops.linear(torch.randn(3, 0, device=device),
                                  torch.randn(5, 0, device=device)),
                       torch.zeros(3, 5, device=device))


def test_bad_inputs_raise(backend):
    linear, device = backend.ops.linear, backend.device
    x = torch.randn(2, 8, device=device)
    w = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"x must be \[rows, in_features\], got shape \[2, 2, 4\]"):
        linear(x.view(2, 2, 4), w, None)
    with pytest.raises(ValueError, match=r"x has 8 features but weight .* = \[4, 9\]"):
        linear(x, torch.randn(4, 9, device=device), None)
    with pytest.raises(TypeError, match="weight has dtype torch.float32 but x has dtype "
                                        "torch.bfloat16"):
        linear(x.bfloat16(), w, None)
    with pytest.raises(TypeError, match="weight has dtype torch.float16 but x has dtype "
                                        "torch.bfloat16"):
        linear(x.bfloat16(), w.half(), None)
    with pytest.raises(TypeError, match="x must be torch.float32, torch.bfloat16 or "
                                        "torch.float16, got torch.int64"):
        linear(x.long(), w.long(), None)
    with pytest.raises(ValueError, match="weight rows must be contiguous"):
        linear(x, torch.randn(8, 4, device=device).t(), None)
    with pytest.raises(ValueError, match="bias has 3 elements but weight has 4"):
        linear(x, w, torch.randn(3, device=device))
    with pytest.raises(TypeError, match="bias has dtype torch.float16"):
        linear(x, w, torch.randn(4, device=device, dtype=torch.float16))


@pytest.mark.parametrize("x_dtype, weight_dtype", [
    *[(dtype, dtype) for dtype in DTYPES], (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16)], ids=str)
@pytest.mark.parametrize("in_features", [64, 1077])
def test_batch_invariant_rows_equal_each_row_alone(x_dtype, weight_dtype, in_features):
    """Under ops.batch_invariant() a row's result is bit for bit its result alone, for more rows
    than the op otherwise streams (it would switch to ATen's GEMM); still float64-close."""
    x = torch.randn(70, in_features).to(x_dtype)
    weight = torch.randn(40, in_features).to(weight_dtype)
    bias = torch.randn(40).to(x_dtype)
    with ops.batch_invariant():
        batch = ops.linear(x, weight, bias)
        alone = torch.cat([ops.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])
        assert torch.equal(batch, alone)
        check(ops.linear, x, weight, bias)


def test_batch_invariant_is_per_thread_and_restored():
    with ops.batch_invariant():
        assert _C.batch_invariant()
        other_thread = []
        thread = threading.Thread(target=lambda: other_thread.append(_C.batch_invariant()))
        thread.start()
        thread.join()
        assert other_thread == [False]
        with ops.batch_invariant(False):
            assert not _C.batch_invariant()
        assert _C.batch_invariant()
    assert not _C.batch_invariant()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with ops.batch_invariant("yes"):
            pass
