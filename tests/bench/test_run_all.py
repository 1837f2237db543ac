"""run_all runs the default set with its presets (every benchmark at its own defaults with
--full or off the CPU), passes the output folder and the device to each, goes on past a failing
one, labels what each prints, and ends with the run's record, results page and summary."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from tiny_bench import import_benchmark

from fastllm.bench.summary import RunRecord


def fake_benchmarks(run_all: ModuleType, out: Path, calls: list[tuple[str, list[str]]],
                    failing: str | None = None) -> dict[str, Callable[[list[str]], None]]:
    """Stand-ins for every benchmark's ``main``: each notes its arguments, prints a line and
    writes its markdown report; ``failing`` raises instead."""
    def fake(name: str) -> Callable[[list[str]], None]:
        def main(argv: list[str]) -> None:
            calls.append((name, argv))
            if name == failing:
                raise RuntimeError(f"{name} broke")
            print(f"{name}: measured")
            (out / f"{name}.md").write_text(f"# {name}\n\n## A table\n")
        return main

    return {name: fake(name) for name in run_all.BENCHMARKS}


def run(run_all: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
        failing: str | None = None) -> list[tuple[str, list[str]]]:
    """``run_all.main(argv)`` on the fake benchmarks into ``tmp_path``; returns their calls."""
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(run_all, "BENCHMARKS", fake_benchmarks(run_all, tmp_path, calls, failing))
    run_all.main(["--out", str(tmp_path), "--results-md", str(tmp_path / "RESULTS.md"), *argv])
    return calls


def test_the_default_set_runs_with_its_presets(run_all: ModuleType, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    calls = run(run_all, tmp_path, monkeypatch, [])
    assert list(run_all.DEFAULT_SET) == ["gguf", "engine", "serve", "spec", "rerank",
                                         "mask_cache"]
    assert calls == [(name, ["--out", str(tmp_path), "--device", "cpu",
                             *run_all.DEFAULT_SET[name].args]) for name in run_all.DEFAULT_SET]
    printed = capsys.readouterr().out
    assert "[3/6 serve] fastllm serve against llama.cpp's server" in printed
    assert "[3/6 serve 0:00] serve: measured" in printed  # its lines, labelled
    assert "[3/6 serve] done in 0 s; the run so far 0 s" in printed
    # The summary: a row per benchmark (no JSON from the stand-ins) and the run's time.
    assert "| gguf | 0 s | no results | gguf.json is missing |" in printed
    assert "| all |" in printed and "default set on cpu" in printed
    record = RunRecord.read(tmp_path)
    assert [entry.name for entry in record.benchmarks] == list(run_all.DEFAULT_SET)
    assert record.benchmark_set == "default" and record.command.endswith(
        " ".join(["--out", str(tmp_path), "--results-md", str(tmp_path / "RESULTS.md")]))
    results = (tmp_path / "RESULTS.md").read_text()
    assert "## Summary" in results and "### A table" in results  # each report, demoted


def test_every_benchmark_presets_are_its_own_options(run_all: ModuleType) -> None:
    """Each preset parses as its benchmark's command line (the CPU-only ones included)."""
    for name, preset in run_all.DEFAULT_SET.items():
        module = import_benchmark(f"bench_{name}")
        module.parse_args(["--out", "results", "--device", "cpu", *preset.args])


@pytest.mark.parametrize("argv, device, full", [(["--full"], "cpu", True),
                                                (["--device", "cuda"], "cuda", True)])
def test_full_and_other_devices_run_every_benchmark_at_its_defaults(
        run_all: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture, argv: list[str], device: str, full: bool) -> None:
    calls = run(run_all, tmp_path, monkeypatch, argv)
    ran = [name for name in run_all.BENCHMARKS
           if device == "cpu" or name not in run_all.CPU_ONLY]
    assert calls == [(name, ["--out", str(tmp_path), "--device", device]) for name in ran]
    printed = capsys.readouterr().out
    if device != "cpu":
        assert f"left out on {device}: gguf, serve, spec (CPU only)" in printed
    assert f"[1/{len(ran)} mask_cache] its own defaults" in printed
    assert RunRecord.read(tmp_path).benchmark_set == "full"


def test_a_failing_benchmark_does_not_stop_the_others(run_all: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="failed: kv_cache"):
        run(run_all, tmp_path, monkeypatch, ["--benchmarks", "attention", "kv_cache", "sampling"],
            failing="kv_cache")
    assert (tmp_path / "sampling.md").exists()
    printed = capsys.readouterr().out
    assert "[2/3 kv_cache] FAILED in 0 s" in printed
    assert "| kv_cache | 0 s | failed | see the run's log |" in printed
    record = json.loads((tmp_path / "run.json").read_text())
    assert [entry["failed"] for entry in record["benchmarks"]] == [False, True, False]


def test_progress_output_labels_lines_and_speaks_up_when_quiet(run_all: ModuleType) -> None:
    stream = io.StringIO()
    output = run_all.ProgressOutput(stream, "2/6 engine", quiet_s=0.05)
    with output.active():
        print("engine: bfloat16 throughput measured")
        time.sleep(0.2)
        print("a line without its end", end="")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[2/6 engine 0:00] engine: bfloat16 throughput measured"
    assert any(line.endswith("... still running") for line in lines[1:-1])
    assert lines[-1].endswith("] a line without its end")
