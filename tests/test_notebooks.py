"""Every notebook runs end to end on a tiny benchmark result, so none of them rots."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import find_model
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def run_benchmark(name: str, out: Path, args: list[str]) -> Path:
    """Runs ``benchmarks/bench_{name}.py`` with ``args`` into ``out``; returns its JSON path."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        module = importlib.import_module(f"bench_{name}")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    module.main(["--out", str(out), *args])
    return out / f"{name}.json"


@pytest.fixture(scope="module")
def tiny_mask_cache_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mask_cache.json`` from the real benchmark at tiny sizes."""
    return run_benchmark("mask_cache", tmp_path_factory.mktemp("bench"),
                         ["--lengths", "1", "8", "32", "--repeats", "1", "--warmup", "0"])


@pytest.fixture(scope="module")
def tiny_engine_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``engine.json`` from the real benchmark at tiny sizes."""
    return run_benchmark("engine", tmp_path_factory.mktemp("bench"), [
        "--models-dir", str(find_model("qwen3_tokenizer").parent),
        "--dtypes", "float32", "--layers", "1", "--hidden-size", "64", "--intermediate-size",
        "192", "--num-requests", "4", "--min-prompt-len", "4", "--max-prompt-len", "16",
        "--output-tokens", "3", "--hf-batch-size", "2", "--prefix-len", "16", "--suffix-len",
        "4", "--prefix-requests", "2", "--prefix-rounds", "1", "--repeats", "1", "--warmup", "0",
        "--mixed-requests", "5", "--mixed-min-prompt-len", "10", "--mixed-max-prompt-len", "40",
        "--mixed-output-tokens", "3", "--mixed-layers", "1"])


@pytest.fixture(scope="module")
def tiny_rerank_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rerank.json`` from the real benchmark at tiny sizes."""
    return run_benchmark("rerank", tmp_path_factory.mktemp("bench"), [
        "--models-dir", str(find_model("qwen3_tokenizer").parent),
        "--layers", "1", "--hidden-size", "64", "--intermediate-size", "96", "--queries", "2",
        "--top-k", "3", "--repeats", "1", "--warmup", "0"])


@pytest.fixture(scope="module")
def sample_gguf_json() -> Path:
    """A ``gguf.json`` from ``bench_gguf.py --quick``, stored: the benchmark needs llama.cpp,
    which ``make test`` never builds (``tests/bench/test_bench_gguf.py`` checks a fresh run still
    writes the same keys where it is installed)."""
    return REPO / "tests" / "data" / "bench_gguf_quick.json"


# The fixture giving each notebook the JSON it plots.
BENCH_JSON = {"mask_cache.ipynb": "tiny_mask_cache_json", "generation.ipynb": "tiny_engine_json",
              "rerank.ipynb": "tiny_rerank_json", "gguf.ipynb": "sample_gguf_json"}


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, "no notebook found in notebooks/"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs(notebook: Path, request: pytest.FixtureRequest,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    bench_json = request.getfixturevalue(BENCH_JSON[notebook.name])
    monkeypatch.setenv("FASTLLM_BENCH_JSON", str(bench_json))
    # The kernel's own inline backend must render the figures, as it does for a user.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    # No kernel directories: only ipykernel's own spec, which launches this interpreter, so the
    # notebook sees this environment's fastllm whatever python3 kernels are installed elsewhere.
    kernel_manager = KernelManager(kernel_name="python3",
                                   kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = NotebookClient(nb, km=kernel_manager, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    figures = [output for cell in nb.cells if cell.cell_type == "code"
               for output in cell.outputs if "image/png" in output.get("data", {})]
    assert figures, f"{notebook.name} drew no figure"
