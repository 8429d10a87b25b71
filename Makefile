# Two commands do all set-up on a fresh machine:
#   make train   trains the default model on the embedded Gutenberg corpus (creates .venv when missing)
#   make test    runs the test suite (the same command CI runs)
# Pass Hydra overrides with ARGS='...', pytest options with PYTEST_ARGS='...'.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Machines without an NVIDIA GPU get the CPU build of torch first, so that no CUDA wheels are pulled.
# Elsewhere set TORCH_INDEX to PyTorch's CPU wheel index if your pip would otherwise fetch CUDA wheels.
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
export PROJECT_ROOT := $(CURDIR)

.PHONY: setup train test test-all prepare clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install torch; \
	  else $(BIN)/pip install "$(TORCH_CPU)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); fi; \
	fi
	$(BIN)/pip install -e ".[dev]"
	@touch $(STAMP)

prepare: setup
	$(BIN)/nats-prepare $(ARGS)

train: setup
	$(BIN)/nats-train $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the slow tests too (still no GPU tests unless a GPU is present)
test-all: setup
	$(BIN)/python -m pytest -q --runslow $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
