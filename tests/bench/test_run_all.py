"""run_all passes the output folder and the device to every benchmark, and goes on past a
failing one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_bench import import_benchmark

run_all = import_benchmark("run_all")


def fake_benchmarks(out: Path, calls: list[tuple[str, list[str]]],
                    failing: str | None = None) -> dict[str, Callable[[list[str]], None]]:
    """Stand-ins for every benchmark's ``main``: each notes its arguments and writes its
    markdown report; ``failing`` raises instead."""
    def fake(name: str) -> Callable[[list[str]], None]:
        def main(argv: list[str]) -> None:
            calls.append((name, argv))
            if name == failing:
                raise RuntimeError(f"{name} broke")
            (out / f"{name}.md").write_text(f"# {name}\n")
        return main

    return {name: fake(name) for name in run_all.BENCHMARKS}


@pytest.mark.parametrize("device_args, device", [([], "cpu"), (["--device", "cuda"], "cuda")])
def test_every_benchmark_gets_out_and_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture,
                                             device_args: list[str], device: str) -> None:
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(run_all, "BENCHMARKS", fake_benchmarks(tmp_path, calls))
    run_all.main(["--out", str(tmp_path), *device_args])
    ran = [name for name in run_all.BENCHMARKS
           if device == "cpu" or name not in run_all.CPU_ONLY]
    assert calls == [(name, ["--out", str(tmp_path), "--device", device]) for name in ran]
    printed = capsys.readouterr().out
    assert all(f"# {name}" in printed for name in ran)
    if device != "cpu":
        assert run_all.CPU_ONLY and f"left out on {device}: gguf, serve, spec (CPU only)" in printed


def test_a_failing_benchmark_does_not_stop_the_others(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(run_all, "BENCHMARKS", fake_benchmarks(tmp_path, calls, "kv_cache"))
    with pytest.raises(SystemExit, match="failed: kv_cache"):
        run_all.main(["--out", str(tmp_path), "--benchmarks", "attention", "kv_cache",
                      "sampling"])
    assert [name for name, _ in calls] == ["attention", "kv_cache", "sampling"]
    assert (tmp_path / "sampling.md").exists()
