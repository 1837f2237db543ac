"""fastllm.ops.quantized_linear and fastllm.ops.dequantize on every backend against a float64
dequantize + matmul, with weights encoded by the gguf package (an independent encoder of ggml's
block formats)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from fastllm import ops
from fastllm.ops import reference

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


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


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf(type_name, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(37, 96, weight_type)
    expected = torch.from_numpy(gguf.quants.dequantize(weight.numpy(),
                                                       gguf.GGMLQuantizationType(weight_type)))
    got = backend.ops.dequantize(weight.to(backend.device), weight_type, torch.float32).cpu()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(reference.dequantize(weight, weight_type), expected.double())
    half = backend.ops.dequantize(weight.to(backend.device), weight_type, torch.bfloat16).cpu()
    assert torch.equal(half, expected.to(torch.bfloat16))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 64, 512])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (64, 576)])
def test_quantized_linear_float32(type_name, rows, shape, backend):
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


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_linear_low_precision(type_name, rows, dtype):
    weight_type = TYPES[type_name]
    weight = quantized_weight(48, 128, weight_type, seed=rows)
    x = torch.randn(rows, 128, dtype=dtype)
    got = ops.quantized_linear(x, weight, weight_type)
    expected = reference.quantized_linear(x, weight, weight_type)
    assert got.dtype == dtype
    bound = activation_error_bound(x.float(), weight, weight_type) + expected.abs() * 2**-7
    assert ((got.double() - expected).abs() <= bound).all()


def test_a_row_does_not_depend_on_the_others():
    weight = quantized_weight(64, 256, 3)
    x = torch.randn(6, 256)
    alone = torch.cat([ops.quantized_linear(x[i:i + 1], weight, 3) for i in range(6)])
    assert torch.equal(ops.quantized_linear(x, weight, 3), alone)


def test_empty_inputs():
    weight = quantized_weight(8, 64, 2)
    assert ops.quantized_linear(torch.randn(0, 64), weight, 2).shape == (0, 8)
    assert ops.quantized_linear(torch.randn(3, 64), weight[:0], 2).shape == (3, 0)


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
