"""Models named as on the Hugging Face Hub, through huggingface_hub's real client: downloaded from a
local endpoint (:class:`hub_server.LocalHub`, ``HF_ENDPOINT``) into a temporary cache, and loaded
offline (``HF_HUB_OFFLINE``) from a cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from hub_server import LocalHub, lay_out_cache
from huggingface_hub import constants

import fastllm
from fastllm import LLM, Reranker, SamplingParams
from fastllm.bench.gguf_files import _copy_metadata
from fastllm.hub import HubModel, ModelNotFoundError, parse_model_name, resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, huggingface_hub's constants pointed at it (as ``HF_HUB_CACHE`` sets
    them when the process starts), online."""
    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


@pytest.fixture
def hub(hub_cache, monkeypatch):
    """A :class:`LocalHub`, huggingface_hub's endpoint pointed at it (as ``HF_ENDPOINT`` does)."""
    with LocalHub() as local:
        monkeypatch.setattr(constants, "ENDPOINT", local.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            local.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield local


def go_offline(monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def folder_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


def sharded(folder: Path, out: Path) -> dict[str, Path]:
    """``folder``'s checkpoint split in two safetensors shards with an index, beside a pickle
    and an ONNX copy that loading must never download."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    out.mkdir()
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, out / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    files = {name: path for name, path in folder_files(folder).items()
             if name != "model.safetensors"}
    files.update(folder_files(out))
    return {**files, "pytorch_model.bin": b"not to be downloaded",
            "onnx/model.onnx": b"not to be downloaded"}


def split_gguf(source: Path, out: Path, max_tensors: int) -> list[Path]:
    """``source`` rewritten by gguf's writer as a split model of ``max_tensors`` per part."""
    reader = GGUFReader(source)
    writer = GGUFWriter(out / "model.gguf", str(reader.fields["general.architecture"].contents()),
                        split_max_tensors=max_tensors)
    _copy_metadata(reader, writer)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape(shape)
                          if tensor.tensor_type <= 1 else np.array(tensor.data),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.glob("model-*-of-*.gguf"))


@pytest.mark.parametrize("name, parsed", [
    ("Qwen/Qwen3-0.6B", HubModel("Qwen/Qwen3-0.6B")),
    ("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
     HubModel("bartowski/SmolLM2-135M-Instruct-GGUF", quant="Q4_K_M")),
    ("org/repo/sub/model-Q8_0.gguf", HubModel("org/repo", filename="sub/model-Q8_0.gguf")),
    ("./model", None), ("/models/qwen", None), ("model.gguf", None), ("a/b/c", None),
    ("org/repo:Q4 K", None), ("../repo", None), ("org/../x.gguf", None), ("org/repo/", None),
])
def test_names_parse_as_the_hub_spells_them(name, parsed):
    assert parse_model_name(name) == parsed


def test_a_safetensors_repo_downloads_only_what_loading_reads(hub, hub_cache, model_path,
                                                                tmp_path, monkeypatch):
    folder = model_path("stories260K_hf")
    commit = hub.add("karpathy/stories260K", sharded(folder, tmp_path / "sharded"))
    llm = LLM("karpathy/stories260K")
    reference = LLM(folder)
    prompt = "Once upon a time"
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        reference.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    downloaded = {path.rsplit("/", 1)[-1] for path in hub.requested("") if "/resolve/" in path}
    assert downloaded == {"config.json", "generation_config.json", "tokenizer.model",
                          "tokenizer_config.json", "model.safetensors.index.json",
                          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    snapshot = hub_cache / "models--karpathy--stories260K" / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(downloaded)
    assert fastllm.load("karpathy/stories260K") is llm.model

    # Cached: it loads offline with no request at all.
    count = len(hub.requests)
    go_offline(monkeypatch)
    assert fastllm.load("karpathy/stories260K") is llm.model
    assert LLM("karpathy/stories260K").generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0] \
        .token_ids == reference.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(hub.requests) == count


def test_revision_picks_the_branch_or_commit(hub, model_path, tmp_path):
    folder = model_path("stories260K_hf")
    main = hub.add("org/tiny", folder_files(folder))
    config = json.loads((folder / "config.json").read_text())
    # Another revision: the same weights under a longer context.
    longer = 2 * config["max_position_embeddings"]
    other = {**folder_files(folder), "config.json": json.dumps(
        {**config, "max_position_embeddings": longer}).encode()}
    commit = hub.add("org/tiny", other, revision="long-context")
    assert LLM("org/tiny").max_model_len == config["max_position_embeddings"]
    assert LLM("org/tiny", revision="long-context").max_model_len == longer
    assert LLM("org/tiny", revision=commit).max_model_len == longer
    assert fastllm.load("org/tiny", revision=main).config.max_position_embeddings == \
        config["max_position_embeddings"]
    with pytest.raises(ModelNotFoundError, match="org/tiny has no revision v9"):
        LLM("org/tiny", revision="v9")
    # The draft model of speculative decoding, by name and revision.
    llm = LLM(folder, speculative={"method": "draft", "model": "org/tiny",
                                   "revision": "long-context"})
    assert llm.engine.executor.worker.proposer.model.config.max_position_embeddings == longer


def test_the_tokenizer_by_name(hub, model_path):
    folder = model_path("stories260K_hf")
    hub.add("org/tiny", folder_files(folder))
    tokenizer_files = {n: p for n, p in folder_files(folder).items() if n.startswith("tokenizer")}
    hub.add("org/tokenizer-only", tokenizer_files)
    llm = LLM(folder, tokenizer="org/tokenizer-only")
    assert llm.tokenizer.encode("Once upon a time") == LLM(folder).tokenizer.encode(
        "Once upon a time")
    assert fastllm.Tokenizer.from_pretrained("org/tokenizer-only").encode("Once") == \
        llm.tokenizer.encode("Once")
    assert not hub.requested(".safetensors")


def test_a_gguf_repo_by_quant_or_file(hub, model_path, tmp_path):
    tiny = model_path("gguf/llama-2-tiny-random.gguf")
    files = {"llama-2-tiny-random-F16.gguf": tiny, "llama-2-tiny-random.Q8_0.gguf": tiny,
             "README.md": b"# tiny"}
    hub.add("org/tiny-GGUF", files)
    reference = LLM(tiny).generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for name in ("org/tiny-GGUF:f16", "org/tiny-GGUF:Q8_0",
                 "org/tiny-GGUF/llama-2-tiny-random.Q8_0.gguf"):
        llm = LLM(name)
        assert llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            reference
    assert not hub.requested("README.md")
    with pytest.raises(ModelNotFoundError, match="no GGUF file for Q4_0.*F16.gguf"):
        LLM("org/tiny-GGUF:Q4_0")
    # Named without a quant: llama.cpp's default Q4_K_M, absent here, so the choices are listed.
    with pytest.raises(ModelNotFoundError, match=r"name one as org/tiny-GGUF:QUANT"):
        LLM("org/tiny-GGUF")
    hub.add("org/two-GGUF", {"a-Q8_0.gguf": tiny, "b-Q8_0.gguf": tiny})
    with pytest.raises(ValueError, match="matches several GGUF files: a-Q8_0.gguf, b-Q8_0.gguf"):
        LLM("org/two-GGUF:q8_0")


def test_a_split_gguf_is_joined(hub, model_path, tmp_path):
    tiny = model_path("gguf/llama-2-tiny-random.gguf")
    (tmp_path / "split").mkdir()
    parts = split_gguf(tiny, tmp_path / "split", max_tensors=4)
    assert len(parts) >= 3
    reference = LLM(tiny).generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # Locally, by its first part; a later part is refused, naming the first.
    assert LLM(parts[0]).generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0] \
        .token_ids == reference
    with pytest.raises(ValueError, match=f"load its first part, {parts[0].name}"):
        LLM(parts[1])
    # From the hub, every part downloaded.
    hub.add("org/split-GGUF", {f"Q8_0/tiny-Q8_0-{p.name.split('-', 1)[1]}": p for p in parts})
    llm = LLM("org/split-GGUF:Q8_0")
    assert llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference
    assert len(hub.requested(".gguf")) >= 2 * len(parts)
    shutil.rmtree(tmp_path / "split")


def test_a_missing_repo_or_file_is_one_clear_error(hub, monkeypatch, tmp_path):
    with pytest.raises(ModelNotFoundError,
                       match=r"no model at org/missing: not a local path, and http://127\.0\.0\.1"
                             r":\d+ has no repo org/missing"):
        LLM("org/missing")
    with pytest.raises(ModelNotFoundError, match="no model at ./missing-folder: not a file"):
        LLM("./missing-folder")
    with pytest.raises(ModelNotFoundError, match="org/missing"):
        Reranker("org/missing")
    go_offline(monkeypatch)
    with pytest.raises(ModelNotFoundError, match="org/missing.*is not in the Hugging Face cache.*"
                                                  "HF_HUB_OFFLINE is set"):
        LLM("org/missing")
    with pytest.raises(ValueError, match="revision='main' applies to a model on the hub"):
        LLM(tmp_path, revision="main")


def test_a_cache_laid_out_by_hand_loads_offline(hub_cache, model_path, monkeypatch):
    folder = model_path("stories260K_hf")
    snapshot = lay_out_cache(hub_cache, "karpathy/stories260K", folder_files(folder))
    go_offline(monkeypatch)
    assert resolve_model("karpathy/stories260K") == snapshot
    llm = LLM("karpathy/stories260K", tokenizer_revision="main")
    reference = LLM(folder)
    assert llm.generate("Once", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        reference.generate("Once", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiny = model_path("gguf/llama-2-tiny-random.gguf")
    lay_out_cache(hub_cache, "org/tiny-GGUF", {"tiny-Q8_0.gguf": tiny})
    assert resolve_model("org/tiny-GGUF:Q8_0").name == "tiny-Q8_0.gguf"


def test_the_environment_is_huggingface_hubs(model_path, tmp_path):
    """HF_ENDPOINT, HF_HUB_CACHE and HF_TOKEN as a user sets them, in a fresh process."""
    folder = model_path("stories260K_hf")
    with LocalHub() as hub:
        hub.add("karpathy/stories260K", folder_files(folder))
        script = ("import fastllm; llm = fastllm.LLM('karpathy/stories260K'); "
                  "print(llm.generate('Once', fastllm.SamplingParams(temperature=0, "
                  "max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids)")
        env = {"PATH": "/usr/bin:/bin", "HF_ENDPOINT": hub.url,
               "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_TOKEN": "hf_secret"}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "Fetching" in done.stderr or "Download" in done.stderr  # hub's progress bars
        assert {auth for _, path, auth in hub.requests if "karpathy/stories260K" in path} == \
            {"Bearer hf_secret"}
    assert (tmp_path / "cache" / "models--karpathy--stories260K").is_dir()
    # Offline, from that cache, the endpoint gone.
    env["HF_HUB_OFFLINE"] = "1"
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout == done.stdout
    reference = LLM(folder).generate("Once", SamplingParams(temperature=0, max_tokens=4),
                                     use_tqdm=False)[0].outputs[0].token_ids
    assert done.stdout.strip() == str(reference)
