"""Static peak estimates of real-size models: fake tensors only, no real memory.

Build the model on the meta device (``with torch.device("meta"): model = ...``) and give it
meta inputs: ``trace_graph`` compiles it with the aux_capture backend whose pass is replaced
by a recorder, so Dynamo traces it with fake tensors, the token dim symbolic, and the graph
the pass would rewrite is kept as it is: the Dynamo graph (inner ``eager``, target
``dynamo``) or AOTAutograd's forward graph (inner ``aot_eager``, target ``aot``).

``estimate_at`` then runs the pass itself (``run_capture_pass(..., estimate=True)``) on a
copy of that graph for each token count, the symbolic token count evaluated at that count
(``dataflow.sizes_at``): the liveness estimator and cost model the backend uses, at sizes
that would not fit in this machine's memory. One trace serves every token count.

What the estimate is (``liveness.py``): live bytes of the graph's own values, inputs and
weights counted as 0 (``measure_peak``'s baseline). Anything an op allocates inside itself
(attention and MoE kernels' workspaces, a KV cache) is not in the graph and not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from compile_pass.backend import AuxCaptureBackend
from compile_pass.capture_pass import run_capture_pass
from compile_pass.dataflow import copy_graph
from compile_pass.dataflow import sizes_at
from compile_pass.groups import Decision
from compile_pass.liveness import estimate_memory
from compile_pass.memory import measure_peak

__all__ = ["StaticEstimate", "EstimateCheck", "trace_graph", "token_symbols", "estimate_at",
           "graph_peak_at", "check_against_measured"]

_INNER_TARGETS = {"eager": "dynamo", "aot_eager": "aot"}


@dataclass
class _RecordingBackend(AuxCaptureBackend):
    """The aux_capture backend with its pass replaced by a recorder of (graph, target)."""

    graphs: List[Tuple[fx.GraphModule, str]] = field(default_factory=list)

    def _rewrite(self, gm: fx.GraphModule, target: str, *args: Any, **kwargs: Any) -> None:
        self.graphs.append((gm, target))


def trace_graph(model: torch.nn.Module, *inputs: torch.Tensor,
                inner: str = "eager") -> Tuple[fx.GraphModule, str]:
    """The graph the pass would rewrite under ``inner`` and its target name.

    Dim 0 of every tensor input is marked dynamic (the token count). ``model`` and
    ``inputs`` may live on the meta device: Dynamo traces with fake tensors, and the
    compiled graph then runs once on the meta inputs, allocating nothing. Raises
    ValueError for an inner other than ``eager``/``aot_eager``, RuntimeError unless the
    model compiles to exactly one graph.
    """
    if inner not in _INNER_TARGETS:
        raise ValueError(f"trace_graph: inner must be one of {', '.join(_INNER_TARGETS)}, got {inner!r}")
    backend = _RecordingBackend(inner=inner)
    torch._dynamo.reset()
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            torch._dynamo.mark_dynamic(t, 0)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    if len(backend.graphs) != 1:
        raise RuntimeError(f"trace_graph: expected one graph for the pass, got {len(backend.graphs)}")
    return backend.graphs[0]


def token_symbols(gm: fx.GraphModule, tokens: int) -> Set[str]:
    """Names of the symbols in the graph inputs' shapes whose example value is ``tokens``."""
    names: Set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val", node.meta.get("example_value"))
        sizes = list(value.shape) if isinstance(value, torch.Tensor) else [value]
        for size in sizes:
            if isinstance(size, torch.SymInt) and size.node.hint == tokens:
                names |= {s.name for s in size.node.expr.free_symbols}
    return names


@dataclass
class StaticEstimate:
    """The pass on one graph at one token count: estimated peaks before and after."""

    tokens: int
    peak_before: int  # the graph as traced (list path)
    peak_after: int  # after the pass (== peak_before where nothing was rewritten)
    changed: bool
    decisions: List[str]
    pass_seconds: float
    error: Optional[str] = None
    #: estimated live bytes while the widest capture concat runs (list path), if any
    concat_bytes: Optional[int] = None


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph, _ = copy_graph(gm.graph)
    return fx.GraphModule(gm, graph)


def graph_peak_at(gm: fx.GraphModule, traced_tokens: int, tokens: int) -> int:
    """Estimated peak bytes of ``gm`` (unchanged) at ``tokens`` tokens."""
    with sizes_at({name: tokens for name in token_symbols(gm, traced_tokens)}):
        return estimate_memory(gm.graph).peak_bytes


def estimate_at(gm: fx.GraphModule, target: str, traced_tokens: int, tokens: Sequence[int],
                cost_model: bool = True) -> List[StaticEstimate]:
    """Run the pass on a copy of ``gm`` at each token count; ``gm`` is left unchanged.

    ``traced_tokens``: the token count the graph was traced with (it names the symbol to
    evaluate). Raises ValueError if no input shape has that symbolic size.
    """
    names = token_symbols(gm, traced_tokens)
    if not names:
        raise ValueError(f"no graph input has a symbolic size with example value {traced_tokens}: "
                         f"trace with the token dim dynamic (trace_graph does)")
    estimates: List[StaticEstimate] = []
    for n in tokens:
        copy = _copy(gm)
        with sizes_at({name: n for name in names}):
            start = time.perf_counter()
            result = run_capture_pass(copy, target, estimate=True, cost_model=cost_model)
            seconds = time.perf_counter() - start
        if result.timeline_before is None or result.timeline_after is None:
            raise RuntimeError(f"the pass recorded no timeline at {n} tokens: {result.error}")
        decisions = [f"{g.key} K={g.k}: {g.decision.value}: {g.reason}"
                     for g in result.groups if g.k > 2 or g.decision is Decision.REWRITE]
        before = result.timeline_before
        concats = [g for g in result.groups if g.cat.op == "call_function" and g.cat.name in before.node_names]
        widest = max(concats, key=lambda g: g.k, default=None)
        concat_bytes = before.live_bytes[before.node_names.index(widest.cat.name)] if widest else None
        estimates.append(StaticEstimate(n, before.peak_bytes, result.timeline_after.peak_bytes,
                                        result.changed, decisions, seconds, result.error,
                                        concat_bytes))
    return estimates


@dataclass
class EstimateCheck:
    """Estimated vs measured peak bytes of one graph run as is, before and after the pass."""

    estimated_before: int
    measured_before: int
    estimated_after: int
    measured_after: int
    rewritten: bool
    bitwise_equal: bool

    @property
    def errors(self) -> Tuple[float, float]:
        """(estimate - measured) / measured, before and after the pass."""
        return ((self.estimated_before - self.measured_before) / self.measured_before,
                (self.estimated_after - self.measured_after) / self.measured_after)


def _compiled_as_is(model: Callable[..., Any], inputs: Sequence[torch.Tensor]
                    ) -> Tuple[Callable[..., Any], fx.GraphModule]:
    graphs: List[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: List[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return lambda *args: gm(*args)  # the graph's current code, rewritten or not

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(*inputs)
    if len(graphs) != 1:
        raise RuntimeError(f"check_against_measured: expected one graph, got {len(graphs)}")
    return compiled, graphs[0]


def check_against_measured(model: Callable[..., Any], *inputs: torch.Tensor,
                           cost_model: bool = False) -> EstimateCheck:
    """The estimate against ``measure_peak`` on real tensors, the way the eager inner runs a
    model: its Dynamo graph as is (static shapes), once without the pass and once after it
    (``cost_model=False``: every valid group rewritten, so the rewritten graph is checked
    too). Outputs of the two runs are compared bitwise."""
    compiled, gm = _compiled_as_is(model, inputs)
    estimated_before = estimate_memory(gm.graph).peak_bytes
    with torch.no_grad():
        before = measure_peak(compiled, *inputs)
    result = run_capture_pass(gm, "dynamo", cost_model=cost_model)
    if result.error is not None:
        raise RuntimeError(f"the pass failed: {result.error}")
    estimated_after = estimate_memory(gm.graph).peak_bytes
    with torch.no_grad():
        after = measure_peak(compiled, *inputs)
    flat_before = [t for t in torch.utils._pytree.tree_leaves(before.result) if isinstance(t, torch.Tensor)]
    flat_after = [t for t in torch.utils._pytree.tree_leaves(after.result) if isinstance(t, torch.Tensor)]
    equal = len(flat_before) == len(flat_after) and all(
        torch.equal(a, b) for a, b in zip(flat_before, flat_after))
    return EstimateCheck(estimated_before, before.bytes, estimated_after, after.bytes,
                         result.changed, equal)
