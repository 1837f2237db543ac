"""Rotary position embedding (``csrc/rotary``): :func:`rotary_embedding`, its table
:func:`rope_cos_sin_cache`, and :func:`rotary_and_cache`, an attention block's steps between
its QKV projection and attention in one op."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastllm.ops.fake_kernels import check_one_device, fake_kernel

__all__ = ["rope_cos_sin_cache", "rotary_and_cache", "rotary_embedding"]


def rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor | None,
    cos_sin_cache: Tensor,
    *,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> None:
    """Applies rotary position embedding to ``q`` and ``k`` in place.

    Args:
        positions: int64 or int32 ``[tokens]``, each in ``[0, cos_sin_cache.shape[0])``.
        q: ``[tokens, n_heads, head_dim]``; k: ``[tokens, n_kv_heads, head_dim]`` or None.
            Strided views (for example slices of a fused QKV projection) are rotated in place;
            ``q`` and ``k`` sharing an element, or either reaching one element through several
            indices (an expanded tensor), is a ``ValueError`` (it would be rotated twice).
        cos_sin_cache: ``[max_position, rotary_dim]``, cos in the first half of each row and sin
            in the second (see :func:`rope_cos_sin_cache`).
        is_neox: True rotates channel ``i`` with ``i + rotary_dim/2`` (HF Llama/Qwen); False
            rotates interleaved pairs ``(2i, 2i+1)`` (llama2.c, GGUF).
        rotary_dim: channels rotated per head (the first ones; the rest pass through). Defaults
            to ``cos_sin_cache.shape[1]`` and must equal it when given.
    """
    torch.ops.fastllm.rotary_embedding.default(
        positions, q, k, cos_sin_cache, is_neox=bool(is_neox),
        rotary_dim=None if rotary_dim is None else int(rotary_dim),
    )


@fake_kernel("rotary_embedding")
def _rotary_embedding_fake(positions, q, k, cos_sin_cache, *, is_neox=True, rotary_dim=None):
    check_one_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)


def rotary_and_cache(
    positions: Tensor,
    q: Tensor,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    cos_sin_cache: Tensor | None,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
    *,
    is_neox: bool = True,
    rotate_keys: bool = True,
) -> None:
    """An attention block's steps between its QKV projection and attention, in one op.

    ``q`` and ``key`` are RMS-normalized per head by ``q_norm`` / ``k_norm`` if given (Qwen3's
    q/k norms, :func:`rms_norm`'s arithmetic), then rotated in place as
    :func:`rotary_embedding` rotates them if ``cos_sin_cache`` is given (``key`` only with
    ``rotate_keys``; False leaves the cached keys before RoPE, for
    :func:`paged_attention`'s ``rotary_cos_sin_cache``); then ``key`` and ``value`` are written
    to their cache slots as :func:`reshape_and_cache` writes them. The same result as those
    three ops in that order; on CUDA one kernel instead of four.

    Args:
        positions: int64 or int32 ``[tokens]``.
        q: ``[tokens, n_heads, head_dim]``; key, value: ``[tokens, n_kv_heads, head_dim]``, one
            dtype (strided views of one projection are fine; q and key are updated in place).
        k_cache, v_cache, slot_mapping: as :func:`reshape_and_cache` takes them.
        cos_sin_cache: as :func:`rotary_embedding` takes it, or None (no RoPE: a NoPE layer).
        q_norm, k_norm: ``[head_dim]`` weights in q's dtype, both or neither.
        eps: the norms' epsilon.
    """
    torch.ops.fastllm.rotary_and_cache.default(
        positions, q, key, value, k_cache, v_cache, slot_mapping, cos_sin_cache, q_norm, k_norm,
        float(eps), is_neox=bool(is_neox), rotate_keys=bool(rotate_keys))


@fake_kernel("rotary_and_cache")
def _rotary_and_cache_fake(positions, q, key, value, k_cache, v_cache, slot_mapping,
                           cos_sin_cache, q_norm=None, k_norm=None, eps=1e-6, *, is_neox=True,
                           rotate_keys=True):
    check_one_device(positions=positions, q=q, key=key, value=value, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping, cos_sin_cache=cos_sin_cache)


def rope_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """The ``[max_position, rotary_dim]`` cos|sin table :func:`rotary_embedding` reads.

    Frequencies are ``base ** (-2i / rotary_dim)`` as in HF transformers' default RoPE; computed
    in float64 and rounded once to ``dtype``.
    """
    if max_position <= 0 or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"need max_position > 0 and an even rotary_dim > 0, got {max_position=}, {rotary_dim=}"
        )
    if not (base > 0 and math.isfinite(base)):
        raise ValueError(f"base must be a positive number, got {base}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)
