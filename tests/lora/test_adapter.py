"""peft LoRA adapters read into fastllm's layout (fastllm.lora.load_adapter), checked against
peft itself: for every layer and projection, ``B @ A`` equals what peft's merge adds to the
fused weight, on the whole model and on each tensor-parallel rank's shard; every refusal names
what it refuses; a hub repo id is downloaded through huggingface_hub (a local endpoint)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from hub_server import LocalHub
from safetensors.torch import load_file, save_file
from tiny_hf import random_hf_model, save_hf_model

from fastllm.hub import ModelNotFoundError
from fastllm.lora import LORA_PROJECTIONS, LoRAAdapter, LoRARequest, load_adapter
from fastllm.models import ModelConfig, TensorParallel, hf_weight_map, load_model
from fastllm.models.tensor_parallel import ShardLayout

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
# name -> (model_type, overrides of SHAPE). Qwen3's heads are wider than hidden / heads, so q
# rows (128) differ from the hidden size; Phi-3's checkpoint fuses q|k|v and gate|up.
MODELS = {"llama": ("llama", {}), "qwen3": ("qwen3", dict(head_dim=32)), "phi3": ("phi3", {})}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PARAMETERS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
              "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}
WHOLE = None  # no tensor parallelism


class Base:
    """A tiny random HF model, saved, with fastllm's config of it."""

    def __init__(self, name: str, folder: Path) -> None:
        model_type, overrides = MODELS[name]
        self.hf = random_hf_model(model_type, seed=0, **{**SHAPE, **overrides})
        self.folder = save_hf_model(self.hf, folder)
        self.config = ModelConfig.from_pretrained(folder)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Base]:
    return {name: Base(name, tmp_path_factory.mktemp(name)) for name in MODELS}


def save_adapter(base: Base, folder: Path, **lora) -> tuple[dict[str, torch.Tensor],
                                                            dict[str, int]]:
    """A random peft LoRA of ``base`` (B random too) saved in ``folder``; returns what peft's
    merge adds to each HF weight, and each adapted module's rank."""
    import peft

    model = peft.get_peft_model(copy.deepcopy(base.hf),
                                peft.LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(folder)
    ranks = {name.removeprefix("base_model.model."): module.r["default"]
             for name, module in model.named_modules() if hasattr(module, "lora_A")}
    merged = model.merge_and_unload().state_dict()
    weights = base.hf.state_dict()
    return {name: merged[name] - weights[name] for name in weights}, ranks


def load(folder: Path | str, config: ModelConfig, tensor_parallel: TensorParallel | None = WHOLE,
         *, max_lora_rank: int = 64, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    return load_adapter(LoRARequest("test", 1, str(folder)), config,
                        ShardLayout.of(config, tensor_parallel), max_lora_rank=max_lora_rank,
                        dtype=dtype)


def fused(tensors: dict[str, torch.Tensor], config: ModelConfig, layer: int,
          projection: str) -> torch.Tensor:
    """HF tensors joined into fastllm's fused parameter, as hf_weight_map joins the weights."""
    parts = hf_weight_map(config)[f"layers.{layer}.{PARAMETERS[projection]}.weight"]
    return torch.cat([tensors[hf_name] for hf_name, _ in parts])


def delta(adapter: LoRAAdapter, layer: int, projection: str) -> torch.Tensor:
    a, b = adapter.layers[layer][projection]
    return b.float() @ a.float()


CASES = {
    "llama-all-seven": ("llama", dict(r=8, lora_alpha=16, target_modules=SEVEN)),
    "llama-q-v-rslora": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                       use_rslora=True)),
    "qwen3-patterns": ("qwen3", dict(r=4, lora_alpha=8, target_modules=SEVEN,
                                     rank_pattern={"k_proj": 2, "layers.1.mlp.down_proj": 6},
                                     alpha_pattern={"o_proj": 3})),
    "qwen3-k-o-up-layer-1": ("qwen3", dict(r=3, lora_alpha=5, use_rslora=True,
                                           target_modules=["k_proj", "o_proj", "up_proj"],
                                           layers_to_transform=[1])),
    "phi3-fused": ("phi3", dict(r=4, lora_alpha=8, target_modules=FUSED,
                                rank_pattern={"layers.1.self_attn.qkv_proj": 2})),
}


@pytest.mark.parametrize("case", CASES)
def test_b_a_is_what_peft_adds(case, bases, tmp_path):
    name, lora = CASES[case]
    base = bases[name]
    added, ranks = save_adapter(base, tmp_path, **lora)
    adapter = load(tmp_path, base.config)
    assert (adapter.name, adapter.int_id, adapter.rank) == ("test", 1, max(ranks.values()))
    assert len(adapter.layers) == base.config.num_layers
    for layer in range(base.config.num_layers):
        for projection in LORA_PROJECTIONS:
            expected = fused(added, base.config, layer, projection)
            parts = hf_weight_map(base.config)[f"layers.{layer}.{PARAMETERS[projection]}.weight"]
            rank = sum(ranks.get(hf_name.removesuffix(".weight"), 0) for hf_name, _ in parts)
            if rank == 0:
                assert projection not in adapter.layers[layer]
                assert not expected.any()
                continue
            a, b = adapter.layers[layer][projection]
            assert a.shape == (rank, expected.shape[1]) and b.shape == (expected.shape[0], rank)
            for t in (a, b):
                assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
            torch.testing.assert_close(b @ a, expected, rtol=1e-5, atol=1e-6)


def test_dtype_and_the_default_adapter_name_infix(bases, tmp_path):
    """Cast to the dtype asked for; keys with peft's ".default" infix read the same."""
    base = bases["llama"]
    save_adapter(base, tmp_path / "plain", r=4, lora_alpha=8, target_modules=SEVEN)
    reference = load(tmp_path / "plain", base.config)
    half = load(tmp_path / "plain", base.config, dtype=torch.bfloat16)
    shutil.copytree(tmp_path / "plain", tmp_path / "infix")
    weights = tmp_path / "infix" / "adapter_model.safetensors"
    save_file({key.replace(".weight", ".default.weight"): t
               for key, t in load_file(weights).items()}, weights)
    infix = load(tmp_path / "infix", base.config)
    for layer in range(base.config.num_layers):
        for projection, (a, b) in reference.layers[layer].items():
            half_a, half_b = half.layers[layer][projection]
            assert half_a.dtype == half_b.dtype == torch.bfloat16
            assert torch.equal(half_a, a.bfloat16()) and torch.equal(half_b, b.bfloat16())
            assert all(torch.equal(x, y) for x, y in zip(infix.layers[layer][projection],
                                                         (a, b)))


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_concatenate_to_the_whole(name, bases, tmp_path):
    """Column-parallel q|k|v and gate|up: the ranks' B rows of each sub-module, one after the
    other, are the whole's, A whole on each; row-parallel o and down: the ranks' A columns are
    the whole's, B whole on each."""
    base = bases[name]
    config = base.config
    save_adapter(base, tmp_path, r=4, lora_alpha=8,
                 target_modules=FUSED if name == "phi3" else SEVEN)
    whole = load(tmp_path, config)
    ranks = [load(tmp_path, config, TensorParallel(rank, 2, "unused")) for rank in range(2)]
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    blocks = {"qkv": [q, kv, kv], "gate_up": [config.intermediate_size] * 2}
    for layer in range(config.num_layers):
        for projection in LORA_PROJECTIONS:
            a, b = whole.layers[layer][projection]
            shards = [shard.layers[layer][projection] for shard in ranks]
            if projection in blocks:
                halves = [shard_b.split([n // 2 for n in blocks[projection]])
                          for _, shard_b in shards]
                assert torch.equal(torch.cat([half for block in zip(*halves) for half in block]),
                                   b)
                assert all(torch.equal(shard_a, a) for shard_a, _ in shards)
            else:
                assert torch.equal(torch.cat([shard_a for shard_a, _ in shards], dim=1), a)
                assert all(torch.equal(shard_b, b) for _, shard_b in shards)


@pytest.mark.parametrize("name, size", [("llama", 2), ("qwen3", 4), ("phi3", 2)])
def test_each_rank_adds_what_peft_adds_to_its_shard(name, size, bases, tmp_path):
    """On every rank, B @ A is the merged model's shard less the base model's, both loaded by
    fastllm's loader; 4 ranks over 2 key/value heads replicate each head on two; Phi-3's fused
    tensors are cut sub-module by sub-module."""
    base = bases[name]
    added, _ = save_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8,
                            target_modules=FUSED if name == "phi3" else SEVEN)
    merged = copy.deepcopy(base.hf)
    merged.load_state_dict({key: w + added[key] for key, w in base.hf.state_dict().items()})
    save_hf_model(merged, tmp_path / "merged")
    for rank in range(size):
        tensor_parallel = TensorParallel(rank, size, "unused")
        adapter = load(tmp_path / "adapter", base.config, tensor_parallel)
        weights = load_model(base.folder, tensor_parallel=tensor_parallel).state_dict()
        merged_weights = load_model(tmp_path / "merged",
                                    tensor_parallel=tensor_parallel).state_dict()
        for layer in range(base.config.num_layers):
            for projection in LORA_PROJECTIONS:
                key = f"layers.{layer}.{PARAMETERS[projection]}.weight"
                torch.testing.assert_close(delta(adapter, layer, projection),
                                           merged_weights[key] - weights[key],
                                           rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def good(bases, tmp_path_factory) -> Path:
    """A valid llama adapter (q and v, r=4), which each refusal test copies and spoils."""
    folder = tmp_path_factory.mktemp("good")
    save_adapter(bases["llama"], folder, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return folder


def spoiled(good: Path, out: Path, options: dict | None = None,
            tensors: dict[str, torch.Tensor | None] | None = None) -> Path:
    """A copy of ``good`` with ``options`` set in its config and ``tensors`` set (None:
    removed) in its weights."""
    shutil.copytree(good, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **(options or {})}))
    weights = load_file(out / "adapter_model.safetensors")
    for key, tensor in (tensors or {}).items():
        if tensor is None:
            del weights[key]
        else:
            weights[key] = tensor
    save_file(weights, out / "adapter_model.safetensors")
    return out


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("options, match", [
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias='all'"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(peft_type="IA3"), "peft_type is 'IA3'"),
    (dict(init_lora_weights="pissa_niter_4"), "init_lora_weights='pissa_niter_4'"),
    (dict(r=2), r"q_proj.lora_A.weight has shape \(4, 64\), expected \(2, 64\)"),
    (dict(rank_pattern={"v_proj": 3}), r"v_proj.lora_A.weight has shape \(4, 64\)"),
    (dict(r="4"), "r must be an int"),
])
def test_refuses_options(options, match, good, bases, tmp_path):
    folder = spoiled(good, tmp_path / "adapter", options=options)
    with pytest.raises((ValueError, TypeError), match=match) as error:
        load(folder, bases["llama"].config)
    assert "LoRA adapter 'test'" in str(error.value)


@pytest.mark.parametrize("tensors, match", [
    ({f"{Q}.lora_B.weight": None}, f"{Q.removeprefix('base_model.model.')}.lora_B.weight is "
                                   "missing"),
    ({f"{Q}.lora_B.weight": torch.zeros(64, 5)},
     r"q_proj.lora_B.weight has shape \(64, 5\), expected \(64, 4\)"),
    ({f"{Q}.lora_A.weight": torch.zeros(4, 64, dtype=torch.int32)},
     f"{Q}.lora_A.weight is stored as I32"),
    ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
      "base_model.model.lm_head.lora_B.weight": torch.zeros(128, 4)}, "LoRA on lm_head"),
    ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128),
      "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(64, 4)},
     "LoRA on model.embed_tokens"),
    ({"base_model.model.model.layers.1.self_attn.q_norm.lora_A.weight": torch.zeros(4, 16),
      "base_model.model.model.layers.1.self_attn.q_norm.lora_B.weight": torch.zeros(16, 4)},
     "LoRA on model.layers.1.self_attn.q_norm"),
    ({f"{Q}.lora_magnitude_vector": torch.zeros(64)}, "unexpected tensor .*magnitude"),
])
def test_refuses_tensors(tensors, match, good, bases, tmp_path):
    folder = spoiled(good, tmp_path / "adapter", tensors=tensors)
    with pytest.raises(ValueError, match=match):
        load(folder, bases["llama"].config)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_refuses_peft_targets_outside_the_layers(target, bases, tmp_path):
    save_adapter(bases["llama"], tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", target])
    with pytest.raises(ValueError, match=f"LoRA on (model.)?{target} is not supported"):
        load(tmp_path, bases["llama"].config)


def test_refuses_experts_and_router(good, bases, tmp_path):
    """A Qwen3-MoE of the llama's attention shapes: LoRA on attention loads; on layer 0's
    experts or router (a mixture of experts) it is refused by name."""
    config = ModelConfig.from_hf_config(dict(
        architectures=["Qwen3MoeForCausalLM"], **{**SHAPE, "head_dim": 16}, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32))
    assert load(good, config).layers[0].keys() == {"qkv"}
    for module, rows in (("mlp.experts.0.gate_proj", 32), ("mlp.gate", 4)):
        key = f"base_model.model.model.layers.0.{module}"
        factors = {f"{key}.lora_A.weight": torch.zeros(4, 64),
                   f"{key}.lora_B.weight": torch.zeros(rows, 4)}
        folder = spoiled(good, tmp_path / module, tensors=factors)
        with pytest.raises(ValueError, match=f"LoRA on model.layers.0.{module}, in layer 0's "
                                             "mixture of experts"):
            load(folder, config)


def test_refuses_a_rank_above_max_lora_rank(good, bases):
    with pytest.raises(ValueError, match="q_proj has rank r=4, above max_lora_rank=2"):
        load(good, bases["llama"].config, max_lora_rank=2)
    assert load(good, bases["llama"].config, max_lora_rank=4).rank == 4


def test_refuses_a_pickled_adapter(good, bases, tmp_path):
    folder = spoiled(good, tmp_path / "adapter")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle checkpoint"):
        load(folder, bases["llama"].config)
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle checkpoint"):
        load(folder / "adapter_model.bin", bases["llama"].config)


def test_base_model_name_is_not_checked(good, bases, tmp_path):
    folder = spoiled(good, tmp_path / "adapter",
                     options=dict(base_model_name_or_path="someone/another-model"))
    assert load(folder, bases["llama"].config).layers[1].keys() == {"qkv"}


@pytest.mark.parametrize("fields, error, match", [
    (("", 1, "p"), ValueError, "lora_name"),
    ((None, 1, "p"), TypeError, "lora_name"),
    (("a", 0, "p"), ValueError, "lora_int_id"),
    (("a", -2, "p"), ValueError, "lora_int_id"),
    (("a", True, "p"), TypeError, "lora_int_id"),
    (("a", 1.0, "p"), TypeError, "lora_int_id"),
    (("a", 1, ""), ValueError, "lora_path"),
    (("a", 1, Path("p")), TypeError, "lora_path"),
])
def test_request_fields_are_checked(fields, error, match):
    with pytest.raises(error, match=match):
        LoRARequest(*fields)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A :class:`LocalHub`, huggingface_hub pointed at it (``HF_ENDPOINT``) with an empty cache,
    online, as tests/entrypoints/test_hub.py points it."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with LocalHub() as local:
        monkeypatch.setattr(constants, "ENDPOINT", local.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            local.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield local


def test_a_hub_repo_id_downloads_the_adapter_only(hub, good, bases):
    config = bases["llama"].config
    files = {p.name: p for p in good.iterdir()}
    hub.add("org/adapter", {**files, "adapter_model.bin": b"never downloaded",
                            "training_args.bin": b"never downloaded"})
    adapter, local = load("org/adapter", config), load(good, config)
    for layer in range(config.num_layers):
        assert all(torch.equal(x, y) for x, y in zip(adapter.layers[layer]["qkv"],
                                                     local.layers[layer]["qkv"]))
    downloaded = {path.rsplit("/", 1)[-1] for path in hub.requested("") if "/resolve/" in path}
    assert downloaded == {"adapter_config.json", "adapter_model.safetensors"}


def test_hub_errors_name_the_repo(hub, good, bases):
    config = bases["llama"].config
    with pytest.raises(ModelNotFoundError, match="LoRA adapter 'test' .*has no repo org/missing"):
        load("org/missing", config)
    hub.add("org/pickled", {"adapter_config.json": good / "adapter_config.json",
                            "adapter_model.bin": b"pickle"})
    with pytest.raises(ValueError, match="org/pickled/adapter_model.bin is a pickle checkpoint"):
        load("org/pickled", config)
    hub.add("org/model", {"config.json": bases["llama"].folder / "config.json"})
    with pytest.raises(ModelNotFoundError, match="org/model holds no adapter_config.json"):
        load("org/model", config)
