"""Tiny random-weight HF transformers models, for parity tests against fastllm."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.initialization import no_init_weights


# The families beyond the Llama decoder's first ones, each as its own HF model_type with the
# overrides that make its particulars matter in a tiny model: name -> (model_type, overrides of
# a Llama-shaped base config). Shared by the model-level and the engine-level parity tests.
FAMILY_CASES: dict[str, tuple[str, dict]] = {
    # Sandwich norms of (1 + w), GELU-tanh, sqrt(hidden) embeddings, attention scaled by
    # query_pre_attn_scalar, both soft-caps low enough to bite; layers 0 and 2 slide.
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=12.0,
                              tie_word_embeddings=True)),
    # Per-head q/k norms of (1 + w); sliding layers rotate with their own base, full ones with
    # linear scaling of another.
    "gemma3": ("gemma3_text", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0,
                                                rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
    # q|k|v and gate|up fused in the checkpoint; half the head rotated; every layer slides.
    "phi3-partial-rotary": ("phi3", dict(
        sliding_window=8, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                               partial_rotary_factor=0.5))),
    # Norms on the sublayers' outputs only; q/k norms over all heads.
    "olmo2": ("olmo2", dict()),
    # Top-2 of 8 experts, renormalized; layer 1 a dense MLP; no head_dim (HF: hidden / heads).
    "qwen3-moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True,
                                    mlp_only_layers=[1])),
    "mixtral-sliding": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=8)),
}


def randomize_(model: torch.nn.Module, seed: int, *, scale: float = 0.15,
               bias_scale: float | None = None) -> None:
    """Weights ``scale * randn`` (biases ``bias_scale * randn``, default ``scale``), norms
    ``1 + 0.2 * randn``: large enough that logits are far apart (greedy ties would make parity
    flaky), norms away from 1 and biases away from 0, so every parameter matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias") and bias_scale is not None:
                p.copy_(bias_scale * noise)
            else:
                p.copy_(scale * noise)


def random_hf_model(model_type: str, seed: int, **config) -> transformers.PreTrainedModel:
    """A float32 eager-attention HF model of ``model_type`` with random weights."""
    # randomize_ writes every parameter: HF's own initialization of them would be thrown away
    # (skipping it skips the tying of the embeddings too, done here).
    with no_init_weights():
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config),
                                              attn_implementation="eager", dtype=torch.float32)
    hf.tie_weights()
    randomize_(hf, seed, bias_scale=0.1)
    return hf.eval()


def save_hf_model(hf: transformers.PreTrainedModel, folder: Path) -> Path:
    """Writes config.json (with "architectures") and model.safetensors into ``folder``."""
    hf.save_pretrained(folder)
    return folder


def tiny_qwen3_folder(folder: Path, tokenizer_dir: Path, seed: int, **config) -> Path:
    """A tiny random Qwen3 (2 layers, hidden 64, 4 query and 2 KV heads of 16; ``config``
    overrides) over the real Qwen3 tokenizer's 151,936-token vocabulary, its tokenizer files
    (and chat template) copied in: a model whose template renders tools, and that HF's
    tokenizer reads."""
    shape = dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=2048, tie_word_embeddings=True)
    save_hf_model(random_hf_model("qwen3", seed, **{**shape, **config}), folder)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, folder)
    return folder


def chain_qwen3_folder(folder: Path, tokenizer_dir: Path, chain: list[int]) -> Path:
    """:func:`tiny_qwen3_folder` made into a bigram model whose greedy continuation of
    ``chain[i]`` is ``chain[i + 1]``: the layers add nothing to the residual stream (their
    output projections are zero), so the logits are the tied embeddings against the last
    token's normalized embedding; ``chain[k]``'s embedding is ``3**k (e_k + e_(k+1))`` along the
    axes, so the next one (three times longer, half aligned) outscores itself, the one before
    and the random rest. A reply that starts after ``chain[0]`` writes the chain as long as
    nothing (a grammar) stops it: a known reply out of a random model."""
    tiny_qwen3_folder(folder, tokenizer_dir, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert len(chain) + 1 <= hf.config.hidden_size
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        embeddings = hf.model.embed_tokens.weight
        for k, token in enumerate(chain):
            row = torch.zeros(hf.config.hidden_size)
            row[k] = row[k + 1] = 3.0 ** k
            embeddings[token] = row
    hf.save_pretrained(folder)
    return folder
