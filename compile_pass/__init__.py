"""compile_pass: capture aux hidden states (Eagle3/DFlash) without the torch.cat memory spike.

Three ways in:
- eager: :class:`AuxHiddenStatePacker` in place of the capture list;
- compiled: ``torch.compile(model, backend="aux_capture")`` rewrites the append/cat pattern;
- debugging: ``python -m compile_pass diff`` shows what the pass did and saved.
"""

import logging

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
    "AuxCaptureError",
    "AuxHiddenStateAccumulator",
    "AuxHiddenStateList",
    "AuxHiddenStatePacker",
    "AuxHiddenStates",
    "pack_aux_hidden_states",
]
