"""Reference decoder models that capture aux hidden states (Eagle3 / DFlash).

Plain PyTorch in the serving-engine 1-D token layout, traceable by Dynamo with
``fullgraph=True, dynamic=True``. Every model's ``forward(input_ids [T], positions [T])``
returns ``(hidden_states [T, hidden], aux)`` where ``aux`` depends on ``capture_mode``
(see :mod:`models.common`): ``[T, K * hidden]`` for "list" (cat in the model) and
"packer", a list of K ``[T, hidden]`` for "list_out", ``None`` for "none".

``FACTORIES`` maps a model name to its module; each module has factories ``tiny`` and
``capture_dominated`` (listed in its ``FACTORY_NAMES``) returning
``(model, (input_ids, positions))``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, Optional, Tuple, Union

import torch
from torch import nn

from models import common, deepseek, dflash, llama
from models.common import CAPTURE_MODES

__all__ = ["CAPTURE_MODES", "FACTORIES", "build", "common", "deepseek", "dflash", "llama"]

FACTORIES: Dict[str, ModuleType] = {"llama": llama, "deepseek": deepseek, "dflash": dflash}


def build(
    name: str,
    config_name: str = "tiny",
    capture_mode: str = "list",
    tokens: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    **overrides,
) -> Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor]]:
    """``FACTORIES[name].<config_name>(...)``; ``tokens=None`` uses the factory's default.

    Raises ValueError naming the choices for an unknown model or factory name.
    """
    if name not in FACTORIES:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(FACTORIES)}")
    module = FACTORIES[name]
    if config_name not in module.FACTORY_NAMES:
        raise ValueError(
            f"unknown config {config_name!r} for {name}; expected one of {', '.join(module.FACTORY_NAMES)}"
        )
    kwargs = dict(capture_mode=capture_mode, dtype=dtype, seed=seed, device=device, **overrides)
    if tokens is not None:
        kwargs["tokens"] = tokens
    return getattr(module, config_name)(**kwargs)
