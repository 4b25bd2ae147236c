"""``explain()``: what the capture pass did to a model's graphs, as text, JSON and a plot.

    report = compile_pass.explain(model, *example_inputs, inner="eager")
    print(report.to_text())          # groups table, unified diff, estimated peaks
    report.plot("timeline.png")      # estimated live bytes before vs after (matplotlib)

It compiles the model with the ``aux_capture`` backend (the pass recording whole-graph
memory timelines, ``run_capture_pass(..., estimate=True)``), runs it once under
``torch.no_grad()`` and keeps, per compiled graph, the ``PassResult`` and where the
captures are produced (before) and written into the packed buffer (after).
``python -m compile_pass diff`` is the command-line front end (``compile_pass/__main__.py``).

With ``TORCH_TRACE=dir`` each graph's code before and after the pass is also logged as the
structured-trace artifacts ``aux_capture_before`` / ``aux_capture_after`` (and the groups as
``aux_capture_groups``), which ``tlparse`` shows next to Dynamo's own artifacts.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from compile_pass.backend import INNERS, AuxCaptureBackend
from compile_pass.result import PassResult
from compile_pass.groups import CaptureGroup, Decision
from compile_pass.liveness import MemoryTimeline
from compile_pass.rewrite import BUFFER_NAME

__all__ = ["ExplainReport", "GraphExplain", "MeasuredPeaks", "ModelRunError", "explain",
           "trace_pass_result"]

_WRITES = (torch.ops.compile_pass.write_slice_.default, torch.ops.compile_pass.binary_into_slice_.default)


class ModelRunError(RuntimeError):
    """The model, compiled with the aux_capture backend, raised while compiling or running."""


# --------------------------------------------------------------------------- recording


def trace_pass_result(result: PassResult) -> None:
    """Log ``result``'s code before/after (and its groups) as structured-trace artifacts.

    Written only when structured tracing is on (``TORCH_TRACE=dir``); otherwise a no-op.
    Called while the graph is being compiled, so ``tlparse`` files the artifacts under the
    right compile id.
    """
    from torch._logging import trace_structured

    artifacts = (
        ("aux_capture_before", "string", lambda: result.code_before),
        ("aux_capture_after", "string", lambda: result.code_after),
        ("aux_capture_groups", "json",
         lambda: json.dumps([g.to_dict() for g in result.groups])),
    )
    for name, encoding, payload in artifacts:
        trace_structured(
            "artifact",
            metadata_fn=lambda name=name, encoding=encoding: {"name": name, "encoding": encoding},
            payload_fn=payload,
        )


def _packed_writes(graph: fx.Graph) -> List[str]:
    """Names of the nodes of a rewritten graph that allocate or write a packed buffer."""
    names = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        out = node.kwargs.get("out")
        if node.name.startswith(BUFFER_NAME) and not node.name.startswith(BUFFER_NAME + "_slot"):
            names.append(node.name)  # the allocation
        elif node.target in _WRITES or (isinstance(out, fx.Node) and out.name.startswith(BUFFER_NAME)):
            names.append(node.name)
    return names


@dataclass
class _Recorded:
    result: PassResult
    writes: List[str]
    notes: List[str] = field(default_factory=list)


def _recorded(result: PassResult, graph: fx.Graph) -> _Recorded:
    return _Recorded(result, _packed_writes(graph))


class _ExplainBackend(AuxCaptureBackend):
    """The aux_capture backend keeping timelines, packed writes and trace artifacts for
    every graph, whichever graph its inner rewrites (Inductor's post-grad one included)."""

    _estimate = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.recorded: List[_Recorded] = []

    def _on_result(self, result: PassResult, graph: fx.Graph) -> None:
        self.recorded.append(_recorded(result, graph))
        trace_pass_result(result)


@contextlib.contextmanager
def _no_compile_caches():
    """Inductor's FX graph cache and AOTAutograd's cache off: a hit would skip the pass."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        yield


# --------------------------------------------------------------------------- report


@dataclass
class MeasuredPeaks:
    """Measured peak bytes of one call (``measure_peak``): pass off vs on, same compile."""

    without_pass: int  # aux_capture with rewrite=False
    with_pass: int
    device: str

    @property
    def ratio(self) -> float:
        return self.with_pass / self.without_pass if self.without_pass else float("nan")

    def to_dict(self) -> Dict[str, Any]:
        return {"without_pass_bytes": self.without_pass, "with_pass_bytes": self.with_pass,
                "ratio": self.ratio, "device": self.device}


@dataclass
class GraphExplain:
    """One compiled graph: its pass result and where captures are produced and written."""

    index: int
    result: PassResult
    writes: List[str] = field(default_factory=list)  # after graph: buffer allocation + writes
    notes: List[str] = field(default_factory=list)

    @property
    def groups(self) -> List[CaptureGroup]:
        return self.result.groups

    @property
    def priced_groups(self) -> List[CaptureGroup]:
        """Groups that got as far as the cost model (cross-layer captures)."""
        return [g for g in self.result.groups
                if g.decision is Decision.REWRITE or g.estimated_peak_before is not None]

    def producers(self) -> List[str]:
        """Before graph: the capture producers and concats of the priced groups."""
        names: List[str] = []
        for g in self.priced_groups:
            names.extend(c.node.name for c in g.captures)
        return names

    def concats(self) -> List[str]:
        return [g.key for g in self.priced_groups]

    @property
    def peak_before(self) -> Optional[int]:
        t = self.result.timeline_before
        return t.peak_bytes if t is not None else None

    @property
    def peak_after(self) -> Optional[int]:
        t = self.result.timeline_after
        return t.peak_bytes if t is not None else None

    def to_dict(self) -> Dict[str, Any]:
        r = self.result

        def timeline(t: Optional[MemoryTimeline]) -> Optional[Dict[str, Any]]:
            return t.to_dict() if t is not None else None

        return {
            "index": self.index,
            "target": r.target,
            "notes": list(self.notes),
            "changed": r.changed,
            "error": r.error,
            "seconds": r.seconds,
            "counts": r.counts,
            "estimated_peak_before": self.peak_before,
            "estimated_peak_after": self.peak_after,
            "groups": [g.to_dict() for g in r.groups],
            "capture_producers": self.producers(),
            "concats": self.concats(),
            "packed_writes": self.writes,
            "lifted_buffers": [b.describe() for b in r.lifted.buffers] if r.lifted else [],
            "lift_note": r.lift_note,
            "timeline_before": timeline(r.timeline_before),
            "timeline_after": timeline(r.timeline_after),
        }


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _widths(widths: Sequence[int]) -> str:
    if len(set(widths)) == 1:
        return f"{len(widths)}x{widths[0]}"
    return "+".join(str(w) for w in widths)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_ANSI = {"red": "\x1b[31m", "green": "\x1b[32m", "cyan": "\x1b[36m", "yellow": "\x1b[33m",
         "bold": "\x1b[1m", "dim": "\x1b[2m", "reset": "\x1b[0m"}


class _Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        return "".join(_ANSI[s] for s in styles) + text + _ANSI["reset"]


def _table(rows: List[List[str]], indent: str = "  ") -> List[str]:
    """Left-aligned columns; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip()
            for r in rows]


def _group_key(g: CaptureGroup) -> Tuple[Any, ...]:
    return (g.k, g.widths, g.dtype, g.decision, g.rejection, g.reason, g.projection,
            tuple((c.source, c.location, c.producer, c.strategy) for c in g.captures))


def _ranges(indices: Sequence[int], limit: Optional[int] = None) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``; past ``limit`` ranges, ``",..."``."""
    parts: List[str] = []
    start = prev = indices[0]
    for i in list(indices[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    if limit is not None and len(parts) > limit:
        parts = parts[:limit] + ["..."]
    return ",".join(parts)


@dataclass
class ExplainReport:
    """What ``explain()`` found: one ``GraphExplain`` per graph the backend compiled."""

    model_name: str
    inner: str
    dynamic: bool
    cost_model: bool
    graphs: List[GraphExplain]
    measured: Optional[MeasuredPeaks] = None
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def results(self) -> List[PassResult]:
        return [g.result for g in self.graphs]

    def diff(self, index: int, color: bool = False) -> str:
        """Unified diff of graph ``index``'s code before vs after the pass."""
        r = self.graphs[index].result
        lines = difflib.unified_diff(r.code_before.strip("\n").splitlines(),
                                     r.code_after.strip("\n").splitlines(),
                                     fromfile=f"graph_{index}_before.py",
                                     tofile=f"graph_{index}_after.py", lineterm="")
        style = _Style(color)
        out = []
        for line in lines:
            if line.startswith(("---", "+++")):
                out.append(style(line, "bold"))
            elif line.startswith("@@"):
                out.append(style(line, "cyan"))
            elif line.startswith("+"):
                out.append(style(line, "green"))
            elif line.startswith("-"):
                out.append(style(line, "red"))
            else:
                out.append(line)
        return "\n".join(out)

    def to_text(self, color: bool = False) -> str:
        """The groups table, the unified diff and the estimated (and measured) peaks."""
        s = _Style(color)
        out = [s(f"aux_capture explain: {self.model_name}", "bold")
               + f"  (inner={self.inner}, dynamic={self.dynamic}, cost_model={self.cost_model}, "
               f"{len(self.graphs)} graph{'s' if len(self.graphs) != 1 else ''}, "
               f"{self.seconds:.1f} s)"]
        for note in self.notes:
            out.append(s(f"note: {note}", "yellow"))
        for graph in self.graphs:
            r = graph.result
            counts = r.counts or {}
            out.append("")
            out.append(s(f"== graph {graph.index} (pass target {r.target}, "
                         f"{len(r.groups)} capture group{'s' if len(r.groups) != 1 else ''}: "
                         f"{counts.get('groups_rewritten', 0)} rewritten, "
                         f"{counts.get('groups_rejected', 0)} rejected; pass {r.seconds:.2f} s) ==",
                         "bold"))
            if r.error:
                out.append(s(f"pass error (graph left unchanged): {r.error}", "red"))
            if r.lifted is not None:
                for spec in r.lifted.buffers:
                    out.append(s(f"lifted: {spec.describe()}: a graph input the compiled graph's "
                                 f"caller allocates per call (the 'after' code shows it in the "
                                 f"graph)", "cyan"))
            if r.lift_note:
                out.append(s(f"note: {r.lift_note}", "yellow"))
            for note in graph.notes:
                out.append(s(f"note: {note}", "yellow"))
            if r.groups:
                out.append("")
                out.extend(self._table_lines(graph, s))
            else:
                out.append("no capture groups (no concat of two or more tensors in this graph)")
            out.append("")
            diff = self.diff(graph.index, color)
            out.append(diff if diff else "graph code unchanged by the pass")
            out.append("")
            before, after = graph.peak_before, graph.peak_after
            if before is None or after is None:
                out.append("estimated peak: no timeline recorded for this graph")
            else:
                change = f" ({(after - before) / before:+.0%})" if before else ""
                tb, ta = r.timeline_before, r.timeline_after
                out.append(s(f"estimated peak: before {_size(before)} (at {tb.peak_node}), "
                             f"after {_size(after)} (at {ta.peak_node}){change}", "bold"))
        if self.measured is not None:
            m = self.measured
            out.append("")
            out.append(s(f"measured peak ({m.device}, whole call, measure_peak): without the pass "
                         f"{_size(m.without_pass)}, with the pass {_size(m.with_pass)}: "
                         f"ratio {m.ratio:.2f}", "bold"))
        return "\n".join(out) + "\n"

    def _table_lines(self, graph: GraphExplain, s: _Style) -> List[str]:
        # groups that differ only in their nodes (RoPE's rotate-half join, once per layer)
        # share one row
        rows_of: Dict[Tuple[Any, ...], List[Tuple[int, CaptureGroup]]] = {}
        for i, g in enumerate(graph.groups):
            rows_of.setdefault(_group_key(g), []).append((i, g))
        rows = [["#", "concat", "K", "widths", "dtype", "packed", "decision", "reason"]]
        runs = list(rows_of.values())
        for run in runs:
            g = run[0][1]
            cats = [x.key for _, x in run]
            sizes = sorted({x.packed_bytes for _, x in run})
            rows.append([
                _ranges([i for i, _ in run], limit=3),
                cats[0] if len(cats) == 1 else f"{', '.join(cats[:2])}{', ...' if len(cats) > 2 else ''}",
                str(g.k), _widths(g.widths), _dtype(g.dtype),
                f"{_size(sizes[0])}..{_size(sizes[-1])}" if len(sizes) > 1 else _size(sizes[0]),
                g.decision.value + (f" x{len(run)}" if len(run) > 1 else ""),
                (f"[{g.rejection.value}] " if g.rejection is not None else "") + (g.reason or "-")
                + (f" (not projected: {g.projection})" if g.projection and not g.fused else ""),
            ])
        table = _table(rows)
        out = [s(table[0], "bold")]
        for run, line in zip(runs, table[1:]):
            g = run[0][1]
            colour = {Decision.REWRITE: "green", Decision.REJECT: "yellow"}.get(g.decision)
            out.append(s(line, colour) if colour else line)
            for c in g.captures:
                how = c.producer.value + (f", {c.strategy.value}" if c.strategy is not None else "")
                node = f" {c.node.name}" if len(run) == 1 else ""
                where = f"[{c.location}]  " if c.location else ""
                out.append(s(f"      capture {c.position}:{node} ({how})  {where}{c.source or '?'}", "dim"))
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {
            "model": self.model_name,
            "inner": self.inner,
            "dynamic": self.dynamic,
            "cost_model": self.cost_model,
            "seconds": self.seconds,
            "notes": list(self.notes),
            "graphs": [g.to_dict() for g in self.graphs],
            "measured": self.measured.to_dict() if self.measured is not None else None,
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def plot(self, path: "str | os.PathLike[str]") -> str:
        """Write a PNG of the estimated live bytes over each graph's nodes, before vs after.

        Needs matplotlib (``pip install matplotlib``, or the ``debug`` extra); raises
        ``ImportError`` with that hint without it, ``ValueError`` when no graph has a timeline.
        """
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("plot() needs matplotlib: pip install matplotlib "
                              "(or the 'debug' extra: pip install 'compile-pass[debug]')") from e
        graphs = [g for g in self.graphs
                  if g.result.timeline_before is not None and g.result.timeline_after is not None]
        if not graphs:
            raise ValueError("no graph has a memory timeline to plot")
        fig, axes = plt.subplots(len(graphs), 1, figsize=(11, 4.2 * len(graphs)), squeeze=False)
        for ax, graph in zip(axes[:, 0], graphs):
            tb, ta = graph.result.timeline_before, graph.result.timeline_after
            top = max(tb.peak_bytes, ta.peak_bytes)
            unit, mib = next(((u, float(f)) for u, f in (("GiB", 2**30), ("MiB", 2**20))
                              if top >= f), ("KiB", 1024.0))
            xb = range(len(tb.live_bytes))
            xa = range(len(ta.live_bytes))
            ax.step(xb, [b / mib for b in tb.live_bytes], where="post", color="tab:red",
                    lw=2.0, alpha=0.85, label=f"before the pass (peak {_size(tb.peak_bytes)})")
            ax.step(xa, [b / mib for b in ta.live_bytes], where="post", color="tab:blue",
                    lw=1.1, label=f"after the pass (peak {_size(ta.peak_bytes)})")
            before_at = {n: i for i, n in enumerate(tb.node_names)}
            after_at = {n: i for i, n in enumerate(ta.node_names)}
            producers = [before_at[n] for n in graph.producers() if n in before_at]
            concats = [before_at[n] for n in graph.concats() if n in before_at]
            writes = [after_at[n] for n in graph.writes if n in after_at]
            if producers:
                ax.plot(producers, [tb.live_bytes[i] / mib for i in producers], "v",
                        color="tab:red", mec="black", mew=0.6, ms=7, label="capture producers (before)")
            if concats:
                ax.plot(concats, [tb.live_bytes[i] / mib for i in concats], "X",
                        color="black", ms=8, label="concat (before)")
            if writes:
                ax.plot(writes, [ta.live_bytes[i] / mib for i in writes], "^",
                        color="tab:blue", mec="black", mew=0.6, ms=7, label="packed buffer alloc / writes (after)")
            change = (f" ({(ta.peak_bytes - tb.peak_bytes) / tb.peak_bytes:+.0%})"
                      if tb.peak_bytes else "")
            ax.set_title(f"{self.model_name} [{self.inner}] graph {graph.index}: estimated peak "
                         f"{_size(tb.peak_bytes)} -> {_size(ta.peak_bytes)}{change}", fontsize=11)
            ax.set_xlabel("graph node index (the after graph has the buffer and its writes "
                          "inserted)")
            ax.set_ylabel(f"estimated live {unit}")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(loc="upper left", fontsize=8)
        if self.measured is not None:
            m = self.measured
            fig.text(0.99, 0.005, f"measured ({m.device}): {_size(m.without_pass)} -> "
                     f"{_size(m.with_pass)} (ratio {m.ratio:.2f})", ha="right", va="bottom",
                     fontsize=8)
        fig.tight_layout(rect=(0, 0.03 if self.measured is not None else 0, 1, 1))
        fig.savefig(os.fspath(path), dpi=110)
        plt.close(fig)
        return os.fspath(path)


# --------------------------------------------------------------------------- explain


def _run(fn: Callable[..., Any], inputs: Tuple[Any, ...]) -> Any:
    try:
        with torch.no_grad(), _no_compile_caches():
            return fn(*inputs)
    except Exception as e:  # noqa: BLE001 - reported as one error naming the cause
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        cause = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise ModelRunError(f"the model failed to compile or run: {cause}") from e


def explain(model: Callable[..., Any], *example_inputs: Any, inner: str = "eager",
            split_ops: Optional[Sequence[str]] = None, pack_outputs: bool = False,
            dynamic: bool = True, measure: bool = False, cost_model: bool = True,
            fuse_projection: bool = False, name: Optional[str] = None) -> ExplainReport:
    """Compile ``model`` with the aux_capture backend, run it once, report what the pass did.

    ``inner``: ``"eager"`` (the pass rewrites the Dynamo graph), ``"aot_eager"`` (the aten
    graph after AOTAutograd) or ``"inductor"`` (the Dynamo graph, packed buffers lifted to
    inputs, capture twins merged by Inductor's pre pass; its FX graph cache is turned off so
    the passes really run). ``dynamic``: ``torch.compile(dynamic=)``.
    ``cost_model=False``: rewrite every valid group whatever the estimate says.
    ``measure=True``: also measure the peak of one call (``measure_peak``) compiled with the
    pass off (``rewrite=False``) and on, after a warm-up call each.
    ``split_ops``: split the Dynamo graph at those ops (the pass runs on the whole Dynamo
    graph first; the report notes the pieces). ``pack_outputs``: captures the graph
    returns become adjacent slices of one buffer (output groups in the report).
    ``fuse_projection``: a concat read only by the draft's fc is projected into its
    accumulator (the backend's opt-in; the reason column says which, or why not).

    Dynamo's caches are reset first (``torch._dynamo.reset()``), so the report shows a
    fresh compile. Raises ``ModelRunError`` when the compiled model raises.
    """
    if not isinstance(inner, str) or inner not in INNERS:
        raise ValueError(f"unknown inner {inner!r} for explain: expected one of "
                         f"eager, aot_eager, inductor")
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    if name is None:
        name = type(model).__name__ if isinstance(model, torch.nn.Module) else \
            getattr(model, "__qualname__", type(model).__name__)
    start = time.perf_counter()
    torch._dynamo.reset()
    options = dict(split_ops=tuple(split_ops or ()), pack_outputs=pack_outputs, fuse_projection=fuse_projection)
    backend = _ExplainBackend(inner=inner, cost_model=cost_model, **options)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    _run(compiled, example_inputs)
    graphs = [GraphExplain(i, rec.result, rec.writes, rec.notes)
              for i, rec in enumerate(backend.recorded)]
    notes: List[str] = []
    if not graphs:
        notes.append("no graph reached the aux_capture backend (Dynamo compiled nothing: "
                     "is the model traceable?)")
    for g in graphs:
        if g.result.timeline_before is None or g.result.timeline_after is None:
            notes.append(f"graph {g.index}: no memory timeline was recorded "
                         f"({g.result.error or 'the pass stopped before estimating'})")
    for split in backend.splits:
        calls = ", ".join(f"{name} x{n}" for name, n in split.calls.items())
        notes.append(f"split into {split.num_pieces} compiled pieces at {calls}; the pass ran "
                     f"on the whole Dynamo graph before the split")
        notes.extend(split.warnings)
    if inner == "inductor" and not split_ops:
        notes.append("inductor: the pass ran on the Dynamo graph; packed buffers are then lifted "
                     "to inputs that the compiled graph's caller allocates, outside Inductor's "
                     "memory plan; the estimate models Inductor computing pointwise/mm producers "
                     "into a concat and merging capture twins, not its buffer reuse")
    if backend.twin_merges:
        merges = backend.twin_merges
        notes.append(f"Inductor's pre pass merged {len(merges)} capture twin"
                     f"{'s' if len(merges) != 1 else ''} (the capture reads the model's own value): "
                     + "; ".join(m.describe() for m in merges[:4])
                     + ("; ..." if len(merges) > 4 else ""))
    measured = None
    if measure:
        measured = _measure(model, example_inputs, inner, dynamic, cost_model, compiled, options)
    return ExplainReport(name, inner, dynamic, cost_model, graphs, measured, notes,
                         time.perf_counter() - start)


def _measure(model: Callable[..., Any], inputs: Tuple[Any, ...], inner: str, dynamic: bool,
             cost_model: bool, compiled_with_pass: Callable[..., Any],
             options: Dict[str, Any]) -> MeasuredPeaks:
    from compile_pass.memory import _device_of, measure_peak

    without = torch.compile(model, backend=_ExplainBackend(inner=inner, rewrite=False,
                                                           cost_model=cost_model, **options),
                            dynamic=dynamic)
    _run(without, inputs)  # compile (and warm up) outside the measurement

    def peak(fn: Callable[..., Any]) -> int:
        with torch.no_grad(), _no_compile_caches():
            return measure_peak(fn, *inputs).bytes

    off = peak(without)
    on = peak(compiled_with_pass)
    return MeasuredPeaks(off, on, str(_device_of(model, inputs, {})))
