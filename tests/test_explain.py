"""The graph-diff tool: ``compile_pass.explain()`` and ``python -m compile_pass diff``.

Budget (< 60 s on 2 cores): the CLI runs as subprocesses (``sys.executable -m compile_pass
diff ...`` from the repo root), each paying ~3 s of imports, so there are nine of them, all
started once, a few at a time, by the module-scoped ``cli`` fixture: the DFlash
capture-dominated model at 512 tokens (where the pass rewrites 8 captures of
``aux.append(hidden_states + residual)``; also under ``TORCH_TRACE``), the three reference
models (the tiny Llama one also without matplotlib and with a stand-in depyf), and the five
bad inputs. Other argument errors go through ``main()`` in process. Everything uses the
eager inner.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]

import compile_pass  # noqa: E402
import models.dflash  # noqa: E402
import models.llama  # noqa: E402
from compile_pass.explainer import ExplainReport, ModelRunError, explain, trace_pass_result  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ANSI = re.compile(r"\x1b\[")
CAPTURE_SOURCE = "aux.append(hidden_states + residual)"
REFERENCE_MODELS = ("models.llama:tiny", "models.deepseek:tiny", "models.dflash:tiny")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- CLI runs


@dataclass
class Run:
    args: List[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def error_lines(self) -> List[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def _run(args: List[str], env: Optional[Dict[str, str]] = None) -> Run:
    full_env = dict(os.environ)
    full_env.pop("TORCH_TRACE", None)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # several runs share the cores
    full_env.update(env or {})
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "compile_pass", "diff", *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=180)
    return Run(args, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


_FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn

    def wrong_type(tokens=4):
        return 42

    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("boom from the model")

    def raises(tokens=4):
        return Raises(), (torch.randn(tokens, 8),)
''')

# stand-ins on PYTHONPATH for the fallback run: a depyf whose prepare_debug records that it
# ran, and a matplotlib that cannot be imported
_FAKE_DEPYF = textwrap.dedent('''
    import contextlib, os

    @contextlib.contextmanager
    def prepare_debug(dump_src_dir):
        os.makedirs(dump_src_dir, exist_ok=True)
        yield
        open(os.path.join(dump_src_dir, "fake_depyf_ran"), "w").close()
''')


@pytest.fixture(scope="module", autouse=True)
def _cli_runs_started(request, tmp_path_factory):
    """Start every CLI invocation of this module (3 at a time, in the background, so the
    in-process tests run meanwhile), if any selected test of the module reads them."""
    if not any("cli" in item.fixturenames and item.path == request.path
               for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("explain_cli")
    factories = tmp / "factories.py"
    factories.write_text(_FACTORIES)
    fakes = tmp / "fakes"
    (fakes / "depyf").mkdir(parents=True)
    (fakes / "depyf" / "__init__.py").write_text(_FAKE_DEPYF)
    (fakes / "matplotlib").mkdir()
    (fakes / "matplotlib" / "__init__.py").write_text('raise ImportError("matplotlib hidden")\n')
    pythonpath = os.pathsep.join([str(fakes), str(REPO)])

    specs: Dict[str, Tuple[List[str], Optional[Dict[str, str]]]] = {
        "dflash": (["models.dflash:capture_dominated", "--tokens", "512", "--no-color",
                    "--out", str(tmp / "out")], {"TORCH_TRACE": str(tmp / "trace")}),
        "unknown_module": (["no_such_module_xyz:tiny"], None),
        "missing_factory": (["models.llama:no_such_factory"], None),
        "bad_path": ([str(tmp / "does_not_exist.py") + ":tiny"], None),
        "wrong_type": ([f"{factories}:wrong_type"], None),
        "model_raises": ([f"{factories}:raises"], None),
        # the tiny Llama reference run doubles as the no-matplotlib / --depyf run
        "models.llama:tiny": (["models.llama:tiny", "--no-color", "--depyf", "--out",
                               str(tmp / "fallback")], {"PYTHONPATH": pythonpath}),
        "models.deepseek:tiny": (["models.deepseek:tiny", "--no-color"], None),
        "models.dflash:tiny": (["models.dflash:tiny", "--no-color"], None),
        "fuse_projection": (["models.draft_input:tiny", "--fuse-projection", "--no-color"], None),
    }
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {name: pool.submit(_run, args, env) for name, (args, env) in specs.items()}
    yield tmp, futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def cli(_cli_runs_started) -> Dict[str, Run]:
    """The CLI runs by name (waits for them all)."""
    _, futures = _cli_runs_started
    return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def cli_tmp(_cli_runs_started, cli) -> Path:
    """The folder the CLI runs wrote into (after they finished)."""
    return _cli_runs_started[0]


# --------------------------------------------------------------------------- explain() API


@pytest.fixture(scope="module")
def report() -> ExplainReport:
    """The tiny Llama with the cost model off: its 3-capture group is rewritten (the
    estimate says it would not pay at 16 tokens), RoPE's joins are rejected."""
    model, inputs = models.llama.tiny(tokens=16)
    return explain(model, *inputs, inner="eager", cost_model=False, name="llama-tiny")


def test_explain_is_exported():
    assert compile_pass.explain is explain
    assert "explain" in compile_pass.__all__


def test_explain_report(report):
    assert len(report.graphs) == 1
    graph = report.graphs[0]
    assert graph.index == 0 and graph.result.changed
    assert graph.peak_before is not None and graph.peak_after is not None
    assert graph.writes[0] == "aux_packed" and len(graph.writes) == 1 + 3  # alloc + 3 writes
    assert len(graph.producers()) == 3

    data = json.loads(report.to_json())
    assert data["graphs"][0]["groups"][-1]["decision"] == "rewrite"
    assert data["graphs"][0]["timeline_before"]["peak_bytes"] == graph.peak_before
    assert data["measured"] is None

    text = report.to_text()
    assert "rewrite" in text and "reject" in text
    assert "rewritten because the cost model is off" in text
    assert "all captures come out of one block" in text  # RoPE's rotate-half joins
    assert all(g.reason for g in graph.groups)
    assert CAPTURE_SOURCE in text
    assert "+++ graph_0_after.py" in text
    assert not ANSI.search(text)
    colored = report.to_text(color=True)
    assert ANSI.search(colored)
    assert re.sub(r"\x1b\[[0-9;]*m", "", colored) == text


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib is not installed")
def test_plot_writes_a_png(report, tmp_path):
    path = tmp_path / "timeline.png"
    report.plot(path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_is_a_clear_error(report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="plot\\(\\) needs matplotlib"):
        report.plot(tmp_path / "x.png")


def test_trace_artifacts_without_torch_trace(report, monkeypatch):
    monkeypatch.delenv("TORCH_TRACE", raising=False)
    trace_pass_result(report.graphs[0].result)  # a no-op, must not fail


def test_explain_bad_options():
    model, inputs = models.llama.tiny(tokens=8)
    with pytest.raises(ValueError, match=r"split op 'attention' is not of the form 'namespace::op'"):
        explain(model, *inputs, split_ops=["attention"])
    with pytest.raises(ValueError, match="unknown inner"):
        explain(model, *inputs, inner="nope")


def test_explain_split_ops_notes_the_pieces_and_missing_ops():
    model, inputs = models.dflash.tiny(tokens=16, num_layers=4, k=3)
    with pytest.warns(UserWarning, match="never appears"):
        report = explain(model, *inputs, split_ops=["models::attention", "models::add_rms_norm"],
                         cost_model=False)
    text = report.to_text(color=False)
    assert "split into 5 compiled pieces at models::attention x4, models::add_rms_norm x0" in text
    assert "split op 'models::add_rms_norm' never appears in this graph" in text
    assert any(g.decision.value == "rewrite" for g in report.graphs[-1].result.groups)


def _three_captures(x: torch.Tensor, w: torch.Tensor):
    captures, h = [], x
    for _ in range(3):
        h = torch.relu(h @ w)
        captures.append(h + x)
    return h, torch.cat(captures, dim=-1)


def test_explain_measure_reports_both_peaks():
    x, w = torch.randn(256, 64), torch.randn(64, 64) / 8
    report = explain(_three_captures, x, w, dynamic=False, measure=True)
    m = report.measured
    assert m is not None and m.device == "cpu"
    assert m.without_pass > 0 and m.with_pass > 0
    assert m.ratio == pytest.approx(m.with_pass / m.without_pass)
    assert "measured peak (cpu" in report.to_text()
    assert json.loads(report.to_json())["measured"]["with_pass_bytes"] == m.with_pass
    assert report.model_name == "_three_captures"


def test_explain_model_that_raises():
    class Raises(nn.Module):
        def forward(self, x):
            raise RuntimeError("broken model")

    with pytest.raises(ModelRunError, match="the model failed to compile or run: RuntimeError: broken model"):
        explain(Raises(), torch.randn(4, 4))


# --------------------------------------------------------------------------- CLI tests


@pytest.mark.slow
def test_cli_diff_shows_the_rewrite(cli):
    run = cli["dflash"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    added = [line for line in out.splitlines() if line.startswith("+") and "aux_packed" in line]
    assert added, out
    assert any(line.startswith("-") and not line.startswith("---") for line in out.splitlines())
    # the groups table names the captures' source lines and the decision
    assert CAPTURE_SOURCE in out
    assert re.search(r"^\s+\d+\s+cat\S*\s+8\s+8x256\s+float32\s+4\.0 MiB\s+rewrite\s+estimated peak",
                     out, re.M), out
    assert "reject" in out  # RoPE's rotate-half joins are found and left alone, with a reason
    assert re.search(r"estimated peak: before [\d.]+ MiB .*after [\d.]+ MiB", out)


def test_cli_fuse_projection_shows_the_projection(cli):
    """``--fuse-projection``: the captures go into the draft's accumulator, the concat and
    fc leave the graph, and the table says so."""
    run = cli["fuse_projection"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert re.search(r"^\s+0\s+packed\s+3\s+3x128\s+float32\s+\S+ KiB\s+rewrite\s+projected into the "
                     r"draft's accumulator", out, re.M), out
    added = [line for line in out.splitlines() if line.startswith("+")]
    assert sum("compile_pass.project_into_" in line for line in added) == 3, out
    assert any(line.startswith("-") and "torch.cat" in line for line in out.splitlines()), out


def test_cli_no_color_has_no_ansi(cli):
    run = cli["dflash"]
    assert run.returncode == 0
    assert not ANSI.search(run.stdout)


def test_cli_out_writes_graphs_report_and_timeline(cli_tmp):
    out = cli_tmp / "out"
    before, after = (out / "graph_0_before.py").read_text(), (out / "graph_0_after.py").read_text()
    assert "torch.cat" in before and "aux_packed" not in before
    assert "aux_packed" in after
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "models.dflash:capture_dominated"
    groups = report["graphs"][0]["groups"]
    rewritten = [g for g in groups if g["decision"] == "rewrite"]
    assert len(rewritten) == 1 and rewritten[0]["k"] == 8
    assert all({"k", "decision", "reason", "widths", "packed_bytes", "captures"} <= set(g)
               for g in groups)
    assert all(c["source"].endswith(CAPTURE_SOURCE) for c in rewritten[0]["captures"])
    graph = report["graphs"][0]
    assert graph["estimated_peak_after"] < graph["estimated_peak_before"]
    assert len(graph["timeline_after"]["live_bytes"]) == len(graph["timeline_after"]["node_names"])
    if _has_matplotlib():
        assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_trace_artifacts_under_torch_trace(cli_tmp):
    trace = cli_tmp / "trace"
    text = "".join(p.read_text() for p in trace.iterdir())
    assert '"name": "aux_capture_before"' in text and '"name": "aux_capture_after"' in text


def test_cli_without_matplotlib_and_with_depyf(cli, cli_tmp):
    """No matplotlib: a one-line note, no timeline.png, status 0. --depyf wraps the compile
    and the graphs are also written next to depyf's files."""
    run = cli["models.llama:tiny"]
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert "timeline.png not written: matplotlib is not installed" in run.stderr
    out = cli_tmp / "fallback"
    assert not (out / "timeline.png").exists()
    assert (out / "report.json").exists() and (out / "graph_0_after.py").exists()
    assert (out / "depyf" / "fake_depyf_ran").exists()
    assert (out / "depyf" / "graph_0_before.py").exists()


@pytest.mark.parametrize("name, message", [
    ("unknown_module", "cannot import module 'no_such_module_xyz'"),
    ("missing_factory", "has no factory 'no_such_factory' (its factories: tiny, capture_dominated)"),
    ("bad_path", "model file not found"),
    ("wrong_type", "must return (model, example_inputs)"),
    ("model_raises", "the model failed to compile or run: ValueError: boom from the model"),
])
def test_cli_bad_input_is_one_line_exit_2(cli, name, message):
    run = cli[name]
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    lines = run.error_lines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("compile-pass: error: ")
    assert message in lines[0]


@pytest.mark.parametrize("spec", REFERENCE_MODELS)
def test_cli_reference_models(cli, spec):
    run = cli[spec]
    assert run.returncode == 0, run.stderr
    assert re.search(r"^\s+#\s+concat\s+K\s+widths\s+dtype\s+packed\s+decision\s+reason",
                     run.stdout, re.M), run.stdout
    assert "estimated peak: before" in run.stdout


@pytest.mark.parametrize("argv, message", [
    (["models.llama:tiny", "--inner", "nope"], "argument --inner: invalid choice: 'nope'"),
    (["models.llama:tiny", "--tokens", "0"], "expected a positive integer, got '0'"),
    (["models.llama:tiny", "--split-ops", "attention"],
     "split op 'attention' is not of the form 'namespace::op'"),
    (["models.llama:tiny", "--depyf"], "--depyf needs --out DIR"),
    (["models.llama"], "MODEL must be module:factory or path/to/file.py:factory"),
    (["models.llama:FACTORY_NAMES"], "models.llama:FACTORY_NAMES is not callable (a tuple)"),
])
def test_main_argument_errors_are_one_line(argv, message, capsys):
    from compile_pass.__main__ import main

    try:
        status = main(["diff", *argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    captured = capsys.readouterr()
    assert status == 2
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("compile-pass: error: "), captured.err
    assert message in lines[0]
    assert captured.out == ""
