"""The capture pass: find -> plan -> estimate -> rewrite, one group at a time.

``run_capture_pass(gm, target)`` is a pure function of the graph and its target: it either
replaces ``gm.graph`` with a graph in which accepted groups are written into packed
buffers, or leaves it untouched. A group is accepted only where the liveness estimate of
the rewritten graph has a lower peak than the current one. Any exception inside the pass
leaves the graph unchanged, is logged with its reason and counted
(``counters["aux_capture"]["pass_errors"]``); it never fails the compile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from compile_pass.find import find_capture_groups
from compile_pass.groups import CaptureGroup, Decision, Producer, summarize
from compile_pass.liveness import MemoryTimeline, estimate_memory
from compile_pass.plan import GraphFacts, plan_group
from compile_pass.dataflow import is_cat
from compile_pass.find import classify_producer
from compile_pass.rewrite import RewriteError, rewrite_group

__all__ = ["Target", "PassResult", "run_capture_pass", "TARGETS"]

log = logging.getLogger("compile_pass")

#: Producers Inductor's concat lowering computes straight into the concat's output.
_INDUCTOR_COMPUTES_INTO_CAT = {Producer.POINTWISE, Producer.EXACT_ARITHMETIC, Producer.CLONE,
                               Producer.MATMUL}


@dataclass(frozen=True)
class Target:
    """Where the rewritten graph goes, which decides how writes may be expressed.

    ``runs_as_is``: the graph is executed node by node afterwards (no functionalization),
    so ``out=`` recomputation into a slice is safe. ``inductor_cost``: estimate peaks the
    way Inductor runs a concat (pointwise and mm producers computed into its output).
    """

    name: str
    runs_as_is: bool
    inductor_cost: bool


TARGETS: Dict[str, Target] = {
    "dynamo": Target("dynamo", runs_as_is=True, inductor_cost=False),  # eager inner
    "aot": Target("aot", runs_as_is=True, inductor_cost=False),  # aot_eager / cudagraphs inners
    "dynamo_inductor": Target("dynamo_inductor", runs_as_is=False, inductor_cost=True),
    "dynamo_functional": Target("dynamo_functional", runs_as_is=False, inductor_cost=False),
}


@dataclass
class PassResult:
    """What one run of the pass did to one graph."""

    target: str
    groups: List[CaptureGroup]
    code_before: str
    code_after: str
    timeline_before: Optional[MemoryTimeline] = None
    timeline_after: Optional[MemoryTimeline] = None
    seconds: float = 0.0
    error: Optional[str] = None
    counts: Dict[str, int] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(g.decision is Decision.REWRITE for g in self.groups)


def _inductor_computed_into(graph: fx.Graph) -> Dict[fx.Node, fx.Node]:
    fused: Dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if is_cat(node) and node.args and isinstance(node.args[0], (list, tuple)):
            for arg in node.args[0]:
                if isinstance(arg, fx.Node) and arg not in fused and \
                        classify_producer(arg) in _INDUCTOR_COMPUTES_INTO_CAT:
                    fused[arg] = node
    return fused


def _estimate(graph: fx.Graph, target: Target) -> MemoryTimeline:
    return estimate_memory(graph, _inductor_computed_into(graph) if target.inductor_cost else None)


def copy_graph(graph: fx.Graph) -> Tuple[fx.Graph, Dict[fx.Node, fx.Node]]:
    """A node-for-node copy of ``graph`` (metadata dicts copied, fake values shared)."""
    new = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    node_map: Dict[fx.Node, fx.Node] = {}
    value, old_out = new.graph_copy(graph, node_map, return_output_node=True)
    out_node = new.output(value, type_expr=old_out.type)
    out_node.meta = dict(old_out.meta)
    node_map[old_out] = out_node
    return new, node_map


def _mib(n: Optional[int]) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _decide(gm: fx.GraphModule, group: CaptureGroup, target: Target) -> Optional[fx.Graph]:
    """Plan, trial-rewrite and cost one group; return the rewritten graph if accepted."""
    facts = GraphFacts(gm.graph)
    plan_group(group, facts, target.runs_as_is)
    if group.decision is Decision.REJECT:
        return None
    before = _estimate(gm.graph, target).peak_bytes
    trial, node_map = copy_graph(gm.graph)
    try:
        rewrite_group(trial, group.replace_nodes(node_map))
        trial.lint()
    except RewriteError as e:
        group.reject(str(e))
        return None
    after = _estimate(trial, target).peak_bytes
    group.estimated_peak_before, group.estimated_peak_after = before, after
    if after < before:
        group.decision = Decision.REWRITE
        group.reason = f"estimated peak {_mib(before)} -> {_mib(after)} ({(after - before) / before:+.0%})"
        return trial
    fused = [c for c in group.captures if c.producer in _INDUCTOR_COMPUTES_INTO_CAT]
    why = f"estimated peak would not drop ({_mib(before)} -> {_mib(after)})"
    if target.inductor_cost and fused:
        why += (f"; Inductor already computes {len(fused)} of {group.k} captures straight into "
                f"the concat output")
    group.reject(why)
    return None


def _record(result: PassResult) -> None:
    result.counts = summarize(result.groups)
    for key, n in result.counts.items():
        counters["aux_capture"][key] += n
    for g in result.groups:
        log.info("aux_capture[%s] %s K=%d widths=%s %s: %s: %s", result.target, g.cat.name, g.k,
                 list(g.widths), g.dtype, g.decision.value, g.reason)


def run_capture_pass(gm: fx.GraphModule, target: Target | str = "dynamo",
                     estimate: bool = False) -> PassResult:
    """Rewrite every accepted capture group of ``gm`` (in place); never raises.

    ``estimate=True`` also records whole-graph memory timelines before and after, for the
    diff tool.
    """
    if isinstance(target, str):
        target = TARGETS[target]
    start = time.perf_counter()
    result = PassResult(target.name, [], gm.code, gm.code)
    original = gm.graph
    try:
        if estimate:
            result.timeline_before = _estimate(gm.graph, target)
        handled: set = set()
        graph_changed = False
        while True:
            pending = [g for g in find_capture_groups(gm) if g.cat.name not in handled]
            if not pending:
                break
            group = pending[0]
            handled.add(group.cat.name)
            result.groups.append(group)
            if group.decision is not Decision.FOUND:
                continue
            group.placement = target.name
            rewritten = _decide(gm, group, target)
            if rewritten is not None:
                gm.graph = rewritten
                graph_changed = True
        if graph_changed:
            gm.recompile()
        result.code_after = gm.code
        if estimate:
            result.timeline_after = _estimate(gm.graph, target)
    except Exception as e:  # noqa: BLE001 - the pass must never break a compile
        result.error = f"{type(e).__name__}: {e}"
        if gm.graph is not original:
            gm.graph = original
            gm.recompile()
        result.code_after = gm.code
        counters["aux_capture"]["pass_errors"] += 1
        log.warning("aux_capture pass failed, graph left unchanged: %s", result.error)
        return result
    finally:
        result.seconds = time.perf_counter() - start
    _record(result)
    return result
