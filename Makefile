# KVLRelay: translate one Qwen3's KV cache into another's, and measure what it costs and saves.
# `make help` lists the targets. Variables can be set on the command line:
#   make run DEVICE=cuda DIRECTION=s2l
#   make recipe PROFILE=paper-budget DEVICE=cuda RUN=qwen-headwise
#   make train PROFILE=paper-budget DEVICE=cuda NPROC=8          (torchrun, one rank per GPU)

PROFILE   ?= pilot
DIRECTION ?= l2s
# The offline toy world (make demo): its pair, corpus and evaluation files.
TOY       ?= artifacts/toy
TOY_ARGS  ?=
# PROFILE=demo (and scale, the demo at 8,192 training conversations) runs on the toy world, offline, on the CPU:
# every stage's inputs default to it. Their chats: the toy world's held-out conversations, 2,048 or 10,240 of them.
# PAIR picks the toy pair (toy: the packaged 4-layer pair; deep: the 28-layer pair; mismatched: the 3-layer model
# beside the packaged pair, two pairs in `make demo`).
PAIR ?= toy
PAIR_MODELS_toy  := large small
PAIR_MODELS_deep := deep/large deep/small
ifneq ($(filter demo scale,$(PROFILE)),)
DEVICE        ?= cpu
DTYPE         ?= float32
LARGE         ?= $(TOY)/$(word 1,$(or $(PAIR_MODELS_$(PAIR)),$(PAIR_MODELS_toy)))
SMALL         ?= $(TOY)/$(word 2,$(or $(PAIR_MODELS_$(PAIR)),$(PAIR_MODELS_toy)))
# One torch thread per process: the toy models' small ops are fastest on one thread on a machine other jobs share
# (two OpenMP threads wait at each other's barriers; distillation ran ~20x slower so). THREADS=2 to change it.
THREADS       ?= 1
SOURCE        ?= $(TOY)/corpus/chats.$(if $(filter scale,$(PROFILE)),10240,2048).jsonl
IFEVAL_SOURCE ?= $(TOY)/corpus/ifeval.jsonl
TASK_SOURCE_DIR ?= $(TOY)/corpus
EVAL_ROOT     ?= data/toy-eval
export HF_HUB_OFFLINE = 1
endif
DEVICE    ?= auto
DTYPE     ?= bfloat16
# Torch's CPU threads (OMP_NUM_THREADS) for every stage; empty: torch's default (every core). Reports record it.
THREADS   ?=
ifneq ($(THREADS),)
export OMP_NUM_THREADS = $(THREADS)
endif
# Run name: empty means every stage's default, PROFILE-DIRECTION (kvlingo/records/paths.py); the deep pair's runs
# are demo-deep-DIRECTION.
RUN       ?= $(if $(filter deep,$(PAIR)),$(if $(filter demo scale,$(PROFILE)),$(PROFILE)-deep-$(DIRECTION)))
# The suite runs in pytest-xdist workers, TEST_JOBS of them (auto: one per CPU core; 0: in pytest's own process),
# idle workers taking tests from busy ones (worksteal). Each worker runs torch on one thread: a worker per core
# on torch's default threads would put cores x cores threads on the machine.
TEST_JOBS ?= auto
# Data-parallel ranks of a training (torchrun --nproc-per-node; the recipe's GPUs per training cell).
NPROC     ?= 1
# How the recipe runs its cells: local (processes on this machine) or slurm (job arrays, submitit).
RECIPE_LAUNCHER ?= local
# A planned GPU for `make estimate` (H100, H200, A100, ...); empty: this machine's device.
GPU       ?=
TASK      ?= arc
HANDOFF   ?= prompt
LARGE     ?= Qwen/Qwen3-1.7B
SMALL     ?= Qwen/Qwen3-0.6B
# Evaluation data (IFEval, ARC, GSM8K) is prepared under EVAL_ROOT/<name>/.
EVAL_ROOT ?= data
# Local JSONL sources (offline). Empty: the pinned Hub data sets.
SOURCE        ?=
IFEVAL_SOURCE ?=
TASK_SOURCE   ?=
# A folder of local task files named <task>.jsonl (the toy world's corpus); wins over TASK_SOURCE.
TASK_SOURCE_DIR ?=
PREPARE_ARGS ?=
TRAIN_ARGS   ?=
BENCH_ARGS   ?=
SWITCH_ARGS  ?=
IFEVAL_ARGS  ?=
TASK_ARGS    ?=
RECIPE_ARGS  ?=
PERF_ARGS    ?=
ABLATE_ARGS  ?=
FRONTIER_ARGS ?=
# Refresh setting of the handoff stages (benchmark, switch, ifeval, task): none, tail:W, layers:K, select:R
REFRESH      ?=
# Which of a run's two trained translators switch, ifeval, task and export use
TRANSLATOR   ?= distilled
# make ablate runs both directions at once, one CPU thread each (the toy models are too small to use two)
ABLATE_DIRECTIONS ?= l2s s2l
ABLATE_THREADS    ?= 1
# each direction's log: results/ablate-[PROFILE-][PAIR-]DIRECTION.log (the demo profile and the 4-layer pair unnamed)
ABLATE_LOG = ablate-$(if $(filter-out demo,$(PROFILE)),$(PROFILE)-)$(if $(filter-out toy,$(PAIR)),$(PAIR)-)
EXPORT_ARGS  ?=
# perf: float32 on a CPU (the CPU goal is FP32; BF16 is fast only where the CPU has AVX512-BF16 or AMX), bfloat16 on a GPU
PERF_DTYPE   ?= auto
# The toy pair(s) make demo runs: toy = large ↔ small; mismatched = large ↔ mismatched, then mismatched ↔ small
# (the mismatched model's 3 layers × 4 KV heads × head_dim 32 against the pair's 4 × 2 × 32: cross-layer maps).
DEMO_PAIRS_toy  := large:small
DEMO_PAIRS_deep := deep/large:deep/small
DEMO_PAIRS_mismatched := large:mismatched mismatched:small
# the mismatched pairs' caches line up neither layer by layer nor head by head: token input beside cross-layer maps
DEMO_FAMILY_mismatched := tokeninput --base crosslayer

# Variables that name a choice or a count are checked here, before any target runs: a typo is one line naming the
# choices, not a run under another pair's name, make's "No rule to make target", or a launcher's traceback.
ifeq ($(filter $(PAIR),toy deep mismatched),)
$(error PAIR=$(PAIR) is not a toy pair: one of toy (4 layers), deep (28 layers), mismatched (make demo only))
endif
ifeq ($(PAIR),mismatched)
ifneq ($(filter-out demo help toy,$(MAKECMDGOALS)),)
ifneq ($(origin LARGE),command line)
$(error PAIR=mismatched is two pairs (large ↔ mismatched, mismatched ↔ small) and runs as such only in make demo; \
  for one of them give LARGE= and SMALL=, e.g. LARGE=$(TOY)/large SMALL=$(TOY)/mismatched)
endif
endif
endif
ifeq ($(filter $(TASK),arc gsm8k),)
$(error TASK=$(TASK) is not a task: one of arc, gsm8k (IFEval has its own targets: make ifeval, make ifeval-native))
endif
ifeq ($(filter $(HANDOFF),prompt trace),)
$(error HANDOFF=$(HANDOFF) is not a handoff: one of prompt, trace)
endif
ifeq ($(filter $(TRANSLATOR),distilled closed_form),)
$(error TRANSLATOR=$(TRANSLATOR) is not a translator of a run: one of distilled (the default), closed_form)
endif
ifeq ($(shell echo '$(TEST_JOBS)' | grep -xE 'auto|[0-9]+'),)
$(error TEST_JOBS=$(TEST_JOBS) is not a count of test workers: auto (one per core), 0 (none: one process) or a whole number)
endif
ifeq ($(shell echo '$(NPROC)' | grep -xE '[1-9][0-9]*'),)
$(error NPROC=$(NPROC) is not a count of ranks: a whole number, 1 or more (make train NPROC=8: torchrun, 8 ranks))
endif

# Python caches compiled modules in .venv even where the environment turns that off: without the
# cache every process recompiles torch and transformers (seconds per stage, minutes per test run).
export PYTHONDONTWRITEBYTECODE =
# torch's CPU allocator asks Linux for transparent huge pages for tensors of 2 MiB or more (read once,
# at torch's first allocation; nothing elsewhere); a long prefill otherwise takes millions of page
# faults. Every process of a run gets the same setting, so a timing's paths do;
# reports record it (env.huge_pages). THP_MEM_ALLOC_ENABLE=0 on the command line turns it off.
export THP_MEM_ALLOC_ENABLE ?= 1

VENV  := .venv
PY    := $(VENV)/bin/python
UV    := $(shell command -v uv 2>/dev/null || echo python3 -m uv)
PAIR_FLAGS = --profile $(PROFILE) --large $(LARGE) --small $(SMALL) --direction $(DIRECTION) --device $(DEVICE) \
	--dtype $(DTYPE) $(if $(RUN),--run $(RUN))
REFRESH_FLAG = $(if $(REFRESH),--refresh $(REFRESH))
TRANSLATOR_FLAG = $(if $(filter-out distilled,$(TRANSLATOR)),--translator $(TRANSLATOR))
PUNKT := $(VENV)/nltk_data/tokenizers/punkt_tab/english/ortho_context.tab
# One process, or torchrun with NPROC ranks (kvlingo/train/distributed.py). torchrun's parser would take a stage
# flag that abbreviates one of its own options (--run: --run-path) for its own: the stage's flags follow `--`.
TRAIN_PY = $(if $(filter-out 1,$(NPROC)),$(PY) -m kvlingo.train.torchrun --standalone --nproc-per-node $(NPROC),$(PY))
TRAIN_SEP = $(if $(filter-out 1,$(NPROC)),--)

.DEFAULT_GOAL := help
.PHONY: help venv lint format test test-fast run demo toy toy-train toy-train-deep toy-train-mismatched toy-export prepare train estimate benchmark switch ifeval ifeval-native task task-native perf gpu-check recipe summary ablate frontier layers export

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

PYTEST := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal

test: $(VENV)/.synced ## run the whole test suite offline on the CPU (tiny local models, no network; what CI runs; TEST_JOBS=N workers, 0: one process)
	$(PYTEST) $(TEST_ARGS)

lint: $(VENV)/.synced ## ruff: the linter and the formatter's check (what CI runs before the tests)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.synced ## ruff: format the code and apply the linter's safe fixes
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test-fast: $(VENV)/.synced ## the fast tests only (skips those marked slow)
	$(PYTEST) -m "not slow" $(TEST_ARGS)

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

toy: $(VENV)/.synced ## install the offline toy world: the packaged toy pairs (4 and 28 layers) and mismatched model + regenerated, verified corpus → artifacts/toy (seconds)
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) $(TOY_ARGS)

toy-train: $(VENV)/.synced ## retrain the toy pair from scratch (~26 CPU-minutes) and re-package it into kvlingo/toy/pair
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) --train --export kvlingo/toy/pair $(TOY_ARGS)

toy-train-deep: $(VENV)/.synced ## retrain the deep toy pair (28 layers each, about 3 hours of one core) on the packaged pair's corpus and re-package it into kvlingo/toy/deep
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) --train-deep --export-deep kvlingo/toy/deep $(TOY_ARGS)

toy-train-mismatched: $(VENV)/.synced ## retrain the mismatched toy model (3 layers, 4 KV heads, about an hour of one core) on the packaged pair's corpus and re-package it into kvlingo/toy/mismatched
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) --train-mismatched --export-mismatched kvlingo/toy/mismatched $(TOY_ARGS)

# Every stage on a toy pair, offline, on the CPU. The demo profile holds every setting (learning
# rate, fit weighting, switch lengths, the recipe's budget; timing CV flags reported, not fatal).
# PAIR=toy keeps the default run names (demo-DIRECTION), PAIR=deep runs as demo-deep-DIRECTION; the mismatched
# pairs as demo-LARGE-SMALL-DIRECTION.
demo_name = $(if $(filter toy,$(PAIR)),demo,$(if $(filter deep,$(PAIR)),demo-deep,demo-$(1)-$(2)))
demo_run = RUN=$(call demo_name,$(1),$(2))-$(DIRECTION)
demo_vars = PROFILE=demo LARGE=$(TOY)/$(1) SMALL=$(TOY)/$(2) $(call demo_run,$(1),$(2)) \
	$(if $(DEMO_FAMILY_$(PAIR)),TRAIN_ARGS="--family $(DEMO_FAMILY_$(PAIR)) $(TRAIN_ARGS)" \
	  RECIPE_ARGS="--train-args='--family $(DEMO_FAMILY_$(PAIR))' $(RECIPE_ARGS)")
define demo_pair
	$(MAKE) run $(call demo_vars,$(1),$(2)) || status=1; \
	$(MAKE) switch $(call demo_vars,$(1),$(2)) || status=1; \
	for task in arc gsm8k; do for mode in prompt trace; do \
	  $(MAKE) task-native task $(call demo_vars,$(1),$(2)) TASK=$$task HANDOFF=$$mode TASK_ARGS="--resume" || status=1; \
	done; done; \
	$(MAKE) recipe $(call demo_vars,$(1),$(2)) RUN=$(call demo_name,$(1),$(2))-$(DIRECTION)-recipe || status=1; \
	$(MAKE) summary $(call demo_vars,$(1),$(2)) || status=1;
endef
demo: toy ## the whole suite offline on a CPU with a toy pair (PAIR=toy: the 4-layer pair; PAIR=deep: the 28-layer pair; PAIR=mismatched: large ↔ mismatched, mismatched ↔ small), ending in summary tables
	@$(if $(DEMO_PAIRS_$(PAIR)),,echo "make demo: PAIR=$(PAIR) is not one of toy, deep, mismatched"; exit 2;) status=0; \
	$(foreach p,$(DEMO_PAIRS_$(PAIR)),$(call demo_pair,$(word 1,$(subst :, ,$(p))),$(word 2,$(subst :, ,$(p))))) \
	exit $$status

# A translator to try kvlingo.Relay on, offline: the demo's first three stages on the toy pair, then its export.
toy-export: toy ## a toy translator with its evidence: prepare → train → benchmark → export on the toy pair → artifacts/demo-l2s/export
	$(MAKE) prepare train benchmark export PROFILE=demo

# ---------------------------------------------------------------- stages
# More held-out toy conversations than chats.jsonl holds (deterministic; disjoint from evaluation and toy training).
$(TOY)/corpus/chats.%.jsonl: | $(VENV)/.synced
	HF_HUB_OFFLINE=1 $(PY) toy_world.py --out $(TOY) --chats $*

prepare: $(VENV)/.synced $(filter $(TOY)/corpus/chats.%.jsonl,$(SOURCE)) ## disjoint train/validation/test splits → data/PROFILE (SOURCE=chats.jsonl offline)
	$(PY) prepare.py --profile $(PROFILE) --tokenizer $(SMALL) $(if $(SOURCE),--source $(SOURCE)) $(PREPARE_ARGS)

train: $(VENV)/.synced ## closed-form fit + KL distillation → artifacts/RUN, results/RUN/train.json (TRAIN_ARGS=--resume, NPROC=8)
	$(TRAIN_PY) train_translator.py $(TRAIN_SEP) $(PAIR_FLAGS) $(TRAIN_ARGS)

estimate: $(VENV)/.synced ## peak memory per rank and time per update of PROFILE's distillation (NPROC=8 GPU=H100)
	$(PY) estimate.py --profile $(PROFILE) --large $(LARGE) --small $(SMALL) --direction $(DIRECTION) \
	  --dtype $(DTYPE) --nproc $(NPROC) --device $(DEVICE) $(if $(GPU),--gpu $(GPU))

benchmark: $(VENV)/.synced ## KL/perplexity rows, native controls, four timing paths → results/RUN/benchmark.json
	$(PY) benchmark.py $(PAIR_FLAGS) $(REFRESH_FLAG) $(BENCH_ARGS)

switch: $(VENV)/.synced ## switch cost against re-reading on long chats → results/RUN/switch.json (SWITCH_ARGS="--lengths 4000 8000")
	$(PY) switch_cost.py $(PAIR_FLAGS) $(REFRESH_FLAG) $(TRANSLATOR_FLAG) $(SWITCH_ARGS)

$(EVAL_ROOT)/ifeval/manifest.json: | $(VENV)/.synced
	$(PY) ifeval.py --prepare --data-root $(EVAL_ROOT) $(if $(IFEVAL_SOURCE),--source $(IFEVAL_SOURCE))

ifeval-native: $(PUNKT) $(EVAL_ROOT)/ifeval/manifest.json ## IFEval, native source and target, official grader → results/RUN/ifeval-native.json
	$(PY) ifeval.py --native --data-root $(EVAL_ROOT) $(PAIR_FLAGS) $(IFEVAL_ARGS)

ifeval: $(PUNKT) $(EVAL_ROOT)/ifeval/manifest.json ## IFEval after the handoff (the distilled maps; TRANSLATOR=closed_form: the fit's) → results/RUN/ifeval.json
	$(PY) ifeval.py --data-root $(EVAL_ROOT) $(PAIR_FLAGS) $(REFRESH_FLAG) $(TRANSLATOR_FLAG) $(IFEVAL_ARGS)

$(EVAL_ROOT)/arc/manifest.json $(EVAL_ROOT)/gsm8k/manifest.json: | $(VENV)/.synced
	$(PY) task_eval.py --task $(notdir $(@D)) --prepare --data-root $(EVAL_ROOT) \
	  $(if $(TASK_SOURCE_DIR),--source $(TASK_SOURCE_DIR)/$(notdir $(@D)).jsonl,$(if $(TASK_SOURCE),--source $(TASK_SOURCE)))

task: $(EVAL_ROOT)/$(TASK)/manifest.json ## ARC/GSM8K accuracy after the handoff (TASK=arc|gsm8k HANDOFF=prompt|trace)
	$(PY) task_eval.py --task $(TASK) --handoff $(HANDOFF) --data-root $(EVAL_ROOT) $(PAIR_FLAGS) $(REFRESH_FLAG) $(TRANSLATOR_FLAG) $(TASK_ARGS)

task-native: $(EVAL_ROOT)/$(TASK)/manifest.json ## ARC/GSM8K accuracy of the native source and target
	$(PY) task_eval.py --task $(TASK) --handoff $(HANDOFF) --native --data-root $(EVAL_ROOT) $(PAIR_FLAGS) $(TASK_ARGS)

# LARGE/SMALL given on the command line name preset shapes (kvlingo/bench/shapes.py), e.g. Qwen/Qwen3-4B.
# Both directions unless DIRECTION is given: one perf.py line each.
PERF_DIRECTIONS = $(if $(filter command line environment,$(origin DIRECTION)),$(DIRECTION),l2s s2l)
PERF_CMD = $(PY) perf.py $(if $(filter command line,$(origin LARGE) $(origin SMALL)),--large $(LARGE) --small $(SMALL)) \
  --device $(DEVICE) --dtype $(PERF_DTYPE) $(PERF_ARGS) --direction
perf: $(VENV)/.synced ## speed at real shapes, random weights: each direction's default family at 4k, the handoff against re-prefill, optimised, what the maps cost, the physical limit (DIRECTION=s2l: one direction; PERF_ARGS=--full: 1k/2k/4k, 4 paths, shipped rows, every family; LARGE=Qwen/Qwen3-4B SMALL=... PERF_ARGS=--family crosshead: other depths) → results/perf/perf.json, results/perf-s2l/perf.json
	$(PERF_CMD) $(firstword $(PERF_DIRECTIONS))
	$(if $(word 2,$(PERF_DIRECTIONS)),$(PERF_CMD) $(word 2,$(PERF_DIRECTIONS)))

# Needs no .venv: on a machine lent a GPU, PY=python3 with the pinned transformers beside it (gpu_check.py's header).
GPU_CHECK_ARGS ?=
gpu-check: ## on one CUDA GPU (PY=python3 there): the GPU tests, perf at 4k/8k/16k both directions (deferred values, CUDA graphs on/off), the toy benchmark, a torch.profiler breakdown of the handoff at 8k/16k → results/gpu-check/gpu-check.md (GPU_CHECK_ARGS=--dry-run: on the CPU)
	HF_HUB_OFFLINE=1 $(PY) gpu_check.py $(GPU_CHECK_ARGS)

recipe: $(PUNKT) ## native rows, one closed-form fit, LR search on validation KL, 3 seeds → results/RUN/recipe.{json,md,png} (RECIPE_ARGS=--resume, RECIPE_LAUNCHER=slurm)
	$(PY) recipe.py $(PAIR_FLAGS) --ifeval-data-root $(EVAL_ROOT) --launcher $(RECIPE_LAUNCHER) --gpus-per-cell $(NPROC) \
	  $(if $(IFEVAL_SOURCE),--ifeval-source $(IFEVAL_SOURCE)) $(RECIPE_ARGS)

export: $(VENV)/.synced ## the run's translator, its evidence and a model card → artifacts/RUN/export (kvlingo.Relay loads it; EXPORT_ARGS="--out DIR")
	$(PY) export.py --profile $(PROFILE) --direction $(DIRECTION) $(if $(RUN),--run $(RUN)) $(TRANSLATOR_FLAG) $(EXPORT_ARGS)

summary: $(VENV)/.synced ## one table and one figure of the run's reports → results/RUN/summary.{md,png,json}
	$(PY) summary.py --profile $(PROFILE) --direction $(DIRECTION) $(if $(RUN),--run $(RUN))

ablate: $(PUNKT) $(if $(filter demo scale,$(PROFILE)),toy) $(EVAL_ROOT)/ifeval/manifest.json $(EVAL_ROOT)/gsm8k/manifest.json ## the translator's levers (families, exact layer 0, token identity, objectives) on one budget; metric and default chosen on validation, the best scored on test → results/PROFILE-DIRECTION-ablate/ablation.{json,md,png} (both directions)
	$(MAKE) prepare
	@mkdir -p results; status=0; pids=""; \
	for d in $(ABLATE_DIRECTIONS); do \
	  log=results/$(ABLATE_LOG)$$d.log; echo "ablate $$d: log in $$log"; \
	  OMP_NUM_THREADS=$(ABLATE_THREADS) $(PY) ablate.py --profile $(PROFILE) --large $(LARGE) --small $(SMALL) \
	    --direction $$d --device $(DEVICE) --dtype $(DTYPE) --data-root $(EVAL_ROOT) \
	    $(if $(filter-out toy,$(PAIR)),--run $(PROFILE)-$(PAIR)-$$d-ablate) $(ABLATE_ARGS) \
	    > $$log 2>&1 & pids="$$pids $$!"; \
	done; \
	for p in $$pids; do wait $$p || status=1; done; \
	for d in $(ABLATE_DIRECTIONS); do tail -n 40 results/$(ABLATE_LOG)$$d.log; done; \
	exit $$status

frontier: $(PUNKT) $(if $(filter demo scale,$(PROFILE)),toy) $(EVAL_ROOT)/ifeval/manifest.json $(EVAL_ROOT)/gsm8k/manifest.json ## prepare and train the run (when not done), then quality against cost from pure translation to re-prefill (refresh settings) → results/RUN/frontier.{json,md,png}
	$(MAKE) prepare
	$(MAKE) train TRAIN_ARGS="--resume $(TRAIN_ARGS)"
	$(PY) frontier.py $(PAIR_FLAGS) --data-root $(EVAL_ROOT) $(FRONTIER_ARGS)

LAYERS_ARGS ?=
layers: $(VENV)/.synced ## where trained translators' error lives: each target layer's share of the handoff's KL (LAYERS_ARGS="--runs RUN ...") → results/RUN-layers/layers.{json,md,png} (RUN: PROFILE-DIRECTION, or PROFILE-deep-DIRECTION for PAIR=deep)
	$(PY) layers.py $(PAIR_FLAGS) $(LAYERS_ARGS)

# ---------------------------------------------------------------- serving (optional: vLLM in its own environment)
# vLLM's CPU build pins another torch and transformers than the suite, so it lives in .venv-serve, installed
# without resolution from the exact pins of requirements-serve.txt. torch 2.13.0+cpu comes from the wheel folder
# in PIP_FIND_LINKS when that is set, else from PyTorch's CPU index. Nothing above depends on it.
SERVE_VENV   := .venv-serve
SERVE_PY     := $(SERVE_VENV)/bin/python
SERVE_PYTHON ?= 3.11
SERVE_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
SERVE_ARGS   ?=
# serve-perf: the random maps' family and refresh (SERVE_FAMILY empty: the default translator, token-w3, with the
# target's exact layer 0; SERVE_REFRESH empty: exact:0 for a family that reads the target's layer 0, else none), and
# the translation's precision (fast-fused: the maps' matmuls in the engine's BF16 with FP32 accumulation, the keys'
# norm and RoPE compiled; kvlingo/core/engine.py)
SERVE_FAMILY    ?=
SERVE_REFRESH   ?=
SERVE_PRECISION ?= fast-fused
# The demo's translators: the scale profile's default in both directions (token-w3 with refresh exact:0: the connector
# computes the target's layer 0 from the token ids and its checked layer-0 tensors), in the cache key space (the
# engine's own saved cache is their input), trained on 2,048 conversations of the scale profile's data (the demo's
# 512 left the earlier cross-head and cross-layer maps above the default gate's NLL Δ of 0.25 on 256 test
# conversations), the best validation kept.
SERVE_PROFILE  ?= scale
SERVE_L2S_ARGS ?= --key-space cache --n-train 2048 --updates 1200 --keep-best
SERVE_S2L_ARGS ?= --key-space cache --n-train 2048 --updates 3000 --keep-best
# The engines share one process (one store of source caches); vLLM's own threads follow OMP_NUM_THREADS.
SERVE_RUN = HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind
.PHONY: serve-env serve-demo serve-perf test-serve

$(SERVE_VENV)/.synced: requirements-serve.txt
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || \
	  python3 -m pip install --quiet uv || python3 -m pip install --quiet --user --break-system-packages uv
	rm -rf $(SERVE_VENV)
	$(UV) venv --quiet --python $(SERVE_PYTHON) $(SERVE_VENV)
	VIRTUAL_ENV=$(CURDIR)/$(SERVE_VENV) $(UV) pip install --quiet --no-deps \
	  $(if $(PIP_FIND_LINKS),--find-links "$(PIP_FIND_LINKS)",--extra-index-url $(SERVE_TORCH_INDEX) --index-strategy unsafe-best-match) \
	  -r requirements-serve.txt
	echo "$(CURDIR)" > "$$($(SERVE_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvlrelay.pth"
	HF_HUB_OFFLINE=1 $(SERVE_PY) -c "import vllm, kvlingo.serve.connector; print('vllm', vllm.__version__, 'with kvlingo.serve.connector')"
	@touch $@

serve-env: $(SERVE_VENV)/.synced ## the optional serving environment .venv-serve: vLLM (CPU build) and kvlingo, exact pins (requirements-serve.txt)

artifacts/serve-l2s/export/config.json: | $(VENV)/.synced
	$(MAKE) prepare train benchmark export PROFILE=$(SERVE_PROFILE) DIRECTION=l2s RUN=serve-l2s TRAIN_ARGS="$(SERVE_L2S_ARGS)"

artifacts/serve-s2l/export/config.json: | $(VENV)/.synced
	$(MAKE) prepare train benchmark export PROFILE=$(SERVE_PROFILE) DIRECTION=s2l RUN=serve-s2l TRAIN_ARGS="$(SERVE_S2L_ARGS)"

serve-demo: $(SERVE_VENV)/.synced toy artifacts/serve-l2s/export/config.json artifacts/serve-s2l/export/config.json ## a conversation alternating between the toy pair's models served by vLLM, each switch through kvlingo's KV connector, TTFT against vLLM's re-prefill → results/serve/demo.json
	$(SERVE_RUN) $(SERVE_PY) serve_demo.py toy --large $(TOY)/large --small $(TOY)/small \
	  --l2s artifacts/serve-l2s/export --s2l artifacts/serve-s2l/export $(SERVE_ARGS)

serve-perf: $(SERVE_VENV)/.synced toy ## TTFT at Qwen3-1.7B → 0.6B shapes (random weights and the default's token-w3 maps with exact:0, BF16, 4,096 tokens): vLLM re-prefill against the connector, and the same translation timed at each suspect of a slower engine (vLLM's import, a second engine, the engine's load, allocation) → results/serve/real-*.json (SERVE_FAMILY=crosshead)
	HF_HUB_OFFLINE=1 $(PY) serve_demo.py prepare-real --tokenizer $(TOY)/small $(if $(SERVE_FAMILY),--family $(SERVE_FAMILY)) \
	  $(if $(SERVE_REFRESH),--refresh $(SERVE_REFRESH))
	$(SERVE_RUN) $(SERVE_PY) serve_demo.py real --allow-unproven $(if $(SERVE_FAMILY),--family $(SERVE_FAMILY)) --precision $(SERVE_PRECISION) \
	  $(SERVE_ARGS)

test-serve: $(SERVE_VENV)/.synced $(VENV)/.synced ## the serving tests, in .venv-serve (vLLM engines on the CPU; references from .venv)
	$(SERVE_RUN) TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $(SERVE_PY) -m pytest -q tests/serve/test_connector.py $(TEST_ARGS)
