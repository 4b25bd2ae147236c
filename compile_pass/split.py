"""Split a Dynamo graph at calls to named ops, as serving engines split for piecewise graphs.

``split_graph(gm, split_ops)`` cuts the graph before and after every call to one of
``split_ops`` (attention, all-reduce): the result is a ``GraphModule`` whose submodules are
*pieces* (``submod_<i>``) in the original order, alternating between compute pieces and
pieces that hold exactly one split-op call. Values that cross a cut are passed from piece to
piece; that includes a packed capture buffer the capture pass allocated in one piece and
writes in later ones (``write_slice_`` declares the mutation, so each piece keeps its
writes through functionalization).

Split ops are named ``"namespace::op"`` (any overload) or ``"namespace::op.overload"``.
A name that resolves to no registered op, or an op that never appears in the graph, is not
an error (a backend option may name ops of models it is not compiling right now): it is
reported in ``SplitGraph.warnings``, logged and warned once.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

__all__ = ["SplitGraph", "split_graph", "check_split_ops", "count_split_op_calls", "split_op_name",
           "unknown_split_ops"]

log = logging.getLogger("compile_pass")


def check_split_ops(split_ops: object) -> Tuple[str, ...]:
    """Validate the ``split_ops`` option: a list of ``"namespace::op[.overload]"`` strings."""
    if isinstance(split_ops, str) or not isinstance(split_ops, (list, tuple)):
        raise TypeError(f"split_ops must be a list of op names like 'models::attention', "
                        f"got {split_ops!r}")
    for name in split_ops:
        if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
            raise ValueError(f"split op {name!r} is not of the form 'namespace::op' "
                             f"(e.g. 'models::attention' or '_c10d_functional::all_reduce')")
    return tuple(split_ops)


def _resolve(name: str) -> Optional[object]:
    namespace, op = name.split("::")
    packet_name, _, overload = op.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        return None


def unknown_split_ops(split_ops: Sequence[str]) -> List[str]:
    """The names among ``split_ops`` that resolve to no registered op."""
    return [name for name in split_ops if _resolve(name) is None]


def split_op_name(node: fx.Node) -> Optional[str]:
    """``"namespace::op"`` of the op a node calls, if it calls an ``OpOverload``/packet."""
    target = node.target
    if node.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


@dataclass
class SplitGraph:
    """A graph split at split-op calls: ``module`` runs the pieces in order."""

    module: fx.GraphModule
    compute_pieces: List[str]  # submodule names of pieces without a split op
    op_pieces: List[str]  # submodule names of pieces holding one split-op call
    calls: Dict[str, int] = field(default_factory=dict)  # split op name -> calls found
    warnings: List[str] = field(default_factory=list)

    @property
    def num_pieces(self) -> int:
        return len(self.compute_pieces)


def _split_op_key(node: fx.Node, split_ops: Sequence[str]) -> Optional[str]:
    """The entry of ``split_ops`` a node's call matches, if any."""
    name = split_op_name(node)
    if name is None:
        return None
    if name in split_ops:
        return name
    overload = getattr(node.target, "_overloadname", "")
    full = f"{name}.{overload}" if overload else name
    return full if full in split_ops else None


def count_split_op_calls(gm: fx.GraphModule, split_ops: Sequence[str]) -> Tuple[Dict[str, int], List[str]]:
    """Calls of each split op in ``gm``, and a warning for each op that does not exist or
    never appears (logged and issued with ``warnings.warn``)."""
    split_ops = check_split_ops(split_ops)
    calls: Dict[str, int] = {name: 0 for name in split_ops}
    for node in gm.graph.nodes:
        key = _split_op_key(node, split_ops)
        if key is not None:
            calls[key] += 1
    unknown = set(unknown_split_ops(split_ops))
    problems = [f"split op {name!r} does not exist (no such registered op)" if name in unknown
                else f"split op {name!r} never appears in this graph"
                for name, n in calls.items() if n == 0]
    for message in problems:
        log.warning("aux_capture: %s", message)
        warnings.warn(f"aux_capture: {message}", stacklevel=4)
    return calls, problems


def split_graph(gm: fx.GraphModule, split_ops: Sequence[str]) -> SplitGraph:
    """Split ``gm`` before and after every call to one of ``split_ops`` (original order kept).

    With no call to any of them the result has one compute piece (the whole graph).
    """
    calls, problems = count_split_op_calls(gm, split_ops)
    partition_of: Dict[fx.Node, int] = {}
    op_partitions = set()
    partition = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _split_op_key(node, calls) is not None:
            partition += 1
            partition_of[node] = partition
            op_partitions.add(partition)
            partition += 1
        else:
            partition_of[node] = partition
    split = split_module(gm, gm, lambda node: partition_of[node], keep_original_order=True)
    compute, ops = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.rsplit("_", 1)[1])
            (ops if index in op_partitions else compute).append(node.target)
    return SplitGraph(split, compute, ops, calls, problems)
