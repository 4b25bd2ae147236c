"""compile_pass: capture aux hidden states (Eagle3/DFlash) without the torch.cat memory spike.

Three ways in:
- eager: :class:`AuxHiddenStatePacker` in place of the capture list;
- compiled: ``torch.compile(model, backend="aux_capture")`` rewrites the append/cat pattern;
- debugging: ``python -m compile_pass diff`` shows what the pass did and saved.

Importing the package loads the eager packer only (what serving engines' model files
import); the compiler side (the backend, the passes, the diff tool), which imports
``torch._dynamo`` and ``torch._inductor``, loads on first use of one of its names.
"""

import importlib
import logging
from typing import Any, List

from compile_pass.packer import (
    AuxCaptureError,
    AuxHiddenStateAccumulator,
    AuxHiddenStateList,
    AuxHiddenStatePacker,
    AuxHiddenStates,
    pack_aux_hidden_states,
    packed_view,
)

logging.getLogger("compile_pass").addHandler(logging.NullHandler())

#: public name -> the module that defines it, imported on first use
_LAZY = {
    "AuxCaptureBackend": "compile_pass.backend",
    "aux_capture_backend": "compile_pass.backend",
    "Build": "compile_pass.inductor_pass",
    "InductorPassSet": "compile_pass.inductor_pass",
    "inductor_pass_set": "compile_pass.inductor_pass",
    "keep_outputs_distinct": "compile_pass.distinct_outputs",
    "DraftProjection": "compile_pass.projection",
    "ProjectingAccumulator": "compile_pass.projection",
    "PassResult": "compile_pass.result",
    "rewrite_graph": "compile_pass.capture_pass",
    "run_capture_pass": "compile_pass.capture_pass",
    "explain": "compile_pass.explainer",
    "find_capture_groups": "compile_pass.find",
    "find_output_groups": "compile_pass.find",
    "Capture": "compile_pass.groups",
    "CaptureGroup": "compile_pass.groups",
    "Decision": "compile_pass.groups",
    "Rejection": "compile_pass.groups",
    "GroupKind": "compile_pass.groups",
    "Producer": "compile_pass.groups",
    "Strategy": "compile_pass.groups",
    "Peak": "compile_pass.memory",
    "measure_peak": "compile_pass.memory",
    "SplitGraph": "compile_pass.split",
    "split_graph": "compile_pass.split",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compile_pass' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AuxCaptureError",
    "AuxHiddenStateAccumulator",
    "AuxHiddenStateList",
    "AuxHiddenStatePacker",
    "AuxHiddenStates",
    "pack_aux_hidden_states",
    "packed_view",
    *_LAZY,
]
