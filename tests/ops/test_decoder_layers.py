"""fastllm.ops.DecoderLayers (the decoder layers run from C++) against its float64 twin,
fastllm.ops.reference.decoder_layers: a prefill step then a decode step over two sequences of a
paged cache whose unwritten slots hold NaN, with float and block-quantized (mixed-format)
projections, and each family's layer: q/k norms per head or over all heads, pre-, post- and
sandwich norms, GELU-tanh, soft-capped scores, a mixture of experts, a NoPE layer, a sliding
window, two RoPE tables, partial rotary, pre-RoPE caches and LoRA adapter slots."""

from __future__ import annotations

import pytest
import torch
from conftest import OpLog

from fastllm import ops
from fastllm.models.quantized import quantize_weight
from fastllm.ops import reference

HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 96
BLOCK_SIZE, NUM_BLOCKS = 4, 8
Q8_0, Q4_1 = 8, 3


def projection(out: int, inp: int, quantized: bool, bias: bool) -> list[ops.ProjectionPart]:
    """A projection ``[out, inp]``; quantized: its first rows Q8_0, the rest Q4_1 (as a Q4_K_M
    file mixes formats in one fused projection), each part with its share of the bias."""
    weight = torch.randn(out, inp) * inp**-0.5
    b = torch.randn(out) * 0.1 if bias else None
    if not quantized:
        return [ops.ProjectionPart(weight, None, b)]
    split = out // 2
    return [ops.ProjectionPart(quantize_weight(weight[rows], kind).data, kind,
                               None if b is None else b[rows])
            for rows, kind in ((slice(0, split), Q8_0), (slice(split, out), Q4_1))]


EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 4, 2, 32


def norm(n: int) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n)


def experts(quantized: bool, decisive: bool) -> ops.Experts:
    """Four SwiGLU experts, two a token, renormalized; quantized: gate|up Q8_0, down Q4_1.
    ``decisive``: the router's bias puts experts 0 and 1 far ahead, so that rounding of the
    hidden state (bfloat16) cannot change which experts a token runs, only their weights."""
    gate_up = torch.randn(EXPERTS, 2 * EXPERT_INTERMEDIATE, HIDDEN) * HIDDEN**-0.5
    down = torch.randn(EXPERTS, HIDDEN, EXPERT_INTERMEDIATE) * EXPERT_INTERMEDIATE**-0.5
    router = projection(EXPERTS, HIDDEN, quantized=False, bias=False)
    if decisive:
        router = [ops.ProjectionPart(router[0].weight * 0.1, None,
                                     torch.tensor([4.0, 4.0, -4.0, -4.0]))]
    if not quantized:
        return ops.Experts(router, gate_up, down, TOP_K, renormalize=True)
    blocks = lambda w, kind: torch.stack(  # noqa: E731
        [quantize_weight(e, kind).data for e in w])
    return ops.Experts(router, blocks(gate_up, Q8_0), blocks(down, Q4_1), TOP_K,
                       renormalize=True, gate_up_type=Q8_0, down_type=Q4_1)


def layer_weights(quantized: bool, variant: str = "plain", *, use_rope: bool = True,
                  window_left: int = -1, rope_table: int = 0,
                  decisive_router: bool = False) -> ops.DecoderLayer:
    """A layer of the family ``variant`` names:

    - plain: Llama's pre-norms, SwiGLU;
    - qk_norm: Qwen3's per-head q/k norms;
    - sandwich: Gemma 2/3: all four norms, GELU-tanh, soft-capped scores, a query scale;
    - post_norms: OLMo 2: norms after each branch only, q/k norms over all heads;
    - moe: Qwen3-MoE: the MLP a mixture of experts.
    """
    qkv_rows = (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM
    pre = variant != "post_norms"
    post = variant in ("sandwich", "post_norms")
    moe = variant == "moe"
    qk_norm = {"qk_norm": HEAD_DIM, "sandwich": HEAD_DIM, "moe": HEAD_DIM,
               "post_norms": None}.get(variant)
    q_norm = norm(N_HEADS * HEAD_DIM) if variant == "post_norms" else (
        norm(qk_norm) if qk_norm else None)
    k_norm = norm(N_KV_HEADS * HEAD_DIM) if variant == "post_norms" else (
        norm(qk_norm) if qk_norm else None)
    return ops.DecoderLayer(
        input_norm=norm(HIDDEN) if pre else None,
        post_attention_norm=norm(HIDDEN) if post else None,
        pre_feedforward_norm=norm(HIDDEN) if pre else None,
        post_feedforward_norm=norm(HIDDEN) if post else None,
        qkv=projection(qkv_rows, HIDDEN, quantized, bias=variant == "plain"),
        o=projection(HIDDEN, N_HEADS * HEAD_DIM, quantized, bias=False),
        gate_up=None if moe else projection(2 * INTERMEDIATE, HIDDEN, quantized, bias=False),
        down=None if moe else projection(HIDDEN, INTERMEDIATE, quantized, bias=False),
        experts=experts(quantized, decisive_router) if moe else None,
        activation="gelu_tanh" if variant == "sandwich" else "silu",
        n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, eps=1e-5, use_rope=use_rope,
        rope_table=rope_table, window_left=window_left,
        scale=0.3 if variant == "sandwich" else None,
        softcap=5.0 if variant == "sandwich" else 0.0,
        q_norm=q_norm, k_norm=k_norm, qk_norm_per_head=variant != "post_norms")


def as_dtype(layer: ops.DecoderLayer, dtype: torch.dtype) -> ops.DecoderLayer:
    """Float tensors in ``dtype`` (the activations'); quantized blocks as they are."""
    cast = lambda t: t if t is None or t.dtype == torch.uint8 else t.to(dtype)  # noqa: E731
    parts = lambda ps: None if ps is None else [  # noqa: E731
        ops.ProjectionPart(cast(p.weight), p.weight_type, cast(p.bias)) for p in ps]
    e = layer.experts
    return layer.replace(
        input_norm=cast(layer.input_norm),
        post_attention_norm=cast(layer.post_attention_norm),
        pre_feedforward_norm=cast(layer.pre_feedforward_norm),
        post_feedforward_norm=cast(layer.post_feedforward_norm), qkv=parts(layer.qkv),
        o=parts(layer.o), gate_up=parts(layer.gate_up), down=parts(layer.down),
        experts=None if e is None else e.replace(
            router=parts(e.router), gate_up=cast(e.gate_up), down=cast(e.down)),
        q_norm=cast(layer.q_norm), k_norm=cast(layer.k_norm))


def steps() -> list[ops.DecoderStep]:
    """Two sequences: a prefill of 7 and 3 tokens, then one decoded token each."""
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)

    def step(starts: list[int], lens: list[int], keys_are_new: bool) -> ops.DecoderStep:
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        slots = tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        return ops.DecoderStep(
            positions=positions, slot_mapping=slots, block_tables=tables,
            cu_seqlens_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                      dtype=torch.int32),
            max_seqlen_q=max(lens), keys_are_new=keys_are_new,
            seq_lens=torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32))
    return [step([0, 0], [7, 3], True), step([7, 3], [1, 1], False)]


# id: (layer variant, second layer's changes, pre-RoPE caches, RoPE tables' rotary dims)
VARIANTS = {
    "plain": ("plain", {}, False, [HEAD_DIM]),
    "qk_norm+nope": ("qk_norm", dict(use_rope=False), False, [HEAD_DIM]),
    "window+pre_rope": ("plain", dict(window_left=2), True, [HEAD_DIM]),
    # Gemma 3: sliding layers rotate with a local table, full ones with a global one.
    "sandwich+two_tables": ("sandwich", dict(rope_table=1), False, [HEAD_DIM, HEAD_DIM]),
    "post_norms+window": ("post_norms", dict(window_left=2), False, [HEAD_DIM]),
    "moe": ("moe", {}, False, [HEAD_DIM]),
    # Phi-3's partial rotary: the table rotates the first half of each head.
    "partial_rotary+pre_rope": ("plain", {}, True, [HEAD_DIM // 2]),
}


# Relative error against the float64 twin. float32 as tight as the op tests: every op sums in
# float32. Quantized projections also round their inputs to integer blocks (int16 for these
# types, test_quantized_linear.py's bound: 2^-16 of a block's largest value), which each layer's
# norms and attention compound.
TOLERANCE = {(torch.float32, False): 2e-5, (torch.float32, True): 1e-3,
             (torch.bfloat16, False): 6e-2, (torch.bfloat16, True): 6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_layers_match_their_float64_twin(dtype, quantized, variant):
    kind, second, pre_rope, rotary_dims = VARIANTS[variant]
    decisive = dict(decisive_router=dtype != torch.float32)
    layers = [layer_weights(quantized, kind, **decisive),
              layer_weights(quantized, kind, **second, **decisive)]
    layers = [as_dtype(layer, dtype) for layer in layers]
    tables = [ops.rope_cos_sin_cache(16, dim, base=base)
              for dim, base in zip(rotary_dims, (10000.0, 100.0))]
    shape = (len(layers), NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    # Unwritten slots poisoned: a read of one would turn the outputs NaN.
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    bound = ops.DecoderLayers(layers, tables)
    assert len(bound) == 2
    for step in steps():
        x = torch.randn(step.positions.shape[0], HIDDEN).to(dtype)
        out, residual = bound(x.clone(), None, step, k_cache, v_cache, pre_rope)
        want, want_residual, ref_k, ref_v = reference.decoder_layers(
            layers, x, None, step, ref_k, ref_v, rope_tables=tables, pre_rope=pre_rope)
        tolerance = TOLERANCE[dtype, quantized]
        for got, expected in ((out, want), (residual, want_residual)):
            assert got.dtype == dtype and torch.isfinite(got).all()
            err = (got.double() - expected).abs().max() / expected.abs().max()
            assert err < tolerance, f"relative error {err:.3g}"
        written = ~torch.isnan(ref_k)
        assert torch.equal(written, ~torch.isnan(k_cache))
        torch.testing.assert_close(k_cache[written].double(), ref_k[written].double(),
                                   rtol=tolerance, atol=tolerance)


def lora_slots(fan_in: int, fan_out: int, rank: int, dtype: torch.dtype) -> ops.ProjectionLoRA:
    """Two adapter slots of a projection, the second's rows and columns past rank 2 zero
    (a smaller adapter in a slot of ``rank``)."""
    a, b = torch.randn(2, rank, fan_in) * 0.2, torch.randn(2, fan_out, rank) * 0.2
    a[1, 2:], b[1, :, 2:] = 0, 0
    return ops.ProjectionLoRA(a.to(dtype), b.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized", [False, True])
def test_lora_slots_match_the_twin(dtype, quantized):
    """Each token adds its own slot's LoRA (or none) to every projection that has slots,
    over float and block-quantized weights."""
    q_rows = N_HEADS * HEAD_DIM
    qkv_rows = (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM
    slots = dict(qkv_lora=lora_slots(HIDDEN, qkv_rows, 12, dtype),
                 o_lora=lora_slots(q_rows, HIDDEN, 4, dtype),
                 gate_up_lora=lora_slots(HIDDEN, 2 * INTERMEDIATE, 8, dtype),
                 down_lora=lora_slots(INTERMEDIATE, HIDDEN, 4, dtype))
    layers = [as_dtype(layer_weights(quantized), dtype).replace(**slots) for _ in range(2)]
    tables = [ops.rope_cos_sin_cache(16, HEAD_DIM)]
    shape = (len(layers), NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    bound = ops.DecoderLayers(layers, tables)
    plain = None
    for step in steps():
        tokens = step.positions.shape[0]
        step = step.replace(lora_slots=torch.tensor([0, 1, -1] * tokens, dtype=torch.int32)[
            :tokens])
        x = torch.randn(tokens, HIDDEN).to(dtype)
        out, _ = bound(x.clone(), None, step, k_cache, v_cache, False)
        want, _, ref_k, ref_v = reference.decoder_layers(
            layers, x, None, step, ref_k, ref_v, rope_tables=tables, pre_rope=False)
        err = (out.double() - want).abs().max() / want.abs().max()
        assert err < TOLERANCE[dtype, quantized], f"relative error {err:.3g}"
        if plain is None:  # the adapters matter: without the step's slots, other outputs
            plain = ops.DecoderLayers(layers, tables)(
                x.clone(), None, step.replace(lora_slots=None), k_cache.clone(),
                v_cache.clone(), False)[0]
            assert (plain.double() - want).abs().max() / want.abs().max() > 0.05


def test_a_decode_layer_is_nine_fastllm_ops():
    """A Qwen3 layer (q/k norms, RoPE) at decode: each step one fastllm op and no other compute
    op (views aside), so on CUDA one kernel each (attention adds its merge of key splits, and
    cuBLAS a split-K reduction, where they split)."""
    layers = [layer_weights(False, "qk_norm") for _ in range(2)]
    layers = [layer.replace(qkv=[layer.qkv[0].replace(bias=None)]) for layer in layers]
    shape = (len(layers), NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    caches = dict(k_cache=torch.zeros(shape), v_cache=torch.zeros(shape))
    bound = ops.DecoderLayers(layers, [ops.rope_cos_sin_cache(16, HEAD_DIM)])
    prefill, decode = steps()
    bound(torch.randn(10, HIDDEN), None, prefill, **caches, pre_rope=False)
    x = torch.randn(2, HIDDEN)
    with OpLog() as log:
        bound(x, None, decode, **caches, pre_rope=False)
    layer = ["fastllm::add_rms_norm", "fastllm::linear", "fastllm::rotary_and_cache",
             "fastllm::paged_attention", "fastllm::linear", "fastllm::add_rms_norm",
             "fastllm::linear", "fastllm::silu_and_mul", "fastllm::linear"]
    assert log.names == ["fastllm::rms_norm", *layer[1:], *layer], log.names


def test_the_residual_stream_continues_from_the_caller():
    """Given a residual stream, the first norm adds x into it in place (a model split into
    several calls)."""
    layers = [layer_weights(False)]
    step = steps()[0]
    shape = (1, NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    caches = dict(k_cache=torch.zeros(shape), v_cache=torch.zeros(shape))
    x, stream = torch.randn(10, HIDDEN), torch.randn(10, HIDDEN)
    residual = stream.clone()
    tables = [ops.rope_cos_sin_cache(16, HEAD_DIM)]
    out, got_residual = ops.DecoderLayers(layers, tables)(x.clone(), residual, step, **caches,
                                                          pre_rope=False)
    want, want_residual, _, _ = reference.decoder_layers(
        layers, x, stream, step, **caches, rope_tables=tables, pre_rope=False)
    assert got_residual.data_ptr() == residual.data_ptr()  # updated in place
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_residual.double(), want_residual, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad, error, match", [
    (lambda: dict(layers=[]), TypeError, "non-empty"),
    (lambda: dict(n_kv_heads=3), ValueError, "multiple of n_kv_heads"),
    (lambda: dict(qkv=[]), TypeError, "qkv must be a non-empty"),
    (lambda: dict(q_norm=torch.ones(HEAD_DIM)), ValueError, "q_norm and k_norm come together"),
    (lambda: dict(down=[ops.ProjectionPart(torch.zeros(4, 34, dtype=torch.uint8), -3)]),
     ValueError, "weight_type must be a ggml type id"),
    (lambda: dict(activation="relu"), ValueError, "activation must be 'silu' or 'gelu_tanh'"),
    (lambda: dict(use_rope=None), TypeError, "use_rope must be a bool"),
    (lambda: dict(rope_table=1), ValueError, "layer 0 rotates with RoPE table 1 but 1 table"),
    (lambda: dict(eps=1e-5, epsilon=1e-5), TypeError, "DecoderLayer has no field epsilon"),
    (lambda: dict(o_lora=ops.ProjectionLoRA(torch.zeros(2, 4, 64), torch.zeros(2, 64, 8))),
     ValueError, "must agree on slots and rank"),
    (lambda: dict(qkv_lora=torch.zeros(2, 4, 64)), TypeError,
     "qkv_lora must be a ProjectionLoRA or None"),
])
def test_bad_layers_are_refused(bad, error, match):
    """Each record is checked as it is built (fields, values), the layers as they are bound
    (their RoPE tables): a ValueError or TypeError naming what is wrong."""
    tables = [ops.rope_cos_sin_cache(16, HEAD_DIM)]
    with pytest.raises(error, match=match):
        changes = bad()
        layers = changes.pop("layers", None)
        if layers is None:
            layers = [layer_weights(False).replace(**changes)]
        ops.DecoderLayers(layers, tables)


def test_caches_of_another_layer_count_are_refused():
    layers = [layer_weights(False)] * 2
    shape = (3, NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must be \[num_layers=2"):
        ops.DecoderLayers(layers, [ops.rope_cos_sin_cache(16, HEAD_DIM)])(
            torch.randn(10, HIDDEN), None, steps()[0], torch.zeros(shape), torch.zeros(shape),
            pre_rope=False)


@pytest.mark.parametrize("change, error, match", [
    (dict(positions=torch.zeros(10, dtype=torch.int32)), TypeError,
     "positions must be torch.int64"),
    (dict(slot_mapping=torch.zeros(9, dtype=torch.long)), ValueError,
     r"a step of 10 tokens \(positions\) in 2 sequences \(seq_lens\) needs slot_mapping \[10\]"),
    (dict(block_tables=torch.zeros(3, dtype=torch.int32)), ValueError,
     r"block_tables must be \[batch, max_blocks\]"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    (dict(keys_are_new=1), TypeError, "keys_are_new must be a bool"),
    (dict(lora_slots=torch.zeros(10, dtype=torch.long)), TypeError,
     "lora_slots must be torch.int32"),
    (dict(lora_slots=torch.zeros(9, dtype=torch.int32)), ValueError,
     r"a step of 10 tokens needs lora_slots \[10\]"),
])
def test_bad_steps_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        steps()[0].replace(**change)
