"""Megatron-style tensor parallelism: which part of a model each rank holds, and the collectives
that join the parts.

A rank holds, of every layer, its share of the attention heads (the fused QKV projection's rows
of its query heads and of the key/value heads they read) and of the MLP's intermediate features
(gate/up rows): column-parallel, so attention needs no communication. The output and down
projections hold the matching input columns (row-parallel): each rank's product is a partial
sum, all-reduced once per projection (by the C++ decoder loop, :class:`fastllm.ops.
DecoderLayers`). The embedding and LM head hold a contiguous range of vocabulary rows: a lookup
is masked to the rank's rows, then all-reduced; the logits are computed locally, then gathered,
so every rank gets the full vocabulary's. Norms are replicated; a row-parallel bias lives on
rank 0 only, so it is added once.

Key/value heads fewer than the ranks are replicated: each rank keeps the one its query heads
read. A vocabulary that does not divide among the ranks is padded with zero rows, whose logits
are cut off after the gather.

The collectives are torch's functional ones (:mod:`fastllm.ops.collectives`): dispatcher ops
on any backend (gloo for CPU tensors, NCCL for CUDA ones), which CUDA graphs and
``torch.compile`` capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastllm.models.config import ModelConfig

__all__ = ["ShardLayout", "TensorParallel", "TensorSlice"]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size`` ranks, which
    communicate over the ``torch.distributed`` process group named ``group_name``
    (``group.group_name``, as the functional collectives take it). The caller creates the group
    (``torch.distributed.init_process_group`` or ``new_group``) before the model is loaded,
    one process per device, and every rank runs the same steps."""

    rank: int
    size: int
    group_name: str

    def __post_init__(self) -> None:
        for name in ("rank", "size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"TensorParallel.{name} must be an int, got {value!r}")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel needs size >= 1 and 0 <= rank < size, got "
                             f"rank={self.rank}, size={self.size}")
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"TensorParallel.group_name must be a process group's name, got "
                             f"{self.group_name!r}")


@dataclass(frozen=True)
class TensorSlice:
    """Indices ``[start, stop)`` of a checkpoint tensor along ``dim`` (0: rows, 1: columns)."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class ShardLayout:
    """The part of a model one rank holds (the whole model without tensor parallelism).

    Attributes:
        n_heads, n_kv_heads: query and key/value heads here (of ``head_dim`` values); query
            heads ``first_head`` onwards read key/value heads ``first_kv_head`` onwards.
        intermediate_size: MLP features here, from ``first_intermediate``.
        vocab_rows: embedding and LM head rows here (padding included), from ``vocab_start``.
        vocab_size: the model's vocabulary, less the padding.
        row_bias: row-parallel biases (o_proj, down_proj) are held and added here.
        tensor_parallel: the group, None for a whole model.
    """

    head_dim: int
    n_heads: int
    first_head: int
    n_kv_heads: int
    first_kv_head: int
    intermediate_size: int
    first_intermediate: int
    vocab_rows: int
    vocab_start: int
    vocab_size: int
    row_bias: bool
    tensor_parallel: TensorParallel | None

    @classmethod
    def of(cls, config: ModelConfig, tensor_parallel: TensorParallel | None) -> ShardLayout:
        """The layout of rank ``tensor_parallel.rank``; a model whose heads or MLP features
        do not divide among the ranks is a ValueError naming the numbers."""
        if tensor_parallel is None:
            return cls(config.head_dim, config.n_heads, 0, config.n_kv_heads, 0,
                       config.intermediate_size, 0, config.vocab_size, 0, config.vocab_size,
                       True, None)
        if not isinstance(tensor_parallel, TensorParallel):
            raise TypeError(f"tensor_parallel must be a TensorParallel or None, got "
                            f"{tensor_parallel!r}")
        rank, size = tensor_parallel.rank, tensor_parallel.size
        where = f"tensor parallelism over {size} ranks"
        if any(config.moe_layers):
            raise ValueError(f"{where}: a mixture-of-experts model ({config.architecture}) does "
                             "not split among ranks; run it on one")
        if config.family.qk_norm == "full":
            raise ValueError(f"{where}: {config.architecture} normalizes q and k over all heads, "
                             "which would need the other ranks' heads; run it on one")
        if config.n_heads % size:
            raise ValueError(f"{where} needs the attention heads ({config.n_heads}) to be a "
                             f"multiple of {size}")
        n_kv = config.n_kv_heads
        if (n_kv >= size and n_kv % size) or (n_kv < size and size % n_kv):
            raise ValueError(f"{where} needs the key/value heads ({n_kv}) to be a multiple of "
                             f"{size}, or to divide {size} (then each is replicated)")
        if config.intermediate_size % size:
            raise ValueError(f"{where} needs the MLP's intermediate size "
                             f"({config.intermediate_size}) to be a multiple of {size}")
        heads = config.n_heads // size
        kv_heads = max(n_kv // size, 1)
        # Replicated: the key/value head of this rank's query heads (a group of query heads
        # shares one, and n_kv dividing size keeps a rank's heads within one group).
        first_kv = rank * kv_heads if n_kv >= size else rank * heads // (config.n_heads // n_kv)
        inter = config.intermediate_size // size
        vocab_rows = -(-config.vocab_size // size)
        return cls(config.head_dim, heads, rank * heads, kv_heads, first_kv, inter,
                   rank * inter, vocab_rows, rank * vocab_rows, config.vocab_size, rank == 0,
                   tensor_parallel)

    def slices(self, name: str,
               parts: Sequence[tuple[str, tuple[int, ...]]]) -> list[TensorSlice | None] | None:
        """What this rank reads of each checkpoint tensor of fastllm parameter ``name``
        (``parts``: ``(hf_name, shape)`` as :func:`fastllm.models.hf_weight_map` lists them):
        a :class:`TensorSlice` each, None for a whole one; None for a parameter this rank does
        not hold (a row-parallel bias off rank 0). The embedding and LM head's last rows may
        fall past the vocabulary: they are cut here and padded with zeros by the loader."""
        if self.tensor_parallel is None:
            return [None] * len(parts)
        path, kind = name.rsplit(".", 1)  # kind: weight or bias
        module = path.rsplit(".", 1)[-1]
        d = self.head_dim
        heads = TensorSlice(0, self.first_head * d, (self.first_head + self.n_heads) * d)
        kv_heads = TensorSlice(0, self.first_kv_head * d,
                               (self.first_kv_head + self.n_kv_heads) * d)
        features = TensorSlice(0, self.first_intermediate,
                               self.first_intermediate + self.intermediate_size)
        if module == "qkv_proj":
            return [heads, kv_heads, kv_heads]
        if module == "gate_up_proj":
            return [features, features]
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return [None] if self.row_bias else None
            columns = heads if module == "o_proj" else features
            return [TensorSlice(1, columns.start, columns.stop)]
        if module in ("embed_tokens", "lm_head"):
            return [TensorSlice(0, min(self.vocab_start, self.vocab_size),
                                min(self.vocab_start + self.vocab_rows, self.vocab_size))]
        return [None] * len(parts)
