"""Model code: the config read from HF ``config.json``, the decoder every family runs
(:mod:`fastllm.models.families`: Llama, Qwen, Gemma, Phi-3, OLMo 2, their mixtures of experts),
its loaders and the model pool.

``load_model(folder)`` reads a HF safetensors checkpoint (or ``load_model(file.gguf)`` a llama.cpp
GGUF file) into a :class:`DecoderLM`, which runs packed batches against a paged KV cache, each
step described by a :class:`fastllm.ops.DecoderStep`. Given a :class:`TensorParallel`, either
loader builds one rank's Megatron-style shard of the model (:mod:`fastllm.models.tensor_parallel`).
"""

from fastllm.models.build import build_model, hf_weight_map
from fastllm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from fastllm.models.gguf import load_gguf
from fastllm.models.decoder import DecoderLM
from fastllm.models.loader import load_model
from fastllm.models.tensor_parallel import TensorParallel

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderLM", "ModelConfig", "RopeScaling",
           "TensorParallel", "build_model", "hf_weight_map", "load_gguf", "load_model"]
