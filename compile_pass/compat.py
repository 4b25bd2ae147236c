"""The private torch APIs the pass relies on, checked before it runs.

The pass reads and edits compiler internals that move between torch releases (post-grad
pass hooks, functionalization's higher-order ops, fake-tensor metadata, AOTAutograd's
Dynamo bookkeeping). ``missing_private_apis()`` probes each one the pass uses; the
``aux_capture`` backend calls it on its first compile and, where one is missing or changed,
warns once (naming the API, what uses it and the torch version) and compiles without the
pass: never a failed compile. ``docs/design.md`` lists the same table.
"""

from __future__ import annotations

import functools
import importlib
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["PrivateAPI", "PRIVATE_APIS", "missing_private_apis", "warn_once_if_unsupported"]

log = logging.getLogger("compile_pass")


@dataclass(frozen=True)
class PrivateAPI:
    """``module.attr`` (dotted attribute path after the module) and who needs it."""

    module: str
    attr: str
    used_by: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module

    def present(self) -> bool:
        try:
            value = importlib.import_module(self.module)
            for part in self.attr.split(".") if self.attr else ():
                value = getattr(value, part)
        except (ImportError, AttributeError):
            return False
        return True


PRIVATE_APIS: Tuple[PrivateAPI, ...] = (
    PrivateAPI("torch._inductor.custom_graph_pass", "CustomGraphPass",
               "inductor_pass.py: post-grad passes with a cache key"),
    PrivateAPI("torch._inductor.config", "post_grad_custom_pre_pass", "backend.py: CaptureTwinsPass"),
    PrivateAPI("torch._inductor.config", "post_grad_custom_post_pass", "backend.py: AuxCapturePass"),
    PrivateAPI("torch._inductor.compile_fx", "compile_fx", "backend.py: the inductor inner"),
    PrivateAPI("torch._inductor", "list_mode_options", "backend.py: torch.compile modes"),
    PrivateAPI("torch._dynamo.utils", "counters", "capture_pass.py: counters['aux_capture']"),
    PrivateAPI("torch._dynamo.utils", "GmWrapper", "backend.py: boxed pieces of split graphs"),
    PrivateAPI("torch._dynamo.backends.common", "aot_autograd", "backend.py: the aot_eager inner"),
    PrivateAPI("torch._ops", "HigherOrderOperator", "find.py, twins.py: functionalized custom ops"),
    PrivateAPI("torch._higher_order_ops.auto_functionalize", "",
               "reinplace.py, twins.py: auto_functionalized write_slice_"),
    PrivateAPI("torch._guards", "detect_fake_mode", "rewrite.py, find.py: fake values of new nodes"),
    PrivateAPI("torch._C._profiler", "_EventType", "memory.py: allocation events"),
    PrivateAPI("torch._logging", "trace_structured", "explainer.py: TORCH_TRACE artifacts"),
    PrivateAPI("torch.fx.experimental.symbolic_shapes", "ShapeEnv", "dataflow.py: size hints"),
)


def _dynamo_source_probe() -> Optional[str]:
    """AOTAutograd must accept a Dynamo graph input without a source (``lift.py`` makes
    one): ``_try_get_metadata_from_dynamo`` reads ``node._dynamo_source``."""
    try:
        frontend = importlib.import_module("torch._functorch._aot_autograd.frontend_utils")
    except ImportError:
        return "torch._functorch._aot_autograd.frontend_utils (lift.py: inputs made by the backend)"
    if not hasattr(frontend, "_try_get_metadata_from_dynamo"):
        return ("torch._functorch._aot_autograd.frontend_utils._try_get_metadata_from_dynamo "
                "(lift.py: inputs made by the backend)")
    return None


#: probes that are more than an attribute lookup: each returns what is missing, or None
_PROBES: Tuple[Callable[[], Optional[str]], ...] = (_dynamo_source_probe,)


def missing_private_apis() -> List[str]:
    """Each private API the pass uses that this torch lacks, as "name (used by)"."""
    missing = [f"{api.name} ({api.used_by})" for api in PRIVATE_APIS if not api.present()]
    missing += [m for m in (probe() for probe in _PROBES) if m is not None]
    return missing


@functools.lru_cache(maxsize=1)
def _checked() -> Tuple[str, ...]:
    """``missing_private_apis()`` once per process (``cache_clear()`` to check again)."""
    return tuple(missing_private_apis())


_warned: List[bool] = []


def warn_once_if_unsupported() -> bool:
    """True if the pass can run on this torch; else warn (once per process) naming what is
    missing, and return False: the caller compiles without the pass."""
    missing = _checked()
    if not missing:
        return True
    if not _warned:
        message = (f"compile_pass: torch {torch.__version__} lacks private APIs the capture pass "
                   f"uses: {'; '.join(missing)}. Compiling without the pass (the list path is kept).")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)
        _warned.append(True)
    return False
