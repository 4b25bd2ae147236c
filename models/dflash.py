"""DFlash-style capture: the Llama model capturing K >= 5 layers spread over its depth.

DFlash drafts read more target layers than Eagle3's three; the capture layers are
:func:`models.common.dflash_capture_layers` ``(L, k)``. Everything else (forward
signature, output convention, capture modes) is :class:`models.llama.LlamaModel`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch

from models.common import dflash_capture_layers
from models.llama import (
    LlamaConfig,
    LlamaModel,
    build_model,
    capture_dominated_config as _llama_capture_dominated_config,
    example_inputs,
    tiny_config as _llama_tiny_config,
)

__all__ = [
    "FACTORY_NAMES",
    "capture_dominated",
    "capture_dominated_config",
    "dflash_config",
    "example_inputs",
    "tiny",
    "tiny_config",
]

FACTORY_NAMES = ("tiny", "capture_dominated")


def dflash_config(base: LlamaConfig, k: int = 5) -> LlamaConfig:
    """``base`` with ``capture_layers = dflash_capture_layers(base.num_layers, k)``."""
    return dataclasses.replace(base, capture_layers=dflash_capture_layers(base.num_layers, k))


def tiny_config(k: int = 5, **overrides) -> LlamaConfig:
    """Tiny Llama with 10 layers capturing k=5: layers [1, 3, 4, 6, 7]."""
    overrides.setdefault("num_layers", 10)
    return dflash_config(_llama_tiny_config(**overrides), k)


def capture_dominated_config(k: int = 8, **overrides) -> LlamaConfig:
    """Capture-dominated Llama (12 layers) capturing k=8 layers spread over [1, 9]."""
    return dflash_config(_llama_capture_dominated_config(**overrides), k)


def tiny(
    capture_mode: str = "list",
    tokens: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    k: int = 5,
    **overrides,
) -> Tuple[LlamaModel, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`tiny_config` model and inputs; ``overrides`` replace Llama config fields."""
    return build_model(tiny_config(k, **overrides), capture_mode, tokens, dtype, seed, device)


def capture_dominated(
    capture_mode: str = "list",
    tokens: int = 8192,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    k: int = 8,
    **overrides,
) -> Tuple[LlamaModel, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`capture_dominated_config` model and inputs; ``overrides`` replace Llama config fields."""
    return build_model(capture_dominated_config(k, **overrides), capture_mode, tokens, dtype, seed, device)
