"""load_model and ModelConfig: sharded checkpoints, dtypes, the name map, and every refusal."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from fastllm.models import DecoderLM, ModelConfig, build, hf_weight_map, load_model
from fastllm.models.decoder import DEFAULT_ROPE_POSITIONS

transformers.logging.set_verbosity_error()

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny untied HF Llama saved as one safetensors file."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=False))
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return folder


@pytest.fixture
def edit_checkpoint(hf_folder, tmp_path):
    """``edit(fn)``: a copy of the tiny model whose tensors dict went through ``fn``."""
    def edit(fn) -> Path:
        folder = tmp_path / "model"
        shutil.copytree(hf_folder, folder)
        tensors = load_file(folder / "model.safetensors")
        fn(tensors)
        save_file(tensors, folder / "model.safetensors")
        return folder
    return edit


def test_sharded_checkpoint_loads_like_a_single_file(hf_folder, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(hf_folder)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded, single = load_model(tmp_path).state_dict(), load_model(hf_folder).state_dict()
    assert sharded.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=0, atol=0)


def test_dtype_and_fusion(hf_folder):
    model = load_model(hf_folder, dtype=torch.bfloat16)
    tensors = load_file(hf_folder / "model.safetensors")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.cos_sin_cache.dtype == torch.float32  # rotation runs in float32
    qkv = model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, expected.bfloat16())
    assert model.kv_cache_spec().dtype == torch.bfloat16


@pytest.mark.parametrize("stored, dtype", [(torch.float16, torch.bfloat16),
                                           (torch.bfloat16, torch.float16)], ids=str)
def test_a_16_bit_checkpoint_under_the_other_16_bit_dtype(edit_checkpoint, monkeypatch, stored,
                                                          dtype):
    # The cast between the two goes through float32 a chunk at a time: chunks of 100 values
    # here, so that every weight spans several and ends inside one. The values must be the
    # direct cast's.
    monkeypatch.setattr(build, "_CAST_CHUNK", 100)
    folder = edit_checkpoint(lambda t: t.update({k: v.to(stored) for k, v in t.items()}))
    model = load_model(folder, dtype=dtype)
    tensors = load_file(folder / "model.safetensors")
    assert all(p.dtype == dtype for p in model.parameters())
    qkv = model.layers[0].self_attn.qkv_proj.weight
    expected = torch.cat([tensors[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, expected.to(dtype))
    assert torch.equal(model.layers[1].mlp.down_proj.weight,
                       tensors["model.layers.1.mlp.down_proj.weight"].to(dtype))
    assert torch.equal(model.norm.weight, tensors["model.norm.weight"].to(dtype))


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(architectures=["Qwen2ForCausalLM"]),
    dict(architectures=["Qwen3ForCausalLM"], head_dim=16, attention_bias=True,
         tie_word_embeddings=True),
    dict(architectures=["SmolLM3ForCausalLM"], attention_bias=True, mlp_bias=True),
])
def test_weight_map_covers_the_model_exactly(overrides):
    """Every parameter is built from HF tensors whose shapes add up to it, and nothing else."""
    config = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **TINY,
                                         **overrides})
    with torch.device("meta"):
        params = dict(DecoderLM(config).named_parameters())
    weight_map = hf_weight_map(config)
    assert weight_map.keys() == params.keys()
    for name, parts in weight_map.items():
        rows = sum(shape[0] for _, shape in parts)
        assert (rows, *parts[0][1][1:]) == tuple(params[name].shape), name


def test_tied_checkpoint_ignores_lm_head_and_old_inv_freq(edit_checkpoint):
    """With tie_word_embeddings, a stray lm_head.weight is skipped (HF ties it too), and so are
    the rotary_emb.inv_freq buffers older checkpoints carry."""
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    folder = edit_checkpoint(add)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = load_model(folder)
    assert model.lm_head is None
    hidden = torch.randn(2, TINY["hidden_size"])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed_tokens.weight.T)


def test_missing_tensor(edit_checkpoint):
    folder = edit_checkpoint(lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)


def test_missing_lm_head_when_untied(edit_checkpoint):
    folder = edit_checkpoint(lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lacks lm_head.weight"):
        load_model(folder)


def test_unexpected_tensor(edit_checkpoint):
    def add(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm"):
        load_model(edit_checkpoint(add))


def test_wrong_shape(edit_checkpoint):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    expected = r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has " \
        r"shape \(8, 32\), expected \(16, 32\)"
    with pytest.raises(ValueError, match=expected):
        load_model(edit_checkpoint(shrink))


def test_pickle_checkpoints_are_refused(hf_folder, tmp_path):
    shutil.copy(hf_folder / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match="pickle checkpoint.*safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="pickle checkpoint.*safetensors"):
        load_model(tmp_path / "pytorch_model.bin")


def test_missing_folder_or_config_or_weights(hf_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    shutil.copy(hf_folder / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_index_naming_a_missing_shard(hf_folder, tmp_path):
    shutil.copy(hf_folder / "config.json", tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("overrides, match", [
    (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (dict(architectures=None, model_type="gpt2"), "names no architecture"),
    (dict(hidden_act="gelu"),
     r"hidden_act must be one of \['gelu_pytorch_tanh', 'silu'\], got 'gelu'"),
    (dict(num_key_value_heads=3), "not a multiple of n_kv_heads=3"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(vocab_size=0), r"vocab_size must be an int in \[1, 16777216\], got 0"),
    # bounded, so a typo cannot make the loader allocate the machine (once a MemoryError)
    (dict(num_hidden_layers=10**9), r"num_hidden_layers must be an int in \[1, 1024\]"),
    (dict(max_position_embeddings=2**31), r"max_position_embeddings must be an int in \[1, "),
    (dict(rope_theta=float("inf")), "rope_theta must be a positive number, got inf"),
    (dict(rms_norm_eps=10**400), "rms_norm_eps must be a positive number"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=0),
     r"sliding_window must be an int in \[1, "),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a positive number"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "unsupported RoPE scaling type 'yarn'"),
    (dict(rope_parameters=dict(rope_type="linear", factor=0)), "factor must be a positive"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0,
                               high_freq_factor=1.0)), "low_freq_factor < high_freq_factor"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be a number in \(0, 1\]"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
          layer_types=["sliding_attention", "full_attention"]), "sliding_window is not set"),
    (dict(architectures=["Qwen2ForCausalLM"], layer_types=["full_attention"]),
     "layer_types must be 2"),
    (dict(architectures=["SmolLM3ForCausalLM"], no_rope_layers=[1, 2]), "no_rope_layers must be"),
    (dict(eos_token_id=[2, -1]), "non-negative ints"),
])
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **TINY, **overrides})


@pytest.mark.parametrize("overrides, match", [
    # JSON's "false" is a string, and truthy: it once read as true
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(attention_bias=1), "attention_bias must be true or false, got 1"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window="no"),
     "use_sliding_window must be true or false"),
    (dict(rope_scaling="linear"), "rope_scaling must be a JSON object .* got 'linear'"),
    (dict(rope_parameters=[2.0]), "rope_parameters must be a JSON object"),
    (dict(rope_scaling=dict(rope_type=["linear"], factor=2.0)), "rope_type must be a string"),
    (dict(rope_scaling=dict(rope_type="linear", factor="2")),
     "RoPE scaling factor must be a positive number, got '2'"),
    (dict(architectures="LlamaForCausalLM"),
     "architectures must be a list of class names, got 'LlamaForCausalLM'"),
    (dict(num_hidden_layers=1e9),
     r"num_hidden_layers must be an int in \[1, 1024\], got 1000000000\.0"),
    (dict(hidden_size="32"), "hidden_size must be an int .* got '32'"),
    (dict(num_key_value_heads=True), "num_key_value_heads must be an int .* got True"),
    (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a positive number, got '1e-5'"),
    (dict(layer_types="full_attention"), "layer_types must be a list"),
    (dict(architectures=["Qwen2ForCausalLM"], max_window_layers="28"),
     "max_window_layers must be an int"),
    (dict(architectures=["SmolLM3ForCausalLM"], no_rope_layer_interval=0.0),
     "no_rope_layer_interval must be an int"),
])
def test_config_value_of_the_wrong_type(overrides, match):
    with pytest.raises(TypeError, match=match):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **TINY, **overrides})


def test_config_json_that_is_not_an_object(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    (folder / "config.json").write_text(json.dumps([TINY]))
    with pytest.raises(TypeError, match=r"config\.json: a model config must be a JSON object "
                                        r"\(a dict\), got list"):
        load_model(folder)
    (folder / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model(folder)


def test_config_errors_name_the_file(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": "false"}))
    with pytest.raises(TypeError, match=r"model/config\.json: tie_word_embeddings must be true"):
        load_model(folder)


def test_long_context_builds_only_the_rope_table_used(hf_folder, tmp_path):
    """max_position_embeddings 10**9 once allocated tens of GB for the RoPE table: it is built
    to DEFAULT_ROPE_POSITIONS at load and grown only to what an engine reserves."""
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**9}))
    model = load_model(folder)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert model.cos_sin_cache.shape == (DEFAULT_ROPE_POSITIONS, head_dim)
    model.reserve_positions(DEFAULT_ROPE_POSITIONS + 3)
    assert model.cos_sin_cache.shape == (DEFAULT_ROPE_POSITIONS + 3, head_dim)
    short = load_model(hf_folder)  # a context under the default: the whole context
    assert short.cos_sin_cache.shape == (TINY["max_position_embeddings"], head_dim)
    with pytest.raises(ValueError, match=r"max_positions must be in \[1, 32\]"):
        short.reserve_positions(33)


def test_rope_parameters_giving_infinite_angles(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    scaling = dict(rope_type="linear", factor=1e-308, rope_theta=10000.0)
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": scaling}))
    with pytest.raises(ValueError, match="give non-finite RoPE angles within 32 positions"):
        load_model(folder)


def rewrite_header(file: Path, edit) -> None:
    """Rewrites the JSON header of the safetensors ``file`` through ``edit(header)``; the data
    bytes stay as they were."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    file.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length:])


def test_relabelled_dtype(hf_folder, tmp_path):
    """F32 weights relabelled I32 (the same bytes) once loaded silently as garbage."""
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_header(folder / "model.safetensors", lambda h: h[name].update(dtype="I32"))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor {re.escape(name)} is "
                                         r"stored as I32; a weight must be floats"):
        load_model(folder)


def test_corrupt_safetensors_header(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    name = "model.norm.weight"
    rewrite_header(folder / "model.safetensors",
                   lambda h: h[name].update(data_offsets=[0, 10**9]))
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        load_model(folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        load_model(folder)


def test_index_naming_a_path_outside_the_folder(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "model")
    index = {"weight_map": {"model.norm.weight": "../model.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"maps model\.norm\.weight to '\.\./model\.safetensors', "
                                         "not a file name"):
        load_model(folder)
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"index\.json is not valid JSON"):
        load_model(folder)


def test_bad_architecture_in_a_folder(hf_folder, tmp_path):
    shutil.copytree(hf_folder, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'BertForMaskedLM'"):
        load_model(tmp_path / "model")


def test_config_defaults_follow_each_hf_config_class():
    """Keys a config.json leaves out take the HF class's default for that architecture."""
    minimal = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4)
    qwen3 = ModelConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"], **minimal})
    assert (qwen3.head_dim, qwen3.n_kv_heads, qwen3.family.qk_norm) == (128, 4, "head")
    mistral = ModelConfig.from_hf_config({"architectures": ["MistralForCausalLM"], **minimal})
    assert mistral.sliding_window == 4096 and all(mistral.sliding_layers)
    no_window = ModelConfig.from_hf_config({"architectures": ["MistralForCausalLM"], **minimal,
                                            "sliding_window": None})
    assert not any(no_window.sliding_layers)
    smollm3 = ModelConfig.from_hf_config({"architectures": ["SmolLM3ForCausalLM"], **minimal})
    assert smollm3.tie_word_embeddings and smollm3.rope_theta == 2e6
    qwen2 = ModelConfig.from_hf_config({"model_type": "qwen2", **minimal, "sliding_window": 16})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.sliding_window) == (True, False, None)
    llama = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **minimal,
                                        "eos_token_id": [2, 7]})
    assert (llama.bos_token_id, llama.eos_token_ids, llama.head_dim) == (1, (2, 7), 16)
