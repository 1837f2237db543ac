"""fastllm.ops.DecoderLayers (the decoder layers run from C++) against its float64 twin,
fastllm.ops.reference.decoder_layers: a prefill step then a decode step over two sequences of a
paged cache whose unwritten slots hold NaN, with float and block-quantized (mixed-format)
projections, q/k norms, a NoPE layer, a sliding window and pre-RoPE caches."""

from __future__ import annotations

import dataclasses

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


def layer_weights(quantized: bool, qk_norm: bool, use_rope: bool,
                  window_left: int) -> ops.DecoderLayerWeights:
    qkv_rows = (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM
    norm = lambda n: 1 + 0.1 * torch.randn(n)  # noqa: E731
    return ops.DecoderLayerWeights(
        input_norm=norm(HIDDEN), pre_feedforward_norm=norm(HIDDEN),
        qkv=projection(qkv_rows, HIDDEN, quantized, bias=True),
        o=projection(HIDDEN, N_HEADS * HEAD_DIM, quantized, bias=False),
        gate_up=projection(2 * INTERMEDIATE, HIDDEN, quantized, bias=False),
        down=projection(HIDDEN, INTERMEDIATE, quantized, bias=False),
        n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, eps=1e-5, use_rope=use_rope,
        window_left=window_left, q_norm=norm(HEAD_DIM) if qk_norm else None,
        k_norm=norm(HEAD_DIM) if qk_norm else None)


def as_dtype(layer: ops.DecoderLayerWeights, dtype: torch.dtype) -> ops.DecoderLayerWeights:
    """Float tensors in ``dtype`` (the activations'); quantized blocks as they are."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    parts = lambda ps: [ops.ProjectionPart(p.weight if p.weight_type is not None  # noqa: E731
                                           else p.weight.to(dtype), p.weight_type, cast(p.bias))
                        for p in ps]
    return ops.DecoderLayerWeights(
        input_norm=cast(layer.input_norm), pre_feedforward_norm=cast(layer.pre_feedforward_norm),
        qkv=parts(layer.qkv), o=parts(layer.o), gate_up=parts(layer.gate_up),
        down=parts(layer.down), n_heads=layer.n_heads, n_kv_heads=layer.n_kv_heads,
        head_dim=layer.head_dim, eps=layer.eps, use_rope=layer.use_rope,
        window_left=layer.window_left, q_norm=cast(layer.q_norm), k_norm=cast(layer.k_norm))


def steps() -> list[dict]:
    """Two sequences: a prefill of 7 and 3 tokens, then one decoded token each."""
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)

    def step(starts: list[int], lens: list[int], keys_are_new: bool) -> dict:
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        slots = tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        return dict(positions=positions, slot_mapping=slots, block_tables=tables,
                    cu_seqlens_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                              dtype=torch.int32),
                    max_seqlen_q=max(lens), keys_are_new=keys_are_new,
                    seq_lens=torch.tensor([s + n for s, n in zip(starts, lens)],
                                          dtype=torch.int32))
    return [step([0, 0], [7, 3], True), step([7, 3], [1, 1], False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("variant", ["plain", "qk_norm+nope", "window+pre_rope"])
def test_decoder_layers_match_their_float64_twin(dtype, quantized, variant):
    qk_norm, pre_rope = "qk_norm" in variant, "pre_rope" in variant
    layers = [layer_weights(quantized, qk_norm, use_rope=True, window_left=-1),
              layer_weights(quantized, qk_norm, use_rope="nope" not in variant,
                            window_left=2 if "window" in variant else -1)]
    layers = [as_dtype(layer, dtype) for layer in layers]
    cos_sin = ops.rope_cos_sin_cache(16, HEAD_DIM)
    shape = (len(layers), NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    # Unwritten slots poisoned: a read of one would turn the outputs NaN.
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    bound = ops.DecoderLayers(layers)
    assert len(bound) == 2
    for step in steps():
        x = torch.randn(step["positions"].shape[0], HIDDEN).to(dtype)
        out, residual = bound(x.clone(), None, **step, k_cache=k_cache, v_cache=v_cache,
                              cos_sin_caches=[cos_sin], pre_rope=pre_rope)
        want, want_residual, ref_k, ref_v = reference.decoder_layers(
            layers, x, None, **step, k_cache=ref_k, v_cache=ref_v, cos_sin_caches=[cos_sin],
            pre_rope=pre_rope)
        tolerance = 2e-3 if dtype == torch.float32 else 6e-2
        for got, expected in ((out, want), (residual, want_residual)):
            assert got.dtype == dtype and torch.isfinite(got).all()
            err = (got.double() - expected).abs().max() / expected.abs().max()
            assert err < tolerance, f"relative error {err:.3g}"
        written = ~torch.isnan(ref_k)
        assert torch.equal(written, ~torch.isnan(k_cache))
        torch.testing.assert_close(k_cache[written].double(), ref_k[written].double(),
                                   rtol=tolerance, atol=tolerance)


def test_a_decode_layer_is_nine_fastllm_ops():
    """A Qwen3 layer (q/k norms, RoPE) at decode: each step one fastllm op and no other compute
    op (views aside), so on CUDA one kernel each (attention adds its merge of key splits, and
    cuBLAS a split-K reduction, where they split)."""
    layers = [layer_weights(False, True, True, -1) for _ in range(2)]
    layers = [dataclasses.replace(layer, qkv=[dataclasses.replace(layer.qkv[0], bias=None)])
              for layer in layers]
    shape = (len(layers), NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    caches = dict(k_cache=torch.zeros(shape), v_cache=torch.zeros(shape))
    bound = ops.DecoderLayers(layers)
    prefill, decode = steps()
    table = ops.rope_cos_sin_cache(16, HEAD_DIM)
    bound(torch.randn(10, HIDDEN), None, **prefill, **caches, cos_sin_caches=[table], pre_rope=False)
    x = torch.randn(2, HIDDEN)
    with OpLog() as log:
        bound(x, None, **decode, **caches, cos_sin_caches=[table], pre_rope=False)
    layer = ["fastllm::add_rms_norm", "fastllm::linear", "fastllm::rotary_and_cache",
             "fastllm::paged_attention", "fastllm::linear", "fastllm::add_rms_norm",
             "fastllm::linear", "fastllm::silu_and_mul", "fastllm::linear"]
    assert log.names == ["fastllm::rms_norm", *layer[1:], *layer], log.names


def test_the_residual_stream_continues_from_the_caller():
    """Given a residual stream, the first norm adds x into it in place (a model split into
    several calls)."""
    layers = [layer_weights(False, False, True, -1)]
    step = steps()[0]
    shape = (1, NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    caches = dict(k_cache=torch.zeros(shape), v_cache=torch.zeros(shape))
    x, stream = torch.randn(10, HIDDEN), torch.randn(10, HIDDEN)
    residual = stream.clone()
    out, got_residual = ops.DecoderLayers(layers)(
        x.clone(), residual, **step, **caches, cos_sin_caches=[ops.rope_cos_sin_cache(16, HEAD_DIM)],
        pre_rope=False)
    want, want_residual, _, _ = reference.decoder_layers(
        layers, x, stream, **step, **caches, cos_sin_caches=[ops.rope_cos_sin_cache(16, HEAD_DIM)],
        pre_rope=False)
    assert got_residual.data_ptr() == residual.data_ptr()  # updated in place
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_residual.double(), want_residual, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad, error, match", [
    (dict(layers=[]), TypeError, "non-empty"),
    (dict(n_kv_heads=3), ValueError, "multiple of n_kv_heads"),
    (dict(qkv=[]), TypeError, "qkv must be a non-empty"),
    (dict(q_norm=torch.ones(HEAD_DIM)), ValueError, "q_norm and k_norm come together"),
    (dict(down=[ops.ProjectionPart(torch.zeros(4, 34, dtype=torch.uint8), -3)]), ValueError,
     "weight_type must be a ggml type id"),
])
def test_bad_layers_are_refused(bad, error, match):
    layer = layer_weights(False, False, True, -1)
    fields = {**layer.__dict__, **{k: v for k, v in bad.items() if k != "layers"}}
    layers = bad["layers"] if "layers" in bad else [ops.DecoderLayerWeights(**fields)]
    with pytest.raises(error, match=match):
        ops.DecoderLayers(layers)


def test_caches_of_another_layer_count_are_refused():
    layers = [layer_weights(False, False, True, -1)] * 2
    shape = (3, NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must be \[num_layers=2"):
        ops.DecoderLayers(layers)(torch.randn(10, HIDDEN), None, **steps()[0],
                                  k_cache=torch.zeros(shape), v_cache=torch.zeros(shape),
                                  cos_sin_caches=[ops.rope_cos_sin_cache(16, HEAD_DIM)],
                                  pre_rope=False)
