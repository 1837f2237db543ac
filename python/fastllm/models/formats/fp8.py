"""FP8 checkpoints of ``quant_method: "fp8"`` (DeepSeek-V3's and Qwen3's ``-FP8`` releases,
transformers' ``FineGrainedFP8Config``): each quantized Linear's ``weight`` is float8_e4m3fn
beside ``weight_scale_inv`` (float32, or bfloat16 / float16), one scale per block of
``weight_block_size = [r, c]`` (``[ceil(rows / r), ceil(cols / c)]``), or one for the whole
weight without ``weight_block_size``: ``w = fp8 * weight_scale_inv`` (the name is the
quantizer's: it divided by the scale's inverse). Layers it leaves unquantized
(``modules_to_not_convert``: the embedding, the LM head, norms, routers) are plain tensors.

The weights stay in their byte as fastllm's FP8 blocks (:data:`fastllm.ops.FP8_E4M3`, a float32
scale per 32 values: :mod:`fastllm.models.formats.float8`) wherever every 32 columns share a
scale: per tensor, and blocks of a multiple of 32 columns (DeepSeek's and Qwen3's 128), on rows
of a multiple of 32 values. Others are dequantized at load: ``fp8 * scale`` in float32 (exact
but for one rounding), then cast to the model's dtype. Activations run in the model's dtype:
``activation_scheme`` must be ``"dynamic"`` (a static scheme's activation scales would go
unused, so it is refused, as is ``fmt`` other than e4m3).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from fastllm.models.formats.base import (FP8_DTYPES, SCALE_DTYPES, CheckpointFormat,
                                         ConfigSection, StoredTensor, StoredWeight,
                                         TensorGetter)
from fastllm.models.formats.float8 import FP8Weight

__all__ = ["BlockFP8"]


class BlockFP8(CheckpointFormat):
    """A ``quant_method: "fp8"`` config (see the module's docstring)."""

    def __init__(self, config: ConfigSection) -> None:
        config.choice("activation_scheme", ("dynamic",), "dynamic",
                      "fastllm runs activations unquantized, so it loads only dynamic schemes")
        config.choice("fmt", ("e4m3",), "e4m3", "fastllm loads float8_e4m3fn weights")
        block = config.get("weight_block_size", list, None)
        if block is not None and not (len(block) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
            raise ValueError(config.refusal("weight_block_size", block,
                                            "it must be [rows, cols] of positive ints"))
        self.block = None if block is None else tuple(block)

    def stored_weight(self, hf_name: str, shape: tuple[int, ...],
                      names: Container[str]) -> StoredWeight | None:
        module = hf_name.removesuffix(".weight")
        if len(shape) != 2 or module == hf_name or f"{module}.weight_scale_inv" not in names:
            return None
        return _FP8Weight(module, *shape, self.block)


@dataclass(frozen=True)
class _FP8Weight(StoredWeight):
    """``weight`` float8 and its ``weight_scale_inv`` per block (``block``) or per tensor."""

    block: tuple[int, int] | None

    @property
    def method(self) -> str:
        return "fp8"

    @property
    def scale_block(self) -> tuple[int, int]:
        return (self.rows, self.cols) if self.block is None else self.block

    @property
    def group_columns(self) -> int | None:
        columns = self.scale_block[1]
        return None if columns >= self.cols else columns

    @property
    def tensors(self) -> tuple[StoredTensor, ...]:
        rows, cols = self.scale_block
        scale_shapes = (((), (1,)) if self.block is None
                        else ((-(-self.rows // rows), -(-self.cols // cols)),))
        return (StoredTensor(f"{self.module}.weight", FP8_DTYPES, ((self.rows, self.cols),)),
                StoredTensor(f"{self.module}.weight_scale_inv", SCALE_DTYPES, scale_shapes))

    def decode(self, get: TensorGetter) -> FP8Weight:
        rows, cols = self.scale_block
        scales = get(f"{self.module}.weight_scale_inv").reshape(
            -(-self.rows // rows), -(-self.cols // cols))
        return FP8Weight(get(f"{self.module}.weight"), scales, self.scale_block,
                         f"{self.module}.weight")
