"""Tiny random HF base models with the stories260K tokenizer (512 tokens), and random peft LoRA
adapters of them, for the engine and server tests: fastllm's tokens with an adapter are checked
against peft's greedy ones on the same weights."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import transformers
from tiny_hf import random_hf_model, save_hf_model

# A small base of each family: q rows (heads x head_dim) apart from the hidden size in Qwen3,
# q|k|v and gate|up fused in Phi-3's checkpoint.
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
FAMILIES = {"llama": ("llama", {}), "qwen3": ("qwen3", dict(head_dim=32)),
            "phi3": ("phi3", dict(pad_token_id=0))}
# Each family's seven projections by their HF module names (fused ones in Phi-3's checkpoint).
ALL_MODULES = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"],
               "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
ALL_MODULES["qwen3"] = ALL_MODULES["llama"]


def base_model(family: str, folder: Path, tokenizer_dir: Path,
               seed: int = 0) -> transformers.PreTrainedModel:
    """A random float32 base of ``family`` saved in ``folder`` with the tokenizer files of
    ``tokenizer_dir``; returns the HF model."""
    model_type, overrides = FAMILIES[family]
    hf = random_hf_model(model_type, seed, **{**SHAPE, **overrides})
    save_hf_model(hf, folder)
    for file in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, folder)
    return hf


def save_adapter(base: transformers.PreTrainedModel, folder: Path, *, seed: int,
                 **lora) -> Path:
    """A peft LoRA adapter of ``base`` with random A and B (``lora``: LoraConfig's fields)
    saved in ``folder``."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False,
                                                                     **lora))
    model.save_pretrained(folder)
    return folder


def peft_greedy(base: transformers.PreTrainedModel, adapter: Path | None,
                prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """peft's (or, without ``adapter``, HF's) greedy continuation of each prompt."""
    import peft

    model = base if adapter is None else peft.PeftModel.from_pretrained(copy.deepcopy(base),
                                                                       adapter)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(max_tokens):  # EOS included: the engine's ignore_eos
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            outputs.append(tokens[len(prompt):])
    return outputs
