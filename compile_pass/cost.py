"""Cost model: the estimated peak of a graph before and after a planned capture group.

The "after" peak is priced on the original graph's storage intervals (``LivenessModel``)
rather than on a rewritten copy, so deciding a group costs one sweep, not a graph copy:

- the concat's storage becomes the packed buffer: born at the group's first write
  instead of at the concat, freed when the concat's result was;
- a COPY capture is no longer read by the concat: it dies at its write (or at its last
  other reader, whichever is later);
- a COMPUTE_INTO or ELIDE_CLONE capture allocates nothing: its value is the buffer's
  slice (readers of it keep the buffer alive).

Plans that hoist producers (``plan.py``) move nodes; the pass prices those on the rewritten
copy of the graph instead (``capture_pass._decide``).

``tests/test_capture_pass.py`` checks this against the liveness of the rewritten graph.
"""

from __future__ import annotations

from typing import Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch.fx as fx

from compile_pass.dataflow import NodeTable, is_cat
from compile_pass.find import classify_producer
from compile_pass.groups import Capture, CaptureGroup, GroupKind, Producer, Strategy
from compile_pass.liveness import Interval, LivenessModel

__all__ = ["write_time", "planned_changes", "planned_peak", "changed_span",
           "INDUCTOR_COMPUTES_INTO_CAT", "inductor_computes_into", "inductor_shared_storages"]

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
    shared: Dict[fx.Node, fx.Node] = dict(twins or {})
    if groups is not None:
        inputs = [(g.cat, [(c.node, c.producer) for c in g.captures])
                  for g in groups if g.kind is GroupKind.CONCAT]
    else:
        inputs = [(node, [(a, None) for a in node.args[0] if isinstance(a, fx.Node)])
                  for node in table.nodes
                  if is_cat(node) and node.args and isinstance(node.args[0], (list, tuple))]
    for cat, args in inputs:
        if cat is except_cat:
            continue
        for arg, producer in args:
            value = shared.get(arg, arg)
            if value in shared:
                continue
            if producer is None:
                producer = classify_producer(value, table)
            if producer in INDUCTOR_COMPUTES_INTO_CAT:
                shared[value] = cat
    for node, holder in list(shared.items()):  # a twin merged into a value computed into a cat
        while holder in shared:
            holder = shared[holder]
        shared[node] = holder
    return shared


def write_time(model: LivenessModel, capture: Capture) -> Optional[int]:
    """When a planned capture is written (half steps); None for graph inputs (with the first)."""
    if capture.write_after is None:
        return None
    if capture.strategy in (Strategy.COMPUTE_INTO, Strategy.ELIDE_CLONE):
        return 2 * model.position[capture.node]
    return 2 * model.position[capture.write_after] + 1


def planned_changes(model: LivenessModel, group: CaptureGroup,
                    buffer_born: Optional[int] = None) -> Dict[Hashable, Optional[Interval]]:
    """Interval changes that the planned rewrite of ``group`` makes to ``model``'s graph.
    ``buffer_born``: when the packed buffer is allocated (0: before the graph runs, a
    lifted buffer); default: right before the first write."""
    times = [t for t in (write_time(model, c) for c in group.captures) if t is not None]
    first_write = min(times) if buffer_born is None else buffer_born
    cat_key = model.keys_of[group.cat][0]
    packed = model.intervals[cat_key]
    buffer_last = packed.last
    changes: Dict[Hashable, Optional[Interval]] = {}
    for capture in group.captures:
        keys = model.keys_of.get(capture.node) or []
        key = keys[0] if keys else None
        if key is None or key not in model.intervals or key == cat_key:
            continue  # graph inputs and parameters: live anyway
        if key in changes and changes[key] is None:
            continue  # a duplicate of a capture that already became the buffer's slice
        if capture.strategy in (Strategy.COMPUTE_INTO, Strategy.ELIDE_CLONE):
            buffer_last = max(buffer_last, model.last_read(key, ignore=group.cat))
            changes[key] = None
        else:
            current = changes.get(key, model.intervals[key])
            written = write_time(model, capture) or 0
            last = max(model.last_read(key, ignore=group.cat), written)
            changes[key] = Interval(current.size, current.born, last)
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
