# Two commands on a fresh machine: `make train` (default recipe) and `make test`.
# Both create .venv, install torch + the package, and install Fashion-MNIST where apt exists;
# `make test` adds the dev extra (pytest, timm, DALI, ONNX, the metric sinks' clients), which the
# default run does not need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.vitrain-installed
DEV_STAMP := $(VENV)/.vitrain-dev-installed
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
FMNIST_DIR := /usr/share/datasets/fashion-mnist
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: train test install install-dev data lint gpu-check

train: install data
	$(BIN)/vitrain train

test: install-dev data
	$(BIN)/python -m pytest

# On a CUDA machine: vitrain doctor, pytest -m gpu and the benchmark set into records/gpu-check-<date>-<gpu>/
# (docs/gpu-check.md); under 10 minutes on one H100.
gpu-check: install-dev
	$(BIN)/python experiments/gpu_check.py

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# Fashion-MNIST comes from Debian's dataset-fashion-mnist package; elsewhere, see docs/data.md.
data:
	@if [ -f $(FMNIST_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q dataset-fashion-mnist; \
	else echo "apt-get not found: install Fashion-MNIST by hand (docs/data.md); its tests will be skipped"; fi

lint: install-dev
	$(BIN)/ruff check src tests
