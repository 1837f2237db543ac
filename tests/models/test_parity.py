"""Parity of fastllm's DecoderLM with HF transformers on the same weights, float32.

Each case is a tiny random HF model (Qwen2 and Mistral with a sliding window of 8, Qwen3 with
q/k norms, SmolLM3 with NoPE layers, Llama with llama3 and linear RoPE scaling) saved as
safetensors and loaded with ``load_model``, plus the real stories260K. The fastllm side runs
packed batches through a paged cache with small, shuffled blocks whose unwritten slots are NaN.
Prefill logits and greedy decoding also run on each device present, against HF on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import assert_logits_close, metadata_for, model_device, per_device
import transformers
from tiny_hf import FAMILY_CASES, randomize_
from transformers import AutoConfig, AutoModelForCausalLM

from fastllm.kv_cache import PagedKVCache
from fastllm.models import DecoderLM, ModelConfig, load_model
from fastllm.models.rope import build_cos_sin_cache, rope_inv_freq

transformers.logging.set_verbosity_error()

ATOL = 1e-4  # float32 logits, fastllm vs HF eager
BLOCK_SIZE = 4  # small, so every sequence spans several blocks
NUM_BLOCKS = 96
NEW_TOKENS = 20

BASE = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            tie_word_embeddings=False)

# name -> (model_type, overrides of BASE)
CASES = {
    # Layers 1 and 2 slide (from max_window_layers), layer 0 does not; q/k/v biases.
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                    max_window_layers=1)),
    # head_dim 32 != hidden / heads; MQA; every attention projection biased; tied embeddings.
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, num_key_value_heads=1, attention_bias=True,
                                    tie_word_embeddings=True)),
    "mistral-sliding": ("mistral", dict(sliding_window=8)),
    # no_rope_layers [1, 0, 1, 0]: layers 1 and 3 are NoPE, and they slide.
    "smollm3-nope": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                     use_sliding_window=True, sliding_window=8,
                                     attention_bias=True, mlp_bias=True)),
    # original 32: one frequency kept, one interpolated, the rest divided by the factor.
    "llama-rope-llama3": ("llama", dict(
        head_dim=16, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=32))),
    "llama-rope-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0,
                                                             rope_theta=500.0),
                                        attention_bias=True, mlp_bias=True)),
    **FAMILY_CASES,
}


def hf_config(name: str) -> transformers.PreTrainedConfig:
    model_type, overrides = CASES[name]
    return AutoConfig.for_model(model_type, **{**BASE, **overrides})


@pytest.fixture(scope="module", params=[*CASES, "stories260K"])
def checkpoint(request, tmp_path_factory, model_path
               ) -> tuple[torch.nn.Module, Callable[[torch.device | str], DecoderLM]]:
    """(HF model, ``load(device)``: the fastllm model on ``device``, loaded once per device),
    with the same weights, from one safetensors folder."""
    if request.param == "stories260K":
        folder = model_path("stories260K_hf")
    else:
        hf = AutoModelForCausalLM.from_config(hf_config(request.param), attn_implementation="eager",
                                              dtype=torch.float32)
        randomize_(hf, seed=len(request.param), bias_scale=0.1)
        folder = tmp_path_factory.mktemp(request.param)
        hf.save_pretrained(folder)  # writes config.json with "architectures"
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    return hf, per_device(lambda device: load_model(folder, device=device))


@pytest.fixture(scope="module")
def models(checkpoint) -> tuple[torch.nn.Module, DecoderLM]:
    """(HF model, fastllm model on the CPU)."""
    hf, load = checkpoint
    return hf, load("cpu")


@pytest.fixture
def device_models(checkpoint, device) -> tuple[torch.nn.Module, DecoderLM]:
    """(HF model on the CPU, fastllm model on the test's device)."""
    hf, load = checkpoint
    return hf, load(device)


def prompts(model: DecoderLM, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def shuffled_cache(model: DecoderLM, *, prefix_caching: bool = False,
                   pre_rope: bool = False) -> PagedKVCache:
    """A paged cache on the model's device whose free blocks come out in a random order, every
    slot NaN until written, so a wrong slot or block table shows up as NaN or a wrong logit."""
    cache = PagedKVCache(model.kv_cache_spec(BLOCK_SIZE), NUM_BLOCKS, device=model_device(model),
                         enable_prefix_caching=prefix_caching, pre_rope=pre_rope)
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    manager = cache.block_manager
    dummies = range(1000, 1000 + NUM_BLOCKS)
    for seq_id in dummies:
        manager.allocate(seq_id, [0])  # one block each
    for i in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist():
        manager.free(dummies[i])  # freed blocks queue up in this order
    return cache


def append(cache: PagedKVCache, seq_id: int, tokens: list[int]) -> None:
    cache.copy_blocks(cache.block_manager.append_tokens(seq_id, tokens))


def run_step(model: DecoderLM, cache: PagedKVCache, seq_ids: list[int],
             new_tokens: list[list[int]]) -> list[torch.Tensor]:
    """One packed forward of ``new_tokens[b]`` (already in the block manager) for each
    sequence; returns each sequence's logits ``[len(new_tokens[b]), vocab]``."""
    counts = [len(tokens) for tokens in new_tokens]
    meta = metadata_for(cache, seq_ids, counts)
    input_ids = torch.tensor([t for tokens in new_tokens for t in tokens],
                             device=cache.k_cache.device)
    hidden = model(input_ids, meta, cache)  # [T, hidden]
    return list(model.compute_logits(hidden).split(counts))


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [len, vocab]


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    assert_logits_close(got, expected, ATOL)


def test_prefill_logits_match_hf(device_models):
    hf, model = device_models
    batch = prompts(model, [7, 1, 30, 13], seed=1)
    cache = shuffled_cache(model)
    seq_ids = [0, 1, 2, 3]
    for seq_id, prompt in zip(seq_ids, batch):
        assert cache.block_manager.allocate(seq_id, prompt) == 0
    tables = [cache.block_manager.block_table(seq_id) for seq_id in seq_ids]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "blocks not shuffled"
    logits = run_step(model, cache, seq_ids, batch)
    for got, prompt in zip(logits, batch):
        assert_close(got, hf_logits(hf, prompt))


# Pre-RoPE caches (keys rotated as attention reads them) must give what post-RoPE ones give.
@pytest.mark.parametrize("pre_rope", [False, True], ids=["post_rope", "pre_rope"])
def test_greedy_decode_matches_hf_generate(device_models, pre_rope):
    hf, model = device_models
    batch = prompts(model, [5, 12, 1], seed=2)
    cache = shuffled_cache(model, pre_rope=pre_rope)
    seq_ids = [7, 8, 9]
    for seq_id, prompt in zip(seq_ids, batch):
        cache.block_manager.allocate(seq_id, prompt)
    step_tokens = batch
    generated: list[list[int]] = [[] for _ in batch]
    for _ in range(NEW_TOKENS):
        logits = run_step(model, cache, seq_ids, step_tokens)
        step_tokens = [[int(rows[-1].argmax())] for rows in logits]
        for seq_id, out, [token] in zip(seq_ids, generated, step_tokens):
            out.append(token)
            append(cache, seq_id, [token])
    eos = model.config.eos_token_ids
    for prompt, out in zip(batch, generated):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=NEW_TOKENS)
        expected = expected[0, len(prompt):].tolist()
        # HF stops at an eos (stories260K ends its stories); the tokens up to it must agree.
        assert len(expected) == NEW_TOKENS or expected[-1] in eos
        assert out[:len(expected)] == expected


@pytest.mark.parametrize("pre_rope", [False, True], ids=["post_rope", "pre_rope"])
def test_chunked_prefill_in_a_mixed_batch_matches_one_shot(models, pre_rope):
    """Sequence 0 prefills 30 tokens in chunks of 11, 9, 10 while sequence 1 prefills 5 tokens
    and then decodes in the same batches; both match HF, and the last logits of the chunked
    prefill match a one-shot prefill."""
    hf, model = models
    long, short = prompts(model, [30, 5], seed=3)
    cache = shuffled_cache(model, pre_rope=pre_rope)
    manager = cache.block_manager
    chunks = [long[:11], long[11:20], long[20:]]
    manager.allocate(0, chunks[0])
    manager.allocate(1, short)
    got_long, got_short = run_step(model, cache, [0, 1], [chunks[0], short])
    long_logits, short_tokens = [got_long], list(short)
    for chunk in chunks[1:]:
        short_tokens.append(int(got_short[-1].argmax()))
        append(cache, 0, chunk)
        append(cache, 1, short_tokens[-1:])
        got_long, got_short = run_step(model, cache, [0, 1], [chunk, short_tokens[-1:]])
        long_logits.append(got_long)
    assert_close(torch.cat(long_logits), hf_logits(hf, long))
    assert_close(got_short[-1], hf_logits(hf, short_tokens)[-1])

    one_shot_cache = shuffled_cache(model)
    one_shot_cache.block_manager.allocate(0, long)
    [one_shot] = run_step(model, one_shot_cache, [0], [long])
    assert_close(long_logits[-1][-1], one_shot[-1])


def test_prefix_cache_hit_computes_only_the_rest(models):
    """A prompt sharing 9 tokens with a prefilled one reuses its two full blocks: only the
    tokens from position 8 on are computed, and their logits still match HF."""
    hf, model = models
    first, tail = prompts(model, [13, 6], seed=4)
    second = first[:9] + tail
    cache = shuffled_cache(model, prefix_caching=True)
    manager = cache.block_manager
    manager.allocate(0, first)
    assert manager.allocate(2, first) == 0  # not computed yet: nothing to reuse
    manager.free(2)
    run_step(model, cache, [0], [first])  # this module's run_step calls the model directly,
    manager.mark_computed(0, manager.num_tokens(0))  # so the test says the KV is written
    cached = manager.allocate(1, second)
    assert cached == 2 * BLOCK_SIZE
    [got] = run_step(model, cache, [1], [second[cached:]])
    assert_close(got, hf_logits(hf, second)[cached:])


def test_logits_for_selected_rows_only(models):
    """compute_logits takes only the rows it is given (the last token of each sequence)."""
    _, model = models
    batch = prompts(model, [3, 6], seed=5)
    cache = shuffled_cache(model)
    for seq_id, prompt in enumerate(batch):
        cache.block_manager.allocate(seq_id, prompt)
    meta = metadata_for(cache, [0, 1], [3, 6])
    assert meta.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    hidden = model(torch.tensor(batch[0] + batch[1]), meta, cache)
    last_rows = meta.cu_seqlens_q[1:].long() - 1
    logits = model.compute_logits(hidden[last_rows])
    assert logits.shape == (2, model.config.vocab_size)
    assert_close(logits, model.compute_logits(hidden)[last_rows])


@pytest.mark.parametrize("name", CASES)
def test_config_resolves_layers_like_hf(name):
    """Per-layer sliding windows, NoPE layers, head_dim and biases as the HF config reads them."""
    hf = hf_config(name)
    config = ModelConfig.from_hf_config(hf.to_dict())  # architecture from model_type
    hf_sliding = [t == "sliding_attention" for t in getattr(hf, "layer_types", None) or []]
    if not hf_sliding:  # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer, when set
        hf_sliding = [getattr(hf, "sliding_window", None) is not None] * hf.num_hidden_layers
    assert list(config.sliding_layers) == (hf_sliding or [False] * hf.num_hidden_layers)
    assert config.rope_layers == tuple(bool(f) for f in getattr(
        hf, "no_rope_layers", [1] * hf.num_hidden_layers))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.head_dim == head_dim
    expected_windows = [7 if s else -1 for s in config.sliding_layers]
    assert [config.window_left(i) for i in range(config.num_layers)] == expected_windows


def test_smollm3_no_rope_layers_convention():
    """HF's no_rope_layers[i] == 1 means layer i *uses* RoPE; the default drops it on every
    no_rope_layer_interval-th layer."""
    hf = dict(architectures=["SmolLM3ForCausalLM"], **{**BASE, "num_hidden_layers": 8})
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_layers == (True, True, True, False, True, True, True, False)
    config = ModelConfig.from_hf_config({**hf, "no_rope_layers": [0, 1, 1, 1, 1, 1, 1, 0]})
    assert config.rope_layers == (False, True, True, True, True, True, True, False)


@pytest.mark.parametrize("rope", [
    dict(rope_scaling=dict(type="linear", factor=4.0), rope_theta=500.0),  # legacy form
    dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=500.0)),
    dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=64),
         rope_theta=500000.0),
    dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0,
                              high_freq_factor=8.0, rope_theta=500000.0)),
    dict(rope_theta=1e6),
])
def test_rope_frequencies_match_hf(rope):
    """Both config forms (``rope_scaling`` + top-level ``rope_theta``, and transformers 5's
    ``rope_parameters``) give HF's inverse frequencies, and the table is built from them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_dict = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                   **{**BASE, "head_dim": 32}, **rope)
    config = ModelConfig.from_hf_config(hf_dict)
    hf = AutoConfig.for_model("llama", **{k: v for k, v in hf_dict.items() if k != "model_type"})
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        expected = 1.0 / hf.rope_parameters["rope_theta"] ** (
            torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf)
    inv_freq = rope_inv_freq(config)
    torch.testing.assert_close(inv_freq.float(), expected.float(), rtol=1e-6, atol=0)
    table = build_cos_sin_cache(config, 128)  # [max_position, head_dim]
    angles = torch.outer(torch.arange(128, dtype=torch.float64), inv_freq)
    torch.testing.assert_close(table, torch.cat([angles.cos(), angles.sin()], -1).float())


def test_stories260k_tells_its_story(model_path):
    """Independent of HF: the reference values in shared/models/README.md (BOS's top logit,
    and the greedy story llama2.c's docs print)."""
    import sentencepiece

    folder = model_path("stories260K_hf")
    model = load_model(folder)
    cache = shuffled_cache(model)
    tokens = [model.config.bos_token_id]
    cache.block_manager.allocate(0, tokens)
    [logits] = run_step(model, cache, [0], [tokens])
    assert int(logits[0].argmax()) == 403
    assert abs(float(logits[0, 403]) - 17.02352) < 1e-3
    for _ in range(24):
        tokens.append(int(logits[-1].argmax()))
        append(cache, 0, tokens[-1:])
        [logits] = run_step(model, cache, [0], [tokens[-1:]])
    text = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert text.decode(tokens).startswith("Once upon a time, there was a little girl named Lily.")


def test_attention_metadata_layout():
    """Slots and positions of the newest tokens, through each sequence's own block table."""
    config = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **BASE})
    cache = PagedKVCache(DecoderLM(config).kv_cache_spec(BLOCK_SIZE), 16,
                         enable_prefix_caching=False)
    manager = cache.block_manager
    manager.allocate(5, [3] * 6)  # blocks [0, 1]
    manager.allocate(6, [4] * 3)  # blocks [2]
    manager.append_tokens(5, [7, 7, 7])  # 9 tokens: blocks [0, 1, 3]
    meta = metadata_for(cache, [5, 6], [4, 1])
    assert meta.cu_seqlens_q.tolist() == [0, 4, 5] and meta.max_seqlen_q == 4
    assert meta.seq_lens.tolist() == [9, 3]
    assert meta.positions.tolist() == [5, 6, 7, 8, 2]
    assert meta.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0, 2 * 4 + 2]
    assert meta.block_tables[0].tolist() == [0, 1, 3]
    assert not meta.keys_are_new  # the new tokens attend to keys cached before them
    assert metadata_for(cache, [5, 6], [9, 3]).keys_are_new  # whole prompts
    assert (meta.cu_seqlens_q.dtype, meta.seq_lens.dtype, meta.block_tables.dtype,
            meta.slot_mapping.dtype, meta.positions.dtype) == (torch.int32, torch.int32,
                                                               torch.int32, torch.int64,
                                                               torch.int64)
    with pytest.raises(ValueError, match="holds 3 tokens, so it cannot have 4 new ones"):
        metadata_for(cache, [6], [4])


def test_layers_rebind_after_load_and_by_hand(tmp_path):
    """The model runs its layers as functions bound to the weights (DecoderLayer.bind): loading
    new weights rebinds them, and so does unbind_layers after a parameter replaced by hand; the
    logits then equal those of a model loaded with the new weights."""
    hf = AutoModelForCausalLM.from_config(hf_config("qwen3-qk-norm"), attn_implementation="eager",
                                          dtype=torch.float32)
    randomize_(hf, seed=1, bias_scale=0.1)
    hf.save_pretrained(tmp_path / "a")
    randomize_(hf, seed=2, bias_scale=0.1)
    hf.save_pretrained(tmp_path / "b")
    model, other = load_model(tmp_path / "a"), load_model(tmp_path / "b")
    tokens = prompts(model, [9], seed=3)

    def logits(m: DecoderLM) -> torch.Tensor:
        cache = shuffled_cache(m)
        cache.block_manager.allocate(0, tokens[0])
        return run_step(m, cache, [0], tokens)[0]

    before, expected = logits(model), logits(other)
    assert not torch.allclose(before, expected)
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    torch.testing.assert_close(logits(model), expected, atol=0, rtol=0)

    down = model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.zeros_like(down.weight), requires_grad=False)
    model.unbind_layers()
    changed = logits(model)
    assert not torch.allclose(changed, expected)
    other.layers[1].mlp.down_proj.weight.zero_()
    torch.testing.assert_close(changed, logits(other), atol=0, rtol=0)
