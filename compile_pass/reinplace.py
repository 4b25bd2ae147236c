"""Turn functionalized writes back into in-place ones (graphs run as is).

The writes are ``write_slice_`` and this project's other writing ops (``ops.MUTATED_ARG``).

AOTAutograd functionalizes every call to the mutating op ``compile_pass::write_slice_``
into ``auto_functionalized_v2(write_slice_, ..., _all_bases=[buf])``, whose eager
implementation clones the whole buffer before writing the slice, plus, for a buffer that
is a graph input (a piece of a split graph writing a buffer an earlier piece allocated),
a ``copy_`` of the result back into the input. Inductor undoes this itself (its
reinplacing pass); a graph that runs as is (``aot_eager``) would copy the whole packed
buffer at every write.

``reinplace_slice_writes`` restores the in-place call where that is exact: the buffer
version the functional call consumed is read by nothing after it (so overwriting it in
place is unobservable), and the call writes the whole base (no view arguments). The
functional result is then the buffer itself; a trailing ``copy_(buf, buf)`` that this
leaves is dropped.

``write_from_twins`` (Inductor's post-grad graph of a piece, before Inductor's own
reinplacing): a capture that the graph computes a second time, bit for bit, and returns
is written from that returned value instead. SGLang-style models capture
``hidden_states + residual`` and the next norm computes ``x + residual`` again from the
same two tensors; written from the capture, both sums read the two addends, so neither
can be computed in place into one of them (and Inductor fuses them into one kernel that
must allocate both). Written from the returned sum, the capture costs a copy out of a
value that is live anyway.
"""

from __future__ import annotations

import logging
import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from compile_pass.ops import MUTATED_ARG

__all__ = ["reinplace_slice_writes", "write_from_twins"]

log = logging.getLogger("compile_pass")

_COPY = torch.ops.aten.copy_.default


def _functional_write_base(node: fx.Node) -> Optional[fx.Node]:
    """The buffer a functionalized call of one of this project's writing ops
    (``ops.MUTATED_ARG``: ``write_slice_``, ``binary_into_slice_``, the projection ops)
    consumes, if it is one we can undo."""
    if node.op != "call_function" or not node.args or node.args[0] not in MUTATED_ARG:
        return None
    arg = MUTATED_ARG[node.args[0]]
    hop = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    if hop is not None and node.target is hop:
        bases = node.kwargs.get("_all_bases")
        view_args = {f"_{arg}_size", f"_{arg}_stride", f"_{arg}_storage_offset", f"_{arg}_slice_dim"}
        if (not isinstance(bases, (list, tuple)) or len(bases) != 1
                or node.kwargs.get(f"_{arg}_base_index") != 0 or view_args & set(node.kwargs)):
            return None
        return bases[0]
    v1 = getattr(torch.ops.higher_order, "auto_functionalized", None)
    if v1 is not None and node.target is v1:
        return node.kwargs.get(arg)
    return None


def reinplace_slice_writes(graph: fx.Graph) -> int:
    """Replace undoable functional ``write_slice_`` calls by in-place calls; return how many."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for node in list(graph.nodes):
        base = _functional_write_base(node)
        if not isinstance(base, fx.Node):
            continue
        here = position[node]
        later_readers = [u for u in base.users if u is not node and position.get(u, -1) > here
                         and not (u.target is _COPY and u.args[0] is base)]
        if later_readers:
            continue
        results = [u for u in node.users if u.target is operator.getitem]
        if len(results) != len(node.users):
            continue
        op = node.args[0]
        kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_") and k != MUTATED_ARG[op]}
        meta = {k: v for k, v in node.meta.items() if k != "val"}
        with graph.inserting_before(node):
            write = graph.call_function(op, (base,), kwargs)
            write.meta = meta
            write.meta["val"] = None
        for result in results:
            result.replace_all_uses_with(base)
            graph.erase_node(result)
        graph.erase_node(node)
        done += 1
    for node in list(graph.nodes):  # copy_(buf, buf) left by a write into a graph input
        if node.target is _COPY and len(node.args) == 2 and node.args[0] is node.args[1]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    if done:
        log.debug("aux_capture: %d functional slice writes made in place again", done)
    return done


#: Elementwise ops whose result is one correctly rounded operation on their operands: two
#: calls on the same stored operands are bitwise equal in any kernel.
_EXACT_ELEMENTWISE = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor)
#: aten ops Inductor runs as extern kernels writing a buffer (never inlined into a reader).
_STORED_ATEN = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                torch.ops.aten.baddbmm.default)


def _is_view_op(target: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def _stored(value: object) -> bool:
    """``value`` reaches a reader as loads of stored elements (a graph input, an extern
    kernel's or custom op's output, views of those, or a non-tensor), never as an
    expression Inductor inlines (which a compiler may contract differently per kernel)."""
    while isinstance(value, fx.Node):
        if value.op == "placeholder":
            return True
        if value.op != "call_function":
            return False
        target = value.target
        if target is operator.getitem:
            value = value.args[0]
            continue
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if target in _STORED_ATEN:
            return True
        if _is_view_op(target):
            value = value.args[0] if value.args else None
            continue
        return target.namespace not in ("aten", "prims")  # custom ops: fallback kernels
    return True


def _exact_twin(src: fx.Node, returned: List[fx.Node]) -> Optional[fx.Node]:
    """Another node computing exactly ``src``'s value, which the graph returns."""
    if src.op != "call_function" or src.target not in _EXACT_ELEMENTWISE:
        return None
    if src.kwargs.get("alpha", 1) != 1 or not all(_stored(a) for a in src.args):
        return None
    for node in returned:
        if (node is not src and node.op == "call_function" and node.target is src.target
                and node.args == src.args and node.kwargs == src.kwargs):
            return node
    return None


def write_from_twins(graph: fx.Graph) -> int:
    """Write captures from bitwise-equal values the graph returns; return how many.

    For each functionalized ``write_slice_`` whose ``src`` is an add/sub/mul of stored
    operands that another returned node computes from the same operands, the write reads
    that node instead (moved right after it when it comes later; skipped when a later
    write of the same buffer would then come before it), and ``src`` is erased once
    unused. Values the graph computes are unchanged.
    """
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    returned = output.all_input_nodes
    done = 0
    for node in list(graph.nodes):
        if _functional_write_base(node) is None:
            continue
        src = node.kwargs.get("src")
        if not isinstance(src, fx.Node):
            continue
        twin = _exact_twin(src, returned)
        if twin is None:
            continue
        position: Dict[fx.Node, int] = {n: i for i, n in enumerate(graph.nodes)}
        results: List[fx.Node] = list(node.users)
        if position[twin] > position[node]:
            if any(position[user] <= position[twin] for r in results for user in r.users):
                continue  # the buffer this write produces is written again before the twin
            twin.append(node)
            previous = node
            for result in results:
                previous.append(result)
                previous = result
        node.update_kwarg("src", twin)
        if not src.users:
            graph.erase_node(src)
        done += 1
    if done:
        log.debug("aux_capture: %d capture writes read a bitwise-equal returned value", done)
    return done
