# Every target creates .venv if missing and installs what it needs (CPU torch 2.13.0 pinned).
PY        ?= python3
VENV      ?= .venv
PIP       := $(VENV)/bin/pip
PYTHON    := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
N         ?= 1000

.PHONY: demo test bench fuzz gpu-check clean

$(VENV)/.installed-%: pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip >/dev/null
	$(PIP) install -q "$(TORCH_PIN)" numpy
	$(PIP) install -q -e ".[$*]"
	@touch $@

demo: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) examples/quickstart.py

test: $(VENV)/.installed-test
	$(PYTHON) -m pytest -q

bench: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) benchmarks/capture_memory.py --out bench-results/capture_memory.json

fuzz: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) -m pytest -q tests/test_fuzz.py --fuzz-cases $(N)

# On a GPU machine (torch with CUDA already installed there): GPU tests + GPU benchmark.
gpu-check:
	PYTHONPATH=. $(PY) -m pytest -q -m gpu tests
	PYTHONPATH=. $(PY) benchmarks/capture_memory.py --device cuda --out $${OUT:-bench-results}/gpu_capture_memory.json

clean:
	rm -rf $(VENV) bench-results .pytest_cache
