"""The decoder families fastllm runs, one record each.

A :class:`Family` says how one HF architecture differs from the Llama decoder: where its norms
sit and how they scale, its q/k norms, its embedding scale, which config keys give its sliding
windows and logit soft-cap, its layer switches (:class:`LayerSwitch`: which config keys set
fields of the decoder's layer record, such as the activation, the attention scale and soft-cap),
its mixture-of-experts block, and the names of its tensors in HF checkpoints and in llama.cpp's
GGUF files. :class:`~fastllm.models.config.ModelConfig` reads a family's config keys,
:mod:`fastllm.models.build` its tensor names, and one decoder (:class:`fastllm.ops.DecoderLayers`
in C++, ``ops.reference.decoder_layers`` in float64) runs them all.

Adding a family: a record here (its HF config class's defaults included), a parity test against
HF transformers on a tiny random checkpoint (tests/models/test_parity.py), and, when llama.cpp
converts it, its :class:`GGUFConventions` and a GGUF round trip (tests/models/test_gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastllm import ops
from fastllm.models.checks import brief, check_positive_number

__all__ = ["FAMILIES", "Family", "GGUFConventions", "GGUF_EXPERT_NAMES", "GGUF_GLOBAL_NAMES",
           "GGUF_LAYER_NAMES", "GGUF_NORM_NAMES", "HF_ACTIVATIONS", "LayerSwitch", "MoeNames",
           "NORM_ROLES"]

# Where a decoder layer's norms may sit, in order: before attention, on attention's output,
# before the MLP, on the MLP's output. fastllm names its norm modules by role.
NORM_ROLES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm")

# Norm placement -> {role: the HF checkpoint's module name}.
_NORM_NAMES = {
    # Llama: pre-norm; HF calls the MLP's input norm post_attention_layernorm.
    "pre": {"input_layernorm": "input_layernorm",
            "pre_feedforward_layernorm": "post_attention_layernorm"},
    # Gemma 2/3: each sublayer's input and output normalized.
    "sandwich": {role: role for role in NORM_ROLES},
    # OLMo 2: the sublayers' outputs only; the residual stream is never normalized in a layer.
    "post": {"post_attention_layernorm": "post_attention_layernorm",
             "post_feedforward_layernorm": "post_feedforward_layernorm"},
}
# Role -> llama.cpp's tensor name (gguf.constants.TENSOR_NAMES), the same in every family.
GGUF_NORM_NAMES = {"input_layernorm": "attn_norm",
                   "post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}
# HF module name -> llama.cpp's, for the tensors outside the layers.
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                     "lm_head": "output"}
# HF module name after "model.layers.{i}." -> llama.cpp's after "blk.{i}.", for every layer tensor
# but the norms (named by role). A fused checkpoint's gate_up_proj is llama.cpp's ffn_up (Phi-3:
# gate rows, then up rows).
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down"}
# MoeNames field -> llama.cpp's name after "blk.{i}.", the same in every family: the router, and
# each projection of every expert stacked into one [experts, rows, cols] tensor.
GGUF_EXPERT_NAMES = {"router": "ffn_gate_inp", "gate": "ffn_gate_exps", "up": "ffn_up_exps",
                     "down": "ffn_down_exps"}


# HF's names of the MLP activations -> the decoder's (DecoderLayer.activation).
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def hf_activation(key: str, name: Any) -> str:
    """The decoder's name of HF's activation ``name`` (config key ``key``)."""
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"{key} must be one of {sorted(HF_ACTIVATIONS)}, got {brief(name)}")
    return HF_ACTIVATIONS[name]


def inverse_sqrt(key: str, value: Any) -> float:
    """``value ** -0.5`` of a positive number (Gemma's ``query_pre_attn_scalar``)."""
    return check_positive_number(key, value) ** -0.5


@dataclass(frozen=True)
class LayerSwitch:
    """How a family sets one field of the decoder's layer record (:class:`fastllm.ops.
    DecoderLayer`, declared in ``csrc/decoder/decoder_layers.h``) from its HF config: one value
    for every layer. A key absent from the config takes the family's ``defaults``, else
    ``default``; null, it leaves the field at the record's default.

    Attributes:
        key: the ``config.json`` key.
        value: ``value(key, config value)``, the field's value (a TypeError or ValueError naming
            ``key`` for a bad one).
        default: the key's value where neither the config nor the family's defaults give one
            (the HF config class's default shared by several families).
        gguf: llama.cpp's metadata key for it (after ``{arch}.``) and that key's type (int,
            float, str or bool); None where GGUF files do not carry it (the default applies).
    """

    key: str
    value: Callable[[str, Any], Any] = check_positive_number
    default: Any = None
    gguf: tuple[str, type] | None = None


# The switch every family has: its MLP's activation, HF's default SiLU unless the config says.
_ACTIVATION = {"activation": LayerSwitch("hidden_act", hf_activation, default="silu")}


@dataclass(frozen=True)
class GGUFConventions:
    """How llama.cpp stores a family: what ``convert_hf_to_gguf.py`` does to its tensors, and
    what llama.cpp's loader (``llama-model.cpp``) fixes for it instead of reading it from the
    file. The converter also adds a family's ``norm_offset`` to its norm weights, as fastllm
    folds it.

    Attributes:
        architecture: ``general.architecture``.
        permuted_qk: q/k rows are permuted to llama.cpp's interleaved RoPE pairs (``llama``).
        window_pattern: one layer in this many attends to everything, the others slide.
        default_window: ``sliding_window`` when the file has no ``attention.sliding_window``
            (None: no layer slides).
        local_rope_theta: the RoPE base of sliding layers.
        hidden_scalar_layers: llama.cpp fixes ``query_pre_attn_scalar`` (Gemma): ``hidden_size
            / heads`` at this layer count (the 27B model's), ``head_dim`` at any other; None:
            the family has none.
        expert_weights_norm: whether the experts' top-k weights are renormalized when the file
            has no ``{arch}.expert_weights_norm`` (a family whose renormalization is a config
            key; llama.cpp's ``qwen3moe`` graph always renormalizes).
    """

    architecture: str
    permuted_qk: bool = False
    window_pattern: int | None = None
    default_window: int | None = None
    local_rope_theta: float | None = None
    hidden_scalar_layers: int | None = None
    expert_weights_norm: bool | None = None


@dataclass(frozen=True)
class MoeNames:
    """A mixture-of-experts block's HF tensor names, after ``model.layers.{i}.``: the router
    and each expert's gate, up and down projections (``{e}`` the expert)."""

    router: str
    gate: str
    up: str
    down: str
    renormalize_key: str | None  # the config key that says whether top-k weights sum to 1
    experts_keys: tuple[str, ...]  # the config keys of the expert count, the first one present


@dataclass(frozen=True)
class Family:
    """One decoder architecture, as data.

    Attributes:
        architecture: HF's class name (``config.json``'s ``architectures[0]``).
        model_types: ``config.json``'s ``model_type`` values that mean it.
        defaults: the HF config class's defaults for keys a ``config.json`` may leave out.
        gguf: how llama.cpp stores it, None if fastllm reads no GGUF of it.
        norms: ``"pre"`` (Llama), ``"sandwich"`` (Gemma) or ``"post"`` (OLMo 2).
        norm_offset: RMSNorm scales by ``norm_offset + weight`` (Gemma: 1), folded into the
            weights at load (llama.cpp's converter does the same).
        qk_norm: per-head RMSNorm of q and k (``"head"``: Qwen3, Gemma 3), over all of q and
            all of k (``"full"``: OLMo 2), or none.
        layer_switches: the fields of the decoder's layer record it sets from its config, by
            field name (every family: the activation).
        embedding_scale: embeddings are multiplied by ``sqrt(hidden_size)`` (in their dtype).
        windows: how layers slide: ``"none"``; ``"every"`` (every layer, when ``sliding_window``
            is set); ``"every_if_used"`` (the same, when ``use_sliding_window`` too);
            ``"qwen2"`` (layers from ``max_window_layers`` on, with ``use_sliding_window``);
            ``"layer_types"`` (per ``layer_types``, else one full layer in
            ``sliding_window_pattern``); ``"smollm3"`` (NoPE layers, with ``use_sliding_window``).
        final_softcap: reads ``final_logit_softcapping`` (the logits' soft-cap).
        local_rope: sliding layers rotate with their own RoPE base (Gemma 3).
        qkv_bias, o_bias: fixed biases; None: as ``attention_bias`` says.
        mlp_bias: reads ``mlp_bias``.
        fused_checkpoint: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused (Phi-3).
        moe: its mixture-of-experts block, None for a dense MLP.
    """

    architecture: str
    model_types: tuple[str, ...]
    defaults: Mapping[str, Any]
    gguf: GGUFConventions | None = None
    norms: str = "pre"
    norm_offset: float = 0.0
    qk_norm: str | None = None
    layer_switches: Mapping[str, LayerSwitch] = field(default_factory=lambda: _ACTIVATION)
    embedding_scale: bool = False
    windows: str = "none"
    final_softcap: bool = False
    local_rope: bool = False
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool = False
    fused_checkpoint: bool = False
    moe: MoeNames | None = None
    norm_names: Mapping[str, str] = field(init=False)
    gguf_names: Mapping[str, str] = field(init=False)
    gguf_expert_names: Mapping[str, str] = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.layer_switches) - set(ops.DecoderLayer.fields)
        if unknown:
            raise ValueError(f"{self.architecture}'s layer switches {sorted(unknown)} are not "
                             f"fields of fastllm.ops.DecoderLayer ({ops.DecoderLayer.fields})")
        object.__setattr__(self, "norm_names", _NORM_NAMES[self.norms])
        router = {} if self.moe is None else {self.moe.router: GGUF_EXPERT_NAMES["router"]}
        # HF module after "model.layers.{i}." -> llama.cpp's name after "blk.{i}."
        object.__setattr__(self, "gguf_names", {
            **GGUF_LAYER_NAMES, **router,
            **{hf_name: GGUF_NORM_NAMES[role] for role, hf_name in self.norm_names.items()}})
        # One expert's HF module ("{e}" the expert) -> llama.cpp's stacked tensor of them all.
        object.__setattr__(self, "gguf_expert_names", {} if self.moe is None else {
            getattr(self.moe, part): GGUF_EXPERT_NAMES[part] for part in ("gate", "up", "down")})


_QWEN3_MOE = MoeNames(router="mlp.gate", gate="mlp.experts.{e}.gate_proj",
                      up="mlp.experts.{e}.up_proj", down="mlp.experts.{e}.down_proj",
                      renormalize_key="norm_topk_prob",
                      experts_keys=("num_experts", "num_local_experts"))
_MIXTRAL_MOE = MoeNames(router="block_sparse_moe.gate", gate="block_sparse_moe.experts.{e}.w1",
                        up="block_sparse_moe.experts.{e}.w3",
                        down="block_sparse_moe.experts.{e}.w2", renormalize_key=None,
                        experts_keys=("num_local_experts",))

# Gemma's activation, attention scale and scores' soft-cap (llama.cpp writes the soft-cap).
_GEMMA_SWITCHES = {
    "activation": LayerSwitch("hidden_activation", hf_activation),
    "scale": LayerSwitch("query_pre_attn_scalar", inverse_sqrt),
    "softcap": LayerSwitch("attn_logit_softcapping", gguf=("attn_logit_softcapping", float))}
_GEMMA_DEFAULTS = dict(tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
                       rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=256,
                       query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh")

FAMILIES: dict[str, Family] = {family.architecture: family for family in (
    Family("LlamaForCausalLM", ("llama",), gguf=GGUFConventions("llama", permuted_qk=True),
           mlp_bias=True, defaults=dict(
               max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)),
    Family("MistralForCausalLM", ("mistral",), windows="every", qkv_bias=False, o_bias=False,
           defaults=dict(max_position_embeddings=4096 * 32, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         sliding_window=4096)),
    # Qwen2 hard-codes q/k/v biases and no o_proj bias.
    Family("Qwen2ForCausalLM", ("qwen2",), gguf=GGUFConventions("qwen2"), windows="qwen2",
           qkv_bias=True, o_bias=False, defaults=dict(
               max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, sliding_window=4096)),
    Family("Qwen3ForCausalLM", ("qwen3",), gguf=GGUFConventions("qwen3"), windows="qwen2",
           qk_norm="head", defaults=dict(
               max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, sliding_window=4096, head_dim=128)),
    Family("SmolLM3ForCausalLM", ("smollm3",), windows="smollm3", mlp_bias=True, defaults=dict(
        max_position_embeddings=32768, rope_theta=2000000.0, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001, sliding_window=None)),
    Family("Gemma2ForCausalLM", ("gemma2",), norms="sandwich", norm_offset=1.0,
           layer_switches=_GEMMA_SWITCHES, embedding_scale=True, windows="layer_types",
           # llama.cpp: layers 0, 2, ... slide; the 27B (46 layers) scales by hidden / heads.
           gguf=GGUFConventions("gemma2", window_pattern=2, default_window=4096,
                                hidden_scalar_layers=46),
           final_softcap=True, defaults=dict(
               _GEMMA_DEFAULTS, max_position_embeddings=8192, sliding_window=4096,
               sliding_window_pattern=2, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0)),
    Family("Gemma3ForCausalLM", ("gemma3_text",), norms="sandwich",
           norm_offset=1.0, qk_norm="head", layer_switches=_GEMMA_SWITCHES,
           # llama.cpp: five sliding layers of RoPE base 10000, then a full one; the 27B (62
           # layers) scales by hidden / heads.
           gguf=GGUFConventions("gemma3", window_pattern=6, local_rope_theta=10000.0,
                                hidden_scalar_layers=62),
           embedding_scale=True, windows="layer_types", final_softcap=True, local_rope=True,
           defaults=dict(
               _GEMMA_DEFAULTS, max_position_embeddings=131072, rope_theta=1000000.0,
               rope_local_base_freq=10000.0, sliding_window=4096, sliding_window_pattern=6,
               attn_logit_softcapping=None, final_logit_softcapping=None)),
    Family("Phi3ForCausalLM", ("phi3",), gguf=GGUFConventions("phi3"), windows="every",
           qkv_bias=False, o_bias=False, fused_checkpoint=True, defaults=dict(
               max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=32000, rms_norm_eps=1e-5, sliding_window=None)),
    Family("Olmo2ForCausalLM", ("olmo2",), gguf=GGUFConventions("olmo2"), norms="post",
           qk_norm="full", defaults=dict(
               max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=50279, rms_norm_eps=1e-5)),
    Family("Qwen3MoeForCausalLM", ("qwen3_moe",),
           gguf=GGUFConventions("qwen3moe", expert_weights_norm=True),
           qk_norm="head", windows="every_if_used", moe=_QWEN3_MOE, defaults=dict(
               max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, sliding_window=4096,
               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
               norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])),
    # llama.cpp's converter writes Mixtral as llama with experts (llama.expert_count).
    Family("MixtralForCausalLM", ("mixtral",), windows="every", qkv_bias=False, o_bias=False,
           gguf=GGUFConventions("llama", permuted_qk=True), moe=_MIXTRAL_MOE, defaults=dict(
               max_position_embeddings=4096 * 32, rope_theta=1000000.0,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=None,
               num_local_experts=8, num_experts_per_tok=2)),
)}
