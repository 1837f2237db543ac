"""fastllm.LLM end to end: generate / stream / chat against HF transformers on the same weights
(stories260K, and tiny random models of every architecture with the real Qwen3 and Llama 2
tokenizers), the stop rules, logprobs, prefix reuse across requests, and bad input. Generation
against HF (greedy tokens, logprobs, the repetition penalty) and seeded sampling run on each
device present, HF on the CPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
from conftest import per_device
from tiny_hf import random_hf_model, save_hf_model

import fastllm
from fastllm import LLM, SamplingParams, Tokenizer
from fastllm.gguf_file import GGUFFileReader

transformers.logging.set_verbosity_error()

GREEDY = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
PROMPT = "Once upon a time, there was a little girl"

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)

# name -> (model_type, tokenizer folder, vocab size, overrides of TINY)
ARCHITECTURES = {
    "llama": ("llama", "llama2_tokenizer", 32000, {}),
    # The prompt (about 15 tokens) is longer than the window.
    "mistral-window": ("mistral", "llama2_tokenizer", 32000, dict(sliding_window=8)),
    "qwen2": ("qwen2", "qwen3_tokenizer", 151936, {}),
    "qwen3": ("qwen3", "qwen3_tokenizer", 151936, dict(head_dim=32, tie_word_embeddings=True)),
    "smollm3": ("smollm3", "qwen3_tokenizer", 151936, dict(num_hidden_layers=4,
                                                          no_rope_layer_interval=2)),
}


@pytest.fixture(scope="module")
def stories_llms(model_path):
    """(``llms(device)``: an LLM of stories260K on ``device``, one per device; HF's model)."""
    folder = model_path("stories260K_hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return per_device(lambda device: LLM(folder, device=device)), hf


@pytest.fixture(scope="module")
def stories(stories_llms) -> tuple[LLM, torch.nn.Module]:
    llms, hf = stories_llms
    return llms("cpu"), hf


@pytest.fixture
def device_stories(stories_llms, device) -> tuple[LLM, torch.nn.Module]:
    """(the LLM on the test's device, HF's model on the CPU)."""
    llms, hf = stories_llms
    return llms(device), hf


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def tiny_llms(request, tmp_path_factory, model_path):
    """(``llms(device)``: an LLM of a tiny random model on ``device``, one per device; HF's
    model with its weights)."""
    model_type, tokenizer, vocab, overrides = ARCHITECTURES[request.param]
    hf = random_hf_model(model_type, seed=len(request.param),
                         **{**TINY, "vocab_size": vocab, **overrides})
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    for file in model_path(tokenizer).iterdir():
        if file.name.startswith("tokenizer") and file.suffix != ".bin":
            shutil.copy(file, folder)
    return per_device(lambda device: LLM(folder, device=device)), hf


@pytest.fixture(scope="module")
def tiny(tiny_llms) -> tuple[LLM, torch.nn.Module]:
    llms, hf = tiny_llms
    return llms("cpu"), hf


@pytest.fixture
def device_tiny(tiny_llms, device) -> tuple[LLM, torch.nn.Module]:
    """(the LLM on the test's device, HF's model on the CPU)."""
    llms, hf = tiny_llms
    return llms(device), hf


def hf_greedy(hf: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_stories_greedy_128_tokens_equal_hf(device_stories):
    llm, hf = device_stories
    out, = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert out.prompt == PROMPT
    assert out.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    completion = out.outputs[0]
    assert completion.token_ids == hf_greedy(hf, out.prompt_token_ids, 128)
    assert completion.finish_reason == "length" and out.finished
    full = llm.tokenizer.decode(out.prompt_token_ids + completion.token_ids)
    assert completion.text == full[len(llm.tokenizer.decode(out.prompt_token_ids)):]


def test_tiny_architectures_text_prompt_equal_hf(device_tiny):
    llm, hf = device_tiny
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)


def test_stream_deltas_join_to_generate_text(tiny):
    """Random weights over a real vocabulary emit byte tokens, multi-byte characters split over
    tokens and special tokens: the deltas must still join to the full text."""
    llm, _ = tiny
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=48, ignore_eos=True)
    out, = llm.generate(PROMPT, params, use_tqdm=False)
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(deltas) == out.outputs[0].text
    tokenizer = llm.tokenizer
    full = tokenizer.decode(out.prompt_token_ids + out.outputs[0].token_ids)
    assert out.outputs[0].text == full[len(tokenizer.decode(out.prompt_token_ids)):]
    assert all(deltas)


def test_chat_renders_the_template_and_adds_no_second_bos(tiny):
    llm, hf = tiny
    messages = [{"role": "user", "content": "Hi there"}]
    if llm.tokenizer.chat_template is None:  # the Llama 2 tokenizer folder has none
        with pytest.raises(ValueError, match="has no chat template"):
            llm.chat(messages, use_tqdm=False)
        return
    out, = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                    use_tqdm=False, enable_thinking=False)
    text = llm.apply_chat_template(messages, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 8)


def test_many_prompts_keep_their_order_and_parameters(stories):
    llm, _ = stories
    prompts = [PROMPT, [1, 400, 30, 260], {"prompt": "The cat"},
               {"prompt_token_ids": [1, 70]}]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 5, 7, 9)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7, 9]
    for prompt, p, out in zip(prompts, params, outs):
        alone, = llm.generate(prompt, p, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [1, 400, 30, 260]
    assert outs[2].prompt == "The cat"
    assert len({o.request_id for o in outs}) == 4


# ---- stop rules --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_text(stories) -> str:
    """The text of PROMPT's 80 greedy tokens on the module's stories LLM, generated once for
    the stop-rule tests (greedy tokens are the same whatever the prefix cache holds:
    test_a_repeated_prompt_reuses_its_prefix_kv)."""
    llm, _ = stories
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)
    return out.outputs[0].text


@pytest.mark.parametrize("stop", ["park", "ed to", "Lily. She"])
def test_stop_string_ends_the_text_before_it(stories, greedy_text, stop):
    llm, _ = stories
    full = greedy_text
    assert stop in full
    params = SamplingParams(temperature=0, max_tokens=80, stop=["never appears", stop])
    out, = llm.generate(PROMPT, params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == full[:full.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 80
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(deltas) == completion.text
    assert not any(stop in d for d in deltas)


def test_a_held_back_stop_prefix_is_released_when_no_stop_follows(stories, greedy_text):
    """"Lily" begins the stop string "Lily!" but is followed by something else: the stream
    holds it back, then must release it."""
    llm, _ = stories
    full = greedy_text
    assert "Lily" in full and "Lily!" not in full
    params = SamplingParams(temperature=0, max_tokens=80, stop=["Lily!"])
    assert "".join(llm.stream(PROMPT, params)) == full
    out, = llm.generate(PROMPT, params, use_tqdm=False)
    assert out.outputs[0].text == full and out.outputs[0].finish_reason == "length"


def test_stop_token_is_in_the_ids_but_not_the_text(stories):
    llm, _ = stories
    reference, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30),
                              use_tqdm=False)
    ids = reference.outputs[0].token_ids
    stop_token = ids[6]
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30,
                                               stop_token_ids=[stop_token]), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == ids[:ids.index(stop_token) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    full = llm.tokenizer.decode(out.prompt_token_ids + ids[:ids.index(stop_token)])
    assert completion.text == full[len(llm.tokenizer.decode(out.prompt_token_ids)):]


def test_eos_stops_unless_ignored(stories):
    llm, _ = stories
    eos = llm.tokenizer.eos_token_id
    forced = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 1000.0})
    out, = llm.generate(PROMPT, forced, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == [eos] and completion.text == ""
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    forced.ignore_eos = True
    out, = llm.generate(PROMPT, forced, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] * 5 and out.outputs[0].finish_reason == "length"


def test_context_end_finishes_with_length(model_path):
    llm = LLM(model_path("stories260K_hf"), max_model_len=20)
    prompt = llm.tokenizer.encode(PROMPT)
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)
    assert len(prompt) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"


# ---- sampling and logprobs ---------------------------------------------------------------------

def test_greedy_logprobs_are_log_softmax_of_hf_logits(device_stories):
    llm, hf = device_stories
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                        use_tqdm=False)
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[len(out.prompt_token_ids) - 1:-1]  # [6, vocab]
    assert len(completion.logprobs) == 6
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert next(iter(entry)) == token and entry[token].rank == 1
        top = expected[step].topk(3)
        assert list(entry) == top.indices.tolist()
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[step, token_id].item(), abs=1e-4)
            # The text the token stands for mid-text: a SentencePiece "▁" is a space.
            assert logprob.decoded_token == llm.tokenizer.token_text(token_id)
            if llm.tokenizer.convert_ids_to_tokens(token_id).startswith("\u2581"):
                assert logprob.decoded_token.startswith(" ")
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)))


def test_sampled_token_outside_the_top_logprobs_is_reported_without_rank(stories):
    llm, _ = stories
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=40, logprobs=0,
                            ignore_eos=True)
    out, = llm.generate(PROMPT, params, use_tqdm=False)
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert list(entry) == [token] and entry[token].logprob <= 0


def test_temperature_samples_and_the_seed_reproduces(device_stories, model_path):
    llm, _ = device_stories
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40,
                            ignore_eos=True)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    again = LLM(model_path("stories260K_hf"), device=llm.device).generate(PROMPT, params,
                                                                          use_tqdm=False)
    assert again[0].outputs[0].token_ids == first
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    other_seed = llm.generate(PROMPT, SamplingParams(temperature=0.9, top_p=0.95, seed=12,
                                                     max_tokens=40, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert first != greedy and first != other_seed


def test_repetition_penalty_matches_hf(device_stories):
    llm, hf = device_stories
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40,
                                               repetition_penalty=1.5, ignore_eos=True),
                        use_tqdm=False)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=40,
                               min_new_tokens=40, do_sample=False, repetition_penalty=1.5,
                               pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, len(out.prompt_token_ids):].tolist()


# ---- KV reuse and cleanup ----------------------------------------------------------------------

def test_a_repeated_prompt_reuses_its_prefix_kv(stories):
    llm, _ = stories
    prompt = llm.tokenizer.encode(PROMPT * 4)  # several blocks
    first, = llm.generate([prompt], GREEDY, use_tqdm=False)
    second, = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics.ttft is not None and second.metrics.queue_time >= 0


def test_closing_a_stream_early_frees_its_kv(stories):
    llm, _ = stories
    manager = llm.kv_cache.block_manager
    stream = llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=100))
    next(stream)
    assert manager.usage > 0
    stream.close()
    assert manager.usage == 0


def test_a_failed_step_leaves_nothing_in_the_prefix_cache(model_path, monkeypatch):
    llm = LLM(model_path("stories260K_hf"))
    prompt = llm.tokenizer.encode(PROMPT * 4)
    norm = llm.model.norm
    forward = norm.forward
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            # e.g. Ctrl-C in a notebook, mid-prefill: after every layer wrote its K/V
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(norm, "forward", fail_once)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.kv_cache.block_manager.usage == 0
    out, = llm.generate([prompt], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert out.num_cached_tokens == 0  # the interrupted prefill's blocks were never published
    fresh, = LLM(model_path("stories260K_hf")).generate([prompt], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_llms_share_the_pooled_model(model_path):
    first, second = LLM(model_path("stories260K_hf")), LLM(model_path("stories260K_hf"))
    assert first.model is second.model
    assert LLM(model_path("stories260K_hf"), dtype="bfloat16").model is not first.model


def test_a_gguf_file_is_parsed_once_for_its_model_and_tokenizer(model_path, tmp_path,
                                                                monkeypatch):
    path = tmp_path / "model.gguf"  # a path of its own: not pooled yet
    shutil.copyfile(model_path("gguf") / "llama-2-tiny-random.gguf", path)
    parsed = []
    parse = GGUFFileReader.__init__
    monkeypatch.setattr(GGUFFileReader, "__init__",
                        lambda reader, file: (parsed.append(file), parse(reader, file))[1])
    llm = LLM(path)
    assert parsed == [path]
    assert llm.tokenizer.encode("Hello world") == Tokenizer.from_pretrained(path).encode(
        "Hello world")


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, error, match", [
    ([], ValueError, "has no tokens"),
    ([1, 512], ValueError, r"prompt_token_ids\[1\] = 512 is outside \[0, 512\)"),
    ([1, -3], ValueError, r"prompt_token_ids\[1\] = -3 is outside"),
    ([1, 2.5], TypeError, "prompt_token_ids must be ints, got float 2.5 at position 1"),
    ({"text": "hi"}, ValueError, "'prompt' or 'prompt_token_ids'"),
    (3.5, TypeError, "a prompt is a str"),
    ([1] * 600, ValueError, "600 tokens, which leaves no room"),
])
def test_bad_prompts_raise(stories, prompt, error, match):
    llm, _ = stories
    with pytest.raises(error, match=match):
        llm.generate([prompt] if not isinstance(prompt, list) else {"prompt_token_ids": prompt},
                     use_tqdm=False)


def test_a_prompt_is_text_ids_a_1d_integer_tensor_or_array_or_a_dict(stories):
    llm, _ = stories
    params = SamplingParams(temperature=0, max_tokens=3)
    ids = llm.tokenizer.encode(PROMPT)
    expected = llm.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (PROMPT, {"prompt": PROMPT}, tuple(ids), torch.tensor(ids),
                   torch.tensor(ids, dtype=torch.int32), np.array(ids), [np.int64(i) for i in ids],
                   {"prompt_token_ids": torch.tensor(ids)}, {"prompt_token_ids": np.array(ids)}):
        out, = llm.generate(prompt, params, use_tqdm=False)
        assert out.outputs[0].token_ids == expected, type(prompt)
        assert out.prompt_token_ids == ids
    # A list of them is a batch.
    outs = llm.generate([torch.tensor(ids), np.array(ids), PROMPT], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == [expected] * 3
    assert "".join(llm.stream(torch.tensor(ids), params)) == outs[0].outputs[0].text


@pytest.mark.parametrize("prompt, error, match", [
    (b"Once upon", TypeError, "a prompt is a str, .*got bytes"),
    ([b"Once upon"], TypeError, "got bytes"),
    ([1.0, 2.0], TypeError, "a prompt is a str, .*got float"),
    (torch.tensor([[1, 2, 3]]), TypeError, r"prompt token ids must be 1-D, got a Tensor of shape "
                                           r"\(1, 3\)"),
    (np.array([[1, 2, 3]]), TypeError, r"must be 1-D, got a ndarray of shape \(1, 3\)"),
    (torch.tensor(5), TypeError, r"must be 1-D, got a Tensor of shape \(\)"),
    (torch.tensor([1.0, 2.0]), TypeError, "prompt token ids must be ints, got float 1.0"),
    (torch.tensor([True, False]), TypeError, "got bool True"),
    ([True, 2], TypeError, "a prompt is a str, .*got bool"),
    (torch.tensor([1, 700]), ValueError, r"prompt token ids\[1\] = 700 is outside \[0, 512\)"),
    ({"prompt": [1, 2]}, TypeError, "a prompt dict's 'prompt' must be a str, got list"),
    ({"prompt_token_ids": "Once"}, TypeError, "prompt_token_ids must be a sequence of ints, got "
                                              "str"),
    (None, TypeError, "prompts must be a prompt or a list of prompts, got NoneType"),
    ("Once\ud800", ValueError, "lone surrogate '\\\\ud800' at position 4"),
])
def test_prompts_of_other_types_raise_naming_the_type(stories, prompt, error, match):
    llm, _ = stories
    with pytest.raises(error, match=match):
        llm.generate(prompt, use_tqdm=False)


def test_chat_messages_that_are_a_string_raise(stories):
    llm, _ = stories
    with pytest.raises(TypeError, match=r"messages must be a list of .* dicts .*, got str"):
        llm.chat("hello", use_tqdm=False)
    with pytest.raises(TypeError, match=r"messages\[0\] must be a .* dict, got str"):
        llm.chat(["hello", "there"], use_tqdm=False)


def test_bad_parameters_raise(stories, model_path):
    llm, _ = stories
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([PROMPT], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="must be SamplingParams, got dict"):
        llm.generate([PROMPT], [{"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids names token ids \\[9999\\]"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=[9999]), use_tqdm=False)
    with pytest.raises(TypeError, match="one prompt and one SamplingParams"):
        next(llm.stream(PROMPT, [SamplingParams()]))
    folder = model_path("stories260K_hf")
    with pytest.raises(ValueError, match=r"max_model_len must be an int in \[2, 512\]"):
        LLM(folder, max_model_len=513)
    with pytest.raises(ValueError, match="holds no block"):
        LLM(folder, kv_cache_memory=1000)
    with pytest.raises(ValueError, match=r"kv_cache_memory=204,800 bytes hold 160 tokens, fewer "
                                         r"than max_model_len=512; give it at least 655,360"):
        LLM(folder, kv_cache_memory=204_800)
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got 'int8'"):
        LLM(folder, dtype="int8")
    with pytest.raises(FileNotFoundError, match="no model at"):
        LLM(folder / "missing")


def test_generate_with_no_prompts_returns_nothing(stories):
    llm, _ = stories
    assert llm.generate([], use_tqdm=False) == []


def test_public_names():
    assert fastllm.LLM is LLM and callable(fastllm.load)


def test_a_stop_string_inside_a_speculative_step(stories, model_path):
    """Speculation hands the front end several tokens in one step; a stop string completed by
    one of them ends the text there and cuts the tokens after it, exactly as without
    speculation, and a stream never shows the stop string."""
    plain, _ = stories
    prompt = ("Once upon a time, there was a little girl named Lily. She liked to play in the "
              "park. Once upon a time, there was a little girl named Lily. She liked to")
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40),
                          use_tqdm=False)[0].outputs[0].text
    # The model drafting for itself: its drafts are its own greedy tokens, so steps accept
    # several tokens and stop strings fall inside them.
    path = model_path("stories260K_hf")
    llm = LLM(path, speculative={"method": "draft", "model": path, "num_speculative_tokens": 4,
                                 "adaptive": False})
    words = full.split(" ")
    stops = [" ".join(words[i:i + 2]) for i in range(1, len(words) - 2)]
    cut_mid_step = 0
    for stop in stops:
        params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
        expected = plain.generate(prompt, params, use_tqdm=False)[0]
        got = llm.generate(prompt, params, use_tqdm=False)[0]
        assert got.outputs[0].text == expected.outputs[0].text == full[:full.index(stop)]
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == ("stop", stop)
        deltas = list(llm.stream(prompt, params))
        assert "".join(deltas) == got.outputs[0].text and not any(stop in d for d in deltas)
        # The step that completed the stop string had accepted tokens beyond it.
        cut_mid_step += got.metrics.num_generated_tokens > len(got.outputs[0].token_ids)
    assert got.metrics.num_accepted_tokens > 0 and cut_mid_step > 0
    assert llm.kv_cache.block_manager.usage == 0
