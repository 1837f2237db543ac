"""Every notebook runs end to end on a tiny benchmark result, so none of them rots."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def tiny_mask_cache_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mask_cache.json`` from the real benchmark at tiny sizes."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_mask_cache
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    out = tmp_path_factory.mktemp("bench")
    bench_mask_cache.main(["--out", str(out), "--lengths", "1", "8", "32", "--repeats", "1",
                           "--warmup", "0"])
    return out / "mask_cache.json"


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, "no notebook found in notebooks/"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs(notebook: Path, tiny_mask_cache_json: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLLM_BENCH_JSON", str(tiny_mask_cache_json))
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
