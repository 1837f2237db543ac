"""fastllm.ops.moe on every backend (conftest.py) against its float64 twin (reference.moe: HF's
eager Qwen3MoeSparseMoeBlock), against HF's own Qwen3-MoE and Mixtral blocks, and on the CPU
against the composition of fastllm's own ops that it runs.

Token counts cover decode (1-3 tokens: every expert streams its weights on the CPU, the GEMV
path on CUDA) and prefill (16, 61, 512: on the CPU experts past the few-row kernels' limits run
GEMMs, on CUDA the pairs are grouped by expert); experts E=8 top 2 (Mixtral's), E=16 top 4 and
E=4 top 4 (every expert for every token), renormalized or not. float32 is held tight to the
float64 result; bfloat16 / float16 to flash-attention's 2x rule against the plain composition
(the eager block in that dtype, whose roundings the op follows).

The grids are covering arrays (tests/covering.py) over the backend and the case's parameters:
every pair of values meets in some case, so each backend runs every token count, dtype, expert
layout, format pair and size at least once. Always in: on the CPU each dtype at 3 tokens (the
most that stream every expert's weights) and at 16 (past the few-row kernels). The simulator
runs the tests marked ``cuda_sim`` on its rows of those arrays: each of its GEMV and grouped
cases, each dtype and each format pair at least once.
"""

from __future__ import annotations

import covering
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_within_twice_plain_error
from test_quantized_linear import quantized_weight

from fastllm import ops
from fastllm.models.quantized import pack_fp8
from fastllm.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TYPES = {name: type_id for type_id, (name, _, _) in ops.BLOCK_FORMATS.items()}
TYPES["FP8_E4M3"] = ops.FP8_E4M3
F32_TOL = 2e-5
# (num_experts, top_k, renormalize)
EXPERTS = [(8, 2, True), (8, 2, False), (16, 4, True), (16, 4, False), (4, 4, True),
           (4, 4, False)]
TOKENS = [1, 2, 3, 16, 61, 512]


def float_experts(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] and down [E, H, I], scaled so that every layer's output is O(1)."""
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, intermediate) / intermediate**0.5
    return gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype)


def quantized_experts(num_experts: int, rows: int, columns: int, type_name: str | None,
                      dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, int | None]:
    """An expert projection [E, rows, columns]: blocks of `type_name` (uint8 [E, rows, row
    bytes]: a ggml format's, or FP8_E4M3's), or floats of `dtype` where it is None."""
    if type_name is None:
        return (torch.randn(num_experts, rows, columns) / columns**0.5).to(dtype), None
    weight_type = TYPES[type_name]
    if weight_type == ops.FP8_E4M3:  # codes of spread 8, a scale per row: values ~ N(0, 1/cols)
        generator = torch.Generator().manual_seed(seed)
        codes = (8 * torch.randn(num_experts * rows, columns, generator=generator))
        scales = (0.5 + torch.rand(num_experts * rows, 1, generator=generator)) / (8 * columns**0.5)
        weight = pack_fp8(codes.to(torch.float8_e4m3fn), scales, (1, columns)).data
        return weight.view(num_experts, rows, -1), weight_type
    blocks = columns // ops.BLOCK_FORMATS[weight_type][1]
    weight = quantized_weight(num_experts * rows, blocks, weight_type, seed=seed)
    if type_name not in ("Q4_K", "Q5_K", "Q6_K"):  # gguf's values are ~1: scale like floats
        weight = weight.view(num_experts * rows, blocks, -1)
        d = weight[..., :2].contiguous().view(torch.float16) / columns**0.5
        weight[..., :2] = d.view(torch.uint8)
        if type_name in ("Q4_1", "Q5_1"):  # the minimum too
            m = weight[..., 2:4].contiguous().view(torch.float16) / columns**0.5
            weight[..., 2:4] = m.view(torch.uint8)
    return weight.reshape(num_experts, rows, -1), weight_type


def judge(got: torch.Tensor, plain, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 tight against float64; bfloat16/float16 flash-attention's 2x rule, where
    ``plain()`` is the reference in the low-precision dtype."""
    assert got.dtype == dtype and got.shape == expected.shape
    assert not got.isnan().any(), "NaN in the output"
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu().double(), expected, atol=F32_TOL, rtol=F32_TOL)
    else:
        assert_within_twice_plain_error(got.cpu().double(), plain().cpu().double(), expected)


def check_float_experts(backend, tokens, dtype, num_experts, top_k, renormalize, hidden=64,
                        intermediate=32) -> None:
    device = backend.device
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    logits = torch.randn(tokens, num_experts, device=device)
    gate_up, down = float_experts(num_experts, hidden, intermediate, dtype, device)
    inputs = [t.clone() for t in (x, logits, gate_up, down)]
    got = backend.ops.moe(x, logits, gate_up, down, top_k, renormalize)
    assert all(torch.equal(t, saved) for t, saved in zip((x, logits, gate_up, down), inputs)), \
        "an input was written"
    expected = reference.moe(x.cpu().double(), logits.cpu(), gate_up.cpu().double(),
                             down.cpu().double(), top_k, renormalize)
    judge(got, lambda: reference.moe(x, logits, gate_up, down, top_k, renormalize), expected,
          dtype)


@covering.grid(tokens=TOKENS, dtype=DTYPES, experts=EXPERTS,
               edges=[dict(backend="cpu", tokens=tokens, dtype=dtype)
                      for tokens in (3, 16) for dtype in DTYPES])
def test_matches_float64(backend, tokens, dtype, experts):
    check_float_experts(backend, tokens, dtype, *experts)


# The simulator's subset: the GEMV path (up to 8 tokens) and the grouped one.
SIM_CASES = [(1, 8, 2, True), (3, 16, 4, False), (8, 4, 4, True), (9, 8, 2, False),
             (61, 16, 4, True)]


@pytest.mark.cuda_sim
@covering.grid(dtype=DTYPES, case=SIM_CASES)
def test_matches_float64_on_every_path(backend, dtype, case):
    tokens, num_experts, top_k, renormalize = case
    check_float_experts(backend, tokens, dtype, num_experts, top_k, renormalize)


@pytest.mark.cuda_sim
@covering.grid(tokens=[2, 40], sizes=[(40, 24), (17, 5), (130, 70)])
def test_odd_sizes(backend, tokens, sizes):
    """Rows shorter than a SIMD vector, with tails, and longer than a warp's stride."""
    hidden, intermediate = sizes
    for dtype in (torch.float32, torch.bfloat16):
        check_float_experts(backend, tokens, dtype, 8, 2, True, hidden, intermediate)


@pytest.mark.cuda_sim
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 61])
def test_16_bit_experts_under_float32(backend, weight_dtype, tokens):
    """A bfloat16 checkpoint run in float32 keeps its experts in 16 bits: the result is the
    float32 block with the upcast weights (exact conversion)."""
    device = backend.device
    x = torch.randn(tokens, 64, device=device)
    logits = torch.randn(tokens, 8, device=device)
    gate_up, down = float_experts(8, 64, 32, weight_dtype, device)
    got = backend.ops.moe(x, logits, gate_up, down, 2, True)
    assert got.dtype == torch.float32
    expected = reference.moe(x.cpu().double(), logits.cpu(), gate_up.cpu().double(),
                             down.cpu().double(), 2, True)
    judge(got, None, expected, torch.float32)
    upcast = backend.ops.moe(x, logits, gate_up.float(), down.float(), 2, True)
    torch.testing.assert_close(got, upcast, atol=1e-6, rtol=1e-6)


def composed_moe(x, logits, gate_up, down, top_k, renormalize, gate_up_type, down_type):
    """What the CPU kernel computes, as a composition of fastllm's ops: HF's routing, then per
    expert (increasing) its tokens' rows through ops.linear / ops.quantized_linear (each picks
    its few-row kernel or its GEMM by the expert's row count, as moe does), ops.silu_and_mul,
    the down projection, and the weighted sum in x's dtype (index_add_, expert after expert)."""
    chosen = torch.softmax(logits, -1, dtype=torch.float32).topk(top_k, -1)
    weights = chosen.values
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(x.dtype)

    def project(rows, w, weight_type, e):
        if weight_type is None:
            return ops.linear(rows, w[e])
        return ops.quantized_linear(rows, w[e], weight_type)

    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tokens, slots = (chosen.indices == e).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        tokens, order = tokens.sort()
        slots = slots[order]
        gated = ops.silu_and_mul(project(x[tokens], gate_up, gate_up_type, e))
        out.index_add_(0, tokens, project(gated, down, down_type, e) * weights[tokens, slots, None])
    return out


# (gate_up format, down format): None is float experts.
FORMAT_PAIRS = [("Q8_0", "Q8_0"), ("Q4_0", "Q6_K"), ("Q4_K", "Q4_1"), ("Q5_K", "Q5_0"),
                ("Q6_K", None), (None, "Q4_K"), ("Q5_1", "Q8_0"), ("FP8_E4M3", "FP8_E4M3"),
                ("Q4_K", "FP8_E4M3")]
QUANTIZED_CASES = [(1, 8, 2), (3, 4, 4), (40, 4, 4)]  # (tokens, num_experts, top_k)
BYTE_ACTIVATIONS = {"Q4_0", "Q4_K", "Q5_K", "Q6_K"}  # the CPU's int8 activations


def check_quantized_experts(backend, gate_up_name, down_name, tokens, dtype, num_experts, top_k):
    hidden = intermediate = 256  # K-quant rows are super-blocks of 256
    x = torch.randn(tokens, hidden).to(dtype)
    logits = torch.randn(tokens, num_experts)
    gate_up, gate_up_type = quantized_experts(num_experts, 2 * intermediate, hidden, gate_up_name,
                                              dtype, seed=tokens)
    down, down_type = quantized_experts(num_experts, hidden, intermediate, down_name, dtype,
                                        seed=tokens + 1)
    types = dict(gate_up_type=gate_up_type, down_type=down_type)
    device = backend.device
    got = backend.ops.moe(x.to(device), logits.to(device), gate_up.to(device), down.to(device),
                          top_k, True, **types).cpu()
    assert got.dtype == dtype and not got.isnan().any()
    expected = reference.moe(x.double(), logits,
                             gate_up if gate_up_type is not None else gate_up.double(),
                             down if down_type is not None else down.double(), top_k, True,
                             **types)
    if backend.name.startswith("cpu"):
        # Exactly the composition of fastllm's ops (the same kernels on the same rows)...
        composed = composed_moe(x, logits, gate_up, down, top_k, True, gate_up_type, down_type)
        assert torch.equal(got, composed)
        # ... whose int16 (int8) activations and bfloat16 GEMM tiles keep it near float64.
        byte = {gate_up_name, down_name} & BYTE_ACTIVATIONS
        scale = expected.abs().max().item()
        bound = (0.05 if byte else 0.01) * scale
        assert (got.double() - expected).abs().max().item() <= bound
    elif dtype == torch.float32:  # exact weights, float32 sums
        torch.testing.assert_close(got.double(), expected, atol=F32_TOL, rtol=F32_TOL)
    else:
        def plain():  # the weights dequantized and rounded to dtype, as the composite does
            return reference.moe(x, logits, gate_up, down, top_k, True, **types)

        assert_within_twice_plain_error(got.double(), plain().double(), expected)


@pytest.mark.cpu_isas
@pytest.mark.cuda_sim
@covering.grid(formats=FORMAT_PAIRS, case=QUANTIZED_CASES,
               edges=[dict(backend=backend, formats=("FP8_E4M3", "FP8_E4M3"), case=case)
                      for backend in ("cpu", "composite", "cuda_sim") for case in QUANTIZED_CASES])
def test_quantized_experts(backend, formats, case):
    """Quantized experts (gate_up and down in different formats, or one of them float), on
    each path: 40 tokens over 4 experts give each expert 40 rows, past the CPU's few-row limit
    of 32 and CUDA's GEMV's 8. FP8 experts run every path on every backend (each CPU
    instruction set's FP8 kernels: float32 activations, unlike the ggml formats)."""
    (gate_up_name, down_name), (tokens, num_experts, top_k) = formats, case
    check_quantized_experts(backend, gate_up_name, down_name, tokens, torch.float32,
                            num_experts, top_k)


@covering.grid(dtype=[torch.bfloat16, torch.float16], tokens=[2, 40],
               formats=[("Q4_K", "Q8_0"), ("Q6_K", "Q4_1"), ("FP8_E4M3", "FP8_E4M3")],
               edges=[dict(backend="cpu", dtype=torch.bfloat16, tokens=tokens,
                           formats=("FP8_E4M3", "FP8_E4M3")) for tokens in (2, 40)])
def test_quantized_experts_low_precision(backend, formats, tokens, dtype):
    check_quantized_experts(backend, *formats, tokens, dtype, 4, 4)


def hf_block(family: str, num_experts: int, top_k: int, renormalize: bool):
    """HF's MoE block of `family` with random weights (hidden 64, intermediate 32)."""
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=num_experts,
                                num_experts_per_tok=top_k, norm_topk_prob=renormalize)
        block = Qwen3MoeSparseMoeBlock(config)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=64, intermediate_size=32,
                               num_local_experts=num_experts, num_experts_per_tok=top_k)
        block = MixtralSparseMoeBlock(config)
    config._experts_implementation = "eager"
    with torch.no_grad():
        for name, parameter in block.named_parameters():
            parameter.normal_(0.0, 0.3 if name.startswith("gate.") else 0.1)
    return block


@covering.grid(tokens=[1, 3, 61, 300],
               block=[("qwen3_moe", 8, 2, True), ("qwen3_moe", 16, 4, False),
                      ("mixtral", 8, 2, True), ("mixtral", 4, 2, True)])
def test_equals_hf_block(backend, block, tokens):
    """HF's eager block in float32 on the same weights: the same experts, weights and
    roundings, so the outputs differ only by the float32 sums' order."""
    family, num_experts, top_k, renormalize = block
    block = hf_block(family, num_experts, top_k, renormalize)
    hidden = torch.randn(1, tokens, 64)
    with torch.no_grad():
        expected = block(hidden)[0]
        logits = F.linear(hidden[0], block.gate.weight)
        device = backend.device
        got = backend.ops.moe(hidden[0].to(device), logits.to(device),
                              block.experts.gate_up_proj.to(device),
                              block.experts.down_proj.to(device), top_k, renormalize).cpu()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_ties_choose_as_torch_topk(backend):
    """A bfloat16 router ties logits often; the CPU kernel and the composite pick the experts
    torch.topk picks (whose CPU kernel does not break ties by index), as HF does."""
    if backend.name == "cuda":
        pytest.skip("CUDA's routing breaks ties by the lower expert id (test_kernels_sim.py)")
    x = torch.randn(50, 64)
    logits = torch.randint(-2, 3, (50, 16)).to(torch.bfloat16)  # many ties at the k-th place
    gate_up, down = float_experts(16, 64, 32, torch.float32, "cpu")
    got = backend.ops.moe(x.to(backend.device), logits.to(backend.device),
                          gate_up.to(backend.device), down.to(backend.device), 4, True).cpu()
    expected = reference.moe(x.double(), logits, gate_up.double(), down.double(), 4, True)
    judge(got, None, expected, torch.float32)


@pytest.mark.cuda_sim
def test_strided_inputs(backend):
    """x stored transposed, logits a column slice, experts as a slice of wider storage (each
    expert's rows contiguous, experts and rows further apart)."""
    device = backend.device
    x = torch.randn(64, 20, device=device).t()
    logits = torch.randn(20, 12, device=device)[:, 2:10]
    wide_gate_up = torch.randn(8, 70, 80, device=device) / 8
    wide_down = torch.randn(8, 66, 40, device=device) / 6
    gate_up, down = wide_gate_up[:, 3:67, 5:69], wide_down[:, 1:65, 4:36]
    got = backend.ops.moe(x, logits, gate_up, down, 2, True)
    expected = reference.moe(x.cpu().double(), logits.cpu(), gate_up.cpu().double(),
                             down.cpu().double(), 2, True)
    judge(got, None, expected, torch.float32)


@pytest.mark.cuda_sim
def test_empty_inputs(backend):
    device = backend.device
    gate_up, down = float_experts(4, 64, 32, torch.float32, device)
    got = backend.ops.moe(torch.randn(0, 64, device=device), torch.randn(0, 4, device=device),
                          gate_up, down, 2, True)
    assert got.shape == (0, 64)
    # No intermediate features: every expert outputs zeros.
    x, logits = torch.randn(3, 64, device=device), torch.randn(3, 4, device=device)
    got = backend.ops.moe(x, logits, gate_up[:, :0], down[:, :, :0], 2, True)
    assert torch.equal(got.cpu(), torch.zeros(3, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gate_up_type", [None, TYPES["Q4_K"]])
def test_batch_invariant_tokens_equal_each_token_alone(dtype, gate_up_type):
    """Under ops.batch_invariant() a token's output is bit for bit its output alone, with more
    rows per expert than the few-row kernels otherwise take."""
    x = torch.randn(150, 256).to(dtype)
    logits = torch.randn(150, 4)
    gate_up, gate_up_type = quantized_experts(4, 128, 256, "Q4_K" if gate_up_type else None,
                                              dtype, seed=0)
    down = (torch.randn(4, 256, 64) / 8).to(dtype)
    with ops.batch_invariant():
        batch = ops.moe(x, logits, gate_up, down, 2, True, gate_up_type=gate_up_type)
        alone = torch.cat([ops.moe(x[i:i + 1], logits[i:i + 1], gate_up, down, 2, True,
                                   gate_up_type=gate_up_type) for i in range(0, 150, 7)])
    assert torch.equal(batch[::7], alone)


def test_decode_reads_only_the_chosen_experts():
    """At decode only the chosen experts' weights are read: NaN in every other expert leaves
    the output finite (the CPU's streaming path, and its GEMM path too)."""
    for tokens in (1, 300):
        x = torch.randn(tokens, 64)
        logits = torch.full((tokens, 8), -20.0)
        logits[:, [2, 5]] = torch.randn(tokens, 2)  # every token picks experts 2 and 5
        gate_up, down = float_experts(8, 64, 32, torch.float32, "cpu")
        unused = [e for e in range(8) if e not in (2, 5)]
        gate_up[unused] = float("nan")
        down[unused] = float("nan")
        got = ops.moe(x, logits, gate_up, down, 2, True)
        assert not got.isnan().any()
