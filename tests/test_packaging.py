"""pyproject.toml declares what the package imports: every third-party module a fastllm module
imports (at the top or inside a function) comes from a declared dependency, the server's from
the "server" extra, the benchmark charts' from the "bench" extra. ``pip install .`` then gives a working ``fastllm.LLM`` and
``pip install .[server]`` a working ``fastllm serve``, which CI's requirements.txt would hide."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import fastllm

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(fastllm.__file__).resolve().parent
# Modules only `fastllm serve` loads (and the KV-cache events it publishes for routers), the
# Ray Serve deployment, and the benchmarks' charts.
EXTRAS = {"entrypoints/openai/": "server", "engine/kv_events.py": "server",
          "entrypoints/ray_serve.py": "ray", "bench/charts.py": "bench"}


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in requirements}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module the file imports, wherever in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def distributions(module: str, provided_by: dict[str, list[str]]) -> set[str]:
    """The installed distributions that provide a top-level module."""
    return {name.lower().replace("_", "-") for name in provided_by.get(module, [])}


def test_every_imported_module_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    provided_by = importlib.metadata.packages_distributions()
    missing = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        extra = next((name for prefix, name in EXTRAS.items() if relative.startswith(prefix)),
                     None)
        declared = base | (requirement_names(extras[extra]) if extra else set())
        for module in imported_modules(path):
            if module in sys.stdlib_module_names or module == "fastllm":
                continue
            provided = distributions(module, provided_by)
            assert provided, f"{relative} imports {module!r}, which no installed package provides"
            if not provided & declared:
                missing.append(f"{relative}: {module} ({', '.join(sorted(provided))})")
    assert not missing, missing
