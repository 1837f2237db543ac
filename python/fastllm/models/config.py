"""The decoder family's configuration, read from a Hugging Face ``config.json``.

:class:`ModelConfig` holds what the forward pass needs, with every per-architecture rule of HF
transformers 5 resolved once here (which projections have a bias, which layers slide or skip
RoPE, the RoPE scaling), so the model code never branches on the architecture name.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "SmolLM3ForCausalLM")

# model_type -> architecture, for a config.json that has no "architectures" list.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "smollm3": "SmolLM3ForCausalLM"}

# The HF config classes' defaults for keys a config.json may leave out (transformers 5.23).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048, rope_theta=10000.0,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "MistralForCausalLM": dict(max_position_embeddings=4096 * 32, rope_theta=10000.0,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                               sliding_window=4096),
    "Qwen2ForCausalLM": dict(max_position_embeddings=32768, rope_theta=10000.0,
                             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                             sliding_window=4096),
    "Qwen3ForCausalLM": dict(max_position_embeddings=32768, rope_theta=10000.0,
                             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                             sliding_window=4096, head_dim=128),
    "SmolLM3ForCausalLM": dict(max_position_embeddings=32768, rope_theta=2000000.0,
                               tie_word_embeddings=True, bos_token_id=128000,
                               eos_token_id=128001, sliding_window=None),
}

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
        _check_positive_number("RoPE scaling factor", self.factor)
        if self.rope_type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            _check_positive_number("low_freq_factor", low)
            _check_positive_number("high_freq_factor", high)
            if not low < high:
                raise ValueError("llama3 RoPE scaling needs 0 < low_freq_factor < "
                                 f"high_freq_factor, got {low!r} and {high!r}")
            _check_int("original_max_position_embeddings", self.original_max_position_embeddings,
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
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        sliding_window: keys a sliding layer's query sees, itself included (HF's meaning).
        sliding_layers: per layer, whether it uses ``sliding_window``.
        rope_layers: per layer, whether it applies RoPE (False: a SmolLM3 NoPE layer).
        bos_token_id, eos_token_ids: special tokens (eos may be several).
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
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = field(default=())
    rope_layers: tuple[bool, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; fastllm supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name, (_, high) in _SIZES.items():
            _check_int(name, getattr(self, name), high)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            _check_positive_number(name, getattr(self, name))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got "
                            f"{_brief(self.rope_scaling)}")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
            _check_bool(name, getattr(self, name))
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, MAX_POSITIONS)
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
                raise ValueError(f"token ids must be non-negative ints, got {_brief(token)}")

    def window_left(self, layer: int) -> int:
        """The ``window_left`` of layer ``layer`` for :func:`fastllm.ops.paged_attention`.

        HF's window lets query ``i`` see keys ``j > i - sliding_window``: ``sliding_window``
        keys counting itself, so ``sliding_window - 1`` to its left; -1 is no window.
        """
        return self.sliding_window - 1 if self.sliding_layers[layer] else -1

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
        defaults = _DEFAULTS[arch]

        def get(key: str, default: Any = None) -> Any:
            # A key present with null stays None (HF: an explicit null sliding_window or eos).
            return hf[key] if key in hf else defaults.get(key, default)

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {hidden_act!r}")
        sizes: dict[str, int] = {}
        for name, (key, high) in _SIZES.items():
            value = get(key)
            if value is not None or name not in ("n_kv_heads", "head_dim"):  # those two derive
                sizes[name] = _check_int(key, value, high)
        sizes.setdefault("n_kv_heads", sizes["n_heads"])
        sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["n_heads"])
        rope_theta, rope_scaling = _rope(hf, get("rope_theta"), sizes["max_position_embeddings"])
        sliding_window, layer_types, rope_layers = _layer_rules(arch, hf, get,
                                                                sizes["num_layers"])
        attention_bias = _check_bool("attention_bias", hf.get("attention_bias", False))
        eos = get("eos_token_id")
        return cls(
            architecture=arch,
            **sizes,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_check_bool("tie_word_embeddings", get("tie_word_embeddings")),
            # Qwen2 hard-codes q/k/v biases and no o_proj bias; Mistral has none.
            qkv_bias={"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(
                arch, attention_bias),
            o_bias=attention_bias and arch not in ("Qwen2ForCausalLM", "MistralForCausalLM"),
            mlp_bias=_check_bool("mlp_bias", hf.get("mlp_bias", False)) and arch in (
                "LlamaForCausalLM", "SmolLM3ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_layers=rope_layers,
            bos_token_id=get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )


def _architecture(hf: Mapping[str, Any]) -> str:
    architectures = hf.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(
            isinstance(name, str) for name in architectures)):
        raise TypeError(f"architectures must be a list of class names, got "
                        f"{_brief(architectures)}")
    model_type = hf.get("model_type")
    if architectures:
        arch = architectures[0]
    elif isinstance(model_type, str) and model_type in _MODEL_TYPES:
        arch = _MODEL_TYPES[model_type]
    else:
        raise ValueError("config.json names no architecture (no 'architectures' list and an "
                         f"unknown model_type {_brief(model_type)})")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; fastllm supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope(hf: Mapping[str, Any], top_level_theta: float,
          max_position: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) with HF's precedence: ``rope_scaling`` over ``rope_parameters``,
    a theta inside them over the top-level ``rope_theta``."""
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], Mapping):
            raise TypeError(f"{key} must be a JSON object (e.g. {{\"rope_type\": \"linear\", "
                            f"\"factor\": 2.0}}) or null, got {_brief(hf[key])}")
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported, got "
                         f"{_brief(params)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial rotary embedding is not supported, got "
                         f"partial_rotary_factor={_brief(partial)}")
    theta = params.get("rope_theta", top_level_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise TypeError(f"rope_type must be a string, got {_brief(rope_type)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=params.get("factor"))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings",
                              hf.get("original_max_position_embeddings", max_position))
        return theta, RopeScaling("llama3", factor=params.get("factor"),
                                  low_freq_factor=params.get("low_freq_factor"),
                                  high_freq_factor=params.get("high_freq_factor"),
                                  original_max_position_embeddings=original)
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; fastllm supports 'default', "
                     "'linear' and 'llama3'")


def _layer_rules(arch: str, hf: Mapping[str, Any], get, num_layers: int
                 ) -> tuple[int | None, list[str], tuple[bool, ...]]:
    """(sliding_window, layer_types, rope_layers) as each HF config class resolves them."""
    layer_types = hf.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise TypeError(f"layer_types must be a list, got {_brief(layer_types)}")
    rope_layers = (True,) * num_layers
    if arch == "LlamaForCausalLM":
        sliding_window, layer_types = None, ["full_attention"] * num_layers
    elif arch == "MistralForCausalLM":
        # Every layer slides when the window is set; Mistral ignores layer_types.
        sliding_window = get("sliding_window")
        layer_types = ["full_attention" if sliding_window is None else "sliding_attention"
                       ] * num_layers
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # The window exists only with use_sliding_window, and then only from max_window_layers.
        use_window = _check_bool("use_sliding_window", hf.get("use_sliding_window", False))
        sliding_window = get("sliding_window") if use_window else None
        if layer_types is None:
            first_sliding = _check_int("max_window_layers", get("max_window_layers", 28),
                                       MAX_POSITIONS, low=0)
            layer_types = ["sliding_attention" if sliding_window is not None and i >= first_sliding
                           else "full_attention" for i in range(num_layers)]
    else:  # SmolLM3
        # no_rope_layers[i] == 1 means layer i *uses* RoPE (HF: use_rope = no_rope_layers[i]).
        no_rope_layers = hf.get("no_rope_layers")
        if no_rope_layers is None:
            interval = _check_int("no_rope_layer_interval", hf.get("no_rope_layer_interval", 4),
                                  MAX_POSITIONS)
            no_rope_layers = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if not isinstance(no_rope_layers, list) or len(no_rope_layers) != num_layers or any(
                f not in (0, 1) or isinstance(f, float) for f in no_rope_layers):
            raise ValueError(f"no_rope_layers must be {num_layers} values of 0 or 1, got "
                             f"{_brief(no_rope_layers)}")
        rope_layers = tuple(bool(f) for f in no_rope_layers)
        sliding_window = get("sliding_window")
        if layer_types is None:
            slide = _check_bool("use_sliding_window", hf.get("use_sliding_window", False)) \
                and sliding_window is not None
            layer_types = ["sliding_attention" if slide and not rope else "full_attention"
                           for rope in rope_layers]
    if len(layer_types) != num_layers or any(t not in _LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types must be {num_layers} of {_LAYER_TYPES}, got "
                         f"{_brief(layer_types)}")
    return sliding_window, layer_types, rope_layers


def _check_int(name: str, value: Any, high: int, *, low: int = 1) -> int:
    """``value``, if it is an int in ``[low, high]``; else a TypeError (not an int: a bool, a
    float, a string) or a ValueError (out of bounds) naming ``name`` and the value."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int in [{low}, {high}], got {_brief(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value}")
    return value


def _check_positive_number(name: str, value: Any) -> float:
    """``value``, if it is a finite int or float > 0; else a TypeError or ValueError."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive number, got {_brief(value)}")
    if not 0 < value <= sys.float_info.max:  # False for NaN and inf; exact for huge ints
        raise ValueError(f"{name} must be a positive number, got {_brief(value)}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    """``value``, if it is a bool: JSON's ``"false"`` is a string, and truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {_brief(value)}")
    return value


def _brief(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config may hold long lists)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
