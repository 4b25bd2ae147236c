"""Dataflow facts about FX nodes, read from metadata rather than op spelling.

Works on both graph dialects the pass sees:
- Dynamo graphs (torch IR): tensor values in ``node.meta["example_value"]``, targets are
  torch functions, ``operator`` functions, methods or OpOverloads;
- AOT / post-grad graphs (aten IR): values in ``node.meta["val"]``, targets OpOverloads.

Aliasing comes from the fake values' storages (two nodes alias iff their fake tensors
share a storage), mutation from op schemas (``alias_info.is_write``) and, for torch IR,
from the in-place conventions (trailing underscore, ``out=``, ``inplace=True``,
``operator.i*``, ``setitem``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import operator
import os
from typing import Any, Dict, Hashable, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx

__all__ = [
    "tensor_value",
    "op_name",
    "OPERATOR_NAMES",
    "hint",
    "sizes_at",
    "hinted_numel",
    "nbytes",
    "storage_key",
    "mutated_inputs",
    "source_line",
    "is_cat",
    "cat_nodes",
    "nodes_calling",
    "module_location",
    "NodeTable",
    "holders_of",
    "copy_graph",
    "gc_paused",
]

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}

_CAT_TARGETS = (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default,
                torch.ops.aten.cat, torch.ops.aten.concat.default, torch.ops.aten.concat)


#: ``operator`` functions under the aten name of the op they compute
OPERATOR_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.matmul: "matmul", operator.pow: "pow", operator.getitem: "getitem",
}


def op_name(node: fx.Node) -> str:
    """The canonical name of the op ``node`` calls (``""`` for a non-call)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op != "call_function":
        return ""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return OPERATOR_NAMES.get(target) or getattr(target, "__name__", "") or ""


def tensor_value(node: Any) -> Optional[torch.Tensor]:
    """The (fake) tensor a node produces, or None if it is not a single tensor."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("val", node.meta.get("example_value"))
    return value if isinstance(value, torch.Tensor) else None


#: symbol name -> value, set by ``sizes_at``
_SIZES_AT: contextvars.ContextVar[Optional[Dict[str, int]]] = contextvars.ContextVar(
    "compile_pass_sizes_at", default=None)


@contextlib.contextmanager
def sizes_at(values: Mapping[Any, int]) -> Iterator[None]:
    """Inside the block, ``hint`` evaluates symbolic sizes at ``values`` instead of at their
    hints: the estimates of a graph traced once (token count symbolic), at other token
    counts. Keys are sympy symbols or their names (``"s0"``), values ints >= 0. A size whose
    symbols are not all given keeps its hint.
    """
    resolved: Dict[str, int] = {}
    for symbol, value in values.items():
        name = symbol if isinstance(symbol, str) else getattr(symbol, "name", None)
        if not isinstance(name, str):
            raise TypeError(f"sizes_at keys must be sympy symbols or their names, got {symbol!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"sizes_at: size of {name} must be an int >= 0, got {value!r}")
        resolved[name] = value
    token = _SIZES_AT.set(resolved)
    try:
        yield
    finally:
        _SIZES_AT.reset(token)


def hint(size: Any) -> int:
    """A concrete int for a size: ints as is, SymInts at their hint (the example size), or
    at the values ``sizes_at`` gives inside its block."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        values = _SIZES_AT.get()
        if values:
            expr = size.node.expr
            symbols = expr.free_symbols
            if symbols and all(s.name in values for s in symbols):
                return int(expr.xreplace({s: values[s.name] for s in symbols}))
        node = size.node
        known = node.hint
        return int(known if known is not None else node.shape_env.size_hint(node.expr))
    return int(size)


def hinted_numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= hint(s)
    return n


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements at the example sizes."""
    return hinted_numel(t) * t.element_size()


def storage_key(t: torch.Tensor) -> Optional[int]:
    """Identity of ``t``'s storage: equal keys mean the two values alias.

    The key is the storage's address (what ``StorageWeakRef`` hashes and compares), a
    plain int so that the dicts and sets of every whole-graph sweep hash it in C. It
    identifies a storage while that storage is alive, which every value a graph's
    metadata holds is while the graph is analysed: compare keys of one graph's live
    values, do not keep them past the values.
    """
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def is_cat(node: fx.Node) -> bool:
    """A concatenation: ``torch.cat`` and its aliases in torch IR, ``aten.cat`` in aten IR."""
    if node.op == "call_function" and node.target in _CAT_TARGETS:
        return True
    return node.op == "call_method" and node.target in ("cat",)


def nodes_calling(graph: fx.Graph, op: str, targets: Iterable[Any]) -> List[fx.Node]:
    """The nodes of ``graph`` with ``op`` calling one of ``targets``, in graph order: from
    fx's index of nodes by op and target (``Graph.find_nodes``) without reading every
    node, or by a sweep where the graph has no such index."""
    targets = tuple(dict.fromkeys(targets))
    find = getattr(graph, "find_nodes", None)
    if find is None:
        return [n for n in graph.nodes if n.op == op and n.target in targets]
    found: Dict[fx.Node, None] = {}
    for target in targets:
        found.update(dict.fromkeys(find(op=op, target=target, sort=False)))
    return sorted(found)  # nodes order as they stand in their graph


def cat_nodes(graph: fx.Graph) -> List[fx.Node]:
    """The concatenations of ``graph`` (``is_cat``), in graph order."""
    nodes = nodes_calling(graph, "call_function", _CAT_TARGETS)
    methods = nodes_calling(graph, "call_method", ("cat",))
    return sorted(nodes + methods) if methods else nodes


def _node_args(obj: Any) -> Iterable[fx.Node]:
    if isinstance(obj, fx.Node):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _node_args(item)


def _mutation_spec_uncached(op: str, target: Any) -> Tuple[bool, Tuple[Tuple[int, str], ...]]:
    overload = getattr(target, "default", None) if isinstance(target, torch._ops.OpOverloadPacket) \
        else target
    if isinstance(overload, torch._ops.OpOverload):
        return True, tuple((i, arg.name) for i, arg in enumerate(overload._schema.arguments)
                           if arg.alias_info is not None and arg.alias_info.is_write)
    name = target if op == "call_method" else getattr(target, "__name__", "")
    by_spelling = (target in _INPLACE_OPERATORS
                   or (isinstance(name, str) and name.endswith("_") and not name.endswith("__")))
    return False, ((0, ""),) if by_spelling else ()


@functools.lru_cache(maxsize=4096)
def _mutation_spec(op: str, target: Any) -> Tuple[bool, Tuple[Tuple[int, str], ...]]:
    """What a call of ``target`` writes, from what it is rather than from its arguments:
    ``(True, written)`` for an op with a schema (position and name of each argument it
    writes), ``(False, ((0, ""),))`` for a torch-IR call that writes its first argument by
    its spelling (``add_``, ``operator.iadd``), ``(False, ())`` otherwise."""
    return _mutation_spec_uncached(op, target)


def mutated_inputs(node: fx.Node) -> List[fx.Node]:
    """The input nodes whose values ``node`` writes in place (empty for functional nodes)."""
    if node.op not in ("call_function", "call_method"):
        return []
    try:
        has_schema, written = _mutation_spec(node.op, node.target)
    except TypeError:  # an unhashable target
        has_schema, written = _mutation_spec_uncached(node.op, node.target)
    if has_schema:
        mutated: List[fx.Node] = []
        for i, name in written:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
            mutated.extend(_node_args(value))
        return mutated
    kwargs = node.kwargs
    out = list(_node_args(kwargs["out"])) if "out" in kwargs else []
    if written or kwargs.get("inplace") is True:
        return list(_node_args(node.args[:1])) + out
    return out


def source_line(node: fx.Node) -> str:
    """The user source line that produced ``node`` (last frame of its stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return ""
    # the user's line, not this package's (AuxHiddenStateList.capture's clone, say)
    user_frames = [i for i in frames if f"{os.sep}compile_pass{os.sep}" not in lines[i]]
    last = (user_frames or frames)[-1]
    location = lines[last]
    code = lines[last + 1] if last + 1 < len(lines) and not lines[last + 1].startswith("File ") else ""
    # 'File "/x/llama.py", line 12, in forward' -> 'llama.py:12 (forward)'
    try:
        path = location.split('"')[1].rsplit("/", 1)[-1]
        lineno = location.split("line ")[1].split(",")[0]
        func = location.rsplit("in ", 1)[1]
        where = f"{path}:{lineno} ({func})"
    except IndexError:
        where = location
    return f"{where}: {code}" if code else where


def _module_path(stack_entry: Any) -> str:
    path = stack_entry[0] if isinstance(stack_entry, tuple) else str(stack_entry)
    for prefix in ("L['self'].", "L['self']", "self."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path


def module_location(node: fx.Node, following: Iterable[fx.Node]) -> str:
    """Where in the model ``node`` is computed, from ``nn_module_stack`` metadata: inside a
    module ("in layers.3.mlp"), or between modules at the input of the next one entered
    ("input of layers.2", what an Eagle3 capture at layer 2 looks like)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        return f"in {_module_path(list(stack.values())[-1])}"
    for later in following:
        stack = later.meta.get("nn_module_stack")
        if stack:
            parts = _module_path(list(stack.values())[0]).split(".")
            # the block being entered: up to the first ModuleList index ("layers.2")
            cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), len(parts))
            return f"input of {'.'.join(parts[:cut])}"
    return ""


class NodeTable:
    """The per-node facts of one graph that find, plan and liveness all read, taken in one
    sweep: order and position, input nodes, tensor values and their storages, in-place
    writes. One table serves every stage of one pass run over one version of the graph.

    Invariant: the table describes ``graph`` as it was when built. Any edit of the graph
    makes it stale; ``NodeTable.of`` builds a new one for a graph whose length changed
    (every rewrite adds nodes), and the pass builds a new one after each rewrite.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.nodes: List[fx.Node] = list(graph.nodes)
        self.position: Dict[fx.Node, int] = {}
        self.inputs: Dict[fx.Node, List[fx.Node]] = {}  # all_input_nodes
        self.value: Dict[fx.Node, Optional[torch.Tensor]] = {}  # = tensor_value(node)
        self.key: Dict[fx.Node, Optional[int]] = {}  # = storage_key(value), None if no value
        #: every tensor the node produces (each output of a multi-output op), and for each a
        #: storage identity: its storage key, or ("object", id) for a tensor without storage
        self.tensors: Dict[fx.Node, Tuple[torch.Tensor, ...]] = {}
        self.storages: Dict[fx.Node, Tuple[Hashable, ...]] = {}
        self.writes: Dict[fx.Node, List[fx.Node]] = {}  # node -> inputs it writes (writers only)
        self.mutators: Dict[fx.Node, List[fx.Node]] = {}  # written node -> its writers, in order
        #: storage -> its bytes at the example sizes, filled by the liveness models built on it
        self.storage_bytes: Dict[Hashable, int] = {}
        #: the graph's liveness model with nothing computed into anything (a
        #: ``liveness.LivenessModel``), set by the first one built on this table: models with
        #: ``computed_into`` are derived from it
        self.plain_liveness: Optional[Any] = None
        #: node -> the last node (in graph order) whose inputs include it; absent if unread
        self.last_reader: Dict[fx.Node, fx.Node] = {}
        #: storage -> the storage object (``storage_bytes`` reads its size on first need)
        self.storage: Dict[Hashable, Any] = {}
        position, inputs, value, key = self.position, self.inputs, self.value, self.key
        tensors, storages, writes, mutators = self.tensors, self.storages, self.writes, self.mutators
        storage_of, last_reader = self.storage, self.last_reader
        # target -> its ``_mutation_spec``: a call writes nothing if its schema writes nothing,
        # or (torch IR, no schema) its spelling writes nothing and no ``out=`` or
        # ``inplace=True`` is given (what ``mutated_inputs`` checks, without the call)
        specs: Dict[int, Tuple[bool, Tuple[Tuple[int, str], ...]]] = {}
        Tensor = torch.Tensor
        for i, node in enumerate(self.nodes):  # locals only: this loop is the pass's widest
            position[node] = i
            inputs[node] = ins = node.all_input_nodes
            for arg in ins:
                last_reader[arg] = node  # graph order: the latest reader so far
            meta = node.meta
            raw = meta["val"] if "val" in meta else meta.get("example_value")
            if isinstance(raw, Tensor):
                try:  # storage_key, inline: one call per node
                    storage = raw.untyped_storage()
                    k: Hashable = storage._cdata
                    storage_of[k] = storage
                except (NotImplementedError, RuntimeError):
                    k = None
                value[node], key[node] = raw, k
                tensors[node] = (raw,)
                storages[node] = (k or ("object", id(raw)),)
            else:
                value[node] = key[node] = None
                many = tuple(v for v in raw if isinstance(v, Tensor)) \
                    if isinstance(raw, (list, tuple)) else ()
                tensors[node] = many
                storages[node] = tuple(storage_key(t) or ("object", id(t)) for t in many)
            op = node.op
            if op == "call_function" or op == "call_method":
                target = node.target
                try:  # by identity: an op's own __hash__ is Python code, and every node's
                    # target stays alive while the graph is being read
                    has_schema, written = specs[id(target)]
                except KeyError:
                    try:
                        has_schema, written = specs[id(target)] = _mutation_spec(op, target)
                    except TypeError:  # an unhashable target
                        has_schema, written = True, ((0, ""),)  # mutated_inputs decides
                if not written:
                    if has_schema:
                        continue
                    kwargs = node.kwargs
                    if not kwargs or ("out" not in kwargs and kwargs.get("inplace") is not True):
                        continue
                mutated = mutated_inputs(node)
                if mutated:
                    writes[node] = mutated
                    for target in mutated:
                        mutators.setdefault(target, []).append(node)

    @classmethod
    def of(cls, graph: fx.Graph, table: Optional["NodeTable"] = None) -> "NodeTable":
        """``table`` if it was built for ``graph`` and the graph still has its length, else
        a new table."""
        if table is not None and table.graph is graph and len(graph.nodes) == len(table.nodes):
            return table
        return cls(graph)

    @functools.cached_property
    def holders(self) -> Dict[Hashable, List[fx.Node]]:
        """Storage -> the nodes whose values (any output of a multi-output op) live in it,
        in graph order: a value and all its aliases. The output node holds nothing (it
        returns what others hold)."""
        return holders_of(self.storages)


def holders_of(storages: Mapping[fx.Node, Iterable[Hashable]]) -> Dict[Hashable, List[fx.Node]]:
    """Storage -> the nodes holding it, in the mapping's (graph) order, from each node's
    storages; the output node holds nothing."""
    holders: Dict[Hashable, List[fx.Node]] = {}
    for node, keys in storages.items():
        if node.op != "output":
            for key in keys:
                holders.setdefault(key, []).append(node)
    return holders


def copy_graph(graph: fx.Graph) -> Tuple[fx.Graph, Dict[fx.Node, fx.Node]]:
    """A node-for-node copy of ``graph`` (metadata dicts copied, fake values shared)."""
    new = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    node_map: Dict[fx.Node, fx.Node] = {}
    value, old_out = new.graph_copy(graph, node_map, return_output_node=True)
    out_node = new.output(value, type_expr=old_out.type)
    out_node.meta = dict(old_out.meta)
    node_map[old_out] = out_node
    return new, node_map


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (reference counting still
    frees). A pass allocates many small objects next to a compile's large heap of nodes and
    fake tensors, and a full collection that falls inside it costs more than the pass:
    measured on the 61-layer DeepSeek-V3 Dynamo graph, 0.5-1.2 s with it, see
    docs/scale.md."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
