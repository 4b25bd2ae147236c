# Every target creates .venv if missing and installs what it needs (CPU torch 2.13.0 pinned).
PY        ?= python3
VENV      ?= .venv
PIP       := $(VENV)/bin/pip
PYTHON    := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
HF_PIN    ?= transformers==5.24.0
N         ?= 1000

.PHONY: demo test compat bench scale fuzz gpu-check clean

$(VENV)/.installed-%: pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip >/dev/null
	$(PIP) install -q "$(TORCH_PIN)" numpy $(if $(findstring hf,$*),"$(HF_PIN)")
	$(PIP) install -q -e ".[$*]"
	@touch $@

demo: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) examples/quickstart.py

test: $(VENV)/.installed-test,hf
	$(PYTHON) -m pytest -q

# The torch releases serving engines pin (SGLang 0.5.23: 2.14.1; vLLM 0.33.0 pins 2.14.0, the
# same minor) and the GPU machine's (2.11.0), each in its own venv cached outside the clone
# (COMPAT_DIR; CUDA builds, about 5 GB each, run on the CPU here; the first run installs them,
# later runs reuse them). On each: a named subset of the suite (the packer, the backend with
# each inner running the pass, piecewise and pack_outputs, the diff tool, twins and lifting
# (the pass's internals on traced graphs, tests/test_capture_pass.py, stay in make test), an
# Inductor sample marked ``compat``: the SGLang-style decoder reaching the packed bytes; the
# measurement, and that it prints only what the project prints), the
# checkout itself installed editable without
# dependencies. Measured on this 2-core VM once installed: 2.14.1, 229 passed in 174 s.
COMPAT_TORCH ?= 2.14.1 2.11.0
COMPAT_DIR   ?= $(HOME)/.cache/compile_pass
COMPAT_TESTS ?= tests/test_packer.py tests/test_backend.py tests/test_memory.py \
                tests/test_piecewise.py tests/test_explain.py tests/test_twins_and_lift.py \
                tests/test_inductor.py
COMPAT_MARKS ?= not inductor or compat
# left out for time: the same checks on bigger graphs (DeepSeek-shaped fixtures, one split
# run), the diff tool's CLI (its report stays) and the aot_eager twins of eager piecewise tests
COMPAT_SKIP  ?= not node_table_agrees and not changed_span_bounds and not split_piecewise_peak \
                and not cli_diff and not split_aot_eager and not (split_ops_pieces_equal and aot_eager) \
                and not (pack_outputs_returns_adjacent and aot_eager)
compat:
	@set -e; for v in $(COMPAT_TORCH); do \
	  venv="$(COMPAT_DIR)/venv-torch$$v"; \
	  if [ ! -f "$$venv/.installed" ]; then \
	    echo "== creating $$venv (torch $$v, a CUDA build of about 5 GB)"; \
	    $(PY) -m venv "$$venv"; \
	    "$$venv/bin/pip" install -q "torch==$$v" numpy "pytest>=7" "hypothesis>=6"; \
	    touch "$$venv/.installed"; \
	  fi; \
	  "$$venv/bin/pip" install -q --no-deps -e . >/dev/null; \
	  echo "== torch $$v: $(COMPAT_TESTS)"; \
	  TORCHINDUCTOR_CACHE_DIR="$(COMPAT_DIR)/inductor-cache-$$v" \
	    "$$venv/bin/python" -m pytest -q -p no:cacheprovider -m "$(COMPAT_MARKS)" -k "$(COMPAT_SKIP)" $(COMPAT_TESTS); \
	done

bench: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) benchmarks/capture_memory.py --out bench-results/capture_memory.json

# Real-size estimates and the pass's own time, traced on the meta device (docs/scale.md)
scale: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) benchmarks/real_size_estimates.py --out bench-results/real_size_estimates.json
	PYTHONPATH=. $(PYTHON) benchmarks/pass_speed.py --out bench-results/pass_speed.json

fuzz: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) -m pytest -q tests/test_fuzz.py --fuzz-cases $(N)

# On a GPU machine (torch with CUDA already installed there, nothing installable): the GPU
# tests, then the GPU memory benchmark (JSON under $OUT, default bench-results/), each under its
# own timeout and both under one overall timeout (< 8 min). The benchmark starts no new row after
# GPU_BENCH_BUDGET_S and rewrites its JSON after every row, so a cut run keeps what it measured.
GPU_TIMEOUT_S       ?= 470
GPU_TESTS_TIMEOUT_S ?= 180
GPU_BENCH_TIMEOUT_S ?= 280
GPU_BENCH_BUDGET_S  ?= 200
gpu-check:
	timeout $(GPU_TIMEOUT_S) sh -c '\
	  rc=0; out=$${OUT:-bench-results}; mkdir -p "$$out"; \
	  export PYTHONPATH=. TORCHINDUCTOR_FX_GRAPH_CACHE=0; \
	  timeout $(GPU_TESTS_TIMEOUT_S) $(PY) -m pytest -q -m gpu --continue-on-collection-errors \
	    -p no:cacheprovider --junitxml="$$out/gpu_tests.xml" tests || rc=$$?; \
	  timeout $(GPU_BENCH_TIMEOUT_S) $(PY) benchmarks/gpu_capture_memory.py --device cuda \
	    --budget-s $(GPU_BENCH_BUDGET_S) --out "$$out/gpu_capture_memory.json" || rc=$$?; \
	  exit $$rc'

clean:
	rm -rf $(VENV) bench-results .pytest_cache
