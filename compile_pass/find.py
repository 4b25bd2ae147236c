"""Find capture groups: concats of captures with one leading shape, dtype and device.

A capture group is a concat (``torch.cat`` / ``aten.cat``) of >= 2 tensor values whose
sizes agree on every dim but the concat dim, with one dtype and one device. Each input is
classified by what produces it (``Producer``), from the node's op schema and tags, not
from a list of op spellings. Groups that cannot be rewritten are still returned, rejected
with a reason, so the diff tool can show them.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from compile_pass.dataflow import (
    OPERATOR_NAMES, NodeTable, cat_nodes, hint, nbytes, op_name, storage_key, tensor_value,
)
from compile_pass.groups import Capture, CaptureGroup, Decision, GroupKind, Producer, Provenance, Rejection

__all__ = ["find_capture_groups", "find_output_groups", "classify_producer", "is_dtype_conversion", "aten_packet",
           "exact_out_variant", "exact_binary_op", "LAYER_DEPTH"]

_EXACT_ARITHMETIC = {"add", "sub", "mul", "div"}  # IEEE correctly rounded: bitwise in any layout
_MATMUL = {"mm", "addmm", "linear", "matmul"}
_BATCHED_MATMUL = {"bmm", "baddbmm"}
_CLONE = {"clone"}
#: element-type conversions (``x.float()``, ``x.to(dtype)``, aten ``_to_copy``, prims'
#: ``convert_element_type``): elementwise, though not tagged pointwise
_CONVERSIONS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "_to_copy", "convert_element_type"}
#: A depth spread (``CaptureGroup.depth_span``) of at least this many matmuls / opaque ops
#: spans a whole layer: any decoder layer has two or more (attention's projections, the
#: MLP's up and down). MLA's k = [k_nope, k_rope] join spreads 1 (kv_a, then kv_b).
LAYER_DEPTH = 2


def aten_packet(node: fx.Node) -> Optional[torch._ops.OpOverloadPacket]:
    """The aten (or custom) op packet a node calls, whatever IR spells it."""
    return _packet_of(node.op, node.target)


def _packet_of(op: str, target: object) -> Optional[torch._ops.OpOverloadPacket]:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target
    if op == "call_method":
        name = target
    else:
        name = OPERATOR_NAMES.get(target) or getattr(target, "__name__", None)
    if not isinstance(name, str):
        return None
    try:
        return getattr(torch.ops.aten, name)
    except AttributeError:
        return None


def classify_producer(node: fx.Node, table: Optional[NodeTable] = None) -> Producer:
    """What produces ``node``'s value (see ``Producer``); ``table``: its graph's table, to
    read values and storages from instead of the nodes' metadata."""
    if node.op in ("placeholder", "get_attr"):
        return Producer.GRAPH_INPUT
    if table is not None:
        value_of, key_of = table.value.get, table.key.get
    else:
        value_of = tensor_value

        def key_of(n: fx.Node) -> Optional[int]:
            v = tensor_value(n)
            return storage_key(v) if v is not None else None
    value = value_of(node)
    key = key_of(node) if value is not None else None

    def shares_storage(inputs: List[fx.Node]) -> bool:
        return key is not None and any(value_of(a) is not None and key_of(a) == key for a in inputs)

    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]  # one output of a multi-output op, or tensor indexing
        if not isinstance(source, fx.Node):
            return Producer.OTHER
        if key is not None and value_of(source) is not None:
            return Producer.VIEW if key_of(source) == key else Producer.OTHER
        if classify_producer(source, table) is Producer.CUSTOM_OP:
            return Producer.CUSTOM_OP
        return Producer.VIEW if shares_storage(source.all_input_nodes) else Producer.OTHER
    if shares_storage(node.all_input_nodes):
        return Producer.VIEW
    try:
        kind, exact = _kind_of_target(node.op, node.target)
    except TypeError:  # an unhashable target
        kind, exact = _kind_of_target.__wrapped__(node.op, node.target)
    if kind is not Producer.POINTWISE:
        return kind
    if exact:
        inputs = [value_of(a) for a in node.all_input_nodes if value_of(a) is not None]
        if value is not None and len(inputs) == 2 and all(v.dtype == value.dtype for v in inputs):
            return Producer.EXACT_ARITHMETIC
    return Producer.POINTWISE


def is_dtype_conversion(node: fx.Node, table: Optional[NodeTable] = None) -> bool:
    """Whether ``node`` converts one tensor's element type and nothing else: a conversion
    op whose value has its first input's shape and another dtype (read from the values,
    so a ``.to(device)`` or a reshaping call is not one)."""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if op_name(node).split(".")[-1] not in _CONVERSIONS:
        return False
    value_of = table.value.get if table is not None else tensor_value
    value, source = value_of(node), value_of(node.args[0])
    return (value is not None and source is not None and value.shape == source.shape
            and value.dtype != source.dtype and value.device == source.device)


@functools.lru_cache(maxsize=4096)  # a graph calls a few ops many times
def _kind_of_target(op: str, target: object) -> Tuple[Producer, bool]:
    """What a call of ``target`` produces, from the op alone (its namespace, packet name
    and tags): CUSTOM_OP, CLONE, MATMUL, BATCHED_MATMUL, POINTWISE or OTHER, and whether a
    pointwise op is correctly rounded add/sub/mul/div (EXACT_ARITHMETIC when its two
    inputs and output share a dtype)."""
    if op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        return Producer.CUSTOM_OP, False
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = target._schema.name if isinstance(target, torch._ops.OpOverload) \
            else target._qualified_op_name  # "aten::mul"
        namespace = qualified.split("::")[0]
        if namespace not in ("aten", "prims"):
            return Producer.CUSTOM_OP, False
    packet = _packet_of(op, target)
    if packet is None:
        return Producer.OTHER, False
    name = packet.__name__.split(".")[-1]
    if name in _CLONE:
        return Producer.CLONE, False
    if name in _MATMUL:
        return Producer.MATMUL, False
    if name in _BATCHED_MATMUL:
        return Producer.BATCHED_MATMUL, False
    if isinstance(target, torch._ops.OpOverload):
        overload = target
    else:  # torch IR: the tensor overload the call dispatches to (pow's is Tensor_Scalar)
        overload = getattr(packet, "Tensor", None) or getattr(packet, "default", None) or next(
            (getattr(packet, o) for o in packet.overloads() if o.startswith("Tensor_")), None)
    if overload is not None and torch.Tag.pointwise in overload.tags:
        return Producer.POINTWISE, name in _EXACT_ARITHMETIC
    return Producer.OTHER, False


@functools.lru_cache(maxsize=1024)
def _expr_str(expr: object) -> str:
    return str(expr)  # sympy's printer: ~10 us, and a graph repeats a few expressions


def _sym_str(size: object) -> str:
    return _expr_str(size.node.expr) if isinstance(size, torch.SymInt) else str(size)


def _same_size(a: object, b: object) -> bool:
    """Two sizes are the same expression (an int equals a SymInt of that number); compares
    the sympy expressions themselves rather than printing them."""
    if a is b:
        return True
    expr_a = a.node.expr if isinstance(a, torch.SymInt) else a
    expr_b = b.node.expr if isinstance(b, torch.SymInt) else b
    return expr_a is expr_b or bool(expr_a == expr_b)


def _is_static(size: object) -> bool:
    return isinstance(size, int) or (isinstance(size, torch.SymInt) and size.node.expr.is_number)


def _group_for(cat: fx.Node, table: Optional[NodeTable] = None) -> Optional[CaptureGroup]:
    """The group of one concat, FOUND or REJECTED with a reason; None if it concatenates
    fewer than 2 values. ``table``: the graph's table (captures get locations from it)."""
    inputs = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim_arg = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", cat.kwargs.get("axis", 0))
    value_of = table.value.get if table is not None else tensor_value
    out = value_of(cat)
    if not isinstance(inputs, (list, tuple)) or len(inputs) < 2 or out is None:
        return None
    out_shape = out.shape  # read once: each read of a fake tensor's sizes builds SymInts
    rank = len(out_shape)
    dim = dim_arg + rank if isinstance(dim_arg, int) and dim_arg < 0 else dim_arg
    example_shape = tuple(hint(s) for s in out_shape)
    group = CaptureGroup(
        cat=cat, captures=[], dim=dim if isinstance(dim, int) else -1,
        shape=tuple(_sym_str(s) for s in out_shape), example_shape=example_shape,
        dtype=out.dtype, device=out.device,
        packed_bytes=math.prod(example_shape) * out.element_size(), packed_value=out,
    )
    if not isinstance(dim, int):
        return group.reject(Rejection.NOT_PACKABLE, f"concat dim {dim_arg!r} is not a constant int")
    order = table.nodes if table is not None else None
    offset = 0
    out_dtype, out_device = out.dtype, out.device
    for position, node in enumerate(inputs):
        value = value_of(node) if isinstance(node, fx.Node) else None
        if value is None:
            return group.reject(Rejection.NOT_PACKABLE,
                                f"concat input {position} ({node!r}) is not a tensor node of this graph")
        shape = value.shape
        if len(shape) != rank:
            return group.reject(Rejection.NOT_PACKABLE,
                                f"concat input {position} has {len(shape)} dims, the result has {rank}")
        width = shape[dim]
        group.captures.append(Capture(
            node=node, position=position, offset=offset, width=hint(width),
            producer=classify_producer(node, table),
            provenance=Provenance(node, order, table.position[node] if order is not None else 0),
        ))
        if not _is_static(width):
            return group.reject(
                Rejection.SYMBOLIC_WIDTH,
                f"capture {position} has a symbolic width {_sym_str(width)} along the concat dim"
            )
        offset += hint(width)
        if value.dtype != out_dtype:
            return group.reject(
                Rejection.MIXED_DTYPES,
                f"capture {position} is {value.dtype}, the concat result is {out_dtype} "
                f"(torch.cat type-promotes mixed dtypes; the packer keeps one dtype)"
            )
        if value.device != out_device:
            return group.reject(Rejection.MIXED_DEVICES,
                                f"capture {position} is on {value.device}, the result on {out_device}")
        for d in range(rank):
            if d != dim and not _same_size(shape[d], out_shape[d]):
                return group.reject(
                    Rejection.SHAPE_MISMATCH,
                    f"capture {position} has size {_sym_str(shape[d])} in dim {d}, "
                    f"the others {_sym_str(out_shape[d])}"
                )
    return group


def _may_be_boundary(node: fx.Node, cache: Dict[object, bool]) -> bool:
    """Whether the op ``node`` calls is a layer boundary op: a higher-order op, an op
    outside aten/prims, a (batched) matmul, or one output of such an op; the producers
    ``classify_producer`` calls MATMUL, BATCHED_MATMUL or CUSTOM_OP, before it rules out
    views (``_layer_depths`` does that from storages). Cached per target: most nodes of a
    graph call a few ops."""
    target = node.target
    if target is operator.getitem:
        source = node.args[0] if node.args else None
        return isinstance(source, fx.Node) and source.op == "call_function" \
            and _may_be_boundary(source, cache)
    try:
        return cache[target]
    except KeyError:
        pass
    except TypeError:  # an unhashable target: decide without the cache
        cache = {}
    if isinstance(target, torch._ops.HigherOrderOperator):
        result = True
    elif isinstance(target, torch._ops.OpOverload) and target._schema.name.split("::")[0] not in ("aten", "prims"):
        result = True
    elif isinstance(target, torch._ops.OpOverloadPacket) and \
            target._qualified_op_name.split("::")[0] not in ("aten", "prims"):
        result = True
    else:
        packet = aten_packet(node)
        result = packet is not None and packet.__name__.split(".")[-1] in _MATMUL | _BATCHED_MATMUL
    cache[target] = result
    return result


def _layer_depths(table: NodeTable) -> Dict[fx.Node, int]:
    """Per node: the longest chain of matmuls and opaque ops it depends on (its "layer").

    An in-place write is a dependency too: a value read after a node mutated its storage
    (a residual updated by a fused add-RMSNorm) depends on that node. One pass over the
    graph's table; a node is a boundary when its op is (``_may_be_boundary``, cached per
    target) and its value is not a view of one of its inputs.
    """
    depth: Dict[fx.Node, int] = {}
    # storage -> depth of its latest in-place writer (absent: none)
    written_at: Dict[Optional[int], int] = {}
    key, inputs_of, writes = table.key, table.inputs, table.writes
    written_depth = written_at.get
    boundary_ops: Dict[object, bool] = {}
    boundary_by_id: Dict[int, bool] = {}
    getitem = operator.getitem
    for n in table.nodes:  # graph order is topological: every input's depth is known
        inputs = inputs_of[n]
        if not inputs:
            base = 0
        elif len(inputs) == 1:
            base = depth[inputs[0]]
            if written_at:
                base = max(base, written_depth(key[inputs[0]], 0))
        else:
            base = max([depth[a] for a in inputs])
            if written_at:
                base = max(base, max([written_depth(key[a], 0) for a in inputs]))
        # one output of a multi-output op is as deep as the op (counted at the op itself);
        # a boundary op's view of its input (classify_producer's VIEW) is no boundary
        if n.op == "call_function" and n.target is not getitem:
            try:  # by identity: targets stay alive with the graph, and an op hashes in Python
                boundary = boundary_by_id[id(n.target)]
            except KeyError:
                boundary = boundary_by_id[id(n.target)] = _may_be_boundary(n, boundary_ops)
            if boundary and (key[n] is None or all(key[a] != key[n] for a in inputs)):
                base += 1
        depth[n] = base
        if n in writes:
            for mutated in writes[n]:
                if key[mutated] is not None:
                    written_at[key[mutated]] = base
    return depth


def _spans_layers(group: CaptureGroup, depth: dict) -> bool:
    """True if the captures depend on different numbers of matmuls/opaque ops; records
    the spread in ``group.depth_span``.

    This is the dataflow sense of "captured across layers", independent of node order: a
    concat whose inputs all come out of one block (RoPE's rotate-half, MLA's q nope/rope
    join) has inputs at one depth, is not a capture group and stays with the compiler.
    """
    depths = [depth[c.node] for c in group.captures]
    group.depth_span = max(depths) - min(depths)
    if any(c.producer is Producer.GRAPH_INPUT for c in group.captures):
        group.depth_span = max(group.depth_span, LAYER_DEPTH)
        return True  # a graph input and a computed value come from different places
    return group.depth_span > 0


def find_capture_groups(graph_module: fx.GraphModule | fx.Graph,
                        table: Optional[NodeTable] = None) -> List[CaptureGroup]:
    """All concat capture groups of a Dynamo (torch IR) or AOT/post-grad (aten IR) graph.

    Groups are in graph order; each is FOUND or already REJECTED with a reason. Finding
    does not change the graph. ``table``: the graph's ``NodeTable`` if one is at hand.
    """
    graph = graph_module.graph if isinstance(graph_module, fx.GraphModule) else graph_module
    table = NodeTable.of(graph, table)
    groups = []
    depth: Optional[Dict[fx.Node, int]] = None
    for node in cat_nodes(graph):
        if node in table.position:
            group = _group_for(node, table)
            if group is None:
                continue
            if group.decision is Decision.FOUND and depth is None:
                depth = _layer_depths(table)
            if group.decision is Decision.FOUND and not _spans_layers(group, depth):
                group.reject(Rejection.ONE_BLOCK,
                             "all captures come out of one block (each depends on the same "
                             "number of matmuls and opaque ops): not a cross-layer capture, left "
                             "to the compiler")
            groups.append(group)
    return groups


def _output_values(graph: fx.Graph) -> List[object]:
    output = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    if output is None:  # a graph under construction returns nothing yet
        return []
    returned = output.args[0] if output.args else ()
    return list(returned) if isinstance(returned, (list, tuple)) else [returned]


def _packable_together(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal leading shape, dtype and device: ``b`` can sit next to ``a`` along the last dim."""
    return (a.dim() == b.dim() >= 1 and a.dtype == b.dtype and a.device == b.device
            and all(_same_size(x, y) for x, y in zip(a.shape[:-1], b.shape[:-1])))


def _output_runs(values: List[object]) -> List[List[int]]:
    """Maximal runs (>= 2) of consecutive returned tensors that can be packed together."""
    runs: List[List[int]] = []
    run: List[int] = []
    for i, item in enumerate(values):
        value = tensor_value(item)
        if value is not None and run and _packable_together(tensor_value(values[run[0]]), value):
            run.append(i)
            continue
        if len(run) >= 2:
            runs.append(run)
        run = [i] if value is not None and value.dim() >= 1 else []
    if len(run) >= 2:
        runs.append(run)
    return runs


def _packed_fake(like: torch.Tensor, shape: List[object], requires_grad: bool) -> torch.Tensor:
    fake_mode = torch._guards.detect_fake_mode([like])
    if fake_mode is None:
        return torch.empty(shape, dtype=like.dtype, device="meta").requires_grad_(requires_grad)
    with fake_mode:
        return torch.empty(shape, dtype=like.dtype, device=like.device).requires_grad_(requires_grad)


def find_output_groups(graph_module: fx.GraphModule | fx.Graph,
                       table: Optional[NodeTable] = None) -> List[CaptureGroup]:
    """Groups of captures the graph returns for its caller to pack (``pack_outputs``).

    A group is a maximal run of >= 2 consecutive returned tensors with one leading shape
    (all dims but the last), dtype and device: the list a model returns. When the run
    starts with a value at least as deep as all the others and deeper than some (the
    model's result returned ahead of its captures, as in ``return hidden_states, aux``; a
    final norm adds no depth to a last capture of the last layer's output), that value is
    not a capture; if fewer than 2 values remain (the result and one capture: the other
    captures may be inputs Dynamo returns itself) the run is no group.
    Captures are packed along the last dim, in output order. ``table``: the graph's
    ``NodeTable`` if one is at hand.
    """
    graph = graph_module.graph if isinstance(graph_module, fx.GraphModule) else graph_module
    values = _output_values(graph)
    runs = _output_runs(values)
    if not runs:
        return []
    table = NodeTable.of(graph, table)
    output = table.nodes[-1]
    depth = _layer_depths(table)
    groups: List[CaptureGroup] = []
    for run in runs:
        first_depth = depth.get(values[run[0]], 0)
        rest = [depth.get(values[i], 0) for i in run[1:]]
        if first_depth >= max(rest) and first_depth > min(rest):
            run = run[1:]  # the model's result, returned ahead of its captures
            if len(run) < 2:
                continue
        nodes = [values[i] for i in run]
        first = tensor_value(nodes[0])
        dim = first.dim() - 1
        group = CaptureGroup(
            cat=output, captures=[], dim=dim, shape=(), example_shape=(), dtype=first.dtype,
            device=first.device, packed_bytes=0, kind=GroupKind.OUTPUTS, output_indices=tuple(run),
        )
        offset, width_sum = 0, 0
        for position, node in enumerate(nodes):
            width = tensor_value(node).shape[dim]
            group.captures.append(Capture(
                node=node, position=position, offset=offset, width=hint(width),
                producer=classify_producer(node, table), provenance=Provenance(node),
            ))
            offset += hint(width)
            width_sum = width_sum + width
        shape = list(first.shape[:-1]) + [width_sum]
        group.shape = tuple(_sym_str(s) for s in shape)
        group.example_shape = tuple(hint(s) for s in shape)
        group.packed_bytes = sum(nbytes(tensor_value(n)) for n in nodes)
        group.packed_value = _packed_fake(
            first, shape, any(tensor_value(n).requires_grad for n in nodes))
        groups.append(group)
        if not all(_is_static(tensor_value(n).shape[dim]) for n in nodes):
            group.reject(Rejection.SYMBOLIC_WIDTH, "a returned capture has a symbolic last dim")
        elif len(set(nodes)) != len(nodes):
            group.reject(Rejection.RETURNED_TWICE,
                         "the same value is returned more than once: its outputs must stay one tensor")
        elif any(c.producer in (Producer.GRAPH_INPUT, Producer.VIEW) for c in group.captures):
            which = next(c for c in group.captures if c.producer in (Producer.GRAPH_INPUT, Producer.VIEW))
            group.reject(Rejection.RETURNED_ALIAS, f"returned value {which.position} ({which.node.name}) is a "
                         f"{which.producer.value}: returning a copy would change what it aliases")
        elif not _spans_layers(group, depth):
            group.reject(Rejection.ONE_BLOCK, "all returned values come out of one block: not cross-layer captures")
    return groups


def exact_out_variant(node: fx.Node) -> Optional[torch._ops.OpOverload]:
    """The ``out=`` overload that recomputes an EXACT_ARITHMETIC producer, if its call fits.

    Fits: two tensor positional operands, no keyword but ``alpha``.
    """
    packet = aten_packet(node)
    if packet is None or not hasattr(packet, "out"):
        return None
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    if set(node.kwargs) - {"alpha"}:
        return None
    return packet.out


def exact_binary_op(node: fx.Node) -> Optional[str]:
    """``"add"``/``"sub"``/``"mul"``/``"div"`` for an EXACT_ARITHMETIC producer whose call
    ``compile_pass::binary_into_slice_`` can compute (two tensor operands, ``alpha`` 1 if
    given, no rounding mode), else None."""
    if exact_out_variant(node) is None:
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    packet = aten_packet(node)
    name = packet.__name__.split(".")[-1] if packet is not None else None
    return name if name in _EXACT_ARITHMETIC else None
