"""The package's layering, read from its source: no import circle, no import from a lower layer
to a higher one, the engine's block manager driven from the scheduler and the KV cache module
only (a component may drive a cache it builds itself), and ``import fastllm.ops`` loading no
engine, entrypoint, tokenizer or model module."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import fastllm

PACKAGE = Path(fastllm.__file__).resolve().parent
# Lower layers first; a module may import its own layer and those before it.
LAYERS = [{"fastllm", "fastllm._C", "fastllm.ops", "fastllm.gguf_file",
           "fastllm.gc_pause", "fastllm.hub"},
          {"fastllm.kv_cache", "fastllm.sampling", "fastllm.tokenizer"},
          {"fastllm.models", "fastllm.lora"}, {"fastllm.engine"}, {"fastllm.entrypoints"},
          {"fastllm.bench", "fastllm.__main__"}]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    top = ".".join(module.split(".")[:2])
    return next(i for i, group in enumerate(LAYERS) if top in group)


def runtime_nodes(tree: ast.AST):
    """Every node, less those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def imports(path: Path, annotations: bool = False) -> set[str]:
    """fastllm modules imported by the file when it runs (lazy imports count too), and with
    ``annotations`` those imported for type checking too."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if annotations else runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")} | {"fastllm._C", "fastllm"}
    return {name for name in found if name in modules}


SOURCES = {module_name(p): p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
           or p.parent != PACKAGE}


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [(module, imported) for module, path in SOURCES.items()
              for imported in imports(path) if layer(imported) > layer(module)]
    assert not upward


def test_no_import_circle():
    """Not even through imports for type checking: a circle there is two modules that each
    need the other to be read."""
    graph = {module: imports(path, annotations=True) - {module}
             for module, path in SOURCES.items()}
    # A package's __init__ re-exporting its own modules is not a circle through them.
    graph = {module: {i for i in deps if not module.startswith(i + ".")}
             for module, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        if state.get(module) == 1:
            raise AssertionError(f"import circle: {' -> '.join(trail + [module])}")
        if state.get(module) == 2:
            return
        state[module] = 1
        for dep in graph.get(module, ()):
            visit(dep, trail + [module])
        state[module] = 2

    for module in graph:
        visit(module, [])


def own_caches(cls: ast.ClassDef) -> set[str]:
    """The attributes a class sets to a ``PagedKVCache`` it builds itself."""
    return {target.attr for node in ast.walk(cls) if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "PagedKVCache"
            for target in node.targets if isinstance(target, ast.Attribute)
            and getattr(target.value, "id", None) == "self"}


def test_only_the_scheduler_and_the_kv_cache_drive_the_block_manager():
    """The engine's cache is driven by its scheduler alone; a component may drive only the
    block manager of a cache it builds and owns (the draft model's, in speculative decoding),
    and the model runner's step over sequences placed by such an owner marks them computed."""
    owners = {"fastllm.engine.scheduler", "fastllm.kv_cache.paged_cache"}
    placed_steps = {"fastllm.engine.model_runner": "execute_placed_sequences"}
    strays = []
    for module, path in SOURCES.items():
        if module in owners:
            continue
        tree = ast.parse(path.read_text())
        owned = set()  # ids of the nodes inside a class, reaching a cache it built
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                         and n.name == placed_steps.get(module)):
            owned |= {id(node) for node in ast.walk(function)}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            caches = own_caches(cls)
            owned |= {id(node) for node in ast.walk(cls) if isinstance(node, ast.Attribute)
                      and node.attr == "block_manager" and isinstance(node.value, ast.Attribute)
                      and node.value.attr in caches
                      and getattr(node.value.value, "id", None) == "self"}
        strays += [f"{module}:{node.lineno}" for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr == "block_manager"
                   and id(node) not in owned]
    assert not strays, strays


def test_importing_the_ops_loads_no_higher_layer():
    code = ("import sys, fastllm.ops; print(sorted(m for m in sys.modules if m.startswith("
            "('fastllm.engine', 'fastllm.entrypoints', 'fastllm.tokenizer', 'fastllm.models', "
            "'fastllm.sampling', 'fastllm.kv_cache'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]"


def test_importing_fastllm_leaves_torchs_modules_frozen_and_the_collector_on():
    """``import fastllm`` (and a name it imports on first use) freezes what the import made: no
    later collection walks torch's modules, and the collector runs as before."""
    code = ("import gc, fastllm, torch, json; from fastllm import SamplingParams; "
            "tracked = {id(o) for o in gc.get_objects()}; print(json.dumps([gc.isenabled(), "
            "id(torch.nn.Module) in tracked, id(SamplingParams) in tracked, "
            "gc.is_tracked(torch.nn.Module)]))")
    state = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout
    assert json.loads(state) == [True, False, False, True]


def test_the_scheduler_sees_neither_runner_nor_executor():
    """The step contract is the seam: the scheduler, and all it imports, know the step's plain
    input and output, never what runs it."""
    seen, todo = set(), ["fastllm.engine.scheduler"]
    while todo:
        module = todo.pop()
        if module in seen or module not in SOURCES:
            continue
        seen.add(module)
        todo += imports(SOURCES[module])
    runs_steps = {"fastllm.engine.model_runner", "fastllm.engine.worker",
                  "fastllm.engine.executor", "fastllm.engine.engine"}
    assert not seen & runs_steps
    assert "fastllm.engine.scheduler_output" in seen


def request_attributes() -> set[str]:
    """The attributes a Request sets on itself."""
    tree = ast.parse(SOURCES["fastllm.engine.request"].read_text())
    request = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Request")
    return {target.attr for node in ast.walk(request)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute)
            and getattr(target.value, "id", None) == "self"}


def test_only_the_scheduler_writes_requests():
    """Outside the scheduler (and the request's own methods) nothing assigns a request's
    attributes or calls the methods that change its generation: the output processor reads
    requests and makes its own state of them."""
    attributes = request_attributes()
    changing = {"append_token", "finish_prompt", "abort", "fail"}
    writers = []
    for module, path in SOURCES.items():
        if module in ("fastllm.engine.scheduler", "fastllm.engine.request"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                chain = []
                while isinstance(target, ast.Attribute):
                    chain.append(target.attr)
                    target = target.value
                # A request, by its name (a worker's RunnerRequest is named so too, and
                # shares a few attributes: its own).
                if chain and getattr(target, "id", "").endswith("request") \
                        and chain[-1] in attributes:
                    writers.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in changing:
                writers.append(f"{module}:{node.lineno} .{node.func.attr}()")
    assert not writers, writers


def test_the_scheduler_moves_no_kv_tensor():
    """Block ids and chunk entry ids only: every KV move travels in the step for the workers
    (vLLM v1's split), so it runs on every tensor-parallel rank."""
    tree = ast.parse(SOURCES["fastllm.engine.scheduler"].read_text())
    moves = {"copy_blocks", "read_rows", "write_rows", "k_cache", "v_cache", "slots"}
    touched = [f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in moves]
    assert not touched, touched
