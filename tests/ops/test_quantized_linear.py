"""fastllm.ops.quantized_linear and fastllm.ops.dequantize on every backend (the CPU kernels once
per instruction set) against a float64 dequantize + matmul, with weights encoded by the gguf
package (an independent encoder of ggml's block formats) where it can, and dequantized by it.

The product grids are covering arrays (tests/covering.py) over the backend (each CPU instruction
set one), the block format, the row/weight case and the dtype: every pair of values meets in
some case, so each instruction set and backend runs every format, every row case and every dtype
at least once, and each format every row case. Always in: each instruction set with each format
at 3 decode rows (a full 2-row AVX2 tile plus a tail) and at 33 rows (the first past the CPU's
streamed rows: the GEMM path). The simulator runs the tests marked ``cuda_sim`` on its rows of
those arrays (each format and decode case at least once; every format in
test_dequantize_equals_gguf and test_a_row_does_not_depend_on_the_others).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import covering
import gguf
import numpy as np
import pytest
import torch

from conftest import assert_within_twice_plain_error, cpu_isa
from fastllm import _C, ops
from fastllm.ops import reference

TYPES = {name: type_id for type_id, (name, _, _) in ops.BLOCK_FORMATS.items()}
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}  # gguf-py dequantizes these, but has no quantizer for them
# Each fp16 field of a K-quant block: d (and dmin) lead Q4_K/Q5_K blocks, d ends Q6_K's.
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
CUDA_GEMV_ROWS = 8  # the most rows CUDA's GEMV takes (kMaxGemvRows, quantized_kernels.cuh)


def quantized_weight(out: int, blocks: int, weight_type: int, seed: int = 0) -> torch.Tensor:
    """A random weight of ``blocks`` blocks per row: uint8 [out, row bytes].

    Q4_x, Q5_x and Q8_0 go through gguf's own quantizer. A K-quant block is random bytes (any
    bits are a valid block) with finite fp16 scales of either sign, bounded so values are ~0.1.
    """
    name, values, block_bytes = ops.BLOCK_FORMATS[weight_type]
    rng = np.random.default_rng(seed)
    if name not in K_QUANTS:
        w = rng.standard_normal((out, blocks * values)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(weight_type)))
    data = rng.integers(0, 256, (out, blocks, block_bytes), dtype=np.uint8)
    bound = 0.1 / (63 * 15) if name != "Q6_K" else 0.1 / (128 * 32)
    for at in FP16_FIELDS[name]:
        scale = rng.uniform(-bound, bound, (out, blocks)).astype(np.float16)
        data[..., at:at + 2] = scale.view(np.uint8).reshape(out, blocks, 2)
    return torch.from_numpy(data.reshape(out, -1))


def in_features(weight: torch.Tensor, weight_type: int) -> int:
    _, values, block_bytes = ops.BLOCK_FORMATS[weight_type]
    return weight.shape[1] // block_bytes * values


def activation_error_bound(x: torch.Tensor, weight: torch.Tensor, weight_type: int,
                           backend_name: str) -> torch.Tensor:
    """The most the kernel may differ from exact float64: its activation blocks round each value
    by at most half a step, plus float32 summation. The step is block amax / 32639 (the int16
    range the kernels split into two signed bytes), but for the CPU's Q4_0 and K-quant
    kernels, which take bytes as llama.cpp does: amax / 127."""
    w = reference.dequantize(weight, weight_type).abs()  # [out, in]
    xd = x.double()
    byte_activations = (backend_name.startswith("cpu")
                        and ops.BLOCK_FORMATS[weight_type][0] in K_QUANTS | {"Q4_0"})
    levels = 127 if byte_activations else 32639
    step = xd.abs().reshape(x.shape[0], -1, 32).amax(-1) / levels  # [rows, blocks]
    per_value = step.repeat_interleave(32, dim=1) / 2  # [rows, in]
    return per_value @ w.T + 1e-5 * (xd.abs() @ w.T) + 1e-6


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf(type_name, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(37, 3, weight_type)
    expected = torch.from_numpy(gguf.quants.dequantize(weight.numpy(),
                                                       gguf.GGMLQuantizationType(weight_type)))
    got = backend.ops.dequantize(weight.to(backend.device), weight_type, torch.float32).cpu()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(reference.dequantize(weight, weight_type), expected.double())
    for dtype in (torch.bfloat16, torch.float16):
        low = backend.ops.dequantize(weight.to(backend.device), weight_type, dtype).cpu()
        assert torch.equal(low, expected.to(dtype))


# Rows past this take the CPU's GEMM path (kMaxStreamRows, quantized_cpu.cpp): the byte GEMM
# for Q4_0 and the K-quants (AVX2, AVX-512), oneDNN's bfloat16 GEMM (AMX; AVX-512 on a CPU
# with AVX512-BF16 for the other types), else the ISA's float32 GEMM.
CPU_STREAM_ROWS = 32
CPU_HAS_AVX512_BF16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()


def isa_takes_bfloat16_gemm(isa: str, byte_activations: bool) -> bool:
    """Whether the CPU ISA's prefill rows go through oneDNN's bfloat16 GEMM (not for the types
    whose GEMM takes byte activations)."""
    return isa == "amx" or (isa == "avx512" and CPU_HAS_AVX512_BF16 and not byte_activations)


def takes_bfloat16_gemm(backend_name: str, weight_type: int) -> bool:
    """Whether the CPU backend's prefill rows of this type go through oneDNN's bfloat16 GEMM."""
    if not backend_name.startswith("cpu"):
        return False
    isa = backend_name.removeprefix("cpu-") if "-" in backend_name else _C.cpu_isa()
    return isa_takes_bfloat16_gemm(isa, ops.BLOCK_FORMATS[weight_type][0] in K_QUANTS | {"Q4_0"})


def assert_prefill_rows_independent(weight: torch.Tensor, weight_type: int, isa: str) -> None:
    """Past the decode rows, each row's result is bitwise the same in any batch that takes it
    (the CPU ISA's float32 or byte GEMM: its sums run over k in order whatever its tile)."""
    _, values, block_bytes = ops.block_format(weight_type)
    x = torch.randn(90, weight.shape[-1] // block_bytes * values)
    with cpu_isa(isa):
        together = ops.quantized_linear(x, weight, weight_type)
        for first, rows in ((0, 33), (7, 40), (45, 45)):
            part = ops.quantized_linear(x[first:first + rows], weight, weight_type)
            assert torch.equal(part, together[first:first + rows]), (first, rows)


def gemm_error_bound(backend, x: torch.Tensor, weight: torch.Tensor,
                     weight_type: int) -> torch.Tensor | float:
    """What the CPU's bfloat16 GEMM adds to the error (the float32 and byte GEMMs stay well
    within the activations' bound): x and the dequantized weights rounded to bfloat16 (2^-9
    each) and the result too (2^-9 of at most the sum of |x w|): 2^-7 of that sum."""
    if not takes_bfloat16_gemm(backend.name, weight_type) or x.shape[0] <= CPU_STREAM_ROWS:
        return 0.0
    return 2**-7 * (x.double().abs() @ reference.dequantize(weight, weight_type).abs().T)


def check_quantized_linear(backend, type_name: str, rows: int, shape: tuple[int, int]) -> None:
    """x [rows, in] (with an outlier) times a random weight [out, blocks of in] plus a bias,
    within the kernel's error bound of the float64 reference."""
    weight_type = TYPES[type_name]
    out, blocks = shape
    weight = quantized_weight(out, blocks, weight_type, seed=rows)
    x = torch.randn(rows, in_features(weight, weight_type)) * 3
    x[:, 0] = 40.0  # an outlier: its block's other values lose precision, as real activations do
    bias = torch.randn(out)
    got = backend.ops.quantized_linear(x.to(backend.device), weight.to(backend.device),
                                       weight_type, bias.to(backend.device)).cpu()
    expected = reference.quantized_linear(x, weight, weight_type, bias)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    bound = (activation_error_bound(x, weight, weight_type, backend.name)
             + gemm_error_bound(backend, x, weight, weight_type))
    err = (got.double() - expected).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound[err.argmax()]}"


def case_ids(cases: list) -> list[str]:
    return [f"{rows}x{out}x{blocks}" for rows, (out, blocks) in cases]


# (activation rows, (weight rows, blocks per row)) on either side of each kernel's switch:
# decode rows up to 32 on the CPU (AVX-512 tiles 4 rows and AVX2 2: full tiles and every
# tail; weight rows in tiles of 4 and alone), up to 8 in CUDA's GEMV; past them tiles of 128
# dequantized weight rows (each ISA's dequantization: test_dequantize_equals_gguf) for a GEMM,
# on the CPU panels of 4-32 weight rows in groups of 4, in tiles of 4-12 activation rows and
# blocks of 128 values of k (the byte GEMM: panels of 16 weight rows and tiles of 2 activation
# rows with AVX2, 32 and 4 with AVX-512): full ones and tails of each. The CPU's ISAs and the simulator run DECODE_CASES.
DECODE_CASES = [*((rows, (7, 3)) for rows in (1, 2, 3, 8, 9)), (1, (1, 1)), (3, (1, 1)),
                (4, (64, 2))]
MORE_CASES = [(5, (7, 3)), (17, (7, 3)), (32, (7, 3)), (33, (7, 3)), (33, (1, 1)),
              (40, (130, 1)), (512, (7, 1)), (59, (161, 9)), (38, (300, 2))]


CASE_IDS = {"case": lambda case: case_ids([case])[0]}


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@covering.grid(type_name=list(TYPES), case=DECODE_CASES, ids=CASE_IDS,
               edges=[dict(backend="cpu", type_name=type_name, case=(3, (7, 3)))
                      for type_name in TYPES])
def test_quantized_linear_float32(type_name, case, backend):
    rows, shape = case
    check_quantized_linear(backend, type_name, rows, shape)


@pytest.mark.cpu_isas
@covering.grid(type_name=list(TYPES), case=MORE_CASES, ids=CASE_IDS,
               edges=[dict(backend="cpu", type_name=type_name, case=(33, (7, 3)))
                      for type_name in TYPES])
def test_quantized_linear_float32_more_rows(type_name, case, backend):
    rows, shape = case
    check_quantized_linear(backend, type_name, rows, shape)


@pytest.mark.cuda_sim
@covering.grid(type_name=["Q4_0", "Q5_1", "Q4_K", "Q6_K"], rows=[1, 5, 40],
               dtype=[torch.bfloat16, torch.float16])
def test_quantized_linear_low_precision(type_name, rows, dtype, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(48, 256 // ops.BLOCK_FORMATS[weight_type][1], weight_type, seed=rows)
    x, bias = torch.randn(rows, 256, dtype=dtype), torch.randn(48, dtype=dtype)
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
        bound = (activation_error_bound(x.float(), weight, weight_type, backend.name)
                 + expected.abs() * 2**-7
                 + gemm_error_bound(backend, x, weight, weight_type))
        assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_does_not_depend_on_the_others(type_name, backend):
    """On the decode path a row's result is bitwise the same alone or in any batch."""
    if backend.name == "composite":
        pytest.skip("ATen's matmul promises no batch invariance")
    weight_type = TYPES[type_name]
    weight = quantized_weight(9, 512 // ops.BLOCK_FORMATS[weight_type][1], weight_type)
    weight = weight.to(backend.device)
    # float32: a low-precision output would round small differences away.
    x = torch.randn(16, 512, device=backend.device)
    batches = (2, 3, 7, 16) if backend.name.startswith("cpu") else (2, 3, CUDA_GEMV_ROWS)

    def linear(rows):
        return backend.ops.quantized_linear(rows, weight, weight_type)

    alone = torch.cat([linear(x[i:i + 1]) for i in range(16)])
    for batch in batches:
        together = torch.cat([linear(x[i:i + batch]) for i in range(0, 16, batch)])
        assert torch.equal(together, alone), batch


@pytest.mark.parametrize("isa", _C.cpu_isas())
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_prefill_row_does_not_depend_on_the_others(type_name, isa):
    """On the CPU's float32 and byte GEMM paths too (past CPU_STREAM_ROWS rows) a row's result
    is bitwise the same in any batch that takes it: its sums run over k in order whatever its
    tile."""
    weight_type = TYPES[type_name]
    if takes_bfloat16_gemm(f"cpu-{isa}", weight_type):
        pytest.skip(f"{isa}'s {type_name} prefill rows take oneDNN's bfloat16 GEMM, whose "
                    "blocking depends on the batch (ops.batch_invariant() covers that path)")
    assert_prefill_rows_independent(
        quantized_weight(70, 512 // ops.BLOCK_FORMATS[weight_type][1], weight_type), weight_type,
        isa)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_K"])
@pytest.mark.parametrize("rows", [3, 12, 20])
def test_strided_inputs(type_name, rows, backend):
    device = backend.device
    weight_type = TYPES[type_name]
    weight = quantized_weight(24, 256 // ops.BLOCK_FORMATS[weight_type][1], weight_type)
    # The weight's rows inside wider rows, at an odd byte offset.
    row_bytes = weight.shape[1]
    wide = torch.zeros(24, row_bytes + 5, dtype=torch.uint8, device=device)
    wide[:, 1:row_bytes + 1] = weight.to(device)
    strided_weight = wide[:, 1:row_bytes + 1]
    bias = torch.randn(24)
    # x as a column slice of wider rows, and stored transposed.
    for x in (torch.randn(rows, 272, device=device)[:, 7:263],
              torch.randn(256, rows, device=device).T):
        got = backend.ops.quantized_linear(x, strided_weight, weight_type, bias.to(device)).cpu()
        expected = reference.quantized_linear(x.cpu(), weight, weight_type, bias)
        bound = (activation_error_bound(x.cpu(), weight, weight_type, backend.name)
                 + gemm_error_bound(backend, x.cpu(), weight, weight_type))
        assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@pytest.mark.parametrize("type_name", ["Q4_0", "Q6_K"])
@pytest.mark.parametrize("rows", [3, 20])
def test_a_nan_activation_makes_its_row_nan(type_name, rows, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(5, 256 // ops.BLOCK_FORMATS[weight_type][1], weight_type)
    x = torch.randn(rows, 256)
    x[1, 77] = float("nan")
    got = backend.ops.quantized_linear(x.to(backend.device), weight.to(backend.device),
                                       weight_type).cpu()
    assert got[1].isnan().all() and not got[torch.arange(rows) != 1].isnan().any()


@pytest.mark.cuda_sim
def test_empty_inputs(backend):
    device = backend.device
    weight = quantized_weight(8, 2, 2).to(device)
    bias = torch.randn(8, device=device)
    for rows in (0, 3, 12, 20):
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
    weight = quantized_weight(8, 2, 2)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight_type must be a ggml type id .*Q6_K \(14\), "
                                         r"or fastllm's FP8_E4M3 blocks \(2000\), got 10"):
        op.quantized_linear(x, weight, 10)  # Q2_K
    with pytest.raises(TypeError, match="weight must be torch.uint8, got torch.float32"):
        op.quantized_linear(x, weight.float(), 2)
    with pytest.raises(ValueError, match=r"whole blocks of 18 bytes \(32 values\), got rows of "
                                         "35 bytes"):
        op.quantized_linear(x, weight[:, :35], 2)
    k_quant = quantized_weight(8, 2, TYPES["Q4_K"])
    with pytest.raises(ValueError, match=r"a Q4_K weight row is whole blocks of 144 bytes \(256 "
                                         r"values\), got rows of 216 bytes"):
        op.dequantize(k_quant[:, :216], TYPES["Q4_K"], torch.float32)
    with pytest.raises(ValueError, match="x has 32 features but the Q4_0 weight's rows hold 64"):
        op.quantized_linear(torch.randn(2, 32), weight, 2)
    with pytest.raises(ValueError, match="x has 256 features but the Q6_K weight's rows hold 512"):
        op.quantized_linear(torch.randn(2, 256), quantized_weight(3, 2, TYPES["Q6_K"]),
                            TYPES["Q6_K"])
    with pytest.raises(ValueError, match="bias has 3 elements but weight has 8"):
        op.quantized_linear(x, weight, 2, torch.randn(3))
    with pytest.raises(TypeError, match="x must be torch.float32, torch.bfloat16"):
        op.quantized_linear(x.long(), weight, 2)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_opcheck(type_name, backend):
    weight_type = TYPES[type_name]
    weight = quantized_weight(16, 2, weight_type).to(backend.device)
    x = torch.randn(3, in_features(weight, weight_type), device=backend.device)
    torch.library.opcheck(backend.ops.quantized_linear.default, (x, weight, weight_type, None))
    torch.library.opcheck(backend.ops.dequantize.default, (weight, weight_type, torch.float32))


def test_cpu_isa_choice():
    """The widest instruction set is the default; set_cpu_isa switches and refuses what the CPU
    lacks; FASTLLM_CPU_ISA is read at first use (a fresh process) and a bad value is refused."""
    assert _C.cpu_isas()[-1] == "scalar" and _C.cpu_isa() in _C.cpu_isas()
    with pytest.raises(ValueError, match="unknown CPU instruction set 'sse9'"):
        _C.set_cpu_isa("sse9")
    previous = _C.set_cpu_isa("scalar")
    try:
        assert _C.cpu_isa() == "scalar"
    finally:
        _C.set_cpu_isa(previous)
    script = """
import os, torch
from fastllm import _C, ops
try:
    ops.quantized_linear(torch.randn(1, 32), torch.zeros(1, 34, dtype=torch.uint8), 8)
except ValueError as e:
    print(e)
os.environ["FASTLLM_CPU_ISA"] = "scalar"
print(_C.cpu_isa())
"""
    env = {**os.environ, "FASTLLM_CPU_ISA": "avx9"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["unknown CPU instruction set 'avx9'; expected amx, avx512, avx2 or scalar",
                   "scalar"]


@pytest.mark.parametrize("weight_type", [TYPES["Q4_0"], TYPES["Q8_0"], TYPES["Q4_K"],
                                         TYPES["Q6_K"]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_rows_equal_each_row_alone(weight_type, dtype):
    """Under ops.batch_invariant() a row's result is bit for bit its result alone, past the row
    count where the op otherwise switches to the dequantize + GEMM path; still within the
    kernel's error bound."""
    weight = quantized_weight(96, 8, weight_type)
    x = torch.randn(40, in_features(weight, weight_type)).to(dtype)
    with ops.batch_invariant():
        batch = ops.quantized_linear(x, weight, weight_type)
        alone = torch.cat([ops.quantized_linear(x[i:i + 1], weight, weight_type)
                           for i in range(x.shape[0])])
    assert torch.equal(batch, alone)
    exact = x.double() @ reference.dequantize(weight, weight_type).T
    bound = activation_error_bound(x.float(), weight, weight_type, "cpu")
    if dtype == torch.bfloat16:  # the result's own rounding
        bound = bound + exact.abs() * 2.0 ** -8
    assert ((batch.double() - exact).abs() <= bound).all()


# The CPU's interleaved layouts (ops.cpu_decode_layout): 48 rows, three groups of 16, so each
# thread's task starts on a group; 576 values (18 blocks of 32) or 512 (the K-quants' 2).
INTERLEAVED_ROWS = 48
INTERLEAVED = {"Q4_0": (ops.INTERLEAVED_Q4_0, 18), "Q4_1": (ops.INTERLEAVED_Q4_1, 18),
               "Q5_0": (ops.INTERLEAVED_Q5_0, 18), "Q8_0": (ops.INTERLEAVED_Q8_0, 18),
               "Q4_K": (ops.INTERLEAVED_Q4_K, 2), "Q6_K": (ops.INTERLEAVED_Q6_K, 2)}


@covering.grid(isa=_C.cpu_isas(), rows=[1, 3, 4, 5, 9, 32, 33, 70],
               dtype=[torch.float32, torch.bfloat16], type_name=list(INTERLEAVED))
def test_interleaved_weight_is_the_same_weight(type_name, rows, dtype, isa):
    """A weight in the AVX-512 decode kernels' layout gives the plain weight's products within
    the kernel's error bound on every path (its own kernel for decode rows where the ISA has it,
    else the rows put back in order for the ISA's kernels: then bit for bit the plain weight's
    result), and dequantizes to the same values."""
    weight_type = TYPES[type_name]
    interleaved_type, blocks = INTERLEAVED[type_name]
    weight = quantized_weight(INTERLEAVED_ROWS, blocks, weight_type, seed=rows)
    interleaved = _C.interleave_rows(weight, weight_type)
    assert interleaved.shape == weight.shape and not torch.equal(interleaved, weight)
    x = (torch.randn(rows, in_features(weight, weight_type)) * 3).to(dtype)
    bias = torch.randn(INTERLEAVED_ROWS).to(dtype)
    with cpu_isa(isa):
        got = ops.quantized_linear(x, interleaved, interleaved_type, bias)
        plain = ops.quantized_linear(x, weight, weight_type, bias)
        for out_dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(ops.dequantize(interleaved, interleaved_type, out_dtype),
                               ops.dequantize(weight, weight_type, out_dtype))
        own_kernel = weight_type in _C.cpu_interleaved_types()
    assert got.shape == plain.shape and got.dtype == dtype
    if not own_kernel or rows > CPU_STREAM_ROWS:
        assert torch.equal(got, plain)
    exact = reference.quantized_linear(x.float(), weight, weight_type, bias.float())
    bound = (activation_error_bound(x.float(), weight, weight_type, "cpu")
             + gemm_error_bound(SimpleNamespace(name=f"cpu-{isa}"), x.float(), weight,
                                weight_type))
    if dtype == torch.bfloat16:  # the result's own rounding
        bound = bound + exact.abs() * 2.0 ** -8
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound[err.argmax()]}"


@pytest.mark.parametrize("isa", _C.cpu_isas())
@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_interleaved_row_does_not_depend_on_the_others(type_name, isa):
    """The interleaved kernels' decode rows too are bitwise the same alone or in any batch."""
    weight_type = TYPES[type_name]
    interleaved_type, _ = INTERLEAVED[type_name]
    weight = quantized_weight(INTERLEAVED_ROWS, 512 // ops.BLOCK_FORMATS[weight_type][1],
                              weight_type)
    weight = _C.interleave_rows(weight, weight_type)
    x = torch.randn(16, 512)
    with cpu_isa(isa):
        alone = torch.cat([ops.quantized_linear(x[i:i + 1], weight, interleaved_type)
                           for i in range(16)])
        for batch in (2, 3, 7, 16):
            together = torch.cat([ops.quantized_linear(x[i:i + batch], weight, interleaved_type)
                                  for i in range(0, 16, batch)])
            assert torch.equal(together, alone), batch


def test_cpu_decode_layout():
    """Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K with whole groups of 16 rows are interleaved where
    the CPU kernels run AVX-512, Q4_0, Q4_1, Q5_0 and Q8_0 where they run AVX2; anything else
    (another type, other row counts, another instruction set) is kept as it is."""
    own_kernels = {"amx": set(INTERLEAVED), "avx512": set(INTERLEAVED),
                   "avx2": {"Q4_0", "Q4_1", "Q5_0", "Q8_0"}, "scalar": set()}
    for isa in _C.cpu_isas():
        with cpu_isa(isa):
            assert _C.cpu_interleaved_types() == [TYPES[name] for name in INTERLEAVED
                                                  if name in own_kernels[isa]]
    for type_name, (interleaved_type, blocks) in INTERLEAVED.items():
        weight_type = TYPES[type_name]
        weight = quantized_weight(INTERLEAVED_ROWS, blocks, weight_type)
        for isa in _C.cpu_isas():
            with cpu_isa(isa):
                data, layout_type = ops.cpu_decode_layout(weight, weight_type)
                if type_name in own_kernels[isa]:
                    assert layout_type == interleaved_type
                    assert torch.equal(data, _C.interleave_rows(weight, weight_type))
                else:
                    assert data is weight and layout_type == weight_type
                for kept in ((weight[:40], weight_type),
                             (quantized_weight(16, 2, TYPES["Q5_K"]), TYPES["Q5_K"])):
                    data, layout_type = ops.cpu_decode_layout(*kept)
                    assert data is kept[0] and layout_type == kept[1]
        assert ops.block_format(interleaved_type) == (
            f"{type_name} interleaved by 16", *ops.BLOCK_FORMATS[weight_type][1:])


@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_quantized_rows(type_name):
    """Looked-up rows of an interleaved weight are the ggml blocks' rows, in the indices' shape
    (repeats, the first and last group's rows); a ggml type's are ``weight[rows]``."""
    weight_type = TYPES[type_name]
    interleaved_type, blocks = INTERLEAVED[type_name]
    weight = quantized_weight(INTERLEAVED_ROWS, blocks, weight_type)
    interleaved = _C.interleave_rows(weight, weight_type)
    for rows in (torch.tensor([47, 0, 5, 5, 16, 31]), torch.tensor([[3, 40], [17, 3]]),
                 torch.tensor([], dtype=torch.long), torch.tensor([7], dtype=torch.int32)):
        got, got_type = ops.quantized_rows(interleaved, interleaved_type, rows)
        assert got_type == weight_type and torch.equal(got, weight[rows.long()])
        plain, plain_type = ops.quantized_rows(weight, weight_type, rows)
        assert plain_type == weight_type and torch.equal(plain, weight[rows])


def test_quantized_rows_bad_input():
    """A row out of range is an IndexError naming it; float indices a TypeError; a ggml type or
    a weight that is not whole groups a ValueError."""
    q8_0 = TYPES["Q8_0"]
    weight = _C.interleave_rows(quantized_weight(32, 2, q8_0), q8_0)
    for row in (32, -1):
        with pytest.raises(IndexError, match=f"row {row} is out of range for a weight of 32 rows"):
            ops.quantized_rows(weight, ops.INTERLEAVED_Q8_0, torch.tensor([0, row]))
    with pytest.raises(TypeError, match="rows must be integers, got torch.float32"):
        ops.quantized_rows(weight, ops.INTERLEAVED_Q8_0, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"weight_type must be an interleaved type, Q4_0 \(1002\), "
                                         r".* or Q6_K \(1014\); got 8"):
        _C.deinterleave_rows(weight, q8_0, torch.tensor([1]))
    with pytest.raises(ValueError, match="an interleaved Q8_0 weight has whole groups of 16 rows"):
        ops.quantized_rows(weight[:24], ops.INTERLEAVED_Q8_0, torch.tensor([1]))


@pytest.mark.cpu_inputs
def test_interleaved_weight_bad_input(backend):
    """An interleaved type on a backend without it, with rows that are not whole groups, or not
    contiguous, is a ValueError naming the problem; so is interleaving another format."""
    q4_k = TYPES["Q4_K"]
    weight = _C.interleave_rows(quantized_weight(32, 1, q4_k), q4_k)
    x = torch.randn(2, 256)
    if backend.name != "cpu":
        with pytest.raises(ValueError, match=r"weight_type 1012 \(Q4_K with rows interleaved by "
                                             r"16\) is the CPU's decode layout; on cpu pass the "
                                             r"weight's ggml blocks \(Q4_K, 12\)"):
            backend.ops.quantized_linear(x, weight, ops.INTERLEAVED_Q4_K)
        return
    with pytest.raises(ValueError, match="an interleaved Q4_K weight has whole groups of 16 rows, "
                                         "got 24"):
        backend.ops.quantized_linear(x, weight[:24], ops.INTERLEAVED_Q4_K)
    with pytest.raises(ValueError, match="an interleaved Q4_K weight must be contiguous"):
        backend.ops.dequantize(weight[:, :72], ops.INTERLEAVED_Q4_K, torch.float32)
    with pytest.raises(ValueError, match="interleaving takes whole groups of 16 rows, got 20"):
        _C.interleave_rows(quantized_weight(20, 2, TYPES["Q4_0"]), TYPES["Q4_0"])
    with pytest.raises(ValueError, match=r"interleaving takes Q4_0 \(2\), Q4_1 \(3\), Q5_0 \(6\), "
                                         r"Q8_0 \(8\), Q4_K \(12\) or Q6_K \(14\) blocks, got "
                                         "weight_type 13"):
        _C.interleave_rows(quantized_weight(16, 1, TYPES["Q5_K"]), TYPES["Q5_K"])
    with pytest.raises(ValueError, match=r"got 1001 \(the CPU also takes Q4_0 \(1002\), Q4_1 "
                                         r"\(1003\), Q5_0 \(1006\), Q8_0 \(1008\), Q4_K \(1012\) or "
                                         r"Q6_K \(1014\) with rows interleaved by 16\)"):
        backend.ops.quantized_linear(x, weight, 1001)
