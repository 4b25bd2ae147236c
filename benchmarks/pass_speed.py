"""The capture pass's own time on DeepSeek-V3-shaped graphs of 16, 32 and 61 layers.

Each model is built on the meta device (bf16, DeepSeek-V3 dimensions, ``num_layers``
overridden, Eagle3 captures), traced once with fake tensors (token count symbolic) into the
graph a pass sees, and the pass runs ``--repeats`` times, each on a fresh node-for-node copy
of that graph, as the backend runs it (``estimate=False``). The rows (``--inners``):

- ``eager``: the Dynamo graph, target ``dynamo`` (the eager inner);
- ``aot_eager``: AOTAutograd's forward graph, target ``aot``;
- ``inductor``: the Dynamo graph, target ``dynamo_lifted``: what the inductor inner runs
  before AOTAutograd (Inductor's cost model, buffers priced as lifted, twins merged);
- ``inductor_twins``: ``CaptureTwinsPass`` on AOTAutograd's forward graph, the functional
  aten graph Inductor's post-grad pre pass sees: what the inductor inner runs after it;
- ``post_grad``: ``AuxCapturePass`` (target ``post_grad``: Inductor's cost model and
  hoisting) on that aten graph, as a user who sets it in Inductor's config runs it.

Reported per graph: wall time (``PassResult.seconds``) and CPU time of the process
(``time.process_time``, less disturbed by other jobs on a shared machine), minimum and
median, both without the regeneration of a rewritten module's code (``codegen ms``, shown
apart: running or compiling the rewritten module needs it in any case); ms per layer; a least-squares line ms = a + b * layers with its R^2; the Python
function calls of one run per node (the work: constant per node when the pass is linear)
and the time per node of a trivial sweep over the graph (what merely reading a node costs
at that graph size).

    python benchmarks/pass_speed.py --out docs/results/pass_speed.json
    python benchmarks/pass_speed.py --inners eager --layers 16,61 --profile   # cProfile, largest graph
    python benchmarks/pass_speed.py --render docs/results/pass_speed.json
    python benchmarks/pass_speed.py --repo /tmp/before   # time another checkout's compile_pass
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import pstats
import statistics
import sys
import time
import timeit
from typing import Any, Dict, List, Optional, Tuple

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _repo_from_argv(argv: List[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--repo" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if arg.startswith("--repo="):
            return os.path.abspath(arg.split("=", 1)[1])
    return _HERE


sys.path.insert(0, _repo_from_argv(sys.argv[1:]))

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
from compile_pass.backend import AuxCaptureBackend  # noqa: E402
from compile_pass.capture_pass import PassResult, copy_graph, run_capture_pass  # noqa: E402
from models.deepseek import DeepseekModel, deepseek_v3_config  # noqa: E402

TOKENS = 4096


class _Recorder(AuxCaptureBackend):
    """The aux_capture backend with its pass replaced by a recorder of (graph, target)."""

    graphs: List[Tuple[fx.GraphModule, str]]

    def _rewrite(self, gm: fx.GraphModule, target: str, *args: Any, **kwargs: Any) -> None:
        self.graphs.append((gm, target))


#: row -> the inner whose graph it is timed on, and what runs on it (a pass target, or
#: TWINS: Inductor's pre pass)
TWINS = "twins"
#: ``--keep-code-before``: run the working-copy target as the backend does (the graph's code
#: before the rewrite generated during the pass, for the results and the diff tool)
KEEP_CODE_BEFORE = False
_ROWS = {"eager": ("eager", "dynamo"), "aot_eager": ("aot_eager", "aot"),
         "inductor": ("eager", "dynamo_lifted"), "inductor_twins": ("aot_eager", TWINS),
         "post_grad": ("aot_eager", "post_grad")}


def run_timed(gm: fx.GraphModule, target: str, original: Optional[fx.Graph] = None) -> PassResult:
    """One run of ``target`` on ``gm`` (in place), as a PassResult (``seconds``: wall time).
    ``original``: the graph ``gm`` copies, which this script owns: the code before is then
    generated only if read (the backend cannot do that with Dynamo's graph and generates it
    during the pass: ``--keep-code-before`` times that)."""
    if target != TWINS:
        if original is not None and not KEEP_CODE_BEFORE \
                and "original" in inspect.signature(run_capture_pass).parameters:
            return run_capture_pass(gm, target, original=original)
        return run_capture_pass(gm, target)
    from compile_pass.twins import merge_capture_twins

    start = time.perf_counter()
    merges = merge_capture_twins(gm.graph)
    result = PassResult(TWINS, [], "", None, seconds=time.perf_counter() - start)
    result.counts = {"twins_merged": len(merges)}
    return result


def trace(num_layers: int, inner: str) -> Tuple[fx.GraphModule, str]:
    """The graph the pass sees under ``inner`` for a ``num_layers`` DeepSeek-V3 on meta."""
    with torch.device("meta"):
        model = DeepseekModel(deepseek_v3_config(num_layers=num_layers), capture_mode="list",
                              dtype=torch.bfloat16).eval()
    inputs = (torch.zeros(TOKENS, dtype=torch.long, device="meta"), torch.arange(TOKENS, device="meta"))
    for t in inputs:
        torch._dynamo.mark_dynamic(t, 0)
    backend = _Recorder(inner=inner)
    backend.graphs = []
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    [(gm, target)] = backend.graphs
    return gm, target


def _fresh(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy_graph(gm.graph)[0])


def time_pass(gm: fx.GraphModule, target: str, repeats: int) -> Dict[str, Any]:
    run_timed(_fresh(gm), target, gm.graph)  # warm-up: op schemas, caches, imports
    wall: List[float] = []
    cpu: List[float] = []
    result = None
    for _ in range(repeats):
        copy = _fresh(gm)
        start = time.process_time()
        result = run_timed(copy, target, gm.graph)
        # the pass's own time: not the codegen of a changed module, which compiling needs anyway
        cpu.append(time.process_time() - start - result.codegen_cpu_seconds)
        wall.append(result.seconds)
    assert result is not None
    profiler = cProfile.Profile()
    copy = _fresh(gm)
    profiler.enable()
    run_timed(copy, target, gm.graph)
    profiler.disable()
    return {"wall_ms": [1000 * s for s in wall], "cpu_ms": [1000 * s for s in cpu],
            "codegen_ms": 1000 * result.codegen_seconds,
            "groups": len(result.groups), "rewritten": result.changed, "error": result.error,
            "python_calls": pstats.Stats(profiler).total_calls,
            "sweep_us_per_node": sweep_us_per_node(gm)}


def sweep_us_per_node(gm: fx.GraphModule) -> float:
    """Time per node of a trivial sweep (each node's inputs and fake value), best of 20: what
    reading a node costs on this machine at this graph size. It grows with the graph (cache
    misses on a larger working set) although the work per node is the same."""
    nodes = list(gm.graph.nodes)

    def sweep() -> None:
        for n in nodes:
            n.all_input_nodes
            n.meta.get("val", n.meta.get("example_value"))

    return 1e6 * min(timeit.repeat(sweep, number=1, repeat=20)) / len(nodes)


def calibration_us() -> float:
    """This machine's speed at plain Python: 1000 dict lookups, best of 5 (microseconds), to
    compare runs on different machines or under different load."""
    setup = "d = {i: i for i in range(1000)}"
    return 1e6 * min(timeit.repeat("for i in range(1000): d[i]", setup, number=2000, repeat=5)) / 2000


def fit(xs: List[float], ys: List[float]) -> Dict[str, float]:
    """Least squares ``y = a + b x`` and its R^2."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"a_ms": a, "b_ms_per_layer": b, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per inner: fits of min wall and min CPU ms against layers, and t(max)/t(min) vs the
    layer ratio."""
    fits = []
    for inner in sorted({r["inner"] for r in rows}):
        sub = sorted((r for r in rows if r["inner"] == inner), key=lambda r: r["layers"])
        if len(sub) < 2:
            continue
        layers = [r["layers"] for r in sub]
        entry: Dict[str, Any] = {"inner": inner, "layers": layers}
        for clock in ("wall", "cpu"):
            ms = [min(r[f"{clock}_ms"]) for r in sub]
            entry[clock] = {**fit(layers, ms), "ratio": ms[-1] / ms[0], "layer_ratio": layers[-1] / layers[0]}
        fits.append(entry)
    return fits


def format_table(rows: List[Dict[str, Any]], fits: List[Dict[str, Any]]) -> str:
    table = _report.markdown_table(
        ("graph", "layers", "nodes", "groups", "rewritten", "wall ms min / median", "CPU ms min / median",
         "CPU ms per layer", "codegen ms", "Python calls per node", "node sweep us per node"),
        [(r["target"], r["layers"], r["nodes"], r["groups"], "yes" if r["rewritten"] else "no",
          f"{min(r['wall_ms']):.0f} / {statistics.median(r['wall_ms']):.0f}",
          f"{min(r['cpu_ms']):.0f} / {statistics.median(r['cpu_ms']):.0f}",
          f"{min(r['cpu_ms']) / r['layers']:.2f}",
          f"{r['codegen_ms']:.0f}" if r.get("codegen_ms") else "",
          f"{r['python_calls'] / r['nodes']:.1f}" if "python_calls" in r else "",
          f"{r['sweep_us_per_node']:.2f}" if "sweep_us_per_node" in r else "") for r in rows])
    if not fits:
        return table
    return table + "\n\n" + _report.markdown_table(
        ("graph", "clock", "fit ms = a + b * layers", "R^2", "t(max) / t(min)", "layers ratio"),
        [(f["inner"], clock, f"{f[clock]['a_ms']:.1f} + {f[clock]['b_ms_per_layer']:.2f} * L",
          f"{f[clock]['r2']:.3f}", f"{f[clock]['ratio']:.2f}", f"{f[clock]['layer_ratio']:.2f}")
         for f in fits for clock in ("wall", "cpu")])


def format_calibration(us: float) -> str:
    return f"calibration: 1000 dict lookups in {us:.1f} us"


def format_saved(saved: Dict[str, Any]) -> str:
    """A saved run (``--render``): the tables, then the machine's calibration if recorded."""
    text = format_table(saved["rows"], saved["fits"])
    if "calibration_us" in saved:
        text += "\n\n" + format_calibration(saved["calibration_us"])
    return text


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="16,32,61")
    parser.add_argument("--inners", default=",".join(_ROWS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile one pass on the largest graph")
    parser.add_argument("--repo", default=_HERE, help="checkout whose compile_pass and models to time")
    parser.add_argument("--keep-code-before", action="store_true",
                        help="generate the code before during the pass, as the backend does")
    _report.add_output_args(parser, render_help="print an earlier run's JSON as markdown tables, run nothing")
    args = parser.parse_args(argv)
    global KEEP_CODE_BEFORE
    KEEP_CODE_BEFORE = args.keep_code_before
    if args.render:
        return _report.render(args.render, "python benchmarks/pass_speed.py", format_saved)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    layer_counts = sorted(int(n) for n in args.layers.split(","))
    inners = args.inners.split(",")
    for inner in inners:
        if inner not in _ROWS:
            parser.error(f"--inners: {inner!r} is not one of {', '.join(_ROWS)}")
    rows: List[Dict[str, Any]] = []
    for layers in layer_counts:
        traces: Dict[str, Tuple[fx.GraphModule, float]] = {}  # one trace per graph kind
        for inner in inners:
            traced_as, target = _ROWS[inner]
            if traced_as not in traces:
                start = time.perf_counter()
                traces[traced_as] = (trace(layers, traced_as)[0], time.perf_counter() - start)
            gm, traced = traces[traced_as]
            row = {"inner": inner, "target": target, "layers": layers, "nodes": len(gm.graph.nodes),
                   "trace_seconds": traced, **time_pass(gm, target, args.repeats)}
            rows.append(row)
            print(f"{inner:9} {layers:3d} layers {row['nodes']:6d} nodes: pass CPU min "
                  f"{min(row['cpu_ms']):.0f} ms, wall min {min(row['wall_ms']):.0f} ms "
                  f"(trace {traced:.0f} s)", flush=True)
            if args.profile and layers == layer_counts[-1]:
                profiler = cProfile.Profile()
                copy = _fresh(gm)
                profiler.enable()
                run_timed(copy, target, gm.graph)
                profiler.disable()
                out = io.StringIO()
                stats = pstats.Stats(profiler, stream=out)
                stats.sort_stats("cumulative").print_stats("compile_pass", 12)  # the stages
                stats.sort_stats("tottime").print_stats(12)  # the hot functions
                print(out.getvalue())
            del gm
        del traces
    fits = summarize(rows)
    calibration = calibration_us()
    print()
    print(format_table(rows, fits))
    print(f"\n{format_calibration(calibration)}")
    _report.write_out(args.out, {"repo": os.path.abspath(args.repo), "calibration_us": calibration,
                                 "rows": rows, "fits": fits}, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
