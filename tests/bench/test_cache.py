"""The benchmarks' cache of made files and folders (fastllm.bench.cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastllm.bench.cache import cached


def test_a_folder_is_made_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    made = []

    def make(dest: Path) -> None:
        made.append(dest)
        dest.mkdir()
        (dest / "weights").write_text("x")

    path = tmp_path / "model"
    assert cached(path, make, "lora") == path
    assert cached(path, make, "lora") == path
    assert made == [tmp_path / "model.partial"] and (path / "weights").is_file()
    assert capsys.readouterr().out.startswith(f"lora: made {path} in ")


def test_a_failed_make_leaves_nothing(tmp_path: Path) -> None:
    def make(dest: Path) -> None:
        dest.write_bytes(b"half a file")
        raise RuntimeError("interrupted")

    path = tmp_path / "model.gguf"
    with pytest.raises(RuntimeError, match="interrupted"):
        cached(path, make, "gguf")
    assert list(tmp_path.iterdir()) == []
