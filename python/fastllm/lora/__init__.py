"""LoRA adapters: peft adapters read into fastllm's fused-projection layout
(:mod:`fastllm.lora.adapter`), requested by vLLM's :class:`LoRARequest`, and held by a worker in
``max_loras`` slots on its device (:mod:`fastllm.lora.slots`)."""

from fastllm.lora.adapter import LORA_PROJECTIONS, LoRAAdapter, LoRARequest, load_adapter
from fastllm.lora.slots import LoRAConfig, LoRASlots

__all__ = ["LORA_PROJECTIONS", "LoRAAdapter", "LoRAConfig", "LoRARequest", "LoRASlots",
           "load_adapter"]
