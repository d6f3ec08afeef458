# KVLRelay: translate one Qwen3's KV cache into another's, and measure what it costs and saves.
# `make help` lists the targets. Variables below can be set on the command line:
#   make run DEVICE=cuda DIRECTION=s2l

DEVICE    ?= auto
DTYPE     ?= bfloat16
PROFILE   ?= pilot
DIRECTION ?= l2s
RUN       ?= $(PROFILE)-$(DIRECTION)
LARGE     ?= Qwen/Qwen3-1.7B
SMALL     ?= Qwen/Qwen3-0.6B
SOURCE    ?=
TRAIN_ARGS   ?=
PREPARE_ARGS ?=

VENV := .venv
PY   := $(VENV)/bin/python
UV   := $(shell command -v uv 2>/dev/null || echo python3 -m uv)
PAIR  = --large $(LARGE) --small $(SMALL) --direction $(DIRECTION) --device $(DEVICE) --dtype $(DTYPE)
DATA  = data/$(PROFILE)

.DEFAULT_GOAL := help
.PHONY: help test venv prepare train

help: ## list the targets
	@echo "KVLRelay targets (variables: DEVICE=$(DEVICE) DTYPE=$(DTYPE) PROFILE=$(PROFILE) DIRECTION=$(DIRECTION) RUN=$(RUN)):"
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'

# The environment: created or updated from the lock on first use by every target below.
$(VENV)/.synced: pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || \
	  python3 -m pip install --quiet uv || python3 -m pip install --quiet --user --break-system-packages uv
	$(UV) sync --locked --extra ifeval
	@touch $@

venv: $(VENV)/.synced ## create or update .venv from uv.lock

test: $(VENV)/.synced ## run the test suite offline on the CPU (tiny local models, no network)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q $(TEST_ARGS)

prepare: $(VENV)/.synced ## disjoint train/validation/test splits under data/PROFILE (SOURCE=local.jsonl for offline)
	$(PY) paper_data.py --profile $(PROFILE) --tokenizer $(SMALL) $(if $(SOURCE),--source $(SOURCE)) $(PREPARE_ARGS)

train: $(VENV)/.synced ## closed-form fit + KL distillation → artifacts/RUN, results/RUN/train.json (TRAIN_ARGS=--resume)
	$(PY) train_translator.py --profile $(PROFILE) --data $(DATA) --run $(RUN) $(PAIR) $(TRAIN_ARGS)
