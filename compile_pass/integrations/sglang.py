"""SGLang plugin: Eagle3/DFlash captures written in place into one packed buffer.

Switched on by the user (SGLang loads every installed ``sglang.srt.plugins`` entry point,
so the plugin itself checks an opt-in)::

    COMPILE_PASS_SGLANG=1 python -m sglang.launch_server ...   # SGLANG_PLUGINS=aux_capture
                                                              # additionally restricts SGLang
                                                              # to this plugin

or, in process (SpecForge's offline capture backend, which builds SGLang's ``ModelRunner``
without running SGLang's plugin loader): ``import compile_pass.integrations.sglang as p;
p.enable()`` before the model runner is created.

What it does (sglang 0.5.23, through SGLang's own ``HookRegistry``):

- replaces ``sglang.srt.layers.aux_hidden_states.AuxHiddenStateList`` (every module that
  imported it) by a subclass of SGLang's class (``_make_list_class``) whose ``capture`` /
  ``append`` copy each capture into its slot of one ``[tokens, K * hidden]`` packer buffer
  and keep the slot (no clone: the copy is the snapshot). K is read from the model's
  ``layers_to_capture`` by an around-hook on ``ModelRunner.forward`` (a context variable,
  never a caller's frame);
- models that append to a plain ``[]`` in ``forward`` (no class to replace): the list is
  adopted from the model's frame at its layer boundaries and its entries moved into one
  buffer (:mod:`compile_pass.integrations.list_adoption`, hooks on the layers of the module
  holding ``layers_to_capture``, active only inside a capturing ``ModelRunner.forward``);
- replaces ``pack_aux_hidden_states`` by one that returns a view when the captures are
  adjacent slices of one buffer (the logits processor's pack), else SGLang's own ``torch.cat``;
- with ``--enable-torch-compile`` (``COMPILE_PASS_SGLANG_COMPILE=1``, default on): an
  around-hook on SGLang's ``patch_model`` (the context inside which it compiles
  ``model.forward`` with plain ``torch.compile``) opens Inductor config patches holding this
  project's whole-graph pass set, chained after the user's passes, for as long as that
  context is open: the twins pass (post-grad pre pass), the capture pass then
  ``DistinctOutputsPass`` (post-grad post pass, last) and ``ReturnedCopiesPass`` (joint-graph
  pre pass); see :func:`compile_config_patch`. Nothing else in the process compiles with them.

On an SGLang without ``AuxHiddenStateList`` (0.5.14, SpecForge 0.2.0's pin: each model
appends to a plain ``[]`` in ``forward``) it installs the compiler way in instead
(:mod:`compile_pass.integrations.sglang_compile`): the inner model compiled with the capture
pass and ``pack_outputs`` on capturing extend batches, the logits processor's FULL pack a view.

Inside a graph Dynamo traces (``--enable-torch-compile``), the list and the pack are SGLang's
(``super()`` calls, which Dynamo traces like SGLang's class; the pack hands SGLang's cat a plain
list, so the cat is in the graph for the capture pass instead of a graph break); with
``COMPILE_PASS_SGLANG_PROJECT`` and a registered draft that fits, the traced list projects as
the eager one does (:mod:`compile_pass.integrations.sglang_projection`).

K for a forward that reaches the model without ``ModelRunner.forward`` (the CUDA-graph
runners' captures call ``model.forward`` themselves): the model that SGLang's
``configure_aux_hidden_state_capture`` set capture layers on (an around-hook keeps it).

Anything unexpected (another SGLang layout, a class that is no list, a capture whose shape
differs, more captures than ``layers_to_capture``) is a warning naming it, and SGLang runs
as without the plugin (a capture falls back to the list's own clone).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
import re
import weakref
from typing import Any, Optional

import torch

from compile_pass.integrations import list_adoption, sglang_projection
from compile_pass.integrations.sglang_seams import (AUX_MODULE, CAPTURE_CONFIG, COMPILE_CONTEXTS, DFLASH_PROJECT, DRAFT_INPUT_WIDTH, LOGITS_FORWARD,
                                                    PACKING_LIST, PLAIN_LIST, RUNNER_FORWARD, RUNNER_LOAD, layout,
                                                    layout_problems, probe_projection, probe_sglang)
from compile_pass.integrations.sglang_seams import warn as _warn
from compile_pass.packer import AuxCaptureError, AuxHiddenStatePacker
from compile_pass.packer import pack_aux_hidden_states as _cp_pack

__all__ = ["register", "enable", "enabled_by_env", "pack_view", "capture_style", "compile_config_patch",
           "projected_input", "STATE"]

logger = logging.getLogger("compile_pass.sglang")

ENV = "COMPILE_PASS_SGLANG"
ENV_COMPILE = "COMPILE_PASS_SGLANG_COMPILE"
#: the Inductor config keys the plugin chains its passes onto
INDUCTOR_KEYS = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass", "joint_custom_pre_pass")

#: K for the forward in progress (set around ``ModelRunner.forward``); None: not known.
_num_captures: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "compile_pass_sglang_k", default=None)

#: what register() did: ``active``, ``reason`` (why not), originals kept at registration.
STATE: dict = {"active": False, "reason": "not registered", "layout": None, "orig_list": None,
               "orig_pack": None, "fallbacks": 0, "packed": 0, "adopted": 0, "adoption": None,
               "inductor": {}, "project": False, "projected": 0}


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


class _PackingMixin:
    """Copy-on-capture into one packed buffer (the packer's ``slot``); the list holds the
    slices (adjacent views). With ``COMPILE_PASS_SGLANG_PROJECT`` and a draft that fits, each
    capture is projected instead into the draft's ``[T, H_draft]`` input (``_cp_project``),
    in an eager forward and in a forward Dynamo traces alike, and the list holds ``[T, 0]``
    stand-ins."""

    _cp_packer: Optional[AuxHiddenStatePacker] = None
    _cp_plan: Optional[sglang_projection.CapturePlan] = None  # projecting: the draft's plan
    _cp_acc: Optional[torch.Tensor] = None  # projecting: [T, H_draft], the terms so far
    _cp_sumsq: Optional[torch.Tensor] = None  # projecting, a norm over the concat: fp32 [T, 1]
    _cp_done: Optional[torch.Tensor] = None  # the finished projection, once handed over
    _cp_off = False

    def _cp_write(self, hidden: torch.Tensor) -> bool:
        """Copy (or project) ``hidden`` and append its slice (or stand-in); False: the caller
        appends as SGLang's list does (off for this forward, or the packer failed here). A
        capture that does not fit a projection under way raises: its earlier captures exist
        only as projected terms."""
        if self._cp_off or not isinstance(hidden, torch.Tensor):
            return False
        try:
            return self._cp_write_slice(hidden)
        except Exception as e:  # noqa: BLE001 - never fail the model's forward, but:
            if self._cp_plan is not None and len(self):
                raise  # the earlier captures exist only as projected terms
            self._cp_plan = self._cp_acc = self._cp_sumsq = None
            self._cp_fail(e)
            return False

    def _cp_fail(self, e: Any) -> None:
        self._cp_off = True
        STATE["fallbacks"] += 1
        _warn_once(type(self), "write failed", f"writing capture {len(self)} into the packed "
                   f"buffer failed ({e!r}): this forward captures as without the plugin")

    def _cp_write_slice(self, hidden: torch.Tensor) -> bool:
        if self._cp_packer is None and self._cp_plan is None:
            if len(self) != 0 or hidden.dim() < 1:
                self._cp_off = True
                return False
            # K: from the model runner's forward; a CUDA-graph capture calls the model's
            # forward directly: the one capturing model configured in this process
            k = _num_captures.get()
            if k is None:
                k = _configured_k()
            if STATE["project"]:
                self._cp_plan, why = sglang_projection.plan_for(k, hidden)
                if self._cp_plan is None and sglang_projection.registered() is not None:
                    _warn_once(type(self), "projection", f"{why}: the captures are packed as without "
                               f"{sglang_projection.ENV_PROJECT}")
            if self._cp_plan is None:
                if k is None or k < 1:
                    self._cp_off = True
                    return False
                self._cp_packer = AuxHiddenStatePacker(k)
        if self._cp_plan is not None:
            self._cp_project(hidden)
            return True
        try:
            slot = self._cp_packer.slot(hidden)
        except AuxCaptureError as e:
            _warn(f"capture {len(self)} ({tuple(hidden.shape)} {hidden.dtype}) does not fit the packed "
                  f"buffer for K={self._cp_packer.num_captures} ({e}): this forward captures as "
                  f"without the plugin")
            STATE["fallbacks"] += 1
            self._cp_off = True
            return False
        slot.copy_(hidden)
        super().append(slot)
        return True

    def _cp_project(self, hidden: torch.Tensor) -> None:
        """Capture ``len(self)``'s term added to the draft's input (and its sum of squares for
        a norm over the concat) by the registered draft's ops, then a ``[T, 0]`` stand-in
        appended: the term is the snapshot, no bytes of the capture are kept. The same ops
        run eager and traced."""
        plan, index = self._cp_plan, len(self)
        lead = tuple(hidden.shape[:-1])
        if (index >= plan.num_captures or hidden.dim() < 1 or hidden.shape[-1] != plan.hidden
                or hidden.dtype != plan.dtype or (index and lead != tuple(self._cp_acc.shape[:-1]))):
            raise AuxCaptureError(
                f"capture {index} ({tuple(hidden.shape)} {hidden.dtype}) does not fit the draft's input "
                f"projection ({plan.signature}"
                f"{', first capture ' + str(lead) if index else ''}): its earlier captures were projected")
        if index == 0:
            self._cp_acc = hidden.new_zeros((*lead, plan.out_features))
            if plan.sum_squares:
                self._cp_sumsq = hidden.new_zeros((*lead, 1), dtype=torch.float32)
        if plan.sum_squares:
            torch.ops.compile_pass.sum_squares_into_(self._cp_sumsq, hidden, None, "", False)
        torch.ops.compile_pass.project_registered_(self._cp_acc, hidden, None, "", plan.draft, plan.signature,
                                                    index, plan.num_captures, False)
        super().append(hidden.new_empty((*lead, 0)))

    def _cp_trace(self, hidden: Any) -> bool:
        """In a forward Dynamo traces: project ``hidden`` as the eager list does, where the
        projection is on and the registered draft fits; False: SGLang's own append (the
        capture pass packs in that graph)."""
        if not STATE["project"] or not isinstance(hidden, torch.Tensor):
            return False
        if self._cp_plan is None:
            if len(self) != 0:
                return False
            plan, _ = sglang_projection.plan_for(None, hidden)
            if plan is None:
                return False
            self._cp_plan = plan
        self._cp_project(hidden)
        return True

    # Inside a compiled graph, unless projecting, the list is SGLang's (the capture pass packs
    # there): each method goes straight to the original through ``super()``, which Dynamo
    # traces as it traces SGLang's class (``list.append(self, x)`` is a graph break per capture).

    def append(self, hidden):  # noqa: D401 - list API
        if torch.compiler.is_compiling():
            if not self._cp_trace(hidden):
                super().append(hidden)
            return
        if not self._cp_write(hidden):
            super().append(hidden)

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        if torch.compiler.is_compiling():
            if not self._cp_trace(hidden):
                super().append(hidden if owned else hidden.clone())
            return
        if not self._cp_write(hidden):
            super().append(hidden if owned else hidden.clone())


def _make_list_class(orig: type) -> type:
    cls = type("AuxHiddenStateList", (_PackingMixin, orig), {
        "__module__": __name__,
        "__doc__": f"compile_pass: {orig.__module__}.{orig.__qualname__} writing its captures "
                   "in place into one packed buffer.",
        "_cp_original": orig,
    })
    return cls


def pack_view(aux_hidden_states):
    """SGLang's ``pack_aux_hidden_states``, a view where the captures are adjacent slices."""
    if torch.compiler.is_compiling():
        # traced: SGLang's own cat, of a plain list (Dynamo cannot hand a list subclass to
        # torch.cat: a graph break, and the cat would run outside the graph the pass sees)
        if isinstance(aux_hidden_states, list) and type(aux_hidden_states) is not list:
            aux_hidden_states = list(aux_hidden_states)
        return STATE["orig_pack"](aux_hidden_states)
    if isinstance(aux_hidden_states, (list, tuple)) and len(aux_hidden_states) > 1:
        list_adoption.complete(aux_hidden_states)  # a plain-list model's list: the last moves
        try:
            out = _cp_pack(aux_hidden_states)
        except Exception:  # anything ours rejects: SGLang's own
            return STATE["orig_pack"](aux_hidden_states)
        STATE["packed"] += 1
        return out
    return STATE["orig_pack"](aux_hidden_states)


_CAPTURE_ATTR = re.compile(r"(?:^|_)layers_to_capture$")  # layers_to_capture, dspark_...


def _capture_holder(model: Any) -> Optional[tuple]:
    """(module, attribute) of the first module of ``model`` holding its capture layers
    (``layers_to_capture``, or a ``<name>_layers_to_capture`` such as kimi_linear's
    ``dspark_layers_to_capture``); cached on the model."""
    found = getattr(model, "_compile_pass_k_holder", None)
    if found is None and isinstance(model, torch.nn.Module):
        for mod in model.modules():
            attr = next((a for a in mod.__dict__ if _CAPTURE_ATTR.search(a)), None)
            if attr is not None:
                found = (mod, attr)
                break
        if found is not None:
            try:
                object.__setattr__(model, "_compile_pass_k_holder", found)
            except Exception:
                pass
    return found


def _find_k(model: Any) -> Optional[int]:
    """len of the capture layers of the module holding them; the holder is cached, the
    length is read each forward (set_eagle3/dflash_layers_to_capture may change it after
    the first)."""
    found = _capture_holder(model)
    layers = getattr(*found, None) if found is not None else None
    if layers is None or isinstance(layers, torch.Tensor):
        return None
    try:
        return len(layers) or None
    except TypeError:
        return None


#: capture styles: how a model's layer loop collects its captures
PACKING_LIST_STYLE, PACKER_STYLE, PLAIN_LIST_STYLE = "AuxHiddenStateList", "packer", "plain list"

_style_of_class: dict = {}


def capture_style(cls: type) -> Optional[str]:
    """How ``cls``'s layer loop collects its captures: ``"AuxHiddenStateList"`` (SGLang's
    list class), ``"packer"`` (SGLang's packer) or ``"plain list"`` (a ``[]`` built in the
    loop's method), read from the source of the first class in ``cls``'s MRO whose own body
    shows one of them (``_style_of_source``); None: none does, or no source. Cached per
    class."""
    if cls not in _style_of_class:
        style = None
        for klass in cls.__mro__:
            if klass is object or klass.__module__.startswith("torch."):
                continue
            try:
                style = _style_of_source(inspect.getsource(klass))
            except (OSError, TypeError):  # no source: not this one
                continue
            if style is not None:
                break
        _style_of_class[cls] = style
    return _style_of_class[cls]


def _style_of_source(src: str) -> Optional[str]:
    """The capture style a class's source shows (see ``capture_style``), or None."""
    if re.search(r"AuxHiddenStateList\(\)", src):
        return PACKING_LIST_STYLE
    if "AuxHiddenStatePacker" in src:
        return PACKER_STYLE
    if re.search(r"aux_hidden_states\s*(?::[^=\n]+)?=\s*\[\]", src) and "layers_to_capture" in src:
        return PLAIN_LIST_STYLE
    return None


#: (class, kind) pairs already named in a warning or log line: each is said once
_told: set = set()


def _plain_list_holder(holder: torch.nn.Module) -> bool:
    """True for a holder whose file appends its captures to a plain ``[]`` and whose layers
    now carry the adoption hooks (installed once); a holder with no layers to hook is named
    in a warning, once per class."""
    cls = type(holder)
    if capture_style(cls) != PLAIN_LIST_STYLE:
        return False
    hooked = list_adoption.install(holder)
    if not hooked:
        _warn_once(cls, "no layers", f"{cls.__qualname__} ({cls.__module__}) appends its captures "
                   f"to a plain [] but has no layers to observe: its captures are packed by "
                   f"SGLang's torch.cat as without the plugin")
    elif (cls, "adopting") not in _told:
        _told.add((cls, "adopting"))
        logger.info("%s (%s) appends its captures to a plain []: the list is adopted at its "
                    "layer boundaries (%d modules hooked)", cls.__qualname__, cls.__module__, hooked)
    return hooked > 0


def _report_adoption(adoption: list_adoption.ListAdoption) -> None:
    """After a capturing forward of a plain-list model: count it, and name in a warning
    (once per class and reason) why adoption stopped, if it did, or why it saved nothing."""
    STATE["adoption"] = {"model": adoption.owner, "moved": adoption.moved,
                         "moves": adoption.moves, "boundaries": adoption.boundaries,
                         "reason": adoption.reason}
    if adoption.reason is None and adoption.moved:
        STATE["adopted"] += 1
        if adoption.moved_all_at_once:
            _warn_once(type(adoption.holder), "moved all at once",
                       f"{adoption.owner} showed no layer call between its captures (layers "
                       f"called as layer.forward(...) run no hook): its {adoption.moved} captures "
                       f"were packed in one step, with the peak of SGLang's torch.cat")
        return
    if adoption.reason is not None:
        _warn_once(type(adoption.holder), adoption.reason.split(":")[0],
                   f"{adoption.reason}: this forward's captures are packed by SGLang's torch.cat "
                   f"as without the plugin")


def _warn_once(cls: type, kind: str, msg: str) -> None:
    if (cls, kind) not in _told:
        _told.add((cls, kind))
        _warn(msg)


#: the models SGLang configured to capture (``configure_aux_hidden_state_capture``)
_capturing_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _configure_capture(original_fn, *args, **kwargs):
    """Around ``configure_aux_hidden_state_capture``: the model it sets capture layers on is
    kept (weakly), for the forwards that reach the model without ``ModelRunner.forward``
    (the CUDA-graph runners' captures call ``model.forward`` themselves)."""
    out = original_fn(*args, **kwargs)
    model = kwargs.get("model", args[0] if args else None)
    if isinstance(model, torch.nn.Module) and (kwargs.get("eagle_use_aux_hidden_state")
                                               or kwargs.get("dflash_use_aux_hidden_state")):
        _capturing_models.add(model)
    return out


def _configured_k() -> Optional[int]:
    """K of the models configured to capture when they agree on one (a process serves one
    target), else None."""
    ks = {_find_k(m) for m in list(_capturing_models)} - {None}
    return ks.pop() if len(ks) == 1 else None


def _capture_plan(runner: Any) -> tuple:
    """(K, the plain-list holder to adopt from or None) for the runner's model; K None: not
    capturing, or capture layers not found."""
    model = getattr(runner, "model", None)
    k = _find_k(model)
    holder = _capture_holder(model)[0] if k else None
    return k, (holder if holder is not None and _plain_list_holder(holder) else None)


def _runner_forward(original_fn, self, *args, **kwargs):
    """Around ``ModelRunner.forward``: K for the packing list, and the adoption of a
    plain-list model's captures. Nothing of the plugin's own can fail the forward: an error
    in it is a warning (once per kind) and the forward runs as without the plugin."""
    try:
        k, holder = _capture_plan(self)
    except Exception as e:  # noqa: BLE001
        _warn_once(type(self), "capture plan", f"reading the capture layers failed ({e!r}): "
                   f"this forward captures as without the plugin")
        k, holder = None, None
    token = _num_captures.set(k)
    try:
        if holder is None:
            return original_fn(self, *args, **kwargs)
        with list_adoption.adopting(holder, k) as adoption:
            out = original_fn(self, *args, **kwargs)
        try:
            _report_adoption(adoption)
        except Exception as e:  # noqa: BLE001
            logger.warning("reporting the adoption failed: %r", e)
        return out
    finally:
        _num_captures.reset(token)


def projected_input(aux: Any) -> Optional[torch.Tensor]:
    """The draft's projected input ``[T, H_draft]`` if ``aux`` is a packing list that
    projected its captures (``COMPILE_PASS_SGLANG_PROJECT``), finished once (the combine's
    per-token norm scale and bias: ``finish_registered_``); None for any other list. A list
    that projected some captures but not the draft's K raises: the captures it holds are
    stand-ins."""
    plan = getattr(aux, "_cp_plan", None)
    if plan is None:
        return None
    done = getattr(aux, "_cp_done", None)
    if done is not None:
        return done
    if len(aux) != plan.num_captures:
        raise AuxCaptureError(f"the target captured {len(aux)} hidden states, the draft's input projection "
                              f"({plan.signature}) reads {plan.num_captures}")
    acc = aux._cp_acc
    torch.ops.compile_pass.finish_registered_(acc, aux._cp_sumsq, plan.draft, plan.signature, plan.num_captures)
    aux._cp_done = acc
    return acc


def _project_packed(aux: Any) -> Optional[torch.Tensor]:
    """The registered Eagle3 draft's combine applied to captures that reached the logits
    processor unprojected while its input is projected (a list that fell back, or not ours),
    so the draft, whose CUDA-graph buffers are then ``H_draft`` wide, always reads
    ``[T, H_draft]``. Traced into a compiled forward, the combine reads the captures' concat
    alone, and the capture pass (``fuse_projection``) folds it into the captures where it
    can. None where no such draft fits ``aux``."""
    draft = sglang_projection.registered()
    if draft is None or draft.kind != "eagle3" or not isinstance(aux, (list, tuple)) \
            or len(aux) != draft.num_captures:
        return None
    p = draft.projection
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == p.hidden and t.dtype == p.weight.dtype
               for t in aux):
        return None
    return p.reference(torch.cat(list(aux), dim=-1))


_signatures: dict = {}


def _signature(fn: Any) -> inspect.Signature:
    """``inspect.signature(fn)``, cached per wrapped function in eager forwards; traced, read
    afresh (a cache filled inside a traced forward is a guard that fails on the next call)."""
    if torch.compiler.is_compiling():
        return inspect.signature(fn)
    sig = _signatures.get(fn)
    if sig is None:
        sig = _signatures[fn] = inspect.signature(fn)
    return sig


def _logits_forward(original_fn, self, *args, **kwargs):
    """Around ``LogitsProcessor.forward``: a capture list whose captures were projected is
    handed on as the projected ``[T, H_draft]`` tensor (stored for the draft where the packed
    captures were; the logits processor slices a tensor by rows as it did the list). A
    projection left incomplete is an error (``projected_input``), never a list of stand-ins
    handed on."""
    try:
        bound = _signature(original_fn).bind(self, *args, **kwargs)
        aux = bound.arguments.get("aux_hidden_states")
    except Exception as e:  # noqa: BLE001 - never fail the model's forward
        _warn_once(type(self), "logits hook", f"reading the capture list failed ({e!r})")
        return original_fn(self, *args, **kwargs)
    projected = projected_input(aux)
    if projected is None:
        try:
            projected = _project_packed(aux)
        except Exception as e:  # noqa: BLE001
            _warn_once(type(self), "logits hook", f"projecting the packed captures failed ({e!r})")
    if projected is None:
        return original_fn(self, *args, **kwargs)
    bound.arguments["aux_hidden_states"] = projected
    if not torch.compiler.is_compiling():  # traced, a global's count would be a guard
        STATE["projected"] += 1
    return original_fn(*bound.args, **bound.kwargs)


def _runner_load(original_fn, self, *args, **kwargs):
    """Around ``ModelRunner.load_model``: a draft worker's model hands its input projection
    over (``sglang_projection.register_draft``; a draft that does not fit is named)."""
    out = original_fn(self, *args, **kwargs)
    if getattr(self, "is_draft_worker", False):
        try:
            sglang_projection.register_draft(getattr(self, "model", None))
        except Exception as e:  # noqa: BLE001
            _warn(f"reading the draft's input projection failed ({e!r}): its input is packed")
    return out


def _register_projection(registry: Any, hook_type: Any) -> None:
    """``COMPILE_PASS_SGLANG_PROJECT=1``: the projection's hooks, if its seams fit."""
    probes = probe_projection()
    problems = [f"{p.seam.name}: {p.state} ({p.detail})" for p in probes if not p.fits]
    if problems:
        _warn(f"{sglang_projection.ENV_PROJECT}=1 but {'; '.join(problems)}: the captures are packed")
        return
    registry.register(RUNNER_LOAD, _runner_load, hook_type.AROUND)
    registry.register(LOGITS_FORWARD, _logits_forward, hook_type.AROUND)
    if any(p.seam.name == DFLASH_PROJECT and p.state == "ok" for p in probes):
        registry.register(DFLASH_PROJECT, sglang_projection.projected_target_hidden, hook_type.AROUND)
    if any(p.seam.name == DRAFT_INPUT_WIDTH and p.state == "ok" for p in probes):
        registry.register(DRAFT_INPUT_WIDTH, sglang_projection.draft_input_width, hook_type.AROUND)
    STATE["project"] = True
    logger.info("compile_pass SGLang plugin: the draft's input is projected as each capture is made (%s)",
                sglang_projection.ENV_PROJECT)


def compile_config_patch() -> Optional[Any]:
    """``torch._inductor.config.patch(...)`` holding this project's Inductor pass set for a
    whole-graph compile (``inductor_pass_set(Build.WHOLE_GRAPH)``), each pass chained after
    whatever Inductor's config has in its slot (the user's); None where the passes must not
    be set: ``COMPILE_PASS_SGLANG_COMPILE=0``, a torch without the slots, or lite mode (which
    skips every post-grad pass: a warning says so).

    - ``post_grad_custom_pre_pass``: ... then ``CaptureTwinsPass``;
    - ``post_grad_custom_post_pass``: ... then ``AuxCapturePass`` then ``DistinctOutputsPass``
      (last: no clone of a mutated input, e.g. a ``residual.clone()`` capture after a fused
      add-norm, handed back as the input itself);
    - ``joint_custom_pre_pass``: ... then ``ReturnedCopiesPass`` (tags the returned clones
      before ``remove_noop_ops`` drops them; ``DistinctOutputsPass`` needs the tags).
    """
    if os.environ.get(ENV_COMPILE, "1").strip().lower() in ("0", "false", "no", "off"):
        STATE["inductor"] = {}
        return None
    try:
        import torch._inductor.config as ic

        from compile_pass.inductor_pass import AuxCapturePass, Build, inductor_pass_set
    except Exception as e:  # torch without the APIs the pass needs
        _warn(f"the capture pass is not set for --enable-torch-compile ({e!r})")
        return None
    missing = [k for k in INDUCTOR_KEYS if not hasattr(ic, k)]
    if missing:
        _warn(f"torch._inductor.config has no {', '.join(missing)}: the capture pass is not set "
              f"for --enable-torch-compile")
        return None
    off = [k for k in ("use_post_grad_passes", "use_joint_graph_passes") if not getattr(ic, k, True)]
    if off:
        _warn(f"torch._inductor.config.{' and '.join(off)} is False (lite mode: "
              f"TORCHINDUCTOR_LITE_MODE=1?): Inductor would skip the capture pass, so it is not set "
              f"for --enable-torch-compile")
        return None
    # with the draft's input projected, the combine the logits hook traces into the graph
    # (``_project_packed``) is folded into the captures by ``fuse_projection``
    capture = AuxCapturePass(fuse_projection=True) if STATE.get("project") else None
    patches = inductor_pass_set(Build.WHOLE_GRAPH, capture_pass=capture).config_patches()
    STATE["inductor"] = {k: repr(v) for k, v in patches.items()}
    return ic.patch(patches)


class _CompileScope:
    """SGLang's ``patch_model(...)`` context (``--enable-torch-compile``: the model's forward is
    compiled, on its first call, while that context is open), entered inside
    ``compile_config_patch()``: the passes apply to those compiles only, and Inductor's config
    is as it was once the context closes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.patch: Optional[Any] = None

    def __enter__(self) -> Any:
        self.patch = compile_config_patch()
        if self.patch is not None:
            self.patch.__enter__()
        try:
            return self.inner.__enter__()
        except BaseException:
            self._close_patch()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._close_patch()

    def _close_patch(self) -> None:
        if self.patch is not None:
            self.patch.__exit__(None, None, None)
            self.patch = None


def _compile_scope(original_fn, *args, **kwargs):
    """Around-hook on SGLang's ``patch_model``: its context, scoped with the passes."""
    return _CompileScope(original_fn(*args, **kwargs))


def enable(*, registry: Any = None, apply: bool = True) -> bool:
    """Register the hooks (and apply them unless ``apply=False``); True when active.

    Idempotent. The seams are probed first (``sglang_seams``): the layout whose seams all
    fit is used; if none does, a warning names what moved and nothing is registered.
    """
    if STATE["active"]:
        return True
    probes = probe_sglang()
    which = layout(probes)
    if which is None:
        STATE["reason"] = f"SGLang layout not as expected: {layout_problems(probes)}"
        _warn(STATE["reason"] + "; SGLang runs without the plugin")
        return False
    from sglang.srt.plugins.hook_registry import HookType

    if registry is None:
        from sglang.srt.plugins.hook_registry import HookRegistry as registry  # noqa: N813
    if which == PLAIN_LIST:
        from compile_pass.integrations import sglang_compile

        if sglang_projection.enabled_by_env():
            _warn(f"{sglang_projection.ENV_PROJECT}=1: the draft-input projection needs SGLang's "
                  f"AuxHiddenStateList (0.5.23); on this layout the captures are packed")

        sglang_compile.register(registry, HookType)
        if apply:
            registry.apply_hooks()
        STATE.update(active=True, reason="", layout=PLAIN_LIST)
        logger.info("compile_pass SGLang plugin active: plain-list layout, the inner model compiled "
                    "with the capture pass on capturing extend batches")
        return True
    import importlib

    aux = importlib.import_module(AUX_MODULE)
    orig_list = aux.AuxHiddenStateList
    orig_list = getattr(orig_list, "_cp_original", None) or orig_list  # a second registry: the original
    STATE.update(orig_list=orig_list, orig_pack=aux.pack_aux_hidden_states)
    registry.register(f"{AUX_MODULE}.AuxHiddenStateList", _make_list_class(orig_list),
                      HookType.REPLACE)
    registry.register(f"{AUX_MODULE}.pack_aux_hidden_states", pack_view, HookType.REPLACE)
    registry.register(RUNNER_FORWARD, _runner_forward, HookType.AROUND)
    for probe_ in probes:
        if probe_.seam.name == CAPTURE_CONFIG and probe_.state == "ok":
            registry.register(CAPTURE_CONFIG, _configure_capture, HookType.AROUND)
        if probe_.seam.name in COMPILE_CONTEXTS and probe_.state == "ok":
            registry.register(probe_.seam.name, _compile_scope, HookType.AROUND)
    if sglang_projection.enabled_by_env():
        _register_projection(registry, HookType)
    if apply:
        registry.apply_hooks()
    STATE.update(active=True, reason="", layout=PACKING_LIST)
    logger.info("compile_pass SGLang plugin active: captures packed in place")
    return True


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: active only with ``COMPILE_PASS_SGLANG=1``.

    SGLang's loader applies the registry's hooks after every plugin has run.
    """
    if not enabled_by_env():
        STATE["reason"] = f"{ENV} is not set"
        return
    enable(apply=False)
