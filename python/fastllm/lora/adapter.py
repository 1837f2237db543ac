"""peft LoRA adapters read into fastllm's layout: one ``(A, B)`` pair per fused projection.

peft trains a pair per HF module (``q_proj``, ``k_proj`` ...), each adding ``scale * B @ A`` to
that module's weight. fastllm runs q|k|v and gate|up as one fused projection each
(:func:`fastllm.models.hf_weight_map`), so the pairs of a projection's sub-modules are stacked
into one: their A's one above the other, their B's block-diagonal, the scale folded into B. One
batched product per projection then applies any subset of the sub-modules. A tensor-parallel
rank keeps the rows (column-parallel q|k|v, gate|up) or the input columns (row-parallel o, down)
of ``B @ A`` that it holds of the base weight (:meth:`ShardLayout.slices`).

Only safetensors adapters are read (a pickle is refused, as the model loader refuses one), and
only plain LoRA on the decoder layers' projections: an option that makes peft compute something
else (DoRA, biases, trained embeddings ...) is a ValueError naming it, never silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fastllm.hub import ModelNotFoundError, download_files, parse_model_name, repo_files
from fastllm.models.build import fused_rows, hf_weight_map
from fastllm.models.checks import brief, check_bool, check_int, check_positive_number
from fastllm.models.config import ModelConfig
from fastllm.models.loader import FLOAT_DTYPES, PICKLE_SUFFIXES, open_safetensors
from fastllm.models.tensor_parallel import ShardLayout, TensorSlice

__all__ = ["LORA_PROJECTIONS", "LoRAAdapter", "LoRARequest", "load_adapter"]

# fastllm's projections that take LoRA, in this order.
LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# Each projection's fused parameter, less "layers.{i}." and ".weight".
_PARAMETERS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
               "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}

_CONFIG_FILE = "adapter_config.json"
_WEIGHTS_FILE = "adapter_model.safetensors"
# A LoRA factor as peft saves it: "base_model.model." + the HF module + ".lora_A.weight", with
# the adapter's name after lora_A in some versions (".lora_A.default.weight"); an embedding's
# factors are "lora_embedding_A" (named here only to be refused by their module).
_FACTOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?:embedding_)?(?P<factor>[AB])"
                     r"(?:\.[\w-]+)?(?:\.weight)?")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# adapter_config.json options that make peft add something other than B @ A to the projections
# (or train more than them); refused unless unset (None, false, "none", empty).
_REFUSED_OPTIONS = {
    "bias": "it trains the base model's biases",
    "lora_bias": "it gives lora_B a bias",
    "fan_in_fan_out": "it is for Conv1D (GPT-2 style) weights, stored transposed",
    "modules_to_save": "it trains whole modules beside the LoRA weights",
    "trainable_token_indices": "it trains rows of the embedding",
    "target_parameters": "it puts LoRA on parameters (such as experts') rather than projections",
    "layer_replication": "it repeats layers of the base model",
    "use_dora": "DoRA rescales each adapted weight's columns",
    "use_qalora": "QA-LoRA pools the input before lora_A",
    "alora_invocation_tokens": "aLoRA adapts only the tokens after its invocation",
    "use_bdlora": "it is a LoRA variant fastllm does not run",
    "velora_config": "it is a LoRA variant fastllm does not run",
    "monteclora_config": "it is a LoRA variant fastllm does not run",
    "arrow_config": "it is a LoRA variant fastllm does not run",
    "kasa_config": "it is a LoRA variant fastllm does not run",
}
# Initializations that also rewrite the base weights (W - B0 @ A0): such an adapter applies to
# the original model only once saved with peft's path_initial_model_for_weight_conversion,
# which records init_lora_weights as true.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "lora_ga")
# The largest rank a config may give: far above any adapter's, low enough that a typo cannot
# pass for one.
_MAX_RANK = 1 << 16


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to serve, by vLLM's name and fields.

    Attributes:
        lora_name: its name, as requests choose it (a non-empty str).
        lora_int_id: its id, a positive int (0 stands for "no adapter" elsewhere).
        lora_path: a local peft folder, or a Hugging Face Hub repo id holding one.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"LoRARequest.{name} must be a str, got {brief(value)}")
            if not value:
                raise ValueError(f"LoRARequest.{name} must not be empty")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool):
            raise TypeError(f"LoRARequest.lora_int_id must be an int, got "
                            f"{brief(self.lora_int_id)}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be positive (0 means no adapter), "
                             f"got {self.lora_int_id}")


@dataclass
class LoRAAdapter:
    """One adapter in fastllm's layout, for one rank's shard.

    Attributes:
        name, int_id: the request's ``lora_name`` and ``lora_int_id``.
        rank: the largest ``r`` of its modules.
        layers: per decoder layer, ``projection -> (A [R, in], B [out, R])`` for each of
            :data:`LORA_PROJECTIONS` it adapts there (absent: no LoRA). ``R`` is the sum of the
            ranks of the projection's sub-modules (q, k, v; gate, up) the adapter targets; B is
            block-diagonal over them and holds the scale (``lora_alpha / r``, or
            ``lora_alpha / sqrt(r)`` with rsLoRA), so ``B @ A`` is exactly what peft adds to the
            projection's fused weight, in fastllm's row order and this shard's rows / columns.
    """

    name: str
    int_id: int
    rank: int
    layers: list[dict[str, tuple[Tensor, Tensor]]] = field(repr=False)


@dataclass(frozen=True)
class _Module:
    """One HF module a projection is made of: its weight's shape ``[out, in]`` and its rows'
    blocks ``(first row, rows, what this rank holds of them: None for all)``, one per sub-module
    (several for a module the checkpoint stores fused: Phi-3's q|k|v, gate|up)."""

    name: str
    shape: tuple[int, int]
    blocks: list[tuple[int, int, TensorSlice | None]]


@dataclass(frozen=True)
class _Options:
    """The adapter_config.json values that shape the weights (peft's meaning)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def scale(self, module: str) -> tuple[int, float]:
        """The rank and scale of HF module ``module``: the first pattern key matching the end
        of its name overrides ``r`` / ``lora_alpha``, as peft's ``get_pattern_key`` picks it."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


def load_adapter(request: LoRARequest, config: ModelConfig, shard: ShardLayout, *,
                 max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Reads the peft LoRA adapter ``request`` names, for the model ``config`` describes, as
    the rank ``shard`` lays out holds it: its tensors cast to ``dtype``, contiguous, on the CPU.

    ``request.lora_path`` is a folder with ``adapter_config.json`` and
    ``adapter_model.safetensors``, or else a Hugging Face Hub repo id whose two files are
    downloaded through huggingface_hub (its cache and environment apply, as for models:
    :mod:`fastllm.hub`); a repo the hub does not have is a :class:`ModelNotFoundError` naming
    it. A pickled adapter (``adapter_model.bin``) is refused.

    A ValueError naming the adapter and the offending key or value refuses: a module's ``r``
    above ``max_lora_rank``; LoRA on anything but the decoder layers' q/k/v, o, gate/up and down
    projections (the embedding, the LM head, a mixture of experts' experts or router); options
    peft computes something else with (``use_dora``, ``bias``, ``modules_to_save``,
    ``fan_in_fan_out`` ... see ``_REFUSED_OPTIONS``); a ``peft_type`` other than LORA; a
    tensor whose shape does not fit the model, a lora_A without its lora_B (or the reverse),
    one not stored as floats. ``base_model_name_or_path`` is not checked: adapters are often
    pointed at a local copy of their base.
    """
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = _adapter_folder(request.lora_path, where)
    options = _read_options(folder / _CONFIG_FILE, where)
    factors, others = _read_factors(folder / _WEIGHTS_FILE, where)
    projections = _projections(config, shard)
    # The modules first: peft saves a targeted embedding or LM head whole beside its factors.
    _check_modules(factors, projections, config, where)
    if others:
        raise ValueError(f"{where}: unexpected tensor {others[0]} in {_WEIGHTS_FILE} (fastllm "
                         "reads LoRA factors only: ...lora_A.weight, ...lora_B.weight)")

    # Scaled in float32 at least, as peft scales (and merges) in the weights' float32.
    compute = torch.promote_types(dtype, torch.float32)
    layers: list[dict[str, tuple[Tensor, Tensor]]] = [{} for _ in range(config.num_layers)]
    largest = 0
    for (layer, projection), modules in projections.items():
        a_parts: list[Tensor] = []  # each targeted module's A, cut to this rank's columns
        b_blocks: list[tuple[int, int, Tensor]] = []  # (output row, first column, B's rows)
        row = col = 0
        for module in modules:
            if module.name not in factors:  # not targeted: its rows of B stay zero
                row += sum(_held_rows(rows, part) for _, rows, part in module.blocks)
                continue
            a, b = factors[module.name]["A"], factors[module.name]["B"]
            r, scale = options.scale(module.name)
            _check_shape(module.name, "A", a, (r, module.shape[1]), where)
            _check_shape(module.name, "B", b, (module.shape[0], r), where)
            if r > max_lora_rank:
                raise ValueError(f"{where}: {module.name} has rank r={r}, above max_lora_rank="
                                 f"{max_lora_rank}; raise max_lora_rank to serve it")
            largest = max(largest, r)
            b = b.to(compute) * scale
            for first, rows, part in module.blocks:
                block = b[first:first + rows]
                if part is not None and part.dim == 0:  # column-parallel: this rank's rows
                    block = block[part.start:part.stop]
                if part is not None and part.dim == 1:  # row-parallel: its input columns
                    a = a[:, part.start:part.stop]
                b_blocks.append((row, col, block))
                row += block.shape[0]
            a_parts.append(a.to(compute))
            col += r
        if not a_parts:
            continue
        stacked_b = torch.zeros(row, col, dtype=compute)  # [out here, R], block-diagonal
        for first_row, first_col, block in b_blocks:
            stacked_b[first_row:first_row + block.shape[0],
                      first_col:first_col + block.shape[1]] = block
        stacked_a = torch.cat(a_parts)  # [R, in here]
        layers[layer][projection] = (stacked_a.to(dtype).contiguous(),
                                     stacked_b.to(dtype).contiguous())
    return LoRAAdapter(request.lora_name, request.lora_int_id, largest, layers)


def _adapter_folder(lora_path: str, where: str) -> Path:
    """The local folder of ``lora_path``: itself, or the hub repo it names downloaded (its
    adapter_config.json and adapter_model.safetensors only) into huggingface_hub's cache."""
    path = Path(lora_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if path.suffix in PICKLE_SUFFIXES:
            raise ValueError(_pickle_refusal(where, str(path)))
        raise ValueError(f"{where}: {path} is a file; a LoRA adapter is a peft folder "
                         f"({_CONFIG_FILE} and {_WEIGHTS_FILE})")
    name = parse_model_name(lora_path)
    if name is None or name.quant is not None or name.filename is not None:
        raise ModelNotFoundError(f"{where}: no such folder, nor a Hugging Face repo id "
                                 "(org/name)")
    try:
        files = repo_files(name.repo_id, None)
        if _CONFIG_FILE not in files:
            raise ModelNotFoundError(f"{name.repo_id} holds no {_CONFIG_FILE}: not a peft "
                                     "adapter")
        if _WEIGHTS_FILE not in files:
            pickles = [f for f in files if Path(f).suffix in PICKLE_SUFFIXES]
            if pickles:
                raise ValueError(_pickle_refusal(where, f"{name.repo_id}/{pickles[0]}"))
            raise ModelNotFoundError(f"{name.repo_id} holds no {_WEIGHTS_FILE}")
        return download_files(name, None, [_CONFIG_FILE, _WEIGHTS_FILE])
    except ModelNotFoundError as error:  # fastllm.hub's message, said of this adapter
        raise ModelNotFoundError(f"{where}: {error}") from None


def _pickle_refusal(where: str, file: str) -> str:
    return (f"{where}: {file} is a pickle checkpoint; fastllm loads only safetensors, since "
            "unpickling can run arbitrary code. Convert it first, e.g. with peft: "
            "PeftModel.from_pretrained(base_model, folder).save_pretrained(out, "
            "safe_serialization=True)")


def _read_options(path: Path, where: str) -> _Options:
    """adapter_config.json's values, checked: a refused option or a bad value is a ValueError
    (a TypeError for a value of the wrong kind) naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no {_CONFIG_FILE} in {path.parent} (expected a peft "
                                "LoRA adapter folder)")
    try:
        values: Any = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
        raise ValueError(f"{where}: {path} is not valid JSON: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{where}: {path} holds {brief(values)}, not an object")
    if values.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type is {values.get('peft_type')!r}; fastllm serves "
                         "LoRA adapters only (peft_type 'LORA')")
    for key, why in _REFUSED_OPTIONS.items():
        value = values.get(key)
        if value not in (None, False, "none") and value != [] and value != {}:
            raise ValueError(f"{where}: {_CONFIG_FILE} sets {key}={brief(value)}, which fastllm "
                             f"does not support: {why}")
    init = values.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ValueError(f"{where}: init_lora_weights={init!r} also changed the base weights; "
                         "save the adapter with peft's path_initial_model_for_weight_conversion "
                         "to make it apply to the original model")
    try:  # peft's defaults where a key is absent
        return _Options(
            check_int("r", values.get("r", 8), _MAX_RANK),
            check_positive_number("lora_alpha", values.get("lora_alpha", 8)),
            check_bool("use_rslora", values.get("use_rslora", False)),
            _pattern(values, "rank_pattern", lambda key, v: check_int(key, v, _MAX_RANK)),
            _pattern(values, "alpha_pattern", check_positive_number))
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: {_CONFIG_FILE}: {error}") from None


def _pattern(values: dict[str, Any], key: str,
             check: Callable[[str, Any], Any]) -> dict[str, Any]:
    """``values[key]`` (module pattern -> value), each value checked."""
    pattern = values.get(key) or {}
    if not isinstance(pattern, dict):
        raise TypeError(f"{key} must map module names to values, got {brief(pattern)}")
    return {name: check(f"{key}[{name!r}]", value) for name, value in pattern.items()}


def _pattern_key(pattern: dict[str, Any], module: str) -> str:
    """peft's ``get_pattern_key``: the first key that matches the end of ``module`` (as a
    regex, after a dot or at the start), else ``module``."""
    return next((key for key in pattern if re.match(rf"(.*\.)?({key})$", module)), module)


def _read_factors(path: Path, where: str) -> tuple[dict[str, dict[str, Tensor]], list[str]]:
    """HF module -> {"A": lora_A, "B": lora_B} from the adapter's safetensors file, and the
    names of its other tensors (unread); a factor twice or one without its partner, or one not
    stored as floats is a ValueError naming it."""
    if not path.is_file():
        pickles = sorted(p for p in path.parent.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(_pickle_refusal(where, str(pickles[0])))
        raise FileNotFoundError(f"{where}: no {_WEIGHTS_FILE} in {path.parent}")
    factors: dict[str, dict[str, Tensor]] = {}
    others: list[str] = []
    with open_safetensors(path) as handle:
        for key in handle.keys():
            match = _FACTOR.fullmatch(key)
            if match is None:
                others.append(key)
                continue
            stored = handle.get_slice(key).get_dtype()
            if stored not in FLOAT_DTYPES:
                raise ValueError(f"{where}: tensor {key} is stored as {stored}; a LoRA weight "
                                 f"must be floats ({', '.join(FLOAT_DTYPES)})")
            pair = factors.setdefault(match["module"], {})
            if match["factor"] in pair:
                raise ValueError(f"{where}: {path.name} holds lora_{match['factor']} of "
                                 f"{match['module']} twice (a second adapter's, as {key})")
            pair[match["factor"]] = handle.get_tensor(key)
    if not factors:
        raise ValueError(f"{where}: {path.name} holds no LoRA weights")
    for module, pair in factors.items():
        for factor, partner in (("A", "B"), ("B", "A")):
            if factor not in pair:
                raise ValueError(f"{where}: {module}.lora_{factor}.weight is missing (its "
                                 f"lora_{partner} is in {path.name})")
    return factors, others


def _projections(config: ModelConfig, shard: ShardLayout) -> dict[tuple[int, str], list[_Module]]:
    """(layer, projection) -> the HF modules it is made of, in fastllm's row order, for each
    dense projection of the model: :func:`hf_weight_map`'s parts, each block cut as
    :meth:`ShardLayout.slices` cuts the base weight's."""
    weight_map = hf_weight_map(config)
    projections: dict[tuple[int, str], list[_Module]] = {}
    for layer in range(config.num_layers):
        for projection in LORA_PROJECTIONS:
            name = f"layers.{layer}.{_PARAMETERS[projection]}.weight"
            if name not in weight_map:  # a mixture of experts' stacked weights
                continue
            parts = weight_map[name]
            fused = fused_rows(config, name)
            splits = [fused] if fused is not None else [[shape[0]] for _, shape in parts]
            # The sub-modules' blocks, each as the base weight's part slices() takes.
            blocks = [(hf_name, (rows, shape[1])) for (hf_name, shape), split in zip(parts, splits)
                      for rows in split]
            cuts = iter(shard.slices(name, blocks))
            modules = []
            for (hf_name, shape), split in zip(parts, splits):
                firsts = [sum(split[:i]) for i in range(len(split))]
                modules.append(_Module(hf_name.removesuffix(".weight"), shape,
                                       [(first, rows, next(cuts))
                                        for first, rows in zip(firsts, split)]))
            projections[layer, projection] = modules
    return projections


def _held_rows(rows: int, part: TensorSlice | None) -> int:
    """The rows this rank holds of a block of ``rows``, cut by ``part``."""
    return rows if part is None or part.dim == 1 else part.stop - part.start


def _check_modules(factors: dict[str, dict[str, Tensor]],
                   projections: dict[tuple[int, str], list[_Module]], config: ModelConfig,
                   where: str) -> None:
    """Refuses LoRA on a module that is not one of the projections' (naming it)."""
    supported = {module.name for modules in projections.values() for module in modules}
    moe_block = None if config.family.moe is None else config.family.moe.router.split(".")[0]
    for module in factors:
        if module in supported:
            continue
        layer = _LAYER.fullmatch(module)
        if (layer is not None and moe_block is not None
                and int(layer[1]) < config.num_layers and config.moe_layers[int(layer[1])]
                and layer[2].startswith(moe_block + ".")):
            raise ValueError(f"{where}: LoRA on {module}, in layer {layer[1]}'s mixture of "
                             "experts, is not supported: fastllm applies LoRA to dense "
                             "projections only")
        kinds = sorted({name.split(".", 3)[-1] for name in supported})
        raise ValueError(f"{where}: LoRA on {module} is not supported: fastllm applies LoRA "
                         f"to the {', '.join(kinds)} of a {config.architecture}'s "
                         f"{config.num_layers} layers only")


def _check_shape(module: str, factor: str, tensor: Tensor, shape: tuple[int, int],
                 where: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{where}: tensor {module}.lora_{factor}.weight has shape "
                         f"{tuple(tensor.shape)}, expected {shape} from the model's config and "
                         f"{_CONFIG_FILE}")
