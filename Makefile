# KVLRelay: translate one Qwen3's KV cache into another's, and measure what it costs and saves.
# `make help` lists the targets. Variables can be set on the command line:
#   make run DEVICE=cuda DIRECTION=s2l
#   make recipe PROFILE=paper-budget DEVICE=cuda RUN=qwen-headwise

DEVICE    ?= auto
DTYPE     ?= bfloat16
PROFILE   ?= pilot
DIRECTION ?= l2s
# Run name: empty means every stage's default, PROFILE-DIRECTION (kvlingo/run/paths.py).
RUN       ?=
TASK      ?= arc
HANDOFF   ?= prompt
LARGE     ?= Qwen/Qwen3-1.7B
SMALL     ?= Qwen/Qwen3-0.6B
# Evaluation data (IFEval, ARC, GSM8K) is prepared under EVAL_ROOT/<name>/.
EVAL_ROOT ?= data
# The offline toy world (make demo): its pair, corpus and evaluation files.
TOY       ?= artifacts/toy
TOY_ARGS  ?=
# Local JSONL sources (offline). Empty: the pinned Hub data sets.
SOURCE        ?=
IFEVAL_SOURCE ?=
TASK_SOURCE   ?=
PREPARE_ARGS ?=
TRAIN_ARGS   ?=
BENCH_ARGS   ?=
SWITCH_ARGS  ?=
IFEVAL_ARGS  ?=
TASK_ARGS    ?=
RECIPE_ARGS  ?=
PERF_ARGS    ?=
# perf: float32 on a CPU (its BF16 kernels are slow for small steps), bfloat16 on a GPU
PERF_DTYPE   ?= auto

VENV  := .venv
PY    := $(VENV)/bin/python
UV    := $(shell command -v uv 2>/dev/null || echo python3 -m uv)
PAIR   = --profile $(PROFILE) --large $(LARGE) --small $(SMALL) --direction $(DIRECTION) --device $(DEVICE) \
	--dtype $(DTYPE) $(if $(RUN),--run $(RUN))
PUNKT := $(VENV)/nltk_data/tokenizers/punkt_tab/english/ortho_context.tab

.DEFAULT_GOAL := help
.PHONY: help venv test test-fast run demo toy toy-train prepare train benchmark switch ifeval ifeval-native task task-native perf recipe summary

help: ## list the targets
	@echo "KVLRelay targets (DEVICE=$(DEVICE) DTYPE=$(DTYPE) PROFILE=$(PROFILE) DIRECTION=$(DIRECTION) RUN=$(or $(RUN),PROFILE-DIRECTION)):"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'

# ---------------------------------------------------------------- environment
# Created or updated from the lock on first use by every target below.
$(VENV)/.synced: pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || \
	  python3 -m pip install --quiet uv || python3 -m pip install --quiet --user --break-system-packages uv
	$(UV) sync --locked --extra ifeval
	@touch $@

venv: $(VENV)/.synced ## create or update .venv from uv.lock

test: $(VENV)/.synced ## run the whole test suite offline on the CPU (tiny local models, no network; what CI runs)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q $(TEST_ARGS)

test-fast: $(VENV)/.synced ## the fast tests only (skips those marked slow)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m "not slow" $(TEST_ARGS)

# nltk's English punkt_tab for IFEval's sentence-count instructions, written offline and verified.
$(PUNKT): $(VENV)/.synced
	$(PY) ifeval.py --install-punkt

# ---------------------------------------------------------------- whole runs
# The pilot as one training cell. IFEval runs even when the benchmark's checks fail; the
# exit status is nonzero at the end if any stage failed.
run: $(VENV)/.synced ## the pilot: prepare → train → benchmark → IFEval (native, then translated)
	$(MAKE) prepare
	$(MAKE) train
	@status=0; \
	$(MAKE) benchmark || status=1; \
	$(MAKE) ifeval-native || status=1; \
	$(MAKE) ifeval || status=1; \
	if [ $$status -ne 0 ]; then echo "make run: a stage failed (see above); its report is still written"; fi; \
	exit $$status

toy: $(VENV)/.synced ## install the offline toy world: packaged toy Qwen3 pair + regenerated, verified corpus → artifacts/toy (seconds)
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) $(TOY_ARGS)

toy-train: $(VENV)/.synced ## retrain the toy pair from scratch (~26 CPU-minutes) and re-package it into kvlingo/toy/pair
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) --train --export kvlingo/toy/pair $(TOY_ARGS)

# Every stage on the toy pair, offline, on the CPU. The demo profile holds every setting (learning
# rate, fit weighting, switch lengths, the recipe's budget; timing CV flags reported, not fatal).
DEMO_VARS = HF_HUB_OFFLINE=1 PROFILE=demo DEVICE=cpu DTYPE=float32 DIRECTION=$(DIRECTION) \
	LARGE=$(TOY)/large SMALL=$(TOY)/small SOURCE=$(TOY)/corpus/chats.jsonl \
	IFEVAL_SOURCE=$(TOY)/corpus/ifeval.jsonl EVAL_ROOT=data/toy-eval
demo: toy ## the whole suite offline on a CPU with the toy pair, ending in a summary table
	@status=0; \
	$(MAKE) run $(DEMO_VARS) || status=1; \
	$(MAKE) switch $(DEMO_VARS) || status=1; \
	for task in arc gsm8k; do for mode in prompt trace; do \
	  $(MAKE) task-native task $(DEMO_VARS) TASK=$$task HANDOFF=$$mode TASK_SOURCE=$(TOY)/corpus/$$task.jsonl \
	    TASK_ARGS="--resume" || status=1; \
	done; done; \
	$(MAKE) recipe $(DEMO_VARS) RUN=demo-$(DIRECTION)-recipe || status=1; \
	$(MAKE) summary $(DEMO_VARS) || status=1; \
	exit $$status

# ---------------------------------------------------------------- stages
prepare: $(VENV)/.synced ## disjoint train/validation/test splits → data/PROFILE (SOURCE=chats.jsonl offline)
	$(PY) paper_data.py --profile $(PROFILE) --tokenizer $(SMALL) $(if $(SOURCE),--source $(SOURCE)) $(PREPARE_ARGS)

train: $(VENV)/.synced ## closed-form fit + KL distillation → artifacts/RUN, results/RUN/train.json (TRAIN_ARGS=--resume)
	$(PY) train_translator.py $(PAIR) $(TRAIN_ARGS)

benchmark: $(VENV)/.synced ## KL/perplexity rows, native controls, four timing paths → results/RUN/benchmark.json
	$(PY) benchmark.py $(PAIR) $(BENCH_ARGS)

switch: $(VENV)/.synced ## switch cost against re-reading on long chats → results/RUN/switch.json (SWITCH_ARGS="--lengths 4000 8000")
	$(PY) switch_cost.py $(PAIR) $(SWITCH_ARGS)

$(EVAL_ROOT)/ifeval/manifest.json: | $(VENV)/.synced
	$(PY) ifeval.py --prepare --data-root $(EVAL_ROOT) $(if $(IFEVAL_SOURCE),--source $(IFEVAL_SOURCE))

ifeval-native: $(PUNKT) $(EVAL_ROOT)/ifeval/manifest.json ## IFEval, native source and target, official grader → results/RUN/ifeval-native.json
	$(PY) ifeval.py --native --data-root $(EVAL_ROOT) $(PAIR) $(IFEVAL_ARGS)

ifeval: $(PUNKT) $(EVAL_ROOT)/ifeval/manifest.json ## IFEval after the handoff (distilled maps) → results/RUN/ifeval.json
	$(PY) ifeval.py --data-root $(EVAL_ROOT) $(PAIR) $(IFEVAL_ARGS)

$(EVAL_ROOT)/arc/manifest.json $(EVAL_ROOT)/gsm8k/manifest.json: | $(VENV)/.synced
	$(PY) task_eval.py --task $(notdir $(@D)) --prepare --data-root $(EVAL_ROOT) $(if $(TASK_SOURCE),--source $(TASK_SOURCE))

task: $(EVAL_ROOT)/$(TASK)/manifest.json ## ARC/GSM8K accuracy after the handoff (TASK=arc|gsm8k HANDOFF=prompt|trace)
	$(PY) task_eval.py --task $(TASK) --handoff $(HANDOFF) --data-root $(EVAL_ROOT) $(PAIR) $(TASK_ARGS)

task-native: $(EVAL_ROOT)/$(TASK)/manifest.json ## ARC/GSM8K accuracy of the native source and target
	$(PY) task_eval.py --task $(TASK) --handoff $(HANDOFF) --native --data-root $(EVAL_ROOT) $(PAIR) $(TASK_ARGS)

perf: $(VENV)/.synced ## speed at real Qwen3 shapes, random weights: 4 paths as shipped and optimised, the physical limit, 1k/2k/4k (DIRECTION=s2l too) → results/perf/perf.json
	$(PY) perf.py --direction $(DIRECTION) --device $(DEVICE) --dtype $(PERF_DTYPE) $(PERF_ARGS)

recipe: $(PUNKT) ## native rows, one closed-form fit, LR search on validation KL, 3 seeds → results/RUN/recipe.{json,md,png} (RECIPE_ARGS=--resume)
	$(PY) recipe.py $(PAIR) --ifeval-data-root $(EVAL_ROOT) \
	  $(if $(IFEVAL_SOURCE),--ifeval-source $(IFEVAL_SOURCE)) $(RECIPE_ARGS)

summary: $(VENV)/.synced ## one table of the run's reports → results/RUN/summary.md
	$(PY) -m kvlingo.eval.summary --profile $(PROFILE) --direction $(DIRECTION) $(if $(RUN),--run $(RUN))
