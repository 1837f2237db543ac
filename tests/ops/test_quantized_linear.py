"""fastllm.ops.quantized_linear and fastllm.ops.dequantize on every backend against a float64
dequantize + matmul, with weights encoded by the gguf package (an independent encoder of ggml's
block formats)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import assert_within_twice_plain_error
from fastllm.ops import reference

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
CUDA_GEMV_ROWS = 8  # the most rows CUDA's GEMV takes (kMaxGemvRows, quantized_kernels.cuh)


def quantized_weight(out: int, in_: int, weight_type: int, seed: int = 0) -> torch.Tensor:
    """A random weight through gguf's own quantizer: uint8 [out, row bytes]."""
    values = np.random.default_rng(seed).standard_normal((out, in_)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType(weight_type)))


def activation_error_bound(x: torch.Tensor, weight: torch.Tensor, weight_type: int) -> torch.Tensor:
    """The most the kernel may differ from exact float64: its int16 activation blocks round each
    value by at most half a step (block amax / 32767), plus float32 summation."""
    w = reference.dequantize(weight, weight_type).abs()  # [out, in]
    xd = x.double()
    step = xd.abs().reshape(x.shape[0], -1, 32).amax(-1) / 32767  # [rows, blocks]
    per_value = step.repeat_interleave(32, dim=1) / 2  # [rows, in]
    return per_value @ w.T + 1e-5 * (xd.abs() @ w.T) + 1e-6


@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf(type_name, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(37, 96, weight_type)
    expected = torch.from_numpy(gguf.quants.dequantize(weight.numpy(),
                                                       gguf.GGMLQuantizationType(weight_type)))
    got = backend.ops.dequantize(weight.to(backend.device), weight_type, torch.float32).cpu()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(reference.dequantize(weight, weight_type), expected.double())
    for dtype in (torch.bfloat16, torch.float16):
        low = backend.ops.dequantize(weight.to(backend.device), weight_type, dtype).cpu()
        assert torch.equal(low, expected.to(dtype))


def check_float32(backend, type_name: str, rows: int, shape: tuple[int, int]) -> None:
    weight_type = TYPES[type_name]
    out, in_ = shape
    weight = quantized_weight(out, in_, weight_type, seed=rows)
    x = torch.randn(rows, in_) * 3
    x[:, 0] = 40.0  # an outlier: its block's other values lose precision, as real activations do
    bias = torch.randn(out)
    got = backend.ops.quantized_linear(x.to(backend.device), weight.to(backend.device),
                                       weight_type, bias.to(backend.device)).cpu()
    expected = reference.quantized_linear(x, weight, weight_type, bias)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    bound = activation_error_bound(x, weight, weight_type)
    err = (got.double() - expected).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound[err.argmax()]}"


SHAPES = [(1, 32), (7, 96), (64, 576)]
# Rows on either side of each kernel's switch: the CPU's 4-row tiles and its 16 stream rows,
# the CUDA GEMV's 8 rows. The simulator runs the first set: the GEMV with 1, 3 and 8 rows, then
# dequantize + matmul.
ROWS = [1, 3, 8, 9]
MORE_ROWS = [2, 4, 5, 16, 17, 64, 512]


@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_linear_float32(type_name, rows, shape, backend):
    check_float32(backend, type_name, rows, shape)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", MORE_ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_linear_float32_more_rows(type_name, rows, shape, backend):
    check_float32(backend, type_name, rows, shape)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_linear_low_precision(type_name, rows, dtype, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(48, 128, weight_type, seed=rows)
    x, bias = torch.randn(rows, 128, dtype=dtype), torch.randn(48, dtype=dtype)
    got = backend.ops.quantized_linear(x.to(backend.device), weight.to(backend.device),
                                       weight_type, bias.to(backend.device)).cpu()
    expected = reference.quantized_linear(x, weight, weight_type, bias)
    assert got.dtype == dtype
    if backend.name == "composite" or (backend.name in ("cuda", "cuda_sim")
                                       and rows > CUDA_GEMV_ROWS):
        # These round the weight to x's dtype for a matmul in it: flash-attention's rule
        # against that plain composition.
        plain = torch.nn.functional.linear(
            x, reference.dequantize(weight, weight_type).to(dtype), bias)
        assert_within_twice_plain_error(got.double(), plain.double(), expected)
    else:  # exact weights, float32 sums, one rounding to dtype
        bound = activation_error_bound(x.float(), weight, weight_type) + expected.abs() * 2**-7
        assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_does_not_depend_on_the_others(type_name, backend):
    if backend.name == "composite":
        pytest.skip("ATen's matmul promises no batch invariance")
    weight_type = TYPES[type_name]
    weight = quantized_weight(64, 256, weight_type).to(backend.device)
    # float32: a low-precision output would round small differences away.
    x = torch.randn(CUDA_GEMV_ROWS, 256, device=backend.device)

    def linear(rows):
        return backend.ops.quantized_linear(rows, weight, weight_type)

    alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(linear(x), alone)
    assert torch.equal(linear(x[2:5]), alone[2:5])


@pytest.mark.cuda_sim
@pytest.mark.parametrize("rows", [3, 12])
def test_strided_inputs(rows, backend):
    device = backend.device
    weight = quantized_weight(24, 64, 3)  # Q4_1: rows of 40 bytes
    # The weight's rows inside wider rows, at an odd byte offset.
    wide = torch.zeros(24, 45, dtype=torch.uint8, device=device)
    wide[:, 1:41] = weight.to(device)
    strided_weight = wide[:, 1:41]
    bias = torch.randn(24)
    # x as a column slice of wider rows, and stored transposed.
    for x in (torch.randn(rows, 80, device=device)[:, 7:71],
              torch.randn(64, rows, device=device).T):
        got = backend.ops.quantized_linear(x, strided_weight, 3, bias.to(device)).cpu()
        expected = reference.quantized_linear(x.cpu(), weight, 3, bias)
        bound = activation_error_bound(x.cpu(), weight, 3)
        assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.cuda_sim
def test_empty_inputs(backend):
    device = backend.device
    weight = quantized_weight(8, 64, 2).to(device)
    bias = torch.randn(8, device=device)
    for rows in (0, 3, 12):
        x = torch.randn(rows, 64, device=device)
        assert backend.ops.quantized_linear(x, weight, 2).shape == (rows, 8)
        assert backend.ops.quantized_linear(x, weight[:0], 2).shape == (rows, 0)
        # Rows of no blocks: the product is empty, the output the bias.
        got = backend.ops.quantized_linear(x[:, :0], weight[:, :0], 2, bias)
        assert torch.equal(got, bias.expand(rows, 8))
    assert backend.ops.dequantize(weight[:0], 2, torch.float32).shape == (0, 64)


@pytest.mark.cuda_sim
@pytest.mark.cpu_inputs
def test_bad_input(backend):
    op = backend.ops
    weight = quantized_weight(8, 64, 2)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight_type must be a ggml type id .* got 12"):
        op.quantized_linear(x, weight, 12)
    with pytest.raises(TypeError, match="weight must be torch.uint8, got torch.float32"):
        op.quantized_linear(x, weight.float(), 2)
    with pytest.raises(ValueError, match="whole blocks of 18 bytes, got rows of 35 bytes"):
        op.quantized_linear(x, weight[:, :35], 2)
    with pytest.raises(ValueError, match="x has 32 features but the Q4_0 weight's rows hold 64"):
        op.quantized_linear(torch.randn(2, 32), weight, 2)
    with pytest.raises(ValueError, match="bias has 3 elements but weight has 8"):
        op.quantized_linear(x, weight, 2, torch.randn(3))
    with pytest.raises(TypeError, match="x must be torch.float32, torch.bfloat16"):
        op.quantized_linear(x.long(), weight, 2)


def test_opcheck(backend):
    weight = quantized_weight(16, 64, 3).to(backend.device)
    x = torch.randn(3, 64, device=backend.device)
    torch.library.opcheck(backend.ops.quantized_linear.default, (x, weight, 3, None))
    torch.library.opcheck(backend.ops.dequantize.default, (weight, 3, torch.float32))
