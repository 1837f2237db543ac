"""The ``fastllm`` command line: ``fastllm generate`` streams what ``LLM.generate`` returns."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from tiny_hf import random_hf_model, save_hf_model

from fastllm import LLM, SamplingParams
from fastllm.entrypoints.cli import main
from fastllm.models.quantized import QuantizedLinear

PROMPT = "Once upon a time"


def test_generate_streams_the_completion(model_path, capsys):
    folder = model_path("stories260K_hf")
    main(["generate", "--model", str(folder), "--prompt", PROMPT, "--temperature", "0",
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


def test_chat_goes_through_the_template(model_path, tmp_path, capsys):
    hf = random_hf_model("qwen3", seed=1, vocab_size=151936, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=True)
    folder = save_hf_model(hf, tmp_path)
    for file in model_path("qwen3_tokenizer").iterdir():
        shutil.copy(file, folder)
    main(["generate", "--model", str(folder), "--prompt", "Hi", "--chat", "--temperature", "0",
          "--max-tokens", "5"])
    llm = LLM(folder)
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
    assert "--model" in capsys.readouterr().err


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
