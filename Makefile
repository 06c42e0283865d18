# weightsync: `make demo` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-base

.PHONY: venv demo test test-fast lint bench diagram clean

# torch is pinned and installed first: a bare requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,http,dev]'
	touch $@

venv: $(STAMP)

demo: venv
	$(VENV)/bin/weightsync demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest

test-fast: venv
	$(PY) -m pytest -m "not slow and not vllm"

diagram: venv
	$(VENV)/bin/weightsync diagram

bench: venv
	$(PY) benchmarks/core_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
