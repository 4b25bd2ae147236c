"""compile_pass: capture aux hidden states (Eagle3/DFlash) without the torch.cat memory spike.

Three ways in:
- eager: :class:`AuxHiddenStatePacker` in place of the capture list;
- compiled: ``torch.compile(model, backend="aux_capture")`` rewrites the append/cat pattern;
- debugging: ``python -m compile_pass diff`` shows what the pass did and saved.
"""

import logging

from compile_pass.backend import AuxCaptureBackend, aux_capture_backend
from compile_pass.capture_pass import PassResult, rewrite_graph, run_capture_pass
from compile_pass.explain import explain
from compile_pass.find import find_capture_groups, find_output_groups
from compile_pass.groups import Capture, CaptureGroup, Decision, GroupKind, Producer, Strategy
from compile_pass.inductor_pass import AuxCapturePass, CaptureTwinsPass
from compile_pass.memory import Peak, measure_peak
from compile_pass.split import SplitGraph, split_graph
from compile_pass.packer import (
    AuxCaptureError,
    AuxHiddenStateAccumulator,
    AuxHiddenStateList,
    AuxHiddenStatePacker,
    AuxHiddenStates,
    pack_aux_hidden_states,
)

logging.getLogger("compile_pass").addHandler(logging.NullHandler())

__all__ = [
    "AuxCaptureBackend",
    "AuxCapturePass",
    "CaptureTwinsPass",
    "Capture",
    "CaptureGroup",
    "Decision",
    "GroupKind",
    "PassResult",
    "Peak",
    "Producer",
    "Strategy",
    "aux_capture_backend",
    "explain",
    "find_capture_groups",
    "find_output_groups",
    "measure_peak",
    "rewrite_graph",
    "run_capture_pass",
    "split_graph",
    "SplitGraph",
    "AuxCaptureError",
    "AuxHiddenStateAccumulator",
    "AuxHiddenStateList",
    "AuxHiddenStatePacker",
    "AuxHiddenStates",
    "pack_aux_hidden_states",
]
