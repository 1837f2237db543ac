"""Tensor parallelism through the engine, on the CPU: ``LLM(..., tensor_parallel_size=2)`` (two
gloo ranks, one process each) gives exactly one process's float32 greedy tokens on a batch of
mixed prompt lengths; ranks that stop fail ``generate`` within seconds and leave no process
behind; a model the ranks cannot split is refused by name."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import free_port
from tiny_hf import random_hf_model, save_hf_model

from fastllm import LLM, SamplingParams
from fastllm.engine.executor import ExecutorError

PROMPT_LENGTHS = (3, 17, 40, 9, 26)


def rank_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("fastllm-rank")]


@pytest.fixture(autouse=True)
def no_rank_left():
    """Every test leaves no rank process behind."""
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank_processes()


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A Qwen3-shaped GQA model (q/k norms, 4 query and 2 KV heads) over stories260K's 512-token
    vocabulary."""
    hf = random_hf_model("qwen3", seed=3, vocab_size=512, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    return save_hf_model(hf, tmp_path_factory.mktemp("qwen3_tp"))


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist()
            for n in PROMPT_LENGTHS]


def greedy(llm: LLM, batch: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("model", ["stories260K", "qwen3", "gguf"])
def test_two_ranks_give_one_process_greedy_tokens(model, model_path, qwen3_folder):
    tokenizer = model_path("stories260K_hf")
    path, tokenizer = {"stories260K": (tokenizer, None), "qwen3": (qwen3_folder, tokenizer),
                       "gguf": (model_path("gguf/llama-2-tiny-random.gguf"), None)}[model]
    kwargs = dict(tokenizer=tokenizer, max_model_len=128, kv_cache_memory=8 << 20)
    one = LLM(path, **kwargs)
    batch = prompts(min(one.model.config.vocab_size, 512))
    expected = greedy(one, batch)
    two = LLM(path, tensor_parallel_size=2, **kwargs)
    assert two.kv_cache.spec.n_kv_heads * 2 == one.kv_cache.spec.n_kv_heads
    assert greedy(two, batch) == expected
    # The ranks keep nothing of finished requests, and a second batch runs as the first.
    assert not two.engine.executor.worker.requests
    assert greedy(two, batch[:2], max_tokens=4) == [tokens[:4] for tokens in expected[:2]]
    two.shutdown()
    with pytest.raises(ExecutorError):
        greedy(two, batch[:1])


def test_sampling_and_speculation_on_two_ranks(model_path):
    """Rank 0 samples (seeded) and drafts for every rank: the tokens are one process's."""
    folder = model_path("stories260K_hf")
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, repetition_penalty=1.2,
                             ignore_eos=True) for i in range(3)]
    batch = prompts(512)[:3]
    settings = dict(max_model_len=128, kv_cache_memory=8 << 20,
                    speculative={"method": "ngram", "num_speculative_tokens": 3})
    expected = LLM(folder, **settings).generate(batch, params, use_tqdm=False)
    llm = LLM(folder, tensor_parallel_size=2, **settings)
    got = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    llm.shutdown()


def test_a_killed_rank_fails_generate_within_seconds(model_path):
    llm = LLM(model_path("stories260K_hf"), tensor_parallel_size=2, max_model_len=512)
    [rank] = rank_processes()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    killed = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(rank.pid, signal.SIGKILL)

    timer = threading.Timer(0.5, kill)
    timer.start()
    with pytest.raises(ExecutorError, match="rank"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # generate until the kill lands mid-generation
            llm.generate([[1, 2, 3]] * 4, params, use_tqdm=False)
    assert killed and time.monotonic() - killed[0] < 30
    timer.join()
    rank.join(timeout=5)
    assert not rank.is_alive()
    start = time.monotonic()
    with pytest.raises(ExecutorError):  # at once: the executor is stopped
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert time.monotonic() - start < 1


def test_dropping_the_llm_stops_its_rank(model_path):
    llm = LLM(model_path("stories260K_hf"), tensor_parallel_size=2, max_model_len=64)
    [rank] = rank_processes()
    greedy(llm, [[1, 2, 3]], max_tokens=2)
    del llm
    gc.collect()
    rank.join(timeout=10)
    assert not rank.is_alive()


def test_a_model_the_ranks_cannot_split_is_refused(tmp_path, model_path):
    hf = random_hf_model("llama", seed=1, vocab_size=512, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
                         max_position_embeddings=128)
    folder = save_hf_model(hf, tmp_path / "three_heads")
    with pytest.raises(ValueError, match="3"):
        LLM(folder, tokenizer=model_path("stories260K_hf"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(folder, tokenizer=model_path("stories260K_hf"), tensor_parallel_size=0)


TORCHRUN_SCRIPT = """
import json, os, sys
from fastllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=128)
# Only rank 0 gets here: the other rank serves it inside LLM(...), then exits.
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print("tokens", json.dumps([o.outputs[0].token_ids for o in out]), os.environ["RANK"])
llm.shutdown()
"""


def test_torchrun_starts_the_ranks(model_path, tmp_path):
    """Under torchrun (its RANK, WORLD_SIZE, MASTER_ADDR ... set, as across nodes) every rank
    runs the script: rank 0 generates, the other serves it and exits with it."""
    folder = model_path("stories260K_hf")
    batch = prompts(512)[:3]
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    port = free_port()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                          str(script), str(folder), json.dumps(batch)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line.split(" ", 1)[1] for line in run.stdout.splitlines()
               if line.startswith("tokens ")]
    assert len(printed) == 1 and printed[0].endswith(" 0")
    expected = greedy(LLM(folder, max_model_len=128), batch, max_tokens=8)
    assert json.loads(printed[0].rsplit(" ", 1)[0]) == expected


# A user's script as written: no main guard, ranks started where the module's code runs.
PLAIN_SCRIPT = """\
import sys
from fastllm import LLM, SamplingParams

llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=128)
out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)
print("tokens", out[0].outputs[0].token_ids)
"""


def run_script(script, folder, **env):
    return subprocess.run([sys.executable, str(script), str(folder)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_a_script_without_a_main_guard_runs(model_path, tmp_path):
    """Ranks are forked (no CUDA context here), so the script is not run again in them."""
    folder = model_path("stories260K_hf")
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    run = run_script(script, folder)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = greedy(LLM(folder, max_model_len=128), ["Once upon a time"], max_tokens=8)
    assert run.stdout.splitlines()[-1] == f"tokens {expected[0]}"


def test_spawned_ranks_ask_for_a_main_guard_at_once(model_path, tmp_path):
    """Where ranks must be spawned, which runs the script again in each, an unguarded script is
    refused before any rank starts, naming the line; guarded, it runs."""
    folder = model_path("stories260K_hf")
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    run = run_script(script, folder, FASTLLM_WORKER_MULTIPROC_METHOD="spawn")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        f"RuntimeError: tensor_parallel_size=2 starts its ranks with spawn here "
        f"(FASTLLM_WORKER_MULTIPROC_METHOD=spawn), which runs {script} again in each rank, and "
        'line 4 would start ranks again: put the code that makes the LLM under `if __name__ == '
        '"__main__":`')
    body = PLAIN_SCRIPT.split("\n\n", 1)[1]
    guarded = tmp_path / "guarded.py"
    guarded.write_text(PLAIN_SCRIPT.split("\n\n", 1)[0] + "\n\n\ndef main():\n"
                       + "".join(f"    {line}\n" for line in body.splitlines())
                       + '\n\nif __name__ == "__main__":\n    main()\n')
    run = run_script(guarded, folder, FASTLLM_WORKER_MULTIPROC_METHOD="spawn")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = greedy(LLM(folder, max_model_len=128), ["Once upon a time"], max_tokens=8)
    assert run.stdout.splitlines()[-1] == f"tokens {expected[0]}"
