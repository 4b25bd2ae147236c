"""The one data type that flows through the pass: a capture group.

found (``find.find_capture_groups``) -> planned (``plan.plan_group``: a strategy and a
write point per capture) -> priced (``cost.py``: the estimated peak before and after, and
the decision with its reason) -> rewritten (``rewrite``) -> reported (``result.PassResult``:
counters, log lines, the diff tool). Within one version of the graph every field a later
stage reads is set by an earlier one. When a rewrite changes the graph, the groups not yet
decided are found again on the new graph (``capture_pass``: their nodes may be gone) and go
through the same stages from the start.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from compile_pass.dataflow import module_location, source_line

__all__ = ["Producer", "Strategy", "Decision", "Rejection", "GroupKind", "Provenance", "Capture",
           "CaptureGroup", "summarize"]


class Producer(str, Enum):
    """What computes a captured value, as far as the rewrite and Inductor care."""

    EXACT_ARITHMETIC = "exact arithmetic"  # add/sub/mul/div: correctly rounded, any layout
    POINTWISE = "pointwise"
    CLONE = "clone"
    MATMUL = "matmul"  # mm / addmm / linear: Inductor writes it into a cat slice
    BATCHED_MATMUL = "bmm"
    CUSTOM_OP = "custom op"
    GRAPH_INPUT = "graph input"
    VIEW = "view"
    OTHER = "other"


class Strategy(str, Enum):
    """How one capture reaches its slice of the packed buffer."""

    COMPUTE_INTO = "compute into slice"  # the producer's out= variant writes the slice
    #: a capture-only add/sub/mul/div, in a graph a compiler functionalizes next: the op
    #: ``compile_pass::binary_into_slice_`` computes it into the slice, no temporary
    COMPUTE_INTO_OP = "compute into slice (op)"
    ELIDE_CLONE = "elide clone"  # clone(x) feeding only the capture: copy x into the slice
    COPY = "copy"  # write_slice_ after the producer (or after its last mutation)


class GroupKind(str, Enum):
    """Who reads the captures: a concat in the graph, or the graph's caller."""

    CONCAT = "concat"  # torch.cat(captures, dim) inside the graph
    OUTPUTS = "outputs"  # the captures are graph outputs; the caller packs them


class Rejection(str, Enum):
    """Why a group was left as it was: the machine-readable half of a rejection
    (``CaptureGroup.rejection``); ``CaptureGroup.reason`` has the detail text."""

    #: found: the concat is not a capture concat the pass can pack
    NOT_PACKABLE = "not packable"  # dim not a constant, an input no tensor node, ranks differ
    SYMBOLIC_WIDTH = "symbolic width"  # a capture's width along the concat dim is symbolic
    MIXED_DTYPES = "mixed dtypes"  # torch.cat type-promotes; the packer keeps one dtype
    MIXED_DEVICES = "mixed devices"
    SHAPE_MISMATCH = "shape mismatch"  # a capture's size differs in a non-concat dim
    ONE_BLOCK = "one block"  # every capture from the same depth: not cross-layer captures
    #: found: returned captures that cannot become slices of one buffer
    RETURNED_TWICE = "returned twice"
    RETURNED_ALIAS = "returned alias"  # a graph input or a view is returned
    #: planned
    ALL_GRAPH_INPUTS = "all graph inputs"  # the concat is already the only copy
    REQUIRES_GRAD = "requires grad"  # no autograd formula for in-place writes here
    INPUT_WRITTEN_IN_GRAPH = "input written in graph"  # a capture is an input written in place
    WITHIN_ONE_LAYER = "within one layer"  # a concat of values one matmul apart (MLA)
    #: priced
    NO_SAVING = "no saving"  # the estimated peak would not drop (or would rise)
    FUSED_INTO_READERS = "fused into its readers"  # Inductor computes the concat inside pointwise readers
    PEAK_ELSEWHERE = "peak elsewhere"  # reached outside the span the rewrite changes
    LIFTED_CANNOT_PAY = "lifted buffer cannot pay"  # live through the peak before the first capture
    #: rewritten
    NOT_EXPRESSIBLE = "not expressible"  # the planned writes cannot be expressed on this graph


class Decision(str, Enum):
    FOUND = "found"
    REWRITE = "rewrite"
    REJECT = "reject"


class Provenance:
    """Where a captured value comes from, for people (the diff tool, logs): the user source
    line of its producer and its place in the model, read from node metadata of the graph
    as it was when the capture was found (``order``: that graph's nodes, ``index``: the
    node's place among them; without them no location is given).

    Read on first use: no decision of the pass needs it, and a 61-layer graph has
    hundreds of concats (RoPE, MLA) whose provenance nobody reads.
    """

    def __init__(self, node: fx.Node, order: Optional[Sequence[fx.Node]] = None,
                 index: int = 0) -> None:
        self._node, self._order, self._index = node, order, index

    @functools.cached_property
    def source(self) -> str:
        return source_line(self._node)

    @functools.cached_property
    def location(self) -> str:
        if self._order is None:
            return ""
        return module_location(self._node, self._order[self._index + 1:self._index + 65])


@dataclass
class Capture:
    """One input of the concat: a captured value and how it will be written."""

    node: fx.Node
    position: int  # index among the concat's inputs
    offset: int  # start of its slice along the concat dim
    width: int  # its size along the concat dim
    producer: Producer
    provenance: Optional[Provenance] = field(default=None, repr=False, compare=False)
    write_after: Optional[fx.Node] = None  # planned: the write goes right after this node
    hoist_after: Optional[fx.Node] = None  # planned: the producer first moves right after this
    strategy: Optional[Strategy] = None
    note: str = ""  # why this strategy (e.g. "mutated in place at add_ (line 40)")

    @property
    def source(self) -> str:
        """User source line of the producer: 'llama.py:80 (forward): aux.append(h + r)'."""
        return self.provenance.source if self.provenance is not None else ""

    @property
    def location(self) -> str:
        """Where in the model: 'input of layers.2', 'in layers.3.mlp' ('' if unknown)."""
        return self.provenance.location if self.provenance is not None else ""

    def to_dict(self) -> Dict[str, Any]:
        return {
            "node": self.node.name,
            "position": self.position,
            "offset": self.offset,
            "width": self.width,
            "producer": self.producer.value,
            "source": self.source,
            "location": self.location,
            "write_after": self.write_after.name if self.write_after is not None else None,
            "hoist_after": self.hoist_after.name if self.hoist_after is not None else None,
            "strategy": self.strategy.value if self.strategy is not None else None,
            "note": self.note,
        }


@dataclass
class CaptureGroup:
    """Captures produced at different points of one graph, read together, and their fate.

    ``cat`` is the node that reads them all: the concat for ``GroupKind.CONCAT``, the
    graph's output node for ``GroupKind.OUTPUTS`` (then ``output_indices`` says which
    returned values are the captures, in order). ``packed_value`` is the (fake) value of
    the packed result the rewrite allocates.
    """

    cat: fx.Node
    captures: List[Capture]
    dim: int  # non-negative concat dim
    shape: Tuple[str, ...]  # packed shape, symbolic sizes as their expressions
    example_shape: Tuple[int, ...]  # packed shape at the example sizes
    dtype: torch.dtype
    device: torch.device
    packed_bytes: int  # bytes of the packed result at the example sizes
    decision: Decision = Decision.FOUND
    reason: str = ""  # why the decision, in words (a rejection's detail)
    rejection: Optional[Rejection] = None  # why it was rejected, machine-readable
    estimated_peak_before: Optional[int] = None
    estimated_peak_after: Optional[int] = None
    placement: str = ""  # which graph the rewrite targets (dynamo / aot / post_grad)
    kind: GroupKind = GroupKind.CONCAT
    output_indices: Tuple[int, ...] = ()  # OUTPUTS: positions of the captures among the outputs
    packed_value: Optional[torch.Tensor] = None  # fake value of the packed result
    #: deepest minus shallowest capture, in matmuls / opaque ops (``find``): how far apart
    #: in the model the captures are taken (0: one block; ``find.LAYER_DEPTH``: a layer)
    depth_span: int = 0
    #: ``fuse_projection``: whether the rewrite projects the captures into the draft's
    #: accumulator (``fuse_projection.py``) instead of packing them; ``projection`` says why
    #: not where it was asked for and does not
    fused: bool = False
    projection: str = ""

    @property
    def key(self) -> str:
        """Names the group within its graph (stable across rewrites of other groups)."""
        if self.kind is GroupKind.OUTPUTS:
            return f"outputs{list(self.output_indices)}"
        return self.cat.name

    @property
    def widths(self) -> Tuple[int, ...]:
        return tuple(c.width for c in self.captures)

    @property
    def k(self) -> int:
        return len(self.captures)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "cat": self.cat.name,
            "kind": self.kind.value,
            "output_indices": list(self.output_indices),
            "k": self.k,
            "dim": self.dim,
            "widths": list(self.widths),
            "shape": list(self.shape),
            "example_shape": list(self.example_shape),
            "dtype": str(self.dtype),
            "device": str(self.device),
            "packed_bytes": self.packed_bytes,
            "decision": self.decision.value,
            "rejection": self.rejection.value if self.rejection is not None else None,
            "reason": self.reason,
            "estimated_peak_before": self.estimated_peak_before,
            "estimated_peak_after": self.estimated_peak_after,
            "placement": self.placement,
            "depth_span": self.depth_span,
            "fused_projection": self.fused,
            "projection": self.projection,
            "captures": [c.to_dict() for c in self.captures],
        }

    def reject(self, why: Rejection, detail: str) -> "CaptureGroup":
        """Leave the group as it was: ``why`` for code, ``detail`` for people."""
        if not isinstance(why, Rejection):
            raise TypeError(f"a rejection needs a Rejection, got {why!r}")
        self.decision, self.rejection, self.reason = Decision.REJECT, why, detail
        return self

    def replace_nodes(self, node_map: Dict[fx.Node, fx.Node]) -> "CaptureGroup":
        """The same group over a copy of its graph (``node_map``: old node -> copied node)."""
        captures = [
            dataclasses.replace(
                c,
                node=node_map[c.node],
                write_after=node_map[c.write_after] if c.write_after is not None else None,
                hoist_after=node_map[c.hoist_after] if c.hoist_after is not None else None,
            )
            for c in self.captures
        ]
        return dataclasses.replace(self, cat=node_map[self.cat], captures=captures)


def summarize(groups: List[CaptureGroup]) -> Dict[str, int]:
    """Counts of groups by decision, for logs and counters."""
    counts = {"groups_found": len(groups), "groups_rewritten": 0, "groups_rejected": 0,
              "groups_projected": sum(1 for g in groups if g.fused)}
    for g in groups:
        if g.decision is Decision.REWRITE:
            counts["groups_rewritten"] += 1
        elif g.decision is Decision.REJECT:
            counts["groups_rejected"] += 1
    return counts

