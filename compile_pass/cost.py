"""Cost model: the estimated peak of a graph before and after a planned capture group.

The "after" peak is priced on the original graph's storage intervals (``LivenessModel``)
rather than on a rewritten copy, so deciding a group costs one sweep, not a graph copy:

- the concat's storage becomes the packed buffer: born at the group's first write
  instead of at the concat, freed when the concat's result was;
- a COPY capture is no longer read by the concat: it dies at its write (or at its last
  other reader, whichever is later);
- a COMPUTE_INTO, COMPUTE_INTO_OP or ELIDE_CLONE capture allocates nothing: its value is
  the buffer's slice (readers of it keep the buffer alive).

- a hoisted producer (``plan.py``: moved up right after its last input) runs there: its
  storage is born there, and its inputs are read there for its part.

``tests/test_capture_pass.py`` checks this against the liveness of the rewritten graph,
hoisting included.
"""

from __future__ import annotations

from typing import Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch.fx as fx

from compile_pass.dataflow import NodeTable, is_cat
from compile_pass.find import LAYER_DEPTH, classify_producer
from compile_pass.groups import Capture, CaptureGroup, GroupKind, Producer, Strategy
from compile_pass.liveness import Interval, LivenessModel

__all__ = ["write_time", "planned_changes", "planned_peak", "changed_span",
           "INDUCTOR_COMPUTES_INTO_CAT", "inductor_computes_into", "inductor_shared_storages",
           "graph_liveness", "without_fusion_into", "lift_slack", "lifted_floor", "lifted_peak"]

#: Producers Inductor's concat lowering computes straight into the concat's output (their
#: layout is still flexible when the concat is lowered; extern and fallback outputs, bmm
#: and graph inputs are copied instead).
INDUCTOR_COMPUTES_INTO_CAT = frozenset({Producer.POINTWISE, Producer.EXACT_ARITHMETIC,
                                        Producer.CLONE, Producer.MATMUL})


def inductor_computes_into(producer: fx.Node, table: Optional[NodeTable] = None) -> bool:
    """Inductor's concat lowering computes ``producer`` straight into the concat output
    (a ``NonOwningLayout`` slice of it), whatever else reads it: measured on the post-grad
    graphs of the reference models, an ``addmm`` capture that is also the residual stream
    lives in the concat's buffer from the first capture on."""
    return classify_producer(producer, table) in INDUCTOR_COMPUTES_INTO_CAT


def inductor_shared_storages(table: NodeTable, twins: Optional[Mapping[fx.Node, fx.Node]] = None,
                             except_cat: Optional[fx.Node] = None,
                             groups: Optional[Sequence[CaptureGroup]] = None) -> Dict[fx.Node, fx.Node]:
    """Values that hold another value's storage once Inductor has compiled ``table``'s
    graph: node -> the node whose storage it holds (``LivenessModel``'s ``computed_into``).

    - ``twins``: captures merged with their twins before Inductor's pattern passes
      (``twins.capture_twins``: the later of a pair -> the earlier) are one value;
    - every concat input (but ``except_cat``'s) that Inductor computes into its concat
      (``inductor_computes_into``), after twins are merged. ``groups``: the graph's
      concat groups as found, whose captures' producers are read instead of classified
      again (concats of fewer than two inputs, which have no group, are left out).
    """
    twins = dict(twins or {})
    into: Dict[fx.Node, fx.Node] = {}  # value -> the concat computing it into its output
    if groups is not None:  # groups of an earlier version of the graph may be among them
        inputs = [(g.cat, [(c.node, c.producer) for c in g.captures if c.node in table.position])
                  for g in groups if g.kind is GroupKind.CONCAT and g.cat in table.position]
    else:
        inputs = [(node, [(a, None) for a in node.args[0] if isinstance(a, fx.Node)])
                  for node in table.nodes
                  if is_cat(node) and node.args and isinstance(node.args[0], (list, tuple))]
    for cat, args in inputs:
        if cat is except_cat:
            continue
        for arg, producer in args:
            value = twins.get(arg, arg)  # a merged twin: the node Inductor keeps
            if value in into or value in twins:
                continue  # computed into an earlier concat already
            if producer is None:
                producer = classify_producer(value, table)
            if producer in INDUCTOR_COMPUTES_INTO_CAT:
                into[value] = cat
    shared = {**twins, **into}
    for node in list(shared):  # a twin merged into a value computed into a concat
        holder, seen = shared[node], {node}
        while holder in shared and holder not in seen:
            seen.add(holder)
            holder = shared[holder]
        shared[node] = holder
    return shared


#: strategies whose capture allocates nothing: its value is computed or copied into the slice
#: where the producer was
_IN_PLACE = (Strategy.COMPUTE_INTO, Strategy.COMPUTE_INTO_OP, Strategy.ELIDE_CLONE)


def _moved(model: LivenessModel, group: CaptureGroup) -> Dict[fx.Node, int]:
    """Producers the plan hoists -> the time they run at after the rewrite (half steps):
    right after their hoist point."""
    return {c.node: 2 * model.position[c.hoist_after] + 1
            for c in group.captures if c.hoist_after is not None}


def write_time(model: LivenessModel, capture: Capture,
               moved: Optional[Mapping[fx.Node, int]] = None) -> Optional[int]:
    """When a planned capture is written (half steps); None for graph inputs (with the first).
    ``moved``: hoisted producers' new times (``_moved``): their write follows them."""
    if capture.write_after is None:
        return None
    if moved and capture.node in moved and capture.write_after is capture.node:
        return moved[capture.node]
    if capture.strategy in _IN_PLACE:
        return moved[capture.node] if moved and capture.node in moved else 2 * model.position[capture.node]
    return 2 * model.position[capture.write_after] + 1


def _last_read(model: LivenessModel, key: Hashable, gone: frozenset,
               moved: Mapping[fx.Node, int]) -> int:
    """Time of the last read of storage ``key`` once the nodes in ``gone`` no longer read
    it and the ``moved`` nodes run at their new times."""
    last = 0
    for node in model.nodes_of.get(key, ()):
        if node not in gone:
            last = max(last, moved.get(node, 2 * model.position[node]))
        for user in node.users:
            if user in gone:
                continue
            last = max(last, model.end if user.op == "output" else moved.get(user, 2 * model.position[user]))
    return last


def planned_changes(model: LivenessModel, group: CaptureGroup,
                    buffer_born: Optional[int] = None) -> Dict[Hashable, Optional[Interval]]:
    """Interval changes that the planned rewrite of ``group`` makes to ``model``'s graph.
    ``buffer_born``: when the packed buffer is allocated (0: before the graph runs, a
    lifted buffer); default: right before the first write.

    Hoisted producers (``Capture.hoist_after``) run right after their hoist point: their
    storage is born there, and their inputs are read there for the last time by them."""
    moved = _moved(model, group)
    writes = {c.node: write_time(model, c, moved) for c in group.captures}
    times = [t for t in writes.values() if t is not None]
    first_write = min(times) if buffer_born is None else buffer_born
    cat_key = model.keys_of[group.cat][0]
    packed = model.intervals[cat_key]
    buffer_last = packed.last
    elided = frozenset(c.node for c in group.captures if c.strategy is Strategy.ELIDE_CLONE)
    gone = frozenset({group.cat}) | elided  # nodes the rewritten graph no longer has
    slices: set = set()  # storages that become the buffer's slices
    copies: Dict[Hashable, int] = {}  # storage -> time of its last planned write
    for capture in group.captures:
        keys = model.keys_of.get(capture.node) or []
        key = keys[0] if keys else None
        if key is None or key not in model.intervals or key == cat_key:
            continue  # graph inputs and parameters: live anyway
        if capture.strategy in _IN_PLACE:
            slices.add(key)
        else:
            copies[key] = max(copies.get(key, 0), writes[capture.node] or 0)
    # storages whose reads move: the elided clones' sources (now read by their write) and
    # the inputs of hoisted producers
    reads: Dict[Hashable, int] = {}
    for capture in group.captures:
        node = capture.node
        if capture.strategy is Strategy.ELIDE_CLONE:
            for key in model.keys_of.get(node.args[0], ()) if isinstance(node.args[0], fx.Node) else ():
                reads[key] = max(reads.get(key, 0), writes[node] or 0)
        if node in moved:
            for arg in node.all_input_nodes:
                for key in model.keys_of.get(arg, ()):
                    reads.setdefault(key, 0)
    changes: Dict[Hashable, Optional[Interval]] = {}
    for key in slices:
        buffer_last = max(buffer_last, _last_read(model, key, gone, moved))
        changes[key] = None
    for key in set(copies) | set(reads):
        if key in slices or key == cat_key or key not in model.intervals:
            continue
        current = model.intervals[key]
        born = min([current.born] + [moved[n] for n in model.nodes_of.get(key, ()) if n in moved])
        last = max(_last_read(model, key, gone, moved), copies.get(key, 0), reads.get(key, 0))
        changes[key] = Interval(current.size, born, last)
    changes[cat_key] = Interval(packed.size, first_write, buffer_last)
    return changes


def planned_peak(model: LivenessModel, group: CaptureGroup, buffer_born: Optional[int] = None) -> int:
    """Estimated peak bytes of the graph after the planned rewrite of ``group``."""
    return model.peak(planned_changes(model, group, buffer_born))


def changed_span(model: LivenessModel, group: CaptureGroup) -> Optional[Tuple[int, int]]:
    """Times ``(first, last)`` of ``model``'s graph outside which the planned rewrite of
    ``group`` leaves the live bytes exactly as they are, hoisting included; None if no
    such bound holds.

    Before the earliest write, hoist point or producer (a producer a compiler computes
    into the concat's storage allocates that storage there) nothing has changed yet.
    After the concat every storage is live exactly when it was: the buffer takes the
    concat result's place and lifetime, a copied capture still lives to its last other
    reader, a hoisted producer's inputs were read before the concat anyway. The exception
    is a capture computed into its slice that is read after the concat (it stays a slice
    of the buffer): then None. ``tests/test_capture_pass.py`` checks the bound against
    rewritten graphs.
    """
    starts = [t for t in (write_time(model, c) for c in group.captures) if t is not None]
    starts += [2 * model.position[c.hoist_after] + 1 for c in group.captures if c.hoist_after is not None]
    starts += [2 * model.position[c.node] for c in group.captures
               if c.node.op not in ("placeholder", "get_attr")]
    if not starts or any(c.strategy is Strategy.COMPUTE_INTO for c in group.captures):
        return None
    return min(starts), 2 * model.position[group.cat]


# ------------------------------------------------------------ the graph as its compiler runs it
def graph_liveness(graph: fx.Graph, *, inductor_cost: bool, merge_twins: bool,
                   table: Optional[NodeTable] = None, twins: Optional[Mapping[fx.Node, fx.Node]] = None,
                   except_cat: Optional[fx.Node] = None,
                   groups: Optional[Sequence[CaptureGroup]] = None) -> LivenessModel:
    """The liveness model of ``graph`` as its compiler will run it. ``inductor_cost``:
    Inductor's concat lowering is modelled (``inductor_shared_storages``, all concats but
    ``except_cat``'s); ``merge_twins``: Inductor merges capture twins first (``twins``,
    found here when not given); ``groups``: the graph's groups as found, if at hand."""
    if not inductor_cost:
        return LivenessModel(graph, table=table)
    from compile_pass.twins import capture_twins, capture_values

    table = NodeTable.of(graph, table)
    if merge_twins and twins is None:
        twins = capture_twins(capture_values(graph, table), table)
    shared = inductor_shared_storages(table, twins if merge_twins else None, except_cat, groups)
    return LivenessModel(graph, shared, table=table)


def without_fusion_into(model: LivenessModel, graph: fx.Graph, group: CaptureGroup, *,
                        merge_twins: bool, table: NodeTable, twins: Mapping[fx.Node, fx.Node],
                        groups: Sequence[CaptureGroup]) -> LivenessModel:
    """``model`` (an Inductor-cost liveness of ``graph``) with nothing computed into
    ``group``'s concat, which its rewrite removes: ``model`` itself where nothing was."""
    shared = model.computed_into
    if group.cat not in shared and group.cat not in shared.values():
        return model
    return graph_liveness(graph, inductor_cost=True, merge_twins=merge_twins, table=table,
                          twins=twins, except_cat=group.cat, groups=groups)


# ------------------------------------------------------------ a buffer lifted out of the graph
def lift_slack(group: CaptureGroup) -> int:
    """How much cheaper the list path must be estimated, in bytes, before a lifted rewrite
    is rejected: one capture's bytes for captures taken a layer or more apart
    (``find.LAYER_DEPTH``), 0 for a concat of values one matmul apart (MLA's k join),
    which is the model's own computation and must pay for itself.

    With the buffer lifted out of the graph, Inductor plans every other buffer as in the
    build without captures, so the rewrite costs the packed bytes and no more. The list
    path's concat buffer inside the graph changes that plan: Inductor's wrapper keeps a
    freed buffer for a later one of the same size whenever its own estimated peak allows,
    which neither its estimate nor ours sees next to an opaque kernel's temporaries. That
    moves single activations, so a list path estimated cheaper by less than one capture
    is not trusted to be (measured: the capture-dominated Llama, estimated 16 KiB cheaper
    on the list path, paid 1.33x the packed bytes there and 1.00x rewritten).
    """
    if group.depth_span < LAYER_DEPTH:
        return 0
    return max(group.packed_bytes * c.width // max(sum(group.widths), 1) for c in group.captures)


def lifted_floor(model: LivenessModel, peak: int, group: CaptureGroup) -> Optional[int]:
    """Where a lifted buffer cannot pay, the peak it would at least reach; None otherwise.

    A lifted buffer is live from the start, so before the first capture is produced the
    rewritten graph holds what the graph holds now plus the packed bytes. If that alone
    exceeds ``peak`` (the graph's estimated peak) by more than ``lift_slack``, no saving
    later can help (MLA's k join, one per layer: its inputs come right before it)."""
    produced = [2 * model.position[c.node] for c in group.captures
                if c.node.op not in ("placeholder", "get_attr")]
    first = min(produced, default=0)
    if first == 0:
        return None
    floor = model.max_outside(first, model.end) + group.packed_bytes
    return floor if floor > peak + lift_slack(group) else None


def lifted_peak(model: LivenessModel, buffer: fx.Node) -> int:
    """Peak of a rewritten graph whose ``buffer`` is allocated before the graph runs."""
    key = model.keys_of[buffer][0]
    interval = model.intervals[key]
    return model.peak({key: interval._replace(born=0)})
