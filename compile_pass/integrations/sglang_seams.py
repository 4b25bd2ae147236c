"""Where the SGLang plugin touches SGLang: its seams, probed before anything is registered.

The plugin changes SGLang only through SGLang's own plugin ``HookRegistry`` (hooks that
replace a class or function, or run around a method), so its seams carry no ``Patch``:
the probe checks that each place exists as the hooks expect, and the plugin registers the
hooks. Two layouts are supported (``layout``):

- ``PACKING_LIST`` (sglang 0.5.23): models capture into ``AuxHiddenStateList`` and the
  logits processor packs with ``pack_aux_hidden_states``; both are replaced (plus the
  plain-``[]`` models' list adoption, ``list_adoption``);
- ``PLAIN_LIST`` (sglang 0.5.14, SpecForge 0.2.0's pin): models append to a plain ``[]``;
  the inner model is compiled with the capture pass under SGLang's piecewise attention
  context, the logits store packs a view (``sglang_compile``).

Either layout needs the hook registry and ``ModelRunner.forward``. A layout whose seams
do not all fit is not used; if neither fits, the plugin stays off and names what moved.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import List, Optional, Sequence

from compile_pass.integrations.seams import (Patch, Probe, Seam, SeamAbsent, attribute, import_module,
                                             probe, require)

__all__ = ["AUX_MODULE", "COMPILE_CONTEXTS", "RUNNER_FORWARD", "LOGITS_STORE", "PIECEWISE_CONTEXT", "PACKING_LIST",
           "PLAIN_LIST", "SEAMS", "TESTED", "is_tested", "layout", "probe_sglang", "sglang_version",
           "warn", "CAPTURE_CONFIG", "RUNNER_LOAD", "LOGITS_FORWARD", "DFLASH_PROJECT", "DRAFT_INPUT_WIDTH", "PROJECTION_SEAMS", "probe_projection"]

logger = logging.getLogger("compile_pass.sglang")

AUX_MODULE = "sglang.srt.layers.aux_hidden_states"
RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
LOGITS_STORE = "sglang.srt.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store"
PIECEWISE_CONTEXT = ("sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph."
                     "context_manager")
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"
#: sets the capture layers on the target model (0.5.23: before any CUDA graph is captured)
CAPTURE_CONFIG = ("sglang.srt.model_executor.model_runner_components.attention_backend_setup."
                  "configure_aux_hidden_state_capture")
#: the context managers inside which ``--enable-torch-compile`` compiles ``model.forward``
#: (0.5.23: the CUDA-graph runners' and the CPU graph runner's ``patch_model``)
COMPILE_CONTEXTS = ("sglang.srt.compilation.torch_compile_decoration.patch_model",
                    "sglang.srt.model_executor.cpu_graph_runner.patch_model")

PACKING_LIST = "AuxHiddenStateList: packed in place"
PLAIN_LIST = "plain list: compiled inner model"

#: SGLang releases the engine tier runs (make sglang: 0.5.23; make specforge: 0.5.14)
TESTED = ("0.5.14", "0.5.23")


def warn(msg: str) -> None:
    """How the SGLang plugin says something went differently: a RuntimeWarning and a log line."""
    warnings.warn(f"compile_pass SGLang plugin: {msg}", RuntimeWarning, stacklevel=3)
    logger.warning(msg)


def sglang_version() -> Optional[str]:
    try:
        import sglang
    except Exception:  # noqa: BLE001
        return None
    return str(getattr(sglang, "__version__", "?"))


def is_tested(version: str) -> bool:
    return version in TESTED


def _locate_registry() -> List[Patch]:
    reg = import_module(HOOK_REGISTRY)
    attribute(reg, "HookRegistry")
    hook_type = attribute(reg, "HookType")
    for kind in ("REPLACE", "AROUND"):
        attribute(hook_type, kind, f"{HOOK_REGISTRY}.HookType.{kind} is missing")
    return []


def _locate_runner_forward() -> List[Patch]:
    runner = attribute(import_module("sglang.srt.model_executor.model_runner"), "ModelRunner")
    require(callable(getattr(runner, "forward", None)), "ModelRunner.forward is missing")
    return []


def _locate_aux_list() -> List[Patch]:
    aux = import_module(AUX_MODULE, absent_ok=True)
    cls = getattr(aux, "AuxHiddenStateList", None)
    cls = getattr(cls, "_cp_original", None) or cls  # already ours: SGLang's is behind it
    require(isinstance(cls, type) and issubclass(cls, list) and callable(getattr(cls, "capture", None)),
            f"{AUX_MODULE}.AuxHiddenStateList is {cls!r}, not a list class with capture()")
    return []


def _locate_pack() -> List[Patch]:
    aux = import_module(AUX_MODULE, absent_ok=True)
    require(callable(getattr(aux, "pack_aux_hidden_states", None)),
            f"{AUX_MODULE}.pack_aux_hidden_states is missing")
    return []


def _locate_compile_context(name: str):
    def locate() -> List[Patch]:
        module_name, attr = name.rsplit(".", 1)
        module = import_module(module_name, absent_ok=True)
        fn = getattr(module, attr, None)
        if fn is None:
            raise SeamAbsent(f"{name} is missing")
        src = getattr(fn, "__wrapped__", fn)
        try:
            body = inspect.getsource(src)
        except (OSError, TypeError):
            body = ""
        require("torch.compile(" in body, f"{name} no longer calls torch.compile")
        return []

    return locate


def _locate_logits_store() -> List[Patch]:
    lp = attribute(import_module("sglang.srt.layers.logits_processor"), "LogitsProcessor")
    require(callable(getattr(lp, "_get_hidden_states_to_store", None)),
            "LogitsProcessor._get_hidden_states_to_store is missing")
    return []


def _locate_piecewise_attention() -> List[Patch]:
    radix = import_module("sglang.srt.layers.radix_attention")
    if getattr(radix, "unified_attention_with_output", None) is None:
        raise SeamAbsent("sglang.srt.layers.radix_attention has no unified_attention_with_output")
    context = import_module(PIECEWISE_CONTEXT, absent_ok=True)
    require(callable(getattr(context, "set_tc_piecewise_forward_context", None)),
            f"{PIECEWISE_CONTEXT}.set_tc_piecewise_forward_context is missing")
    return []


def _locate_callable(path: str, params: Sequence[str] = (), method: bool = True):
    """A locator: ``path`` (``module.Class.method``, or ``module.function`` with
    ``method=False``) exists and takes ``params``."""
    def locate() -> List[Patch]:
        parts = path.rsplit(".", 2 if method else 1)
        owner = import_module(parts[0], absent_ok=True)
        for name in parts[1:-1]:
            owner = attribute(owner, name)
        fn = getattr(owner, parts[-1], None)
        require(callable(fn), f"{path} is missing")
        missing = [p for p in params if p not in inspect.signature(fn).parameters]
        require(not missing, f"{path} takes no {', '.join(missing)}")
        return []

    return locate


SEAMS: List[Seam] = [
    Seam(f"{HOOK_REGISTRY}.HookRegistry", change="",
         reason="official: SGLang's plugin hook registry (REPLACE, AROUND)", locate=_locate_registry),
    Seam(RUNNER_FORWARD, change="an around-hook: K for the packing list, plain-list adoption, "
                                "the compiled inner model (plain-list layout)",
         reason="K is known to the model runner only", locate=_locate_runner_forward),
    Seam(CAPTURE_CONFIG, change="an around-hook: the model it configures to capture is kept (weakly), "
                                "K for the forwards that bypass ModelRunner.forward (CUDA-graph captures)",
         reason="the CUDA-graph runners call model.forward directly", locate=_locate_callable(CAPTURE_CONFIG, ("model",), method=False), optional=True),
    Seam(f"{AUX_MODULE}.AuxHiddenStateList", change="replaced: capture() copies into one packed buffer",
         reason="the list class every 0.5.23 model captures into", locate=_locate_aux_list,
         optional=True),
    Seam(f"{AUX_MODULE}.pack_aux_hidden_states", change="replaced: a view of adjacent slices",
         reason="the logits processor's pack", locate=_locate_pack, optional=True),
    *[Seam(name, change="an around-hook: its context entered inside Inductor config patches holding "
                        "the capture passes, so they apply to --enable-torch-compile's compiles only",
           reason="SGLang compiles model.forward with plain torch.compile inside this context",
           locate=_locate_compile_context(name), optional=True) for name in COMPILE_CONTEXTS],
    Seam(LOGITS_STORE, change="an around-hook: a FULL capture of adjacent slices is a view",
         reason="0.5.14's logits processor concatenates inline", locate=_locate_logits_store,
         optional=True),
    Seam("sglang.srt.layers.radix_attention.unified_attention_with_output + piecewise context",
         change="", reason="official: SGLang's opaque attention op and its piecewise forward "
                           "context, under which the inner model is compiled (plain-list layout)",
         locate=_locate_piecewise_attention, optional=True),
]

RUNNER_LOAD = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
LOGITS_FORWARD = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
DFLASH_PROJECT = "sglang.srt.models.dflash.DFlashDraftModel.project_target_hidden"
DRAFT_INPUT_WIDTH = "sglang.srt.speculative.eagle_utils.get_draft_input_from_target_hidden_dim"


#: the seams of the draft-input projection (COMPILE_PASS_SGLANG_PROJECT=1), probed only then
PROJECTION_SEAMS: List[Seam] = [
    Seam(RUNNER_LOAD, change="an around-hook: a draft worker's loaded model hands its fc (and norms) over",
         reason="the draft's weights exist only once its model runner has loaded them",
         locate=_locate_callable(RUNNER_LOAD)),
    Seam(LOGITS_FORWARD, change="an around-hook: a capture list whose captures were projected is "
                                "replaced by the projected [T, H_draft] tensor",
         reason="the logits processor is where the captures leave the target for the draft",
         locate=_locate_callable(LOGITS_FORWARD, ("aux_hidden_states",))),
    Seam(DFLASH_PROJECT, change="an around-hook: an input already H_draft wide gets hidden_norm alone",
         reason="the DFlash worker projects the target's captures by calling this method",
         locate=_locate_callable(DFLASH_PROJECT, ("target_hidden",)), optional=True),
    Seam(DRAFT_INPUT_WIDTH, change="an around-hook: K*H -> H_draft while an Eagle3 draft's input is projected",
         reason="the draft's CUDA-graph runners size their static hidden-state buffers with it "
                "(draft extend, prefill, multi-layer draft extend)",
         locate=_locate_callable(DRAFT_INPUT_WIDTH, ("model_runner",), method=False), optional=True),
]


def probe_projection() -> List[Probe]:
    """Probe the projection's seams (nothing is registered)."""
    return probe(PROJECTION_SEAMS)


_PACKING = (f"{AUX_MODULE}.AuxHiddenStateList", f"{AUX_MODULE}.pack_aux_hidden_states")
_PLAIN = (LOGITS_STORE, "sglang.srt.layers.radix_attention.unified_attention_with_output + piecewise context")


def probe_sglang() -> List[Probe]:
    """Probe every seam on the installed SGLang (nothing is registered)."""
    return probe(SEAMS)


def layout(probes: Sequence[Probe]) -> Optional[str]:
    """``PACKING_LIST`` or ``PLAIN_LIST`` where that layout's seams and the common ones all
    fit, else None. A packing-list module that exists but differs is never read as the
    plain-list layout."""
    state = {p.seam.name: p.state for p in probes}
    common = [p for p in probes if not p.seam.optional]
    if not all(p.fits for p in common):
        return None
    if all(state.get(name) == "ok" for name in _PACKING):
        return PACKING_LIST
    if all(state.get(name) == "absent" for name in _PACKING) \
            and all(state.get(name) == "ok" for name in _PLAIN):
        return PLAIN_LIST
    return None


def layout_problems(probes: Sequence[Probe]) -> str:
    """What keeps every layout from fitting, one clause per seam."""
    parts = [f"{p.seam.name}: {p.state} ({p.detail})" for p in probes
             if p.state == "moved" or (p.state == "absent" and not p.seam.optional)]
    if not parts:  # every place exists or is absent as allowed, but no layout is complete
        parts = [f"{p.seam.name}: {p.state} ({p.detail})" for p in probes if p.state != "ok"]
    return "; ".join(parts) or "no supported layout"
