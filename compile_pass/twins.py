"""Capture twins: a capture that recomputes a value the model computes itself.

SGLang-style models capture ``aux.append(hidden_states + residual)`` and the next norm
computes ``residual = hidden_states + residual`` again from the same two tensors. In eager
code the two sums are bitwise equal. In a compiled inference graph (no CSE) they stay two
nodes, and that changes what the *model* computes: the matmul that produces
``hidden_states`` gets a second reader, so Inductor's ``add(mm, x) -> addmm`` fusion stops
firing in capture layers only, and ``addmm`` rounds differently from ``mm`` + ``add``.
More values are live there too.

``merge_capture_twins(graph)`` replaces each such pair by one node, the earlier of the two,
so the capture reads the model's own value: run before Inductor's pattern passes (a
``post_grad_custom_pre_pass``), the graph then compiles like the build without captures
plus one reader per capture. Invariant: two nodes are merged only when they call the same
deterministic functional op on the same arguments, nothing writes any argument's storage
between them, and they do not both leave the graph (as outputs or written back into an
input): so every value the graph computes stays bitwise the same, and no two tensors the
caller receives become one (a piece of a split graph returns a capture and the residual
it equals; the next piece mutates the capture in place, which must not change the
residual).

``twin_of(node, table)`` is the same test without the merge, for estimates of graphs that
Inductor merges later (the pass prices Dynamo graphs, ``cost.py``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Set

import torch
import torch.fx as fx

import compile_pass.draft_registry  # noqa: F401  (registers compile_pass::project_registered_)
import compile_pass.ops  # noqa: F401  (registers compile_pass::write_slice_)
from compile_pass.dataflow import NodeTable, gc_paused, source_line

if TYPE_CHECKING:
    from compile_pass.groups import CaptureGroup

__all__ = ["TwinMerge", "capture_twins", "capture_values", "escaping", "merge_capture_twins", "twin_of"]

#: torch-IR spellings of pure arithmetic (Dynamo graphs): deterministic, no mutation
_PURE_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                   operator.matmul, operator.getitem}


@dataclass(frozen=True)
class TwinMerge:
    """One capture that now reads the model's own value: ``dropped`` (a node name) was
    replaced everywhere by ``kept``, which computes the same op on the same arguments."""

    kept: str
    dropped: str
    op: str
    source: str  # user source line of the capture

    def describe(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.dropped} merged into its twin {self.kept} ({self.op}){where}"


def _is_pure(node: fx.Node) -> bool:
    """A deterministic call that writes none of its arguments (safe to compute once)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in _PURE_OPERATORS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write
                   for a in target._schema.arguments)


def _same_call(a: fx.Node, b: fx.Node) -> bool:
    try:
        return a.target == b.target and a.args == b.args and a.kwargs == b.kwargs
    except RuntimeError:  # a tensor constant among the arguments: no equality
        return False


def _written_between(node: fx.Node, first: int, last: int, table: NodeTable) -> bool:
    """Whether anything writes the storage of one of ``node``'s inputs strictly between
    positions ``first`` and ``last``."""
    for arg in table.inputs[node]:
        key = table.key.get(arg)
        holders = table.holders.get(key, [arg]) if key is not None else [arg]
        for alias in holders:
            for writer in table.mutators.get(alias, ()):
                if first < table.position[writer] < last:
                    return True
    return False


def twin_of(node: fx.Node, table: NodeTable) -> Optional[fx.Node]:
    """The earliest other node of ``table``'s graph computing ``node``'s value bit for bit
    (same pure op, same arguments, no write into an argument in between); None if none."""
    if not _is_pure(node) or not table.inputs[node]:
        return None
    here = table.position[node]
    best: Optional[fx.Node] = None
    for candidate in table.inputs[node][0].users:
        if candidate is node or candidate not in table.position or not _same_call(candidate, node):
            continue
        there = table.position[candidate]
        if _written_between(node, min(here, there), max(here, there), table):
            continue
        if best is None or there < table.position[best]:
            best = candidate
    return best


def _may_have_twin(node: fx.Node) -> bool:
    """Whether another node calls ``node``'s pure op on the same arguments: what
    ``twin_of`` needs before it looks at positions and writes in between."""
    if not _is_pure(node) or not node.all_input_nodes:
        return False
    return any(other is not node and _same_call(other, node)
               for other in node.all_input_nodes[0].users)


#: ops that read a captured value whole -> (the argument holding it, the argument that, if
#: given, makes the op form the capture itself from two inputs: then no one value is read)
_CAPTURE_READERS = {
    torch.ops.compile_pass.write_slice_.default: ("src", None),
    torch.ops.compile_pass.project_into_.default: ("src", None),
    torch.ops.compile_pass.project_normed_into_.default: ("a", "b"),
    torch.ops.compile_pass.project_scaled_into_.default: ("a", "b"),
    torch.ops.compile_pass.sum_squares_into_.default: ("a", "b"),
    torch.ops.compile_pass.project_registered_.default: ("a", "b"),
}


def _bound(op: "torch._ops.OpOverload", node: fx.Node, functional: bool) -> Dict[str, Any]:
    """``node``'s arguments of ``op`` by name (``functional``: a functionalized call, whose
    arguments are all keywords)."""
    if functional:
        return dict(node.kwargs)
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _write_source(node: fx.Node) -> Optional[fx.Node]:
    """The captured value a rewrite op (plain or functionalized) reads whole: what a
    ``write_slice_`` copies, or what a projection op projects when it is given the capture
    rather than the two inputs it sums."""
    if node.op != "call_function":
        return None
    functional = isinstance(node.target, torch._ops.HigherOrderOperator) and bool(node.args)
    op = node.args[0] if functional else node.target
    if not isinstance(op, torch._ops.OpOverload) or op not in _CAPTURE_READERS:
        return None  # (a higher-order op's first argument may be a list, not hashable)
    value_arg, second_arg = _CAPTURE_READERS[op]
    args = _bound(op, node, functional)
    if second_arg is not None and args.get(second_arg) is not None:
        return None
    src = args.get(value_arg)
    return src if isinstance(src, fx.Node) else None


def capture_values(graph: fx.Graph, table: Optional[NodeTable] = None,
                   groups: Optional[Sequence["CaptureGroup"]] = None) -> List[fx.Node]:
    """The values a graph captures, in graph order: what the rewrite's ops read whole
    (``write_slice_`` copies of rewritten groups and packers, ``project_into_`` and the
    other projections), the inputs of cross-layer capture concats and the captures of
    cross-layer output groups (``find``; ``groups``: those groups if already found)."""
    from compile_pass.find import find_capture_groups, find_output_groups
    from compile_pass.groups import Decision

    table = NodeTable.of(graph, table)
    values: Dict[fx.Node, None] = {}
    for node in table.nodes:
        src = _write_source(node)
        if src is not None:
            values[src] = None
    if groups is None:
        groups = find_capture_groups(graph, table) + find_output_groups(graph, table)
    for group in groups:
        if group.decision is Decision.FOUND:
            for capture in group.captures:
                if capture.node in table.position:
                    values[capture.node] = None
    return sorted(values, key=table.position.__getitem__)


def escaping(graph: fx.Graph) -> Set[fx.Node]:
    """Values that leave the graph: its outputs and what ``copy_`` writes into a graph input."""
    leaving: Set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output":
            leaving.update(node.all_input_nodes)
            break
    for copy in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        if isinstance(copy.args[0], fx.Node) and copy.args[0].op == "placeholder" \
                and isinstance(copy.args[1], fx.Node):
            leaving.add(copy.args[1])
    return leaving


def _both_leave(a: fx.Node, b: fx.Node, leaving: Set[fx.Node]) -> bool:
    return a in leaving and b in leaving


def capture_twins(captures: Iterable[fx.Node], table: NodeTable) -> Dict[fx.Node, fx.Node]:
    """For each of ``captures`` with a twin: the later of the two -> the earlier, the node
    that computes their value once they are merged (pairs that both leave the graph are
    not merged)."""
    merged: Dict[fx.Node, fx.Node] = {}
    leaving = escaping(table.graph)
    for capture in captures:
        twin = twin_of(capture, table)
        if twin is not None and not _both_leave(capture, twin, leaving):
            early, late = sorted((capture, twin), key=table.position.__getitem__)
            merged[late] = early
    return merged


def _op_name(node: fx.Node) -> str:
    target: Any = node.target
    return getattr(target, "__name__", None) or str(target)


def _candidates(nodes: Iterable[fx.Node]) -> Dict[fx.Node, None]:
    """Values that may be captures, in graph order: ``write_slice_`` sources, concat
    inputs and returned values (a cheap superset of ``capture_values``)."""
    from compile_pass.dataflow import is_cat

    found: Dict[fx.Node, None] = {}
    for node in nodes:
        src = _write_source(node)
        if src is not None:
            found[src] = None
        elif is_cat(node) and node.args and isinstance(node.args[0], (list, tuple)):
            found.update((a, None) for a in node.args[0] if isinstance(a, fx.Node))
        elif node.op == "output":
            found.update((a, None) for a in node.all_input_nodes)
    return found


def merge_capture_twins(graph: fx.Graph) -> List[TwinMerge]:
    """Merge every capture with its twin (see the module docstring); return the merges.

    Cheap where nothing is merged: the capture groups are found only if some concat input
    or returned value has a twin."""
    with gc_paused():
        # the graph's table only where some candidate has a same-call sibling
        if not any(_may_have_twin(n) for n in _candidates(graph.nodes)):
            return []
        table = NodeTable(graph)
        candidates = [n for n in _candidates(table.nodes) if twin_of(n, table) is not None]
        if not candidates:
            return []
        captures = set(capture_values(graph, table))
        leaving = escaping(graph)
        merges: List[TwinMerge] = []
        dropped: Set[fx.Node] = set()
        for capture in candidates:
            if capture in dropped or capture not in captures:
                continue
            twin = twin_of(capture, table)
            # two tensors the caller receives stay two
            while twin is not None and not _both_leave(capture, twin, leaving):
                keep, drop = (twin, capture) if table.position[twin] < table.position[capture] \
                    else (capture, twin)
                merges.append(TwinMerge(keep.name, drop.name, _op_name(keep), source_line(capture)))
                drop.replace_all_uses_with(keep)
                graph.erase_node(drop)
                dropped.add(drop)
                if drop in leaving:
                    leaving.add(keep)
                table = NodeTable(graph)
                capture = keep
                twin = twin_of(capture, table)
        return merges
