"""Plain-list captures packed at the layer boundaries of the model's own loop.

Some decoders build their capture list inside ``forward`` (``aux_hidden_states = []``, then
``aux_hidden_states.append(hidden_states)`` in the layer loop) and hand it to a pack that
concatenates: the K captures and the packed result are alive together. No class holds that
list, so nothing can be swapped; the layer calls are what can be observed. This module adopts
the list from the model's frame at each layer boundary and moves its entries into one buffer:

- :func:`install` puts a forward pre-hook on each layer of the module holding the capture
  layers (the elements of its ``ModuleList`` children, and its other direct children, e.g.
  the final norm). A hook does nothing unless a :class:`ListAdoption` is current
  (:func:`adopting`, set by the engine around one capturing forward);
- at a hook whose caller is one of the holder's own methods (the frame two module-call frames
  up: a layer call in the holder's loop, nothing in between), the one local of exact type
  ``list`` holding tensors is adopted; each entry appended since the previous boundary is
  copied into its slice of one ``[*lead, K * hidden]`` buffer (allocated at the first) and
  the list's entry is replaced by that slice;
- :func:`complete`, called by the pack, copies the entries appended after the last boundary,
  so the pack returns a view of the buffer.

Invariant: the adopted list keeps its length, order and values (the bytes of entry j are
those it held at the boundary after its append); only the storage of its entries moves. An
entry's original tensor is then freed when the model's loop rebinds its variable, as with
a packer that copies on append: a tensor the model mutates in place after that boundary is
captured as it was there (as a clone on append would), which is the packer's contract.

Anything that does not fit (two lists of tensors in the frame, an entry of another shape,
dtype or device, more than K entries, an entry that needs grad) stops adoption for that
forward with a reason in :attr:`ListAdoption.reason`; the entries already moved hold the same
values, so the pack's concatenation gives the same result as without adoption.

The frame is read only through ``frames.py`` (the caller's frame, the lists among its locals;
nothing writes a frame's variables), whose Python-version semantics are tested on 3.11, 3.12
and 3.13. The buffer and each entry's slot are the packer's (``AuxHiddenStatePacker.slot``),
which checks the fit.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import types
from dataclasses import dataclass
from typing import Any, FrozenSet, Iterator, Optional

import torch

from compile_pass.integrations.frames import caller_frame, lists_in_frame
from compile_pass.packer import AuxCaptureError, AuxHiddenStatePacker

__all__ = ["ListAdoption", "adopting", "install", "complete", "holder_codes"]

logger = logging.getLogger("compile_pass.sglang")

_MODULE_CALL_FILE = inspect.getsourcefile(torch.nn.Module) or ""
_MAX_MODULE_FRAMES = 4  # hook <- _call_impl <- _wrapped_call_impl <- caller (slack for wrappers)
_HOOKED_ATTR = "_compile_pass_list_adoption_hooks"


@dataclass
class ListAdoption:
    """One capturing forward of one holder: the adopted list and the buffer its entries
    moved into (``moved`` entries so far, in ``moves`` steps: boundaries or the pack that
    moved at least one). ``reason`` says why adoption stopped, if it did."""

    holder: torch.nn.Module
    num_captures: int
    codes: FrozenSet[types.CodeType]
    captures: Optional[list] = None
    packer: Optional[AuxHiddenStatePacker] = None  # made at the first move
    moved: int = 0
    moves: int = 0
    boundaries: int = 0
    reason: Optional[str] = None

    @property
    def owner(self) -> str:
        return type(self.holder).__qualname__

    @property
    def buffer(self) -> Optional[torch.Tensor]:
        """The packed buffer, once all K entries moved into it (None before)."""
        if self.packer is None or len(self.packer) < self.packer.num_captures:
            return None
        return self.packer.finalize()

    @property
    def moved_all_at_once(self) -> bool:
        """More than one entry, all moved in one step: no layer boundary was seen between the
        captures (e.g. layers called as ``layer.forward(...)``, which runs no hook), so every
        original was alive with the buffer, the same peak as the list path's cat."""
        return self.moved > 1 and self.moves == 1


_current: contextvars.ContextVar[Optional[ListAdoption]] = contextvars.ContextVar(
    "compile_pass_list_adoption", default=None)


def holder_codes(holder: torch.nn.Module) -> FrozenSet[types.CodeType]:
    """Code objects of the functions the holder's class (and its bases below ``nn.Module``)
    defines: the frames whose layer calls are boundaries of its loop."""
    codes = set()
    for cls in type(holder).__mro__:
        if cls in (torch.nn.Module, object):
            break
        for value in vars(cls).values():
            fn = inspect.unwrap(value) if callable(value) else None
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType):
                codes.add(code)
    return frozenset(codes)


@contextlib.contextmanager
def adopting(holder: torch.nn.Module, num_captures: int) -> Iterator[ListAdoption]:
    """Adopt the holder's capture list during the ``with`` body (one capturing forward)."""
    codes = getattr(holder, "_compile_pass_holder_codes", None)
    if codes is None:
        codes = holder_codes(holder)
        object.__setattr__(holder, "_compile_pass_holder_codes", codes)
    state = ListAdoption(holder, num_captures, codes)
    token = _current.set(state)
    try:
        yield state
    finally:
        _current.reset(token)
        state.captures = None  # the list is the model's: hold it no longer than the forward


def install(holder: torch.nn.Module) -> int:
    """Forward pre-hooks on the holder's layers and direct children (idempotent); returns
    how many modules carry one."""
    hooked = getattr(holder, _HOOKED_ATTR, None)
    if hooked is not None:
        return len(hooked)
    hooked = []
    for child in holder.children():
        targets = list(child) if isinstance(child, torch.nn.ModuleList) else [child]
        for module in targets:
            hooked.append(module.register_forward_pre_hook(_at_boundary))
    object.__setattr__(holder, _HOOKED_ATTR, hooked)
    return len(hooked)


def _holder_frame(state: ListAdoption) -> Optional[types.FrameType]:
    """The holder's frame if it called the module whose pre-hook runs, else None."""
    # 0: this, 1: the hook, 2: nn.Module's call machinery (skipped), then the caller
    frame = caller_frame(2, (_MODULE_CALL_FILE,), _MAX_MODULE_FRAMES)
    if frame is not None and frame.f_code in state.codes:
        return frame
    return None


def _find_list(state: ListAdoption, frame: types.FrameType) -> Optional[list]:
    """The frame's one local of exact type ``list`` holding only tensors (None: none yet)."""
    lists = lists_in_frame(frame, lambda v: bool(v) and all(isinstance(t, torch.Tensor) for t in v))
    if len(lists) > 1:
        state.reason = (f"{len(lists)} lists of tensors in {state.owner}.{frame.f_code.co_name}: "
                        "which one holds the captures is ambiguous")
        return None
    return lists[0] if lists else None


def _move_new_entries(state: ListAdoption) -> None:
    captures, before = state.captures, state.moved
    while state.reason is None and state.moved < len(captures):
        j, hidden = state.moved, captures[state.moved]
        problem = _misfit(state, j, hidden)
        if problem is None:
            if state.packer is None:
                state.packer = AuxHiddenStatePacker(state.num_captures)
            try:
                slot = state.packer.slot(hidden)
            except AuxCaptureError as e:
                problem = f"capture {j} of {state.owner} does not fit the packed buffer: {e}"
        if problem is not None:
            state.reason = problem
            break
        slot.copy_(hidden)
        captures[j] = slot
        state.moved += 1
    state.moves += state.moved > before


def _misfit(state: ListAdoption, j: int, hidden: Any) -> Optional[str]:
    """Why entry ``j`` cannot move, beyond what the packer's ``slot`` checks."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        return f"capture {j} of {state.owner} is {type(hidden).__name__}, not a tensor"
    if j >= state.num_captures:
        return f"{state.owner} appended capture {j}, more than K={state.num_captures}"
    if hidden.requires_grad and torch.is_grad_enabled():
        return f"capture {j} of {state.owner} requires grad: copying it would cut its graph"
    return None


def _at_boundary(module: torch.nn.Module, args: Any) -> None:
    state = _current.get()
    if state is None or state.reason is not None or torch.compiler.is_compiling():
        return
    frame = _holder_frame(state)
    if frame is None:
        return
    try:
        if state.captures is None:
            state.captures = _find_list(state, frame)
            if state.captures is None:
                return
        state.boundaries += 1
        _move_new_entries(state)
    except Exception as exc:  # noqa: BLE001 - a hook must never break the model's forward
        state.reason = f"adopting the captures of {state.owner} failed: {exc!r}"
    finally:
        del frame


def complete(captures: Any) -> Optional[ListAdoption]:
    """Move the entries appended after the last boundary, if ``captures`` is the list the
    current forward adopted (or a list or tuple of the same entries, as a caller's
    ``[h for h in aux]`` copy is); returns that adoption (None: not adopted, nothing done)."""
    state = _current.get()
    if state is None or state.captures is None:
        return None
    adopted = state.captures
    if captures is not adopted:
        if (not isinstance(captures, (list, tuple)) or len(captures) != len(adopted)
                or any(a is not b for a, b in zip(captures, adopted))):
            return None
    if state.reason is None:
        _move_new_entries(state)
        if captures is not adopted and isinstance(captures, list):
            captures[:] = adopted
    return state
