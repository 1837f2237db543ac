"""Benchmark output: the machine it ran on, JSON results, markdown tables."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

import fastllm

__all__ = ["build_document", "format_cell", "machine_info", "machine_summary",
           "markdown_report", "markdown_table", "process_command", "publish", "rows_where",
           "write_json"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | str) -> dict[str, object]:
    """What the numbers depend on: CPU, threads, torch and fastllm builds, accelerator (its
    name, compute capability, memory and CUDA version)."""
    device = torch.device(device)
    info: dict[str, object] = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "fastllm": fastllm.__version__,
        "fastllm_cpu_capability": fastllm._C.cpu_capability,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info["device_name"] = properties.name
        info["cuda_capability"] = f"{properties.major}.{properties.minor}"
        info["device_memory_gib"] = properties.total_memory / 2**30
        info["cuda"] = torch.version.cuda
    return info


def machine_summary(machine: Mapping[str, object]) -> str:
    """One line about the machine of :func:`machine_info`: CPU, threads, builds, device."""
    about = (f"{machine['cpu']}, {machine['torch_threads']} torch threads, "
             f"torch {machine['torch']}, fastllm {machine['fastllm']} "
             f"({machine['fastllm_cpu_capability']}), device {machine['device']}")
    if "device_name" in machine:
        about += f" ({machine['device_name']})"
    return about


def process_command() -> str:
    """The command line of this process, as a shell would take it (``python
    benchmarks/run_all.py --out results``)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def build_document(*, benchmark: str, device: torch.device | str, config: object,
                   rows: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """``{"benchmark", "date", "command", "machine", "config", "rows"}``: the date (UTC, ISO
    8601) and the command line of the process that measured it; a dataclass config is stored
    as its fields."""
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return {"benchmark": benchmark,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": process_command(), "machine": machine_info(device), "config": config,
            "rows": list(rows)}


def rows_where(document: Mapping[str, object], **match: object) -> list[Mapping[str, object]]:
    """The document's rows whose keys hold the given values."""
    return [row for row in document["rows"]
            if all(row.get(key) == value for key, value in match.items())]


def write_json(path: Path, document: Mapping[str, object]) -> None:
    """Writes ``document`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def markdown_report(document: Mapping[str, object], tables: Mapping[str, str]) -> str:
    """A markdown page: the benchmark's name, one line about the machine, then each table
    under its title."""
    sections = [f"# {document['benchmark']}", machine_summary(document["machine"])]
    sections += [f"## {title}\n\n{table}" for title, table in tables.items()]
    return "\n\n".join(sections) + "\n"


def publish(*, benchmark: str, device: torch.device | str, config: object,
            rows: Sequence[Mapping[str, object]], tables: Mapping[str, str],
            out: Path) -> dict[str, object]:
    """Writes ``<out>/<benchmark>.json`` and ``<out>/<benchmark>.md`` and prints the markdown;
    returns the JSON document."""
    document = build_document(benchmark=benchmark, device=device, config=config, rows=rows)
    write_json(out / f"{benchmark}.json", document)
    markdown = markdown_report(document, tables)
    (out / f"{benchmark}.md").write_text(markdown)
    print(markdown)
    return document


def format_cell(value: object) -> str:
    """A table cell: numbers to three significant digits without exponents where they fit
    (``0.0123``, ``4.56``, ``1234``), None as ``n/a``, anything else as ``str``."""
    if value is None:
        return "n/a"
    if not isinstance(value, float):  # ints, strings, bools
        return str(value)
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude < -3 or magnitude >= 6:
        return f"{value:.2e}"
    return f"{value:.{max(0, 2 - magnitude)}f}"


def _is_numeric_column(values: Sequence[object]) -> bool:
    present = [value for value in values if value is not None]
    return bool(present) and all(
        isinstance(value, (int, float)) and not isinstance(value, bool) for value in present
    )


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Mapping[str, str]) -> str:
    """A GitHub markdown table: one line per row, ``columns`` maps row key -> header.

    Numbers are right-aligned and formatted by :func:`format_cell`; a key a row lacks is ``n/a``.
    """
    headers = list(columns.values())
    numeric = [_is_numeric_column([row.get(key) for row in rows]) for key in columns]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if is_number else "---" for is_number in numeric) + "|",
    ]
    lines += ["| " + " | ".join(format_cell(row.get(key)) for key in columns) + " |"
              for row in rows]
    return "\n".join(lines)
