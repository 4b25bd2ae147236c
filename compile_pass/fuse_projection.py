"""``fuse_projection``: a packed buffer read only by the draft's ``fc`` becomes one
``[*, H_draft]`` accumulator that each capture is projected into as it is written.

The draft reads the packed captures once, through ``fc`` (``docs/projection.md``). Where a
capture group's concat has exactly one reader and it is that linear (``linear(cat, W, b)``
in a Dynamo graph, ``aten.linear``, or ``mm`` / ``addmm`` of the concat and ``W``'s
transpose in an aten graph), the rewritten group's writes become projections:

- the packed buffer's allocation becomes the accumulator's, ``[*lead, H_draft]``;
- ``write_slice_(buf, x, dim, start)`` becomes ``project_into_(acc, x, W, start, first)``
  (``binary_into_slice_`` becomes ``project_binary_into_``): ``acc (+)= x @ W_k^T``, the
  first term in graph order written rather than added;
- the fc becomes the accumulator itself, with ``bias_into_(acc, b)`` before its first reader.

Opt-in (``options={"fuse_projection": True}``): K partial products are rounded and summed
where the draft computed one GEMM (the draft's input differs in the last bits; the
measured size is in docs/projection.md). A norm between the concat and ``fc`` (Eagle3's
``norm_before_fc`` or per-chunk norms) is not matched here: such a group is packed as
without the option (the eager ``ProjectingAccumulator`` handles those combines).

Invariant: the accumulator's value at the fc's place equals ``sum_k x_k @ W_k^T + b``
with each ``x_k`` the value its write read; nothing else the graph computes changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.fx as fx

import compile_pass.ops  # noqa: F401  (registers the projection ops)
from compile_pass.dataflow import tensor_value

__all__ = ["FcReader", "fc_reading", "fuse_into_accumulator", "ACCUMULATOR_NAME"]

ACCUMULATOR_NAME = "aux_projected"
_WRITE = torch.ops.compile_pass.write_slice_.default
_BINARY_INTO = torch.ops.compile_pass.binary_into_slice_.default
_PROJECT = torch.ops.compile_pass.project_into_.default
_PROJECT_BINARY = torch.ops.compile_pass.project_binary_into_.default
_BIAS = torch.ops.compile_pass.bias_into_.default
_EMPTY = torch.ops.aten.empty.memory_format

_aten = torch.ops.aten
_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear, _aten.linear.default)
_FLATTENS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_TRANSPOSES = (_aten.t.default, _aten.permute.default, _aten.transpose.int)


@dataclass(frozen=True)
class FcReader:
    """The draft's fc reading a concat: ``out`` is the node whose value is ``[*, H_draft]``
    (the linear, or the mm/addmm), ``flat`` the view flattening the concat to 2-D, if any."""

    out: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    flat: Optional[fx.Node]
    transpose: Optional[fx.Node]


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_transpose_of(node: object) -> Optional[fx.Node]:
    """``W`` if ``node`` is ``W``'s 2-D transpose, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _TRANSPOSES:
        return None
    if node.target is _aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if node.target is _aten.transpose.int and sorted(node.args[1:3]) not in ([0, 1], [-2, -1], [-1, 0]):
        return None
    source = node.args[0]
    value = tensor_value(source) if isinstance(source, fx.Node) else None
    return source if value is not None and value.dim() == 2 else None


def fc_reading(cat: fx.Node, width: int) -> Tuple[Optional[FcReader], str]:
    """The fc reading ``cat`` (its only reader), with ``W`` of shape ``[H_draft, width]``; or
    (None, why not)."""
    user = _only_user(cat)
    if user is None:
        return None, f"the concat has {len(cat.users)} readers, not one fc"
    flat = None
    if user.op == "call_function" and user.target in _FLATTENS:
        flat, user = user, _only_user(user)
        if user is None:
            return None, "the flattened concat has more than one reader"
    if user.op != "call_function":
        return None, (f"the concat's reader {user.name} is not the draft's fc (linear, mm, addmm); a norm "
                      f"between the concat and fc is not fused by the pass")
    weight = bias = transpose = None
    if user.target in _LINEARS and user.args and user.args[0] is (flat or cat):
        weight = user.args[1] if len(user.args) > 1 else user.kwargs.get("weight")
        bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    elif user.target is _aten.mm.default and user.args[0] is (flat or cat):
        transpose = user.args[1]
        weight = _is_transpose_of(transpose)
    elif user.target is _aten.addmm.default and user.args[1] is (flat or cat) \
            and user.kwargs.get("beta", 1) == 1 and user.kwargs.get("alpha", 1) == 1:
        bias, transpose = user.args[0], user.args[2]
        weight = _is_transpose_of(transpose)
    else:
        return None, (f"the concat's reader {user.name} is not the draft's fc (linear, mm, addmm); a norm "
                      f"between the concat and fc is not fused by the pass")
    value = tensor_value(weight) if isinstance(weight, fx.Node) else None
    if value is None or value.dim() != 2 or value.shape[1] != width:
        return None, f"the fc's weight is not [H_draft, {width}]"
    if bias is not None and (not isinstance(bias, fx.Node) or tensor_value(bias) is None
                             or tuple(tensor_value(bias).shape) != (value.shape[0],)):
        return None, "the fc's bias is not [H_draft]"
    if not value.dtype.is_floating_point:
        return None, f"the fc's weight is {value.dtype} (a quantized fc): packed as without the option"
    return FcReader(user, weight, bias, flat, transpose if isinstance(transpose, fx.Node) else None), ""


#: ops that make a weight out of a parameter without computing (a chain of them may sit
#: anywhere in a graph; the projection needs the weight at the first capture)
_WEIGHT_VIEWS = ("detach", "alias", "t", "permute", "transpose", "view", "reshape", "contiguous")


def _weight_chain(weight: fx.Node) -> Optional[list]:
    """The nodes computing ``weight`` from graph inputs or attributes through view-like ops
    only (in order; empty for an input itself), or None if it is computed otherwise."""
    chain = []
    node = weight
    while node.op == "call_function" or node.op == "call_method":
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        inputs = node.all_input_nodes
        if name not in _WEIGHT_VIEWS or len(inputs) != 1:
            return None
        chain.append(node)
        node = inputs[0]
    return list(reversed(chain)) if node.op in ("placeholder", "get_attr") else None


def _meta_key(node: fx.Node) -> str:
    return "val" if "val" in node.meta else "example_value"


def fuse_into_accumulator(graph: fx.Graph, buffer: fx.Node, fc: FcReader) -> fx.Node:
    """Turn ``buffer`` (a rewritten group's packed buffer, read by ``fc`` alone) into the
    projected accumulator in place; return the accumulator node. Raises ``ValueError``
    (graph unchanged) where a reader of the buffer is neither a write nor the fc."""
    writes = [u for u in buffer.users if u.op == "call_function" and u.target in (_WRITE, _BINARY_INTO)]
    readers = [u for u in buffer.users if u not in writes]
    if readers != [fc.flat or fc.out]:
        raise ValueError(f"the packed buffer is read by {', '.join(u.name for u in readers)}, not only the fc")
    for write in writes:
        dim = write.args[2] if write.target is _WRITE else write.args[4]
        if dim not in (-1, tensor_value(buffer).dim() - 1):
            raise ValueError("a capture is written along a dim other than the last")
    position = {n: i for i, n in enumerate(graph.nodes)}
    first_write = min(writes, key=position.__getitem__)
    if position[fc.weight] > position[first_write]:
        chain = _weight_chain(fc.weight)
        if chain is None:
            raise ValueError(f"the fc's weight {fc.weight.name} is computed after the first capture")
        for node in chain:  # view-like ops of a parameter: computed where the first write needs them
            first_write.prepend(node)
    key = _meta_key(buffer)
    value = buffer.meta.get(key)
    out_features = tensor_value(fc.weight).shape[0]
    with graph.inserting_after(buffer):
        sizes = list(buffer.args[0])[:-1] + [out_features]
        acc = graph.call_function(_EMPTY, (sizes,), dict(buffer.kwargs))
        acc._rename(ACCUMULATOR_NAME)
    mode = torch._guards.detect_fake_mode([value]) if value is not None else None
    if mode is not None:
        with mode:
            acc.meta[key] = torch.empty((*value.shape[:-1], out_features), dtype=value.dtype, device=value.device)
    for k in ("stack_trace", "nn_module_stack"):
        if k in buffer.meta:
            acc.meta[k] = buffer.meta[k]
    position = {n: i for i, n in enumerate(graph.nodes)}
    for i, write in enumerate(sorted(writes, key=position.__getitem__)):
        first = i == 0
        with graph.inserting_before(write):
            if write.target is _WRITE:
                _, src, _, start = write.args
                new = graph.call_function(_PROJECT, (acc, src, fc.weight, start, first), {})
            else:
                _, a, b, op, _, start = write.args
                new = graph.call_function(_PROJECT_BINARY, (acc, a, b, op, fc.weight, start, first), {})
        new.meta.update({k: v for k, v in write.meta.items() if k not in ("val", "example_value")})
        new.meta[key] = None
        graph.erase_node(write)
    first_reader = fc.out
    if fc.bias is not None:
        with graph.inserting_before(first_reader):
            bias = graph.call_function(_BIAS, (acc, fc.bias), {})
            bias.meta[key] = None
    flat_value = tensor_value(fc.out)
    if fc.flat is not None and flat_value is not None and flat_value.dim() != tensor_value(acc).dim():
        with graph.inserting_before(first_reader):
            result = graph.call_function(_aten.view.default, (acc, [-1, out_features]), {})
            result.meta[key] = flat_value
    else:
        result = acc
    fc.out.replace_all_uses_with(result)
    graph.erase_node(fc.out)
    for node in (fc.flat, fc.transpose):
        if node is not None and not node.users:
            graph.erase_node(node)
    if not buffer.users:
        graph.erase_node(buffer)
    return acc


def is_accumulator(node: fx.Node) -> bool:
    """Whether ``node`` is an accumulator ``fuse_into_accumulator`` made."""
    return node.op == "call_function" and node.target is _EMPTY and any(
        u.op == "call_function" and u.target in (_PROJECT, _PROJECT_BINARY) for u in node.users)

