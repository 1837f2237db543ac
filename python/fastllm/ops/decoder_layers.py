"""The Llama family's decoder layers run back to back in C++ (``csrc/decoder``).

A decode step makes about ten op calls a layer; from Python each costs a few microseconds of
argument handling, more than a small model's norms and RoPE take (SmolLM2's 30 layers: about a
millisecond a token). :class:`DecoderLayers` runs the same ops, in the same order, from C++
through the dispatcher: each device runs its own kernels, the profiler sees every op, CUDA
graphs capture them, and Python is called once a step. Its plain-PyTorch twin is
:func:`fastllm.ops.reference.decoder_layers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from fastllm import _C

__all__ = ["DecoderLayerWeights", "DecoderLayers", "ProjectionPart"]


@dataclass(frozen=True)
class ProjectionPart:
    """A run of a projection's output rows: a float ``weight`` ``[rows, in]`` run by
    :func:`fastllm.ops.linear` (``weight_type`` None), or ggml blocks (uint8 ``[rows, row
    bytes]`` of type ``weight_type``) run by :func:`fastllm.ops.quantized_linear`."""

    weight: Tensor
    weight_type: int | None = None
    bias: Tensor | None = None


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    Each projection is its parts' outputs side by side (one part unless a file mixes formats):
    ``qkv`` gives ``[tokens, (n_heads + 2 n_kv_heads) * head_dim]`` (q, then k, then v),
    ``gate_up`` ``[tokens, 2 * intermediate]`` (SwiGLU's gate, then up). ``q_norm`` / ``k_norm``
    (together or neither) are per-head RMSNorms before RoPE; ``use_rope`` False is a NoPE layer;
    ``window_left`` >= 0 a sliding window (-1: none). ``eps`` is every norm's.
    """

    input_norm: Tensor
    post_attention_norm: Tensor
    qkv: Sequence[ProjectionPart]
    o: Sequence[ProjectionPart]
    gate_up: Sequence[ProjectionPart]
    down: Sequence[ProjectionPart]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    use_rope: bool = True
    window_left: int = -1
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None


def _parts(parts: Sequence[ProjectionPart], name: str) -> list[tuple]:
    if not parts or not all(isinstance(p, ProjectionPart) for p in parts):
        raise TypeError(f"{name} must be a non-empty sequence of ProjectionPart, got {parts!r}")
    return [(p.weight, p.weight_type, p.bias) for p in parts]


class DecoderLayers:
    """Decoder layers bound to their weights, run back to back by one call.

    Layer ``i`` writes its new K/V into ``k_cache[i]`` / ``v_cache[i]`` (paged pools, as
    :func:`fastllm.ops.reshape_and_cache` takes them) and attends through the block tables
    (:func:`fastllm.ops.paged_attention`, or :func:`fastllm.ops.attention` on the step's own
    K/V when every sequence's keys are its new tokens). The weights are bound when this is
    built: rebuild it after replacing or moving them.

    With ``group_name`` (a ``torch.distributed`` process group's name, ``group.group_name``)
    the layers are one tensor-parallel rank's shard: the outputs of the o and down projections
    (partial sums over this rank's heads and MLP features) are all-reduced over the group
    before each residual add, from C++ through ``torch.ops._c10d_functional`` (``all_reduce``
    then ``wait_tensor``), so a step stays one call on every rank. Every rank of the group
    must make the same calls in the same order.
    """

    def __init__(self, layers: Sequence[DecoderLayerWeights],
                 group_name: str | None = None) -> None:
        if not layers or not all(isinstance(layer, DecoderLayerWeights) for layer in layers):
            raise TypeError("layers must be a non-empty sequence of DecoderLayerWeights")
        if group_name is not None and (not isinstance(group_name, str) or not group_name):
            raise ValueError(f"group_name must be a process group's name or None, got "
                             f"{group_name!r}")
        self._layers = _C.DecoderLayers([
            _C.DecoderLayer(
                input_norm=layer.input_norm, post_attention_norm=layer.post_attention_norm,
                qkv=_parts(layer.qkv, "qkv"), o=_parts(layer.o, "o"),
                gate_up=_parts(layer.gate_up, "gate_up"), down=_parts(layer.down, "down"),
                q_norm=layer.q_norm, k_norm=layer.k_norm, n_heads=int(layer.n_heads),
                n_kv_heads=int(layer.n_kv_heads), head_dim=int(layer.head_dim),
                eps=float(layer.eps), use_rope=bool(layer.use_rope),
                window_left=int(layer.window_left))
            for layer in layers], group_name)

    def __len__(self) -> int:
        return len(self._layers)

    def __call__(self, x: Tensor, residual: Tensor | None, *, positions: Tensor,
                 cu_seqlens_q: Tensor, max_seqlen_q: int, seq_lens: Tensor,
                 block_tables: Tensor, slot_mapping: Tensor, keys_are_new: bool,
                 k_cache: Tensor, v_cache: Tensor, cos_sin_cache: Tensor,
                 pre_rope: bool) -> tuple[Tensor, Tensor]:
        """Runs the layers on one step's packed batch.

        Args:
            x: ``[tokens, hidden]`` the first layer's input; with ``residual`` None it is also
                the residual stream (the embeddings), else the previous sublayer's output,
                which the first norm adds into ``residual`` in place.
            positions, cu_seqlens_q, max_seqlen_q, seq_lens, block_tables, slot_mapping: the
                step's batch, as :func:`fastllm.ops.paged_attention`,
                :func:`fastllm.ops.rotary_embedding` and :func:`fastllm.ops.reshape_and_cache`
                take them.
            keys_are_new: every sequence's keys are exactly its new tokens (nothing cached).
            k_cache, v_cache: ``[num_layers, num_blocks, block_size, n_kv_heads, head_dim]``.
            cos_sin_cache: the RoPE table (:func:`fastllm.ops.rope_cos_sin_cache`).
            pre_rope: the caches hold keys before RoPE, rotated as attention reads them.

        Returns:
            ``(out, residual)``: the last layer's MLP output and the residual stream before it
            (the model's final norm adds one into the other).
        """
        if residual is not None and not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a Tensor or None, got {type(residual).__name__}")
        return self._layers.forward(x, residual, positions, cu_seqlens_q, int(max_seqlen_q),
                                    seq_lens, block_tables, slot_mapping, bool(keys_are_new),
                                    k_cache, v_cache, cos_sin_cache, bool(pre_rope))

