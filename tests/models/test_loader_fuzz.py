"""Property-based tests of the loaders: a GGUF file whose header bytes or metadata values are
mutated, a safetensors file whose JSON header is, and a config.json with mutated values each
either load or raise a ValueError or TypeError: never another exception, never a hang.

The files are tiny (a one-layer Llama with hidden size 8), so each example takes milliseconds;
the runs are derandomized, so the suite sees the same examples every time.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VT
from hypothesis import given, note, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fastllm.models import DecoderLM, ModelConfig, hf_weight_map, load_model
from fastllm.models.gguf import gguf_tensor_name

TINY = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

# The GGUF metadata of TINY as llama.cpp's converter writes it: key -> (GGUF type, value).
GGUF_METADATA: dict[str, tuple[VT, Any]] = {
    "llama.block_count": (VT.UINT32, 1), "llama.context_length": (VT.UINT32, 32),
    "llama.embedding_length": (VT.UINT32, 8), "llama.feed_forward_length": (VT.UINT32, 16),
    "llama.attention.head_count": (VT.UINT32, 2), "llama.attention.head_count_kv": (VT.UINT32, 1),
    "llama.attention.layer_norm_rms_epsilon": (VT.FLOAT32, 1e-5),
    "llama.rope.freq_base": (VT.FLOAT32, 10000.0), "llama.rope.dimension_count": (VT.UINT32, 4),
    "tokenizer.ggml.bos_token_id": (VT.UINT32, 1), "tokenizer.ggml.eos_token_id": (VT.UINT32, 2),
}
# Keys a mutation may also add: the optional ones config_from_gguf reads, and the reader's own.
EXTRA_GGUF_KEYS = ("general.architecture", "general.alignment", "llama.attention.key_length",
                   "llama.attention.value_length", "llama.rope.scaling.type",
                   "llama.rope.scaling.factor", "tokenizer.ggml.eot_token_id")
# config.json keys a mutation may also add: those ModelConfig.from_hf_config reads.
EXTRA_CONFIG_KEYS = ("architectures", "model_type", "head_dim", "rope_scaling",
                     "rope_parameters", "partial_rotary_factor", "attention_bias", "mlp_bias",
                     "hidden_act", "layer_types", "sliding_window", "use_sliding_window",
                     "max_window_layers", "no_rope_layers", "no_rope_layer_interval")

# Each example runs in milliseconds; the deadline only flags a pathological one, and the alarm
# in `loads_or_refuses` turns a hang into a failure.
FUZZ = settings(max_examples=60, deadline=timedelta(seconds=2), derandomize=True,
                database=None)
HANG_SECONDS = 10


@contextlib.contextmanager
def alarm_after(seconds: float) -> Iterator[None]:
    """Raises TimeoutError in the body once ``seconds`` have passed (a Python-level hang)."""
    def fail(signum, frame):
        raise TimeoutError(f"the load took over {seconds} s")
    previous = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def loads_or_refuses(path: Path) -> None:
    """Loads ``path``; a clean refusal (ValueError, TypeError) is fine, anything else fails."""
    try:
        with alarm_after(HANG_SECONDS):
            model = load_model(path)
    except (ValueError, TypeError) as error:
        note(f"refused: {error}")
        return
    assert isinstance(model, DecoderLM)
    # The RoPE table is never longer than the default the model was loaded with.
    assert model.cos_sin_cache.shape[0] <= 8192


def write_tiny_gguf(path: Path, metadata: dict[str, tuple[VT, Any]]) -> Path:
    """The tiny Llama as an F32 GGUF with ``metadata`` (key -> (GGUF type, value))."""
    config = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **TINY})
    writer = gguf.GGUFWriter(path, "llama")
    for key, (value_type, value) in metadata.items():  # general.architecture replaces "llama"
        writer.add_key_value(key, value, value_type,
                             VT.INT32 if value_type == VT.ARRAY else None)
    rng = np.random.default_rng(0)
    for parts in hf_weight_map(config).values():
        for hf_name, shape in parts:
            writer.add_tensor(gguf_tensor_name(config.family, hf_name),
                              rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, int, Path]:
    """(the file's bytes, where its data section starts, a path to write mutants to)."""
    folder = tmp_path_factory.mktemp("gguf_fuzz")
    path = write_tiny_gguf(folder / "tiny.gguf", GGUF_METADATA)
    assert isinstance(load_model(path), DecoderLM)
    return path.read_bytes(), gguf.GGUFReader(path).data_offset, folder / "mutant.gguf"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """The tiny Llama as a HF folder: config.json and model.safetensors."""
    folder = tmp_path_factory.mktemp("hf_fuzz") / "model"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY}
    (folder / "config.json").write_text(json.dumps(config))
    parsed = ModelConfig.from_hf_config(config)
    generator = torch.Generator().manual_seed(0)
    save_file({hf_name: torch.randn(shape, generator=generator)
               for parts in hf_weight_map(parsed).values() for hf_name, shape in parts},
              folder / "model.safetensors")
    assert isinstance(load_model(folder), DecoderLM)
    return folder


def mutant_folder(tiny_hf: Path) -> Path:
    """A fresh copy of the tiny HF folder to mutate."""
    folder = tiny_hf.parent / "mutant"
    shutil.rmtree(folder, ignore_errors=True)
    return Path(shutil.copytree(tiny_hf, folder))


# ---- strategies ------------------------------------------------------------------------------

# Integers where parsers break: zero, sign and width boundaries.
EDGE_INTS = st.sampled_from([0, 1, 2, 3, 7, 31, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                             2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1])
# A patch of a few bytes: one byte, or an edge integer as 4 or 8 little-endian bytes.
PATCH = st.one_of(
    st.binary(min_size=1, max_size=1),
    st.tuples(EDGE_INTS, st.sampled_from([4, 8])).map(
        lambda nw: (nw[0] % 2 ** (8 * nw[1])).to_bytes(nw[1], "little")))

GGUF_VALUES = st.one_of(
    st.tuples(st.just(VT.UINT32), st.one_of(EDGE_INTS.filter(lambda n: n < 2**32),
                                            st.integers(0, 2**32 - 1))),
    st.tuples(st.just(VT.INT32), st.integers(-2**31, 2**31 - 1)),
    st.tuples(st.just(VT.UINT64), st.one_of(EDGE_INTS, st.integers(0, 2**64 - 1))),
    st.tuples(st.just(VT.INT64), st.integers(-2**63, 2**63 - 1)),
    st.tuples(st.just(VT.FLOAT32), st.floats(width=32)),
    st.tuples(st.just(VT.FLOAT64), st.floats()),
    st.tuples(st.just(VT.BOOL), st.booleans()),
    st.tuples(st.just(VT.STRING), st.one_of(st.text(max_size=12),
                                            st.sampled_from(["llama", "qwen2", "linear",
                                                             "none", "yarn"]))),
    st.tuples(st.just(VT.ARRAY), st.lists(st.integers(-2**31, 2**31 - 1), min_size=1,
                                          max_size=3)))


def json_values(floats: st.SearchStrategy[float]) -> st.SearchStrategy[Any]:
    """Any JSON value: edge integers, the strings the loaders look for, nested lists and
    objects with the keys they read."""
    scalars = st.one_of(
        st.none(), st.booleans(), EDGE_INTS, st.integers(-2**70, 2**70), floats,
        st.text(max_size=8),
        st.sampled_from(["false", "true", "linear", "llama3", "F32", "I32", "BF16", "F8_E4M3",
                         "LlamaForCausalLM", "Qwen3ForCausalLM", "full_attention"]))
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(
            st.sampled_from(["rope_type", "type", "factor", "rope_theta", "dtype", "shape",
                             "data_offsets", "low_freq_factor", "high_freq_factor"])
            | st.text(max_size=6), children, max_size=4),
        max_leaves=8)


# config.json is read by Python's json, which takes NaN and Infinity; safetensors' reader
# refuses them, so its header gets finite floats (or every header would be invalid JSON).
JSON_VALUES = json_values(st.floats())
FINITE_JSON_VALUES = json_values(st.floats(allow_nan=False, allow_infinity=False))
# Header fields that often stay self-consistent, so the loader's own checks are reached:
# same-size dtypes (a relabelling), small shapes and offsets.
SAFETENSORS_FIELDS = {
    "dtype": st.sampled_from(["F32", "I32", "U32", "F16", "BF16", "I16", "F64", "I64", "U8",
                              "BOOL", "F8_E4M3"]),
    "shape": st.lists(st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64, 128]), max_size=3),
    "data_offsets": st.lists(st.integers(0, 4096), min_size=2, max_size=2),
}


# ---- GGUF ------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_gguf_with_mutated_header_bytes(tiny_gguf, data):
    """Bytes of the header (metadata and tensor infos) overwritten, and maybe the file cut."""
    base, data_offset, path = tiny_gguf
    mutant = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4), label="patches")):
        patch = data.draw(PATCH, label="bytes")
        # past the magic and the version, which the reader checks first
        at = data.draw(st.integers(8, data_offset - len(patch)), label="at")
        mutant[at:at + len(patch)] = patch
    if data.draw(st.booleans(), label="truncate"):
        del mutant[data.draw(st.integers(0, len(mutant) - 1), label="length"):]
    path.write_bytes(bytes(mutant))
    loads_or_refuses(path)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from([*GGUF_METADATA, *EXTRA_GGUF_KEYS]),
                               GGUF_VALUES, min_size=1, max_size=3),
       dropped=st.sets(st.sampled_from(list(GGUF_METADATA)), max_size=2))
def test_gguf_with_mutated_metadata_values(tiny_gguf, changes, dropped):
    """Metadata values of any GGUF type (wrong types, edge values), and keys left out."""
    path = tiny_gguf[2]
    metadata = {key: value for key, value in GGUF_METADATA.items() if key not in dropped}
    write_tiny_gguf(path, {**metadata, **changes})
    loads_or_refuses(path)


# ---- safetensors -----------------------------------------------------------------------------


def rewrite_safetensors_header(file: Path, edit: Callable[[Any], Any]) -> None:
    """Replaces the JSON header of ``file`` with ``edit(header)``; the data bytes stay."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8:8 + length]))
    encoded = json.dumps(header).encode()
    file.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length:])


@FUZZ
@given(data=st.data())
def test_safetensors_with_mutated_header(tiny_hf, data):
    """A tensor entry's dtype, shape or offsets replaced, entries dropped or added, the
    ``__metadata__`` or the whole header replaced."""
    folder = mutant_folder(tiny_hf)

    def edit(header: dict) -> Any:
        if data.draw(st.integers(0, 9), label="replace all") == 0:
            return data.draw(FINITE_JSON_VALUES, label="header")
        names = sorted(name for name in header if name != "__metadata__")
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            kind = data.draw(st.sampled_from(["field"] * 4 + ["drop", "add", "metadata"]))
            name = data.draw(st.sampled_from(names), label="tensor")
            if kind == "field" and name in header:
                field = data.draw(st.sampled_from(sorted(SAFETENSORS_FIELDS)))
                header[name][field] = data.draw(
                    SAFETENSORS_FIELDS[field] | FINITE_JSON_VALUES, label=field)
            elif kind == "drop":
                header.pop(name, None)
            elif kind == "add":
                header[data.draw(st.text(max_size=6), label="new")] = data.draw(
                    FINITE_JSON_VALUES)
            elif kind == "metadata":
                header["__metadata__"] = data.draw(FINITE_JSON_VALUES, label="__metadata__")
        return header

    rewrite_safetensors_header(folder / "model.safetensors", edit)
    loads_or_refuses(folder)


# ---- config.json -----------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_config_with_mutated_values(tiny_hf, data):
    """Values of config.json replaced by any JSON (wrong types, edge values), keys dropped, or
    the whole file something other than an object."""
    folder = mutant_folder(tiny_hf)
    config = json.loads((folder / "config.json").read_text())
    if data.draw(st.integers(0, 9), label="replace all") == 0:
        config = data.draw(JSON_VALUES, label="config")
    else:
        keys = st.sampled_from([*config, *EXTRA_CONFIG_KEYS])
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            key = data.draw(keys, label="key")
            if data.draw(st.integers(0, 4), label="drop") == 0:
                config.pop(key, None)
            else:
                config[key] = data.draw(JSON_VALUES, label=key)
    (folder / "config.json").write_text(json.dumps(config))
    loads_or_refuses(folder)
