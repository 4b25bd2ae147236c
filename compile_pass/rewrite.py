"""Rewrite a planned capture group into one packed buffer written in place.

Invariant of the rewritten graph: the buffer node ``aux_packed`` is allocated right before
the group's first write, every capture is written into its slice at its planned write
point, and every reader of the concat reads the buffer instead (an output group: the graph
returns the buffer's adjacent slices, in order, where it returned the captures). The buffer's values equal
the concat's bit for bit (writes are copies or correctly rounded recomputations).

New nodes carry fake values (``val`` or ``example_value``, whichever the graph uses), so
liveness estimates and later passes see the rewritten graph as they saw the original.
"""

from __future__ import annotations

from typing import AbstractSet, Any, Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx

import compile_pass.ops  # noqa: F401  (registers compile_pass::write_slice_)
from compile_pass.dataflow import NodeTable, nodes_calling, tensor_value
from compile_pass.find import classify_producer, exact_binary_op, exact_out_variant
from compile_pass.groups import Capture, CaptureGroup, GroupKind, Producer, Strategy

__all__ = ["RewriteError", "check_rewrite", "compute_writes_into_slices", "rewrite_group", "BUFFER_NAME"]

BUFFER_NAME = "aux_packed"
_WRITE = torch.ops.compile_pass.write_slice_.default
_BINARY_INTO = torch.ops.compile_pass.binary_into_slice_.default
_WRITES = (_WRITE, torch.ops.compile_pass.write_slice_)
_EMPTY = torch.ops.aten.empty.memory_format
_SLICE = torch.ops.aten.slice.Tensor
_SYM_SIZE = torch.ops.aten.sym_size.int


class RewriteError(RuntimeError):
    """The planned rewrite cannot be expressed on this graph (the graph is left to the caller)."""


class _Emitter:
    """Creates nodes with fake values in the graph's own metadata convention."""

    def __init__(self, graph: fx.Graph, like: fx.Node) -> None:
        self.graph = graph
        self.meta_key = "val" if "val" in like.meta else "example_value"
        value = tensor_value(like)
        self.fake_mode = torch._guards.detect_fake_mode([value]) if value is not None else None

    def node(self, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], value: Any,
             name: Optional[str] = None, like: Optional[fx.Node] = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        if name is not None:
            node._rename(name)
        node.meta[self.meta_key] = value
        if like is not None:
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        return node

    def fake(self, fn, *args: Any) -> Any:
        if self.fake_mode is None:
            return None
        with self.fake_mode:
            return fn(*args)


SizeSource = Union[int, fx.Node, Tuple[fx.Node, int]]


def _size_sources(group: CaptureGroup, order: List[fx.Node], stop: int, meta_key: str) -> List[SizeSource]:
    """Where each size of the packed shape comes from among the nodes before position
    ``stop``: an int, a SymInt node, or (tensor node, dim). Raises ``RewriteError`` if a
    symbolic size has no such source."""
    shape = group.packed_value.shape
    sizes: List[SizeSource] = []
    for d, size in enumerate(shape):
        if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
            sizes.append(int(size))
            continue
        expr = size.node.expr
        source: Optional[SizeSource] = None
        for node in order[:stop]:
            value = node.meta.get(meta_key)
            if isinstance(value, torch.SymInt) and value.node.expr == expr:
                source = node
                break
            if isinstance(value, torch.Tensor) and node.op != "output":
                dims = [i for i, s in enumerate(value.shape)
                        if isinstance(s, torch.SymInt) and s.node.expr == expr]
                if dims:
                    source = (node, dims[0])
                    break
        if source is None:
            raise RewriteError(f"no value for size {expr} of dim {d} exists before the first capture")
        sizes.append(source)
    return sizes


def _size_args(group: CaptureGroup, order: List[fx.Node], stop: int, emit: _Emitter) -> List[Any]:
    """The packed shape as graph values available before position ``stop``."""
    shape = group.packed_value.shape
    sizes: List[Any] = []
    for d, source in enumerate(_size_sources(group, order, stop, emit.meta_key)):
        if isinstance(source, tuple):
            node, dim = source
            source = emit.node(_SYM_SIZE, (node, dim), {}, shape[d])
        sizes.append(source)
    return sizes


def _placed(group: CaptureGroup, position: Dict[fx.Node, int]) -> List[Capture]:
    """The captures written at a point of the graph, in the order their writes go in."""
    return sorted((c for c in group.captures if c.write_after is not None),
                  key=lambda c: (position[_insertion(c)[0]], not _insertion(c)[1]))


def check_rewrite(graph: fx.Graph, group: CaptureGroup) -> None:
    """Raise ``RewriteError`` if ``rewrite_group`` could not express the planned ``group`` on
    ``graph``; change nothing. After it passes, ``rewrite_group`` raises no RewriteError
    (a plan that hoists producers is checked by a trial rewrite instead)."""
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    placed = _placed(group, position)
    if not placed:
        raise RewriteError("no capture is written at a point of the graph")
    anchor, before = _insertion(placed[0])
    meta_key = "val" if "val" in group.captures[0].node.meta else "example_value"
    _size_sources(group, order, position[anchor] + (0 if before else 1), meta_key)
    for capture in placed:
        if capture.strategy is Strategy.COMPUTE_INTO and exact_out_variant(capture.node) is None:
            raise RewriteError(f"{capture.node.name} has no out= variant")
        if capture.strategy is Strategy.COMPUTE_INTO_OP and exact_binary_op(capture.node) is None:
            raise RewriteError(f"{capture.node.name} is no add/sub/mul/div binary_into_slice_ computes")


def _insertion(capture: Capture) -> Tuple[fx.Node, bool]:
    """(anchor, before): the write goes right before ``anchor`` or right after it."""
    if capture.strategy in (Strategy.COMPUTE_INTO, Strategy.COMPUTE_INTO_OP, Strategy.ELIDE_CLONE):
        return capture.node, True
    assert capture.write_after is not None
    return capture.write_after, False


def _return_slices(graph: fx.Graph, group: CaptureGroup, buffer: fx.Node, buffer_value: Any,
                   emit: _Emitter) -> None:
    """The output node returns adjacent slices of ``buffer`` in place of the captures."""
    output = group.cat
    returned = output.args[0]
    values = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    dim = group.dim
    with graph.inserting_before(output):
        for capture, index in zip(group.captures, group.output_indices):
            end = capture.offset + capture.width
            value = emit.fake(lambda: buffer_value.narrow(dim, capture.offset, capture.width))
            values[index] = emit.node(_SLICE, (buffer, dim, capture.offset, end), {}, value,
                                      name=f"{BUFFER_NAME}_out", like=capture.node)
    if isinstance(returned, (list, tuple)):
        output.args = (type(returned)(values),) + tuple(output.args[1:])
    else:
        output.args = (values[0],) + tuple(output.args[1:])


def rewrite_group(graph: fx.Graph, group: CaptureGroup) -> fx.Node:
    """Apply a planned group to ``graph`` in place; return the packed buffer node."""
    for capture in group.captures:
        if capture.hoist_after is not None:
            capture.hoist_after.append(capture.node)
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    emit = _Emitter(graph, group.captures[0].node)
    cat_value = group.packed_value
    dim = group.dim

    placed = _placed(group, position)
    inputs = [c for c in group.captures if c.write_after is None]
    after_cursor: Dict[fx.Node, fx.Node] = {}  # anchor -> last node inserted after it
    buffer: Optional[fx.Node] = None
    buffer_value: Any = None
    elided: List[fx.Node] = []
    for capture in placed:
        anchor, before = _insertion(capture)
        point = anchor if before else after_cursor.get(anchor, anchor).next
        with graph.inserting_before(point):
            if buffer is None:
                stop = position[anchor] + (0 if before else 1)
                sizes = _size_args(group, order, stop, emit)
                buffer_value = emit.fake(lambda: torch.empty(
                    cat_value.shape, dtype=cat_value.dtype, device=cat_value.device))
                buffer = emit.node(_EMPTY, (sizes,), {"dtype": group.dtype, "device": group.device,
                                                      "pin_memory": False},
                                   buffer_value, name=BUFFER_NAME, like=group.cat)
                for graph_input in inputs:
                    emit.node(_WRITE, (buffer, graph_input.node, dim, graph_input.offset), {}, None,
                              like=group.cat)
            if capture.strategy is Strategy.COPY:
                last = emit.node(_WRITE, (buffer, capture.node, dim, capture.offset), {}, None,
                                 like=anchor)
            elif capture.strategy is Strategy.ELIDE_CLONE:
                source = capture.node.args[0]
                last = emit.node(_WRITE, (buffer, source, dim, capture.offset), {}, None, like=anchor)
                elided.append(capture.node)
            elif capture.strategy is Strategy.COMPUTE_INTO_OP:
                a, b = capture.node.args[:2]
                last = emit.node(_BINARY_INTO, (buffer, a, b, exact_binary_op(capture.node), dim,
                                                capture.offset), {}, None, like=anchor)
                elided.append(capture.node)
            else:
                out_op = exact_out_variant(capture.node)
                if out_op is None:
                    raise RewriteError(f"{capture.node.name} has no out= variant")
                end = capture.offset + capture.width
                view_value = emit.fake(lambda: buffer_value.narrow(dim, capture.offset, capture.width))
                view = emit.node(_SLICE, (buffer, dim, capture.offset, end), {}, view_value,
                                 name=f"{BUFFER_NAME}_slot", like=anchor)
                last = emit.node(out_op, tuple(capture.node.args),
                                 {**capture.node.kwargs, "out": view}, view_value, like=anchor)
                capture.node.replace_all_uses_with(last)
                elided.append(capture.node)
        if not before:
            after_cursor[anchor] = last

    if group.kind is GroupKind.OUTPUTS:
        _return_slices(graph, group, buffer, buffer_value, emit)
    else:
        group.cat.replace_all_uses_with(buffer)
        graph.erase_node(group.cat)
    for node in elided:
        if not node.users:
            graph.erase_node(node)
    return buffer


def _arithmetic_written(node: fx.Node) -> Optional[fx.Node]:
    """The source of ``node`` if it is a ``write_slice_`` of an add/sub/mul/div that
    ``binary_into_slice_`` can compute and that the write alone reads, else None."""
    if node.op != "call_function" or node.target not in _WRITES or len(node.args) < 2:
        return None
    src = node.args[1]
    if not isinstance(src, fx.Node) or src.op != "call_function" or len(src.users) != 1 \
            or exact_binary_op(src) is None:
        return None
    return src


def writes_of_arithmetic(graph: fx.Graph) -> bool:
    """Whether ``graph`` has a candidate of ``compute_writes_into_slices`` (a sweep without
    facts, to skip building them)."""
    return any(_arithmetic_written(node) is not None
               for node in nodes_calling(graph, "call_function", _WRITES))


def compute_writes_into_slices(graph: fx.Graph, table: NodeTable,
                               twinned: AbstractSet[fx.Node] = frozenset()) -> int:
    """Replace ``write_slice_(buf, src, dim, start)`` calls whose ``src`` is a capture-only
    add/sub/mul/div (read by that write alone, no twin in ``twinned``, neither operand
    written in between) by ``binary_into_slice_(buf, a, b, op, dim, start)``: a packer's
    ``aux.append(hidden + residual)`` then needs no temporary. Returns how many."""
    done = 0
    for write in list(table.nodes):
        src = _arithmetic_written(write)
        if src is None or src in twinned or classify_producer(src, table) is not Producer.EXACT_ARITHMETIC:
            continue
        buf, _, dim, start = (list(write.args) + [None] * 4)[:4]
        op = exact_binary_op(src)
        if not isinstance(dim, int) or not isinstance(start, int):
            continue
        first, last = table.position[src], table.position[write]
        if any(first < table.position[w] < last for a in src.all_input_nodes
               for alias in table.holders.get(table.key.get(a), [a]) for w in table.mutators.get(alias, ())):
            continue
        a, b = src.args[:2]
        with graph.inserting_before(write):
            into = graph.call_function(_BINARY_INTO, (buf, a, b, op, dim, start), {})
        into.meta.update({k: v for k, v in write.meta.items() if k != "example_value"})
        into.meta["example_value" if "example_value" in write.meta else "val"] = None
        graph.erase_node(write)
        graph.erase_node(src)
        done += 1
    return done
