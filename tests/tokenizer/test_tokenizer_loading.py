"""Which backend ``Tokenizer.from_pretrained`` picks, what it reads from the configs next to the
tokenizer, and the errors for what it cannot load."""

import json
import os

import gguf
import pytest
import transformers
from tokenizer_util import GGUF, LLAMA2, QWEN3, STORIES, hf_tokenizer, load, model_file

from fastllm.tokenizer import Tokenizer


def _folder(tmp_path, files: dict, **configs):
    """A model folder of links to real files (name -> models-folder entry) and JSON configs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, relative in files.items():
        os.symlink(model_file(relative), tmp_path / name)
    for name, content in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


def test_backend_follows_what_the_folder_holds(tmp_path):
    assert load(QWEN3).backend == "tokenizers"
    assert load(STORIES).backend == "sentencepiece"
    assert load(GGUF).backend == "gguf"
    both = _folder(tmp_path / "both", {"tokenizer.json": f"{QWEN3}/tokenizer.json",
                                       "tokenizer.model": f"{LLAMA2}/tokenizer.model"})
    assert Tokenizer.from_pretrained(both).backend == "tokenizers"  # tokenizer.json first
    gguf_dir = _folder(tmp_path / "gguf", {"model.gguf": GGUF})
    assert Tokenizer.from_pretrained(gguf_dir).backend == "gguf"
    direct = Tokenizer.from_pretrained(model_file(f"{LLAMA2}/tokenizer.model"))
    assert direct.backend == "sentencepiece" and direct.encode("Hi") == [1, 6324]
    # A file path still reads the configs next to it.
    stories = Tokenizer.from_pretrained(model_file(f"{STORIES}/tokenizer.model"))
    assert stories.eos_token_ids == [2] and stories.special_tokens_map == load(
        STORIES).special_tokens_map


def test_missing_and_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at .*nope: not a file or folder"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json, tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "config.json")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="cannot tell which tokenizer"):
        Tokenizer.from_pretrained(tmp_path / "vocab.txt")
    two = _folder(tmp_path / "two", {"a.gguf": GGUF, "b.gguf": GGUF})
    with pytest.raises(ValueError, match="several .gguf"):
        Tokenizer.from_pretrained(two)
    (tmp_path / "broken.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="not a valid sentencepiece model"):
        Tokenizer.from_pretrained(tmp_path / "broken.model")


def test_a_tokenizer_json_is_parsed_once_for_its_bytes_and_added_tokens(tmp_path):
    """Copies of one tokenizer.json share its parsed vocabulary; other bytes, or a config that
    adds other tokens, parse anew; each Tokenizer keeps its own attributes."""
    text = model_file(f"{QWEN3}/tokenizer.json").read_text(encoding="utf-8")
    config = json.loads(model_file(f"{QWEN3}/tokenizer_config.json").read_text(encoding="utf-8"))
    folders = []
    for name, tokenizer_json, extra in (("a", text, None), ("b", text, None),
                                        ("c", text.replace('"<|im_end|>"', '"<|im_stop|>"'), None),
                                        ("d", text, ["<|my_token|>"])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {**config, "additional_special_tokens": extra} if extra else config))
        folders.append(folder)
    a, b, other_bytes, more_tokens = (Tokenizer.from_pretrained(f) for f in folders)
    assert a._backend.tk is b._backend.tk
    assert other_bytes._backend.tk is not a._backend.tk
    assert other_bytes.convert_tokens_to_ids("<|im_stop|>") is not None
    assert more_tokens._backend.tk is not a._backend.tk
    assert more_tokens.convert_tokens_to_ids("<|my_token|>") == len(a)
    assert a.convert_tokens_to_ids("<|my_token|>") is None
    a.chat_template = "{{ messages[0]['content'] }}"
    assert b.chat_template == load(QWEN3).chat_template != a.chat_template
    assert a.encode("Hello world") == b.encode("Hello world") == hf_tokenizer(QWEN3).encode(
        "Hello world")


def _write_gguf(path, **metadata):
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_gguf_errors(tmp_path):
    with pytest.raises(ValueError, match="no embedded tokenizer"):
        Tokenizer.from_pretrained(_write_gguf(tmp_path / "none.gguf"))
    bert = _write_gguf(tmp_path / "bert.gguf", **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="'bert' is not supported"):
        Tokenizer.from_pretrained(bert)


def test_encode_decode_argument_errors():
    tok = load(QWEN3)
    with pytest.raises(TypeError, match="text must be a str, got list"):
        tok.encode(["not", "a", "str"])
    for name in (QWEN3, LLAMA2, GGUF):  # unknown ids decode to nothing, as in HF
        tok = load(name)
        ids = tok.encode("ok", add_special_tokens=False)
        assert tok.decode(ids + [len(tok) + 5]) == "ok"
        detok = tok.detokenizer()
        assert detok.add_many(ids + [len(tok) + 5]) + detok.flush() == "ok"
        with pytest.raises(ValueError, match=r"-1 is outside"):  # never a token id (test_bad_input)
            tok.decode(ids + [-1])


def test_generation_config_eos_ids(tmp_path):
    """eos_token_ids: the tokenizer's EOS, then generation_config.json's, then config.json's."""
    folder = _folder(tmp_path, {"tokenizer.json": f"{QWEN3}/tokenizer.json"},
                     tokenizer_config=json.loads(
                         model_file(f"{QWEN3}/tokenizer_config.json").read_text()),
                     generation_config={"eos_token_id": [151645, 151643]},
                     config={"eos_token_id": 151643})
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_id == 151645 and tok.eos_token_ids == [151645, 151643]
    assert tok.chat_template == load(QWEN3).chat_template


def test_add_bos_and_eos_of_tokenizer_json_as_hf(tmp_path):
    """With a tokenizer.json, its post-processor decides BOS/EOS; transformers 5 ignores the
    config's add_bos_token / add_eos_token there, and so does fastllm."""
    config = json.loads(model_file(f"{QWEN3}/tokenizer_config.json").read_text())
    config.update(add_eos_token=True, bos_token="<|endoftext|>", add_bos_token=True)
    folder = _folder(tmp_path, {"tokenizer.json": f"{QWEN3}/tokenizer.json"},
                     tokenizer_config=config)
    ours = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert not ours.add_bos_token and not ours.add_eos_token
    assert ours.bos_token_id == hf.bos_token_id == 151643
    for text in ["Hello", ""]:
        assert ours.encode(text) == hf.encode(text)


def test_sentencepiece_config_legacy_false(tmp_path):
    """legacy=False: no "▁" in front of text after a special token (HF's LlamaTokenizer)."""
    folder = _folder(tmp_path, {"tokenizer.model": f"{LLAMA2}/tokenizer.model"},
                     tokenizer_config={"tokenizer_class": "LlamaTokenizer", "legacy": False,
                                       "add_bos_token": True, "add_eos_token": True,
                                       "bos_token": "<s>", "eos_token": "</s>",
                                       "unk_token": "<unk>"})
    ours = Tokenizer.from_pretrained(folder)
    legacy = load(LLAMA2)
    hf = hf_tokenizer(str(folder), "LlamaTokenizer")
    for text in ["Hi</s>there", "a<unk>b c", "x</s>\ny", "<s>Hello"]:
        assert ours.encode(text) == hf.encode(text), text
    # "there", where legacy has "▁there"
    assert ours.encode("Hi</s>there", add_special_tokens=False)[-1] == 12711
    assert legacy.encode("Hi</s>there", add_special_tokens=False)[-1] == 727
    assert ours.encode("Hi") == [1, 6324, 2]  # add_eos_token


def test_added_tokens_beyond_the_sentencepiece_vocab(tmp_path):
    """tokenizer_config.json's added tokens past the model's pieces get their ids, are matched
    whole in text, and are dropped by skip_special_tokens when special."""
    added = {"512": {"content": "<|user|>", "special": True},
             "513": {"content": "<tool>", "special": False, "lstrip": True}}
    folder = _folder(tmp_path, {"tokenizer.model": f"{STORIES}/tokenizer.model"},
                     tokenizer_config={"add_bos_token": False, "added_tokens_decoder": added,
                                       "bos_token": "<s>", "eos_token": "</s>"})
    tok = Tokenizer.from_pretrained(folder)
    assert len(tok) == 514 and tok.vocab_size == 512
    assert tok.convert_tokens_to_ids(["<|user|>", "<tool>"]) == [512, 513]
    ids = tok.encode("<|user|>hi  <tool>x")
    assert ids[0] == 512 and 513 in ids
    assert tok.decode(ids) == "hi<tool> x"
    # as HF: a piece after a literal special token keeps its "▁"
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|> hi<tool> x"
    assert 512 in tok.all_special_ids and 513 not in tok.all_special_ids
    detok = tok.detokenizer(skip_special_tokens=False)
    assert detok.add_many(ids) + detok.flush() == tok.decode(ids, skip_special_tokens=False)
