"""The attention ops: :func:`attention` over packed sequences, :func:`paged_attention` over
paged KV caches, and :func:`reshape_and_cache`, which writes those caches (``csrc/attention``,
``csrc/kv_cache``)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["attention", "paged_attention", "reshape_and_cache"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    out: Tensor | None = None,
) -> Tensor:
    """Attention over packed variable-length sequences (flash-attention's varlen layout).

    Args:
        q: ``[total_q, n_heads, head_dim]``, sequences packed back to back, no padding.
        k, v: ``[total_k, n_kv_heads, head_dim]``; ``n_heads % n_kv_heads == 0`` (GQA/MQA: query
            head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``, by index, never copied).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` offsets of each sequence (start at 0,
            non-decreasing, end at the packed totals). Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: upper bounds of the per-sequence lengths.
        causal: bottom-right aligned causal mask: query ``i`` of a sequence with ``len_q``
            queries and ``len_k`` keys sees keys ``j <= i + len_k - len_q``, so prefill, chunked
            prefill and decode are the same op. Computed from indices, never materialized.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        window_left: ``>= 0`` restricts query ``i`` to keys ``j >= i + len_k - len_q - window_left``
            (sliding window); ``-1`` disables it.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): ``> 0`` turns each
            scaled score ``s = scale * q . k`` into ``softcap * tanh(s / softcap)`` before the
            mask and the softmax; ``0`` (the default) disables it. Other values must lie in
            float32's normal range: negative, NaN or infinite ones are a ``ValueError``.
        out: optional preallocated result (q's shape, dtype and device; any strides), written
            in place and returned, so a decode loop allocates nothing.

    Returns:
        ``[total_q, n_heads, head_dim]`` in q's dtype (float32, bfloat16 or float16; float32
        accumulation). A query that sees no key (``len_k == 0``, or rows above the diagonal when
        ``len_q > len_k``) gets zeros, as in flash-attention.
    """
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    kwargs = dict(causal=bool(causal), scale=None if scale is None else float(scale),
                  window_left=int(window_left), softcap=float(softcap))
    if out is None:
        return torch.ops.fastllm.attention.default(*args, **kwargs)
    torch.ops.fastllm.attention_out.default(*args, **kwargs, out=out)
    return out


@fake_kernel("attention")
def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal=True, scale=None, window_left=-1, softcap=0.0):
    check_one_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return q.new_empty(q.shape)


@fake_kernel("attention_out")
def _attention_out_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal=True, scale=None, window_left=-1, out, softcap=0.0):
    check_one_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    window_left: int = -1,
    rotary_cos_sin_cache: Tensor | None = None,
    rotary_is_neox: bool = True,
    softcap: float = 0.0,
) -> Tensor:
    """:func:`attention` with each sequence's keys read from paged caches through its block table.

    Args:
        q: ``[total_q, n_heads, head_dim]``, packed as in :func:`attention`.
        k_cache, v_cache: ``[num_blocks, block_size, n_kv_heads, head_dim]``; key ``j`` of
            sequence ``b`` is in block ``block_tables[b, j // block_size]`` at offset
            ``j % block_size`` (written there by :func:`reshape_and_cache`). In q's dtype, or,
            under float32 q, in bfloat16 or float16 (vLLM's ``kv_cache_dtype``): read back as
            float32, exactly, so the result is that of float32 K/V holding the stored values
            (the CPU kernel and the composite; on CUDA the caches must be in q's dtype).
        block_tables: int32 ``[batch, max_blocks_per_seq]``; entries past a sequence's length
            are never read.
        seq_lens: int32 ``[batch]``, each sequence's number of keys, its new queries' own tokens
            included.
        cu_seqlens_q, max_seqlen_q: the queries' offsets and longest length, as in
            :func:`attention`.
        rotary_cos_sin_cache: position-independent (pre-RoPE) mode: the caches hold keys
            *before* rotary embedding, and key ``j`` of each sequence is rotated by position ``j``
            as it is read, with this float32 ``[max_position, rotary_dim]`` table (the layout
            of :func:`rope_cos_sin_cache`; channels past ``rotary_dim`` are not rotated). The
            queries must come already rotated by their own positions. Cached keys then carry no
            position, so a cached chunk can be placed at any offset of any sequence.
        rotary_is_neox: the pairing of rotated channels, as in :func:`rotary_embedding`.
        softcap: logit soft-capping, as in :func:`attention` (``0``: off).

    Decode is one query per sequence; chunked prefill is many queries against a cached prefix
    plus themselves; the bottom-right causal mask, sliding window, soft-cap and GQA are those
    of :func:`attention`.
    """
    return torch.ops.fastllm.paged_attention.default(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, int(max_seqlen_q),
        causal=bool(causal), scale=None if scale is None else float(scale),
        window_left=int(window_left), rotary_cos_sin_cache=rotary_cos_sin_cache,
        rotary_is_neox=bool(rotary_is_neox), softcap=float(softcap))


@fake_kernel("paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, *, causal=True, scale=None, window_left=-1,
                          rotary_cos_sin_cache=None, rotary_is_neox=True, softcap=0.0):
    check_one_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                      rotary_cos_sin_cache=rotary_cos_sin_cache)
    return q.new_empty(q.shape)


def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Writes new tokens' K and V rows into their cache slots, in place.

    Args:
        key, value: ``[tokens, n_kv_heads, head_dim]``, one dtype.
        k_cache, v_cache: ``[num_blocks, block_size, n_kv_heads, head_dim]``, in key's dtype
            or, under float32 key and value, in bfloat16 or float16: each value is then rounded
            to nearest even, as ``Tensor.to`` rounds.
        slot_mapping: int64 ``[tokens]``; token ``t`` goes to block ``slot // block_size``,
            offset ``slot % block_size``; a negative slot skips the token (padding). A slot past
            the cache is a ``ValueError`` and nothing is written.

    Caches that share memory with each other or with ``key`` / ``value``, or that reach one
    element through several indices (an expanded tensor), are a ``ValueError``.
    """
    torch.ops.fastllm.reshape_and_cache.default(key, value, k_cache, v_cache, slot_mapping)


@fake_kernel("reshape_and_cache")
def _reshape_and_cache_fake(key, value, k_cache, v_cache, slot_mapping):
    check_one_device(k_cache=k_cache, key=key, value=value, v_cache=v_cache,
                      slot_mapping=slot_mapping)
