"""Seams: the places of an engine a plugin relies on, each probed before anything changes.

An engine plugin is a list of ``Seam``s. A seam names one place (a module attribute, a
method, or an engine behaviour the plugin uses through the engine's own API: a *route*),
says what the plugin puts there and why no official hook does it, and has a ``locate``
function that inspects the engine and returns the patches to apply, or raises:

- ``SeamAbsent``: the place does not exist in this release (a module the engine deleted).
  Fine for an ``optional`` seam (that concat site is gone, nothing to do there); for any
  other seam it stops the plugin.
- ``SeamMoved``: the place exists but differs from what the plugin was written against
  (another signature, a statement that is no longer there). Always stops the plugin.

``probe(seams)`` runs every ``locate`` and returns one ``Probe`` per seam; ``PatchSet``
applies the patches of a fitting probe list all at once (or none) and takes them back.
A plugin that does not fit changes nothing: the engine runs exactly as without it, and
the warning names each seam that moved (``describe_problems``). ``report`` prints the
whole table (``tools/engine_seams.py``, ``make engines-latest``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["Patch", "Seam", "SeamAbsent", "SeamMoved", "Probe", "PatchSet", "probe", "report",
           "describe_problems", "import_module", "params", "source_of"]


class SeamAbsent(Exception):
    """The seam's place does not exist in this engine release."""


class SeamMoved(Exception):
    """The seam's place exists but differs from what the plugin was written against."""


@dataclass(frozen=True)
class Patch:
    """``setattr(owner, attribute, value)``, undone by putting the old value back."""

    owner: Any
    attribute: str
    value: Any


@dataclass(frozen=True)
class Seam:
    """One place of an engine a plugin relies on.

    ``name``: where (a dotted path). ``change``: what the plugin puts there (empty for a
    route: an engine API the plugin uses as it is). ``reason``: why no official hook does
    it, or which official route it is. ``upstream``: the hunk of the project's upstream
    patch that would make it unnecessary (empty: none needed). ``locate``: inspects the
    engine, returns the patches, raises ``SeamAbsent`` / ``SeamMoved``.
    """

    name: str
    change: str
    reason: str
    locate: Callable[[], Sequence[Patch]]
    upstream: str = ""
    optional: bool = False

    @property
    def is_route(self) -> bool:
        return not self.change


@dataclass(frozen=True)
class Probe:
    """What probing one seam found: ``state`` is ``ok``, ``absent`` or ``moved``."""

    seam: Seam
    state: str
    detail: str = ""
    patches: Tuple[Patch, ...] = ()

    @property
    def fits(self) -> bool:
        return self.state == "ok" or (self.state == "absent" and self.seam.optional)


def probe(seams: Sequence[Seam]) -> List[Probe]:
    """Locate every seam; never raises (an unexpected error counts as the seam moved)."""
    found: List[Probe] = []
    for seam in seams:
        try:
            patches = tuple(seam.locate())
        except SeamAbsent as e:
            found.append(Probe(seam, "absent", str(e)))
        except SeamMoved as e:
            found.append(Probe(seam, "moved", str(e)))
        except Exception as e:  # noqa: BLE001 - a probe that breaks is a seam that moved
            found.append(Probe(seam, "moved", f"probing raised {type(e).__name__}: {e}"))
        else:
            found.append(Probe(seam, "ok", "", patches))
    return found


def describe_problems(probes: Sequence[Probe]) -> str:
    """One line per seam that does not fit (empty when all fit)."""
    return "; ".join(f"{p.seam.name}: {p.state} ({p.detail})" for p in probes if not p.fits)


def report(probes: Sequence[Probe]) -> str:
    """A plain-text table: each seam, its state, what it changes, and what differs."""
    rows = [("seam", "state", "kind", "detail")]
    for p in probes:
        state = p.state + (" (optional)" if p.state == "absent" and p.seam.optional else "")
        rows.append((p.seam.name, state, "route" if p.seam.is_route else "changed", p.detail or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}"
                     for r in rows)


_MISSING = object()


@dataclass
class PatchSet:
    """The patches of a list of probes, applied together and undone together."""

    applied: List[Tuple[Any, str, Any]] = field(default_factory=list)

    def apply(self, probes: Sequence[Probe]) -> int:
        """Apply every fitting probe's patches; raises ValueError (nothing applied) if any
        probe does not fit. Returns the number of patches."""
        problems = describe_problems(probes)
        if problems:
            raise ValueError(f"seams do not fit: {problems}")
        for p in probes:
            for patch in p.patches:
                owner, name = patch.owner, patch.attribute
                old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
                self.applied.append((owner, name, old))
                setattr(owner, name, patch.value)
        return sum(len(p.patches) for p in probes)

    def undo(self) -> None:
        while self.applied:
            owner, name, old = self.applied.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def __bool__(self) -> bool:
        return bool(self.applied)


# ------------------------------------------------------------------ helpers for locate()
def import_module(name: str, *, absent_ok: bool = False) -> Any:
    """``importlib.import_module(name)``; a module that does not exist is ``SeamAbsent``
    (``absent_ok``) or ``SeamMoved``; one that fails to import is ``SeamMoved``."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise (SeamAbsent if absent_ok else SeamMoved)(f"no module {name}") from None
        raise SeamMoved(f"import {name} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise SeamMoved(f"import {name} failed: {type(e).__name__}: {e}") from None


def params(fn: Callable) -> List[str]:
    """The parameter names of ``fn`` (``SeamMoved`` if it has no signature)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise SeamMoved(f"{fn!r} has no signature: {e}") from None


def source_of(obj: Any) -> str:
    """The source text of ``obj`` (``SeamMoved`` if it cannot be read)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise SeamMoved(f"no source for {getattr(obj, '__qualname__', obj)!r}: {e}") from None


def require(condition: bool, what: str) -> None:
    """``SeamMoved(what)`` unless ``condition``."""
    if not condition:
        raise SeamMoved(what)


def attribute(owner: Any, name: str, what: Optional[str] = None) -> Any:
    """``getattr(owner, name)``, ``SeamMoved`` naming it when missing."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        where = getattr(owner, "__name__", None) or type(owner).__name__
        raise SeamMoved(what or f"{where}.{name} is missing")
    return value
