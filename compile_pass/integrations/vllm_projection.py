"""vLLM: the draft's input projection accumulated as the target captures (opt-in).

With ``COMPILE_PASS_VLLM_PROJECT=1`` (beside ``COMPILE_PASS_VLLM=1``) the vLLM plugin takes
the draft's combine (``combine_hidden_states``: optional ``input_norm`` when
``norm_before_fc``, optional one ``fc_norm`` per capture, then ``fc``) when the draft model
is built, and registers it as ``compile_pass.draft_registry`` draft ``"vllm-draft"``. Then:

- compiled targets: the capture rewrite before vLLM's split (``rewrite_graph(...,
  project_outputs="vllm-draft")``) makes the graph return the projected ``[T, H_draft]`` in
  the captures' first place and ``[T, 0]`` stand-ins at the others; each capture is
  projected into it where it is made (``compile_pass::project_registered_``), in whichever
  piece that is. FULL CUDA graphs then keep one ``[max_tokens, H_draft]`` static buffer
  (``persistent_like`` of each output) where they kept K ``[max_tokens, H]``;
- uncompiled targets: ``EagleModelMixin._maybe_add_hidden_state`` projects each capture
  into a ``ProjectingAccumulator`` (the list holds the finished projection and stand-ins);
- the speculators' ``torch.cat(aux, dim=-1)`` of a projection and its stand-ins is the
  projection itself, and the draft's ``combine_hidden_states`` passes an input already
  ``H_draft`` wide straight on (``fc`` is not applied twice); DFlash's FULL-graph staging
  buffer (``_aux_staging``) is ``[rows, H_draft]``.

Eagle3 drafts (Llama, Qwen3, DeepSeek) and the Qwen3 DFlash draft are recognised. Tensor
parallel: vLLM's Eagle3 and DFlash ``fc`` are ``ReplicatedLinear`` and the captures are the
all-reduced hidden states, so every rank projects in full, as the draft would. A draft
whose layout is not recognised (a quantized ``fc``, a norm that is not an RMSNorm, Laguna's
DFlash with its own per-slice norms) is named in a warning and the captures are packed as
without the option. Opt-in: the draft's input is K rounded partial products summed
instead of one GEMM (docs/projection.md and docs/vllm.md measure it).
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch

from compile_pass import draft_registry
from compile_pass.integrations.draft_layout import not_rms_norm, plain_fc
from compile_pass.integrations.seams import (Patch, Seam, SeamAbsent, attribute, import_module, params,
                                             require, source_of)
from compile_pass.packer import AuxCaptureError
from compile_pass.projection import DraftProjection, ProjectingAccumulator

__all__ = ["ENV_PROJECT", "DRAFT_NAME", "enabled_by_env", "projection_of", "register_draft", "draft_name",
           "accumulator_for", "is_projection", "clear", "PROJECTION_SEAMS"]

logger = logging.getLogger("compile_pass.vllm")

ENV_PROJECT = "COMPILE_PASS_VLLM_PROJECT"
#: the name compiled graphs use for vLLM's draft (``compile_pass.draft_registry``)
DRAFT_NAME = "vllm-draft"

_OWNER: Optional[weakref.ref] = None


def enabled_by_env() -> bool:
    return os.environ.get(ENV_PROJECT, "").strip().lower() in ("1", "true", "yes", "on")


def projection_of(draft: Any) -> Tuple[Optional[Callable[[int], DraftProjection]], str]:
    """``resolve(K) -> DraftProjection`` for a vLLM Eagle3 / DFlash draft (``draft.model``
    holds ``fc`` and its norms; read at every call, so weights loaded later are used), or
    (None, why its layout is not recognised)."""
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
    before = inner.input_norm if getattr(inner, "norm_before_fc", False) else None
    chunks = list(inner.fc_norm) if getattr(inner, "fc_norm", None) is not None else None
    why = not_rms_norm([before, *(chunks or [])])
    if why:
        return None, f"{name}: {why}"

    def resolve(num_captures: int) -> DraftProjection:
        weight, bias, why = plain_fc(inner.fc)
        if weight is None:
            raise AuxCaptureError(f"{name}: {why}")
        return DraftProjection.build(num_captures, weight, fc_bias=bias, norm_before_fc=before, fc_norms=chunks)

    return resolve, ""


def register_draft(draft: Any) -> bool:
    """Take ``draft``'s input projection; True if taken. One that does not fit is named in a
    warning and the captures stay packed."""
    global _OWNER
    resolve, why = projection_of(draft)
    if resolve is None:
        clear()
        msg = f"compile_pass vLLM plugin: {why}: the draft's input is packed as without {ENV_PROJECT}"
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return False
    owner = f"{type(draft).__module__}.{type(draft).__qualname__}"
    draft_registry.register(DRAFT_NAME, owner, resolve)
    _OWNER = weakref.ref(draft)
    weight = _fc_weight()
    logger.info("compile_pass vLLM plugin: draft %s registered: each capture projected into [T, %s]",
                owner, weight.shape[0] if weight is not None else "?")
    return True


def _owner() -> Any:
    return _OWNER() if _OWNER is not None else None


def draft_name() -> Optional[str]:
    """The registered draft's name while one is registered (what the rewrite projects into)."""
    return DRAFT_NAME if _owner() is not None and DRAFT_NAME in draft_registry.registered_names() else None


def clear() -> None:
    global _OWNER
    _OWNER = None
    draft_registry.unregister(DRAFT_NAME)


def accumulator_for(num_captures: int, first: torch.Tensor) -> Tuple[Optional[ProjectingAccumulator], str]:
    """An eager accumulator for a forward capturing ``num_captures`` tensors like ``first``,
    or (None, why not)."""
    if draft_name() is None:
        return None, "no draft registered"
    draft = draft_registry.lookup(DRAFT_NAME)
    signature, why = draft.fits(num_captures, first.shape[-1], first.dtype, first.device)
    if signature is None:
        return None, why
    p = draft.projection(num_captures)
    return ProjectingAccumulator(num_captures, p.weight, fc_bias=p.bias, norm_before_fc=p.norm_before_fc,
                                 fc_norms=p.fc_norms), ""


def _fc_weight() -> Optional[torch.Tensor]:
    """The registered draft's ``fc`` weight now (None: no draft, or no 2-D weight)."""
    weight = getattr(getattr(getattr(_owner(), "model", None), "fc", None), "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def is_projection(t: Any) -> bool:
    """Whether ``t`` is ``[*, H_draft]`` of the registered draft (not its ``K*H`` input)."""
    weight = _fc_weight()
    if weight is None or not isinstance(t, torch.Tensor) or t.dim() < 1:
        return False
    return t.shape[-1] == weight.shape[0] != weight.shape[1]


# ---------------------------------------------------------------- the seams' wrappers
def _register_after_init(original: Callable) -> Callable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            register_draft(self)
        except Exception as e:  # noqa: BLE001  never a broken draft: its input stays packed
            clear()
            logger.warning("compile_pass vLLM plugin: reading the draft's input projection failed (%s: %s); "
                           "its input is packed", type(e).__name__, e)

    __init__.__wrapped__ = original
    return __init__


def _combine_passes_projection(original: Callable) -> Callable:
    def combine_hidden_states(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self is _owner() and not args and not kwargs and is_projection(hidden_states):
            return hidden_states  # projected as it was captured: fc (and its norms) already applied
        return original(self, hidden_states, *args, **kwargs)

    combine_hidden_states.__wrapped__ = original
    return combine_hidden_states


class _ProjectedStaging:
    """Data descriptor for ``DFlashSpeculator._aux_staging`` (the FULL graph's fixed-address
    ``[rows, K*H]`` copy of the captures): while a draft is registered it is ``[rows,
    H_draft]``, what the speculator's ``cat(..., out=)`` of a projection writes."""

    name = "_aux_staging"

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        staging = obj.__dict__.get(self.name)
        weight = _fc_weight()
        if isinstance(staging, torch.Tensor) and weight is not None:
            if staging.shape[-1] == weight.shape[1] != weight.shape[0]:
                staging = staging.new_zeros((*staging.shape[:-1], weight.shape[0]))
                obj.__dict__[self.name] = staging
        return staging

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


#: the draft classes whose combine the plugin takes: (module, class, optional)
DRAFT_CLASSES = (
    ("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM", False),
    ("vllm.model_executor.models.qwen3_eagle3", "Eagle3Qwen3ForCausalLM", True),
    ("vllm.model_executor.models.deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM", True),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM", True),
    ("vllm.model_executor.models.laguna_dflash", "DFlashLagunaForCausalLM", True),
)


def _locate_draft_class(module_name: str, class_name: str, optional: bool) -> Callable[[], List[Patch]]:
    def locate() -> List[Patch]:
        cls = attribute(import_module(module_name, absent_ok=optional), class_name)
        combine = attribute(cls, "combine_hidden_states")
        require(params(combine)[:2] == ["self", "hidden_states"],
                f"{class_name}.combine_hidden_states{params(combine)} (expected (self, hidden_states))")
        require("self.model.fc(" in source_of(combine),
                f"{class_name}.combine_hidden_states no longer applies self.model.fc")
        return [Patch(cls, "__init__", _register_after_init(cls.__init__)),
                Patch(cls, "combine_hidden_states", _combine_passes_projection(combine))]

    return locate


def _locate_dflash_staging() -> List[Patch]:
    spec = attribute(import_module("vllm.v1.worker.gpu.spec_decode.dflash.speculator", absent_ok=True),
                     "DFlashSpeculator")
    if "_aux_staging" not in source_of(spec):
        raise SeamAbsent("this DFlashSpeculator stages no captures for FULL graphs (no _aux_staging)")
    require("self._aux_staging = torch.zeros(" in source_of(spec.__init__),
            "DFlashSpeculator.__init__ no longer allocates self._aux_staging")
    require("out=self._aux_staging[" in source_of(spec), "DFlashSpeculator no longer stages the captures "
                                                          "with cat(..., out=self._aux_staging[...])")
    return [Patch(spec, "_aux_staging", _ProjectedStaging())]


#: the projection's seams (``COMPILE_PASS_VLLM_PROJECT=1``), probed only then
PROJECTION_SEAMS: List[Seam] = [
    *[Seam(f"{module}.{cls}.combine_hidden_states",
           change="the draft's combine registered when it is built; an input already H_draft wide passed on",
           reason="vLLM has no hook that hands a draft's fc to the target's capture",
           locate=_locate_draft_class(module, cls, optional), optional=optional,
           upstream="")
      for module, cls, optional in DRAFT_CLASSES],
    Seam("vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator._aux_staging",
         change="a descriptor: the FULL graph's staging buffer is [rows, H_draft] while a draft is registered",
         reason="the buffer is allocated inside __init__", locate=_locate_dflash_staging, optional=True,
         upstream=""),
]
