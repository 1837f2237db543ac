"""A decoder model's configuration, read from a Hugging Face ``config.json``.

:class:`ModelConfig` holds what the forward pass needs, with every per-architecture rule of HF
transformers 5 resolved once here from the family's record (:mod:`fastllm.models.families`:
which projections have a bias, which layers slide or skip RoPE, the RoPE scaling, soft-caps,
experts), so the model code never branches on the architecture name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastllm.models.checks import brief, check_bool, check_int, check_positive_number
from fastllm.models.families import FAMILIES, Family

__all__ = ["ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# model_type -> architecture, for a config.json that has no "architectures" list.
_MODEL_TYPES = {model_type: family.architecture for family in FAMILIES.values()
                for model_type in family.model_types}

_LAYER_TYPES = ("full_attention", "sliding_attention")

# The largest position (and context) a config may name: positions are int32 in the kernels. The
# RoPE table is built only as long as the context an engine runs (DecoderLM.reserve_positions).
MAX_POSITIONS = 2**31 - 1

# ModelConfig's sizes -> (their config.json key, the largest value taken). The bounds are far
# above any released model and low enough that a typo cannot make the loader allocate the machine
# (num_hidden_layers=10**9 once ended in a MemoryError).
_SIZES: dict[str, tuple[str, int]] = {
    "vocab_size": ("vocab_size", 1 << 24),
    "hidden_size": ("hidden_size", 1 << 17),
    "intermediate_size": ("intermediate_size", 1 << 20),
    "num_layers": ("num_hidden_layers", 1 << 10),
    "n_heads": ("num_attention_heads", 1 << 10),
    "n_kv_heads": ("num_key_value_heads", 1 << 10),
    "head_dim": ("head_dim", 1 << 12),
    "max_position_embeddings": ("max_position_embeddings", MAX_POSITIONS),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, as HF's ``rope_parameters`` (``"default"`` is no scaling).

    Attributes:
        rope_type: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"`` (Llama
            3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp between).
        factor: the scaling factor, > 0.
        low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3 only.
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"unsupported RoPE scaling type {self.rope_type!r}; fastllm supports "
                             "'default', 'linear' and 'llama3'")
        check_positive_number("RoPE scaling factor", self.factor)
        if self.rope_type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            check_positive_number("low_freq_factor", low)
            check_positive_number("high_freq_factor", high)
            if not low < high:
                raise ValueError("llama3 RoPE scaling needs 0 < low_freq_factor < "
                                 f"high_freq_factor, got {low!r} and {high!r}")
            check_int("original_max_position_embeddings", self.original_max_position_embeddings,
                       MAX_POSITIONS)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder model's shape and per-layer rules.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size, hidden_size, intermediate_size, num_layers: model sizes.
        n_heads, n_kv_heads, head_dim: attention heads (GQA when ``n_kv_heads < n_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base; ``rope_scaling`` its frequency scaling (None: default RoPE).
        max_position_embeddings: rows of the RoPE table, the longest sequence the model runs.
        tie_word_embeddings: the LM head reuses the token embedding.
        qkv_bias, o_bias, mlp_bias: which projections have a bias (Qwen2: q/k/v only).
        sliding_window: keys a sliding layer's query sees, itself included (HF's meaning).
        sliding_layers: per layer, whether it uses ``sliding_window``.
        rope_layers: per layer, whether it applies RoPE (False: a SmolLM3 NoPE layer).
        bos_token_id, eos_token_ids: special tokens (eos may be several).
        layer_switches: the values of the family's layer switches
            (:class:`~fastllm.models.families.LayerSwitch`), by field of the decoder's layer
            record (:class:`fastllm.ops.DecoderLayer`); a field not here keeps the record's
            default.
        rotary_dim: channels of each head RoPE rotates (the first ones; partial rotary).
        rope_local_theta: the RoPE base of sliding layers, when theirs is their own (Gemma 3).
        final_softcap: logits soft-capped as ``cap * tanh(x / cap)``; None: not capped.
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob: the
            mixture-of-experts block (``num_experts`` 0: none); each token runs its
            ``num_experts_per_tok`` best experts, their weights renormalized to sum to 1 when
            ``norm_topk_prob``.
        moe_layers: per layer, whether its MLP is the experts (else a dense MLP).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = field(default=())
    rope_layers: tuple[bool, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_switches: Mapping[str, Any] = field(default_factory=dict)
    rotary_dim: int | None = None
    rope_local_theta: float | None = None
    final_softcap: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; fastllm supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name, (_, high) in _SIZES.items():
            check_int(name, getattr(self, name), high)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        check_int("rotary_dim", self.rotary_dim, self.head_dim, low=2)
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            check_positive_number(name, getattr(self, name))
        for name in ("rope_local_theta", "final_softcap"):
            if getattr(self, name) is not None:
                check_positive_number(name, getattr(self, name))
        if not isinstance(self.layer_switches, Mapping) or not all(
                isinstance(name, str) for name in self.layer_switches):
            raise TypeError(f"layer_switches must map DecoderLayer fields to values, got "
                            f"{brief(self.layer_switches)}")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers or not all(
                isinstance(f, bool) for f in self.moe_layers):
            raise ValueError(f"moe_layers must be {self.num_layers} bools (one per layer), got "
                             f"{brief(self.moe_layers)}")
        if any(self.moe_layers):
            check_int("num_experts", self.num_experts, 1 << 12)
            check_int("num_experts_per_tok", self.num_experts_per_tok, self.num_experts)
            check_int("moe_intermediate_size", self.moe_intermediate_size, 1 << 20)
            check_bool("norm_topk_prob", self.norm_topk_prob)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got "
                            f"{brief(self.rope_scaling)}")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
            check_bool(name, getattr(self, name))
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, MAX_POSITIONS)
        for name in ("sliding_layers", "rope_layers"):
            flags = getattr(self, name)
            if len(flags) != self.num_layers or not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"{name} must be {self.num_layers} bools (one per layer), got "
                                 f"{flags!r}")
        if any(self.sliding_layers) and self.sliding_window is None:
            raise ValueError("some layers use sliding-window attention but sliding_window is not "
                             "set")
        for token in (self.bos_token_id, *self.eos_token_ids):
            if token is not None and not (isinstance(token, int) and not isinstance(token, bool)
                                          and token >= 0):
                raise ValueError(f"token ids must be non-negative ints, got {brief(token)}")

    @property
    def family(self) -> Family:
        """The architecture's record (:mod:`fastllm.models.families`)."""
        return FAMILIES[self.architecture]

    def window_left(self, layer: int) -> int:
        """The ``window_left`` of layer ``layer`` for :func:`fastllm.ops.paged_attention`.

        HF's window lets query ``i`` see keys ``j > i - sliding_window``: ``sliding_window``
        keys counting itself, so ``sliding_window - 1`` to its left; -1 is no window.
        """
        return self.sliding_window - 1 if self.sliding_layers[layer] else -1

    def layer_fields(self, layer: int) -> dict[str, Any]:
        """The fields of layer ``layer``'s record (:class:`fastllm.ops.DecoderLayer`) that are
        neither weights nor shapes: the family's layer switches, then the per-layer rules (its
        window, RoPE table and NoPE flag, the q/k norms' span, the norms' epsilon)."""
        return {**self.layer_switches, "eps": self.rms_norm_eps,
                "use_rope": self.rope_layers[layer],
                # Table 1: the local RoPE of sliding layers, where theirs is their own (Gemma 3).
                "rope_table": int(self.rope_local_theta is not None
                                  and self.sliding_layers[layer]),
                "window_left": self.window_left(layer),
                "qk_norm_per_head": self.family.qk_norm != "full"}

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        """Reads ``folder/config.json``; a bad value is a ValueError or TypeError naming the
        file, the key and the value."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {folder} (expected a Hugging Face model "
                                    "folder)")
        try:
            hf_config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
            raise ValueError(f"{path} is not valid JSON: {error}") from error
        try:
            return cls.from_hf_config(hf_config)
        except (TypeError, ValueError) as error:
            kind = ValueError if isinstance(error, ValueError) else TypeError
            raise kind(f"{path}: {error}") from error

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds the config from a HF ``config.json`` dict, following transformers 5.23.

        Missing keys take the HF config class's default for that architecture. RoPE parameters
        are read from ``rope_scaling`` (older files) or ``rope_parameters`` (transformers 5),
        ``rope_theta`` from inside them or from the top level. Every value is checked before it
        is used: a value of the wrong type (``"false"`` for a bool, a string for a size) is a
        TypeError, one out of bounds a ValueError, each naming the key and the value.
        """
        if not isinstance(hf, Mapping):
            raise TypeError(f"a model config must be a JSON object (a dict), got "
                            f"{type(hf).__name__}")
        arch = _architecture(hf)
        family = FAMILIES[arch]
        defaults = family.defaults

        def get(key: str, default: Any = None) -> Any:
            # A key present with null stays None (HF: an explicit null sliding_window or eos).
            return hf[key] if key in hf else defaults.get(key, default)

        switch_keys = {name: get(switch.key, switch.default)
                       for name, switch in family.layer_switches.items()}
        switches = {name: switch.value(switch.key, switch_keys[name])
                    for name, switch in family.layer_switches.items()
                    if switch_keys[name] is not None}
        sizes: dict[str, int] = {}
        for name, (key, high) in _SIZES.items():
            value = get(key)
            if value is not None or name not in ("n_kv_heads", "head_dim"):  # those two derive
                sizes[name] = check_int(key, value, high)
        sizes.setdefault("n_kv_heads", sizes["n_heads"])
        sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["n_heads"])
        rope = _rope(hf, family, get("rope_theta"), sizes["max_position_embeddings"],
                     sizes["head_dim"])
        sliding_window, layer_types, rope_layers = _layer_rules(family, hf, get,
                                                                sizes["num_layers"])
        attention_bias = check_bool("attention_bias", hf.get("attention_bias", False))
        eos = get("eos_token_id")
        return cls(
            architecture=arch,
            **sizes,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            **rope,
            tie_word_embeddings=check_bool("tie_word_embeddings", get("tie_word_embeddings")),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=family.mlp_bias and check_bool("mlp_bias", hf.get("mlp_bias", False)),
            sliding_window=sliding_window,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_layers=rope_layers,
            bos_token_id=get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            layer_switches=switches,
            final_softcap=get("final_logit_softcapping") if family.final_softcap else None,
            **_experts(family, hf, get, sizes["num_layers"], sizes["intermediate_size"]),
        )


def _architecture(hf: Mapping[str, Any]) -> str:
    architectures = hf.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(
            isinstance(name, str) for name in architectures)):
        raise TypeError(f"architectures must be a list of class names, got "
                        f"{brief(architectures)}")
    model_type = hf.get("model_type")
    if architectures:
        arch = architectures[0]
    elif isinstance(model_type, str) and model_type in _MODEL_TYPES:
        arch = _MODEL_TYPES[model_type]
    else:
        raise ValueError("config.json names no architecture (no 'architectures' list and an "
                         f"unknown model_type {brief(model_type)})")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; fastllm supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope(hf: Mapping[str, Any], family: Family, top_level_theta: float, max_position: int,
          head_dim: int) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling``, ``rotary_dim`` and ``rope_local_theta`` with HF's
    precedence: ``rope_scaling`` over ``rope_parameters``, a theta inside them over the
    top-level ``rope_theta``. A family with local RoPE (Gemma 3) gives per-layer-type
    parameters (``{"full_attention": {...}, "sliding_attention": {...}}``), or in older files
    ``rope_local_base_freq`` beside the global ones."""
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], Mapping):
            raise TypeError(f"{key} must be a JSON object (e.g. {{\"rope_type\": \"linear\", "
                            f"\"factor\": 2.0}}) or null, got {brief(hf[key])}")
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    local_theta = None
    if family.local_rope:
        local_theta = hf.get("rope_local_base_freq", family.defaults.get("rope_local_base_freq"))
        if set(params) & set(_LAYER_TYPES):
            local = params.get("sliding_attention") or {}
            if not isinstance(local, Mapping) or local.get("rope_type", "default") != "default":
                raise ValueError(f"sliding layers' RoPE must be default RoPE, got "
                                 f"{brief(local)}")
            local_theta = local.get("rope_theta", local_theta)
            params = dict(params.get("full_attention") or {})
        check_positive_number("rope_local_base_freq", local_theta)
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported, got "
                         f"{brief(params)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got "
                         f"{brief(partial)}")
    rope = dict(rope_theta=params.get("rope_theta", top_level_theta), rope_scaling=None,
                rotary_dim=int(head_dim * partial), rope_local_theta=local_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise TypeError(f"rope_type must be a string, got {brief(rope_type)}")
    if rope_type == "default":
        return rope
    if rope_type == "linear":
        return dict(rope, rope_scaling=RopeScaling("linear", factor=params.get("factor")))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings",
                              hf.get("original_max_position_embeddings", max_position))
        return dict(rope, rope_scaling=RopeScaling(
            "llama3", factor=params.get("factor"), low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            original_max_position_embeddings=original))
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; fastllm supports 'default', "
                     "'linear' and 'llama3'")


def _experts(family: Family, hf: Mapping[str, Any], get, num_layers: int, intermediate_size: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a family with experts (none for a dense one): which
    layers route (Qwen3-MoE: every ``decoder_sparse_step``-th but ``mlp_only_layers``)."""
    names = family.moe
    if names is None:
        return {}
    key = next((key for key in names.experts_keys if key in hf), names.experts_keys[0])
    num_experts = check_int(key, get(key), 1 << 12)
    top_k = check_int("num_experts_per_tok", get("num_experts_per_tok"), num_experts)
    renormalize = (True if names.renormalize_key is None else
                   check_bool(names.renormalize_key, get(names.renormalize_key)))
    step = check_int("decoder_sparse_step", get("decoder_sparse_step", 1), num_layers)
    dense = get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in dense):
        raise TypeError(f"mlp_only_layers must be a list of layer indices, got {brief(dense)}")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=check_int(
                    "moe_intermediate_size", get("moe_intermediate_size", intermediate_size),
                    1 << 20),
                norm_topk_prob=renormalize,
                moe_layers=tuple(i not in dense and (i + 1) % step == 0
                                 for i in range(num_layers)))


def _layer_rules(family: Family, hf: Mapping[str, Any], get, num_layers: int
                 ) -> tuple[int | None, list[str], tuple[bool, ...]]:
    """(sliding_window, layer_types, rope_layers) as each HF config class resolves them."""
    layer_types = hf.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise TypeError(f"layer_types must be a list, got {brief(layer_types)}")
    rope_layers = (True,) * num_layers
    rule = family.windows
    if rule == "none":
        sliding_window, layer_types = None, ["full_attention"] * num_layers
    elif rule in ("every", "every_if_used"):
        # Every layer slides when the window is set; these classes ignore layer_types.
        used = rule == "every" or check_bool("use_sliding_window",
                                               hf.get("use_sliding_window", False))
        sliding_window = get("sliding_window") if used else None
        layer_types = ["full_attention" if sliding_window is None else "sliding_attention"
                       ] * num_layers
    elif rule == "qwen2":
        # The window exists only with use_sliding_window, and then only from max_window_layers.
        use_window = check_bool("use_sliding_window", hf.get("use_sliding_window", False))
        sliding_window = get("sliding_window") if use_window else None
        if layer_types is None:
            first_sliding = check_int("max_window_layers", get("max_window_layers", 28),
                                       MAX_POSITIONS, low=0)
            layer_types = ["sliding_attention" if sliding_window is not None and i >= first_sliding
                           else "full_attention" for i in range(num_layers)]
    elif rule == "layer_types":
        # Gemma: one full layer in every sliding_window_pattern, the others slide.
        sliding_window = get("sliding_window")
        if layer_types is None:
            pattern = check_int("sliding_window_pattern", get("sliding_window_pattern"),
                                 MAX_POSITIONS)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(num_layers)]
        if sliding_window is None and "sliding_attention" in layer_types:
            raise ValueError("layer_types has sliding layers but sliding_window is null")
    else:  # smollm3
        # no_rope_layers[i] == 1 means layer i *uses* RoPE (HF: use_rope = no_rope_layers[i]).
        no_rope_layers = hf.get("no_rope_layers")
        if no_rope_layers is None:
            interval = check_int("no_rope_layer_interval", hf.get("no_rope_layer_interval", 4),
                                  MAX_POSITIONS)
            no_rope_layers = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if not isinstance(no_rope_layers, list) or len(no_rope_layers) != num_layers or any(
                f not in (0, 1) or isinstance(f, float) for f in no_rope_layers):
            raise ValueError(f"no_rope_layers must be {num_layers} values of 0 or 1, got "
                             f"{brief(no_rope_layers)}")
        rope_layers = tuple(bool(f) for f in no_rope_layers)
        sliding_window = get("sliding_window")
        if layer_types is None:
            slide = check_bool("use_sliding_window", hf.get("use_sliding_window", False)) \
                and sliding_window is not None
            layer_types = ["sliding_attention" if slide and not rope else "full_attention"
                           for rope in rope_layers]
    if len(layer_types) != num_layers or any(t not in _LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must be {num_layers} of {_LAYER_TYPES}, got "
                         f"{brief(layer_types)}")
    return sliding_window, layer_types, rope_layers
