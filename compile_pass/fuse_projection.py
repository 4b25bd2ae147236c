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

A norm between the concat and ``fc``, recognized by ``norm_match.py``, is folded in:

- one RMSNorm over the whole concat (Eagle3's ``norm_before_fc``): each write also adds
  its capture's sum of squares into an fp32 ``[*lead, 1]`` buffer
  (``sum_squares_into_``) and projects ``x_k * g_k`` (``project_scaled_into_``);
  ``rms_scale_`` scales the accumulator once, per token, before the bias;
- one RMSNorm per capture (``split`` or slices of the concat, each normed, concatenated
  again; vLLM's ``fc_norm``): each write projects its capture's norm
  (``project_normed_into_``).

Opt-in (``options={"fuse_projection": True}``): K partial products are rounded and summed
where the draft computed one GEMM (the draft's input differs in the last bits; the
measured size is in docs/projection.md). The norms are computed as
``ProjectingAccumulator`` computes them (``ops.rms_norm``), so the compiled and the eager
projection agree.

Invariant: the accumulator's value at the fc's place equals the combine of the captures
(``sum_k n_k(x_k) @ W_k^T``, scaled per token for a norm over the concat, ``+ b``) with each
``x_k`` the value its write read; nothing else the graph computes changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.fx as fx

import compile_pass.ops  # noqa: F401  (registers the projection ops)
from compile_pass.dataflow import is_cat, op_name, tensor_value
from compile_pass.draft_registry import DraftSignature, finish_registered_, project_registered_
from compile_pass.norm_match import RMSNormMatch, chunk_readers, match_rms_norm, opaque_reader

__all__ = ["FcReader", "fc_reading", "fuse_into_accumulator", "project_into_registered", "ACCUMULATOR_NAME"]

ACCUMULATOR_NAME = "aux_projected"
_WRITE = torch.ops.compile_pass.write_slice_.default
_BINARY_INTO = torch.ops.compile_pass.binary_into_slice_.default
_PROJECT = torch.ops.compile_pass.project_into_.default
_PROJECT_BINARY = torch.ops.compile_pass.project_binary_into_.default
_BIAS = torch.ops.compile_pass.bias_into_.default
_PROJECT_NORMED = torch.ops.compile_pass.project_normed_into_.default
_PROJECT_SCALED = torch.ops.compile_pass.project_scaled_into_.default
_SUM_SQUARES = torch.ops.compile_pass.sum_squares_into_.default
_RMS_SCALE = torch.ops.compile_pass.rms_scale_.default
_PROJECT_REGISTERED = project_registered_._opoverload
_FINISH_REGISTERED = finish_registered_._opoverload
_PROJECTIONS = (_PROJECT, _PROJECT_BINARY, _PROJECT_NORMED, _PROJECT_SCALED, _PROJECT_REGISTERED)
_EMPTY = torch.ops.aten.empty.memory_format

_aten = torch.ops.aten
_FLATTENS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)


@dataclass(frozen=True)
class FcReader:
    """The draft's combine reading a concat: ``out`` is the node whose value is
    ``[*, H_draft]`` (the linear, or the mm/addmm), ``flat`` the view flattening its input to
    2-D, if any; ``product``: the ``x @ W.T`` an ``out`` that adds the bias reads, if the
    bias is a separate add; ``norm``: an RMSNorm over the whole concat before ``fc``; ``chunk_norms``:
    one RMSNorm per capture instead; ``between``: the nodes from the concat to ``fc``'s
    input (the norms, the split, the second concat), read by nothing else."""

    out: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    flat: Optional[fx.Node]
    transpose: Optional[fx.Node]
    product: Optional[fx.Node] = None
    norm: Optional[RMSNormMatch] = None
    chunk_norms: Tuple[RMSNormMatch, ...] = ()
    between: Tuple[fx.Node, ...] = ()

    def describe(self) -> str:
        """What the combine is, in the diff tool's words."""
        if self.norm is not None:
            return "an RMSNorm over the concat, then fc"
        if self.chunk_norms:
            return "an RMSNorm per capture, then fc"
        return "fc"


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_transpose_of(node: object) -> Optional[fx.Node]:
    """``W`` if ``node`` is ``W``'s 2-D transpose, in any spelling (``t``, ``W.T``, ``W.mT``,
    ``permute(1, 0)``, ``transpose(0, 1)`` / ``(-1, -2)``; torch or aten IR), else None."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    name = op_name(node)
    source = node.args[0]
    if name in ("t", "numpy_T"):
        pass
    elif name == "getattr":
        if node.args[1:] not in (("T",), ("mT",)):
            return None
    elif name == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if [d % 2 if isinstance(d, int) else d for d in dims] != [1, 0]:
            return None
    elif name == "transpose":
        dims = node.args[1:3]
        if len(dims) != 2 or not all(isinstance(d, int) for d in dims) or sorted(d % 2 for d in dims) != [0, 1]:
            return None
    else:
        return None
    value = tensor_value(source) if isinstance(source, fx.Node) else None
    return source if value is not None and value.dim() == 2 else None


_FC_NAMES = ("linear", "mm", "matmul", "addmm")


def _is_flatten(node: fx.Node) -> bool:
    """Whether ``node`` views its input with the leading dims merged, the last one kept."""
    if node.op != "call_function" or node.target not in _FLATTENS:
        return False
    value, source = tensor_value(node), tensor_value(node.args[0])
    return value is not None and source is not None and value.shape[-1:] == source.shape[-1:]


def _is_fc_input(node: fx.Node) -> bool:
    """Whether ``node`` is a flattening view or a linear / mm / matmul / addmm (what reads
    the combine's input)."""
    return _is_flatten(node) or (node.op == "call_function" and op_name(node) in _FC_NAMES)


def _bias_add(product: fx.Node, out_features: int) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(add, bias)`` if ``product``'s one reader adds a ``[out_features]`` tensor to it
    (``x @ W.T + b``), else None."""
    add = _only_user(product)
    if add is None or op_name(add) != "add" or len(add.args) != 2 or add.kwargs:
        return None
    bias = add.args[1] if add.args[0] is product else add.args[0] if add.args[1] is product else None
    value = tensor_value(bias) if isinstance(bias, fx.Node) else None
    if value is None or tuple(value.shape) != (out_features,):
        return None
    return add, bias


def _norms_before_fc(cat: fx.Node, widths: Sequence[int]) -> Tuple[Optional[fx.Node], dict, str]:
    """The node ``fc`` reads when a norm sits between it and ``cat`` (the norm's output, or
    the concat of the per-capture norms) and the FcReader fields saying which; or
    (None, {}, why not)."""
    opaque = opaque_reader(cat)
    if opaque:
        return None, {}, opaque
    norm, why_whole = match_rms_norm(cat)
    if norm is not None:
        weight = tensor_value(norm.weight) if norm.weight is not None else None
        if weight is not None and weight.shape[0] != sum(widths):
            return None, {}, f"the norm's weight {norm.weight.name} is not [{sum(widths)}]"
        return norm.output, {"norm": norm, "between": norm.interior}, ""
    chunks, splits, why_chunks = chunk_readers(cat, widths)
    if chunks is None:
        return None, {}, (f"the concat's reader is neither the draft's fc nor a norm before it "
                          f"(a norm over it: {why_whole}; one per capture: {why_chunks})")
    matches = []
    for chunk in chunks:
        opaque = opaque_reader(chunk)
        if opaque:
            return None, {}, f"the chunk {chunk.name} is not normed: {opaque}"
        match, why = match_rms_norm(chunk)
        if match is None:
            return None, {}, f"the chunk {chunk.name} is not normed: {why}"
        matches.append(match)
    outputs = [m.output for m in matches]
    again = _only_user(outputs[0])
    value = tensor_value(again) if again is not None else None
    if again is None or not is_cat(again) or list(again.args[0]) != outputs or value is None \
            or (again.args[1] if len(again.args) > 1 else again.kwargs.get("dim", 0)) not in (-1, value.dim() - 1) \
            or any(len(o.users) != 1 for o in outputs):
        return None, {}, "the normed chunks are not concatenated again, in order, along the last dim"
    between = (*splits, *chunks, *(n for m in matches for n in m.interior), again)
    return again, {"chunk_norms": tuple(matches), "between": between}, ""


def fc_reading(cat: fx.Node, widths: Sequence[int]) -> Tuple[Optional[FcReader], str]:
    """The draft's combine reading ``cat`` (all its readers): optionally an RMSNorm over it
    or one per capture (of ``widths``), then an fc with ``W`` of shape ``[H_draft,
    sum(widths)]``; or (None, why not)."""
    width = sum(widths)
    head, found = cat, {}
    if len(cat.users) > 1 and any(_is_fc_input(u) for u in cat.users):
        return None, f"the concat has {len(cat.users)} readers, not one fc"
    if cat.users and not _is_fc_input(next(iter(cat.users))):
        head, found, why = _norms_before_fc(cat, widths)
        if head is None:
            return None, why
    user = _only_user(head)
    if user is None:
        return None, f"the concat has {len(cat.users)} readers, not one fc"
    flat = None
    if _is_flatten(user):
        flat, user = user, _only_user(user)
        if user is None:
            return None, "the flattened concat has more than one reader"
    not_fc = (f"the reader {user.name} ({op_name(user) or user.op}) of the draft's input is not its fc "
              f"(linear, mm, matmul or addmm of the input and W's transpose)")
    if user.op != "call_function":
        return None, not_fc
    name, reads = op_name(user), flat or head
    weight = bias = transpose = product = None
    if name == "linear" and user.args and user.args[0] is reads:
        weight = user.args[1] if len(user.args) > 1 else user.kwargs.get("weight")
        bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    elif name in ("mm", "matmul") and user.args[:1] == (reads,) and len(user.args) == 2 and not user.kwargs:
        transpose = user.args[1]
        weight = _is_transpose_of(transpose)
        if weight is None:
            return None, f"{user.name} multiplies the draft's input by {getattr(transpose, 'name', transpose)}, " \
                         f"not by a 2-D weight's transpose"
        added = _bias_add(user, tensor_value(weight).shape[0])
        if added is not None:  # x @ W.T + b: the add is the fc's output
            product, (user, bias) = user, added
    elif name == "addmm" and len(user.args) == 3 and user.args[1] is reads \
            and user.kwargs.get("beta", 1) == 1 and user.kwargs.get("alpha", 1) == 1:
        bias, transpose = user.args[0], user.args[2]
        weight = _is_transpose_of(transpose)
    else:
        return None, not_fc
    value = tensor_value(weight) if isinstance(weight, fx.Node) else None
    if value is None or value.dim() != 2 or value.shape[1] != width:
        return None, f"the fc's weight is not [H_draft, {width}]"
    if bias is not None and (not isinstance(bias, fx.Node) or tensor_value(bias) is None
                             or tuple(tensor_value(bias).shape) != (value.shape[0],)):
        return None, "the fc's bias is not [H_draft]"
    if not value.dtype.is_floating_point:
        return None, f"the fc's weight is {value.dtype} (a quantized fc): packed as without the option"
    if value.shape[0] >= width:
        return None, (f"the draft's fc is no narrower than the concat ({width} -> {value.shape[0]}): its "
                      f"accumulator would be as large as the packed buffer, projecting saves nothing")
    return FcReader(user, weight, bias, flat, transpose if isinstance(transpose, fx.Node) else None,
                    product=product, **found), ""


#: ops that make a weight out of a parameter without computing, or read (and convert) a
#: traced scalar input (a norm's eps); a chain of them may sit anywhere in a graph: the
#: projection needs its weights and eps at the first capture
_WEIGHT_VIEWS = ("detach", "alias", "t", "permute", "transpose", "view", "reshape", "contiguous", "item",
                 "_local_scalar_dense", "convert_element_type", "_to_copy", "to")


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


def _empty_like_buffer(graph: fx.Graph, buffer: fx.Node, last: int, dtype: Optional[torch.dtype],
                       name: str) -> fx.Node:
    """A new uninitialized ``[*lead, last]`` tensor allocated where ``buffer`` is (``dtype``:
    the buffer's if None), with its metadata value."""
    key = _meta_key(buffer)
    value = buffer.meta.get(key)
    kwargs = dict(buffer.kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    with graph.inserting_after(buffer):
        node = graph.call_function(_EMPTY, (list(buffer.args[0])[:-1] + [last],), kwargs)
        node._rename(name)
    mode = torch._guards.detect_fake_mode([value]) if value is not None else None
    if mode is not None:
        with mode:
            node.meta[key] = torch.empty((*value.shape[:-1], last), dtype=dtype or value.dtype, device=value.device)
    for k in ("stack_trace", "nn_module_stack"):
        if k in buffer.meta:
            node.meta[k] = buffer.meta[k]
    return node


def _available_before(graph: fx.Graph, weight: fx.Node, first_write: fx.Node) -> None:
    """Make ``weight`` (the fc's or a norm's) computed before ``first_write``: the view-like
    ops making it from a parameter move there; raises ``ValueError`` if it is computed
    otherwise after the first capture."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    if position[weight] < position[first_write]:
        return
    chain = _weight_chain(weight)
    if chain is None:
        raise ValueError(f"the weight {weight.name} is computed after the first capture")
    for node in chain:  # view-like ops of a parameter: computed where the first write needs them
        if position[node] > position[first_write]:  # (a chain shared with an earlier weight stays)
            first_write.prepend(node)


def _eps_args(norm: RMSNormMatch) -> tuple:
    """The ops' ``(eps, eps_tensor)`` for ``norm``'s eps: a number (or a traced scalar's
    node) as ``eps``, a 0-dim tensor's node as ``eps_tensor``."""
    value = tensor_value(norm.eps) if isinstance(norm.eps, fx.Node) else None
    return (0.0, norm.eps) if value is not None else (norm.eps, None)


def _writes_of(graph: fx.Graph, buffer: fx.Node) -> list:
    """The capture writes into ``buffer`` (``write_slice_`` / ``binary_into_slice_``) in graph
    order; raises ``ValueError`` if one writes along a dim other than the last."""
    writes = [u for u in buffer.users if u.op == "call_function" and u.target in (_WRITE, _BINARY_INTO)]
    for write in writes:
        dim = write.args[2] if write.target is _WRITE else write.args[4]
        if dim not in (-1, tensor_value(buffer).dim() - 1):
            raise ValueError("a capture is written along a dim other than the last")
    position = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(writes, key=position.__getitem__)


def _write_parts(write: fx.Node) -> tuple:
    """``(a, b, op, start)`` of a capture write: its value is ``a`` or ``op(a, b)``."""
    if write.target is _WRITE:
        _, a, _, start = write.args
        return a, None, "", start
    _, a, b, op, _, start = write.args
    return a, b, op, start


def fuse_into_accumulator(graph: fx.Graph, buffer: fx.Node, fc: FcReader) -> fx.Node:
    """Turn ``buffer`` (a rewritten group's packed buffer, read by ``fc``'s combine alone)
    into the projected accumulator in place; return the accumulator node. Raises
    ``ValueError`` (graph unchanged) where a reader of the buffer is neither a write nor the
    combine."""
    writes = _writes_of(graph, buffer)
    readers = [u for u in buffer.users if u not in writes]
    combine = set(fc.between) | {fc.flat or fc.product or fc.out}
    if not readers or any(r not in combine for r in readers):
        raise ValueError(f"the packed buffer is read by {', '.join(u.name for u in readers)}, not only the "
                         f"draft's combine")
    norms = [m for m in (fc.norm, *fc.chunk_norms) if m is not None]
    inputs = [n for m in norms for n in (m.weight, m.eps) if isinstance(n, fx.Node)]
    for weight in (fc.weight, *inputs):
        _available_before(graph, weight, writes[0])
    key = _meta_key(buffer)
    width = tensor_value(buffer).shape[-1]
    out_features = tensor_value(fc.weight).shape[0]
    acc = _empty_like_buffer(graph, buffer, out_features, None, ACCUMULATOR_NAME)
    sumsq = _empty_like_buffer(graph, buffer, 1, torch.float32, "aux_sum_squares") if fc.norm else None
    starts = {}
    if fc.chunk_norms:
        offset = 0
        for match in fc.chunk_norms:
            starts[offset] = match
            offset += tensor_value(match.input).shape[-1]
    for i, write in enumerate(writes):
        first = i == 0
        a, b, op, start = _write_parts(write)
        with graph.inserting_before(write):
            if fc.norm is not None:
                terms = [graph.call_function(_SUM_SQUARES, (sumsq, a, b, op, first), {}),
                         graph.call_function(_PROJECT_SCALED, (acc, a, b, op, fc.norm.weight, fc.weight, start,
                                                               first), {})]
            elif fc.chunk_norms:
                if start not in starts:
                    raise ValueError(f"the capture written at {start} is not one chunk of the per-capture norms")
                match = starts[start]
                terms = [graph.call_function(_PROJECT_NORMED, (acc, a, b, op, match.weight, *_eps_args(match),
                                                               fc.weight, start, first), {})]
            elif b is None:
                terms = [graph.call_function(_PROJECT, (acc, a, fc.weight, start, first), {})]
            else:
                terms = [graph.call_function(_PROJECT_BINARY, (acc, a, b, op, fc.weight, start, first), {})]
        for term in terms:
            term.meta.update({k: v for k, v in write.meta.items() if k not in ("val", "example_value")})
            term.meta[key] = None
        graph.erase_node(write)
    first_reader = fc.out
    out_value, acc_value = tensor_value(fc.out), tensor_value(acc)
    # ``x @ W.T + b`` with a bias of another dtype is computed in the promoted dtype (the
    # product rounded to the input's dtype first): the bias is then added out of place, in
    # that dtype, not into the accumulator
    promoted = fc.bias is not None and out_value is not None and acc_value is not None \
        and out_value.dtype != acc_value.dtype
    with graph.inserting_before(first_reader):
        if fc.norm is not None:
            graph.call_function(_RMS_SCALE, (acc, sumsq, width, *_eps_args(fc.norm)), {}).meta[key] = None
        if fc.bias is not None and not promoted:
            graph.call_function(_BIAS, (acc, fc.bias), {}).meta[key] = None
    if fc.flat is not None and out_value is not None and out_value.dim() != acc_value.dim():
        with graph.inserting_before(first_reader):
            result = graph.call_function(_aten.view.default, (acc, [-1, out_features]), {})
            result.meta[key] = acc_value.view(-1, out_features) if promoted else out_value
    else:
        result = acc
    if promoted:
        with graph.inserting_before(first_reader):
            result = graph.call_function(_aten.add.Tensor, (result, fc.bias), {})
            result.meta[key] = out_value
    fc.out.replace_all_uses_with(result)
    graph.erase_node(fc.out)
    for node in (fc.product, fc.flat, fc.transpose, *reversed(fc.between)):
        if node is not None and not node.users:
            graph.erase_node(node)
    if not buffer.users:
        graph.erase_node(buffer)
    return acc


def project_into_registered(graph: fx.Graph, buffer: fx.Node, output: fx.Node, indices: Sequence[int],
                            draft: str, signature: DraftSignature) -> fx.Node:
    """Turn ``buffer`` (a rewritten group of *returned* captures: its writes, and the slices
    ``output`` returns at ``indices``) into the registered ``draft``'s projected input, in
    place: each write becomes ``project_registered_`` (and ``sum_squares_into_`` for a norm
    over the concat), ``finish_registered_`` runs before ``output``, which returns the
    accumulator at ``indices[0]`` and an empty ``[*lead, 0]`` at the others. Raises
    ``ValueError`` (graph unchanged) where a reader of the buffer is neither a write nor a
    returned slice."""
    writes = _writes_of(graph, buffer)
    returned = output.args[0]
    values = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    slices = [values[i] for i in indices]
    if any(u not in writes and u not in slices for u in buffer.users) or len(writes) != signature.num_captures:
        raise ValueError(f"the packed buffer is read by more than its {signature.num_captures} writes and "
                         f"returned slices")
    starts = [_write_parts(w)[3] for w in writes]
    if sorted(starts) != [k * signature.hidden for k in range(signature.num_captures)]:
        raise ValueError(f"the captures are not written at the starts of {signature.num_captures} "
                         f"{signature.hidden}-wide slices")
    key = _meta_key(buffer)
    spec = signature.describe()
    acc = _empty_like_buffer(graph, buffer, signature.out_features, None, ACCUMULATOR_NAME)
    sumsq = (_empty_like_buffer(graph, buffer, 1, torch.float32, "aux_sum_squares")
             if signature.combine == "norm_before_fc" else None)
    for i, write in enumerate(writes):
        a, b, op, start = _write_parts(write)
        index = start // signature.hidden
        with graph.inserting_before(write):
            terms = [graph.call_function(_SUM_SQUARES, (sumsq, a, b, op, i == 0), {})] if sumsq is not None else []
            terms.append(graph.call_function(_PROJECT_REGISTERED, (acc, a, b, op, draft, spec, index,
                                                                   signature.num_captures, i == 0), {}))
        for term in terms:
            term.meta.update({k: v for k, v in write.meta.items() if k not in ("val", "example_value")})
            term.meta[key] = None
        graph.erase_node(write)
    with graph.inserting_before(output):
        graph.call_function(_FINISH_REGISTERED, (acc, sumsq, draft, spec, signature.num_captures),
                            {}).meta[key] = None
        values[indices[0]] = acc
        for i in indices[1:]:
            values[i] = _empty_like_buffer(graph, buffer, 0, None, "aux_projected_stand_in")
            output.prepend(values[i])  # allocated right before the output, not with the buffer
    output.args = ((type(returned)(values) if isinstance(returned, (list, tuple)) else values[0]),
                   *output.args[1:])
    for node in slices:
        if not node.users:
            graph.erase_node(node)
    if not buffer.users:
        graph.erase_node(buffer)
    return acc


def is_accumulator(node: fx.Node) -> bool:
    """Whether ``node`` is an accumulator ``fuse_into_accumulator`` made."""
    return node.op == "call_function" and node.target is _EMPTY and any(
        u.op == "call_function" and u.target in _PROJECTIONS for u in node.users)

