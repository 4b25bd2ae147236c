"""The one place the engine plugins read a running function's frame (no torch imported).

``list_adoption`` adopts a capture list a model builds as a local variable of its own
``forward`` (SGLang's plain-list models): at a layer call it needs that caller's frame
(``caller_frame``) and the lists among its locals (``lists_in_frame``). Nothing here
writes a frame's variables: a list found is a reference to the model's own list object.

Python semantics this relies on (``tests/test_frames.py`` checks them on every Python
found, 3.11, 3.12 and 3.13):

- 3.11 and 3.12: ``frame.f_locals`` of a function frame is a dict snapshot the frame keeps
  (refreshed on each read); it holds a reference to every local of that moment until the
  frame ends or the snapshot is cleared. Clearing it leaves the fast locals the function runs
  on untouched, so it is cleared after each read.
- 3.13 (PEP 667): ``frame.f_locals`` is a write-through proxy holding no references: nothing
  to clear (and clearing it would delete the function's variables), so only a ``dict`` is.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Callable, Collection, List, Optional

__all__ = ["caller_frame", "lists_in_frame"]


def caller_frame(depth: int, skip_files: Collection[str], max_skipped: int) -> Optional[types.FrameType]:
    """The frame ``depth`` levels up from the function that calls this one (0: that function
    itself), then past at most ``max_skipped`` frames whose code lives in ``skip_files``
    (e.g. ``nn.Module``'s call machinery between a forward pre-hook and the layer call that
    ran it); None if more are in the way. Drop the frame when done (``del``): frames keep
    their locals alive."""
    frame = sys._getframe(depth + 1)
    for _ in range(max_skipped):
        if frame is None or frame.f_code.co_filename not in skip_files:
            break
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename in skip_files:
        return None
    return frame


def lists_in_frame(frame: types.FrameType, accept: Callable[[list], bool]) -> List[list]:
    """The locals of ``frame`` of exact type ``list`` that ``accept``, each once; the
    frame's ``f_locals`` snapshot released after the read (see the module docstring)."""
    snapshot = frame.f_locals
    try:
        found = {id(v): v for v in snapshot.values() if type(v) is list and accept(v)}
    finally:
        if isinstance(snapshot, dict) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            snapshot.clear()  # 3.11/3.12: the snapshot would keep these locals alive
        del snapshot
    return list(found.values())
