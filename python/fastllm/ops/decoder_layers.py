"""Decoder layers of every family run back to back in C++ (``csrc/decoder``).

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

__all__ = ["ACTIVATIONS", "DecoderLayerWeights", "DecoderLayers", "ExpertWeights",
           "ProjectionPart"]

# The MLP gate activations, by name -> the C++ decoder's code.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass(frozen=True)
class ProjectionPart:
    """A run of a projection's output rows: a float ``weight`` ``[rows, in]`` run by
    :func:`fastllm.ops.linear` (``weight_type`` None), or ggml blocks (uint8 ``[rows, row
    bytes]`` of type ``weight_type``) run by :func:`fastllm.ops.quantized_linear`."""

    weight: Tensor
    weight_type: int | None = None
    bias: Tensor | None = None


@dataclass(frozen=True)
class ExpertWeights:
    """A mixture-of-experts MLP, run by :func:`fastllm.ops.moe`: the ``router`` projection
    gives ``[tokens, experts]`` logits; each token runs its ``top_k`` best experts (their
    softmax weights renormalized to sum to 1 when ``renormalize``), each expert's fused
    ``gate_up`` ``[experts, 2 * intermediate, hidden]`` and ``down`` ``[experts, hidden,
    intermediate]`` weights being floats, or ggml blocks (uint8) of ``gate_up_type`` /
    ``down_type``."""

    router: Sequence[ProjectionPart]
    gate_up: Tensor
    down: Tensor
    top_k: int
    renormalize: bool
    gate_up_type: int | None = None
    down_type: int | None = None


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer: attention, then the MLP, each a residual branch.

    A branch's input is RMS-normalized when its input norm is given (``input_norm`` before
    attention, ``pre_feedforward_norm`` before the MLP: Llama's pre-norm), its output when its
    output norm is (``post_attention_norm``, ``post_feedforward_norm``: Gemma has all four,
    OLMo 2 only these two).

    Each projection is its parts' outputs side by side (one part unless a file mixes formats):
    ``qkv`` gives ``[tokens, (n_heads + 2 n_kv_heads) * head_dim]`` (q, then k, then v),
    ``gate_up`` ``[tokens, 2 * intermediate]`` (the gate, then up), gated by ``activation``
    (``"silu"`` or ``"gelu_tanh"``); or ``experts`` replaces ``gate_up`` and ``down``.
    ``q_norm`` / ``k_norm`` (together or neither) are RMSNorms before RoPE, per head
    (``[head_dim]``) or, with ``qk_norm_per_head`` False, over all heads (``[n_heads *
    head_dim]``, ``[n_kv_heads * head_dim]``). ``use_rope`` False is a NoPE layer;
    ``rope_table`` picks which of the step's RoPE tables the layer rotates with.
    ``window_left`` >= 0 is a sliding window (-1: none); ``scale`` the query-key scale (None:
    ``head_dim ** -0.5``); ``softcap`` > 0 caps attention scores at ``softcap * tanh(s /
    softcap)``. ``eps`` is every norm's.
    """

    qkv: Sequence[ProjectionPart]
    o: Sequence[ProjectionPart]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    input_norm: Tensor | None = None
    post_attention_norm: Tensor | None = None
    pre_feedforward_norm: Tensor | None = None
    post_feedforward_norm: Tensor | None = None
    gate_up: Sequence[ProjectionPart] | None = None
    down: Sequence[ProjectionPart] | None = None
    experts: ExpertWeights | None = None
    activation: str = "silu"
    use_rope: bool = True
    rope_table: int = 0
    window_left: int = -1
    scale: float | None = None
    softcap: float = 0.0
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    qk_norm_per_head: bool = True


def _parts(parts: Sequence[ProjectionPart] | None, name: str) -> list[tuple] | None:
    if parts is None and name in ("gate_up", "down"):
        return None
    if not parts or not all(isinstance(p, ProjectionPart) for p in parts):
        raise TypeError(f"{name} must be a non-empty sequence of ProjectionPart, got {parts!r}")
    return [(p.weight, p.weight_type, p.bias) for p in parts]


def _experts(experts: ExpertWeights | None) -> _C.Experts | None:
    if experts is None:
        return None
    if not isinstance(experts, ExpertWeights):
        raise TypeError(f"experts must be an ExpertWeights or None, got {experts!r:.80}")
    return _C.Experts(router=_parts(experts.router, "router"), gate_up=experts.gate_up,
                      down=experts.down, gate_up_type=experts.gate_up_type,
                      down_type=experts.down_type, top_k=int(experts.top_k),
                      renormalize=bool(experts.renormalize))


def _layer(layer: DecoderLayerWeights) -> _C.DecoderLayer:
    if layer.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                         f"{layer.activation!r:.80}")
    return _C.DecoderLayer(
        input_norm=layer.input_norm, post_attention_norm=layer.post_attention_norm,
        pre_feedforward_norm=layer.pre_feedforward_norm,
        post_feedforward_norm=layer.post_feedforward_norm, qkv=_parts(layer.qkv, "qkv"),
        o=_parts(layer.o, "o"), gate_up=_parts(layer.gate_up, "gate_up"),
        down=_parts(layer.down, "down"), experts=_experts(layer.experts),
        activation=ACTIVATIONS[layer.activation], q_norm=layer.q_norm, k_norm=layer.k_norm,
        qk_norm_per_head=bool(layer.qk_norm_per_head), n_heads=int(layer.n_heads),
        n_kv_heads=int(layer.n_kv_heads), head_dim=int(layer.head_dim), eps=float(layer.eps),
        use_rope=bool(layer.use_rope), rope_table=int(layer.rope_table),
        window_left=int(layer.window_left),
        scale=None if layer.scale is None else float(layer.scale), softcap=float(layer.softcap))


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
        self._layers = _C.DecoderLayers([_layer(layer) for layer in layers], group_name)

    def __len__(self) -> int:
        return len(self._layers)

    def __call__(self, x: Tensor, residual: Tensor | None, *, positions: Tensor,
                 cu_seqlens_q: Tensor, max_seqlen_q: int, seq_lens: Tensor,
                 block_tables: Tensor, slot_mapping: Tensor, keys_are_new: bool,
                 k_cache: Tensor, v_cache: Tensor, cos_sin_caches: Sequence[Tensor],
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
            cos_sin_caches: the RoPE tables (:func:`fastllm.ops.rope_cos_sin_cache`), indexed
                by each layer's ``rope_table``.
            pre_rope: the caches hold keys before RoPE, rotated as attention reads them.

        Returns:
            ``(out, residual)``: the last layer's MLP output and the residual stream before it
            (the model's final norm adds one into the other).
        """
        if residual is not None and not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a Tensor or None, got {type(residual).__name__}")
        return self._layers.forward(x, residual, positions, cu_seqlens_q, int(max_seqlen_q),
                                    seq_lens, block_tables, slot_mapping, bool(keys_are_new),
                                    k_cache, v_cache, list(cos_sin_caches), bool(pre_rope))

