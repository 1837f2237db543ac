"""The charts and the summary of a results folder, on a recorded one: tiny real runs of every
benchmark (tests/data/bench_results_tiny, its README says how they were made)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from fastllm.bench import summary

RECORDED = Path(__file__).resolve().parents[1] / "data" / "bench_results_tiny"


@pytest.fixture(scope="module")
def charts() -> ModuleType:
    """fastllm.bench.charts, imported by the first test that asks for it: it imports
    matplotlib."""
    from fastllm.bench import charts

    return charts


def test_the_recorded_folder_holds_every_charted_benchmark(charts: ModuleType) -> None:
    assert sorted(path.stem for path in RECORDED.glob("*.json")) == sorted(charts.CHARTS)
    assert set(summary.HEADLINES) == set(charts.CHARTS)


def test_every_chart_is_written_and_not_empty(charts: ModuleType, tmp_path: Path) -> None:
    written = charts.main([str(RECORDED), "--out", str(tmp_path)])
    assert sorted(path.name for path in written) == sorted(f"{name}.png" for name in charts.CHARTS)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, path.name


def test_a_chart_names_the_machine_date_and_command(charts: ModuleType) -> None:
    document = json.loads((RECORDED / "serve.json").read_text())
    footer = charts.chart_footer(document)
    assert document["machine"]["cpu"] in footer and "torch threads" in footer
    assert document["date"] in footer and document["command"] in footer


def test_only_a_missing_benchmark_of_the_run_is_named(charts: ModuleType, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    shutil.copy(RECORDED / "mask_cache.json", tmp_path)
    written = charts.write_charts(tmp_path, expected=["mask_cache", "serve"])
    assert [path.name for path in written] == ["mask_cache.png"]
    assert capsys.readouterr().out == (f"charts: no serve chart, {tmp_path / 'serve.json'} is "
                                       "missing\n")


def test_summary_has_each_benchmarks_headline(charts: ModuleType,
                                              capsys: pytest.CaptureFixture) -> None:
    summary.main([str(RECORDED)])
    table = capsys.readouterr().out
    for name in charts.CHARTS:
        assert f"\n| {name} | n/a |" in table  # no run record: no times
    assert "| output tok/s vs llama.cpp, concurrency 1 |" in table
    assert ("| fastllm serve -dp 2 over fastllm serve -dp 2, no prefix affinity, shared "
            "prefixes | output tok/s ") in table
    assert "mask's share of a naive forward, L=" in table


def test_results_page(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RECORDED, results)
    (results / "serve.md").write_text("# serve\n\nmachine\n\n## Levels\n\n| a |\n")
    summary.RunRecord(command="python benchmarks/run_all.py --out results",
                      date="2030-01-01T00:00:00+00:00", benchmark_set="default", device="cpu",
                      benchmarks=[summary.BenchmarkRun("serve", ["--requests", "2"], "tiny",
                                                       65.0, False)],
                      wall_s=70.0).write(results)
    page = tmp_path / "RESULTS.md"
    summary.main([str(results), "--results-md", str(page)])
    text = page.read_text()
    assert "- Command: `python benchmarks/run_all.py --out results` (default set" in text
    assert "- Date: 2030-01-01T00:00:00+00:00" in text and "- Wall time: 1 min 10 s" in text
    assert "| serve | 1 min 05 s | output tok/s vs llama.cpp, concurrency 1 |" in text
    assert "| serve | tiny | `--requests 2` |" in text
    assert "\n## serve\n" in text and "\n### Levels\n" in text
