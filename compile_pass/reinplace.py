"""Turn functionalized ``write_slice_`` calls back into in-place writes (graphs run as is).

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
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

import compile_pass.ops  # noqa: F401  (registers compile_pass::write_slice_)

__all__ = ["reinplace_slice_writes"]

log = logging.getLogger("compile_pass")

_WRITE = torch.ops.compile_pass.write_slice_.default
_COPY = torch.ops.aten.copy_.default
_SLICE = torch.ops.aten.slice.Tensor


def _functional_write_base(node: fx.Node) -> Optional[fx.Node]:
    """The buffer a functionalized ``write_slice_`` call consumes, if it is one we can undo."""
    if node.op != "call_function" or not node.args or node.args[0] is not _WRITE:
        return None
    hop = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    if hop is not None and node.target is hop:
        bases = node.kwargs.get("_all_bases")
        view_args = {"_buf_size", "_buf_stride", "_buf_storage_offset", "_buf_slice_dim"}
        if (not isinstance(bases, (list, tuple)) or len(bases) != 1
                or node.kwargs.get("_buf_base_index") != 0 or view_args & set(node.kwargs)):
            return None
        return bases[0]
    v1 = getattr(torch.ops.higher_order, "auto_functionalized", None)
    if v1 is not None and node.target is v1:
        return node.kwargs.get("buf")
    return None


def _emit_copy_into_slice(graph: fx.Graph, base: fx.Node, kwargs: dict, meta: dict) -> fx.Node:
    """``aten.copy_(aten.slice(base, dim, start, start + width), src)`` with fake values."""
    src, dim, start = kwargs["src"], kwargs["dim"], kwargs["start"]
    base_value, src_value = base.meta.get("val"), src.meta.get("val")
    width = src_value.shape[dim]
    view = graph.call_function(_SLICE, (base, dim, start, start + width))
    view.meta = dict(meta)
    view.meta["val"] = base_value.narrow(dim, start, width) if base_value is not None else None
    copy = graph.call_function(_COPY, (view, src))
    copy.meta = dict(meta)
    copy.meta["val"] = view.meta["val"]
    return copy


def reinplace_slice_writes(graph: fx.Graph, as_copy: bool = False) -> int:
    """Replace undoable functional ``write_slice_`` calls by in-place writes; return how many.

    ``as_copy=False``: the in-place ``write_slice_`` call (graphs run as is).
    ``as_copy=True``: ``aten.copy_`` into an ``aten.slice`` view of the buffer, which
    Inductor lowers as one kernel storing the producer's values straight into the slice
    (for Inductor's post-grad graph).
    """
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
        kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_") and k != "buf"}
        meta = {k: v for k, v in node.meta.items() if k != "val"}
        with graph.inserting_before(node):
            if as_copy:
                _emit_copy_into_slice(graph, base, kwargs, meta)
            else:
                write = graph.call_function(_WRITE, (base,), kwargs)
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
