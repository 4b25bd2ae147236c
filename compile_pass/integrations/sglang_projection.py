"""SGLang: the draft's input projection accumulated as the target captures (opt-in).

With ``COMPILE_PASS_SGLANG_PROJECT=1`` (beside ``COMPILE_PASS_SGLANG=1``) the SGLang plugin
reads the draft's input projection when the draft model is loaded, registers it by name
(``REGISTRY_NAME`` in ``compile_pass.draft_registry``) and, on the target's capturing
forwards, projects each capture into one ``[T, H_draft]`` accumulator instead of packing it
into ``[T, K*H]``: the packing list runs the registered draft's ops
(``project_registered_``; ``finish_registered_`` when handed over) in eager forwards and in
forwards Dynamo traces alike, by the constants of a ``CapturePlan``. The logits processor
then stores the projected tensor where it stored the packed one, and the draft reads it
without projecting again:

- Eagle3 (``llama_eagle3.LlamaModel`` and drafts shaped like it: ``fc``,
  ``num_aux_hidden_states``, optional ``input_norm`` (``norm_before_fc``) or ``fc_norm`` (one
  per capture)): SGLang's draft applies its norms and ``fc`` only when its input's width
  differs from its hidden size, so a projected input passes straight on;
- DFlash (``dflash.DFlashDraftModel``: ``fc``, ``hidden_norm``, ``project_target_hidden``):
  ``project_target_hidden`` is wrapped to apply ``hidden_norm`` alone to an input already
  ``H_draft`` wide (SGLang's own checks and projection for anything else).

Tensor parallelism: SGLang's Eagle3 ``fc`` is an ``nn.Linear`` and DFlash's a replicated
linear; every rank holds the whole weight and the whole (all-reduced) capture, so each rank
projects in full, as the draft would. A draft whose layout is not recognised (a quantized
``fc``, a norm that is not an RMSNorm, a DFlash variant with its own projection) is named
in a warning and the captures are packed as without the option. Opt-in: the draft's input
is K rounded partial products summed instead of one GEMM (docs/projection.md measures it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Tuple

import torch

from compile_pass import draft_registry
from compile_pass.draft_registry import DraftSignature
from compile_pass.errors import AuxCaptureError
from compile_pass.integrations.draft_layout import not_rms_norm, plain_fc
from compile_pass.projection import DraftProjection

__all__ = ["ENV_PROJECT", "REGISTRY_NAME", "enabled_by_env", "DraftInput", "CapturePlan", "draft_input_of",
           "register_draft", "registered", "capture_plan", "clear", "plan_for", "projected_target_hidden",
           "draft_input_width"]

logger = logging.getLogger("compile_pass.sglang")

ENV_PROJECT = "COMPILE_PASS_SGLANG_PROJECT"
#: the name the loaded draft is registered under in ``compile_pass.draft_registry``: the
#: capture ops (``project_registered_``, ``finish_registered_``) read its weights by it
REGISTRY_NAME = "sglang"


def enabled_by_env() -> bool:
    return os.environ.get(ENV_PROJECT, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class DraftInput:
    """What a loaded draft does to the packed captures: ``kind`` (``"eagle3"`` or
    ``"dflash"``), ``owner`` (the module applying it, named in logs) and its projection."""

    kind: str
    owner: str
    projection: DraftProjection

    @property
    def num_captures(self) -> int:
        return self.projection.num_captures

    def plan(self) -> "CapturePlan":
        p = self.projection
        return CapturePlan(REGISTRY_NAME, DraftSignature.of(p).describe(), p.num_captures, p.hidden,
                           p.out_features, p.weight.dtype, p.weight.device, p.norm_before_fc is not None)


class CapturePlan(NamedTuple):
    """Constants by which a capturing forward (eager, or traced by Dynamo, which reads them
    as constants) projects into the registered draft's input: the registry name and the
    signature the capture ops check, K, the capture width, ``H_draft``, dtype, device, and
    whether a sum of squares is kept (a norm over the concat)."""

    draft: str
    signature: str
    num_captures: int
    hidden: int
    out_features: int
    dtype: torch.dtype
    device: torch.device
    sum_squares: bool


_REGISTERED: Optional[DraftInput] = None
_PLAN: Optional[CapturePlan] = None


def draft_input_of(model: Any) -> Tuple[Optional[DraftInput], str]:
    """The draft input projection of a loaded SGLang draft model, or (None, why not)."""
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    eagle = next((m for m in modules if hasattr(m, "fc") and hasattr(m, "num_aux_hidden_states")), None)
    dflash = next((m for m in modules if hasattr(m, "fc") and callable(getattr(m, "project_target_hidden", None))),
                  None)
    if eagle is None and dflash is None:
        return None, f"{type(model).__name__} has no Eagle3 or DFlash input projection (fc) to take"
    owner = eagle if eagle is not None else dflash
    name = f"{type(owner).__module__}.{type(owner).__qualname__}"
    weight, bias, why = plain_fc(owner.fc)
    if weight is None:
        return None, f"{name}: {why}"
    try:
        if eagle is not None:
            k = int(eagle.num_aux_hidden_states)
            norm, chunks = getattr(eagle, "input_norm", None), getattr(eagle, "fc_norm", None)
            why = not_rms_norm([norm, *(chunks or [])])
            if why:
                return None, f"{name}: {why}"
            projection = DraftProjection.build(k, weight, fc_bias=bias, norm_before_fc=norm,
                                               fc_norms=list(chunks) if chunks is not None else None)
            return DraftInput("eagle3", name, projection), ""
        if type(dflash).project_target_hidden.__qualname__.split(".")[0] != "DFlashDraftModel":
            return None, f"{name}: a DFlash variant with a projection of its own (project_target_hidden)"
        k = int(getattr(dflash, "num_context_features", 0))
        return DraftInput("dflash", name, DraftProjection.build(k, weight, fc_bias=bias)), ""
    except (AuxCaptureError, TypeError, ValueError) as e:
        return None, f"{name}: {e}"


def register_draft(model: Any) -> bool:
    """Take the draft's input projection (once its weights are loaded); True if taken. A
    draft that does not fit is named in a warning and the captures stay packed."""
    global _REGISTERED, _PLAN
    found, why = draft_input_of(model)
    if found is None:
        logger.warning("compile_pass SGLang plugin: %s: the draft's input is packed as without %s",
                       why, ENV_PROJECT)
        clear()
        return False
    p = found.projection

    def resolve(num_captures: int) -> DraftProjection:
        # built once from the loaded parameters (a weight update copies into them in place)
        if num_captures != p.num_captures:
            raise AuxCaptureError(f"the draft {found.owner} reads {p.num_captures} captures, not {num_captures}")
        return p

    draft_registry.register(REGISTRY_NAME, found.owner, resolve)
    _REGISTERED, _PLAN = found, found.plan()
    logger.info("compile_pass SGLang plugin: %s draft %s: each capture projected into [T, %d] (K=%d, hidden %d)",
                found.kind, found.owner, p.out_features, p.num_captures, p.hidden)
    return True


def registered() -> Optional[DraftInput]:
    return _REGISTERED


def capture_plan() -> Optional[CapturePlan]:
    """The registered draft's ``CapturePlan``, or None."""
    return _PLAN


def clear() -> None:
    global _REGISTERED, _PLAN
    _REGISTERED = _PLAN = None
    draft_registry.unregister(REGISTRY_NAME)


def plan_for(num_captures: Optional[int], first: torch.Tensor) -> Tuple[Optional[CapturePlan], str]:
    """The plan by which a forward capturing ``num_captures`` tensors like ``first`` (None:
    K not known here, the draft's K is checked when the captures are handed over) projects
    them, or (None, why not: nothing registered, or the registered draft does not fit).
    Pure reads of constants: Dynamo traces it."""
    plan = _PLAN
    if plan is None:
        return None, "no draft registered"
    if num_captures is not None and num_captures != plan.num_captures:
        return None, f"the target captures {num_captures} layers, the draft reads {plan.num_captures}"
    if first.dim() < 1 or first.shape[-1] != plan.hidden or first.dtype != plan.dtype or first.device != plan.device:
        return None, (f"a capture is {tuple(first.shape)} {first.dtype} on {first.device}, the draft's fc reads "
                      f"{plan.num_captures} x {plan.hidden} {plan.dtype} on {plan.device}")
    return plan, ""


def projected_target_hidden(original_fn, self, target_hidden, *args, **kwargs):
    """Around DFlash's ``project_target_hidden``: an input already ``H_draft`` wide (projected
    as it was captured) gets ``hidden_norm`` alone; anything else SGLang's own method."""
    draft = _REGISTERED
    hidden = getattr(getattr(self, "config", None), "hidden_size", None)
    if (draft is not None and draft.kind == "dflash" and isinstance(target_hidden, torch.Tensor)
            and target_hidden.dim() == 2 and target_hidden.shape[-1] == draft.projection.out_features
            and target_hidden.shape[-1] != draft.projection.weight.shape[1] and hidden in (None, target_hidden.shape[-1])):
        return self.hidden_norm(target_hidden)
    return original_fn(self, target_hidden, *args, **kwargs)


def draft_input_width(original_fn, model_runner, *args, **kwargs) -> int:
    """Around ``get_draft_input_from_target_hidden_dim``: the width of what the draft reads
    from the target, by which SGLang's CUDA-graph runners size their static buffers. While
    an Eagle3 draft's input is projected it is ``H_draft``, not ``K*H``."""
    width = original_fn(model_runner, *args, **kwargs)
    draft = _REGISTERED
    if draft is not None and draft.kind == "eagle3" and width == draft.projection.weight.shape[1] \
            and draft.projection.out_features != width:
        return draft.projection.out_features
    return width
