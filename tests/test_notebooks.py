"""Every notebook runs end to end on a tiny benchmark result, so none of them rots."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from conftest import find_model
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from tiny_bench import engine_args, rerank_args

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def tiny_mask_cache_json(bench_run) -> Path:
    """``mask_cache.json`` from the real benchmark at tiny sizes."""
    _, out = bench_run("mask_cache", ["--lengths", "1", "8", "32", "--repeats", "1",
                                      "--warmup", "0"])
    return out / "mask_cache.json"


@pytest.fixture(scope="module")
def tiny_engine_json(bench_run) -> Path:
    """``engine.json`` from the real benchmark at tiny sizes: the run
    tests/bench/test_bench_engine.py checks."""
    _, out = bench_run("engine", engine_args(find_model("qwen3_tokenizer").parent))
    return out / "engine.json"


@pytest.fixture(scope="module")
def tiny_rerank_json(bench_run) -> Path:
    """``rerank.json`` from the real benchmark at tiny sizes: the run
    tests/bench/test_bench_rerank.py checks."""
    _, out = bench_run("rerank", rerank_args(find_model("qwen3_tokenizer").parent))
    return out / "rerank.json"


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
