"""The ``aux_capture`` torch.compile backend: the capture pass in front of an inner compiler.

Where the pass runs depends on the inner, because a rewrite into in-place slice writes
must land where nothing functionalizes the graph again (docs/design.md):

| inner        | graph rewritten                                 | then                          |
|--------------|-------------------------------------------------|-------------------------------|
| ``eager``    | the Dynamo graph                                | runs as is                    |
| ``aot_eager``| the functional aten graph after AOTAutograd     | runs as is                    |
| ``inductor`` | a working copy of the Dynamo graph, packed      | AOTAutograd, then Inductor    |
|              | buffers lifted to inputs this callable allocates| with ``CaptureTwinsPass`` first|
| ``inductor`` + CUDA graphs, or captures that    | Inductor's post-grad graph     |
|   require grad | (``AuxCapturePass``)                          | lowered by Inductor           |
| a callable   | the Dynamo graph, custom-op writes              | the callable                  |

Under Inductor a packed buffer allocated inside the graph changes Inductor's own buffer
reuse (measured worse), so it is lifted out (``lift.py``); capture twins are merged before
Inductor's pattern passes, so the model compiles as without captures (``twins.py``). A
user's own post-grad pre and post passes keep running: ours are chained after them.

With ``split_ops`` the pass runs on the whole Dynamo graph (custom-op writes) and each
piece goes to the inner; Inductor pieces get ``PieceWritesPass`` and take their inputs
boxed (``piecewise.PieceRunner``). Every Inductor graph, the pass on or off, gets
``ReturnedCopiesPass`` (joint graph) and ends with ``DistinctOutputsPass``: Inductor would
otherwise return a mutated residual itself for its ``clone()`` (a piece's input that the
next piece mutates; ``distinct_outputs.py``).

``options={"rewrite": False}`` compiles exactly the same way with the pass off.

CUDA graphs: the inductor inner with ``mode="reduce-overhead"`` (Inductor's cudagraph trees
run the rewritten graph), or ``compile_pass.cudagraph.CudaGraphRunner`` around any compiled
model (one graph per token count, one memory pool, one static packed buffer). There
is no ``cudagraphs`` inner: it was removed (see ``REMOVED_INNERS``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.fx as fx

from torch._dynamo.utils import counters

from compile_pass.capture_pass import run_capture_pass
from compile_pass.result import PassResult
from compile_pass.reinplace import reinplace_slice_writes
from compile_pass.split import SplitGraph, check_split_ops, split_graph

if TYPE_CHECKING:
    from compile_pass.inductor_pass import AuxCapturePass
    from compile_pass.twins import TwinMerge

__all__ = ["AuxCaptureBackend", "aux_capture", "aux_capture_backend", "INNERS", "MODES", "REMOVED_INNERS"]

INNERS = ("inductor", "aot_eager", "eager")
#: inner names that existed once, with why they are gone and what to use instead
REMOVED_INNERS = {
    "cudagraphs": (
        "inner='cudagraphs' was removed from aux_capture: it captured the graph at compile "
        "time, on the fake tensors AOTAutograd compiles with, and copied inputs and outputs, "
        "so writes into a static buffer (aux_out) went to private copies. For CUDA graphs use "
        "the inductor inner with mode='reduce-overhead' (Inductor's cudagraph trees run the "
        "rewritten graph), or compile with inner='eager' / 'inductor' and capture the compiled "
        "model with compile_pass.cudagraph.CudaGraphRunner (one graph per token count, one "
        "memory pool, one static packed buffer; docs/cuda-graphs.md)"
    ),
}
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite")
_BACKEND_KEYS = ("inner", "rewrite", "cost_model", "pack_outputs", "split_ops", "keep_code_before",
                 "fuse_projection", "project_outputs")

CompiledFn = Callable[..., Any]
Inner = Union[str, Callable[[fx.GraphModule, List[torch.Tensor]], CompiledFn]]


def _inductor_config_keys() -> frozenset:
    import torch._inductor.config as inductor_config

    return frozenset(inductor_config.get_config_copy())


@dataclass
class AuxCaptureBackend:
    """A torch.compile backend; keeps the pass result of every graph it compiled.

    ``results`` lists one ``PassResult`` per rewritten graph, in compile order: the
    graph code before and after and every capture group's decision.
    """

    inner: Inner = "inductor"
    rewrite: bool = True
    cost_model: bool = True
    mode: Optional[str] = None
    inductor_options: Dict[str, Any] = field(default_factory=dict)
    pack_outputs: bool = False
    split_ops: Sequence[str] = ()
    #: generate each result's code before the rewrite (``PassResult.code_before``); off, a
    #: rewritten graph's code before reads ``CODE_NOT_KEPT``: on a 61-layer graph the text
    #: costs more than the pass (docs/scale.md section 4). The diff tool and ``TORCH_TRACE``
    #: keep it whatever this says.
    keep_code_before: bool = False
    #: opt-in: a concat the draft's fc alone reads becomes one [*, H_draft] accumulator each
    #: capture is projected into (``fuse_projection.py``; changes the draft input's rounding)
    fuse_projection: bool = False
    #: opt-in: the name of a registered draft (``compile_pass.draft_registry``): returned
    #: captures that fit it are returned as its projected input (implies ``pack_outputs``)
    project_outputs: Optional[str] = None
    results: List[PassResult] = field(default_factory=list)
    #: one entry per split graph compiled: (compute pieces, split-op calls)
    splits: List[SplitGraph] = field(default_factory=list)
    #: captures merged with their twins by Inductor's pre pass (``CaptureTwinsPass``)
    twin_merges: List["TwinMerge"] = field(default_factory=list)
    #: outputs Inductor would have returned as a mutated graph input, returned as copies
    #: instead (``DistinctOutputsPass``, every Inductor graph, the pass on or off)
    outputs_kept_distinct: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.inner, str) and self.inner in REMOVED_INNERS:
            raise ValueError(REMOVED_INNERS[self.inner])
        if isinstance(self.inner, str) and self.inner not in INNERS:
            raise ValueError(
                f"unknown inner compiler {self.inner!r} for aux_capture: "
                f"expected one of {', '.join(INNERS)} or a backend callable"
            )
        if not isinstance(self.inner, str) and not callable(self.inner):
            raise TypeError(f"inner must be a name or a callable, got {type(self.inner).__name__}")
        self.split_ops = check_split_ops(self.split_ops)
        if self.project_outputs is not None:
            if not isinstance(self.project_outputs, str) or not self.project_outputs:
                raise TypeError(f"option 'project_outputs' must be a registered draft's name, got "
                                f"{self.project_outputs!r}")
            self.pack_outputs = True
        for name in ("rewrite", "cost_model", "pack_outputs", "keep_code_before", "fuse_projection"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"option {name!r} must be a bool, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise ValueError(
                f"unknown mode {self.mode!r} for aux_capture: expected one of "
                f"{', '.join(str(m) for m in MODES[1:])}"
            )
        if self.inner != "inductor":
            if self.mode not in (None, "default"):
                raise ValueError(f"mode={self.mode!r} applies to the inductor inner only, "
                                 f"not to inner={self._inner_name}")
            if self.inductor_options:
                raise ValueError(
                    f"Inductor options {sorted(self.inductor_options)} apply to the inductor "
                    f"inner only, not to inner={self._inner_name}"
                )
        else:
            from torch._inductor import list_mode_options

            if self.mode not in (None, "default") and self.mode not in list_mode_options():
                raise ValueError(f"mode={self.mode!r} needs a newer torch: torch {torch.__version__}'s "
                                 f"Inductor modes are {', '.join(list_mode_options())}")
            unknown = sorted(set(self.inductor_options) - _inductor_config_keys())
            if unknown:
                raise ValueError(
                    f"unknown option(s) {unknown} for aux_capture: backend options are "
                    f"{', '.join(_BACKEND_KEYS)}; any other key must be a torch._inductor.config name"
                )

    @property
    def _inner_name(self) -> str:
        return self.inner if isinstance(self.inner, str) else getattr(self.inner, "__name__", "callable")

    #: whole-graph memory timelines in every PassResult (the diff tool turns it on)
    _estimate = False

    @property
    def _keep_code(self) -> bool:
        return self.keep_code_before or self._estimate or bool(os.environ.get("TORCH_TRACE"))

    def _on_result(self, result: PassResult, graph: fx.Graph) -> None:
        """Called with each graph's pass result (already in ``results``); a hook for
        subclasses that keep more about the rewritten ``graph``."""

    def _rewrite(self, gm: fx.GraphModule, target: str, concat: bool = True,
                 pack_outputs: bool = False) -> Optional[PassResult]:
        if not self.rewrite:
            return None
        result = run_capture_pass(gm, target, estimate=self._estimate, cost_model=self.cost_model,
                                  concat=concat, pack_outputs=pack_outputs,
                                  keep_code_before=self._keep_code, fuse_projection=self.fuse_projection,
                                  project_outputs=self.project_outputs)
        self.results.append(result)
        self._on_result(result, gm.graph)
        return result

    def _capture_pass(self) -> "AuxCapturePass":
        """The post-grad pass the inductor inner runs, filling ``results`` as ``_rewrite`` does."""
        from compile_pass.inductor_pass import AuxCapturePass

        return AuxCapturePass(cost_model=self.cost_model, results=self.results,
                              estimate=self._estimate, on_result=self._on_result,
                              keep_code_before=self._keep_code, fuse_projection=self.fuse_projection)

    def __call__(self, gm: fx.GraphModule, example_inputs: List[torch.Tensor]) -> CompiledFn:
        from compile_pass.compat import warn_once_if_unsupported

        if self.rewrite and not warn_once_if_unsupported():
            counters["aux_capture"]["unsupported_torch"] += 1
            return self._without_pass()(gm, example_inputs)
        if self.rewrite and self.inner == "inductor" and not self._post_grad_passes_run():
            counters["aux_capture"]["post_grad_passes_off"] += 1
            _warn_post_grad_passes_off()
            return self._without_pass()(gm, example_inputs)
        if self.split_ops:
            return self._compile_split(gm, example_inputs)
        if self.inner == "eager":
            self._rewrite(gm, "dynamo", pack_outputs=self.pack_outputs)
            return gm.forward
        if not isinstance(self.inner, str):
            self._rewrite(gm, "dynamo_functional", pack_outputs=self.pack_outputs)
            return self.inner(gm, example_inputs)
        if self.inner == "inductor" and not self._inductor_cudagraphs():
            return self._compile_inductor_lifted(gm, example_inputs)
        if self.pack_outputs:
            # returned captures become slices of one buffer before AOTAutograd (it would
            # keep training graphs' saved tensors among the outputs); concats are rewritten
            # later, where the inner's own graph is final
            self._rewrite(gm, "dynamo_functional", concat=False, pack_outputs=True)
        return self._compile_piece(gm, example_inputs, rewrite_inside=True)

    def _without_pass(self) -> "AuxCaptureBackend":
        """The same compile with the pass off: what ``rewrite=False`` compiles."""
        return dataclasses.replace(self, rewrite=False, results=[], splits=[], twin_merges=[],
                                   outputs_kept_distinct=[])

    def _post_grad_passes_run(self) -> bool:
        """Whether Inductor will run its post-grad and joint-graph passes for this compile
        (``use_post_grad_passes`` / ``use_joint_graph_passes``, torch >= 2.15: off in lite
        mode, ``mode="lite"`` or ``TORCHINDUCTOR_LITE_MODE=1``)."""
        import torch._inductor.config as inductor_config

        patches = self._inductor_patches()
        return all(patches.get(key, getattr(inductor_config, key, True))
                   for key in ("use_post_grad_passes", "use_joint_graph_passes"))

    def _inductor_patches(self) -> Dict[str, Any]:
        """Inductor config for this compile: the mode's options, then the user's."""
        from torch._inductor import list_mode_options

        patches = dict(list_mode_options(self.mode)) if self.mode not in (None, "default") else {}
        patches.update(self.inductor_options)
        return patches

    def _inductor_cudagraphs(self) -> bool:
        import torch._inductor.config as inductor_config

        return bool(self._inductor_patches().get("triton.cudagraphs", inductor_config.triton.cudagraphs))

    def _compile_inductor_lifted(self, gm: fx.GraphModule, example_inputs: List[Any]) -> CompiledFn:
        """The inductor inner: a working copy of the Dynamo graph rewritten with its packed
        buffers lifted to inputs this callable allocates (``lift.py``), then compiled by
        Inductor with ``CaptureTwinsPass`` first. Captures that require grad cannot be
        written before AOTAutograd: their groups are left for ``AuxCapturePass`` after it.
        If the pass fails, Dynamo's graph is compiled as it is."""
        from compile_pass.lift import WithLiftedBuffers, copy_module

        if not self.rewrite:
            return self._compile_inductor(gm, example_inputs, rewrite_inside=False)
        work = copy_module(gm)
        result = run_capture_pass(work, "dynamo_lifted", estimate=self._estimate,
                                  cost_model=self.cost_model, pack_outputs=self.pack_outputs,
                                  keep_code_before=self._keep_code, fuse_projection=self.fuse_projection,
                                  project_outputs=self.project_outputs)
        # no ``original=gm.graph``: Dynamo owns its graph and may empty it once the backend
        # returns (a restarted analysis did), so the code before, if kept, is from the copy
        self.results.append(result)
        self._on_result(result, work.graph)
        if result.error is not None:
            return self._compile_inductor(gm, example_inputs, rewrite_inside=False)
        after_aot = any(g.packed_value is not None and g.packed_value.requires_grad
                        for g in result.groups)
        lifted = result.lifted
        inputs = list(example_inputs)
        if lifted is not None:
            placeholders = [n for n in work.graph.nodes if n.op == "placeholder"]
            inputs += [n.meta["example_value"] for n in placeholders[lifted.num_inputs:]]
        compiled = self._compile_inductor(work, inputs, rewrite_inside=after_aot)
        return WithLiftedBuffers(compiled, lifted) if lifted is not None else compiled

    def _compile_piece(self, gm: fx.GraphModule, example_inputs: List[Any],
                       rewrite_inside: bool) -> CompiledFn:
        """``gm`` compiled by the inner; ``rewrite_inside``: the inner's own graph is rewritten."""
        if self.inner == "eager":
            return gm.forward
        if self.inner == "aot_eager":
            return self._compile_aot(gm, example_inputs, rewrite_inside)
        if self.inner == "inductor":
            return self._compile_inductor(gm, example_inputs, rewrite_inside)
        return self.inner(gm, example_inputs)

    def _compile_split(self, gm: fx.GraphModule, example_inputs: List[Any]) -> CompiledFn:
        """Rewrite the whole Dynamo graph, split it at ``split_ops``, compile each piece.

        The rewrite comes first so that a buffer allocated in one piece is written by
        ``write_slice_`` calls in later pieces; the pieces' compilers keep those writes.
        Returns a ``PieceRunner``: it drops each value before the piece that reads it last.
        """
        from compile_pass.piecewise import compile_pieces, fake_inputs

        inputs = fake_inputs(example_inputs)
        runs_as_is = self.inner == "eager"
        self._rewrite(gm, "dynamo" if runs_as_is else "dynamo_functional",
                      pack_outputs=self.pack_outputs)
        split = split_graph(gm, self.split_ops)
        self.splits.append(split)
        counters["aux_capture"]["split_graphs"] += 1
        counters["aux_capture"]["pieces"] += split.num_pieces
        counters["aux_capture"]["split_op_calls"] += len(split.op_pieces)
        return compile_pieces(split, inputs, self._compile_split_piece)

    def _compile_split_piece(self, piece: fx.GraphModule, example_inputs: List[Any]) -> Any:
        """One compute piece of a split graph: its writes were put in on the Dynamo graph.
        Under Inductor the piece is compiled to take its inputs boxed (``BoxedCall``), so
        it frees each input after its last use instead of when the piece returns."""
        if self.inner == "inductor":
            return self._compile_inductor(piece, example_inputs, rewrite_inside=False, boxed=True,
                                          piece=True)
        return self._compile_piece(piece, example_inputs, rewrite_inside=False)

    def _compile_inductor(self, gm: fx.GraphModule, example_inputs: List[torch.Tensor],
                          rewrite_inside: bool = True, boxed: bool = False,
                          piece: bool = False) -> Any:
        """``gm`` compiled by Inductor, captures merged with their twins first
        (``CaptureTwinsPass``). ``rewrite_inside``: the pass runs on Inductor's post-grad
        graph; ``piece``: writes put in on the Dynamo graph of a split graph get
        ``PieceWritesPass``. ``boxed``: return a ``BoxedCall`` (see ``piecewise``)."""
        from torch._inductor.compile_fx import compile_fx

        from compile_pass.inductor_pass import Build, inductor_pass_set
        from compile_pass.piecewise import BoxedCall

        if not self.rewrite:
            build = Build.PASS_OFF
        elif rewrite_inside:
            build = Build.WHOLE_GRAPH
        else:
            build = Build.PIECES if piece else Build.REWRITTEN
        passes = inductor_pass_set(build, twin_merges=self.twin_merges,
                                   outputs_kept_distinct=self.outputs_kept_distinct,
                                   capture_pass=self._capture_pass() if build is Build.WHOLE_GRAPH else None)
        patches = passes.config_patches(self._inductor_patches())
        if not rewrite_inside and "allow_buffer_reuse" not in self.inductor_options and holds_accumulator(gm):
            patches["allow_buffer_reuse"] = False
            logging.getLogger("compile_pass").debug(
                "compile_pass: Inductor's buffer reuse off for a graph holding a draft's accumulator")
        if not boxed:
            return compile_fx(gm, example_inputs, config_patches=patches)
        from torch._dynamo.utils import GmWrapper

        # AOTAutograd gives a module wrapped this way the boxed calling convention
        return BoxedCall(compile_fx(GmWrapper(gm, _inputs_as_given), example_inputs,
                                    config_patches=patches))

    def _compile_aot(self, gm: fx.GraphModule, example_inputs: List[torch.Tensor],
                     rewrite_inside: bool = True) -> CompiledFn:
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def forward_compiler(aot_gm: fx.GraphModule, aot_inputs: Sequence[Any]) -> CompiledFn:
            # writes a Dynamo-graph rewrite put in were functionalized: in place again
            if reinplace_slice_writes(aot_gm.graph):
                aot_gm.recompile()
            if rewrite_inside:
                self._rewrite(aot_gm, "aot")
            return make_boxed_func(aot_gm.forward)

        def backward_compiler(aot_gm: fx.GraphModule, aot_inputs: Sequence[Any]) -> CompiledFn:
            return make_boxed_func(aot_gm.forward)

        return aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def holds_accumulator(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` projects captures into a draft's accumulator: one of our ops mutates one
    (``ops.MUTATED_ARG``; ``fuse_projection`` and ``project_outputs`` put them in).

    Such a graph is compiled with Inductor's ``allow_buffer_reuse`` off (unless the user set
    it). Inductor hands a freed buffer to a later allocation of its size only where its own
    peak estimate has room over the range between; the accumulator, live from the first
    capture to the end, raises that estimate, and the room it then finds is often inside an
    opaque kernel whose temporaries the estimate never sees (attention), where the real peak
    is. Measured on vLLM's one graph (benchmarks/vllm_projection.py, docs/vllm.md): a
    ``[T, H]`` buffer held across attention calls, 0.500 of the packed bytes where the floor
    is 0.250. Without reuse every buffer is freed at its last use, so no value lives longer
    than in the graph without captures."""
    import compile_pass.draft_registry  # noqa: F401  (declares project_registered_'s mutation)
    from compile_pass.ops import MUTATED_ARG

    return any(node.op == "call_function" and MUTATED_ARG.get(node.target) in ("acc", "sumsq")
               for node in gm.graph.nodes)


_post_grad_off_warned: List[bool] = []


def _warn_post_grad_passes_off() -> None:
    """Once per process: Inductor's post-grad passes are off, so is the capture pass."""
    if _post_grad_off_warned:
        return
    _post_grad_off_warned.append(True)
    message = ("compile_pass: Inductor's post-grad and joint-graph passes are off for this compile "
               "(lite mode: torch.compile(mode='lite') or TORCHINDUCTOR_LITE_MODE=1, or "
               "use_post_grad_passes / use_joint_graph_passes set False). The capture pass needs "
               "them, so it is off: compiled as with options={'rewrite': False}, and the captures "
               "take the list path's memory.")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    logging.getLogger("compile_pass").warning(message)


def _inputs_as_given(args: List[Any]) -> List[Any]:
    """The identity ``GmWrapper`` unflattens a boxed piece's flat inputs with."""
    return args


def aux_capture_backend(inner: Inner = "inductor", *, rewrite: bool = True, cost_model: bool = True,
                        mode: Optional[str] = None, pack_outputs: bool = False,
                        split_ops: Sequence[str] = (), keep_code_before: bool = False,
                        fuse_projection: bool = False, project_outputs: Optional[str] = None,
                        **inductor_options: Any) -> AuxCaptureBackend:
    """The backend as a callable: ``torch.compile(m, backend=aux_capture_backend(inner="eager"))``.

    ``rewrite=False``: the same compile with the pass off. ``cost_model=False``: rewrite
    every group that can be rewritten, even where the estimated peak does not drop.
    ``pack_outputs=True``: captures the graph returns become adjacent slices of one
    buffer (``pack_aux_hidden_states`` then takes it without a copy).
    ``split_ops=["ns::op", ...]``: piecewise graphs split at those ops.
    ``keep_code_before=True``: each result keeps the graph's code before the rewrite.
    ``fuse_projection=True`` (opt-in, changes rounding): a concat the draft's ``fc`` alone
    reads is projected per capture into one ``[*, H_draft]`` accumulator.
    ``project_outputs="name"`` (opt-in, changes rounding): returned captures that fit the
    draft registered under that name (``compile_pass.draft_registry.register``) are returned
    as its projected input, ``[*, H_draft]`` first and ``[*, 0]`` stand-ins after.
    Other keywords are Inductor config options (inductor inner only).
    """
    return AuxCaptureBackend(inner=inner, rewrite=rewrite, cost_model=cost_model, mode=mode,
                             pack_outputs=pack_outputs, split_ops=split_ops,
                             keep_code_before=keep_code_before, fuse_projection=fuse_projection,
                             project_outputs=project_outputs, inductor_options=dict(inductor_options))


def backend_from_options(mode: Optional[str] = None,
                         options: Optional[Dict[str, Any]] = None) -> AuxCaptureBackend:
    """Build the backend from ``torch.compile``'s ``mode=`` and ``options=``."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    rewrite = options.pop("rewrite", True)
    cost_model = options.pop("cost_model", True)
    pack_outputs = options.pop("pack_outputs", False)
    split_ops = options.pop("split_ops", ())
    keep_code_before = options.pop("keep_code_before", False)
    fuse_projection = options.pop("fuse_projection", False)
    project_outputs = options.pop("project_outputs", None)
    return aux_capture_backend(inner, rewrite=rewrite, cost_model=cost_model, mode=mode,
                               pack_outputs=pack_outputs, split_ops=split_ops,
                               keep_code_before=keep_code_before, fuse_projection=fuse_projection,
                               project_outputs=project_outputs, **options)


def aux_capture(gm: fx.GraphModule, example_inputs: List[torch.Tensor], *,
                mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None) -> CompiledFn:
    """The backend registered as ``"aux_capture"`` (entry point ``torch_dynamo_backends``)."""
    return backend_from_options(mode, options)(gm, example_inputs)


