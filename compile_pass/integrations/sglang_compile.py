"""SGLang layouts whose models append captures to a plain ``[]`` inside ``forward``
(sglang 0.5.14, the release SpecForge 0.2.0 pins): the compiler way in.

There the model's layer loop builds ``aux_hidden_states = []`` and appends
``hidden_states + residual``; the logits processor's ``_get_hidden_states_to_store`` then runs
``torch.cat(aux_hidden_states, dim=-1)`` (FULL capture: every token), so the K captures and
the packed result are alive together. No class or function holds the list, so nothing can be
swapped eagerly. What this module installs, through SGLang's own ``HookRegistry``:

- an around-hook on ``ModelRunner.forward`` that, the first time an extend batch runs with
  ``capture_aux_hidden_states`` on, replaces the inner model's ``forward`` (``model.model``,
  the module holding ``layers_to_capture``) by ``torch.compile(..., backend="aux_capture",
  options={"pack_outputs": True, "inner": ...})`` called under SGLang's piecewise forward
  context (``set_tc_piecewise_forward_context``): attention then goes through SGLang's opaque
  ``sglang::unified_attention_with_output`` op, as in SGLang's own piecewise CUDA-graph path,
  so the layer loop is one graph and its captures are returned as adjacent slices of one
  ``[tokens, K * hidden]`` buffer, written when each is computed;
- an around-hook on ``LogitsProcessor._get_hidden_states_to_store`` that, for a FULL capture
  whose captures are adjacent slices of one buffer, returns that buffer's view instead of
  SGLang's ``torch.cat`` copy (anything else: SGLang's own code).

Batches SGLang itself compiles or captures (its piecewise CUDA-graph prefill runner, which
sets that context first) and decode batches run SGLang's own path. A compile or run that
fails is a warning naming it; the model's eager ``forward`` is put back and the batch runs
as without the plugin. The inner compiler is ``COMPILE_PASS_SGLANG_INNER`` (default
``inductor``; ``eager`` / ``aot_eager`` for a quick check); ``COMPILE_PASS_SGLANG_REWRITE=0``
compiles the same way with the pass off (an A/B). SGLang registers
``sglang::unified_attention_with_output`` for CUDA, NPU, XPU and MUSA only: on a CPU the op has no kernel, and the compiled forward fails over to eager with
a warning unless a CPU kernel is registered (the tests do it with SGLang's own function).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Callable, List, Optional

import torch

from compile_pass.integrations.sglang_seams import LOGITS_STORE, PIECEWISE_CONTEXT, RUNNER_FORWARD
from compile_pass.integrations.sglang_seams import warn as _warn
from compile_pass.packer import packed_view

__all__ = ["register", "reset", "STATE"]

logger = logging.getLogger("compile_pass.sglang")

ENV_INNER = "COMPILE_PASS_SGLANG_INNER"
ENV_REWRITE = "COMPILE_PASS_SGLANG_REWRITE"

#: what the hooks did: ``compiled`` (inner models compiled), ``failed`` (fell back to eager,
#: with the reason), ``packed`` (FULL packs returned as a view), ``inner``.
STATE: dict = {"compiled": 0, "failed": [], "packed": 0, "inner": None, "rewrite": None}


# ----------------------------------------------------------------------------- logits store

_store_signature: List[inspect.Signature] = []


def _store_hook(original_fn: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``_get_hidden_states_to_store``, a view where a FULL capture's captures are
    adjacent slices of one buffer (``compile_pass.packed_view``); anything else goes to
    SGLang's own code untouched, with no concat made here (one ``[T, K*H]`` at most)."""
    if not torch.compiler.is_compiling():
        try:
            if not _store_signature:
                _store_signature.append(inspect.signature(original_fn))
            bound = _store_signature[0].bind(self, *args, **kwargs).arguments
            aux, mode = bound.get("aux_hidden_states"), bound["logits_metadata"].capture_hidden_mode
            if (isinstance(aux, (list, tuple)) and len(aux) > 1 and mode.need_capture()
                    and mode.is_full() and bound.get("hidden_states_before_norm") is None):
                view = packed_view(list(aux))
                if view is not None:
                    STATE["packed"] += 1
                    return view
        except Exception as e:  # noqa: BLE001 - a layout we did not expect: SGLang's own
            logger.debug("logits store hook fell back to SGLang's: %r", e)
    return original_fn(self, *args, **kwargs)


# ----------------------------------------------------------------------------- compile


def _layer_model(model: Any) -> Optional[torch.nn.Module]:
    """The module whose ``forward`` runs the layer loop and holds ``layers_to_capture``
    (found once per model, then cached on it: the runner hook asks on every extend batch)."""
    cached = model.__dict__.get("_compile_pass_layer_model")
    if cached is not None:
        return cached
    for module in model.modules():
        if "layers_to_capture" in module.__dict__ and hasattr(module, "layers"):
            object.__setattr__(model, "_compile_pass_layer_model", module)
            return module
    return None


def _attention_layers(layer_model: torch.nn.Module) -> List[Any]:
    """Per layer, the attention module SGLang's piecewise context looks up by ``layer_id``."""
    layers = []
    for layer in layer_model.layers:
        attn = getattr(getattr(layer, "self_attn", None), "attn", None)
        layers.append(attn)
    return layers


def _install(runner: Any) -> None:
    """Compile ``runner``'s inner model with the capture pass (once per model)."""
    model = runner.model
    layer_model = _layer_model(model)
    if layer_model is None or getattr(layer_model, "_compile_pass_compiled", False):
        return
    object.__setattr__(layer_model, "_compile_pass_compiled", True)
    attention = _attention_layers(layer_model)
    if not attention or any(a is None for a in attention):
        _warn(f"{type(layer_model).__name__}: not every layer has self_attn.attn; the model "
              f"captures as without the plugin")
        STATE["failed"].append("attention layers not found")
        return
    import importlib

    context = importlib.import_module(PIECEWISE_CONTEXT)
    inner = os.environ.get(ENV_INNER, "inductor")
    rewrite = os.environ.get(ENV_REWRITE, "1").strip().lower() not in ("0", "false", "no", "off")
    STATE.update(inner=inner, rewrite=rewrite)
    eager_forward = layer_model.forward
    object.__setattr__(layer_model, "_compile_pass_eager_forward", eager_forward)
    compiled = torch.compile(eager_forward, backend="aux_capture",
                             options={"inner": inner, "pack_outputs": True, "rewrite": rewrite})
    quant_config = getattr(model, "quant_config", None)
    none_per_layer = [None] * len(attention)

    def forward(input_ids: Any, positions: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if (not forward_batch.forward_mode.is_extend() or torch.compiler.is_compiling()
                or context.get_tc_piecewise_forward_context() is not None):
            # decode; or inside SGLang's own compiled / piecewise CUDA-graph prefill, whose
            # context is set already: SGLang's path, untouched
            return eager_forward(input_ids, positions, forward_batch, *args, **kwargs)
        try:
            with context.set_tc_piecewise_forward_context(forward_batch, attention, quant_config,
                                                          none_per_layer, none_per_layer):
                return compiled(input_ids, positions, forward_batch, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - never stop the engine: eager from here on
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            _warn(f"the compiled {type(layer_model).__name__}.forward failed ({reason}); "
                  f"back to SGLang's eager forward")
            STATE["failed"].append(reason)
            layer_model.forward = eager_forward
            return eager_forward(input_ids, positions, forward_batch, *args, **kwargs)

    layer_model.forward = forward
    STATE["compiled"] += 1
    logger.info("compile_pass: %s.forward compiled with the capture pass (inner %s, "
                "pack_outputs)", type(layer_model).__name__, inner)


def reset(model: torch.nn.Module) -> bool:
    """Put back the eager ``forward`` of ``model``'s inner model (the next capturing extend
    batch compiles it again, with the environment then set); True if it was compiled."""
    layer_model = _layer_model(model)
    if layer_model is None or not getattr(layer_model, "_compile_pass_compiled", False):
        return False
    eager_forward = layer_model.__dict__.pop("_compile_pass_eager_forward", None)
    if eager_forward is not None:
        layer_model.forward = eager_forward
    object.__setattr__(layer_model, "_compile_pass_compiled", False)
    return True


def _runner_forward(original_fn: Callable, self: Any, forward_batch: Any, *args: Any,
                    **kwargs: Any) -> Any:
    try:
        if getattr(self.model, "capture_aux_hidden_states", False) \
                and forward_batch.forward_mode.is_extend():
            _install(self)
    except Exception as e:  # noqa: BLE001
        _warn(f"the capture pass is not installed ({e!r}); SGLang runs as without it")
        STATE["failed"].append(repr(e))
    return original_fn(self, forward_batch, *args, **kwargs)


def register(registry: Any, hook_type: Any) -> None:
    """Register both hooks on SGLang's ``HookRegistry`` (``hook_type``: its ``HookType``)."""
    registry.register(LOGITS_STORE, _store_hook, hook_type.AROUND)
    registry.register(RUNNER_FORWARD, _runner_forward, hook_type.AROUND)
