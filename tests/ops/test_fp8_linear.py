"""fastllm.ops.quantized_linear and fastllm.ops.dequantize on fastllm's FP8 blocks
(ops.FP8_E4M3: a float32 scale and 32 float8_e4m3fn codes per block) on every backend (the CPU
kernels once per instruction set, the ATen composition, the CUDA simulator) against the float64
twin, and fastllm.models.quantized.pack_fp8, which writes the blocks from a checkpoint's codes
and scales.

The CPU's decode rows (up to 32) take the activations as they are, float32: their error is
float32 summation alone; past 32 rows the weight is dequantized for a GEMM (oneDNN's bfloat16
GEMM with AMX, or AVX-512 with AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_within_twice_plain_error
from test_quantized_linear import (CPU_STREAM_ROWS, assert_prefill_rows_independent,
                                   isa_takes_bfloat16_gemm)
from fastllm import _C, ops
from fastllm.models.quantized import pack_fp8
from fastllm.ops import reference

FP8 = ops.FP8_E4M3
CUDA_GEMV_ROWS = 8  # CUDA's GEMV rows (kMaxGemvRows, quantized_kernels.cuh)


def fp8_codes(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Every e4m3 code but the NaNs, at random, with the largest (±448) and subnormals among
    them: float8_e4m3fn [rows, cols]."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=generator, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # 448
    codes.view(-1)[:4] = torch.tensor([0x7E, 0xFE, 0x01, 0x87], dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn)


def fp8_weight(rows: int, blocks: int, seed: int = 0,
               block: tuple[int, int] = (1, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [rows, blocks * 36], float64 values [rows, blocks * 32])``: random codes under
    random float32 scales, one per ``block`` (rows, cols), so values are about 0.1."""
    cols = blocks * 32
    codes = fp8_codes(rows, cols, seed)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = 1e-3 * (0.5 + torch.rand(grid, generator=torch.Generator().manual_seed(seed + 1)))
    packed = pack_fp8(codes, scales, block)
    per_value = (scales.double().repeat_interleave(block[0], 0)[:rows]
                 .repeat_interleave(block[1], 1)[:, :cols])
    return packed.data, codes.double() * per_value


def summation_bound(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """float32 sums of exact products: well within 1e-5 of the sum of |x w| at these sizes."""
    return 1e-5 * (x.double().abs() @ values.abs().T) + 1e-7


def bfloat16_gemm_bound(backend_name: str, rows: int, x: torch.Tensor,
                        values: torch.Tensor) -> torch.Tensor | float:
    """What the CPU's bfloat16 GEMM adds past the decode rows (x and the weights rounded to
    bfloat16, and the result: 2^-7 of the sum of |x w|); 0 on the other paths."""
    isa = backend_name.removeprefix("cpu-") if backend_name.startswith("cpu") else None
    if rows <= CPU_STREAM_ROWS or isa is None or not isa_takes_bfloat16_gemm(isa, False):
        return 0.0
    return 2**-7 * (x.double().abs() @ values.abs().T)


def test_pack_fp8_layout_and_twin():
    """A block is the float32 scale's 4 little-endian bytes, then the 32 codes as stored;
    per-tensor, per-channel and 128 x 128 block scales (float32, bfloat16, float16) become one
    scale per block, exactly: the twin's values are codes times scales in float64."""
    codes = fp8_codes(130, 256, seed=3)
    for block, dtype in (((130, 256), torch.bfloat16), ((1, 256), torch.float16),
                         ((128, 128), torch.float32), ((1, 64), torch.bfloat16)):
        grid = (-(-130 // block[0]), -(-256 // block[1]))
        scales = (0.01 + torch.rand(grid)).to(dtype)
        weight = pack_fp8(codes, scales, block)
        assert weight.weight_type == FP8 and weight.shape == (130, 256)
        blocks = weight.data.view(130, 8, 36)
        per_value = (scales.double().repeat_interleave(block[0], 0)[:130]
                     .repeat_interleave(block[1], 1))
        assert torch.equal(blocks[..., 4:].reshape(130, 256), codes.view(torch.uint8))
        assert torch.equal(blocks[..., :4].contiguous().view(torch.float32).double(),
                           per_value[:, ::32].unsqueeze(-1))
        assert torch.equal(reference.dequantize(weight.data, FP8), codes.double() * per_value)
    assert ops.block_format(FP8) == ("FP8_E4M3", 32, 36)
    data, weight_type = ops.cpu_decode_layout(weight.data, FP8)  # no interleaved layout
    assert data is weight.data and weight_type == FP8


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
def test_dequantize_is_exact(backend):
    """Each value is scale * e4m3(code) rounded once: float32 exactly (the float64 product of
    a 4-bit and a 24-bit significand, rounded), bfloat16 and float16 rounded from it."""
    weight, values = fp8_weight(37, 3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = backend.ops.dequantize(weight.to(backend.device), FP8, dtype).cpu()
        assert got.dtype == dtype and torch.equal(got, values.float().to(dtype))


# (activation rows, (weight rows, blocks per row)): decode rows on both sides of the tiles
# (AVX2: 2 activation rows and 1 weight row; AVX-512: 2 and 4; odd and even block counts for
# the two accumulators), the CPU's and CUDA's switch to the dequantize + GEMM path, GEMM tails.
CASES = [(1, (7, 3)), (2, (7, 3)), (3, (9, 4)), (1, (1, 1)), (5, (64, 2)), (8, (13, 5)),
         (9, (7, 3)), (32, (7, 3)), (33, (7, 3)), (40, (130, 1)), (70, (33, 9))]


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1][0]}x{c[1][1]}")
def test_fp8_linear_float32(case, backend):
    rows, (out, blocks) = case
    weight, values = fp8_weight(out, blocks, seed=rows)
    x = torch.randn(rows, blocks * 32) * 3
    x[:, 0] = 40.0  # an outlier
    bias = torch.randn(out)
    got = backend.ops.quantized_linear(x.to(backend.device), weight.to(backend.device), FP8,
                                       bias.to(backend.device)).cpu()
    expected = reference.quantized_linear(x, weight, FP8, bias)
    assert torch.equal(expected, x.double() @ values.T + bias.double())
    assert got.shape == (rows, out) and got.dtype == torch.float32
    bound = summation_bound(x, values) + bfloat16_gemm_bound(backend.name, rows, x, values)
    err = (got.double() - expected).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound[err.argmax()]}"


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_low_precision(rows, dtype, backend):
    weight, values = fp8_weight(48, 8, seed=rows, block=(16, 64))
    x, bias = torch.randn(rows, 256, dtype=dtype), torch.randn(48, dtype=dtype)
    got = backend.ops.quantized_linear(x.to(backend.device), weight.to(backend.device), FP8,
                                       bias.to(backend.device)).cpu()
    expected = reference.quantized_linear(x, weight, FP8, bias)
    assert got.dtype == dtype
    if backend.name == "composite" or (backend.name in ("cuda", "cuda_sim")
                                       and rows > CUDA_GEMV_ROWS):
        # The weight rounded to x's dtype for a matmul in it: flash-attention's rule.
        plain = torch.nn.functional.linear(x, values.to(dtype), bias)
        assert_within_twice_plain_error(got.double(), plain.double(), expected)
    else:  # exact weights, float32 sums, one rounding to dtype
        bound = (summation_bound(x, values) + expected.abs() * 2**-7
                 + bfloat16_gemm_bound(backend.name, rows, x, values))
        assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
def test_a_decode_row_does_not_depend_on_the_others(backend):
    """On the decode path a row's result is bitwise the same alone or in any batch."""
    if backend.name == "composite":
        pytest.skip("ATen's matmul promises no batch invariance")
    weight, _ = fp8_weight(9, 16)
    weight = weight.to(backend.device)
    x = torch.randn(16, 512, device=backend.device)
    batches = (2, 3, 7, 16) if backend.name.startswith("cpu") else (2, 3, CUDA_GEMV_ROWS)
    alone = torch.cat([backend.ops.quantized_linear(x[i:i + 1], weight, FP8) for i in range(16)])
    for batch in batches:
        together = torch.cat([backend.ops.quantized_linear(x[i:i + batch], weight, FP8)
                              for i in range(0, 16, batch)])
        assert torch.equal(together, alone), batch


@pytest.mark.parametrize("isa", _C.cpu_isas())
def test_a_prefill_row_does_not_depend_on_the_others(isa):
    """Past the decode rows, the float32 GEMM's rows too are bitwise the same in any batch."""
    if isa_takes_bfloat16_gemm(isa, byte_activations=False):
        pytest.skip(f"{isa}'s prefill rows take oneDNN's bfloat16 GEMM, whose blocking depends "
                    "on the batch")
    assert_prefill_rows_independent(fp8_weight(70, 16)[0], FP8, isa)


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@pytest.mark.parametrize("rows", [3, 20])
def test_strided_inputs_and_a_nan_activation(rows, backend):
    """A weight whose rows sit inside wider rows at an odd byte offset, x a column slice or
    transposed; a NaN activation makes its row NaN and no other."""
    device = backend.device
    weight, values = fp8_weight(24, 8)
    wide = torch.zeros(24, weight.shape[1] + 5, dtype=torch.uint8, device=device)
    wide[:, 1:weight.shape[1] + 1] = weight.to(device)
    strided = wide[:, 1:weight.shape[1] + 1]
    for x in (torch.randn(rows, 272, device=device)[:, 7:263],
              torch.randn(256, rows, device=device).T):
        got = backend.ops.quantized_linear(x, strided, FP8).cpu()
        expected = reference.quantized_linear(x.cpu(), weight, FP8)
        bound = summation_bound(x.cpu(), values)
        assert ((got.double() - expected).abs() <= bound).all()
    x = torch.randn(rows, 256)
    x[1, 77] = float("nan")
    got = backend.ops.quantized_linear(x.to(device), weight.to(device), FP8).cpu()
    assert got[1].isnan().all() and not got[torch.arange(rows) != 1].isnan().any()


@pytest.mark.cuda_sim
@pytest.mark.cpu_inputs
def test_bad_input(backend):
    op = backend.ops
    weight, _ = fp8_weight(8, 2)
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="weight must be torch.uint8, got torch.float32"):
        op.quantized_linear(x, weight.float(), FP8)
    with pytest.raises(ValueError, match=r"a FP8_E4M3 weight row is whole blocks of 36 bytes "
                                         r"\(32 values\), got rows of 40 bytes"):
        op.quantized_linear(x, weight[:, :40], FP8)
    with pytest.raises(ValueError, match="x has 32 features but the FP8_E4M3 weight's rows "
                                         "hold 64"):
        op.quantized_linear(torch.randn(2, 32), weight, FP8)
    with pytest.raises(ValueError, match="bias has 3 elements but weight has 8"):
        op.quantized_linear(x, weight, FP8, torch.randn(3))
    with pytest.raises(TypeError, match="x must be torch.float32, torch.bfloat16"):
        op.quantized_linear(x.long(), weight, FP8)
    with pytest.raises(ValueError, match=r"Q6_K \(14\), or fastllm's FP8_E4M3 blocks \(2000\), "
                                         "got 2001"):
        op.dequantize(weight, FP8 + 1, torch.float32)


def test_pack_fp8_bad_input():
    """Wrong dtypes are TypeErrors, wrong shapes, blocks whose 32 columns do not share a scale
    and NaN codes ValueErrors, each naming the value."""
    codes, scales = fp8_codes(4, 64, seed=0), torch.ones(1, 1)
    with pytest.raises(TypeError, match="weight must be torch.float8_e4m3fn, got torch.float32"):
        pack_fp8(codes.float(), scales, (4, 64))
    with pytest.raises(TypeError, match="scales must be .* got torch.int32"):
        pack_fp8(codes, scales.int(), (4, 64))
    with pytest.raises(ValueError, match="rows must hold a multiple of 32 values, got 48"):
        pack_fp8(codes[:, :48], scales, (4, 48))
    with pytest.raises(ValueError, match=r"every 32 columns share a scale; got \(1, 16\)"):
        pack_fp8(codes, torch.ones(4, 4), (1, 16))
    with pytest.raises(ValueError, match=r"scales must be \[1, 2\] for a \[4, 64\] weight in "
                                         r"blocks of \(128, 32\), got shape \(1, 1\)"):
        pack_fp8(codes, scales, (128, 32))
    with pytest.raises(ValueError, match=r"weight must be \[rows, cols\], got shape \(256,\)"):
        pack_fp8(codes.reshape(-1), scales, (4, 64))
    nan = codes.view(torch.uint8).clone()
    nan[2, 33] = 0xFF
    with pytest.raises(ValueError, match="weight holds a NaN code at row 2, column 33"):
        pack_fp8(nan.view(torch.float8_e4m3fn), scales, (4, 64))


def test_opcheck(backend):
    weight, _ = fp8_weight(16, 2)
    weight = weight.to(backend.device)
    x = torch.randn(3, 64, device=backend.device)
    torch.library.opcheck(backend.ops.quantized_linear.default, (x, weight, FP8, None))
    torch.library.opcheck(backend.ops.dequantize.default, (weight, FP8, torch.float32))
