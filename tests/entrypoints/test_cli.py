"""The ``fastllm`` command line: ``fastllm generate`` streams what ``LLM.generate`` returns; MODEL
and its hub options reach the model; bad input is a one-line error with exit status 2; each
``--help`` shows its option groups and defaults. (``fastllm chat``: test_chat.py; ``fastllm
serve``: test_server.py.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hub_server import LocalHub
from tiny_hf import random_hf_model, save_hf_model

from fastllm import LLM, SamplingParams
from fastllm.entrypoints.cli import main
from fastllm.models.quantized import QuantizedLinear

PROMPT = "Once upon a time"


def test_generate_streams_the_completion(model_path, capsys):
    folder = model_path("stories260K_hf")
    main(["generate", str(folder), "--prompt", PROMPT, "--temperature", "0",
          "--max-tokens", "40", "--stop", "park"])
    expected, = LLM(folder).generate(PROMPT, SamplingParams(temperature=0, max_tokens=40,
                                                            stop=["park"]), use_tqdm=False)
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


def test_seeded_sampling_options_reach_the_sampler(model_path, capsys):
    folder = model_path("stories260K_hf")
    main(["generate", "--model", str(folder), "--prompt", PROMPT, "--temperature", "0.8",
          "--top-p", "0.9", "--top-k", "40", "--seed", "5", "--max-tokens", "30"])
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=5, max_tokens=30)
    expected, = LLM(folder).generate(PROMPT, params, use_tqdm=False)
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


def test_quantization_reaches_the_loader(model_path, capsys):
    folder = model_path("stories260K_hf")
    main(["generate", "--model", str(folder), "--prompt", PROMPT, "--temperature", "0",
          "--max-tokens", "20", "--quantization", "int4"])
    llm = LLM(folder, quantization="int4")
    assert isinstance(llm.model.layers[0].self_attn.o_proj, QuantizedLinear)
    expected, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20),
                             use_tqdm=False)
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


def test_chat_goes_through_the_template_of_the_tokenizer_given(model_path, tmp_path, capsys):
    hf = random_hf_model("qwen3", seed=1, vocab_size=151936, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=True)
    folder = save_hf_model(hf, tmp_path)  # weights and config, no tokenizer
    tokenizer = model_path("qwen3_tokenizer")
    main(["generate", str(folder), "--tokenizer", str(tokenizer), "--prompt", "Hi", "--chat",
          "--temperature", "0", "--max-tokens", "5"])
    llm = LLM(folder, tokenizer=tokenizer)
    expected, = llm.chat([{"role": "user", "content": "Hi"}],
                         SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


def test_errors_exit_with_a_message(model_path, capsys):
    folder = str(model_path("stories260K_hf"))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", folder, "--prompt", PROMPT, "--top-p", "2"])
    assert exit_info.value.code == 2
    assert "top_p must be in (0, 1], got 2.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", folder, "--prompt", PROMPT, "--chat"])
    assert "has no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", PROMPT])
    assert "required: MODEL (or --model)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", folder, "--model", folder, "--prompt", PROMPT])
    assert "MODEL given twice" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["generate", "chat", "serve", "rerank"])
def test_hub_options_reach_the_model(model_path, tmp_path, name, capsys):
    """--revision (and, but for rerank, --tokenizer-revision) go to the hub resolution, which
    refuses them for a local folder, naming the value."""
    folder = str(model_path("stories260K_hf"))
    docs = tmp_path / "docs.txt"
    docs.write_text("a document\n")
    rest = {"generate": ["--prompt", PROMPT],
            "rerank": ["--query", "q", "--docs", str(docs)]}.get(name, [])
    with pytest.raises(SystemExit) as exit_info:
        main([name, folder, "--revision", "v2", *rest])
    assert exit_info.value.code == 2
    assert f"fastllm {name}: error: revision='v2' applies to a model on the hub; {folder} is a " \
           "local path" in capsys.readouterr().err
    if name == "rerank":
        with pytest.raises(SystemExit):
            main([name, folder, "--tokenizer-revision", "v2", *rest])
        assert "unrecognized arguments: --tokenizer-revision" in capsys.readouterr().err
    else:
        with pytest.raises(SystemExit):
            main([name, folder, "--tokenizer-revision", "v3", *rest])
        assert "tokenizer_revision='v3' applies to a tokenizer on the hub" in \
            capsys.readouterr().err


def test_a_model_missing_from_the_hub_is_one_line(tmp_path):
    with LocalHub() as hub:
        env = hub.environ(tmp_path / "cache")
        done = subprocess.run([sys.executable, "-m", "fastllm", "serve", "org/missing"],
                              env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "fastllm serve: error: no model at org/missing: not a local path, and " \
           f"{hub.url} has no repo org/missing" in done.stderr
    assert "Traceback" not in done.stderr


def test_kv_cache_dtype_reaches_the_cache(model_path, capsys):
    folder = str(model_path("stories260K_hf"))
    # Refused for a bfloat16 model: the error names the cache dtype the option asked for.
    with pytest.raises(SystemExit):
        main(["generate", "--model", folder, "--prompt", PROMPT, "--dtype", "bfloat16",
              "--kv-cache-dtype", "float16"])
    assert "or torch.float16; got torch.float16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", folder, "--prompt", PROMPT, "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli(model_path):
    result = subprocess.run([sys.executable, "-m", "fastllm", "generate", "--model",
                             str(model_path("stories260K_hf")), "--prompt", PROMPT,
                             "--temperature", "0", "--max-tokens", "8"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(", there was")


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def headings(text: str) -> list[str]:
    return [line[:-1] for line in text.splitlines() if re.fullmatch(r"[a-z]+:", line)]


def test_the_top_level_help_lists_the_subcommands(capsys):
    text = help_text([], capsys)
    assert headings(text) == ["options", "subcommands", "examples"]
    flat = " ".join(text.split())
    for summary in ("chat chat with a model in the terminal",
                    "generate complete a prompt, streamed to the terminal",
                    "serve serve a model over the OpenAI API",
                    "rerank rank documents for a query"):
        assert summary in flat
    assert "fastllm chat Qwen/Qwen3-0.6B" in text


# Per subcommand: its help's headings (vLLM's groups), and options with their help and default
# as the help shows them (whitespace joined, so wrapping does not matter).
HELP = {
    "chat": (["commands", "options", "model", "chat", "sampling", "engine"], [
        "MODEL a model folder (config.json, *.safetensors, tokenizer files), a .gguf file, or a "
        "model on the Hugging Face Hub: org/name (safetensors), org/name:QUANT or "
        "org/name/FILE.gguf",
        "--tokenizer-revision REV the hub tokenizer's branch, tag or commit (default: main)",
        "--dtype {float32,bfloat16,float16} the weights' and activations' dtype "
        "(default: float32)",
        "--system-prompt TEXT a system message that starts every conversation (default: none)",
        "--temperature T 0 = greedy (default: 1.0)",
        "--max-tokens N the most tokens of one reply (default: as many as the context has room "
        "for)",
        "--max-num-seqs N the most sequences in one batch (default: 32)",
        "/clear start a new conversation (the system prompt stays)"]),
    "generate": (["options", "model", "input", "sampling", "engine"], [
        "--prompt TEXT the prompt text",
        "--top-k K keep the k most likely tokens; 0 = all (default: 0)",
        "--max-tokens N the most tokens to generate (default: 256)",
        "--tensor-parallel-size N, -tp N shard the model over this many ranks (one process per "
        "device) (default: 1)"]),
    "serve": (["options", "model", "server", "engine"], [
        "--served-model-name NAME the model name clients send and see (default: MODEL as "
        "given)",
        "--port PORT port to listen on (default: 8000)",
        "--api-key KEY require 'Authorization: Bearer KEY' on /v1 (default: $FASTLLM_API_KEY, "
        "or none)",
        "--max-model-len N the most tokens (prompt and output) of one sequence (default: the "
        "model's context, up to 8192)"]),
    "rerank": (["options", "model", "rerank", "engine"], [
        "--revision REV the hub model's branch, tag or commit (default: main)",
        "--max-length N the most tokens of a wrapped (query, document) pair (default: 8192)",
        "--device DEVICE where the model and KV cache live (default: cpu)"]),
}


@pytest.mark.parametrize("command", HELP)
def test_each_subcommands_help_groups_its_options_with_defaults(command, capsys, monkeypatch):
    monkeypatch.setenv("FASTLLM_API_KEY", "sk-not-to-be-shown")
    text = help_text([command], capsys)
    groups, options = HELP[command]
    assert headings(text) == groups
    flat = " ".join(text.split())
    for option in options:
        assert option in flat
    assert "sk-not-to-be-shown" not in text
    if command == "rerank":  # what Reranker does not take is not offered
        assert "--tokenizer" not in text and "--quantization" not in text
