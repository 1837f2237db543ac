"""The quantized checkpoints GPU users download, loaded as they are stored: the safetensors
loader (:mod:`fastllm.models.loader`) reads ``quantization_config`` in ``config.json`` and asks
its format how each weight is held.

- ``compressed-tensors``: int4 (W4A16, symmetric or with zero points) and int8 (W8A16, W8A8)
  weights, pack-, int- or naive-quantized; FP8 (W8A8, per tensor, channel or block),
  float-quantized.
- ``fp8``: FP8 with a ``weight_scale_inv`` per 128x128 block, or per tensor.
- ``gptq``: 4 and 8 bits, v1 and v2 zero points, with or without ``desc_act``.
- ``awq``: 4 bits, AutoAWQ's GEMM layout.

Integer weights are repacked into ggml blocks, run by fastllm's quantized matmul, wherever the
blocks decode to the checkpoint's values bit for bit (:mod:`fastllm.models.formats.integers`):
symmetric int4 as Q4_0, int4 with zero points as Q4_1 (or Q8_0), int8 as Q8_0, given groups a
multiple of 32 columns in their stored order and fp16 scales. FP8 weights (``fp8`` per tensor
or per block, compressed-tensors' per tensor, channel, group or block) stay 1 byte a value in
fastllm's FP8 blocks (:data:`fastllm.ops.FP8_E4M3`, a float32 scale per 32 values, run by the
same matmul: :mod:`fastllm.models.formats.float8`) wherever every 32 columns share a scale:
tensor and channel scales, blocks and groups of a multiple of 32 columns, on rows of a multiple
of 32 values, a mixture of experts' experts too (:func:`fastllm.ops.moe` takes the same
blocks). The others are dequantized at load (in float32, then the model's dtype). Layers the
checkpoint leaves unquantized (compressed-tensors' ``ignore``, ``modules_to_not_convert``,
usually the LM head) are plain tensors. Any other ``quant_method`` (bitsandbytes, hqq, ...) is
refused naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastllm.models.formats.base import (CheckpointFormat, ConfigSection, StoredTensor,
                                         StoredWeight)
from fastllm.models.formats.compressed_tensors import CompressedTensors
from fastllm.models.formats.fp8 import BlockFP8
from fastllm.models.formats.gptq import AWQ, GPTQ

__all__ = ["FORMATS", "CheckpointFormat", "StoredTensor", "StoredWeight", "checkpoint_format"]

# quant_method -> its format
FORMATS: dict[str, type[CheckpointFormat]] = {
    "compressed-tensors": CompressedTensors, "fp8": BlockFP8, "gptq": GPTQ, "awq": AWQ}


def checkpoint_format(folder: Path) -> CheckpointFormat | None:
    """The format of the HF model folder ``folder``'s ``config.json`` (already read by
    :meth:`~fastllm.models.ModelConfig.from_pretrained`): None without a
    ``quantization_config``. A method fastllm does not load, or a setting of one it does not
    support, is a ValueError (TypeError: a value of the wrong kind) naming the file, the field
    and the value."""
    path = folder / "config.json"
    settings = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    if settings is None:
        return None
    try:
        config = ConfigSection.of(settings, "quantization_config")
        method = config.get("quant_method", str)
        if method not in FORMATS:
            raise ValueError(config.refusal(
                "quant_method", method, f"fastllm loads {', '.join(FORMATS)} checkpoints; for "
                "another, load the float model (quantization='int8' or 'int4' quantizes it at "
                "load)"))
        return FORMATS[method](config)
    except (TypeError, ValueError) as error:
        kind = ValueError if isinstance(error, ValueError) else TypeError
        raise kind(f"{path}: {error}") from error
