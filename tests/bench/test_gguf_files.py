"""The GGUF files the llama.cpp benchmark makes: random models have the drawn scales and the
tokenizer they were given, rewrites keep the metadata and store exactly the gguf package's
quantization of the source's values, fastllm loads them, and (where llama-cpp-python is
installed) llama.cpp loads them, tokenizes alike and quantizes one to Q4_K_M.

The models are Qwen3-shaped but small, with Qwen3's tokenizer cut short: the gguf package's
reader takes many seconds over a vocabulary of 151,936 tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from conftest import find_model
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

import fastllm
from fastllm.bench.gguf_files import (LLAMA_CPP_TYPES, WRITTEN_TYPES, llama_cpp_quantize,
                                      rewrite_gguf, summarize_gguf, write_random_gguf)
from fastllm.bench.workloads import MODEL_SHAPES
from fastllm.models.gguf import load_gguf

# Qwen3-0.6B's shape scaled down: heads of 32, hidden size 64, an MLP of 72 (rows of 72 values
# do not split into 32-value blocks) and 3328 token rows (the cut tokenizer's 3282, then unused
# [PAD] ones).
SMALL_QWEN3 = dataclasses.replace(MODEL_SHAPES["qwen3-0.6b"], hidden_size=64,
                                  intermediate_size=72, n_heads=2, n_kv_heads=1, head_dim=32,
                                  vocab_size=3328)
UNTIED = dataclasses.replace(SMALL_QWEN3, tie_word_embeddings=False)
TEXTS = ["Hello world, 123 and 4567!", "<|im_start|>user\nhi<|im_end|>\n<think>\n",
         " tabs\tand 日本語"]
F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's tokenizer cut to its first 3000 merges (ids 0 .. 3255, as Qwen numbers them) and
    its 26 added tokens after them."""
    folder = tmp_path_factory.mktemp("tokenizer")
    qwen3 = find_model("qwen3_tokenizer")
    data = json.loads((qwen3 / "tokenizer.json").read_text(encoding="utf-8"))
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if i < 3256}
    data["model"]["merges"] = data["model"]["merges"][:3000]
    for k, token in enumerate(data["added_tokens"]):
        token["id"] = 3256 + k
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    shutil.copy(qwen3 / "tokenizer_config.json", folder)
    return folder


@pytest.fixture(scope="module")
def random_f16(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Path) -> Path:
    """One layer, tied embeddings, F16."""
    path = tmp_path_factory.mktemp("gguf") / "small-qwen3.F16.gguf"
    write_random_gguf(path, SMALL_QWEN3, layers=1, type_name="F16",
                      tokenizer_dir=small_tokenizer)
    return path


@pytest.fixture(scope="module")
def random_q8_0(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Path) -> Path:
    """Two layers, an LM head of its own, Q8_0."""
    path = tmp_path_factory.mktemp("gguf") / "small-qwen3.Q8_0.gguf"
    write_random_gguf(path, UNTIED, layers=2, type_name="Q8_0", tokenizer_dir=small_tokenizer,
                      seed=3)
    return path


def torch_shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))


def test_random_model_has_its_scales_and_its_tokenizer(random_q8_0: Path,
                                                      small_tokenizer: Path) -> None:
    tensors = {t.name: t for t in GGUFReader(random_q8_0).tensors}
    assert len(tensors) == 1 + 2 * 11 + 2  # embedding, layers, final norm, LM head
    for name, std in (("token_embd.weight", 0.02), ("output.weight", 64 ** -0.5),
                      ("blk.1.attn_q.weight", 64 ** -0.5), ("blk.0.ffn_down.weight", 72 ** -0.5)):
        tensor = tensors[name]
        # ffn_down's rows of 72 values stay F16
        assert tensor.tensor_type == (F16 if "ffn_down" in name else
                                      GGMLQuantizationType.Q8_0), name
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        assert values.std() == pytest.approx(std, rel=0.05), name
        assert abs(values.mean()) < 0.05 * std, name
    assert np.all(np.asarray(tensors["blk.0.attn_k_norm.weight"].data) == 1.0)
    llm = fastllm.LLM(random_q8_0, max_model_len=32)
    config = llm.model.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.n_heads,
            config.n_kv_heads, config.head_dim, config.family.qk_norm, config.vocab_size,
            config.tie_word_embeddings) == (2, 64, 72, 2, 1, 32, "head", 3328, False)
    reference = tokenizers.Tokenizer.from_file(str(small_tokenizer / "tokenizer.json"))
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == reference.encode(text).ids, text
    assert llm.tokenizer.eos_token_ids == [reference.token_to_id("<|im_end|>")]
    assert llm.tokenizer.convert_ids_to_tokens(3300) == "[PAD3300]"
    [out] = llm.generate([[9, 10, 11]], fastllm.SamplingParams(temperature=0, max_tokens=3,
                                                                ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_rewrites_store_the_gguf_packages_quantization(tmp_path: Path, random_f16: Path) -> None:
    before = GGUFReader(random_f16)
    kept = [key for key in before.fields if not key.startswith("GGUF.")
            and key != "general.file_type"]
    for type_name, (wanted, file_type) in WRITTEN_TYPES.items():
        dest = tmp_path / f"small.{type_name}.gguf"
        rewrite_gguf(random_f16, dest, type_name)
        after = GGUFReader(dest)
        assert after.fields["general.file_type"].contents() == file_type
        assert [key for key in after.fields if not key.startswith("GGUF.")
                and key != "general.file_type"] == kept
        for key in kept:
            assert after.fields[key].types == before.fields[key].types, key
            assert after.fields[key].contents() == before.fields[key].contents(), key
        assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
        for old, new in zip(before.tensors, after.tensors):
            shape = torch_shape(old)
            assert torch_shape(new) == shape
            if len(shape) == 1:
                expected = F32
            else:  # rows of 64 values split into 32-value blocks, rows of 72 do not
                expected = wanted if shape[-1] % 32 == 0 else F16
            assert new.tensor_type == expected, new.name
            values = dequantize(old.data, old.tensor_type).astype(np.float32).reshape(shape)
            assert np.array_equal(np.asarray(new.data), quantize(values, expected)), new.name
        types = {t.name: t.tensor_type for t in after.tensors}
        assert (types["token_embd.weight"], types["blk.0.ffn_down.weight"]) == (wanted, F16)
    load_gguf(dest)  # fastllm reads the last, Q4_0 (its own tests cover each type)


def test_summarize_counts_the_lm_head_not_the_lookup(random_f16: Path,
                                                     random_q8_0: Path) -> None:
    for path, tied in ((random_f16, True), (random_q8_0, False)):
        summary = summarize_gguf(path)
        tensors = GGUFReader(path).tensors
        sizes = {t.name: int(t.n_bytes) for t in tensors}
        assert summary.tensor_bytes == sum(sizes.values())
        assert summary.bytes_per_token == summary.tensor_bytes - (
            0 if tied else sizes["token_embd.weight"])
        assert sum(summary.types.values()) == len(tensors)
    assert summarize_gguf(random_q8_0).types == {"F32": 9, "Q8_0": 14, "F16": 2}


def test_the_embedding_can_have_a_type_of_its_own(tmp_path: Path,
                                                 small_tokenizer: Path) -> None:
    path = tmp_path / "small-qwen3.Q4_0.gguf"
    write_random_gguf(path, SMALL_QWEN3, layers=1, type_name="Q4_0", embedding_type="F16",
                      tokenizer_dir=small_tokenizer)
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == F16 and "output.weight" not in types  # tied
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_0
    with pytest.raises(ValueError, match="embedding_type must be one of .*, got 'Q4_K'"):
        write_random_gguf(path, SMALL_QWEN3, layers=1, type_name="Q4_0", embedding_type="Q4_K",
                          tokenizer_dir=small_tokenizer)


def test_bad_requests_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="type_name must be one of"):
        rewrite_gguf(tmp_path / "in.gguf", tmp_path / "out.gguf", "Q4_K")
    with pytest.raises(ValueError, match="no GGUF writer for LlamaForCausalLM"):
        write_random_gguf(tmp_path / "out.gguf", MODEL_SHAPES["llama-3-8b"], layers=1,
                          type_name="Q8_0", tokenizer_dir=find_model("qwen3_tokenizer"))
    with pytest.raises(ValueError, match="type_name must be one of"):
        llama_cpp_quantize(tmp_path / "in.gguf", tmp_path / "out.gguf", "Q8_0", threads=1)


@pytest.mark.llama_cpp
def test_llama_cpp_loads_them_and_quantizes(tmp_path: Path, random_f16: Path,
                                            random_q8_0: Path, small_tokenizer: Path,
                                            llama_cpp) -> None:
    reference = tokenizers.Tokenizer.from_file(str(small_tokenizer / "tokenizer.json"))
    for path in (random_f16, random_q8_0):
        peer = llama_cpp.Llama(str(path), n_ctx=32, verbose=False)
        for text in TEXTS:
            assert peer.tokenize(text.encode(), add_bos=False, special=True) == reference.encode(
                text).ids, text
        peer.close()
    quantized = tmp_path / "small.Q4_K_M.gguf"
    llama_cpp_quantize(random_f16, quantized, "Q4_K_M", threads=1)
    reader = GGUFReader(quantized)
    assert reader.fields["general.file_type"].contents() == LLAMA_CPP_TYPES["Q4_K_M"]
    # No row of 64 or 72 values fits a 256-value K block: llama.cpp picks other types for
    # them, but quantizes every one it can.
    assert {t.tensor_type for t in reader.tensors if t.name != "blk.0.ffn_down.weight"
            and len(t.shape) == 2}.isdisjoint({F16, F32})
    llama_cpp.Llama(str(quantized), n_ctx=32, verbose=False).close()
    load_gguf(quantized)
    with pytest.raises(RuntimeError, match="llama.cpp could not quantize"):
        llama_cpp_quantize(tmp_path / "missing.gguf", tmp_path / "out.gguf", "Q4_K_M", threads=1)
