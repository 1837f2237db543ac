"""The CUDA kernels run, on the CPU, through the CUDA simulator (``cuda_sim.py``): the host files'
checks, kernel choices and key splits, and the kernels' tiling, masking, pipelines and barriers,
against the same float64 oracles and CPU ops as the device tests. This is what runs of the CUDA
code where there is no GPU; on a GPU the device-parametrized tests run the real thing.

Every output starts poisoned (NaN, or a sentinel for integers), shared memory starts as NaN
bytes, and cp.async copies land only when a wait requires them, so unwritten elements, reads of
unstaged tiles and missing waits show. A few cases run again with each block's threads scheduled
last to first: a result that depends on the order has a missing barrier.

The op test grids (tests/ops, tests/kv_cache, tests/sampling) run their tests marked `cuda_sim` on
the simulator too (rotary embedding and the penalties entirely); this file keeps the cases they
do not cover: the CUDA kernels' own paths, launch grids and scheduling."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import gguf
import pytest
import torch

from conftest import assert_within_twice_plain_error, blind_rows, num_threads
from fastllm import ops
from fastllm.models.quantized import pack_fp8
from fastllm.ops import reference

# The paged-attention and sampling test helpers live beside their own tests.
for folder in ("kv_cache", "sampling"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))
from paged_util import cu_seqlens, make_case  # noqa: E402
from sampling_util import Row, conditioned_logits, random_logits, row_args  # noqa: E402

F32_TOL = 2e-5
SMS = 132  # the simulated device's SMs (an H100/H200)
# Logit soft-cap: off (the kernels' kSoftcap = false instantiations) and on (their kSoftcap ones).
SOFTCAPS = [0.0, 5.0]
BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def sim(cuda_sim_ops):
    return cuda_sim_ops


@pytest.fixture(autouse=True)
def fresh_device(sim):
    sim.configure(SMS, False, False)
    sim.set_trusted_inputs(False)
    sim.take_launch_log()
    yield
    sim.configure(SMS, False, False)
    sim.set_trusted_inputs(False)


def as_float64(args) -> list:
    """The oracle's inputs: floating tensors in float64, the rest as they are."""
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]


def judge(got: torch.Tensor, plain, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 tight against float64; bfloat16/float16 flash-attention's 2x rule, where
    ``plain()`` is the reference run in the low-precision dtype."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, atol=F32_TOL, rtol=F32_TOL)
    else:
        assert_within_twice_plain_error(got.double(), plain().double(), expected)


def test_every_op_has_a_cuda_kernel(sim):
    """Every fastllm op is registered by a CUDA host file (the simulator links them all), so no
    op falls back to its ATen composition on a GPU; in a CUDA build, for the CUDA key itself."""
    names = sorted({schema.name.split("::")[1] for schema in torch._C._jit_get_all_schemas()
                    if schema.name.startswith("fastllm::")})
    assert {"rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_and_cache",
            "linear"} <= set(names)
    missing = [name for name in names
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastllm_sim::{name}", "CPU")]
    assert not missing, f"no CUDA host file registers {missing}"
    if torch.cuda.is_available():
        missing = [name for name in names
                   if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastllm::{name}", "CUDA")]
        assert not missing, f"no CUDA kernel for {missing}"


# --- attention ------------------------------------------------------------------------------

# dtype, head_dim, group, lens_q, lens_k, causal, window_left
ATTENTION = [
    (BF16, 64, 1, [5, 70, 1], [9, 70, 130], True, -1),
    (BF16, 67, 4, [5, 70, 1], [9, 70, 130], True, -1),  # tensor cores, padded to 80
    (FP16, 96, 2, [33, 1], [33, 200], True, -1),
    (FP16, 128, 2, [130], [130], True, -1),  # two query tiles
    (FP16, 128, 7, [9], [40], True, -1),
    (BF16, 256, 1, [20, 3], [70, 3], True, -1),
    (BF16, 64, 2, [150], [150], False, -1),
    (BF16, 64, 2, [150], [150], True, 17),  # sliding window
    (FP16, 64, 1, [9, 0, 3, 1], [4, 5, 0, 1], True, -1),  # rows above the diagonal, empty seqs
    (F32, 64, 2, [5, 40, 1], [9, 40, 130], True, -1),  # SIMT
    (F32, 100, 1, [17], [40], True, 5),
    (F32, 32, 1, [1], [1], True, 0),
    (BF16, 320, 1, [3], [5], True, -1),  # no kernel: the ATen composition
]


def run_attention(sim, dtype, head_dim, group, lens_q, lens_k, causal, window_left, softcap=0.0):
    n_kv = 2
    q = torch.randn(sum(lens_q), n_kv * group, head_dim, dtype=dtype)
    k = torch.randn(sum(lens_k), n_kv, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    args = (q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k))
    kwargs = dict(causal=causal, scale=None, window_left=window_left, softcap=softcap)
    # A strided view of a poisoned buffer: only the view may be written.
    buffer = torch.full((q.shape[0], q.shape[1], head_dim + 8), math.nan, dtype=dtype)
    out = buffer[..., 4:head_dim + 4]
    sim.attention_out(*args, **kwargs, out=out)
    assert buffer[..., :4].isnan().all() and buffer[..., head_dim + 4:].isnan().all()
    return args, kwargs, out


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype, head_dim, group, lens_q, lens_k, causal, window_left", ATTENTION)
def test_attention(sim, dtype, head_dim, group, lens_q, lens_k, causal, window_left, softcap):
    args, kwargs, out = run_attention(sim, dtype, head_dim, group, lens_q, lens_k, causal,
                                      window_left, softcap)
    assert not out.isnan().any(), "some output elements were never written"
    with num_threads(1):
        blind = blind_rows(lens_q, lens_k, causal, window_left)
        assert (out[blind] == 0).all(), "a query that sees no key must output exactly 0"
        expected = reference.attention(*as_float64(args), **kwargs)
        judge(out, lambda: reference.attention(*args, **kwargs), expected, dtype)
    assert torch.equal(sim.attention(*args, **kwargs), out), "functional != out= result"


# --- paged attention ------------------------------------------------------------------------

# dtype, head_dim, n_heads, n_kv_heads, block_size, lens_q, seq_lens, causal, window_left
PAGED = [
    (F32, 64, 8, 2, 16, [1, 1, 1], [37, 300, 1], True, -1),  # decode
    (BF16, 128, 16, 2, 16, [1, 1, 1, 1], [1000, 17, 256, 5], True, -1),
    (FP16, 67, 7, 1, 1, [1, 1], [40, 9], True, -1),  # block size 1, odd head_dim
    (BF16, 64, 4, 4, 16, [7, 40], [20, 90], True, -1),  # chunked prefill over a prefix
    (F32, 128, 8, 2, 32, [33], [100], True, -1),  # the prefill shape (132 rows)
    (BF16, 64, 4, 2, 16, [20, 1], [80, 50], True, 5),
    (F32, 64, 4, 2, 16, [6], [30], False, -1),
    (BF16, 96, 6, 3, 5, [3, 0, 2], [3, 0, 70], True, -1),  # an empty sequence
    # 16-bit chunked prefill on the tensor-core kernel: element loads (head_dim 67) through
    # blocks of 5, and head_dim 256
    (FP16, 67, 4, 2, 5, [30, 3], [50, 70], True, -1),
    (BF16, 256, 4, 1, 16, [20], [150], True, -1),
]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("sm_count", [SMS, 1], ids=["132_sms", "1_sm"])
@pytest.mark.parametrize("dtype, head_dim, n_heads, n_kv, block, lens_q, seq_lens, causal, window",
                         PAGED)
def test_paged_attention(sim, sm_count, dtype, head_dim, n_heads, n_kv, block, lens_q, seq_lens,
                         causal, window, softcap):
    sim.configure(sm_count, False, False)
    case = make_case(lens_q, seq_lens, n_heads, n_kv, head_dim, block, dtype=dtype)
    kwargs = dict(causal=causal, scale=None, window_left=window, softcap=softcap)
    out = sim.paged_attention(*case.args(), **kwargs, rotary_cos_sin_cache=None,
                              rotary_is_neox=True)
    assert not out.isnan().any(), "NaN in the output: unowned slots or blocks were read"
    with num_threads(1):
        assert (out[blind_rows(lens_q, seq_lens, causal, window)] == 0).all()
        expected = reference.paged_attention(*as_float64(case.args()), **kwargs)
        judge(out, lambda: reference.paged_attention(*case.args(), **kwargs), expected, dtype)


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_long_decode_splits_keys_and_combines(sim, softcap):
    """Few sequences with many keys: the grid splits each sequence's keys (grid.z) and a
    combine kernel merges them; one SM's worth of blocks does not split. Both agree."""
    case = make_case([1, 1], [3000, 700], 32, 8, 128, 16, dtype=BF16)
    outs, grids = [], []
    for sm_count in (SMS, 1):
        sim.configure(sm_count, False, False)
        outs.append(sim.paged_attention(*case.args(), causal=True, scale=None, window_left=-1,
                                        rotary_cos_sin_cache=None, rotary_is_neox=True,
                                        softcap=softcap))
        grids.append(sim.take_launch_log())
    assert grids[0].shape[0] == 2 and grids[0][0, 2] > 1, f"no key split: {grids[0].tolist()}"
    assert grids[1].shape[0] == 1 and grids[1][0, 2] == 1, f"split on one SM: {grids[1]}"
    with num_threads(1):
        expected = reference.paged_attention(*as_float64(case.args()), softcap=softcap)
        for out in outs:
            judge(out, lambda: reference.paged_attention(*case.args(), softcap=softcap),
                  expected, BF16)


@pytest.mark.parametrize("dtype, is_neox, rotary_dim, softcap",
                         [(F32, True, 64, 0.0), (BF16, False, 32, 0.0), (BF16, True, 64, 5.0)])
def test_pre_rope_paged_attention(sim, dtype, is_neox, rotary_dim, softcap):
    case = make_case([1, 5], [300, 40], 8, 2, 64, 16, dtype=dtype)
    cos_sin = ops.rope_cos_sin_cache(400, rotary_dim)
    kwargs = dict(causal=True, scale=None, window_left=-1, rotary_cos_sin_cache=cos_sin,
                  rotary_is_neox=is_neox, softcap=softcap)
    out = sim.paged_attention(*case.args(), **kwargs)
    with num_threads(1):
        expected = reference.paged_attention(*as_float64(case.args()), **kwargs)
        judge(out, lambda: reference.paged_attention(*case.args(), **kwargs), expected, dtype)


@pytest.mark.parametrize("dtype, pre_rope", [(BF16, False), (FP16, False), (F32, False),
                                             (BF16, True)])
def test_chunked_prefill_runs_on_tensor_cores_in_16_bits(sim, dtype, pre_rope):
    """16-bit chunked prefill over keys cached after RoPE runs the varlen tensor-core kernel,
    K/V read through the block tables: one launch, a block per (query tile, sequence, head).
    float32 and pre-RoPE caches run the paged kernel: blocks per (row tile, kv head, split)."""
    case = make_case([32, 7], [544, 100], 16, 8, 128, 16, dtype=dtype)
    kwargs = dict(causal=True, scale=None, window_left=-1, softcap=0.0,
                  rotary_cos_sin_cache=ops.rope_cos_sin_cache(600, 128) if pre_rope else None,
                  rotary_is_neox=True)
    out = sim.paged_attention(*case.args(), **kwargs)
    launches = sim.take_launch_log()
    if dtype != F32 and not pre_rope:
        assert launches[:, :3].tolist() == [[1 * 2 * 16, 1, 1]], launches.tolist()
    else:
        assert launches[0, 1] == 8, launches.tolist()
    with num_threads(1):
        expected = reference.paged_attention(*as_float64(case.args()), **kwargs)
        judge(out, lambda: reference.paged_attention(*case.args(), **kwargs), expected, dtype)


@pytest.mark.parametrize("lens_q, dtype", [([1], F32), ([20], BF16)], ids=["decode", "prefill"])
def test_paged_attention_checks_block_tables_unless_trusted(sim, lens_q, dtype):
    case = make_case(lens_q, [40], 4, 2, 64, 16, dtype=dtype)
    case.block_tables[0, 1] = case.k_cache.shape[0]  # a block id past the pool
    with pytest.raises(ValueError, match="block"):
        sim.paged_attention(*case.args(), causal=True, scale=None, window_left=-1,
                            rotary_cos_sin_cache=None, rotary_is_neox=True)
    # Trusted (or while a CUDA graph is captured), the kernel reads no such block: the keys of
    # the bad block do not count, and nothing outside the pool is touched.
    sim.configure(SMS, False, True)
    out = sim.paged_attention(*case.args(), causal=True, scale=None, window_left=-1,
                              rotary_cos_sin_cache=None, rotary_is_neox=True)
    assert not out.isnan().any()


# --- cache writes ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, FP16])
@pytest.mark.parametrize("heads, head_dim", [(2, 64), (3, 67), (8, 128)])
def test_reshape_and_cache_equals_cpu(sim, dtype, heads, head_dim):
    tokens, num_blocks, block = 9, 5, 16
    k = torch.randn(tokens, heads, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    slot_mapping = torch.randperm(num_blocks * block)[:tokens]
    slot_mapping[3] = -1  # a padding token: not written
    caches = [torch.full((num_blocks, block, heads, head_dim), math.nan, dtype=dtype)
              for _ in range(4)]
    sim.reshape_and_cache(k, v, caches[0], caches[1], slot_mapping)
    ops.reshape_and_cache(k, v, caches[2], caches[3], slot_mapping)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_reshape_and_cache_rejects_a_slot_past_the_pool_unless_trusted(sim):
    k = torch.randn(3, 2, 64)
    caches = [torch.full((2, 16, 2, 64), math.nan) for _ in range(2)]
    bad = torch.tensor([0, 32, 5])
    with pytest.raises(ValueError, match="slot_mapping"):
        sim.reshape_and_cache(k, k, *caches, bad)
    assert caches[0].isnan().all(), "a rejected call wrote"
    sim.set_trusted_inputs(True)
    sim.reshape_and_cache(k, k, *caches, bad)  # the bad row is skipped, the others written
    written = ~caches[0].view(-1, 2, 64).isnan().all(-1).all(-1)
    assert written.nonzero().flatten().tolist() == [0, 5]


# --- sampling -------------------------------------------------------------------------------

ROWS = [
    Row(),
    Row(temperature=0.0),
    Row(temperature=0.7, top_k=5, seed=1),
    Row(top_p=0.8, seed=3, offset=9),
    Row(min_p=0.1, seed=5),
    Row(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02, seed=11, offset=2),
]


@pytest.mark.parametrize("dtype", [F32, BF16, FP16])
@pytest.mark.parametrize("vocab", [4096, 4099, 1])  # 16-byte rows, unaligned rows, one token
def test_sample_with_logprobs_equals_cpu(sim, dtype, vocab):
    """Well-conditioned rows (far from every top-p / min-p boundary) draw the CPU's tokens: the
    same Philox keying and the same walk through the vocabulary."""
    logits = torch.stack([conditioned_logits(lambda: random_logits(vocab), row, margin=1e-5)
                          for row in ROWS]).to(dtype)
    args = row_args(ROWS)
    tokens, token_logprobs, top_ids, top_logprobs = sim.sample_with_logprobs(logits, *args, 4)
    expected = ops.sample_with_logprobs(logits, *args, 4)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(token_logprobs, expected[1], atol=2e-6, rtol=2e-6)
    assert torch.equal(top_ids, expected[2])
    torch.testing.assert_close(top_logprobs, expected[3], atol=2e-6, rtol=2e-6)
    assert torch.equal(sim.sample(logits, *args), tokens)


def test_sample_flags_bad_rows(sim):
    logits = torch.randn(3, 100)
    logits[1, 7] = math.nan
    args = row_args([Row(seed=1), Row(seed=2), Row(seed=3)])
    with pytest.raises(ValueError, match="row 1"):
        sim.sample(logits, *args)
    sim.set_trusted_inputs(True)  # no host check: the row's token says it
    tokens = sim.sample(logits, *args)
    assert tokens[1] == -1 and (tokens[[0, 2]] >= 0).all()


# --- block-quantized matmul -----------------------------------------------------------------

def test_quantized_linear_takes_the_gemv_up_to_8_rows(sim):
    """Up to 8 rows: one GEMV launch, a warp per weight row and 4 to a block; more rows: one
    dequantize launch (a thread per 8 values), then ATen's matmul."""
    weight = torch.from_numpy(gguf.quants.quantize(torch.randn(10, 64).numpy(),
                                                   gguf.GGMLQuantizationType.Q8_0))
    for rows, launch in ((8, [3, 1, 1, 128, 1, 1, 0]), (9, [1, 1, 1, 256, 1, 1, 0])):
        x = torch.randn(rows, 64)
        got = sim.quantized_linear(x, weight, 8)
        assert sim.take_launch_log().tolist() == [launch]
        torch.testing.assert_close(got.double(), reference.quantized_linear(x, weight, 8),
                                   atol=F32_TOL, rtol=F32_TOL)


def test_fp8_linear_takes_the_gemv_up_to_8_rows(sim):
    """fastllm's FP8 blocks as the ggml formats: up to 8 rows one GEMV launch (a warp per
    weight row, its codes decoded in registers), more rows one dequantize launch, then ATen's
    matmul; both against the float64 twin."""
    codes = (8 * torch.randn(10, 64)).to(torch.float8_e4m3fn)
    weight = pack_fp8(codes, torch.rand(10, 1) / 100, (1, 64)).data
    for rows, launch in ((8, [3, 1, 1, 128, 1, 1, 0]), (9, [1, 1, 1, 256, 1, 1, 0])):
        x = torch.randn(rows, 64)
        got = sim.quantized_linear(x, weight, ops.FP8_E4M3)
        assert sim.take_launch_log().tolist() == [launch]
        torch.testing.assert_close(got.double(),
                                   reference.quantized_linear(x, weight, ops.FP8_E4M3),
                                   atol=F32_TOL, rtol=F32_TOL)


# --- mixture of experts ---------------------------------------------------------------------

def moe_inputs(tokens, num_experts=8, dtype=F32, logits=None):
    x = torch.randn(tokens, 64, dtype=dtype)
    logits = torch.randn(tokens, num_experts) if logits is None else logits
    gate_up = (torch.randn(num_experts, 64, 64) / 8).to(dtype)
    down = (torch.randn(num_experts, 64, 32) / 6).to(dtype)
    return x, logits, gate_up, down


def test_moe_paths_agree(sim):
    """Up to 8 tokens, or while a CUDA graph is captured: the routing, one GEMV launch per
    projection over every (token, expert) pair (a warp per pair and weight row), silu_and_mul and
    the combine, with no grouping. More tokens: the routing, the pairs grouped by expert (a count
    and a scatter launch, a block per expert), a matmul per expert (ATen's here, cuBLAS on a
    GPU), silu_and_mul and the combine. Both agree with the float64 block."""
    x, logits, gate_up, down = moe_inputs(20)
    grouped = sim.moe(x, logits, gate_up, down, 2, True)
    launches = sim.take_launch_log().tolist()
    route, count, scatter, silu, combine = launches
    assert route == [5, 1, 1, 128, 1, 1, 0] and count == scatter == [8, 1, 1, 256, 1, 1, 0]
    assert combine == [1, 20, 1, 256, 1, 1, 0]
    sim.configure(SMS, False, True)  # capturing: no wait for the device
    gemv = sim.moe(x, logits, gate_up, down, 2, True)
    launches = sim.take_launch_log().tolist()
    assert launches[1] == [16, 40, 1, 128, 1, 1, 0] and launches[3] == [16, 40, 1, 128, 1, 1, 0]
    with num_threads(1):
        expected = reference.moe(x.double(), logits, gate_up.double(), down.double(), 2, True)
    for got in (grouped, gemv):
        torch.testing.assert_close(got.double(), expected, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("tokens", [3, 20])
def test_moe_ties_go_to_the_lower_expert(sim, tokens):
    """Tied probabilities rank by expert id (torch.topk's own order for ties differs between
    its CPU and CUDA kernels and is not documented): the reference, whose logits are nudged
    down by 1e-6 per expert id to break the ties that way, picks the same experts."""
    logits = torch.randint(-2, 3, (tokens, 16)).float()
    x, logits, gate_up, down = moe_inputs(tokens, 16, logits=logits)
    got = sim.moe(x, logits, gate_up, down, 4, True)
    nudged = logits - 1e-6 * torch.arange(16)
    with num_threads(1):
        expected = reference.moe(x.double(), nudged, gate_up.double(), down.double(), 4, True)
    torch.testing.assert_close(got.double(), expected, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", "FP8_E4M3"])
def test_moe_quantized_grouped_path_runs_quantized_linear(sim, type_name):
    """Past 8 tokens each expert's rows go through quantized_linear's CUDA path (its GEMV for an
    expert with up to 8 rows, dequantize + matmul past them: expert 0 has all 12 tokens)."""
    weight_type = {"Q4_K": 12, "Q8_0": 8, "FP8_E4M3": ops.FP8_E4M3}[type_name]
    if weight_type == ops.FP8_E4M3:
        codes = (8 * torch.randn(4 * 64, 256)).to(torch.float8_e4m3fn)
        gate_up = pack_fp8(codes, torch.rand(4 * 64, 1) / 100, (1, 256)).data.view(4, 64, -1)
    else:
        values, block_bytes = ops.BLOCK_FORMATS[weight_type][1:]
        gate_up = torch.randint(0, 256, (4, 64, 256 // values * block_bytes), dtype=torch.uint8)
        blocks = gate_up.view(4, 64, -1, block_bytes)
        blocks[..., 1] = 0x14  # d's high byte: a finite fp16 in [2^-10, 2^-9)
        if type_name == "Q4_K":
            blocks[..., 3] = 0x14  # dmin's
    x = torch.randn(12, 256)
    logits = torch.randn(12, 4)
    logits[:, 0] += 4  # expert 0 has every token (12 rows), the others a few
    down = torch.randn(4, 256, 32) / 6
    got = sim.moe(x, logits, gate_up, down, 2, True, gate_up_type=weight_type)
    with num_threads(1):
        expected = reference.moe(x.double(), logits, gate_up, down.double(), 2, True,
                                 gate_up_type=weight_type)
        plain = reference.moe(x, logits, gate_up, down, 2, True, gate_up_type=weight_type)
    # Outputs in the hundreds, some near 0 by cancellation: an absolute tolerance fits neither,
    # so the float32 composition's own error is the measure.
    assert_within_twice_plain_error(got.double(), plain.double(), expected)


# --- batched LoRA ---------------------------------------------------------------------------

def lora_inputs(tokens, slots, rank, in_features, out_features, dtype=F32):
    """(y, x, lora_a, lora_b, token_slots): every slot and -1 in turn, the LoRA term O(1)."""
    y = torch.randn(tokens, out_features, dtype=dtype)
    x = torch.randn(tokens, in_features, dtype=dtype)
    lora_a = (torch.randn(slots, rank, in_features) / in_features**0.5).to(dtype)
    lora_b = (torch.randn(slots, out_features, rank) / rank**0.5).to(dtype)
    token_slots = (torch.arange(tokens, dtype=torch.int32) % (slots + 1)) - 1
    return y, x, lora_a, lora_b, token_slots


def lora_plain(y, x, lora_a, lora_b, token_slots):
    """peft's eager lora_B(lora_A(x)) per slot in the inputs' dtype, added to y."""
    out = y.clone()
    for s in range(lora_a.shape[0]):
        rows = (token_slots == s).nonzero().squeeze(1)
        out[rows] += torch.nn.functional.linear(torch.nn.functional.linear(x[rows], lora_a[s]),
                                                lora_b[s])
    return out


@pytest.mark.parametrize("dtype", [F32, BF16, FP16])
@pytest.mark.parametrize("rank, lanes", [(1, 1), (5, 8), (16, 16), (33, 32), (1024, 32)])
def test_add_lora_matches_float64(sim, dtype, rank, lanes):
    """The shrink: a block per token and 8 rank rows, a warp per rank row. The expand: a block
    per token and 256 / lanes output rows, lanes the rank rounded up to a power of two (at most a
    warp) per row. Tokens of slot -1 are left as they are; the rest match the float64 twin (and
    in float32 the CPU kernel)."""
    tokens, in_features, out_features = 9, 70, 45
    y, x, lora_a, lora_b, token_slots = lora_inputs(tokens, 3, rank, in_features, out_features,
                                                    dtype)
    got = y.clone()
    sim.add_lora(got, x, lora_a, lora_b, token_slots)
    shrink, expand = sim.take_launch_log().tolist()
    assert shrink == [tokens, math.ceil(rank / 8), 1, 256, 1, 1, 0]
    assert expand == [tokens, math.ceil(out_features / (256 // lanes)), 1, 256, 1, 1, 0]
    untouched = token_slots < 0
    assert torch.equal(got[untouched], y[untouched])
    expected = reference.add_lora(y, x, lora_a, lora_b, token_slots)
    judge(got, lambda: lora_plain(y, x, lora_a, lora_b, token_slots), expected, dtype)
    if dtype == F32:
        cpu = y.clone()
        ops.add_lora(cpu, x, lora_a, lora_b, token_slots)
        torch.testing.assert_close(got, cpu, atol=F32_TOL, rtol=F32_TOL)


def test_add_lora_writes_only_y_through_its_row_stride(sim):
    """y a column slice of a NaN buffer: the rows step by the buffer's stride, and nothing
    outside the slice is written."""
    y, x, lora_a, lora_b, token_slots = lora_inputs(6, 2, 16, 64, 40, BF16)
    buffer = torch.full((6, 48), math.nan, dtype=BF16)
    target = buffer[:, 3:43]
    target.copy_(y)
    sim.add_lora(target, x, lora_a, lora_b, token_slots)
    assert buffer[:, :3].isnan().all() and buffer[:, 43:].isnan().all()
    expected = reference.add_lora(y, x, lora_a, lora_b, token_slots)
    judge(target, lambda: lora_plain(y, x, lora_a, lora_b, token_slots), expected, BF16)


def test_add_lora_rejects_a_slot_out_of_range_unless_trusted(sim):
    y, x, lora_a, lora_b, _ = lora_inputs(4, 2, 8, 32, 24)
    bad = torch.tensor([0, 2, 1, -3], dtype=torch.int32)
    target = y.clone()
    with pytest.raises(ValueError, match=r"token_slots\[1\]=2 is outside \[-1, 2\)"):
        sim.add_lora(target, x, lora_a, lora_b, bad)
    assert torch.equal(target, y), "a rejected call wrote"
    assert sim.take_launch_log().numel() == 0, "a rejected call launched"
    sim.set_trusted_inputs(True)
    sim.add_lora(target, x, lora_a, lora_b, bad)  # the bad tokens are skipped, the others added
    assert torch.equal(target[[1, 3]], y[[1, 3]])
    expected = reference.add_lora(y, x, lora_a, lora_b, torch.tensor([0, -1, 1, -1]))
    torch.testing.assert_close(target.double(), expected, atol=F32_TOL, rtol=F32_TOL)


def test_add_lora_does_not_depend_on_the_threads_order(sim):
    """The expand stages each token's shrink result in shared memory behind a barrier: each
    block's threads run first to last, then last to first, with the same bits."""
    y, x, lora_a, lora_b, token_slots = lora_inputs(5, 2, 40, 64, 70, BF16)
    runs = []
    for reverse in (False, True):
        sim.configure(SMS, reverse, False)
        target = y.clone()
        sim.add_lora(target, x, lora_a, lora_b, token_slots)
        runs.append(target)
    assert torch.equal(runs[0], runs[1])


# --- scheduling order -----------------------------------------------------------------------

def test_results_do_not_depend_on_the_threads_order(sim):
    """Each block's threads run first to last, then last to first: with every barrier in place
    the outputs are bit-identical."""
    attention = ATTENTION[0]
    # 16 bits: the tensor-core kernel through the block tables; float32: the paged kernel
    cases = [make_case([1, 9], [900, 60], 16, 2, 64, 16, dtype=dtype) for dtype in (BF16, F32)]
    logits = torch.randn(4, 4096)
    args = row_args(ROWS[2:])
    moe = moe_inputs(300, dtype=BF16)
    runs = []
    for reverse in (False, True):
        sim.configure(SMS, reverse, False)
        torch.manual_seed(0)
        runs.append((run_attention(sim, *attention)[2],
                     [sim.paged_attention(*case.args(), causal=True, scale=None, window_left=-1,
                                          rotary_cos_sin_cache=None, rotary_is_neox=True)
                      for case in cases],
                     sim.sample_with_logprobs(logits, *args, 3),
                     sim.moe(*moe, 2, True)))
    (attn_f, paged_f, sample_f, moe_f), (attn_r, paged_r, sample_r, moe_r) = runs
    assert torch.equal(attn_f, attn_r)
    assert all(torch.equal(f, r) for f, r in zip(paged_f, paged_r))
    assert torch.equal(moe_f, moe_r)
    for a, b in zip(sample_f, sample_r):
        assert torch.equal(a, b)
