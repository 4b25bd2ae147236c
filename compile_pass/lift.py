"""Lift packed capture buffers out of a graph: the compiled callable's caller allocates them.

A packed buffer (``aux_packed``, or a packer's buffer inside a compiled model) is an
uninitialized allocation that ``compile_pass::write_slice_`` calls fill. Allocated inside
an Inductor graph, it changes Inductor's own memory plan for everything else: the
wrapper reuses a freed buffer for a later one of the same size whenever its *estimated*
peak allows, and a buffer that raises that estimate from the first capture on lets more
freed buffers be held across opaque kernels whose temporaries the estimate cannot see
(an attention op's): measured, a 3-capture Llama paid 1.33x-2.00x the packed bytes with
the buffer in the graph and 1.00x with it passed in (docs/benchmarks.md).

``lift_packed_buffers(gm)`` makes each buffer node a new trailing graph input of ``gm`` (a
backend's working copy of Dynamo's graph, ``copy_module``) and returns ``LiftedBuffers``,
which allocates them from a call's arguments (the buffer's symbolic sizes are read off the
inputs that carry those symbols). Invariant: the
lifted graph called with freshly allocated buffers computes exactly what the graph
computed with its own ``empty`` (the contents of an uninitialized buffer are undefined
either way, and nothing else aliases a fresh tensor).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import sympy
import torch
import torch.fx as fx

import compile_pass.ops  # noqa: F401  (registers compile_pass::write_slice_)
from compile_pass.dataflow import copy_graph, nodes_calling, tensor_value

__all__ = ["LiftError", "LiftedBuffer", "LiftedBuffers", "copy_module", "find_packed_buffers",
           "lift_packed_buffers", "WithLiftedBuffers"]

_WRITES = (torch.ops.compile_pass.write_slice_.default, torch.ops.compile_pass.write_slice_,
           torch.ops.compile_pass.binary_into_slice_.default)
#: uninitialized allocations, in torch IR (Dynamo graphs) and aten IR
_EMPTY_TARGETS = (torch.empty, torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
_EMPTY_METHODS = ("new_empty",)


class LiftError(RuntimeError):
    """A buffer cannot be lifted (it stays in the graph; the message says why)."""


@dataclass(frozen=True)
class SizeSource:
    """Where a call's value of one size symbol is read: argument ``arg`` itself (a SymInt
    input) or its size ``dim`` (a tensor input)."""

    arg: int
    dim: Optional[int] = None

    def read(self, args: Sequence[Any]) -> int:
        value = args[self.arg]
        return int(value) if self.dim is None else int(value.shape[self.dim])


Size = Union[int, sympy.Expr]


@dataclass(frozen=True)
class LiftedBuffer:
    """One buffer the caller allocates: its graph input's name, its size expressions (ints
    or sympy expressions in the graph's size symbols), dtype and device."""

    name: str
    sizes: Tuple[Size, ...]
    dtype: torch.dtype
    device: torch.device
    sources: Tuple[Tuple[sympy.Symbol, SizeSource], ...]

    def shape(self, args: Sequence[Any]) -> List[int]:
        values = {symbol: source.read(args) for symbol, source in self.sources}
        return [size if isinstance(size, int) else
                (values[size] if size in values else int(size.xreplace(values)))
                for size in self.sizes]

    def allocate(self, args: Sequence[Any]) -> torch.Tensor:
        return torch.empty(self.shape(args), dtype=self.dtype, device=self.device)

    def describe(self) -> str:
        return (f"{self.name}: [{', '.join(str(s) for s in self.sizes)}] "
                f"{str(self.dtype).replace('torch.', '')} on {self.device}")


@dataclass(frozen=True)
class LiftedBuffers:
    """The buffers a lifted graph takes after its original inputs, in order."""

    buffers: Tuple[LiftedBuffer, ...]
    num_inputs: int  # the graph's inputs before lifting

    def allocate(self, args: Sequence[Any]) -> List[torch.Tensor]:
        return [b.allocate(args) for b in self.buffers]

    def __len__(self) -> int:
        return len(self.buffers)


class WithLiftedBuffers:
    """A compiled lifted graph called as the original one: each call allocates the
    buffers and appends them to the (positional) arguments.

    A ``torch._dynamo`` ``SerializableCallable`` where that exists (torch's ahead-of-time
    compile, e.g. vLLM's ``VLLM_USE_AOT_COMPILE``, refuses a backend result that is not):
    the artifact is the compiled graph's own (Inductor's, bundled by AOTAutograd) and the
    buffer specs."""

    def __init__(self, compiled: Callable[..., Any], lifted: LiftedBuffers) -> None:
        self.compiled, self.lifted = compiled, lifted

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args, *self.lifted.allocate(args))

    @classmethod
    def serialize_compile_artifacts(cls, fn: "WithLiftedBuffers") -> bytes:
        from torch._dynamo.aot_compile_types import (BundledAOTAutogradSerializableCallable,
                                                     SerializableCallable)

        inner = fn.compiled
        if not isinstance(inner, SerializableCallable):
            if getattr(inner, "serialize", None) is None:
                raise TypeError(f"the compiled lifted graph ({type(inner).__name__}) has no "
                                "serializable artifact")
            inner = BundledAOTAutogradSerializableCallable(inner)
        return pickle.dumps((type(inner), type(inner).serialize_compile_artifacts(inner), fn.lifted))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "WithLiftedBuffers":
        inner_cls, artifact, lifted = pickle.loads(data)
        return cls(inner_cls.deserialize_compile_artifacts(artifact), lifted)


try:  # torch >= 2.10: a virtual subclass, so torch's isinstance check accepts it
    from torch._dynamo.aot_compile_types import SerializableCallable as _SerializableCallable
except ImportError:  # pragma: no cover - older torch has no ahead-of-time compile
    _SerializableCallable = None
if _SerializableCallable is not None:
    _SerializableCallable.register(WithLiftedBuffers)


def find_packed_buffers(graph: fx.Graph) -> List[fx.Node]:
    """Uninitialized allocations that ``write_slice_`` / ``binary_into_slice_`` calls write
    into, in graph order (the buffers of rewritten groups and of packers inside the model)."""
    buffers = []
    allocations = nodes_calling(graph, "call_function", _EMPTY_TARGETS) + \
        nodes_calling(graph, "call_method", _EMPTY_METHODS)
    for node in sorted(allocations):
        if any(u.op == "call_function" and u.target in _WRITES
               and (u.args[0] if u.args else u.kwargs.get("buf")) is node for u in node.users):
            buffers.append(node)
    return buffers


def _size_sources(placeholders: List[fx.Node]) -> Dict[sympy.Symbol, SizeSource]:
    sources: Dict[sympy.Symbol, SizeSource] = {}
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            if isinstance(expr, sympy.Symbol):
                sources.setdefault(expr, SizeSource(i))
        elif isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, SizeSource(i, d))
    return sources


def _buffer_spec(node: fx.Node, name: str, sources: Dict[sympy.Symbol, SizeSource]) -> LiftedBuffer:
    value = tensor_value(node)
    if value is None:
        raise LiftError(f"{node.name} has no tensor value")
    if not value.is_contiguous():
        raise LiftError(f"{node.name} is not contiguous")
    sizes: List[Size] = []
    needed: Dict[sympy.Symbol, SizeSource] = {}
    for d, size in enumerate(value.shape):
        if not isinstance(size, torch.SymInt):
            sizes.append(int(size))
            continue
        expr = size.node.expr
        if expr.is_number:
            sizes.append(int(expr))
            continue
        for symbol in expr.free_symbols:
            if symbol not in sources:
                raise LiftError(f"size {expr} of {node.name} (dim {d}) is not read off any graph input")
            needed[symbol] = sources[symbol]
        sizes.append(expr)
    return LiftedBuffer(name, tuple(sizes), value.dtype, value.device,
                        tuple(sorted(needed.items(), key=lambda item: item[0].name)))


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new module over a node-for-node copy of ``gm``'s graph: same submodules and
    parameters, same module and node metadata (a backend's working copy of Dynamo's graph,
    which stays Dynamo's)."""
    graph, node_map = copy_graph(gm.graph)
    for old, new in node_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(gm.meta)
    for attr in ("_param_name_to_source",):
        if hasattr(gm, attr):
            setattr(copy, attr, getattr(gm, attr))
    return copy


def lift_packed_buffers(gm: fx.GraphModule) -> Optional[LiftedBuffers]:
    """Make each packed buffer of ``gm`` (``find_packed_buffers``) a trailing graph input,
    in place (call it on a working copy: Dynamo keeps its own graph's inputs), and return
    how to allocate them per call; None if it has none. Raises ``LiftError`` (graph
    unchanged) if one cannot be lifted."""
    graph = gm.graph
    buffers = find_packed_buffers(graph)
    if not buffers:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources = _size_sources(placeholders)
    specs = [_buffer_spec(node, f"{node.name}_input", sources) for node in buffers]
    meta_key = "val" if "val" in buffers[0].meta else "example_value"
    last = placeholders[-1] if placeholders else None
    for node, spec in zip(buffers, specs):
        if last is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                placeholder = graph.placeholder(spec.name)
        else:
            with graph.inserting_after(last):
                placeholder = graph.placeholder(spec.name)
        placeholder.meta[meta_key] = node.meta[meta_key]
        # AOTAutograd maps a Dynamo graph's inputs to their sources (guards); an input
        # made inside the backend has none, as DDP's split graphs' intermediates
        placeholder._dynamo_source = None  # type: ignore[attr-defined]
        for key in ("stack_trace", "nn_module_stack"):
            if key in node.meta:
                placeholder.meta[key] = node.meta[key]
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        last = placeholder
    return LiftedBuffers(tuple(specs), len(placeholders))
