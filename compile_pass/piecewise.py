"""Compile the pieces of a split graph, each with the inner compiler; split ops run eagerly.

``compile_pieces(split, compile_piece)`` walks the split module once under the Dynamo
graph's fake mode (each piece's inputs are the fake values flowing into it, symbolic
sizes included, so one compile serves every token count) and replaces every compute
piece by what ``compile_piece(piece, fake_inputs)`` returns. Pieces holding a split-op
call stay as they are: the op runs eagerly between compiled pieces, as in serving engines.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch
import torch.fx as fx
from torch import nn

from compile_pass.split import SplitGraph

__all__ = ["CompiledPiece", "compile_pieces", "fake_inputs"]

CompiledFn = Callable[..., Any]


class CompiledPiece(nn.Module):
    """A compiled piece in place of its submodule: ``forward(*args)`` calls the compiled fn."""

    def __init__(self, name: str, compiled: CompiledFn, graph_module: fx.GraphModule) -> None:
        super().__init__()
        self.name = name
        self.compiled = compiled
        self.graph_module = graph_module  # the piece as compiled (for reading its code)

    def forward(self, *args: Any) -> Any:
        return self.compiled(*args)


def fake_inputs(example_inputs: Sequence[Any]) -> List[Any]:
    """A backend's example inputs as fake values of the compile's own fake mode (the
    tracing context's): symbolic sizes stay symbolic, so pieces compile for every size."""
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        raise ValueError("no fake mode: fake_inputs must be called inside a torch.compile backend")
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


class _PieceCompiler(fx.Interpreter):
    def __init__(self, split: SplitGraph, compile_piece: Callable[[fx.GraphModule, List[Any]], CompiledFn]
                 ) -> None:
        super().__init__(split.module)
        self.compute = set(split.compute_pieces)
        self.compile_piece = compile_piece
        self.compiled: dict = {}

    def call_module(self, target: str, args: Sequence[Any], kwargs: dict) -> Any:
        piece = self.fetch_attr(target)
        result = piece(*args, **kwargs)
        if target in self.compute:
            self.compiled[target] = _compile_returning_tuple(piece, list(args), self.compile_piece)
        return result


def _compile_returning_tuple(piece: fx.GraphModule, args: List[Any],
                             compile_piece: Callable[[fx.GraphModule, List[Any]], CompiledFn]
                             ) -> CompiledFn:
    """Compilers after AOTAutograd want tuple outputs; a piece returning one value is
    compiled returning a 1-tuple and unwrapped around the call."""
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return compile_piece(piece, args)
    output.args = ((output.args[0],),)
    piece.recompile()
    compiled = compile_piece(piece, args)
    return lambda *call_args: compiled(*call_args)[0]


def compile_pieces(split: SplitGraph, example_inputs: Sequence[Any],
                   compile_piece: Callable[[fx.GraphModule, List[Any]], CompiledFn]) -> fx.GraphModule:
    """``split.module`` with every compute piece compiled by ``compile_piece``."""
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        raise ValueError("compile_pieces needs fake example inputs (see fake_inputs)")
    interpreter = _PieceCompiler(split, compile_piece)
    with fake_mode:
        interpreter.run(*example_inputs)
    for name, compiled in interpreter.compiled.items():
        setattr(split.module, name, CompiledPiece(name, compiled, getattr(split.module, name)))
    return split.module
