"""``AuxCapturePass``: the capture pass as an Inductor post-grad custom pass.

    torch._inductor.config.post_grad_custom_post_pass = compile_pass.AuxCapturePass()

It runs on Inductor's post-grad graph (functional aten IR, before reinplacing and
lowering) with Inductor's cost model: a group is rewritten only where the estimated peak
drops once pointwise and mm producers, which Inductor's concat lowering already computes
into the concat's output, are taken into account. Writes are the mutating
``compile_pass::write_slice_`` op, which Inductor lowers as an in-place fallback call.

``PieceWritesPass`` is the post-grad pass for pieces of a split graph, whose writes were
put in on the Dynamo graph.

``uuid()`` hashes the package's source files and the pass's options, so the FX graph
cache misses whenever either changes and hits otherwise.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from compile_pass.capture_pass import PassResult, run_capture_pass

__all__ = ["AuxCapturePass", "PieceWritesPass"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _source_files() -> tuple:
    return tuple(sorted(os.path.join(_PACKAGE_DIR, f) for f in os.listdir(_PACKAGE_DIR)
                        if f.endswith(".py")))


class AuxCapturePass(CustomGraphPass):
    """Inductor post-grad pass rewriting aux-hidden-state concats into packed buffers."""

    def __init__(self, cost_model: bool = True, results: Optional[List[PassResult]] = None,
                 estimate: bool = False,
                 on_result: Optional[Callable[[PassResult, fx.Graph], None]] = None) -> None:
        if not isinstance(cost_model, bool):
            raise TypeError(f"cost_model must be a bool, got {cost_model!r}")
        self.cost_model = cost_model
        #: one PassResult per graph the pass ran on (shared with the backend that made it)
        self.results: List[PassResult] = results if results is not None else []
        self.estimate = estimate  # record memory timelines (does not change the rewrite)
        self.on_result = on_result  # told of each result with its rewritten graph

    def __call__(self, graph: fx.Graph) -> None:
        gm: Optional[fx.GraphModule] = graph.owning_module
        if gm is None:  # a bare graph: give the pass a module to recompile
            gm = fx.GraphModule({}, graph)
        result = run_capture_pass(gm, "post_grad", estimate=self.estimate, cost_model=self.cost_model)
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result, gm.graph)

    def uuid(self) -> bytes:
        return get_hash_for_files(_source_files(), extra=f"cost_model={self.cost_model}")

    def __repr__(self) -> str:
        return f"AuxCapturePass(cost_model={self.cost_model})"


class PieceWritesPass(CustomGraphPass):
    """Post-grad pass for graphs whose capture writes were put in before AOTAutograd
    (pieces of a split graph): captures the graph computes again and returns are written
    from the returned value (``reinplace.write_from_twins``).

    It runs after Inductor's pattern passes (which decide, e.g., whether an add folds into
    a matmul), so it changes no computed value: the pass-off graph computes the same sum
    twice, and the write now copies the copy that is returned anyway.
    """

    def __call__(self, graph: fx.Graph) -> None:
        from compile_pass.reinplace import write_from_twins

        write_from_twins(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files(_source_files(), extra="piece_writes")


class _ChainedPass(CustomGraphPass):
    """Two post-grad passes run in order; its uuid covers both."""

    def __init__(self, first: CustomGraphPass, second: CustomGraphPass) -> None:
        self.first, self.second = first, second

    def __call__(self, graph: fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Optional[Any]:
        first = self.first.uuid() if hasattr(self.first, "uuid") else None
        second = self.second.uuid()
        if first is None:
            return None  # an uncacheable first pass keeps the chain uncacheable
        return f"{first!r}+{second!r}"


def chain_post_grad_passes(existing: Optional[Callable[[fx.Graph], None]],
                           capture_pass: CustomGraphPass) -> CustomGraphPass:
    """``capture_pass`` after a post-grad pass the user already configured (if any)."""
    if existing is None:
        return capture_pass
    return _ChainedPass(existing, capture_pass)
