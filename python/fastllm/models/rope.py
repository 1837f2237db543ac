"""The RoPE cos|sin tables of a model, default or frequency-scaled (linear, llama3).

Default RoPE is :func:`fastllm.ops.rope_cos_sin_cache`; the scaled variants compute HF's
inverse frequencies (in float64, rounded once) and lay them out the same way,
``[max_position, rotary_dim]`` with cos in the first half of each row and sin in the second.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from fastllm import ops
from fastllm.models.config import ModelConfig

__all__ = ["build_cos_sin_cache", "cos_sin_cache_from_inv_freq", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """float64 ``[rotary_dim / 2]`` inverse frequencies, scaled as HF's
    ``ROPE_INIT_FUNCTIONS``."""
    dim = config.rotary_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths above original / low_freq_factor are divided by factor, those below
    # original / high_freq_factor kept, and the band between interpolated smoothly.
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache_from_inv_freq(inv_freq: Tensor, max_position: int, *,
                                dtype: torch.dtype = torch.float32,
                                device: torch.device | str = "cpu") -> Tensor:
    """``[max_position, 2 * len(inv_freq)]`` cos|sin table for any float64 ``inv_freq``."""
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def build_cos_sin_cache(config: ModelConfig, max_positions: int, *,
                        device: torch.device | str = "cpu", local: bool = False) -> Tensor:
    """The model's float32 ``[max_positions, rotary_dim]`` table: positions ``[0,
    max_positions)``; with ``local``, its sliding layers' own (default RoPE of base
    ``rope_local_theta``, Gemma 3).

    float32 whatever the model dtype: the rotary kernel rotates in float32, and HF too computes
    cos/sin in float32. Each row depends on its position alone, so a longer table starts with
    the rows of a shorter one. RoPE parameters that give a non-finite table (a tiny
    ``rope_theta`` or scaling factor) are a ValueError.
    """
    if not 1 <= max_positions <= config.max_position_embeddings:
        raise ValueError(f"max_positions must be in [1, {config.max_position_embeddings}] (the "
                         f"model's max_position_embeddings), got {max_positions}")
    if local:
        config = dataclasses.replace(config, rope_theta=config.rope_local_theta,
                                     rope_scaling=None)
    if config.rope_scaling is None:
        table = ops.rope_cos_sin_cache(max_positions, config.rotary_dim, config.rope_theta,
                                       device=device)
    else:
        table = cos_sin_cache_from_inv_freq(rope_inv_freq(config), max_positions, device=device)
    if not torch.isfinite(table).all():
        raise ValueError(f"rope_theta={config.rope_theta} and rope_scaling={config.rope_scaling} "
                         f"give non-finite RoPE angles within {max_positions} positions")
    return table
