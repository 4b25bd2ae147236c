"""Keep a compiled graph's outputs distinct from the inputs that a mutating op writes.

Stock Inductor (seen on torch 2.11.0, 2.13.0, 2.14.0 and 2.14.1) can hand back a graph *input* where the
program returned a copy of it. For::

    torch.ops.ns.fused_add_norm_(h, residual, w)   # a custom op mutating residual
    capture = residual.clone()
    return capture

AOTAutograd's graph is ``af = auto_functionalized(op, ..., residual=arg1)``,
``clone(af[2])``, ``copy_(arg1, af[2])``. ``remove_noop_ops`` (joint-graph and post-grad
passes) drops the clone: its guard against new input/output aliasing looks at storages,
and ``af[2]`` is a fresh value, not yet the input. Reinplacing then makes ``af[2]`` the
input itself, so the graph returns ``arg1``. A later in-place write to the residual (the
next piece of a piecewise build, the next layer's fused norm) changes the "copy".

The invariant this module keeps: **a value the program returned as a copy is not handed
back as (a view of) a graph input that a mutating op's functionalized form writes**. Two
passes, both pure over the graph, keep it:

- ``mark_returned_copies(graph)``, a joint-graph pre pass (Inductor's
  ``joint_custom_pre_pass``, before the first ``remove_noop_ops``): each returned
  ``clone(x)`` whose ``x`` is such a written-back value (or a view of one) tags ``x``;
- ``keep_outputs_distinct(graph)``, the last post-grad pass (after every
  ``remove_noop_ops``, before reinplacing): each output that is a tagged value gets its
  clone back, the copy the program asked for, no more.

Only clones the program made are restored: an output that is meant to alias a mutated input
(the packed buffer's slices that ``pack_outputs`` returns from a buffer the caller passes
in) was never a clone and stays a view; an aten op's result copied into an input
(``r.add_(h); return r.clone()``) is lowered by Inductor into a buffer of its own, so its
clone is not at risk and is not tagged. Written-back values are the outputs of
``auto_functionalized``, ``auto_functionalized_v2`` and ``triton_kernel_wrapper_functional``
copied into a placeholder. Each pass returns the nodes it tagged or replaced.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from compile_pass.dataflow import storage_key

__all__ = ["RETURNED_COPY", "keep_outputs_distinct", "mark_returned_copies", "written_back_storages"]

log = logging.getLogger("compile_pass")

_aten = torch.ops.aten

#: ``node.meta`` key: the program returned a clone of this value (``mark_returned_copies``)
RETURNED_COPY = "compile_pass_returned_copy"


def _functionalized_hops() -> tuple:
    hops = []
    higher_order = torch.ops.higher_order
    for name in ("auto_functionalized", "auto_functionalized_v2", "triton_kernel_wrapper_functional"):
        hop = getattr(higher_order, name, None)
        if hop is not None:
            hops.append(hop)
    return tuple(hops)


def _storage(node: Any) -> Optional[int]:
    """The storage key of the node's (fake) value (``dataflow.storage_key``), if a tensor."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return storage_key(value) if isinstance(value, torch.Tensor) else None


def _is_functionalized_output(node: fx.Node, hops: tuple) -> bool:
    """``getitem(hop(...), i)``: a mutated argument's new value out of a functionalized op."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source = node.args[0]
    return isinstance(source, fx.Node) and source.op == "call_function" and source.target in hops


def written_back_storages(graph: fx.Graph) -> Dict[int, fx.Node]:
    """Storage of each functionalized op's output that ``copy_`` writes back into a graph
    input (it becomes that input once Inductor reinplaces) -> the input it becomes."""
    hops = _functionalized_hops()
    found: Dict[int, fx.Node] = {}
    for copy in graph.find_nodes(op="call_function", target=_aten.copy_.default):
        dst, src = copy.args[0], copy.args[1]
        if not (isinstance(dst, fx.Node) and dst.op == "placeholder" and isinstance(src, fx.Node)):
            continue
        if not _is_functionalized_output(src, hops):
            continue
        storage = _storage(src)
        if storage is not None:
            found[storage] = dst
    return found


def _output_node(graph: fx.Graph) -> Optional[fx.Node]:
    output = next(iter(reversed(graph.nodes)), None)
    return output if output is not None and output.op == "output" else None


def mark_returned_copies(graph: fx.Graph) -> List[fx.Node]:
    """Tag (``RETURNED_COPY``) the source of every returned ``clone`` of a value that is
    written back into a graph input; return the tagged nodes. Changes no node but meta."""
    output = _output_node(graph)
    written_back = written_back_storages(graph) if output is not None else {}
    if not written_back:
        return []
    marked: List[fx.Node] = []
    for arg in _flat_nodes(output.args):
        if arg.op != "call_function" or arg.target is not _aten.clone.default:
            continue
        source = arg.args[0]
        if isinstance(source, fx.Node) and _storage(source) in written_back \
                and not source.meta.get(RETURNED_COPY):
            source.meta[RETURNED_COPY] = True
            marked.append(source)
    return marked


def _flat_nodes(args: Any) -> List[fx.Node]:
    nodes: List[fx.Node] = []
    fx.node.map_arg(args, nodes.append)
    return nodes


def keep_outputs_distinct(graph: fx.Graph) -> List[fx.Node]:
    """Clone every output that ``mark_returned_copies`` tagged and that would become (a view
    of) a mutated graph input; return the outputs replaced, in output order. A graph with
    none is left unchanged."""
    output = _output_node(graph)
    written_back = written_back_storages(graph) if output is not None else {}
    if not written_back:
        return []
    replaced: List[fx.Node] = []
    clones: Dict[fx.Node, fx.Node] = {}

    def distinct(arg: Any) -> Any:
        if not isinstance(arg, fx.Node) or not arg.meta.get(RETURNED_COPY) \
                or _storage(arg) not in written_back:
            return arg
        if arg not in clones:
            with graph.inserting_before(output):
                clone = graph.call_function(_aten.clone.default, (arg,))
            clone.meta.update({k: v for k, v in arg.meta.items() if k not in ("val", RETURNED_COPY)})
            value = arg.meta["val"]
            with _fake_mode_of(value):
                clone.meta["val"] = value.clone()
            clones[arg] = clone
            replaced.append(arg)
            log.info("aux_capture: output %s would be graph input %s after reinplacing "
                     "(Inductor dropped its clone); returning a copy", arg.name,
                     written_back[_storage(arg)].name)
        return clones[arg]

    output.args = tuple(fx.node.map_arg(a, distinct) for a in output.args)
    return replaced


def _fake_mode_of(value: torch.Tensor) -> Any:
    mode = getattr(value, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()
