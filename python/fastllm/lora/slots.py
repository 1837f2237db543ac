"""The LoRA adapters a worker holds: ``max_loras`` slots on the device, and on the host up to
``max_cpu_loras`` adapters loaded from their files.

Each of a model's projections has one :class:`fastllm.ops.ProjectionLoRA` of ``max_loras``
slots, every slot wide enough for an adapter of rank ``max_lora_rank`` on each sub-module the
projection fuses (q, k and v: three; gate and up: two). A step's adapters (the scheduler lets at
most ``max_loras`` into a step) get slots, the least recently used adapter's slot going to a new
one; a slot's rows and columns past its adapter's ranks are zeros, so every slot is read whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastllm import ops
from fastllm.lora.adapter import LORA_PROJECTIONS, LoRAAdapter, LoRARequest, load_adapter
from fastllm.models import DecoderLM

__all__ = ["LoRAConfig", "LoRASlots"]

# Sub-modules each projection fuses: its slots hold that many ranks.
_SUB_MODULES = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters, with vLLM's names.

    Attributes:
        max_loras: adapters in a step at most (each holds a slot on the device); requests of
            other adapters wait.
        max_lora_rank: the largest ``r`` an adapter may have.
        max_cpu_loras: adapters kept loaded on the host (at least ``max_loras``; None: as
            many as ``max_loras``); others are read from their files again when they run.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be None or an int >= max_loras "
                             f"({self.max_loras}), got {cpu!r}")

    @property
    def host_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


class LoRASlots:
    """``model``'s adapter slots on its device (zeros until an adapter is loaded), per layer
    the :class:`fastllm.ops.ProjectionLoRA` of each projection that can take an adapter (a
    mixture-of-experts layer's MLP takes none)."""

    def __init__(self, model: DecoderLM, config: LoRAConfig) -> None:
        self.model, self.config = model, config
        device, dtype = model.norm.weight.device, model.dtype
        shard, hidden = model.shard, model.config.hidden_size
        q = shard.n_heads * shard.head_dim
        qkv = q + 2 * shard.n_kv_heads * shard.head_dim
        inter = shard.intermediate_size
        shapes = {"qkv": (hidden, qkv), "o": (q, hidden), "gate_up": (hidden, 2 * inter),
                  "down": (inter, hidden)}  # (in, out)
        slots, rank = config.max_loras, config.max_lora_rank
        self.layers: list[dict[str, ops.ProjectionLoRA]] = []
        for moe in model.config.moe_layers:
            layer = {}
            for name in LORA_PROJECTIONS:
                if moe and name in ("gate_up", "down"):
                    continue
                width = _SUB_MODULES[name] * rank
                fan_in, fan_out = shapes[name]
                layer[name] = ops.ProjectionLoRA(
                    torch.zeros(slots, width, fan_in, dtype=dtype, device=device),
                    torch.zeros(slots, fan_out, width, dtype=dtype, device=device))
            self.layers.append(layer)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free_slots = list(range(slots - 1, -1, -1))  # slot 0 taken first
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # loaded, LRU first

    def slots(self, requests: Sequence[LoRARequest]) -> dict[int, int]:
        """The slot of each of ``requests``' adapters (by ``lora_int_id``), loading those not in
        a slot into the least recently used slots of other adapters."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, over max_loras="
                               f"{self.config.max_loras}")
        for int_id, request in wanted.items():
            if int_id in self._slot_of:
                self._slot_of.move_to_end(int_id)
                continue
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                evicted = next(i for i in self._slot_of if i not in wanted)
                slot = self._slot_of.pop(evicted)
            self._write(slot, self._adapter(request))
            self._slot_of[int_id] = slot
        return {int_id: self._slot_of[int_id] for int_id in wanted}

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter (unloaded): its host copy goes and its slot is free."""
        self._host.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.model.config, self.model.shard,
                                   max_lora_rank=self.config.max_lora_rank,
                                   dtype=self.model.dtype)
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self.config.host_capacity:
                self._host.popitem(last=False)
        else:
            self._host.move_to_end(request.lora_int_id)
        return adapter

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, weights in zip(self.layers, adapter.layers):
            for name, lora in layer.items():
                a, b = lora.lora_a[slot], lora.lora_b[slot]
                a.zero_()
                b.zero_()
                if name in weights:
                    lora_a, lora_b = weights[name]
                    rank = lora_a.shape[0]
                    a[:rank].copy_(lora_a)
                    b[:, :rank].copy_(lora_b)
