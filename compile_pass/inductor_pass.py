"""``AuxCapturePass``: the capture pass as an Inductor post-grad custom pass.

    torch._inductor.config.post_grad_custom_post_pass = compile_pass.AuxCapturePass()

It runs on Inductor's post-grad graph (functional aten IR, before reinplacing and
lowering) with Inductor's cost model: a group is rewritten only where the estimated peak
drops once pointwise and mm producers, which Inductor's concat lowering already computes
into the concat's output, are taken into account. Writes are the mutating
``compile_pass::write_slice_`` op, which Inductor lowers as an in-place fallback call.

``CaptureTwinsPass`` is the post-grad *pre* pass (before Inductor's pattern passes): a
capture that recomputes a value the model computes itself reads the model's value instead
(``twins.py``), so the model compiles as it does without captures. The ``aux_capture``
backend installs it whenever the pass is on; set it yourself next to ``AuxCapturePass``::

    torch._inductor.config.post_grad_custom_pre_pass = compile_pass.CaptureTwinsPass()

``PieceWritesPass`` is the post-grad pass for pieces of a split graph, whose writes were
put in on the Dynamo graph.

``ReturnedCopiesPass`` (joint-graph pre pass) and ``DistinctOutputsPass`` (post-grad, last)
keep a returned copy distinct from the graph input a mutating op writes
(``distinct_outputs.py``: stock Inductor may return the mutated residual itself for a
``residual.clone()`` capture). The backend installs both on every Inductor graph, with the
capture pass on or off (``distinct_outputs_patches``); engine integrations add both to
their Inductor config.

``uuid()`` hashes the package's source files and the pass's options, so the FX graph
cache misses whenever either changes and hits otherwise. It is a ``str`` (hex digest):
vLLM serializes pass uuids into its config hash as JSON.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from torch._dynamo.utils import counters

from compile_pass.capture_pass import PassResult, run_capture_pass
from compile_pass.twins import TwinMerge, merge_capture_twins

__all__ = ["AuxCapturePass", "CaptureTwinsPass", "DistinctOutputsPass", "PieceWritesPass", "ReturnedCopiesPass",
           "distinct_outputs_patches", "source_hash"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _source_files() -> tuple:
    return tuple(sorted(os.path.join(_PACKAGE_DIR, f) for f in os.listdir(_PACKAGE_DIR)
                        if f.endswith(".py")))


def source_hash(extra: str) -> str:
    """Hex digest of the package's source files and ``extra`` (a pass's options)."""
    return get_hash_for_files(_source_files(), extra=extra).hex()


class AuxCapturePass(CustomGraphPass):
    """Inductor post-grad pass rewriting aux-hidden-state concats into packed buffers."""

    def __init__(self, cost_model: bool = True, results: Optional[List[PassResult]] = None,
                 estimate: bool = False,
                 on_result: Optional[Callable[[PassResult, fx.Graph], None]] = None,
                 keep_code_before: bool = True) -> None:
        if not isinstance(cost_model, bool):
            raise TypeError(f"cost_model must be a bool, got {cost_model!r}")
        self.cost_model = cost_model
        #: one PassResult per graph the pass ran on (shared with the backend that made it)
        self.results: List[PassResult] = results if results is not None else []
        self.estimate = estimate  # record memory timelines (does not change the rewrite)
        self.on_result = on_result  # told of each result with its rewritten graph
        #: generate each result's code before (text only: does not change the rewrite)
        self.keep_code_before = keep_code_before

    def __call__(self, graph: fx.Graph) -> None:
        gm: Optional[fx.GraphModule] = graph.owning_module
        if gm is None:  # a bare graph: give the pass a module to recompile
            gm = fx.GraphModule({}, graph)
        result = run_capture_pass(gm, "post_grad", estimate=self.estimate, cost_model=self.cost_model,
                                  keep_code_before=self.keep_code_before)
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result, gm.graph)

    def uuid(self) -> str:
        return source_hash(f"cost_model={self.cost_model}")

    def __repr__(self) -> str:
        return f"AuxCapturePass(cost_model={self.cost_model})"


class CaptureTwinsPass(CustomGraphPass):
    """Inductor post-grad pre pass: merge each capture with its twin (``twins.py``).

    ``merges`` collects what it merged, graph after graph (shared with the backend that
    made it, for the diff tool). It changes no computed value, only which node computes it.
    """

    def __init__(self, merges: Optional[List[TwinMerge]] = None) -> None:
        self.merges: List[TwinMerge] = merges if merges is not None else []

    def __call__(self, graph: fx.Graph) -> None:
        merged = merge_capture_twins(graph)
        self.merges.extend(merged)
        counters["aux_capture"]["twins_merged"] += len(merged)

    def uuid(self) -> str:
        return source_hash("capture_twins")

    def __repr__(self) -> str:
        return "CaptureTwinsPass()"


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

    def uuid(self) -> str:
        return source_hash("piece_writes")


class ReturnedCopiesPass(CustomGraphPass):
    """Joint-graph pre pass (``joint_custom_pre_pass``): tags the values the program
    returned a clone of, before ``remove_noop_ops`` drops such clones
    (``distinct_outputs.mark_returned_copies``). ``DistinctOutputsPass`` reads the tags."""

    def __call__(self, graph: fx.Graph) -> None:
        from compile_pass.distinct_outputs import mark_returned_copies

        mark_returned_copies(graph)

    def uuid(self) -> str:
        return source_hash("returned_copies")

    def __repr__(self) -> str:
        return "ReturnedCopiesPass()"


class DistinctOutputsPass(CustomGraphPass):
    """Post-grad pass: outputs that Inductor would hand back as a mutated graph input get
    the copy the program made (``distinct_outputs.keep_outputs_distinct``); needs
    ``ReturnedCopiesPass`` as the joint-graph pre pass (``distinct_outputs_patches``).

    ``replaced`` collects the replaced outputs' names, graph after graph. Run it last: a
    later pass that drops clones would undo it.
    """

    def __init__(self, replaced: Optional[List[str]] = None) -> None:
        self.replaced: List[str] = replaced if replaced is not None else []

    def __call__(self, graph: fx.Graph) -> None:
        from compile_pass.distinct_outputs import keep_outputs_distinct

        replaced = keep_outputs_distinct(graph)
        self.replaced.extend(n.name for n in replaced)
        counters["aux_capture"]["outputs_kept_distinct"] += len(replaced)

    def uuid(self) -> str:
        return source_hash("distinct_outputs")

    def __repr__(self) -> str:
        return "DistinctOutputsPass()"


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
        if first is None or second is None:
            return None  # an uncacheable pass keeps the chain uncacheable
        return f"{first}+{second}"


def distinct_outputs_patches(patches: dict, replaced: Optional[List[str]] = None) -> dict:
    """``patches`` (an Inductor config patch dict, changed in place and returned) with
    ``ReturnedCopiesPass`` chained after its ``joint_custom_pre_pass`` and
    ``DistinctOutputsPass`` after its ``post_grad_custom_post_pass`` (each falling back to
    Inductor's current config). ``replaced``: where the post pass lists what it replaced."""
    import torch._inductor.config as inductor_config

    for key, added in (("joint_custom_pre_pass", ReturnedCopiesPass()),
                       ("post_grad_custom_post_pass", DistinctOutputsPass(replaced))):
        patches[key] = chain_post_grad_passes(patches.get(key, getattr(inductor_config, key)), added)
    return patches


def chain_post_grad_passes(existing: Optional[Callable[[fx.Graph], None]],
                           capture_pass: CustomGraphPass) -> CustomGraphPass:
    """``capture_pass`` after a post-grad pass the user already configured (if any)."""
    if existing is None:
        return capture_pass
    return _ChainedPass(existing, capture_pass)
