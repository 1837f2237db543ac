"""Every code block of README.md runs as a user runs it: a Python block saved as a file and run
with ``python file.py`` in a fresh process, a shell block with bash (a ``fastllm serve`` block
keeps its server up for the blocks after it in its section, a ``fastllm chat`` block gets two
lines typed in), a YAML block (a Kubernetes manifest: no cluster here) parsed. The hub names
README uses are served by a :class:`hub_server.LocalHub` (``HF_ENDPOINT``) with small
stand-ins: tiny random-weight Qwen3 models over the real Qwen3 tokenizer, and a Q8_0 rewrite of
the real SmolLM2-135M-Instruct GGUF, which must answer Paris.
The set-up commands (``make``, ``pip install``) are what ``make test`` itself runs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import free_port, http, kept
from hub_server import LocalHub
from lora.peft_models import save_adapter
from tiny_hf import tiny_qwen3_folder
from transformers import AutoModelForCausalLM

from fastllm.bench import gguf_files
from fastllm.bench.gguf_files import file_sha256, rewrite_gguf

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int
    section: str  # the ## heading it is under

    @property
    def name(self) -> str:
        return f"line {self.line}: {self.code.splitlines()[0][:50]}"


def read_blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    blocks, section = [], ""
    fence = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
    position = 0
    for match in fence.finditer(text):
        for heading in re.findall(r"^## (.+)$", text[position:match.start()], re.MULTILINE):
            section = heading
        position = match.start()
        blocks.append(Block(match.group(1), match.group(2),
                            text.count("\n", 0, match.start()) + 1, section))
    return blocks


BLOCKS = read_blocks()
# Blocks this test does not run, by their first line, and what runs them.
SET_UP = {"make bench": "the main job; its benchmarks' code is tested in tests/bench",
          "pip install torch": "the Makefile's set-up runs these installs for make test"}
# What a block must print, by a piece of its code.
EXPECTED_OUTPUT = {"SmolLM2-135M-Instruct-GGUF": "Paris"}


def is_set_up(block: Block) -> bool:
    return any(block.code.startswith(command) for command in SET_UP)


def starts_server(block: Block) -> bool:
    return block.language == "sh" and block.code.startswith("fastllm serve")


def server_clients(block: Block) -> list[Block]:
    """The blocks after a ``fastllm serve`` block in its section that name its port: they talk
    to its server."""
    port = str(_port(block.code))
    return [b for b in BLOCKS[BLOCKS.index(block) + 1:]
            if b.section == block.section and b.language != "yaml" and port in b.code]


def _port(code: str) -> int:
    match = re.search(r"--port (\d+)", code)
    return int(match.group(1)) if match else 8000


CLIENTS = {b.line for s in BLOCKS if starts_server(s) for b in server_clients(s)}
RUN_ALONE = [b for b in BLOCKS if b.language != "yaml" and not is_set_up(b)
             and not starts_server(b) and b.line not in CLIENTS]


def test_readme_is_for_users():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 600
    assert "## Install" in lines[:80]
    assert any("LLM(" in line for line in lines[:120])
    assert text.startswith("# fastllm\n")
    blocks = text.split("```")
    assert blocks[1].startswith("sh\nmake bench") and "make test" in blocks[1]
    for block in BLOCKS:
        assert block.language in ("python", "sh", "yaml"), block.name


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "yaml"],
                         ids=lambda block: block.name)
def test_yaml_blocks_are_kubernetes_objects(block):
    """A YAML block is a manifest for a cluster, which no test here has: it must parse, and
    each document name its API version, kind and object."""
    for document in yaml.safe_load_all(block.code):
        assert {"apiVersion", "kind", "metadata"} <= document.keys(), block.name
        assert document["metadata"]["name"], block.name


def test_the_set_up_commands_are_the_makefiles():
    """The install line README gives is the one the Makefile builds with."""
    install = next(b for b in BLOCKS if b.code.startswith("pip install torch"))
    assert "pip install --no-build-isolation ." in install.code
    assert "--no-build-isolation" in (ROOT / "Makefile").read_text()


def smollm2_q8_0(smollm2: Path) -> Path:
    """The Q8_0 rewrite of ``smollm2`` (seconds to make), kept under ``build/test-cache`` keyed
    by the source file and the rewriting code."""
    return kept("SmolLM2-135M-Instruct-Q8_0.gguf",
                lambda partial: rewrite_gguf(smollm2, partial, "Q8_0"),
                [file_sha256(smollm2), version("gguf"), Path(gguf_files.__file__).read_text()])


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory, model_path, smollm2_path):
    """The environment the blocks run in: ``HF_ENDPOINT`` pointed at a LocalHub holding the
    stand-ins, an empty hub cache, the venv's ``fastllm`` command on the PATH."""
    folder = tmp_path_factory.mktemp("readme-hub")
    tokenizer = model_path("qwen3_tokenizer")
    stand_ins = {"Qwen/Qwen3-0.6B": 0, "Qwen/Qwen3-8B": 1, "Qwen/Qwen3-Reranker-0.6B": 2,
                 "Qwen/Qwen3-Embedding-0.6B": 3}
    with LocalHub() as hub:
        for repo, seed in stand_ins.items():
            model = tiny_qwen3_folder(folder / repo.replace("/", "--"), tokenizer, seed,
                                      max_position_embeddings=40960)  # Qwen3's context
            hub.add(repo, {p.name: p for p in model.iterdir()})
        # The LoRA adapter README names, a random one of the Qwen3-0.6B stand-in's shape.
        adapter = save_adapter(AutoModelForCausalLM.from_pretrained(folder / "Qwen--Qwen3-0.6B"),
                               folder / "adapter", seed=0, r=16, lora_alpha=32,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        hub.add("Nishef/Qwen3-0.6B-Full_KTO_20251225_102050",
                {p.name: p for p in adapter.iterdir() if p.is_file()})
        hub.add("bartowski/SmolLM2-135M-Instruct-GGUF",
                {"SmolLM2-135M-Instruct-Q8_0.gguf": smollm2_q8_0(smollm2_path),
                 "README.md": b"# SmolLM2"})
        # The blocks run in another folder: a PYTHONPATH of this checkout's sources as given.
        python_path = os.pathsep.join(str(Path(p).resolve()) for p in
                                      os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
        yield hub.environ(folder / "cache", PYTHONPATH=python_path,
                          PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def run_block(block: Block, env: dict[str, str], folder: Path, *, stdin: str | None = None,
              ports: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    """Runs ``block`` as a file; ``ports``: (the README's port, a free one to use instead)."""
    code = block.code if ports is None else block.code.replace(*map(str, ports))
    suffix = ".py" if block.language == "python" else ".sh"
    script = folder / f"readme_line_{block.line}{suffix}"
    script.write_text(code)
    command = [sys.executable, script.name] if block.language == "python" else \
        ["bash", "-e", script.name]
    return subprocess.run(command, cwd=folder, env=env, input=stdin, capture_output=True,
                          text=True, timeout=600)


def check(block: Block, run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, f"{block.name}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    for piece, output in EXPECTED_OUTPUT.items():
        if piece in block.code:
            assert output in run.stdout, run.stdout


@pytest.mark.parametrize("block", RUN_ALONE, ids=lambda block: block.name)
def test_block_runs_as_a_file(block, hub_env, tmp_path):
    stdin = "What is 2 + 2?\n/exit\n" if block.code.startswith("fastllm chat") else None
    run = run_block(block, hub_env, tmp_path, stdin=stdin)
    check(block, run)
    if stdin is not None:  # a reply, then the prompt that read /exit
        assert run.stdout.startswith("fastllm chat:") and run.stdout.endswith(">>> "), \
            run.stdout


@pytest.mark.parametrize("block", [b for b in BLOCKS if starts_server(b)],
                         ids=lambda block: block.name)
def test_server_blocks_run(block, hub_env, tmp_path):
    """The server block, then each block after it that talks to it, against it."""
    port = free_port()
    script = tmp_path / "serve.sh"
    script.write_text(block.code.replace(str(_port(block.code)), str(port)))
    # A session of its own: the server is bash's child, and stopping goes to both.
    server = subprocess.Popen(["bash", "-e", script.name], cwd=tmp_path, env=hub_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        clients = server_clients(block)
        assert clients, "a server block is followed by blocks that use it"
        for client in clients:
            check(client, run_block(client, hub_env, tmp_path, ports=(_port(block.code), port)))
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited on its own
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
