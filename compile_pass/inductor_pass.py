"""The capture pass's Inductor custom passes, and the set one compile installs.

One function wires them: ``inductor_pass_set(build)`` returns the passes a kind of compile
needs (``Build``), each for its slot, and ``InductorPassSet.config_patches()`` chains them
after whatever the compile's config already has there, for that compile only::

    passes = compile_pass.inductor_pass_set(Build.WHOLE_GRAPH)
    torch.compile(model, options=passes.config_patches())

The backend, the vLLM plugin and the SGLang plugin all build their passes with it. The
passes, for engine authors who place them themselves:

- ``AuxCapturePass`` (post-grad post pass): the capture pass on Inductor's post-grad graph
  (functional aten IR, before reinplacing and lowering), with Inductor's cost model. Writes
  are the mutating ``compile_pass::write_slice_`` op, lowered as an in-place fallback call.
- ``CaptureTwinsPass`` (post-grad *pre* pass, before Inductor's pattern passes): a capture
  that recomputes a value the model computes itself reads the model's value instead
  (``twins.py``), so the model compiles as it does without captures.
- ``PieceWritesPass`` (post-grad post pass): pieces of a split graph whose writes were put
  in on the Dynamo graph (``reinplace.write_from_twins``).
- ``ReturnedCopiesPass`` (joint-graph pre pass) and ``DistinctOutputsPass`` (post-grad,
  after every pass that drops clones): a returned copy stays distinct from the graph input
  a mutating op writes (``distinct_outputs.py``: stock Inductor may return the mutated
  residual itself for a ``residual.clone()`` capture). Every Inductor compile gets both,
  the capture pass on or off.

``uuid()`` hashes the source files the passes execute and the pass's options
(``source_hash``), so the FX graph cache misses whenever either changes and hits
otherwise. It is a ``str`` (hex digest): vLLM serializes pass uuids into its config hash
as JSON.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from torch._dynamo.utils import counters

from compile_pass.capture_pass import run_capture_pass
from compile_pass.result import PassResult
from compile_pass.twins import TwinMerge, merge_capture_twins

__all__ = ["AuxCapturePass", "Build", "CaptureTwinsPass", "DistinctOutputsPass", "InductorPassSet",
           "PieceWritesPass", "ReturnedCopiesPass", "chain_post_grad_passes", "inductor_pass_set",
           "source_hash"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _imported_modules(path: str) -> List[str]:
    """The ``compile_pass`` modules a source file imports, anywhere in it (functions too)."""
    import ast

    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    names: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]  # from compile_pass import ops
    return [n for n in names if n.split(".")[0] == "compile_pass"]


@functools.lru_cache(maxsize=None)
def _source_files() -> tuple:
    """The files the passes execute: this module and every ``compile_pass`` module it
    imports, directly or through those (read from their import statements). The fuzzer,
    the diff tool, the CLI and the engine plugins are not among them, so editing them
    leaves every pass's ``uuid()`` (and Inductor's cache) as it was."""
    seen = set()
    todo = [os.path.abspath(__file__)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _imported_modules(path):
            parts = module.split(".")[1:]
            if not parts:
                continue
            candidate = os.path.join(_PACKAGE_DIR, *parts) + ".py"
            if os.path.isfile(candidate):
                todo.append(candidate)
    return tuple(sorted(seen))


def source_hash(extra: str) -> str:
    """Hex digest of the source files the passes execute (``_source_files``, read now) and
    ``extra`` (a pass's options)."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(extra.encode())
    return digest.hexdigest()


class AuxCapturePass(CustomGraphPass):
    """Inductor post-grad pass rewriting aux-hidden-state concats into packed buffers."""

    def __init__(self, cost_model: bool = True, results: Optional[List[PassResult]] = None,
                 estimate: bool = False,
                 on_result: Optional[Callable[[PassResult, fx.Graph], None]] = None,
                 keep_code_before: bool = True, fuse_projection: bool = False) -> None:
        if not isinstance(cost_model, bool):
            raise TypeError(f"cost_model must be a bool, got {cost_model!r}")
        if not isinstance(fuse_projection, bool):
            raise TypeError(f"fuse_projection must be a bool, got {fuse_projection!r}")
        self.cost_model = cost_model
        self.fuse_projection = fuse_projection
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
                                  keep_code_before=self.keep_code_before,
                                  fuse_projection=self.fuse_projection)
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result, gm.graph)

    def uuid(self) -> str:
        return source_hash(f"cost_model={self.cost_model}" + (",fuse_projection" if self.fuse_projection else ""))

    def __repr__(self) -> str:
        return f"AuxCapturePass(cost_model={self.cost_model}" + \
            (", fuse_projection=True)" if self.fuse_projection else ")")


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


class Build(enum.Enum):
    """What kind of compile a set of Inductor passes is for (``inductor_pass_set``)."""

    #: the capture pass runs in Inductor's own post-grad graph (``AuxCapturePass``)
    WHOLE_GRAPH = "whole_graph"
    #: pieces of a graph whose capture writes were put in before the split (``PieceWritesPass``)
    PIECES = "pieces"
    #: a graph rewritten before AOTAutograd (the lifted inductor inner): twins merged only
    REWRITTEN = "rewritten"
    #: the capture pass off: only returned copies kept distinct from mutated inputs
    PASS_OFF = "pass_off"


@dataclass(frozen=True)
class InductorPassSet:
    """The custom Inductor passes one compile needs, each for the slot it must run in.

    - ``joint_pre`` (``joint_custom_pre_pass``): ``ReturnedCopiesPass``, before Inductor's
      ``remove_noop_ops`` drops returned clones;
    - ``post_grad_pre`` (``post_grad_custom_pre_pass``): ``CaptureTwinsPass``, before
      Inductor's pattern passes, so the model compiles as without captures (None: pass off);
    - ``post_grad_post`` (``post_grad_custom_post_pass``): the capture or piece-writes pass
      (None where the graph was rewritten before, or the pass is off);
    - ``post_grad_last``: ``DistinctOutputsPass``, after every pass that drops clones and
      before anything that removes functionalized ops (``config_patches`` chains it last
      in ``post_grad_custom_post_pass``; an engine whose own post-grad passes drop clones
      places it after them).
    """

    build: Build
    joint_pre: ReturnedCopiesPass
    post_grad_pre: Optional[CaptureTwinsPass]
    post_grad_post: Optional[CustomGraphPass]
    post_grad_last: DistinctOutputsPass

    def config_patches(self, patches: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Inductor config patches for one compile (``compile_fx(config_patches=...)`` or
        ``torch.compile(options=...)``): ``patches`` (copied; default empty) with each pass
        chained after what it, or else Inductor's current config, has in its slot."""
        import torch._inductor.config as inductor_config

        out = dict(patches or {})

        def existing(key: str) -> Any:
            return out.get(key, getattr(inductor_config, key))

        if self.post_grad_pre is not None:
            out["post_grad_custom_pre_pass"] = chain_post_grad_passes(
                existing("post_grad_custom_pre_pass"), self.post_grad_pre)
        post = existing("post_grad_custom_post_pass")
        if self.post_grad_post is not None:
            post = chain_post_grad_passes(post, self.post_grad_post)
        out["post_grad_custom_post_pass"] = chain_post_grad_passes(post, self.post_grad_last)
        out["joint_custom_pre_pass"] = chain_post_grad_passes(existing("joint_custom_pre_pass"),
                                                              self.joint_pre)
        return out


def inductor_pass_set(build: Build, *, capture_pass: Optional[AuxCapturePass] = None,
                      twin_merges: Optional[List[TwinMerge]] = None,
                      outputs_kept_distinct: Optional[List[str]] = None) -> InductorPassSet:
    """The Inductor passes a ``build`` needs, scoped to the compile that installs them.

    ``capture_pass``: the ``AuxCapturePass`` of a ``WHOLE_GRAPH`` build (default: one with
    the cost model on); ``twin_merges`` / ``outputs_kept_distinct``: lists the twins pass and
    the distinct-outputs pass append what they did to (a backend's records).
    """
    if not isinstance(build, Build):
        raise TypeError(f"build must be a compile_pass.inductor_pass.Build, got {build!r}")
    if capture_pass is not None and build is not Build.WHOLE_GRAPH:
        raise ValueError(f"capture_pass is for Build.WHOLE_GRAPH, not {build}")
    post: Optional[CustomGraphPass] = None
    if build is Build.WHOLE_GRAPH:
        post = capture_pass if capture_pass is not None else AuxCapturePass()
    elif build is Build.PIECES:
        post = PieceWritesPass()
    twins = None if build is Build.PASS_OFF else CaptureTwinsPass(twin_merges)
    return InductorPassSet(build, ReturnedCopiesPass(), twins, post,
                           DistinctOutputsPass(outputs_kept_distinct))


def chain_post_grad_passes(existing: Optional[Callable[[fx.Graph], None]],
                           capture_pass: CustomGraphPass) -> CustomGraphPass:
    """``capture_pass`` after a post-grad pass the user already configured (if any)."""
    if existing is None:
        return capture_pass
    return _ChainedPass(existing, capture_pass)
