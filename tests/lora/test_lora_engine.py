"""LoRA adapters through the engine: one ``generate`` mixing adapters and the base model gives
each prompt peft's greedy tokens on the same weights (Llama, Qwen3, Phi-3's fused checkpoint;
different ranks and target modules, rsLoRA), with fewer slots than adapters, under n-gram
speculation, on two tensor-parallel ranks and over a GGUF-quantized base; KV computed under one
adapter never serves another; bad requests are clear errors."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import cpu_isa
from models.test_gguf import gguf_tensors, write_gguf
from peft_models import ALL_MODULES, FAMILIES, base_model, peft_greedy, save_adapter

from fastllm import LLM, LoRARequest, SamplingParams, StructuredOutputsParams

PROMPTS = [[1, 37, 99, 201, 5, 77], [1, 300, 12, 48], [1, 250, 251, 252, 253, 9, 10, 11]]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class Case:
    """A base model and two adapters of it: ``a`` (rank 8 on attention only) and ``b`` (rank
    4, rsLoRA, on every projection)."""

    family: str
    hf: torch.nn.Module
    folder: Path
    a: LoRARequest
    b: LoRARequest

    def expected(self, lora: LoRARequest | None, prompts=PROMPTS) -> list[list[int]]:
        return peft_greedy(self.hf, None if lora is None else Path(lora.lora_path), prompts,
                           MAX_TOKENS)


def make_case(family: str, root: Path, tokenizer_dir: Path) -> Case:
    hf = base_model(family, root / "base", tokenizer_dir)
    attention = ["qkv_proj"] if family == "phi3" else ["q_proj", "v_proj"]
    a = save_adapter(hf, root / "a", seed=1, r=8, lora_alpha=16, target_modules=attention)
    b = save_adapter(hf, root / "b", seed=2, r=4, lora_alpha=8, use_rslora=True,
                     target_modules=ALL_MODULES[family])
    return Case(family, hf, root / "base", LoRARequest("a", 1, str(a)),
                LoRARequest("b", 2, str(b)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory, model_path) -> Case:
    return make_case(request.param, tmp_path_factory.mktemp(request.param),
                     model_path("stories260K_hf"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory, model_path) -> Case:
    return make_case("llama", tmp_path_factory.mktemp("llama"), model_path("stories260K_hf"))


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_one_call_mixes_adapters_and_the_base(case):
    llm = LLM(case.folder, enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = [case.a, case.b, None]
    got = tokens(llm.generate([p for p in PROMPTS for _ in loras], GREEDY, use_tqdm=False,
                              lora_request=[lora for _ in PROMPTS for lora in loras]))
    expected = {lora: case.expected(lora) for lora in loras}
    assert got == [expected[lora][i] for i in range(len(PROMPTS)) for lora in loras]
    # The adapters matter: each changes some prompt's tokens.
    assert expected[case.a] != expected[None] and expected[case.b] != expected[None]


def test_adapters_wait_for_a_slot(llama):
    """One slot, one adapter kept on the host: the adapters take turns (reloaded from their
    files each time) and every request gets its own adapter's tokens. A request waiting for
    its adapter's turn is not overtaken by later ones of the running adapter (which would
    keep it busy), only by those of the base model."""
    llm = LLM(llama.folder, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    loras = [llama.a, llama.b, None, llama.b, llama.a]
    outputs = llm.generate([PROMPTS[0]] * len(loras), GREEDY, lora_request=loras,
                           use_tqdm=False)
    expected = {lora: llama.expected(lora, [PROMPTS[0]])[0] for lora in set(loras)}
    assert tokens(outputs) == [expected[lora] for lora in loras]
    started = [out.metrics.first_scheduled_time for out in outputs]
    finished = [out.metrics.finished_time for out in outputs]
    assert started[2] < finished[0] < started[1] <= started[3] < finished[1] < started[4]


def test_two_adapters_never_share_cached_kv(llama):
    """A prompt of three full blocks computed under adapter a, then under b: b reuses none of
    a's KV (it would get a's hidden states and other tokens), while a again reuses its own."""
    llm = LLM(llama.folder, enable_lora=True, max_lora_rank=8, block_size=16)
    prompt = [1, *range(100, 150)]  # 51 tokens: three full blocks
    first = llm.generate(prompt, GREEDY, lora_request=llama.a, use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, lora_request=llama.b, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, lora_request=llama.a, use_tqdm=False)[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens,
            base.num_cached_tokens) == (0, 0, 48, 0)
    expected_a, expected_b, expected_base = (llama.expected(lora, [prompt])[0]
                                             for lora in (llama.a, llama.b, None))
    assert tokens([first, other, again, base]) == [expected_a, expected_b, expected_a,
                                                   expected_base]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_with_adapters(llama, method):
    """Drafts by prompt lookup, or by a draft model (the base, without adapters): the
    target verifies them with each request's adapter, so the tokens are the adapter's."""
    draft = {"model": str(llama.folder)} if method == "draft" else {}
    llm = LLM(llama.folder, enable_lora=True, max_loras=2, max_lora_rank=8,
              speculative={"method": method, "num_speculative_tokens": 3, **draft})
    prompt = [1, 40, 41, 42, 43, 40, 41, 42, 43, 40, 41]  # repeats: the lookups find drafts
    loras = [llama.a, llama.b, None]
    got = tokens(llm.generate([prompt] * 3, GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [llama.expected(lora, [prompt])[0] for lora in loras]


def test_prompt_logprobs_and_structured_output_with_an_adapter(llama):
    """Prompt logprobs are the adapter's (peft's log-softmax at each prompt position), and a
    grammar holds an adapter's output as it holds the base's."""
    import peft

    llm = LLM(llama.folder, enable_lora=True, max_lora_rank=8)
    prompt = PROMPTS[2]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       lora_request=llama.a, use_tqdm=False)[0]
    model = peft.PeftModel.from_pretrained(copy.deepcopy(llama.hf), llama.a.lora_path)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               expected[torch.arange(len(prompt) - 1), prompt[1:]],
                               atol=1e-4, rtol=0)
    choices = ["once", "upon", "time"]
    constrained = SamplingParams(temperature=0, max_tokens=8, structured_outputs=
                                 StructuredOutputsParams(choice=choices))
    texts = [o.outputs[0].text for o in llm.generate(
        [PROMPTS[0]] * 3, constrained, lora_request=[llama.a, llama.b, None], use_tqdm=False)]
    assert all(text in choices for text in texts), texts


def test_embeddings_and_streams_take_an_adapter(llama):
    import peft

    llm = LLM(llama.folder, enable_lora=True, max_loras=2, max_lora_rank=8)
    text = "".join(llm.stream(PROMPTS[1], GREEDY, lora_request=llama.b))
    assert text == llm.generate(PROMPTS[1], GREEDY, lora_request=llama.b,
                                use_tqdm=False)[0].outputs[0].text
    with_a, with_b, base = (llm.embed([PROMPTS[0]], lora_request=lora, use_tqdm=False)[0]
                            for lora in (llama.a, llama.b, None))
    model = peft.PeftModel.from_pretrained(copy.deepcopy(llama.hf), llama.a.lora_path)
    with torch.no_grad():
        hidden = model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[-1]
        plain = llama.hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[-1]
    for got, expected in ((with_a, hidden), (base, plain)):
        torch.testing.assert_close(torch.tensor(got.embedding),
                                   torch.nn.functional.normalize(expected[0, -1], dim=0),
                                   atol=1e-5, rtol=0)
    assert with_a.embedding != with_b.embedding


def test_adapter_over_a_gguf_quantized_base(llama, tmp_path):
    """The base written as a Q8_0 GGUF: fastllm over the file with an adapter gives peft's
    tokens over HF's model of the weights the file encodes (dequantized), in the scalar
    kernels' arithmetic. (Q8_0: its integer dot products round the activations less than a
    4-bit format's, which HF's float matmuls do not round at all.)"""
    stored, encoded = gguf_tensors(llama.hf, "llama", "Q8_0")
    path = write_gguf(tmp_path / "base.gguf", "llama", llama.hf.config, stored)
    dequantized = copy.deepcopy(llama.hf)
    dequantized.load_state_dict(encoded)
    llm = LLM(path, tokenizer=llama.folder, enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = [llama.a, llama.b, None]
    with cpu_isa("scalar"):
        got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [peft_greedy(dequantized, None if lora is None else Path(lora.lora_path),
                               [prompt], MAX_TOKENS)[0] for lora, prompt in zip(loras, PROMPTS)]


def test_two_ranks_give_one_process_tokens(llama):
    llm = LLM(llama.folder, enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=2, max_model_len=128)
    try:
        loras = [llama.a, llama.b, None]
        got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False))
    finally:
        llm.shutdown()
    assert got == [llama.expected(lora, [prompt])[0] for lora, prompt in zip(loras, PROMPTS)]


def test_bad_lora_requests_are_clear_errors(llama, tmp_path):
    plain = LLM(llama.folder)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(PROMPTS[0], GREEDY, lora_request=llama.a)
    llm = LLM(llama.folder, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=llama.a)  # rank 8
    llm.generate(PROMPTS[0], GREEDY, lora_request=llama.b, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 2"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("c", 2, llama.a.lora_path))
    with pytest.raises(TypeError, match="lora_request"):
        llm.generate(PROMPTS[0], GREEDY, lora_request="b")
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=[llama.b, None])
    with pytest.raises((ValueError, FileNotFoundError), match="missing"):
        llm.generate(PROMPTS[0], GREEDY,
                     lora_request=LoRARequest("gone", 3, str(tmp_path / "missing")))
    for bad in (dict(max_loras=0), dict(max_lora_rank=0), dict(max_loras=2, max_cpu_loras=1)):
        with pytest.raises(ValueError, match=next(iter(bad)) if len(bad) == 1 else "max_cpu"):
            LLM(llama.folder, enable_lora=True, **bad)
    # Nothing failed on the way: the engine still serves both.
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=[llama.b, None],
                               use_tqdm=False)) == [llama.expected(llama.b, [PROMPTS[0]])[0],
                                                    llama.expected(None, [PROMPTS[1]])[0]]
