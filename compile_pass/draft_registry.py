"""The draft a compiled target projects its returned captures into, looked up when it runs.

In a serving engine the draft's ``fc`` is not in the target's graph: the target returns its
captures and the draft's combine (``cat``, then norms and ``fc``) runs after it. An engine
plugin that has the draft model registers it here by name (``register``) before the
target is compiled; the capture pass (``rewrite_graph(project_outputs=name)``) then makes
each returned capture a ``compile_pass::project_registered_`` call into one ``[*, H_draft]``
accumulator, which the graph returns in the captures' first place (the others become
``[*, 0]`` stand-ins). The graph holds the draft's *name*; the op reads the draft's weights
when it runs, so a weight replaced after loading is the one used, and a draft that no
longer fits what the graph was built for is a clear error, never a wrong result.

Invariant: a registered draft resolves, for ``K`` captures, to the ``DraftProjection`` the
draft's combine computes; ``accumulate_term_`` / ``finish_`` (``projection.py``) apply it,
the same arithmetic as the eager ``ProjectingAccumulator``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from compile_pass.errors import AuxCaptureError
from compile_pass.projection import DraftProjection, finish_, project_term_

__all__ = ["DraftSignature", "RegisteredDraft", "register", "unregister", "lookup", "registered_names",
           "finished_count", "project_registered_", "finish_registered_"]

logger = logging.getLogger("compile_pass.draft_registry")


@dataclass(frozen=True)
class DraftSignature:
    """What a rewritten graph was built for: the combine's kind (``"fc"``,
    ``"norm_before_fc"``, ``"fc_norms"``), K, the capture width, ``H_draft`` and the dtype."""

    combine: str
    num_captures: int
    hidden: int
    out_features: int
    dtype: torch.dtype

    @classmethod
    def of(cls, p: DraftProjection) -> "DraftSignature":
        combine = "norm_before_fc" if p.norm_before_fc is not None else "fc_norms" if p.fc_norms is not None \
            else "fc"
        return cls(combine, p.num_captures, p.hidden, p.out_features, p.weight.dtype)

    def describe(self) -> str:
        return (f"{self.combine} K={self.num_captures} x {self.hidden} -> {self.out_features} "
                f"{str(self.dtype).replace('torch.', '')}")


class RegisteredDraft:
    """A draft by name: ``resolve(K)`` builds its ``DraftProjection`` from its weights as they
    are at each call, so a loader that replaces a parameter after registration is followed
    (``owner`` names the draft in messages)."""

    def __init__(self, name: str, owner: str, resolve: Callable[[int], DraftProjection]) -> None:
        self.name, self.owner, self._resolve = name, owner, resolve

    def projection(self, num_captures: int) -> DraftProjection:
        """The draft's projection of ``num_captures`` captures, from its weights now."""
        return self._resolve(num_captures)

    def fits(self, num_captures: int, hidden: int, dtype: torch.dtype,
             device: torch.device) -> Tuple[Optional[DraftSignature], str]:
        """The signature a group of ``num_captures`` captures (``hidden`` wide, ``dtype`` on
        ``device``) is projected with, or (None, why it does not fit this draft)."""
        try:
            p = self.projection(num_captures)
        except (AuxCaptureError, TypeError, ValueError) as e:
            return None, f"the draft's projection of {num_captures} captures cannot be built ({e})"
        if p.hidden != hidden:
            return None, (f"the captures are {hidden} wide, the draft {self.owner}'s fc reads "
                          f"{num_captures} x {p.hidden}")
        if p.weight.dtype != dtype or p.weight.device != device:
            return None, (f"the captures are {dtype} on {device}, the draft {self.owner}'s fc "
                          f"{p.weight.dtype} on {p.weight.device}")
        return DraftSignature.of(p), ""

    def __repr__(self) -> str:
        return f"RegisteredDraft({self.name!r}, {self.owner})"


_LOCK = threading.Lock()
_DRAFTS: Dict[str, RegisteredDraft] = {}
# projected inputs finished per draft name, counted where ``finish_registered_`` runs: in
# eager code and inside compiled graphs alike (an opaque op runs at every call; a Python
# counter in a traced function would be a guard). A CUDA graph's replay runs no Python:
# there it counts the capture only.
_FINISHED: Dict[str, int] = {}


def register(name: str, owner: str, resolve: Callable[[int], DraftProjection]) -> RegisteredDraft:
    """Register (or replace) the draft called ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a draft's name must be a non-empty string, got {name!r}")
    draft = RegisteredDraft(name, owner, resolve)
    with _LOCK:
        _DRAFTS[name] = draft
    logger.info("compile_pass: draft %r registered (%s)", name, owner)
    return draft


def unregister(name: str) -> None:
    with _LOCK:
        _DRAFTS.pop(name, None)


def finished_count(name: str) -> int:
    """How many projected inputs of the draft ``name`` ``finish_registered_`` has finished in
    this process (compiled forwards included): what confirms a projection happened."""
    with _LOCK:
        return _FINISHED.get(name, 0)


def registered_names() -> Tuple[str, ...]:
    with _LOCK:
        return tuple(_DRAFTS)


def lookup(name: str) -> RegisteredDraft:
    with _LOCK:
        draft = _DRAFTS.get(name)
    if draft is None:
        raise AuxCaptureError(f"no draft named {name!r} is registered (compile_pass.draft_registry): the "
                              f"graph projects its captures into it; registered: {list(_DRAFTS) or 'none'}")
    return draft


def _projection_for(name: str, signature: str, num_captures: int) -> DraftProjection:
    p = lookup(name).projection(num_captures)
    found = DraftSignature.of(p).describe()
    if found != signature:
        raise AuxCaptureError(f"the draft {name!r} is now {found}; the graph was built for {signature}")
    return p


@torch.library.custom_op("compile_pass::project_registered_", mutates_args=("acc",),
                         tags=(torch._C.Tag.flexible_layout,))
def project_registered_(acc: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str, draft: str,
                        signature: str, index: int, num_captures: int, first: bool) -> None:
    """``acc (+)= transform_k(src) @ W_k^T`` with the registered ``draft``'s weights (``src``:
    ``a``, or ``op(a, b)``); ``signature``: what the graph was built for."""
    project_term_(_projection_for(draft, signature, num_captures), acc, a, index, first, other=b, op=op)


@project_registered_.register_fake
def _project_registered_fake(acc: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str, draft: str,
                             signature: str, index: int, num_captures: int, first: bool) -> None:
    return None


@torch.library.custom_op("compile_pass::finish_registered_", mutates_args=("acc",),
                         tags=(torch._C.Tag.flexible_layout,))
def finish_registered_(acc: torch.Tensor, sumsq: Optional[torch.Tensor], draft: str, signature: str,
                       num_captures: int) -> None:
    """The registered ``draft``'s combine finished on ``acc`` in place (``projection.finish_``)."""
    finish_(_projection_for(draft, signature, num_captures), acc, sumsq)
    with _LOCK:
        first = draft not in _FINISHED
        _FINISHED[draft] = _FINISHED.get(draft, 0) + 1
    if first:
        logger.info("compile_pass: the first projected input of draft %r finished (%s)", draft, signature)


@finish_registered_.register_fake
def _finish_registered_fake(acc: torch.Tensor, sumsq: Optional[torch.Tensor], draft: str, signature: str,
                            num_captures: int) -> None:
    return None


def _declare_mutations() -> None:
    """Tell ``reinplace.py`` which argument each op mutates (``ops.MUTATED_ARG``)."""
    from compile_pass.ops import MUTATED_ARG

    MUTATED_ARG[project_registered_._opoverload] = "acc"
    MUTATED_ARG[finish_registered_._opoverload] = "acc"


_declare_mutations()
