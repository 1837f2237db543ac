"""Plain-PyTorch twins of the fastllm ops: the readable spec and the tests' oracle.

They favour clarity over speed (a loop over sequences, ``repeat_interleave`` for GQA, a
materialized mask) and compute in the dtype of their inputs, so a float64 call is the exact
reference and a call in the kernel's dtype is the "plain composition" tolerances are judged by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fastllm.ops.collectives import all_reduce
from fastllm.ops.decoder_layers import DecoderLayer, DecoderStep, ProjectionLoRA, ProjectionPart
from fastllm.ops.quantized_ops import BLOCK_FORMATS, FP8_E4M3


def causal_mask(len_q: int, len_k: int, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Tensor:
    """Additive bottom-right causal mask ``[len_q, len_k]``: 0 where ``j <= i + len_k - len_q``."""
    return torch.full((len_q, len_k), float("-inf"), dtype=dtype, device=device).triu(
        len_k - len_q + 1
    )


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
              max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = True,
              scale: float | None = None, window_left: int = -1, softcap: float = 0.0) -> Tensor:
    """Twin of :func:`fastllm.ops.attention`; the soft-cap as HF's Gemma 2 eager attention
    applies it (scaled scores divided by ``softcap``, tanh, times ``softcap``, then the mask)."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    group = n_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0 or len_k == 0:
            continue
        keys = k[k0:k1].repeat_interleave(group, dim=1)  # [len_k, n_heads, head_dim]
        values = v[k0:k1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], keys) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        diag = torch.arange(len_q, device=q.device)[:, None] + (len_k - len_q)
        key = torch.arange(len_k, device=q.device)[None, :]
        visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device)
        if causal:
            visible &= key <= diag
        if window_left >= 0:
            visible &= key >= diag - window_left
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        probs = probs.masked_fill(~visible, 0.0)  # rows that see nothing: 0, not NaN
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def gather_paged(cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    """The packed ``[sum(seq_lens), n_kv_heads, head_dim]`` rows that paged caches hold."""
    rows = []
    block_size = cache.shape[1]
    for table, length in zip(block_tables.tolist(), seq_lens.tolist()):
        blocks = cache[torch.tensor(table[: -(-length // block_size)], dtype=torch.long,
                                    device=cache.device)]
        rows.append(blocks.flatten(0, 1)[:length])
    return torch.cat(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int, *,
                    causal: bool = True, scale: float | None = None,
                    window_left: int = -1, rotary_cos_sin_cache: Tensor | None = None,
                    rotary_is_neox: bool = True, softcap: float = 0.0) -> Tensor:
    """Twin of :func:`fastllm.ops.paged_attention`: gather the keys (rotating pre-RoPE keys by
    their positions in their sequences), then :func:`attention` in q's dtype (a cache of
    another dtype converted to it)."""
    cu_seqlens_k = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0)).to(torch.int32)
    keys = gather_paged(k_cache, block_tables, seq_lens)
    if rotary_cos_sin_cache is not None:
        positions = torch.cat([torch.arange(n, device=q.device) for n in seq_lens.tolist()]
                              + [torch.zeros(0, dtype=torch.long, device=q.device)])
        # float32 at least, as the kernels rotate (a float64 oracle stays float64)
        keys, _ = rotary_embedding(positions, keys.to(torch.promote_types(keys.dtype,
                                                                          torch.float32)),
                                   None, rotary_cos_sin_cache, is_neox=rotary_is_neox)
    values = gather_paged(v_cache, block_tables, seq_lens)
    return attention(q, keys.to(q.dtype), values.to(q.dtype), cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, int(seq_lens.max()) if len(seq_lens) else 0, causal=causal,
                     scale=scale, window_left=window_left, softcap=softcap)


def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Twin of :func:`fastllm.ops.reshape_and_cache`; returns updated copies of the caches (rows
    rounded to the caches' dtype by the assignment, as ``Tensor.to`` rounds)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]
    return k_cache, v_cache


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Twin of :func:`fastllm.ops.linear`: the product in float32, rounded to x's dtype."""
    out = torch.nn.functional.linear(x.float(), weight.float(),
                                     None if bias is None else bias.float())
    return out.to(x.dtype)


def add_lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor,
             token_slots: Tensor) -> Tensor:
    """Twin of :func:`fastllm.ops.add_lora`, token by token in float64: returns y plus each
    token's LoRA (y itself unchanged), the shrink ``lora_a[s] @ x[t]`` rounded to x's dtype as
    the op rounds it."""
    out = y.to(torch.float64, copy=True)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            h = (lora_a[s].double() @ x[t].double()).to(x.dtype).double()
            out[t] += lora_b[s].double() @ h
    return out


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor | None, cos_sin_cache: Tensor, *,
                     is_neox: bool = True, rotary_dim: int | None = None
                     ) -> tuple[Tensor, Tensor | None]:
    """Twin of :func:`fastllm.ops.rotary_embedding`; returns rotated copies of q and k."""
    rot = cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim
    half = rot // 2
    cos_sin = cos_sin_cache[positions.long()].to(q.dtype)[:, None, :]  # [tokens, 1, rot]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]

    def rotate(x: Tensor) -> Tensor:
        x = x.clone()
        if is_neox:
            x1, x2 = x[..., :half].clone(), x[..., half:rot].clone()
            x[..., :half] = x1 * cos - x2 * sin
            x[..., half:rot] = x2 * cos + x1 * sin
        else:
            x1, x2 = x[..., 0:rot:2].clone(), x[..., 1:rot:2].clone()
            x[..., 0:rot:2] = x1 * cos - x2 * sin
            x[..., 1:rot:2] = x2 * cos + x1 * sin
        return x

    return rotate(q), None if k is None else rotate(k)


def rotary_and_cache(positions: Tensor, q: Tensor, key: Tensor, value: Tensor, k_cache: Tensor,
                     v_cache: Tensor, slot_mapping: Tensor, cos_sin_cache: Tensor | None,
                     q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                     eps: float = 1e-6, *, is_neox: bool = True, rotate_keys: bool = True
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Twin of :func:`fastllm.ops.rotary_and_cache`; returns ``(q, key, k_cache, v_cache)``
    as updated copies."""
    if q_norm is not None:
        q, key = rms_norm(q, q_norm, eps), rms_norm(key, k_norm, eps)
    if cos_sin_cache is not None:
        q, rotated = rotary_embedding(positions, q, key if rotate_keys else None, cos_sin_cache,
                                      is_neox=is_neox)
        key = rotated if rotate_keys else key
    return (q, key, *reshape_and_cache(key, value, k_cache, v_cache, slot_mapping))


_MASK32 = 0xFFFFFFFF


def philox_uniform(seed: int, offset: int) -> float:
    """The uniform number in [0, 1) that row sampling draws for ``(seed, offset)``.

    Philox4x32-10 (Salmon et al., Random123) with key ``(seed mod 2^32, seed >> 32)`` and counter
    ``(offset mod 2^32, offset >> 32, 0, 0)``, both taken as unsigned 64-bit; 53 bits of the
    first two output words make the double.
    """
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    k0, k1 = seed & _MASK32, seed >> 32
    c0, c1, c2, c3 = offset & _MASK32, offset >> 32, 0, 0
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32)
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return ((c0 >> 5) * 67108864.0 + (c1 >> 6)) / 9007199254740992.0


def is_greedy(temperature: float) -> bool:
    """Whether a row takes the argmax: temperature 0, or one so small that its float32
    reciprocal (the kernels' scale) overflows."""
    scale = torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32)
    return temperature == 0 or bool(scale.isinf())


def filtered_probs(logits: Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float) -> Tensor:
    """The distribution one row is sampled from (see :func:`fastllm.ops.sample`), in the dtype
    of ``logits``; for a greedy row (:func:`is_greedy`), a one-hot on the first maximum."""
    vocab = logits.shape[-1]
    if is_greedy(temperature):
        return torch.nn.functional.one_hot(logits.argmax(), vocab).to(logits.dtype)
    x = logits / temperature
    keep = torch.ones(vocab, dtype=torch.bool, device=logits.device)
    if 0 < top_k < vocab:
        keep &= x >= x.topk(top_k).values[-1]
    if top_p < 1:
        probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
        # Mass of the tokens strictly more likely than each token: its tie group's start.
        sorted_probs, order = probs.sort(descending=True)
        exclusive = sorted_probs.cumsum(0) - sorted_probs
        first_of_tie = torch.searchsorted(-sorted_probs, -sorted_probs, side="left")
        mass_above = torch.empty_like(probs)
        mass_above[order] = exclusive[first_of_tie]
        keep &= mass_above < top_p
    if min_p > 0:
        keep &= x >= x.max() + math.log(min_p)
    return x.masked_fill(~keep, float("-inf")).softmax(-1)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
           seeds: Tensor, offsets: Tensor) -> Tensor:
    """Twin of :func:`fastllm.ops.sample`: the filtered distribution, inverted at the row's
    Philox uniform in vocabulary order."""
    tokens = []
    for r in range(logits.shape[0]):
        probs = filtered_probs(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]),
                               float(min_p[r]))
        if is_greedy(float(temperature[r])):
            tokens.append(int(probs.argmax()))
            continue
        u = philox_uniform(int(seeds[r]), int(offsets[r]))
        cdf = probs.cumsum(0)
        token = int(torch.searchsorted(cdf, cdf.new_tensor(u * float(cdf[-1])), right=True))
        tokens.append(min(token, int(probs.nonzero().max())))  # never past the last kept token
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)


def sample_with_logprobs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                         min_p: Tensor, seeds: Tensor, offsets: Tensor, num_logprobs: int
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Twin of :func:`fastllm.ops.sample_with_logprobs`."""
    tokens = sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    batch = logits.shape[0]
    token_logprobs = torch.empty(batch, dtype=logits.dtype, device=logits.device)
    top_ids = torch.full((batch, num_logprobs), -1, dtype=torch.int64, device=logits.device)
    top_logprobs = torch.full((batch, num_logprobs), float("-inf"), dtype=logits.dtype,
                              device=logits.device)
    for r in range(batch):
        if is_greedy(float(temperature[r])):
            logprobs = logits[r].log_softmax(-1)
        else:
            logprobs = filtered_probs(logits[r], float(temperature[r]), int(top_k[r]),
                                      float(top_p[r]), float(min_p[r])).log()
        token_logprobs[r] = logprobs[tokens[r]]
        # Most likely first, ties by lower id (a stable sort of the negated values).
        order = torch.sort(-logprobs, stable=True).indices[:num_logprobs]
        order = order[logprobs[order] > float("-inf")]
        top_ids[r, : len(order)] = order
        top_logprobs[r, : len(order)] = logprobs[order]
    return tokens, token_logprobs, top_ids, top_logprobs


def apply_penalties(logits: Tensor, prompt_mask: Tensor, output_counts: Tensor,
                    repetition_penalty: Tensor, frequency_penalty: Tensor,
                    presence_penalty: Tensor, logit_bias: Tensor | None = None) -> Tensor:
    """Twin of :func:`fastllm.ops.apply_penalties`; returns a penalized copy."""
    x = logits.clone()
    if logit_bias is not None:
        x += logit_bias.to(x.dtype)
    seen = prompt_mask | (output_counts > 0)
    penalty = repetition_penalty.to(x.dtype)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    x -= frequency_penalty.to(x.dtype)[:, None] * output_counts.to(x.dtype)
    x -= presence_penalty.to(x.dtype)[:, None] * (output_counts > 0).to(x.dtype)
    return x


def _bits(q: Tensor, shifts: list[int], width: int) -> Tensor:
    """Bits ``[shift, shift + width)`` of each byte of ``q [..., n]``, for each shift:
    ``[..., len(shifts), n]``."""
    return (q.unsqueeze(-2) >> torch.tensor(shifts).view(-1, 1)) & ((1 << width) - 1)


def dequantize(weight: Tensor, weight_type: int) -> Tensor:
    """Twin of :func:`fastllm.ops.dequantize`: the rows of a block-quantized weight
    ``[out, row bytes]`` as float64 ``[out, in]`` (layouts: csrc/quantized/block_formats.h)."""
    if weight_type == FP8_E4M3:  # a float32 scale, then 32 float8_e4m3fn codes
        blocks = weight.reshape(weight.shape[0], -1, 36).cpu()
        scales = blocks[..., :4].contiguous().view(torch.float32).double()  # [R, B, 1]
        codes = blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).double()  # [R, B, 32]
        return (scales * codes).reshape(weight.shape[0], -1)
    name, values, block_bytes = BLOCK_FORMATS[weight_type]
    rows = weight.shape[0]
    blocks = weight.reshape(rows, -1, block_bytes).cpu()  # [R, B, bytes] uint8
    q = blocks.long()

    def half(start: int) -> Tensor:  # the fp16 at byte `start`: [R, B, 1]
        return blocks[..., start:start + 2].contiguous().view(torch.float16).double()

    def int8(start: int, n: int) -> Tensor:  # [R, B, n]
        return blocks[..., start:start + n].contiguous().view(torch.int8).double()

    if name == "Q8_0":
        return (half(0) * int8(2, 32)).reshape(rows, -1)
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_min, five_bits = name.endswith("_1"), name.startswith("Q5")
        start = 2 + 2 * has_min + 4 * five_bits  # after d, m and qh
        ints = _bits(q[..., start:start + 16], [0, 4], 4).flatten(-2)  # low nibbles, then high
        if five_bits:  # bit j of the little-endian qh is value j's fifth bit
            fifth = _bits(q[..., start - 4:start], list(range(8)), 1)  # [R, B, bit, byte]
            ints |= fifth.transpose(-1, -2).flatten(-2) << 4
        if has_min:
            return (half(0) * ints + half(2)).reshape(rows, -1)
        return (half(0) * (ints - (16 if five_bits else 8))).reshape(rows, -1)
    if name in ("Q4_K", "Q5_K"):
        # 6-bit scales and mins of the 8 sub-blocks: bytes 4-7 hold scales 0-3 and the top 2
        # bits of scales 4-7, bytes 8-11 the same for mins, bytes 12-15 the low 4 bits of
        # scales 4-7 (low nibbles) and mins 4-7 (high nibbles).
        first, second, low = q[..., 4:8], q[..., 8:12], q[..., 12:16]
        scales = torch.cat([first & 63, (low & 15) | (first >> 6) << 4], dim=-1)  # [R, B, 8]
        mins = torch.cat([second & 63, (low >> 4) | (second >> 6) << 4], dim=-1)
        # 32-byte runs: sub-block 2c in the low nibbles, 2c + 1 in the high ones.
        start = 16 if name == "Q4_K" else 48
        ints = _bits(q[..., start:start + 128].reshape(rows, -1, 4, 32), [0, 4], 4)
        ints = ints.reshape(rows, -1, 8, 32)
        if name == "Q5_K":  # bit s of qh byte l: the fifth bit of sub-block s's value l
            ints |= _bits(q[..., 16:48], list(range(8)), 1) << 4
        w = (half(0) * scales).unsqueeze(-1) * ints - (half(2) * mins).unsqueeze(-1)
        return w.reshape(rows, -1)
    # Q6_K, per half of 128 values: the low 4 bits of values j and 64 + j in byte j of 64, the
    # high 2 bits of value 32k + l in bits 2k, 2k + 1 of byte l of 32; an int8 scale per 16.
    low = _bits(q[..., :128].reshape(rows, -1, 2, 64), [0, 4], 4).flatten(-2)  # [R, B, 2, 128]
    high = _bits(q[..., 128:192].reshape(rows, -1, 2, 32), [0, 2, 4, 6], 2).flatten(-2)
    ints = ((low | high << 4) - 32).reshape(rows, -1, 16, 16)
    return ((half(208) * int8(192, 16)).unsqueeze(-1) * ints).reshape(rows, -1)


def quantized_linear(x: Tensor, weight: Tensor, weight_type: int,
                     bias: Tensor | None = None) -> Tensor:
    """Twin of :func:`fastllm.ops.quantized_linear`, in float64 with exact activations."""
    y = x.double().cpu() @ dequantize(weight, weight_type).T
    return y if bias is None else y + bias.double().cpu()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's ``LlamaRMSNorm`` in float64: ``weight * x / sqrt(mean(x**2) + eps)``."""
    x64 = x.double()
    return weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """The in-place op's two results, ``(rms_norm(x + residual), x + residual)``, in float64
    from the inputs as given."""
    total = x.double() + residual.double()
    return rms_norm(total, weight, eps), total


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(gate) * up`` over the halves of ``x`` ``[rows, 2 * d]``, in float64."""
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """``gelu(gate, approximate="tanh") * up`` over the halves of ``x`` ``[rows, 2 * d]``, in
    float64: ``0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))``."""
    gate, up = x.double().chunk(2, dim=-1)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    return 0.5 * gate * (1 + torch.tanh(inner)) * up


def moe(x: Tensor, router_logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
        renormalize: bool, *, gate_up_type: int | None = None,
        down_type: int | None = None) -> Tensor:
    """Twin of :func:`fastllm.ops.moe`: HF's eager ``Qwen3MoeSparseMoeBlock`` in x's dtype, so
    a float64 ``x`` gives the exact result and a low-precision one the plain composition. The
    experts are those the op picks, by float32 probabilities and ``torch.topk``, whatever x's
    dtype; their weights come from the softmax in float64 when x is. Quantized experts are
    dequantized exactly (:func:`dequantize`), then cast to x's dtype."""
    chosen = torch.softmax(router_logits.float(), -1).topk(top_k, -1).indices  # [T, top_k]
    probs = torch.softmax(router_logits.to(torch.float64 if x.dtype == torch.float64
                                           else torch.float32), -1)
    weights = probs.gather(-1, chosen)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(x.dtype)

    def expert(w: Tensor, weight_type: int | None, e: int) -> Tensor:
        w = w[e] if weight_type is None else dequantize(w[e], weight_type)
        return w.to(device=x.device, dtype=x.dtype)

    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tokens, slots = (chosen == e).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        h = torch.nn.functional.linear(x[tokens], expert(gate_up, gate_up_type, e))
        gate, up = h.chunk(2, -1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                       expert(down, down_type, e))
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def decoder_layers(layers: Sequence[DecoderLayer], x: Tensor, residual: Tensor | None,
                   step: DecoderStep, k_cache: Tensor, v_cache: Tensor, *,
                   rope_tables: Sequence[Tensor], pre_rope: bool, group_name: str | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Twin of :class:`fastllm.ops.DecoderLayers` (built from ``layers``, ``rope_tables`` and
    ``group_name``, then called), in float64 (K/V rounded to the caches' dtype as they are
    cached); returns ``(out, residual, k_cache, v_cache)``, the caches as updated copies.
    ``step.keys_are_new`` changes nothing here: attention always reads the cache. With
    ``group_name``, the o and down projections' outputs are summed over that process group, as
    the layers of a tensor-parallel rank do."""

    def reduce(x: Tensor) -> Tensor:
        return x if group_name is None else all_reduce(x, group_name)

    def project(parts: Sequence[ProjectionPart], x: Tensor,
                lora: ProjectionLoRA | None = None) -> Tensor:
        y = torch.cat([
            torch.nn.functional.linear(x, p.weight.double(),
                                       None if p.bias is None else p.bias.double())
            if p.weight_type is None else quantized_linear(x, p.weight, p.weight_type, p.bias)
            for p in parts], dim=1)
        if lora is None or step.lora_slots is None:
            return y
        return add_lora(y, x, lora.lora_a, lora.lora_b, step.lora_slots)

    def norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        return x if weight is None else rms_norm(x, weight, eps)

    def feed_forward(layer: DecoderLayer, x: Tensor) -> Tensor:
        if layer.experts is not None:
            e = layer.experts
            return moe(x, project(e.router, x), e.gate_up, e.down, e.top_k, e.renormalize,
                       gate_up_type=e.gate_up_type, down_type=e.down_type)
        activation = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}[layer.activation]
        return project(layer.down, activation(project(layer.gate_up, x, layer.gate_up_lora)),
                       layer.down_lora)

    x = x.double()
    residual = None if residual is None else residual.double()
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for i, layer in enumerate(layers):
        # The pending branch output joins the residual stream; the branch reads it normalized.
        residual = x if residual is None else residual + x
        x = norm(residual, layer.input_norm, layer.eps)
        tokens = x.shape[0]
        q, k, v = project(layer.qkv, x, layer.qkv_lora).view(tokens, -1, layer.head_dim).split(
            [layer.n_heads, layer.n_kv_heads, layer.n_kv_heads], dim=1)
        q_norm, k_norm = layer.q_norm, layer.k_norm
        if q_norm is not None and not layer.qk_norm_per_head:  # over all heads
            q = rms_norm(q.reshape(tokens, -1), q_norm, layer.eps).view(q.shape)
            k = rms_norm(k.reshape(tokens, -1), k_norm, layer.eps).view(k.shape)
            q_norm = k_norm = None
        table = rope_tables[layer.rope_table] if layer.use_rope else None
        q, k, k_cache[i], v_cache[i] = rotary_and_cache(
            step.positions, q, k, v, k_cache[i], v_cache[i], step.slot_mapping, table, q_norm,
            k_norm, layer.eps, rotate_keys=not pre_rope)
        rotation = table if pre_rope else None
        out = paged_attention(q, k_cache[i], v_cache[i], step.block_tables, step.seq_lens,
                              step.cu_seqlens_q, step.max_seqlen_q, scale=layer.scale,
                              window_left=layer.window_left, rotary_cos_sin_cache=rotation,
                              softcap=layer.softcap)
        x = norm(reduce(project(layer.o, out.reshape(tokens, -1), layer.o_lora)),
                 layer.post_attention_norm, layer.eps)
        residual = residual + x
        x = norm(residual, layer.pre_feedforward_norm, layer.eps)
        x = norm(reduce(feed_forward(layer, x)), layer.post_feedforward_norm, layer.eps)
    return x, residual, k_cache, v_cache
