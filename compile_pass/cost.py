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

from typing import Dict, Hashable, Optional, Tuple

from compile_pass.groups import Capture, CaptureGroup, Strategy
from compile_pass.liveness import Interval, LivenessModel

__all__ = ["write_time", "planned_changes", "planned_peak", "changed_span"]


def write_time(model: LivenessModel, capture: Capture) -> Optional[int]:
    """When a planned capture is written (half steps); None for graph inputs (with the first)."""
    if capture.write_after is None:
        return None
    if capture.strategy in (Strategy.COMPUTE_INTO, Strategy.ELIDE_CLONE):
        return 2 * model.position[capture.node]
    return 2 * model.position[capture.write_after] + 1


def planned_changes(model: LivenessModel, group: CaptureGroup) -> Dict[Hashable, Optional[Interval]]:
    """Interval changes that the planned rewrite of ``group`` makes to ``model``'s graph."""
    times = [t for t in (write_time(model, c) for c in group.captures) if t is not None]
    first_write = min(times)
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


def planned_peak(model: LivenessModel, group: CaptureGroup) -> int:
    """Estimated peak bytes of the graph after the planned rewrite of ``group``."""
    return model.peak(planned_changes(model, group))


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
