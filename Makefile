# Two commands do all set-up on a fresh machine:
#   make train   trains the default model on the embedded Gutenberg corpus (creates .venv when missing)
#   make test    runs ruff (lint and format check), then the test suite (the same command CI runs)
# Pass Hydra overrides with ARGS='...', pytest options with PYTEST_ARGS='...'.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first, at a version the project was tested with (pyproject.toml states the range):
# - Linux with an NVIDIA GPU (nvidia-smi present): TORCH_GPU from PyPI (its CUDA build), as on the GPU image;
# - Linux without one: TORCH_CPU from PyTorch's CPU wheel index TORCH_INDEX (no CUDA wheels pulled), or from
#   PyPI when that index cannot be reached (set TORCH_INDEX= to skip it);
# - macOS: TORCH_CPU from PyPI (there triton is not installed: nats runs on the PyTorch references).
TORCH_GPU ?= torch==2.11.0
TORCH_CPU ?= torch==2.13.0
ifeq ($(shell uname -s),Linux)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
else
TORCH_INDEX ?=
endif
STAMP := $(VENV)/.installed
# whether the CPU index answers: one quiet request (5 s), so that pip never tries an unreachable index (which
# prints a "Retrying ... Failed to establish a new connection" warning for every package)
export TORCH_INDEX_PROBE := import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)
export PROJECT_ROOT := $(CURDIR)

.PHONY: setup train test test-all lint prepare clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then \
	    echo "set-up: installing $(TORCH_GPU) (CUDA build) into $(VENV) ..."; $(BIN)/pip install -q "$(TORCH_GPU)"; \
	  elif [ -n "$(TORCH_INDEX)" ] && $(BIN)/python -c "$$TORCH_INDEX_PROBE" "$(TORCH_INDEX)" 2>/dev/null; then \
	    echo "set-up: installing $(TORCH_CPU) (CPU build) into $(VENV) ..."; \
	    $(BIN)/pip install -q "$(TORCH_CPU)" --index-url "$(TORCH_INDEX)"; \
	  else \
	    echo "set-up: installing $(TORCH_CPU) into $(VENV) ($(if $(TORCH_INDEX),$(TORCH_INDEX) does not answer: from the default index,from the default index)) ..."; \
	    $(BIN)/pip install -q "$(TORCH_CPU)"; \
	  fi; \
	fi
	@# the distribution was called `nats` before it became `nats-attention`: drop that editable install
	@$(BIN)/pip uninstall -q -y nats 2>/dev/null || true
	@echo "set-up: installing nats-attention (editable) and its dependencies into $(VENV) ..."
	@$(BIN)/pip install -q -e ".[dev]"
	@# kvpress for NAtS' press (nats.kvpress, tests/test_kvpress_press.py) without its dependencies: kvpress 0.5.5 pins
	@# transformers < 5.3, the press runs on the 5.24 the dev extra resolves (what kvpress imports is in the dev extra)
	@$(BIN)/pip install -q --no-deps "kvpress==0.5.5"
	@touch $(STAMP)
	@echo "set-up done: $(VENV) with torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"

prepare: setup
	$(BIN)/nats-prepare $(ARGS)

train: setup
	$(BIN)/nats-train $(ARGS)

# the suite spread over the machine's cores (pytest-xdist; PYTEST_WORKERS=0 runs it in one process); tests that share
# a session resource (the local SLURM cluster) stay in one worker (--dist loadgroup, tests/conftest.py)
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

test: setup lint
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# ruff's lint (rules in pyproject.toml [tool.ruff]); `make test` runs it first, as CI does
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the slow tests too (still no GPU tests unless a GPU is present)
test-all: setup lint
	$(BIN)/python -m pytest -q --runslow $(PYTEST_PARALLEL) $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
