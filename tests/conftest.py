"""Shared fixtures and the switches ``benchmarks/gpu_check.py`` runs the GPU tests with.

Environment variables (all off by default; ``make test`` sets none):

- ``COMPILE_PASS_REQUIRE_GPU=1``: a test marked ``gpu`` that would be skipped (no CUDA, or
  any other skip) fails instead, with the skip's reason: under ``make gpu-check`` a green
  run means the GPU tests ran.
- ``COMPILE_PASS_TEST_TIMEOUT_S=N``: each test (setup, call and teardown) gets N seconds.
  Past them the tracebacks of all threads are written to stderr (and to
  ``COMPILE_PASS_HANG_LOG``, a file, when set) and the test fails with a ``Failed``
  raised where it hung (SIGALRM), so the run goes on and its junit XML is written. If the
  test is stuck where no Python signal handler runs (inside a C call), faulthandler dumps
  the tracebacks again after ``COMPILE_PASS_TEST_TIMEOUT_GRACE_S`` more seconds (default
  20) and ends the process (set ``COMPILE_PASS_HANG_LOG`` to keep that dump: pytest's
  captured stderr is lost with the process).
"""

import faulthandler
import os
import signal
import sys
from typing import IO, Optional

import pytest
import torch
from torch._dynamo.utils import counters

REQUIRE_GPU_ENV = "COMPILE_PASS_REQUIRE_GPU"
TIMEOUT_ENV = "COMPILE_PASS_TEST_TIMEOUT_S"
GRACE_ENV = "COMPILE_PASS_TEST_TIMEOUT_GRACE_S"
HANG_LOG_ENV = "COMPILE_PASS_HANG_LOG"


def pytest_addoption(parser):
    """``--fuzz-cases N``: run N differential fuzz cases in tests/test_fuzz.py (``make fuzz``)."""
    parser.addoption("--fuzz-cases", action="store", type=int, default=0,
                     help="number of random fuzz cases for tests/test_fuzz.py (0: skip that test)")


@pytest.fixture
def _fresh_dynamo():
    """The test starts from a clean Dynamo cache and clean counters, without autograd. Test
    files that want it for every test say ``pytestmark = pytest.mark.usefixtures("_fresh_dynamo")``."""
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- gpu-check switches


def _seconds(name: str, default: float = 0.0) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise pytest.UsageError(f"{name}={value!r}: expected a number of seconds") from None
    if seconds < 0:
        raise pytest.UsageError(f"{name}={value!r}: expected a number of seconds >= 0")
    return seconds


def _require_gpu() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "").strip() not in ("", "0")


_hang_log: Optional[IO[str]] = None


def _hang_files():
    """Where hang tracebacks go: stderr, and the ``COMPILE_PASS_HANG_LOG`` file if set."""
    global _hang_log
    path = os.environ.get(HANG_LOG_ENV)
    if path and _hang_log is None:
        _hang_log = open(path, "a")
    return [f for f in (sys.stderr, _hang_log) if f is not None]


def _write_hang(message: str) -> None:
    for f in _hang_files():
        try:
            f.write(message)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
        except (OSError, ValueError):  # a closed or odd stream: the other one still gets it
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timeout = _seconds(TIMEOUT_ENV)
    if not timeout or not hasattr(signal, "SIGALRM"):
        yield
        return
    grace = _seconds(GRACE_ENV, 20.0)

    def on_timeout(signum, frame):
        _write_hang(f"\n+++ {TIMEOUT_ENV}={timeout:g}: {item.nodeid} is still running; "
                    f"tracebacks of all threads:\n")
        pytest.fail(f"{item.nodeid} timed out after {timeout:g} s ({TIMEOUT_ENV})", pytrace=True)

    previous = signal.signal(signal.SIGALRM, on_timeout)
    # the last resort writes to the hang log if there is one: stderr may be pytest's capture
    # file, lost when faulthandler ends the process
    faulthandler.dump_traceback_later(timeout + grace, exit=True, file=_hang_files()[-1])
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not _require_gpu() or item.get_closest_marker("gpu") is None:
        return
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"{REQUIRE_GPU_ENV}=1 (make gpu-check): this gpu test was skipped, which "
                           f"counts as a failure here; torch.cuda.is_available() = "
                           f"{torch.cuda.is_available()}; the skip: {reason}")
