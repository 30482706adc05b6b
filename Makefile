# Every target creates .venv when missing: torch==2.13.0 first (a local CPU build; an
# unpinned torch would pull gigabytes of CUDA wheels), then the package with its extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-unmask

.PHONY: quickstart test test-fast lint format bench bench-long bench-quick gpu-wheels-check clean-venv

$(STAMP): pyproject.toml
	@echo "unmask: setting up $(VENV) (torch 2.13.0 CPU build, then unmask and its extras; a few minutes the first time)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "unmask: installing torch 2.13.0"
	$(BIN)/pip install -q torch==2.13.0
	@echo "unmask: installing unmask with its extras"
	$(BIN)/pip install -q -e ".[dev,lora,qlora,plot,eval,wandb,trackio,serve,float8]"
	touch $(STAMP)
	@echo "unmask: $(VENV) is ready"

quickstart: $(STAMP)
	$(BIN)/unmask train train.output_dir=runs/quickstart train.overwrite_output_dir=true
	$(BIN)/unmask generate --model runs/quickstart/final --prompt "rev 90417="
	$(BIN)/unmask generate --model runs/quickstart/final --prompt "add 58+67="

# Two pytest workers (pytest-xdist), each test file on one worker (module fixtures such as
# one torchrun launch shared by a file's tests run once), the files marked slow first
# (tests/conftest.py): about 23 minutes on 2 cores. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) tests -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The benchmarks behind the README's numbers, in one run (19 minutes on this project's
# 2-core machine).
bench: $(STAMP)
	$(BIN)/python benchmarks/masked_loss_memory.py
	$(BIN)/python benchmarks/muon.py
	$(BIN)/python benchmarks/distributed_muon.py
	$(BIN)/python benchmarks/checkpoint_stall.py
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/startup.py

# The long ones (about 2 hours on 2 cores): Muon vs AdamW convergence (7 runs of 1000
# steps), data loading at scale, stopping per pad policy (3 trained models, and 3 more on
# open-ended answers), the tensor- and context-parallel layouts (about 10 and 12 minutes:
# launches of 2 and 4 processes).
# benchmarks/sampling.py runs on a trained quickstart model: `make quickstart`, then
# `python benchmarks/sampling.py --model runs/quickstart/final`.
bench-long: $(STAMP)
	$(BIN)/python benchmarks/muon_convergence.py
	$(BIN)/python benchmarks/data.py
	$(BIN)/python benchmarks/stopping.py
	$(BIN)/python benchmarks/stopping.py --task open
	$(BIN)/python benchmarks/parallel.py
	$(BIN)/python benchmarks/context_parallel.py
	$(BIN)/python benchmarks/moe.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/vocab_parallel.py
	$(BIN)/python benchmarks/sequence_parallel.py

# The smoke mode of every benchmark (tiny sizes, one round, no results files): CI runs it.
bench-quick: $(STAMP)
	$(BIN)/python benchmarks/masked_loss_memory.py --quick
	$(BIN)/python benchmarks/startup.py --quick
	$(BIN)/python benchmarks/muon.py --quick
	$(BIN)/python benchmarks/distributed_muon.py --quick
	$(BIN)/python benchmarks/parallel.py --quick
	$(BIN)/python benchmarks/muon_convergence.py --quick
	$(BIN)/python benchmarks/sampling.py --quick
	$(BIN)/python benchmarks/data.py --quick
	$(BIN)/python benchmarks/train_step.py --quick
	$(BIN)/python benchmarks/stopping.py --quick
	$(BIN)/python benchmarks/serve.py --quick
	$(BIN)/python benchmarks/stopping.py --quick --task open
	$(BIN)/python benchmarks/checkpoint_stall.py --quick
	$(BIN)/python benchmarks/context_parallel.py --quick
	$(BIN)/python benchmarks/moe.py --quick
	$(BIN)/python benchmarks/pipeline.py --quick
	$(BIN)/python benchmarks/vocab_parallel.py --quick
	$(BIN)/python benchmarks/sequence_parallel.py --quick
	$(BIN)/python benchmarks/gpu.py --profile --dry

# The GPU run's wheel set (benchmarks/gpu_wheels.py) proven on this CPU: a fresh
# environment from the wheels and this machine's torch alone, offline, imports what the
# phases import and runs the dry profile. Downloads about 150 MB, so not in CI.
gpu-wheels-check: $(STAMP)
	$(BIN)/python benchmarks/gpu.py --check-wheels $${TMPDIR:-/tmp}/unmask-gpu-wheels

clean-venv:
	rm -rf $(VENV)
