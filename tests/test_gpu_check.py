"""``make gpu-check`` (``benchmarks/gpu_check.py``) and its benchmark, on CPU.

No GPU run of this project is recorded yet, so the check must be known to run before one
is lent: its CPU dry run end to end from a clean copy of the repository (no ``pip
install``, as on the GPU machine), a benchmark row that fails (the other rows stay in the
JSON), a test that hangs (cut by the per-test timeout with its traceback; the junit XML and
the summary stay), a step cut by its time limit (SIGINT: pytest still writes its junit
XML), a preflight without CUDA (fails loudly, runs nothing else), and the benchmark's
budget and row order. Each runs the scripts as subprocesses with this interpreter.

``test_simulated_hang`` hangs only when ``COMPILE_PASS_SIMULATE_HANG=test_simulated_hang``
(set by the tests here for a child pytest); otherwise it and its neighbour skip.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_ENV = "COMPILE_PASS_SIMULATE_HANG"
THIS = "tests/test_gpu_check.py"
#: folders never copied into the clean copy (what a fresh clone does not have)
NOT_COPIED = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "bench-results",
              "build", "dist", "out"}


# --------------------------------------------------------------------------- the simulated hang


def test_simulated_hang_neighbour():
    """Runs next to the hanging test in the self-tests below: the run went on."""
    if os.environ.get(HANG_ENV) != "test_simulated_hang":
        pytest.skip(f"part of the gpu-check self-test ({HANG_ENV})")


def test_simulated_hang():
    """Hangs (as a CUDA sync or a collective can) when the self-test asks it to."""
    if os.environ.get(HANG_ENV) != "test_simulated_hang":
        pytest.skip(f"hangs only under {HANG_ENV}=test_simulated_hang")
    while True:
        time.sleep(0.2)


# --------------------------------------------------------------------------- helpers


def _env(**extra: str) -> dict:
    """This environment without the check's own switches, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_PASS_") and k != "OUT"}
    env.update(extra)
    return env


def _gpu_check(args, cwd=ROOT, env=None, timeout=240):
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", *args], cwd=cwd,
                          env=env if env is not None else _env(PYTHONPATH="."),
                          capture_output=True, text=True, timeout=timeout)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _junit_cases(path):
    """{test name: 'passed' | 'failed' | 'error' | 'skipped'} and the file's text."""
    with open(path) as f:
        text = f.read()
    cases = {}
    for case in ElementTree.fromstring(text).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag if tag != "failure" else "failed"
        cases[case.get("name")] = outcome
    return cases, text


def _step(summary, name):
    return next(s for s in summary["steps"] if s["name"] == name)


def _repo_files():
    """What a clone of this checkout would hold: tracked files and untracked ones git does
    not ignore (``git ls-files``), else a walk that leaves out build and tool folders."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        files = [f for f in listed.decode().split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in NOT_COPIED and not d.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
    return [f for f in files
            if os.path.isfile(os.path.join(ROOT, f))
            and not any(part in NOT_COPIED or part.endswith(".egg-info") for part in f.split(os.sep))]


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory):
    copy = tmp_path_factory.mktemp("clean-checkout")
    for rel in _repo_files():
        os.makedirs(copy / os.path.dirname(rel), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), copy / rel)
    assert not glob.glob(str(copy / "**" / "*.egg-info"), recursive=True)
    assert (copy / "benchmarks" / "gpu_check.py").exists() and (copy / "compile_pass").is_dir()
    return copy


# --------------------------------------------------------------------------- the dry run


@pytest.mark.slow
def test_dry_run_from_a_clean_copy(clean_copy, tmp_path):
    """make gpu-dry-run's flow, from a copy without install (``PYTHONPATH=.``): preflight,
    the gpu tests (skipped on CPU, as without COMPILE_PASS_REQUIRE_GPU), the benchmark. For
    time (< 60 s for this file) the benchmark runs list vs list+pass with the eager inner
    (the code path of the Inductor rows, without Inductor's C++ compiles), then the runner
    at several token counts; ``make gpu-dry-run`` runs every row."""
    out = tmp_path / "out"
    proc = _gpu_check(["--device", "cpu", "--out", str(out),
                       "--tests", "tests/test_cudagraph.py", "tests/test_memory.py",
                       "--", "--models", "llama", "--executions", "eager,runner",
                       "--variants", "list,list+pass", "--tokens", "32", "--runner-tokens", "16,32"],
                      cwd=clean_copy)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    summary = _load(out / "gpu_check_summary.json")
    assert summary["rc"] == 0 and [s["name"] for s in summary["steps"]] == ["preflight", "tests", "bench",
                                                                             "projection", "time"]
    assert all(s["rc"] == 0 and not s["timed_out"] for s in summary["steps"]), summary

    preflight = _load(out / "preflight.json")
    assert preflight["usable"] and preflight["cuda_available"] is False
    # imported from the copy, not from this checkout (which the venv has installed editable)
    assert os.path.realpath(preflight["compile_pass_from"]) == os.path.realpath(clean_copy / "compile_pass")
    for key in ("python", "torch", "triton", "pytest", "hypothesis"):
        assert key in preflight

    cases, _ = _junit_cases(out / "gpu_tests.xml")
    assert len(cases) == 5 and set(cases.values()) == {"skipped"}, cases
    assert _step(summary, "tests")["junit"]["tests"] == 5

    bench = _load(out / "gpu_capture_memory.json")
    rows = bench["rows"]
    assert bench["complete"] and not bench["interrupted"] and not bench["skipped"]
    assert [r for r in rows if r.get("error")] == []
    assert [r["name"] for r in rows[:4]] == ["llama/runner/list/16", "llama/runner/list/24",
                                              "llama/runner/list/32", "llama/runner/list+pass/16"]
    assert [r["name"] for r in rows[-2:]] == ["llama/eager/list/32", "llama/eager/list+pass/32"]
    passed = [r for r in rows if r["variant"] == "list+pass"]
    assert passed and all(r["rewritten"] and r["peak_minus_list_bytes"] is not None for r in passed)
    assert all(r["bitwise_equal"] for r in rows if r["reference"] not in (None, "(the reference)"))
    runner = [r for r in rows if r["execution"] == "runner"]
    assert {r["captured_tokens"] == [16, 32] for r in runner} == {True}
    assert any(r["padded_tokens"] != r["tokens"] for r in runner)
    assert _step(summary, "bench")["rows"]["rows"] == len(rows) == 8

    projection = _load(out / "projection_memory.json")["rows"]  # one small row per execution
    assert [r["execution"] for r in projection] == ["module", "eager", "cudagraph"] \
        and _step(summary, "projection")["rows"]
    assert not projection[2]["graph_captured"]  # no CUDA here: the CUDA-graph row's forward, measured
    for r in projection:
        assert r["device"] == "cpu" and r["overhead_projected"] < r["overhead_list"]
        assert all(r[k] for k in r if k.startswith("model_equal"))
    assert projection[1]["overhead_fused"] < projection[1]["overhead_list"]

    timed = _load(out / "projection_time.json")["rows"]  # the dry run: eager rows, 4 and 64 tokens
    assert {(r["row"], r["tokens"]) for r in timed} == {(n, t) for n in ("list", "packer", "proj1", "proj2")
                                                        for t in (4, 64)} and _step(summary, "time")["rows"]
    assert all(r["ms"] > 0 and not r["cuda_graph"] for r in timed)


def test_gpu_check_does_not_need_the_backend_name():
    """On the GPU machine nothing is installed, so the entry point ``aux_capture`` is not
    registered there: the benchmark and the gpu tests use the backend object."""
    by_name = re.compile(r"""backend\s*=\s*["']aux_capture["']""")
    for script in ("gpu_capture_memory.py", "gpu_check.py"):
        with open(os.path.join(ROOT, "benchmarks", script)) as f:
            assert not by_name.search(f.read()), script
    checked = 0
    for path in glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            marks = {ast.unparse(d) for d in node.decorator_list}
            if "pytest.mark.gpu" not in marks:
                continue
            checked += 1
            names = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value == "aux_capture"]
            assert not names, f"{path}::{node.name} compiles with the backend's name"
    assert checked >= 5


# --------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_failing_row_leaves_the_other_rows(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_capture_memory.py", "--device", "cpu", "--config", "tiny",
         "--layers", "3", "--dtype", "float32", "--models", "llama", "--executions", "runner,module",
         "--variants", "list,packer+aux_out", "--tokens", "32", "--runner-tokens", "16,32",
         "--simulate-failure", "llama/runner/list/*", "--out", str(out)],
        cwd=ROOT, env=_env(PYTHONPATH="."), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    saved = _load(out)
    assert saved["complete"]
    failed = [r for r in saved["rows"] if r.get("error")]
    assert [r["name"] for r in failed] == ["llama/runner/list/16", "llama/runner/list/24", "llama/runner/list/32"]
    assert all(r["error"].startswith("SimulatedFailure: simulated failure of row") and "Traceback" in r["traceback"]
               for r in failed)
    ok = [r for r in saved["rows"] if not r.get("error")]
    assert [r["name"] for r in ok] == ["llama/runner/packer+aux_out/16", "llama/runner/packer+aux_out/24",
                                       "llama/runner/packer+aux_out/32", "llama/module/list/32",
                                       "llama/module/packer+aux_out/32"]
    assert all(r["bitwise_equal"] for r in ok)
    shared = [r for r in ok if r["execution"] == "runner"]
    assert all(r["aux_in_static_buffer"] and r["static_buffer_bytes"] == 32 * r["k"] * r["hidden"] * 4
               for r in shared)
    assert "ERROR in llama/runner/list/16: SimulatedFailure" in proc.stdout


@pytest.mark.slow
def test_hanging_test_is_cut_and_results_stay(tmp_path):
    """Per-test timeout: the hanging test fails with its traceback, the next test runs,
    junit XML and summary are written. COMPILE_PASS_REQUIRE_GPU=1 (what gpu-check sets on
    CUDA) turns the skipped gpu test into a failure."""
    out = tmp_path / "out"
    proc = _gpu_check(
        ["--device", "cpu", "--steps", "tests", "--marks", "", "--test-timeout-s", "3", "--out", str(out),
         "--tests", f"{THIS}::test_simulated_hang_neighbour", f"{THIS}::test_simulated_hang",
         "tests/test_memory.py::test_cuda_two_tensors_and_cat_peak_16_mib"],
        env=_env(PYTHONPATH=".", **{HANG_ENV: "test_simulated_hang", "COMPILE_PASS_REQUIRE_GPU": "1"}))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = _load(out / "gpu_check_summary.json")
    tests = _step(summary, "tests")
    assert tests["rc"] == 1 and not tests["timed_out"] and not tests["sigkill_sent"]
    assert tests["junit"]["tests"] == 3 and len(tests["junit"]["failed"]) == 2
    cases, text = _junit_cases(out / "gpu_tests.xml")
    assert cases["test_simulated_hang_neighbour"] == "passed"
    assert cases["test_simulated_hang"] == "failed"
    assert "test_simulated_hang timed out after 3 s (COMPILE_PASS_TEST_TIMEOUT_S)" in text
    assert cases["test_cuda_two_tensors_and_cat_peak_16_mib"] in ("failed", "error")
    assert "COMPILE_PASS_REQUIRE_GPU=1 (make gpu-check): this gpu test was skipped" in text
    with open(out / "gpu_tests_hangs.log") as f:
        hangs = f.read()
    assert "test_simulated_hang is still running" in hangs
    assert re.search(r'test_gpu_check\.py", line \d+ in test_simulated_hang', hangs), hangs
    assert set(tests["files"]) >= {"gpu_tests.xml", "gpu_tests.log", "gpu_tests_hangs.log"}


@pytest.mark.slow
def test_step_past_its_limit_gets_sigint_and_keeps_junit(tmp_path):
    """No per-test timeout: the step's own limit sends SIGINT (not SIGTERM), so pytest
    stops and still writes its junit XML with the test that passed."""
    out = tmp_path / "out"
    proc = _gpu_check(
        ["--device", "cpu", "--steps", "tests", "--marks", "", "--test-timeout-s", "0",
         "--tests-timeout-s", "8", "--out", str(out),
         "--tests", f"{THIS}::test_simulated_hang_neighbour", f"{THIS}::test_simulated_hang"],
        env=_env(PYTHONPATH=".", **{HANG_ENV: "test_simulated_hang"}))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    tests = _step(_load(out / "gpu_check_summary.json"), "tests")
    assert tests["timed_out"] and tests["sigint_sent"] and not tests["sigkill_sent"], tests
    assert tests["rc"] != 0 and "gpu_tests.xml" in tests["files"]
    cases, _ = _junit_cases(out / "gpu_tests.xml")
    assert cases.get("test_simulated_hang_neighbour") == "passed", cases
    assert "KeyboardInterrupt" in proc.stdout


@pytest.mark.slow
def test_preflight_without_cuda_fails_loudly(tmp_path):
    out = tmp_path / "out"
    proc = _gpu_check(["--device", "cuda", "--out", str(out)])
    assert proc.returncode == 2, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "PREFLIGHT FAILED for --device cuda" in proc.stdout + proc.stderr
    preflight = _load(out / "preflight.json")
    assert not preflight["usable"] and "torch.cuda.is_available() is False" in preflight["problems"][0]
    summary = _load(out / "gpu_check_summary.json")
    assert summary["rc"] == 2
    assert [s.get("not_run") for s in summary["steps"][1:]] == ["the preflight failed (preflight.json)"] * 4  # tests, bench, projection, time
    assert not (out / "gpu_tests.xml").exists()


# --------------------------------------------------------------------------- the benchmark's plan


@pytest.fixture(scope="module")
def bench_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_capture_memory", os.path.join(ROOT, "benchmarks", "gpu_capture_memory.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_capture_memory"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_plan_puts_the_proof_first(bench_module):
    specs = bench_module.plan(["llama", "dflash"], list(bench_module.EXECUTIONS), None, [64, 128], [16, 32, 64])
    names = [s.name for s in specs]
    assert names[:8] == [f"{m}/inductor/{v}/{t}" for m in ("llama", "dflash")
                         for v in ("list", "list+pass") for t in (64, 128)]
    assert names[8:13] == ["llama/runner/packer+aux_out/16", "llama/runner/packer+aux_out/24",
                           "llama/runner/packer+aux_out/32", "llama/runner/packer+aux_out/64",
                           "llama/runner/list/16"]
    assert specs[9].padded == 32
    # every (execution, variant) exactly once per model and T
    expected = {(m, e, v) for e, vs in bench_module.VARIANTS.items() for v in vs for m in ("llama", "dflash")}
    assert {(s.model, s.execution, s.variant) for s in specs} == expected
    assert len(names) == len(set(names))


def test_budget_skips_a_row_it_cannot_finish(bench_module):
    args = argparse.Namespace(device="cpu", dtype="float32", tokens="64", runner_tokens="32",
                              budget_s=10.0, out=None, simulate_failure=None, cost_model="auto")
    bench = bench_module.Bench(args)
    bench.durations = {("inductor", True): [4.0, 6.0], ("eager", False): [0.5]}
    assert bench.estimate("inductor", True) == 5.0
    assert bench.estimate("aot_eager", True) == 5.0   # no aot_eager compile yet: any compile
    assert bench.estimate("runner", False) == 0.5
    bench.start = time.perf_counter() - 6.0             # 6 s spent: a 5 s compile would end at 11
    bench.run_row(bench_module.RowSpec("llama", "inductor", "list", 64))
    assert bench.rows == [] and bench.skipped[0]["row"] == "llama/inductor/list/64"
    assert bench.skipped[0]["estimated_seconds"] == 5.0
