"""The GPU check (``make gpu-check``) and its CPU dry run (``make gpu-dry-run``).

    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cuda --out DIR   # on the GPU machine
    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu --out DIR     # the same flow on CPU
    ... -- --models llama --tokens 4096                                    # more benchmark arguments

Needs torch (and pytest for the tests step) for the Python that runs it, nothing installed
from this repository: the checkout is put on ``PYTHONPATH``. Steps, each a subprocess with
its own time limit inside one overall limit (``--timeout-s``); whatever a step does, the
next one runs, and ``DIR/gpu_check_summary.json`` is rewritten after every step:

1. ``preflight``: ``DIR/preflight.json``: Python, torch (and its CUDA), triton, pytest,
   hypothesis versions, ``torch.cuda.is_available()``, every device's name, capability and
   memory, a small matmul on the device, ``nvidia-smi``'s report, where ``compile_pass`` was
   imported from and whether it is installed, whether the backend name ``aux_capture``
   resolves (the check does not need it: the tests and the benchmark use the backend
   object). With ``--device cuda`` and no usable CUDA device it says so loudly, exits 2
   and runs nothing else (every other step would only fail).
2. ``tests``: ``python -m pytest -m gpu tests`` (``--tests``, ``--marks``) with the
   environment ``tests/conftest.py`` reads: ``COMPILE_PASS_REQUIRE_GPU=1`` (CUDA only: a
   skipped GPU test fails), ``COMPILE_PASS_TEST_TIMEOUT_S`` (``--test-timeout-s``: a hung
   test fails with its traceback, the others run) and ``COMPILE_PASS_HANG_LOG``; junit XML
   ``DIR/gpu_tests.xml``, output ``DIR/gpu_tests.log``, hang tracebacks
   ``DIR/gpu_tests_hangs.log``.
3. ``bench``: ``benchmarks/gpu_capture_memory.py`` (``DIR/gpu_capture_memory.json``,
   rewritten after every row; output ``DIR/gpu_capture_memory.log``), its ``--budget-s``
   the step's time limit less a margin, so it starts no row it cannot finish. On CPU it
   runs the tiny configuration (``DRY_RUN_BENCH_ARGS``); arguments after ``--`` are added
   (later ones win).
4. ``projection``: ``benchmarks/projection_memory.py`` (``DIR/projection_memory.json``,
   ``PROJECTION_ARGS``: bf16, K=3 and 8, plain fc and Eagle3's norm before fc, uncompiled,
   Inductor, and captured in one CUDA graph (the bytes its pool holds: list / packer /
   projected); on CPU one small row per execution), ``--projection-timeout-s``; the bench
   step leaves it that time.
5. ``time``: ``benchmarks/projection_time.py`` (``DIR/projection_time.json``, ``TIME_ARGS``:
   a decode step of 4, 16 and 64 tokens in a CUDA graph and a 2048-token prefill, list /
   packer / projected, bf16 at a 70B TP=8 rank's real widths; on CPU a tiny dry run),
   ``--time-timeout-s``; the bench step leaves it that time too.

A step past its limit gets SIGINT (pytest then writes its junit XML, the benchmark its
JSON), and SIGKILL ``--kill-grace-s`` later; each step's process group gets the signals.
SIGINT or SIGTERM to this script do the same to the running step, then the summary is
written and no further step starts. Every child runs with ``PYTHONFAULTHANDLER=1`` (a crash
prints its traceback) and ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` (a cache hit would skip the
pass). Exit status: 0 when every step exited 0; 2 when the preflight failed; 130 when
interrupted; 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("preflight", "tests", "bench", "projection", "time")
SUMMARY = "gpu_check_summary.json"
#: ``benchmarks/projection_memory.py``'s arguments: bf16, K=3 and 8, the plain fc and Eagle3's
#: norm before fc, uncompiled, under Inductor (list / packer or pass / fused / projected) and
#: captured in a CUDA graph (the bytes its pool holds: list / packer / projected)
PROJECTION_ARGS = ["--dtypes", "bfloat16", "--ks", "3,8", "--combines", "plain,norm_before_fc",
                   "--inners", "module,inductor,cudagraph", "--tokens", "4096", "--scale", "8", "--layers", "12"]
#: ``benchmarks/projection_time.py``'s arguments: one Llama 3.1 70B TP=8 rank at its real widths
#: (hidden 8192), 5 layers, bf16, K=3; decode steps of 4, 16 and 64 tokens each captured in a
#: CUDA graph, a 2048-token prefill eagerly; list / packer / projected (both appends), the plain
#: fc and Eagle3's norm before fc; no Inductor (its compiles would take the step's time)
TIME_ARGS = ["--dtype", "bfloat16", "--scale", "1", "--layers", "5", "--tokens", "4,16,64,2048",
             "--cuda-graph-tokens", "64", "--combines", "plain,norm_before_fc", "--no-inductor", "--repeats", "21"]
DRY_RUN_TIME_ARGS = ["--scale", "64", "--layers", "2", "--tokens", "4,64", "--combines", "plain",
                     "--no-inductor", "--repeats", "3"]
#: and on CPU, for the dry run: one small row
DRY_RUN_PROJECTION_ARGS = ["--dtypes", "float32", "--ks", "3", "--combines", "norm_before_fc",
                           "--inners", "module,eager,cudagraph", "--tokens", "64", "--scale", "64", "--layers", "4"]
#: the benchmark's arguments for the CPU dry run: the tiny model, a few token counts
DRY_RUN_BENCH_ARGS = ["--config", "tiny", "--layers", "3", "--tokens", "64,128",
                      "--runner-tokens", "32,64,128", "--dtype", "float32"]
#: seconds kept back from the overall limit for writing the summary
RESERVE_S = 5.0
#: a step given less than this is not started
MIN_STEP_S = 5.0


def _write_json(path: str, data: Dict[str, Any]) -> None:
    """Written to a temporary file and renamed: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _banner(lines: List[str]) -> None:
    bar = "!" * 78
    print("\n".join([bar, *(f"!!! {line}" for line in lines), bar]), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- preflight


def _version(module: str) -> Optional[str]:
    try:
        mod = __import__(module)
    except Exception as e:  # noqa: BLE001: recorded, not fatal
        return f"not importable ({type(e).__name__}: {e})"[:300]
    return str(getattr(mod, "__version__", "unknown"))


def preflight(device: str, out: str) -> int:
    """Write ``out/preflight.json``; 0 if ``device`` is usable, 2 if not."""
    info: Dict[str, Any] = {
        "time": _now(), "requested_device": device, "python": sys.version,
        "executable": sys.executable, "platform": platform.platform(), "cwd": os.getcwd(),
        "pythonpath": os.environ.get("PYTHONPATH"),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("CUDA_", "TORCH", "COMPILE_PASS_", "NVIDIA_"))},
    }
    problems: List[str] = []
    path = os.path.join(out, "preflight.json")
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"not importable ({type(e).__name__}: {e})"
        problems.append(f"torch cannot be imported: {type(e).__name__}: {e}")
        torch = None  # type: ignore[assignment]
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["torch_git"] = getattr(torch.version, "git_version", None)
    for module in ("triton", "pytest", "hypothesis", "numpy", "transformers", "depyf"):
        info[module] = _version(module)
    if torch is not None:
        try:
            info["cuda_available"] = bool(torch.cuda.is_available())
            info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
            devices = []
            for i in range(info["device_count"]):
                p = torch.cuda.get_device_properties(i)
                devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                "total_memory_bytes": p.total_memory,
                                "multi_processor_count": p.multi_processor_count})
            info["devices"] = devices
        except Exception as e:  # noqa: BLE001
            info["cuda_error"] = f"{type(e).__name__}: {e}"
            info["cuda_available"] = False
        if device == "cuda":
            if not info.get("cuda_available"):
                problems.append("torch.cuda.is_available() is False"
                                + (f" ({info['cuda_error']})" if "cuda_error" in info else ""))
            else:
                try:
                    a = torch.randn(512, 512, device="cuda")
                    info["cuda_smoke"] = f"ok: 512x512 matmul, sum {float((a @ a).sum()):.3f}"
                    torch.cuda.synchronize()
                    stats = torch.cuda.memory_stats()
                    info["requested_bytes_stat"] = "requested_bytes.all.peak" in stats
                    info["cuda_memory_free_total_bytes"] = list(torch.cuda.mem_get_info())
                except Exception as e:  # noqa: BLE001
                    info["cuda_smoke"] = f"failed: {type(e).__name__}: {e}"
                    problems.append(f"a matmul on the CUDA device failed: {type(e).__name__}: {e}")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = (done.stdout + done.stderr)[-6000:]
        except Exception as e:  # noqa: BLE001
            info["nvidia_smi"] = f"failed: {type(e).__name__}: {e}"
    try:
        import compile_pass

        info["compile_pass_from"] = os.path.dirname(os.path.abspath(compile_pass.__file__))
    except Exception as e:  # noqa: BLE001
        info["compile_pass_from"] = None
        problems.append(f"compile_pass cannot be imported (PYTHONPATH=. from the checkout?): "
                        f"{type(e).__name__}: {e}")
    try:
        from importlib import metadata

        info["compile_pass_installed"] = metadata.version("compile-pass")
    except Exception:  # noqa: BLE001: not installed, as on the GPU machine
        info["compile_pass_installed"] = None
    if torch is not None:
        try:
            import torch._dynamo

            torch._dynamo.lookup_backend("aux_capture")
            info["aux_capture_by_name"] = True
        except Exception as e:  # noqa: BLE001
            info["aux_capture_by_name"] = f"no ({type(e).__name__}); not needed: the check uses the object"
    info["problems"] = problems
    info["usable"] = not problems
    _write_json(path, info)
    print(json.dumps({k: info.get(k) for k in ("python", "torch", "torch_cuda", "triton", "pytest",
                                                "hypothesis", "cuda_available", "devices", "cuda_smoke",
                                                "compile_pass_from", "aux_capture_by_name")},
                     indent=1, default=str), flush=True)
    if problems:
        _banner([f"PREFLIGHT FAILED for --device {device}: nothing measured on a GPU."]
                + problems + [f"details: {path}"])
        return 2
    return 0


# --------------------------------------------------------------------------- steps


class Check:
    def __init__(self, args: argparse.Namespace, bench_args: List[str]) -> None:
        self.args = args
        self.bench_args = bench_args
        self.out = os.path.abspath(args.out)
        self.start = time.monotonic()
        self.deadline = self.start + args.timeout_s
        self.stop_signal: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self.summary: Dict[str, Any] = {
            "started": _now(), "device": args.device, "out": self.out, "argv": sys.argv[1:],
            "python": sys.executable, "timeout_s": args.timeout_s, "steps": [], "rc": None,
        }

    # ------------------------------------------------------------------ plumbing

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        env.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0")
        return env

    def save(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.start, 1)
        _write_json(os.path.join(self.out, SUMMARY), self.summary)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is None:
            print(f"\ngpu_check: signal {signum}: stopping the running step, then the summary",
                  file=sys.stderr, flush=True)
        self.stop_signal = signum
        self._signal_step(signal.SIGINT)

    def _signal_step(self, sig: int) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _files(self) -> Dict[str, float]:
        found = {}
        for folder, _, names in os.walk(self.out):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    found[os.path.relpath(path, self.out)] = os.stat(path).st_mtime
                except OSError:
                    pass
        return found

    def run_step(self, name: str, cmd: List[str], limit_s: float, env: Dict[str, str],
                 log_name: str) -> Dict[str, Any]:
        """``cmd`` in its own process group, output to the console and ``log_name``; SIGINT
        at ``limit_s``, SIGKILL ``--kill-grace-s`` later."""
        before = self._files()
        log_path = os.path.join(self.out, log_name)
        record: Dict[str, Any] = {"name": name, "cmd": cmd, "limit_s": round(limit_s, 1),
                                  "log": log_name, "started": _now()}
        print(f"\n=== gpu_check {name}: {' '.join(cmd)} (limit {limit_s:.0f} s)", flush=True)
        start = time.monotonic()
        sigint_at = killed_at = None
        with open(log_path, "wb") as log:
            try:
                self.proc = proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                record.update(rc=None, error=f"could not start: {type(e).__name__}: {e}", seconds=0.0)
                return record

            def tee() -> None:
                assert proc.stdout is not None
                for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                    log.write(chunk)
                    log.flush()
                    try:
                        sys.stdout.buffer.write(chunk)
                        sys.stdout.flush()
                    except (OSError, ValueError):
                        pass

            reader = threading.Thread(target=tee, daemon=True)
            reader.start()
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                if sigint_at is None and (elapsed > limit_s or self.stop_signal is not None):
                    sigint_at = elapsed
                    if self.stop_signal is None:
                        print(f"\n=== gpu_check {name}: {limit_s:.0f} s limit reached: SIGINT",
                              file=sys.stderr, flush=True)
                    self._signal_step(signal.SIGINT)
                elif sigint_at is not None and killed_at is None and elapsed > sigint_at + self.args.kill_grace_s:
                    killed_at = elapsed
                    print(f"\n=== gpu_check {name}: still running {self.args.kill_grace_s:.0f} s after "
                          f"SIGINT: SIGKILL", file=sys.stderr, flush=True)
                    self._signal_step(signal.SIGKILL)
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            reader.join(timeout=10)
            self.proc = None
        after = self._files()
        record.update(
            rc=proc.returncode, seconds=round(time.monotonic() - start, 1),
            timed_out=sigint_at is not None and self.stop_signal is None,
            sigint_sent=sigint_at is not None, sigkill_sent=killed_at is not None,
            files={path: os.path.getsize(os.path.join(self.out, path))
                   for path in sorted(after) if before.get(path) != after[path]
                   and os.path.exists(os.path.join(self.out, path))},
        )
        print(f"=== gpu_check {name}: rc {proc.returncode} after {record['seconds']} s", flush=True)
        return record

    def limit(self, step_timeout: float) -> float:
        return min(step_timeout, self.deadline - time.monotonic() - RESERVE_S)

    # ------------------------------------------------------------------ the steps

    def step_preflight(self) -> Dict[str, Any]:
        cmd = [sys.executable, os.path.abspath(__file__), "--preflight-only", "--device",
               self.args.device, "--out", self.out]
        return self.run_step("preflight", cmd, self.limit(self.args.preflight_timeout_s), self.env(),
                             "preflight.log")

    def step_tests(self) -> Dict[str, Any]:
        env = self.env()
        if self.args.device == "cuda":
            env["COMPILE_PASS_REQUIRE_GPU"] = "1"
        if self.args.test_timeout_s:
            env["COMPILE_PASS_TEST_TIMEOUT_S"] = f"{self.args.test_timeout_s:g}"
        hangs = os.path.join(self.out, "gpu_tests_hangs.log")
        env["COMPILE_PASS_HANG_LOG"] = hangs
        junit = os.path.join(self.out, "gpu_tests.xml")
        for stale in (junit, hangs):
            if os.path.exists(stale):
                os.remove(stale)
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={junit}", "-o", "junit_logging=all"]
        if self.args.marks:
            cmd += ["-m", self.args.marks]
        cmd += self.args.tests
        record = self.run_step("tests", cmd, self.limit(self.args.tests_timeout_s), env, "gpu_tests.log")
        record["junit"] = _junit_counts(junit)
        if os.path.exists(hangs) and os.path.getsize(hangs) == 0:
            os.remove(hangs)
            record.get("files", {}).pop("gpu_tests_hangs.log", None)
        return record

    def step_bench(self) -> Dict[str, Any]:
        later = (self.args.projection_timeout_s if "projection" in self.args.steps else 0.0) + \
            (self.args.time_timeout_s if "time" in self.args.steps else 0.0)
        limit = max(MIN_STEP_S, self.limit(self.args.bench_timeout_s) - later)
        budget = max(1.0, limit - max(10.0, 0.1 * limit))
        out = os.path.join(self.out, "gpu_capture_memory.json")
        if os.path.exists(out):
            os.remove(out)
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_capture_memory.py"),
               "--device", self.args.device, "--budget-s", f"{budget:.0f}", "--out", out]
        if self.args.device == "cpu":
            cmd += DRY_RUN_BENCH_ARGS
        cmd += self.bench_args
        record = self.run_step("bench", cmd, limit, self.env(), "gpu_capture_memory.log")
        record["budget_s"] = round(budget)
        record["rows"] = _bench_counts(out)
        return record

    def step_projection(self) -> Dict[str, Any]:
        return self._benchmark_step("projection", "projection_memory", PROJECTION_ARGS, DRY_RUN_PROJECTION_ARGS,
                                    self.args.projection_timeout_s)

    def step_time(self) -> Dict[str, Any]:
        return self._benchmark_step("time", "projection_time", TIME_ARGS, DRY_RUN_TIME_ARGS, self.args.time_timeout_s)

    def _benchmark_step(self, name: str, script: str, args: List[str], dry_run_args: List[str],
                        timeout_s: float) -> Dict[str, Any]:
        """``benchmarks/<script>.py --device D --out DIR/<script>.json`` with ``args`` (on CPU
        ``dry_run_args``); its output in ``DIR/<script>.log``, its row count recorded."""
        out = os.path.join(self.out, f"{script}.json")
        if os.path.exists(out):
            os.remove(out)
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"), "--device", self.args.device,
               "--out", out]
        cmd += dry_run_args if self.args.device == "cpu" else args
        record = self.run_step(name, cmd, self.limit(timeout_s), self.env(), f"{script}.log")
        if os.path.exists(out):
            with open(out) as f:
                record["rows"] = {"rows": len(json.load(f).get("rows", []))}
        return record

    def run(self) -> int:
        os.makedirs(self.out, exist_ok=True)
        summary_path = os.path.join(self.out, SUMMARY)
        if os.path.exists(summary_path):
            os.remove(summary_path)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        self.save()
        rc = 0
        steps = [s for s in STEPS if s in self.args.steps]
        for name in steps:
            if self.stop_signal is not None:
                self.summary["steps"].append({"name": name, "rc": None,
                                              "not_run": f"stopped by signal {self.stop_signal}"})
                continue
            timeout = {"preflight": self.args.preflight_timeout_s, "tests": self.args.tests_timeout_s,
                       "bench": self.args.bench_timeout_s, "projection": self.args.projection_timeout_s,
                       "time": self.args.time_timeout_s}[name]
            if self.limit(timeout) < MIN_STEP_S:
                self.summary["steps"].append({"name": name, "rc": None,
                                              "not_run": "no time left in --timeout-s"})
                rc = rc or 1
                self.save()
                continue
            try:
                record = getattr(self, f"step_{name}")()
            except Exception as e:  # noqa: BLE001: recorded; the next step runs
                record = {"name": name, "rc": None, "error": f"{type(e).__name__}: {e}"}
            self.summary["steps"].append(record)
            self.save()
            if record.get("rc") != 0:
                rc = rc or 1
            if name == "preflight" and record.get("rc") != 0:
                rc = 2
                for rest in steps[steps.index(name) + 1:]:
                    self.summary["steps"].append({"name": rest, "rc": None,
                                                  "not_run": "the preflight failed (preflight.json)"})
                break
        if self.stop_signal is not None:
            rc = 130
        self.summary["rc"] = rc
        self.summary["finished"] = _now()
        self.save()
        self.report(rc)
        return rc

    def report(self, rc: int) -> None:
        print(f"\n=== gpu_check: rc {rc} in {self.summary['seconds']} s; results in {self.out}")
        for step in self.summary["steps"]:
            extra = step.get("junit") or step.get("rows") or step.get("not_run") or step.get("error") or ""
            flags = [f for f in ("timed_out", "sigkill_sent") if step.get(f)]
            print(f"    {step['name']:9} rc {step.get('rc')!s:5} {step.get('seconds', '')!s:>7} s "
                  f"{' '.join(flags)} {extra}")
        if rc == 2:
            _banner(["gpu_check: the preflight failed: no GPU result in this run "
                     f"({os.path.join(self.out, 'preflight.json')})"])


def _junit_counts(path: str) -> Optional[Dict[str, Any]]:
    """Totals of a junit XML file and the failed tests' names; None if there is none."""
    if not os.path.exists(path):
        return None
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as e:
        return {"error": f"unreadable junit XML: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites)
              for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failed"] = failed
    return counts


def _bench_counts(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        return {"error": f"unreadable benchmark JSON: {e}"}
    rows = saved.get("rows", [])
    return {"rows": len(rows), "errors": [r["name"] for r in rows if r.get("error")],
            "not_bitwise_equal": [r["name"] for r in rows if r.get("bitwise_equal") is False],
            "skipped": len(saved.get("skipped", [])), "complete": saved.get("complete"),
            "interrupted": saved.get("interrupted")}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: List[str] = []
    if "--" in argv:
        bench_args = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda: the GPU check; cpu: its dry run (no CUDA needed, tiny benchmark)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-results",
                        help="folder for every result (default: $OUT, else bench-results)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma list, in this order: {', '.join(STEPS)}")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="the whole check")
    parser.add_argument("--preflight-timeout-s", type=float, default=120.0)
    parser.add_argument("--tests-timeout-s", type=float, default=180.0)
    parser.add_argument("--test-timeout-s", type=float, default=90.0,
                        help="each test (COMPILE_PASS_TEST_TIMEOUT_S); 0: none")
    parser.add_argument("--bench-timeout-s", type=float, default=600.0,
                        help="the benchmark (also bounded by what --timeout-s leaves)")
    parser.add_argument("--projection-timeout-s", type=float, default=120.0,
                        help="the per-capture projection rows (benchmarks/projection_memory.py)")
    parser.add_argument("--time-timeout-s", type=float, default=90.0,
                        help="the forward times, decode and prefill (benchmarks/projection_time.py)")
    parser.add_argument("--kill-grace-s", type=float, default=20.0,
                        help="seconds from a step's SIGINT to its SIGKILL")
    parser.add_argument("--tests", nargs="+", default=["tests"], help="pytest paths or node ids")
    parser.add_argument("--marks", default="gpu", help="pytest -m expression ('' for none)")
    parser.add_argument("--preflight-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.preflight_only:
        os.makedirs(args.out, exist_ok=True)
        return preflight(args.device, args.out)
    args.steps = args.steps.split(",")
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    for name in ("timeout_s", "preflight_timeout_s", "tests_timeout_s", "bench_timeout_s", "projection_timeout_s",
                 "time_timeout_s", "kill_grace_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name[:-2].replace('_', '-')}-s must be > 0")
    if args.test_timeout_s < 0:
        parser.error("--test-timeout-s must be >= 0")
    return Check(args, bench_args).run()


if __name__ == "__main__":
    sys.exit(main())
