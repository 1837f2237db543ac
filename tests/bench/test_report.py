"""Markdown tables and cells of the benchmark reports."""

from __future__ import annotations

from fastllm.bench.report import format_cell, markdown_table


def test_format_cell() -> None:
    assert format_cell(0.012345) == "0.0123"
    assert format_cell(4.5678) == "4.57"
    assert format_cell(1234.5) == "1234"
    assert format_cell(0.0) == "0"
    assert format_cell(1.5e-5) == "1.50e-05"
    assert format_cell(12) == "12"
    assert format_cell(None) == "n/a"
    assert format_cell("fused") == "fused"


def test_markdown_table() -> None:
    rows = [{"len": 8, "method": "sdpa", "ms": 0.5}, {"len": 512, "method": "fastllm"}]
    table = markdown_table(rows, {"len": "L", "method": "method", "ms": "median (ms)"})
    assert table.splitlines() == [
        "| L | method | median (ms) |",
        "|---:|---|---:|",
        "| 8 | sdpa | 0.500 |",
        "| 512 | fastllm | n/a |",
    ]
