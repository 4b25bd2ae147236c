"""An RMSNorm in an FX graph, recognized by what its nodes compute, in either IR.

The draft's combine may norm the captures before its ``fc`` (Eagle3's ``norm_before_fc``
over the whole concat, or one norm per capture). ``fuse_projection`` folds such a norm into
the per-capture projection, so it must know that a region of the graph is an RMSNorm, with
which weight and epsilon. ``match_rms_norm(x)`` reads it from ``x``'s readers:

- one call: ``F.rms_norm`` / ``torch.rms_norm`` / ``aten.rms_norm`` / ``aten._fused_rms_norm``
  over the last dim;
- the spelled-out form the engines' ``forward_native`` and HF models trace to (Dynamo's
  torch IR or aten IR alike)::

      u = cast(x)?;  s = mean(u*u | u**2 | square(u), -1, keepdim);  r = rsqrt(s + eps)
      y = cast(u * r)? * weight?

Ops are told apart by their canonical name (``dataflow.op_name``: an OpOverload's packet, a torch
function's or method's name, an ``operator`` function's aten name) and by the values in
the nodes' metadata (shapes, dims, which argument is which node), never by one spelling.

Invariant: a match's ``interior`` nodes compute ``output`` from ``input`` (and the weight)
and are read by nothing outside the match but through ``output``; anything else is not a
match, and the reason says which node broke it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

from compile_pass.dataflow import op_name, tensor_value
from compile_pass.split import split_op_name

__all__ = ["RMSNormMatch", "match_rms_norm", "chunk_readers", "opaque_reader"]

_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as", "_to_copy", "convert_element_type"}
_ONE_CALL = {"rms_norm", "_fused_rms_norm"}
_RESHAPES = {"view", "reshape", "unflatten", "_unsafe_view"}


@dataclass(frozen=True)
class RMSNormMatch:
    """``output = rms_norm(input, weight, eps)`` over the last dim; ``interior``: the nodes
    computing it (``output`` last), read by nothing else. ``eps``: a number, or the node
    computing it (a traced float input)."""

    input: fx.Node
    output: fx.Node
    weight: Optional[fx.Node]
    eps: Union[float, fx.Node]
    interior: Tuple[fx.Node, ...]


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _is_last_dim(dim[0], ndim)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _is_cast_of(node: fx.Node, source: fx.Node) -> bool:
    """``node`` converts ``source``'s element type (or is an identity ``.float()``): same shape,
    a floating dtype, nothing else read."""
    if op_name(node) not in _CASTS or not node.args or node.args[0] is not source:
        return False
    if any(isinstance(a, fx.Node) for a in [*node.args[1:], *node.kwargs.values()]):
        return False
    value, before = tensor_value(node), tensor_value(source)
    return (value is not None and before is not None and value.shape == before.shape
            and value.dtype.is_floating_point and value.device == before.device)


def _is_square_of(node: fx.Node, u: fx.Node) -> bool:
    name = op_name(node)
    if name == "pow":
        return node.args[:1] == (u,) and _arg(node, 1, "exponent") in (2, 2.0)
    if name == "square":
        return node.args[:1] == (u,)
    return name == "mul" and len(node.args) == 2 and node.args[0] is u and node.args[1] is u


def _other(node: fx.Node, one: fx.Node) -> Any:
    """The operand of binary ``node`` that is not ``one`` (None unless exactly one is)."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if a is one and b is not one:
        return b
    if b is one and a is not one:
        return a
    return None


def _single_call(x: fx.Node, node: fx.Node, width: int) -> Tuple[Optional[RMSNormMatch], str]:
    """``F.rms_norm(x, (width,), weight, eps)`` and its aten spellings."""
    if node.args[:1] != (x,):
        return None, f"{node.name} does not norm {x.name}"
    shape = _arg(node, 1, "normalized_shape")
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or shape[0] != width:
        return None, f"{node.name} norms over {shape}, not the last dim ({width})"
    weight, eps = _arg(node, 2, "weight"), _arg(node, 3, "eps")
    if weight is not None and not isinstance(weight, fx.Node):
        return None, f"{node.name}'s weight is not a tensor"
    value = tensor_value(x)
    eps = torch.finfo(value.dtype).eps if eps is None else eps
    output = node
    interior = [node]
    if op_name(node) == "_fused_rms_norm":  # (out, rstd): the out alone may be read
        getitems = list(node.users)
        if len(getitems) != 1 or op_name(getitems[0]) != "getitem" or getitems[0].args[1] != 0:
            return None, f"{node.name}'s rstd is read"
        output = getitems[0]
        interior.append(output)
    if not _is_scalar(eps):
        return None, f"{node.name}'s eps is not a number"
    return RMSNormMatch(x, output, weight, eps if isinstance(eps, fx.Node) else float(eps), tuple(interior)), ""


def match_rms_norm(x: fx.Node) -> Tuple[Optional[RMSNormMatch], str]:
    """The RMSNorm over the last dim that reads ``x`` (all of ``x``'s readers belong to it);
    or (None, why not)."""
    value = tensor_value(x)
    if value is None or value.dim() < 1:
        return None, f"{x.name} is not a tensor"
    width, ndim = value.shape[-1], value.dim()
    readers = list(x.users)
    if len(readers) == 1 and op_name(readers[0]) in _ONE_CALL:
        return _single_call(x, readers[0], width)
    interior = []
    us = [x]  # x as the norm computes in it: x, or its cast (one node, or one per use, as
    #          ``x.float() * rsqrt(x.float().pow(2).mean(...))`` traces)
    if readers and all(_is_cast_of(r, x) for r in readers) \
            and len({tensor_value(r).dtype for r in readers}) == 1:
        us = readers
        interior.extend(us)
        readers = [r for u in us for r in u.users]
    squares = [r for r in readers if any(_is_square_of(r, u) for u in us)]
    if len(readers) != 2 or len(squares) != 1:
        return None, (f"{x.name}'s readers ({', '.join(r.name for r in readers)}) are not an RMSNorm's "
                      f"square and scale")
    square = squares[0]
    scale = next(r for r in readers if r is not square)
    mean = _only_user(square)
    if mean is None or op_name(mean) != "mean" or mean.args[:1] != (square,) \
            or not _is_last_dim(_arg(mean, 1, "dim"), ndim) or not _arg(mean, 2, "keepdim", False):
        return None, f"{square.name} is not averaged over the last dim (keepdim) alone"
    add = _only_user(mean)  # add_ in place on the mean (aten's decomposition) is the same value
    eps = _other(add, mean) if add is not None and op_name(add) in ("add", "add_") else None
    if not _is_scalar(eps):
        return None, f"{mean.name} is not followed by + eps (a number)"
    rsqrt = _only_user(add)
    if rsqrt is None or op_name(rsqrt) != "rsqrt" or rsqrt.args[:1] != (add,):
        return None, f"{add.name} is not followed by rsqrt"
    if _only_user(rsqrt) is not scale or op_name(scale) != "mul" or _other(scale, rsqrt) not in us:
        return None, f"{scale.name} is not {us[0].name} * rsqrt(mean square + eps)"
    interior += [square, mean, add, rsqrt, scale]
    output = scale
    after = _only_user(output)
    if after is not None and _is_cast_of(after, output):
        interior.append(after)
        output, after = after, _only_user(after)
    weight = None
    if after is not None and op_name(after) == "mul":
        candidate = _other(after, output)
        w = tensor_value(candidate) if isinstance(candidate, fx.Node) else None
        if w is not None and w.dim() == 1 and w.shape[0] == width and not _reads(candidate, x):
            weight, output = candidate, after
            interior.append(after)
            last = _only_user(output)  # weighted in fp32, then cast (F.rms_norm's decomposition)
            if last is not None and _is_cast_of(last, output) and interior[-2] is scale:
                interior.append(last)
                output = last
    return RMSNormMatch(x, output, weight, eps if isinstance(eps, fx.Node) else float(eps), tuple(interior)), ""


def opaque_reader(x: fx.Node) -> str:
    """Why ``x`` cannot be matched if a reader of it is an opaque op (a custom op such as an
    engine's fused RMSNorm kernel, called directly or through ``auto_functionalized``): its
    arithmetic is not in the graph, so it is not looked into; ``""`` if none is."""
    for reader in x.users:
        target = reader.target
        if reader.op != "call_function":
            continue
        if isinstance(target, torch._ops.HigherOrderOperator):
            inner = reader.args[0] if reader.args else None
            name = inner._schema.name if isinstance(inner, torch._ops.OpOverload) else target.name()
        else:
            name = split_op_name(reader)
        if name is not None and name.split("::")[0] not in ("aten", "prims"):
            return (f"{reader.name} reads {x.name} through {name}, an opaque op (a fused norm kernel's "
                    f"arithmetic is not in the graph): not matched as a norm")
    return ""


def _is_scalar(eps: Any) -> bool:
    """A number, or a node whose value is one (Dynamo traces a float attribute as a graph
    input read by ``item()`` when floats are not specialized; AOT then adds a 0-dim tensor)."""
    if isinstance(eps, fx.Node):  # or a 0-dim tensor (AOT's functional form of that input)
        value = eps.meta.get("val", eps.meta.get("example_value"))
        if isinstance(value, torch.Tensor):
            return value.dim() == 0 and value.dtype.is_floating_point
        return isinstance(value, (float, torch.SymFloat)) and not isinstance(value, bool)
    return isinstance(eps, (int, float)) and not isinstance(eps, bool)


def _reads(node: fx.Node, x: fx.Node, limit: int = 64) -> bool:
    """Whether ``node`` is computed from ``x`` (a bounded walk up its inputs)."""
    seen, todo = set(), [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is x:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return bool(todo)  # too deep to tell: treat as reading it


def chunk_readers(x: fx.Node, widths: Sequence[int]) -> Tuple[Optional[Tuple[fx.Node, ...]], Tuple[fx.Node, ...], str]:
    """The nodes reading ``x`` in consecutive last-dim chunks of ``widths`` (one per width,
    in order) and the split nodes between (a ``split`` and its ``getitem``s, one slice
    each, or a ``[..., K, H]`` view cut by ``unbind`` / ``select``); or (None, (), why not).
    Every reader of ``x`` must be one of them."""
    value = tensor_value(x)
    ndim = value.dim() if value is not None else 0
    readers = list(x.users)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    if len(readers) == 1 and op_name(readers[0]) in ("split", "split_with_sizes", "chunk", "tensor_split"):
        split = readers[0]
        items = _items_in_order(split, len(widths))
        if items is None:
            return None, (), f"{split.name}'s pieces are not read one each"
        dim = _arg(split, 2, "dim", 0)
        if not _is_last_dim(dim, ndim):
            return None, (), f"{split.name} ({op_name(split)}) splits dim {dim}, not the last ({ndim - 1} or -1)"
        pieces = [tensor_value(n) for n in items]
        if any(p is None or p.shape[-1] != w for p, w in zip(pieces, widths)):
            return None, (), f"{split.name}'s pieces are not the captures' widths {list(widths)}"
        return tuple(items), (split,), ""
    if readers and all(op_name(r) in _RESHAPES for r in readers):
        return _unbound_rows(x, readers, widths)
    if len(readers) == len(widths):
        bounds, whole = {}, []
        for r in readers:
            r, passed = _past_whole_slices(r)
            whole += passed
            start, v = _last_dim_start(r, ndim, value.shape[-1] if value is not None else None), tensor_value(r)
            if start is None or v is None:
                return None, (), f"{r.name} ({op_name(r) or r.op}) is not a last-dim slice of {x.name}"
            bounds[start] = (r, v.shape[-1])
        if sorted(bounds) != starts or any(bounds[s][1] != w for s, w in zip(starts, widths)):
            return None, (), "the slices are not the captures' widths"
        return tuple(bounds[s][0] for s in starts), tuple(whole), ""
    names = ", ".join(f"{r.name} ({op_name(r) or r.op})" for r in readers)
    return None, (), f"{x.name} is read by {names}, not split into the captures' widths {list(widths)}"


def _unbound_rows(x: fx.Node, reshapes: Sequence[fx.Node], widths: Sequence[int]) -> Tuple[Optional[Tuple[fx.Node, ...]], Tuple[fx.Node, ...], str]:
    """``x`` viewed as ``[*lead, K, H]`` (by each of ``reshapes``: ``reshape`` / ``view`` /
    ``unflatten``) and cut along that ``K`` dim into its captures: one ``unbind`` read through
    ``getitem``s, or one ``select`` / integer index per capture; the chunk_readers answer."""
    k, value = len(widths), tensor_value(x)
    for reshape in reshapes:
        viewed = tensor_value(reshape)
        if value is None or viewed is None or len(set(widths)) != 1 or viewed.dim() != value.dim() + 1 \
                or tuple(viewed.shape[-2:]) != (k, widths[0]):
            return None, (), (f"{reshape.name} ({op_name(reshape)}) does not view {x.name} as [..., {k}, "
                              f"{widths[0] if len(set(widths)) == 1 else '?'}] (one row per capture)")
    ndim = value.dim() + 1
    readers = [r for reshape in reshapes for r in reshape.users]
    if len(reshapes) == 1 and len(readers) == 1 and op_name(readers[0]) == "unbind":
        unbind = readers[0]
        if _arg(unbind, 1, "dim", 0) not in (-2, ndim - 2):
            return None, (), f"{unbind.name} (unbind) cuts dim {_arg(unbind, 1, 'dim', 0)}, not the captures' ({ndim - 2} or -2)"
        items = _items_in_order(unbind, k)
        if items is None:
            return None, (), f"{unbind.name}'s rows are not read one each"
        return tuple(items), (*reshapes, unbind), ""
    rows, whole = {}, []
    for r in readers:
        r, passed = _past_whole_slices(r)
        whole += passed
        row = _row_index(r, ndim)
        if row is None:
            return None, (), f"{r.name} ({op_name(r) or r.op}) is not one capture's row of {r.args[0].name}"
        rows[row % k] = r
    if sorted(rows) != list(range(k)) or len(readers) != k:
        return None, (), f"the [..., {k}, {widths[0]}] view's {k} rows are not read one each"
    return tuple(rows[i] for i in range(k)), (*reshapes, *whole), ""


def _items_in_order(node: fx.Node, k: int) -> Optional[list]:
    """The ``getitem``s reading items ``0..k-1`` of ``node`` (a split's or unbind's tuple), in
    order, if those are all its readers; else None."""
    items = sorted(node.users, key=lambda n: n.args[1] if op_name(n) == "getitem" else -1)
    if any(op_name(n) != "getitem" for n in items) or [n.args[1] for n in items] != list(range(k)):
        return None
    return items


def _past_whole_slices(node: fx.Node) -> Tuple[fx.Node, list]:
    """``node``'s one reader, and on, while ``node`` is a slice taking all of a dim (``p[:, a:b]``
    in aten IR is ``slice(slice(p, 0, 0, max), -1, a, b)``): the first node that is not, and
    the whole slices passed."""
    passed = []
    while op_name(node) == "slice" and len(node.users) == 1 and _takes_all(node):
        passed.append(node)
        node = next(iter(node.users))
    return node, passed


def _takes_all(node: fx.Node) -> bool:
    """Whether slice ``node`` keeps every element of its dim."""
    start, end, step = _arg(node, 2, "start"), _arg(node, 3, "end"), _arg(node, 4, "step", 1)
    value, source = tensor_value(node), tensor_value(node.args[0])
    if step != 1 or start not in (None, 0) or value is None or source is None:
        return False
    dim = _arg(node, 1, "dim", 0)
    size = source.shape[dim] if isinstance(dim, int) and -source.dim() <= dim < source.dim() else None
    return end is None or (isinstance(end, int) and (end >= 2 ** 62 or (isinstance(size, int) and end >= size)))


def _row_index(node: fx.Node, ndim: int) -> Optional[int]:
    """``i`` if ``node`` takes row ``i`` of dim -2 of its ``ndim``-dim input (``select(-2, i)``
    or indexing ``[..., i, :]`` / ``[:, i]``), else None."""
    name = op_name(node)
    if name == "select":
        dim, index = _arg(node, 1, "dim"), _arg(node, 2, "index")
        return index if dim in (-2, ndim - 2) and isinstance(index, int) else None
    if name == "getitem" and isinstance(node.args[1], tuple):
        whole = slice(None, None, None)
        parts = list(node.args[1])
        if parts and parts[-1] == whole:
            parts = parts[:-1]
        if not parts or not isinstance(parts[-1], int) or isinstance(parts[-1], bool):
            return None
        lead = parts[:-1]
        return parts[-1] if lead == [whole] * (ndim - 2) or lead == [Ellipsis] else None
    return None


def _last_dim_start(node: fx.Node, ndim: int, width: Any = None) -> Optional[int]:
    """Where ``node``'s last-dim slice of its input starts, if ``node`` is one (``slice``,
    ``narrow``, or indexing by slices that are whole but for the last dim); a negative
    start counts from ``width``, the input's last-dim size, where that is a number."""
    name = op_name(node)
    if name == "slice":
        dim, start, step = _arg(node, 1, "dim", 0), _arg(node, 2, "start", 0), _arg(node, 4, "step", 1)
        ok = _is_last_dim(dim, ndim) and step == 1
    elif name == "narrow":
        dim, start = _arg(node, 1, "dim"), _arg(node, 2, "start")
        ok = _is_last_dim(dim, ndim)
    elif name == "getitem" and isinstance(node.args[1], tuple) and node.args[1]:
        *lead, last = node.args[1]
        whole = slice(None, None, None)
        ok = isinstance(last, slice) and last.step in (None, 1) and (
            lead == [whole] * (ndim - 1) or lead == [Ellipsis])
        start = last.start if ok else None
        start = 0 if ok and start is None else start
    else:
        return None
    if ok and isinstance(start, int) and start < 0 and isinstance(width, int):
        start += width
    return start if ok and isinstance(start, int) and start >= 0 else None
