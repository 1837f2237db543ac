"""Plain-PyTorch twins of the fastllm ops: the readable spec and the tests' oracle.

They favour clarity over speed (a loop over sequences, ``repeat_interleave`` for GQA, a
materialized mask) and compute in the dtype of their inputs, so a float64 call is the exact
reference and a call in the kernel's dtype is the "plain composition" tolerances are judged by.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(len_q: int, len_k: int, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Tensor:
    """Additive bottom-right causal mask ``[len_q, len_k]``: 0 where ``j <= i + len_k - len_q``."""
    return torch.full((len_q, len_k), float("-inf"), dtype=dtype, device=device).triu(
        len_k - len_q + 1
    )


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
              max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = True,
              scale: float | None = None, window_left: int = -1) -> Tensor:
    """Twin of :func:`fastllm.ops.attention`."""
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
