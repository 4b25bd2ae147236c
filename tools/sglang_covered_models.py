"""Which SGLang model architectures the SGLang plugin packs, generated from the installed SGLang.

    ~/.cache/compile_pass/venv-sglang0.5.23/bin/python -m tools.sglang_covered_models

prints the covered-models block of docs/sglang.md (``tests/test_sglang.py`` checks the
docs hold exactly what this prints). Per architecture (each ``EntryClass`` of
``sglang.srt.models``, draft and MTP modules left out):

- whether SGLang can make it capture at all: its class has ``set_eagle3_layers_to_capture``,
  ``set_dflash_layers_to_capture`` or ``set_dspark_layers_to_capture`` (what the model
  runner calls); without one it is no Eagle3/DFlash target in this SGLang, whatever its
  loop looks like;
- the class that runs the capture loop: breadth first from the architecture's MRO through
  the model classes its source names (``LlamaForCausalLM`` -> ``LlamaModel``), the first
  whose own body shows a capture style (``sglang._style_of_source``, the rule
  ``sglang.capture_style`` applies at run time to the module holding ``layers_to_capture``);
- its style: ``AuxHiddenStateList`` (the plugin replaces the class: packed in place),
  ``plain list`` (the plugin adopts the list at the layer boundaries), ``packer`` (the model
  packs itself).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil
import re
import sys
import warnings
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Tuple

DRAFT_MODULES = re.compile(r"(_eagle3?|_nextn|_mtp|eagle)$")
DRAFT_CLASSES = re.compile(r"(NextN|MTP|Eagle3?)$")
SETTERS = ("set_eagle3_layers_to_capture", "set_dflash_layers_to_capture", "set_dspark_layers_to_capture")
PREFIX = "sglang.srt.models"


@dataclass(frozen=True)
class Architecture:
    name: str
    module: str
    settable: Tuple[str, ...]  # which of SETTERS it has ("eagle3", "dflash")
    loop: Optional[str]  # module.Class of the capture loop, None: not found
    style: Optional[str]


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _own_style(klass: type) -> Optional[str]:
    """The capture style ``klass``'s own body shows (not its bases')."""
    from compile_pass.integrations.sglang import _style_of_source

    return _style_of_source(_source(klass))


def loop_class(entry: type) -> Optional[type]:
    """The class whose ``forward`` runs ``entry``'s capture loop (see the module docstring)."""
    import torch


    seen = set()
    queue = deque([entry])
    while queue:
        for klass in queue.popleft().__mro__:
            if klass in seen or not klass.__module__.startswith(PREFIX):
                continue
            seen.add(klass)
            if _own_style(klass) is not None:
                return klass
            scope = vars(sys.modules[klass.__module__])
            for name in re.findall(r"\b([A-Z]\w*)\b", _source(klass)):
                found = scope.get(name)
                if isinstance(found, type) and issubclass(found, torch.nn.Module) \
                        and found.__module__.startswith(PREFIX):
                    queue.append(found)
    return None


def architectures() -> Tuple[List[Architecture], List[str]]:
    """Every architecture of the installed SGLang and the model modules that do not import."""
    from compile_pass.integrations.sglang import capture_style

    models = importlib.import_module(PREFIX)
    found: List[Architecture] = []
    broken: List[str] = []
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        if DRAFT_MODULES.search(info.name):
            continue
        try:
            module = importlib.import_module(f"{PREFIX}.{info.name}")
        except Exception:  # noqa: BLE001 - a CUDA-only import on this machine
            broken.append(info.name)
            continue
        entries = getattr(module, "EntryClass", None)
        for cls in entries if isinstance(entries, (list, tuple)) else [entries] if entries else []:
            if cls.__module__ != module.__name__ or DRAFT_CLASSES.search(cls.__name__):
                continue  # re-exported from another module (listed there), or a draft
            settable = tuple(s.split("_")[1] for s in SETTERS if hasattr(cls, s))
            loop = loop_class(cls)
            found.append(Architecture(cls.__name__, info.name, settable,
                                      f"{loop.__module__.rsplit('.', 1)[-1]}.{loop.__name__}" if loop else None,
                                      capture_style(loop) if loop else None))
    return found, broken


NOTES = {
    "AuxHiddenStateList": "packed in place: the plugin replaces SGLang's list class",
    "plain list": "a `[]` in forward: the list adopted at the layer boundaries and packed in place",
    "packer": "pack with SGLang's packer already: nothing to do",
    None: "no capture loop found by this generator (vision-language wrappers and hybrid "
          "models whose loop it does not follow): not claimed",
}


def markdown() -> str:
    archs, broken = architectures()
    lines = []
    targets = [a for a in archs if a.settable]
    for style in ("AuxHiddenStateList", "plain list", "packer", None):
        group = [a for a in targets if a.style == style]
        label = style or "not found"
        lines.append(f"- **{label}** ({len(group)}; {NOTES[style]}): "
                     + ", ".join(f"`{a.name}`" for a in group))
    not_targets = [a for a in archs if not a.settable and a.style is not None]
    lines.append(f"- **no way to set capture layers** ({len(not_targets)}; no "
                 f"`set_eagle3/dflash/dspark_layers_to_capture`: not a capture target in this "
                 f"SGLang, whatever its loop): "
                 + ", ".join(f"`{a.name}`" for a in not_targets))
    lines.append(f"- **not importable on this CPU** ({len(broken)} model files): "
                 + ", ".join(f"`{b}`" for b in broken))
    return "\n".join(lines)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(markdown())


if __name__ == "__main__":
    main()
