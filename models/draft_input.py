"""A served rank whose captures feed the draft's input projection, as the engines use them.

The packed ``[T, K*H]`` captures exist only to be projected by the draft (vLLM's Eagle3
``combine_hidden_states``: optional ``norm_before_fc`` over the concat, optional per-chunk
``fc_norm``, then ``fc``; DFlash: ``fc`` then ``hidden_norm``). ``TargetWithDraftInput`` runs
a ``models.engine`` rank and that combine at the end of its forward, and returns ``(hidden,
draft_input [T, H_draft])``:

- ``capture="none"``: the rank without captures and without the combine (the baseline);
- ``"list"``: the list path, the concat, then the combine (what the engines do today);
- ``"packer"``: ``AuxHiddenStatePacker``, then the combine;
- ``"projected"``: ``compile_pass.ProjectingAccumulator``, each capture projected as it is
  made (its result is the draft input; nothing of ``[T, K*H]`` exists);
- ``"projected_pairs"``: the same, handed ``append(hidden, residual)`` (vLLM's plugin's call).

``combine``: ``"plain"`` (fc with bias), ``"norm_before_fc"``, ``"fc_norms"``, ``"dflash"``.
The draft's weights are seeded apart from the target's.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

import torch.nn.functional as F

from compile_pass.projection import DraftProjection, ProjectingAccumulator, rms_norm
from models import engine
from models.engine import EngineConfig, EngineDecoder

__all__ = ["COMBINES", "CAPTURES", "FACTORY_NAMES", "DraftCombine", "TargetWithDraftInput", "tiny",
           "tiny_norm_before_fc", "tiny_fc_norms", "tp_rank"]

COMBINES = ("plain", "norm_before_fc", "fc_norms", "dflash")
CAPTURES = ("none", "list", "packer", "projected", "projected_pairs")


class DraftCombine(nn.Module):
    """The draft's input projection over ``K`` captures of ``hidden`` features."""

    def __init__(self, kind: str, num_captures: int, hidden: int, draft_hidden: int, eps: float = 1e-5,
                 dtype: torch.dtype = torch.float32, seed: int = 1) -> None:
        super().__init__()
        if kind not in COMBINES:
            raise ValueError(f"unknown combine {kind!r}: expected one of {', '.join(COMBINES)}")
        g = torch.Generator().manual_seed(seed)
        self.kind, self.num_captures, self.eps = kind, num_captures, eps
        width = num_captures * hidden

        def weight(*shape: int, scale: float = 1.0) -> nn.Parameter:
            return nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype), requires_grad=False)

        self.fc_weight = weight(draft_hidden, width, scale=width ** -0.5)
        self.fc_bias = weight(draft_hidden, scale=0.1) if kind == "plain" else None
        self.norm_before_fc = weight(width, scale=0.1) if kind == "norm_before_fc" else None
        self.fc_norms = nn.ParameterList(weight(hidden, scale=0.1) for _ in range(num_captures)) \
            if kind == "fc_norms" else None
        self.norm_after_fc = weight(draft_hidden, scale=0.1) if kind == "dflash" else None
        with torch.no_grad():
            for p in (self.norm_before_fc, self.norm_after_fc, *(self.fc_norms or ())):
                if p is not None:
                    p.add_(1.0)

    def projection(self) -> DraftProjection:
        return DraftProjection.build(self.num_captures, self.fc_weight, fc_bias=self.fc_bias,
                                     norm_before_fc=self.norm_before_fc, fc_norms=self.fc_norms,
                                     norm_after_fc=self.norm_after_fc, eps=self.eps)

    def accumulator(self) -> ProjectingAccumulator:
        return ProjectingAccumulator(self.num_captures, self.fc_weight, fc_bias=self.fc_bias,
                                     norm_before_fc=self.norm_before_fc, fc_norms=self.fc_norms,
                                     norm_after_fc=self.norm_after_fc, eps=self.eps)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        """The draft's own code path, as the engines write it: the norm(s), then ``fc``."""
        x = packed
        if self.norm_before_fc is not None:
            x = rms_norm(x, self.norm_before_fc, self.eps)
        elif self.fc_norms is not None:
            x = torch.cat([rms_norm(c, w, self.eps) for c, w in
                           zip(x.split(x.shape[-1] // self.num_captures, dim=-1), self.fc_norms)], dim=-1)
        out = F.linear(x, self.fc_weight, self.fc_bias)
        if self.norm_after_fc is not None:
            out = rms_norm(out, self.norm_after_fc, self.eps)
        return out


class TargetWithDraftInput(nn.Module):
    """``models.engine`` rank ``cfg`` whose captures feed ``DraftCombine(combine)``."""

    def __init__(self, cfg: EngineConfig, combine: str, capture: str, draft_hidden: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if capture not in CAPTURES:
            raise ValueError(f"unknown capture {capture!r}: expected one of {', '.join(CAPTURES)}")
        self.capture = capture
        mode = {"none": "none", "list": "list", "packer": "packer", "projected": "none",
                "projected_pairs": "none"}[capture]
        self.target = EngineDecoder(cfg, mode, dtype=dtype)
        self.combine = DraftCombine(combine, len(cfg.layers_to_capture), cfg.hidden_size, draft_hidden,
                                    eps=cfg.rms_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if self.capture in ("projected", "projected_pairs"):
            return self.target(input_ids, positions, aux=self.combine.accumulator(),
                               pairs=self.capture == "projected_pairs")
        hidden, packed = self.target(input_ids, positions)
        return hidden, (self.combine(packed) if packed is not None else None)


FACTORY_NAMES = ("tiny", "tiny_norm_before_fc", "tiny_fc_norms", "tp_rank")


def tiny(tokens: int = 32, k: int = 3, combine: str = "plain", dtype: torch.dtype = torch.float32,
         capture: str = "list") -> Tuple[TargetWithDraftInput, Tuple[torch.Tensor, torch.Tensor]]:
    """An 8-layer engine-shaped rank (hidden 128) whose K captures feed ``combine``;
    ``(model, (input_ids, positions))`` for the diff tool:
    ``python -m compile_pass diff models.draft_input:tiny --fuse-projection``."""
    cfg = engine.with_captures(engine.scaled(engine.llama_3_1_70b(tp=8, num_layers=8), 64), k)
    torch.manual_seed(0)
    model = TargetWithDraftInput(cfg, combine, capture, int(cfg.hidden_size * 0.75), dtype=dtype).eval()
    return model, engine.example_inputs(cfg, tokens)


def tiny_norm_before_fc(tokens: int = 32) -> Tuple[TargetWithDraftInput, Tuple[torch.Tensor, torch.Tensor]]:
    """``tiny`` with Eagle3's RMSNorm over the concat before ``fc``:
    ``python -m compile_pass diff models.draft_input:tiny_norm_before_fc --fuse-projection``."""
    return tiny(tokens, combine="norm_before_fc")


def tiny_fc_norms(tokens: int = 32) -> Tuple[TargetWithDraftInput, Tuple[torch.Tensor, torch.Tensor]]:
    """``tiny`` with one RMSNorm per capture before ``fc`` (vLLM's ``fc_norm``)."""
    return tiny(tokens, combine="fc_norms")


def tp_rank(tokens: int = 2048, k: int = 3, combine: str = "plain", dtype: torch.dtype = torch.bfloat16,
            capture: str = "list") -> Tuple[TargetWithDraftInput, Tuple[torch.Tensor, torch.Tensor]]:
    """One Llama 3.1 70B TP=8 rank scaled 1/8 (12 layers), as ``benchmarks/projection_memory.py``."""
    cfg = engine.with_captures(engine.scaled(engine.llama_3_1_70b(tp=8, num_layers=12), 8), k)
    torch.manual_seed(0)
    model = TargetWithDraftInput(cfg, combine, capture, int(cfg.hidden_size * 0.75), dtype=dtype).eval()
    return model, engine.example_inputs(cfg, tokens)
