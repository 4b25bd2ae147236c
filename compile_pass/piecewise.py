"""Compile the pieces of a split graph, each with the inner compiler, and run them.

``compile_pieces(split, example_inputs, compile_piece)`` walks the split module once under
the Dynamo graph's fake mode (each piece's inputs are the fake values flowing into it,
symbolic sizes included, so one compile serves every token count) and replaces every
compute piece by what ``compile_piece(piece, fake_inputs)`` returns. Pieces holding a
split-op call stay as they are: the op runs eagerly between compiled pieces, as in serving
engines.

``PieceRunner(split.module)`` runs the pieces in order. Invariant: when a piece is called,
the runner holds no reference to a value whose last reader is that piece. A piece compiled
with the boxed calling convention (``compile_piece`` returned a :class:`BoxedCall`) takes
its inputs as a list it empties, so it frees each input after its own last use inside the
piece instead of at the piece's return (Inductor's generated code ``del``\\ s each input after
its last read). An FX ``GraphModule`` forward keeps every argument of a call alive until the
call returns; under Inductor that held the residual stream and the attention output for the
whole of each piece (measured: 1.25 hidden-size activations at every piece's peak).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import torch
import torch.fx as fx
from torch import nn

from compile_pass.split import SplitGraph

__all__ = ["BoxedCall", "CompiledPiece", "PieceRunner", "compile_pieces", "fake_inputs"]

CompiledFn = Callable[..., Any]


class BoxedCall:
    """A compiled piece taking its inputs as one list, which it empties (frees them early)."""

    def __init__(self, fn: Callable[[List[Any]], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"BoxedCall needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, args: List[Any]) -> Any:
        return self.fn(args)


PieceFn = Union[CompiledFn, BoxedCall]


class CompiledPiece(nn.Module):
    """A compiled piece in place of its submodule.

    ``forward(*args)`` (ordinary calls) and ``call_boxed(args)`` (the runner: ``args`` is
    emptied, so a boxed piece owns its inputs) return what the piece's graph returns.
    """

    def __init__(self, name: str, compiled: PieceFn, graph_module: fx.GraphModule,
                 unwrap: bool = False) -> None:
        super().__init__()
        self.name = name
        self.compiled = compiled
        self.graph_module = graph_module  # the piece as compiled (for reading its code)
        self.unwrap = unwrap  # compiled returning a 1-tuple for a piece returning one value

    @property
    def boxed(self) -> bool:
        return isinstance(self.compiled, BoxedCall)

    def call_boxed(self, args: List[Any]) -> Any:
        if self.boxed:
            out = self.compiled(args)
        else:
            call_args = tuple(args)
            args.clear()
            out = self.compiled(*call_args)
        return out[0] if self.unwrap else out

    def forward(self, *args: Any) -> Any:
        return self.call_boxed(list(args))


def fake_inputs(example_inputs: Sequence[Any]) -> List[Any]:
    """A backend's example inputs as fake values of the compile's own fake mode (the
    tracing context's): symbolic sizes stay symbolic, so pieces compile for every size."""
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        raise ValueError("no fake mode: fake_inputs must be called inside a torch.compile backend")
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


class _PieceCompiler(fx.Interpreter):
    def __init__(self, split: SplitGraph, compile_piece: Callable[[fx.GraphModule, List[Any]], PieceFn]
                 ) -> None:
        super().__init__(split.module)
        self.compute = set(split.compute_pieces)
        self.compile_piece = compile_piece
        self.compiled: Dict[str, Tuple[PieceFn, bool]] = {}

    def call_module(self, target: str, args: Sequence[Any], kwargs: dict) -> Any:
        piece = self.fetch_attr(target)
        result = piece(*args, **kwargs)
        if target in self.compute:
            self.compiled[target] = _compile_returning_tuple(piece, list(args), self.compile_piece)
        return result


def _compile_returning_tuple(piece: fx.GraphModule, args: List[Any],
                             compile_piece: Callable[[fx.GraphModule, List[Any]], PieceFn]
                             ) -> Tuple[PieceFn, bool]:
    """(compiled, unwrap): compilers after AOTAutograd want tuple outputs; a piece returning
    one value is compiled returning a 1-tuple (``unwrap``: take its element)."""
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return compile_piece(piece, args), False
    output.args = ((output.args[0],),)
    piece.recompile()
    return compile_piece(piece, args), True


class PieceRunner:
    """Runs a split module's graph, releasing each value before the call that reads it last.

    Supports the nodes ``split_module`` emits: placeholders, ``call_module`` (pieces),
    ``call_function`` (``getitem`` of a piece's outputs), ``get_attr`` and the output.
    """

    def __init__(self, module: fx.GraphModule) -> None:
        self.module = module
        nodes = list(module.graph.nodes)
        last_reader: Dict[fx.Node, int] = {}
        for i, node in enumerate(nodes):
            for arg in node.all_input_nodes:
                last_reader[arg] = i
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.steps: List[Tuple[fx.Node, List[fx.Node]]] = []
        for i, node in enumerate(nodes):
            if node.op == "placeholder":
                continue
            if node.op not in ("call_module", "call_function", "get_attr", "output"):
                raise ValueError(f"PieceRunner cannot run {node.op} node {node.name}")
            released = [a for a in node.all_input_nodes if last_reader[a] == i]
            self.steps.append((node, released))
        self.pieces = {n.target: getattr(module, n.target) for n in nodes if n.op == "call_module"}

    def __call__(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.placeholders):
            raise TypeError(f"the split graph takes {len(self.placeholders)} inputs, "
                            f"got {len(inputs)}")
        env: Dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        del inputs
        for node, released in self.steps:
            if node.op == "output":
                return fx.graph.map_arg(node.args[0], env.__getitem__)
            args = list(fx.graph.map_arg(node.args, env.__getitem__))
            kwargs = fx.graph.map_arg(node.kwargs, env.__getitem__)
            for value in released:
                del env[value]
            if node.op == "call_module":
                piece = self.pieces[node.target]
                if isinstance(piece, CompiledPiece) and not kwargs:
                    env[node] = piece.call_boxed(args)  # empties args: the piece owns them
                else:
                    env[node] = piece(*args, **kwargs)
            elif node.op == "call_function":
                env[node] = node.target(*args, **kwargs)
            else:
                env[node] = getattr(self.module, node.target)
            del args, kwargs
        raise ValueError("the split graph has no output node")


def compile_pieces(split: SplitGraph, example_inputs: Sequence[Any],
                   compile_piece: Callable[[fx.GraphModule, List[Any]], PieceFn]) -> PieceRunner:
    """``split.module`` with every compute piece compiled by ``compile_piece``, and a runner
    for it. ``compile_piece`` returns a callable taking the inputs as arguments, or a
    :class:`BoxedCall` taking them as a list it empties."""
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        raise ValueError("compile_pieces needs fake example inputs (see fake_inputs)")
    interpreter = _PieceCompiler(split, compile_piece)
    with fake_mode:
        interpreter.run(*example_inputs)
    for name, (compiled, unwrap) in interpreter.compiled.items():
        setattr(split.module, name, CompiledPiece(name, compiled, getattr(split.module, name), unwrap))
    return PieceRunner(split.module)
