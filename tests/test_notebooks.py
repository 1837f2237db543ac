"""Every notebook runs end to end on a tiny benchmark result, so none of them rots, and draws the
same kinds of output as its committed copy. The committed copies hold the outputs of a real
``make bench`` run, so that a code host shows their plots without running them; after a run,
save them again with

    PYTHONPATH=python .venv/bin/python tests/test_notebooks.py results
"""

from __future__ import annotations

import argparse
import os
import re
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
# The JSON each notebook plots, as the benchmark names it in a results folder.
RESULTS_FILE = {"mask_cache.ipynb": "mask_cache.json", "generation.ipynb": "engine.json",
                "rerank.ipynb": "rerank.json", "gguf.ipynb": "gguf.json"}
# A few figures as 80-dpi PNGs come to tens of KB; more means data or long text was saved too.
MAX_COMMITTED_BYTES = 300_000


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
    """A ``gguf.json`` from ``bench_gguf.py --quick``, recorded with the other tiny results
    (tests/data/bench_results_tiny): the benchmark needs llama.cpp, which ``make test`` never
    builds."""
    return REPO / "tests" / "data" / "bench_results_tiny" / "gguf.json"


# The fixture giving each notebook the JSON it plots.
BENCH_JSON = {"mask_cache.ipynb": "tiny_mask_cache_json", "generation.ipynb": "tiny_engine_json",
              "rerank.ipynb": "tiny_rerank_json", "gguf.ipynb": "sample_gguf_json"}


def execute(nb: nbformat.NotebookNode, folder: Path, bench_json: Path) -> None:
    """Runs ``nb`` top to bottom in a fresh kernel started in ``folder``, on ``bench_json``,
    as a reader runs it; its outputs replace those it held."""
    env = dict(os.environ, FASTLLM_BENCH_JSON=str(bench_json))
    # The kernel's own inline backend must render the figures, as it does for a user.
    env.pop("MPLBACKEND", None)
    # The kernel runs in ``folder``: a relative PYTHONPATH (PYTHONPATH=python) would import
    # another fastllm there than the one this process runs.
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry)
                                            for entry in env["PYTHONPATH"].split(os.pathsep))
    # No kernel directories: only ipykernel's own spec, which launches this interpreter, so the
    # notebook sees this environment's fastllm whatever python3 kernels are installed elsewhere.
    kernel_manager = KernelManager(kernel_name="python3",
                                   kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    # No timestamps in the cells' metadata, and one output per stream however the kernel cuts
    # it: saving again changes only what the run changed.
    client = NotebookClient(nb, km=kernel_manager, kernel_name="python3", timeout=120,
                            record_timing=False, coalesce_streams=True,
                            resources={"metadata": {"path": str(folder)}})
    client.execute(env=env)


def output_kind(output: nbformat.NotebookNode) -> str:
    """What an output is, not what it holds: ``stream stdout``, ``error``, or a display's type
    and MIME types (``display_data image/png text/plain`` for a figure,
    ``display_data text/markdown text/plain`` for a table)."""
    if output.output_type == "stream":
        return f"stream {output.name}"
    return " ".join([output.output_type, *sorted(output.get("data", {}))])


def output_kinds(nb: nbformat.NotebookNode) -> list[list[str]]:
    """Per code cell, the kind of each of its outputs."""
    return [[output_kind(output) for output in cell.outputs]
            for cell in nb.cells if cell.cell_type == "code"]


def first_stdout(nb: nbformat.NotebookNode) -> str:
    """What the first code cell printed."""
    cell = next(cell for cell in nb.cells if cell.cell_type == "code")
    return "".join(output.text for output in cell.outputs
                   if output.output_type == "stream" and output.name == "stdout")


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, "no notebook found in notebooks/"
    assert sorted(path.name for path in NOTEBOOKS) == sorted(RESULTS_FILE) == sorted(BENCH_JSON)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_and_draws_what_its_committed_copy_shows(
        notebook: Path, request: pytest.FixtureRequest) -> None:
    bench_json = request.getfixturevalue(BENCH_JSON[notebook.name])
    committed = nbformat.read(notebook, as_version=4)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    execute(nb, notebook.parent, bench_json)
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    nb.cells.pop()
    figures = [output for cell in nb.cells if cell.cell_type == "code"
               for output in cell.outputs if "image/png" in output.get("data", {})]
    assert figures, f"{notebook.name} drew no figure"
    assert first_stdout(nb).startswith(f"{bench_json}: written ")
    assert output_kinds(nb) == output_kinds(committed), (
        f"{notebook.name} no longer draws what its committed copy shows: save it again from a "
        "`make bench` run (this file's docstring says how)")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_notebook_shows_a_real_runs_plots(notebook: Path) -> None:
    assert notebook.stat().st_size <= MAX_COMMITTED_BYTES, (
        f"{notebook.name} is {notebook.stat().st_size} bytes")
    nb = nbformat.read(notebook, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    # Executed top to bottom in one fresh kernel, without an error.
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    kinds = [kind for cell in output_kinds(nb) for kind in cell]
    assert "display_data image/png text/plain" in kinds
    assert not [kind for kind in kinds if kind.startswith("error") or "stderr" in kind], kinds
    # It names the run: the results file of a `make bench` folder, its date and its command.
    file = re.escape(RESULTS_FILE[notebook.name])
    assert re.match(rf"\S*{file}: written \d{{4}}-\d\d-\d\dT\S+ by `.+`\n", first_stdout(nb)), (
        first_stdout(nb))
    assert all("execution" not in cell.metadata for cell in code)


def save_with_outputs(notebook: Path, results: Path) -> None:
    """Runs ``notebook`` on its JSON in ``results`` and saves it with the outputs."""
    bench_json = results / RESULTS_FILE[notebook.name]
    if not bench_json.is_file():
        raise SystemExit(f"{bench_json} does not exist: run `make bench` first")
    nb = nbformat.read(notebook, as_version=4)
    # Relative to the notebook, as it reads its default: the saved output names no local folder.
    execute(nb, notebook.parent, Path(os.path.relpath(bench_json.resolve(), notebook.parent)))
    # The kernel's language_info (its versions) would change the file from machine to machine.
    nb.metadata = nbformat.read(notebook, as_version=4).metadata
    nbformat.write(nb, notebook)


def main(argv: list[str] | None = None) -> None:
    """Saves the notebooks with the outputs of a results folder, printing each one's size."""
    parser = argparse.ArgumentParser(
        description="Saves notebooks/*.ipynb with their outputs, run on a results folder of "
                    "`make bench` (benchmarks/run_all.py).")
    parser.add_argument("results", type=Path, help="the results folder (make bench: results)")
    parser.add_argument("--notebooks", nargs="+", choices=sorted(RESULTS_FILE),
                        metavar="NAME", help="only these (default: all)")
    args = parser.parse_args(argv)
    for notebook in NOTEBOOKS:
        if args.notebooks is None or notebook.name in args.notebooks:
            save_with_outputs(notebook, args.results)
            print(f"{notebook.relative_to(REPO)}: {notebook.stat().st_size / 1e3:.0f} KB, from "
                  f"{args.results / RESULTS_FILE[notebook.name]}")


if __name__ == "__main__":
    main()
