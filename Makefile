# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint typecheck unit bench clean

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

# pytest exits 5 when it collects nothing; that is a broken suite here, so say so and fail.
unit: $(VENV)/.all
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

test: lint typecheck unit

bench: $(VENV)/.all
	$(PY) benchmarks/index_ops.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
