"""Plan a capture group: a strategy and a write point for each capture.

Semantics kept: the concat reads each capture when it runs. A capture is written into the
packed buffer at a point where its value already equals what the concat would read:
right after its producer, unless the capture or an alias of it is mutated in place
between its producer and the concat; then right after the last such mutation.

Strategies (``Strategy``):
- COMPUTE_INTO: correctly rounded arithmetic (add/sub/mul/div of two tensors of the
  capture's dtype) is recomputed by its ``out=`` variant straight into the slice: no
  temporary. Only for graphs that run as is (an ``out=`` write would be functionalized),
  and only where the capture may become a slice of the buffer for good: written in place
  by nothing, not a graph output, the concat's result not mutated either.
- COMPUTE_INTO_OP: the same arithmetic in a graph a compiler functionalizes next (the
  Inductor inner's), read by nothing but the concat and without a twin: the custom op
  ``compile_pass::binary_into_slice_`` computes it into the slice; no temporary.
- ELIDE_CLONE: ``clone(x)`` whose only reader is the concat: ``x`` is copied into the
  slice at the clone's position; the clone disappears.
- COPY: ``write_slice_`` right after the write point.

Hoisting (functional graphs only, ``hoist=True``): a scheduler may have moved a producer
next to the concat (Inductor's locality reordering does), which keeps the producer's
inputs alive until then. A functional producer is moved right after its last input, so
the capture is written as soon as its value can exist.
"""

from __future__ import annotations

from typing import AbstractSet, Optional, Set

import torch.fx as fx

from compile_pass.dataflow import NodeTable, source_line
from compile_pass.find import exact_binary_op, exact_out_variant
from compile_pass.groups import Capture, CaptureGroup, Decision, GroupKind, Producer, Rejection, Strategy

__all__ = ["GraphFacts", "plan_group"]


class GraphFacts:
    """Per-graph facts the planner reads: node order, aliases, in-place writers (from the
    graph's ``NodeTable``; pass the one the finder used to avoid another sweep)."""

    def __init__(self, graph: fx.Graph, table: Optional[NodeTable] = None) -> None:
        table = NodeTable.of(graph, table)
        self.graph = graph
        self.table = table
        self.nodes = table.nodes
        self.position = table.position
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.last_placeholder: Optional[fx.Node] = placeholders[-1] if placeholders else None
        self.mutators = table.mutators

    def alias_set(self, node: fx.Node) -> Set[fx.Node]:
        """``node`` and every node whose value shares its storage."""
        key = self.table.key.get(node)
        return set(self.table.holders.get(key, ())) | {node} if key is not None else {node}

    def last_mutation(self, node: fx.Node, after: int, before: int) -> Optional[fx.Node]:
        """The last node strictly between positions ``after`` and ``before`` that writes
        ``node``'s value or an alias of it in place."""
        last = None
        for alias in self.alias_set(node):
            for writer in self.mutators.get(alias, ()):
                p = self.position[writer]
                if after < p < before and (last is None or p > self.position[last]):
                    last = writer
        return last


def _may_become_a_slice(node: fx.Node, facts: GraphFacts, group: CaptureGroup) -> bool:
    """True if ``node``'s value can live in the packed buffer for the rest of the graph:
    nothing writes it in place after it is produced and it is not itself a graph output
    (either would make the capture and the packed result share bytes they did not share),
    except as the one returned value of an output group that becomes that slice anyway."""
    if facts.last_mutation(node, facts.position[node], len(facts.nodes)) is not None:
        return False
    for alias in facts.alias_set(node):
        for user in alias.users:
            if user.op != "output":
                continue
            returned = user.args[0] if isinstance(user.args[0], (list, tuple)) else [user.args[0]]
            if not (group.kind is GroupKind.OUTPUTS and alias is node and user is group.cat
                    and list(returned).count(node) == 1):
                return False
    return True


def _only_reader_is(node: fx.Node, reader: fx.Node) -> bool:
    return set(node.users) == {reader}


def _hoist_point(node: fx.Node, facts: GraphFacts) -> Optional[fx.Node]:
    """The earliest node a functional producer can move right after, if earlier than now:
    after its last input, after the last in-place write into any input's storage (a view
    of a buffer an earlier rewrite fills), and never among the graph's placeholders."""
    if node.op != "call_function":
        return None
    here = facts.position[node]
    candidates = list(node.all_input_nodes)
    if facts.last_placeholder is not None:
        candidates.append(facts.last_placeholder)
    for arg in node.all_input_nodes:
        writer = facts.last_mutation(arg, -1, here)
        if writer is not None:
            candidates.append(writer)
    if not candidates:
        return None
    latest = max(candidates, key=lambda n: facts.position[n])
    return latest if facts.position[latest] < here - 1 else None


def _plan_capture(capture: Capture, group: CaptureGroup, facts: GraphFacts, runs_as_is: bool,
                  repeated: Set[fx.Node], seen: Set[fx.Node], cat_mutated: bool, hoist: bool,
                  into_op: bool, twinned: AbstractSet[fx.Node]) -> None:
    node, cat = capture.node, group.cat
    produced_at = facts.position[node] if node.op not in ("placeholder", "get_attr") else -1
    mutation = facts.last_mutation(node, produced_at, facts.position[cat])
    first_occurrence = node not in seen
    seen.add(node)
    duplicate = node in repeated  # concatenated more than once: plain copies only
    if mutation is not None:
        capture.strategy, capture.write_after = Strategy.COPY, mutation
        capture.note = f"mutated in place after it is produced; written after {mutation.name}"
        where = source_line(mutation)
        if where:
            capture.note += f" ({where})"
        return
    if node.op in ("placeholder", "get_attr"):
        capture.strategy, capture.write_after = Strategy.COPY, None
        capture.note = "graph input: written together with the first capture"
        return
    if hoist and first_occurrence:
        capture.hoist_after = _hoist_point(node, facts)
    hoisted = (f"; moved up to right after {capture.hoist_after.name}, as early as its inputs allow"
               if capture.hoist_after is not None else "")
    if capture.producer is Producer.CLONE and not duplicate and _only_reader_is(node, cat):
        capture.strategy, capture.write_after = Strategy.ELIDE_CLONE, node
        capture.note = "clone read only by the concat: the write into the buffer is the copy" + hoisted
        return
    if (runs_as_is and capture.producer is Producer.EXACT_ARITHMETIC and not duplicate
            and not cat_mutated and exact_out_variant(node) is not None
            and _may_become_a_slice(node, facts, group)):
        capture.strategy, capture.write_after = Strategy.COMPUTE_INTO, node
        capture.note = "computed straight into its slice by the out= variant"
        return
    if (into_op and capture.producer is Producer.EXACT_ARITHMETIC and not duplicate
            and not cat_mutated and _only_reader_is(node, cat) and node not in twinned
            and exact_binary_op(node) is not None and _may_become_a_slice(node, facts, group)):
        capture.strategy, capture.write_after = Strategy.COMPUTE_INTO_OP, node
        capture.note = (f"computed straight into its slice by compile_pass::binary_into_slice_ "
                        f"({exact_binary_op(node)}): read only by the concat, no temporary")
        return
    capture.strategy, capture.write_after = Strategy.COPY, node
    capture.note = "copied into its slice right after it is produced" + hoisted


def plan_group(group: CaptureGroup, facts: GraphFacts, runs_as_is: bool,
               hoist: bool = False, into_op: bool = False,
               twinned: AbstractSet[fx.Node] = frozenset()) -> CaptureGroup:
    """Give each capture of a FOUND group its strategy and write point (in place).

    ``into_op``: a functional graph whose capture-only arithmetic may be computed into its
    slice by ``compile_pass::binary_into_slice_`` (not a capture with a twin in
    ``twinned``: that one is the model's own value once twins are merged, ``twins.py``)."""
    if group.decision is not Decision.FOUND:
        return group
    cat_position = facts.position[group.cat]
    cat_mutated = facts.last_mutation(group.cat, cat_position, len(facts.nodes)) is not None
    seen: Set[fx.Node] = set()
    nodes = [c.node for c in group.captures]
    repeated = {n for n in nodes if nodes.count(n) > 1}
    for capture in group.captures:
        _plan_capture(capture, group, facts, runs_as_is and not hoist, repeated, seen, cat_mutated,
                      hoist, into_op and not runs_as_is, twinned)
    writes = [c for c in group.captures if c.write_after is not None]
    if not writes:
        return group.reject(Rejection.ALL_GRAPH_INPUTS,
                            "every capture is a graph input: the concat is already the only copy")
    return group
