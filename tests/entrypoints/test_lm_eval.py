"""lm-eval's ``local-completions`` against ``fastllm serve``: a multiple-choice task scored by
loglikelihood (completions with ``echo`` and prompt logprobs), whose scores equal the prompt
logprobs ``LLM`` computes in process for the same tokens, and whose accuracy is the share of
questions where the answer's in-process loglikelihood is the highest."""

from __future__ import annotations

import json

import pytest
from openai_server import running_server
from tiny_hf import tiny_qwen3_folder

from fastllm import LLM, AsyncLLM, SamplingParams

QUESTIONS = [
    {"question": "The sky is", "choices": [" blue", " green", " a loud noise"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Paris is the capital of", "choices": [" France", " Peru", " the moon"],
     "answer": 0},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model_path):
    """A tiny random Qwen3 over the real Qwen3 tokenizer (lm-eval tokenizes with HF's)."""
    return tiny_qwen3_folder(tmp_path_factory.mktemp("qwen3_lm_eval"),
                             model_path("qwen3_tokenizer"), seed=5, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=512)


def test_multiple_choice_scores_are_the_prompt_logprobs(folder, tmp_path):
    # Imported here: lm-eval (with datasets, pandas and scipy) takes seconds to import.
    import lm_eval
    import lm_eval.api.registry
    import lm_eval.tasks

    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=data))
    llm = AsyncLLM(folder, max_model_len=256, batch_invariant=True)
    try:
        with running_server(llm, "tiny") as server:
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"model=tiny,base_url={server.v1}/completions,tokenizer={folder},"
                           "tokenizer_backend=huggingface,tokenized_requests=True,"
                           "num_concurrent=1,max_retries=1",
                tasks=["tiny_mc"], log_samples=True,
                task_manager=lm_eval.tasks.TaskManager(include_path=str(tmp_path),
                                                       include_defaults=False))
    finally:
        llm.shutdown()
    samples = results["samples"]["tiny_mc"]
    assert sorted(sample["doc"]["question"] for sample in samples) == sorted(
        question["question"] for question in QUESTIONS)
    # The same tokens in process: the continuation's prompt logprobs, summed.
    lm = lm_eval.api.registry.get_model("local-completions")(
        model="tiny", base_url="http://127.0.0.1:1/v1/completions", tokenizer=str(folder),
        tokenizer_backend="huggingface")
    local = LLM(folder, max_model_len=256, batch_invariant=True)
    right = 0
    for sample in samples:
        loglikelihoods = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            [out] = local.generate({"prompt_token_ids": context_ids + continuation_ids},
                                   SamplingParams(max_tokens=0, prompt_logprobs=1),
                                   use_tqdm=False)
            entries = out.prompt_logprobs[len(context_ids):]
            tokens = continuation_ids
            loglikelihood = sum(entry[token].logprob for entry, token in zip(entries, tokens))
            greedy = all(entry[token].rank == 1 for entry, token in zip(entries, tokens))
            served, served_greedy = response[0]
            assert float(served) == pytest.approx(loglikelihood, rel=1e-6, abs=1e-6)
            assert served_greedy == greedy
            loglikelihoods.append(loglikelihood)
        assert len(loglikelihoods) == len(sample["doc"]["choices"])
        right += loglikelihoods.index(max(loglikelihoods)) == sample["doc"]["answer"]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(right / len(QUESTIONS))
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
