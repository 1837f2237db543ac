"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples() -> None:
    assert BLOCKS, "README.md shows no ```python example"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.splitlines()[0][:40])
def test_readme_example_runs(block: str) -> None:
    exec(compile(block, str(README), "exec"), {})
