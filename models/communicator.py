"""A decoder written apart from ``models/``, in the style of SGLang's communicator models.

Per layer: an in-place fused add-RMSNorm custom op on ``(hidden, residual)``
(``residual += hidden; hidden = rmsnorm(residual) * w``), the capture
``residual.clone()`` right after it (the clone is needed: the next fused op overwrites the
residual), an opaque attention custom op, a second fused norm and an MLP. Split at
``comm_test::attention`` the residual is an input of every piece and the next piece mutates
it in place: the shape that exposed Inductor returning the residual itself for its clone
(``compile_pass/distinct_outputs.py``).

``CommunicatorDecoder(capture_at, cat_inside)`` returns ``(hidden, aux)``: ``aux`` the list
of captures, or their ``torch.cat`` when ``cat_inside``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_OPS = ["comm_test::attention"]


@torch.library.custom_op("comm_test::fused_add_rmsnorm_", mutates_args=("hidden", "residual"))
def fused_add_rmsnorm_(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    residual.add_(hidden)
    variance = residual.pow(2).mean(-1, keepdim=True)
    hidden.copy_(residual * torch.rsqrt(variance + 1e-6) * weight)


@fused_add_rmsnorm_.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    return None


@torch.library.custom_op("comm_test::attention", mutates_args=())
def attention(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.chunk(3, dim=-1)
    scores = (q @ k.transpose(0, 1)) / q.shape[-1] ** 0.5
    return scores.softmax(-1) @ v


@attention.register_fake
def _(qkv: torch.Tensor) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)


class _Layer(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm1 = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)


class CommunicatorDecoder(nn.Module):
    def __init__(self, num_layers: int = 4, hidden: int = 64, intermediate: int = 96,
                 capture_at: Sequence[int] = (0, 1, 3), cat_inside: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(_Layer(hidden, intermediate) for _ in range(num_layers))
        self.final_norm = nn.Parameter(torch.ones(hidden))
        self.capture_at = tuple(capture_at)
        self.cat_inside = cat_inside

    def forward(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, Union[torch.Tensor, List[torch.Tensor]]]:
        hidden = hidden.clone()
        residual = torch.zeros_like(hidden)
        aux: List[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            torch.ops.comm_test.fused_add_rmsnorm_(hidden, residual, layer.norm1)
            if i in self.capture_at:
                aux.append(residual.clone())
            hidden = layer.o(torch.ops.comm_test.attention(layer.qkv(hidden)))
            torch.ops.comm_test.fused_add_rmsnorm_(hidden, residual, layer.norm2)
            hidden = layer.down(F.silu(layer.up(hidden)))
        torch.ops.comm_test.fused_add_rmsnorm_(hidden, residual, self.final_norm)
        if self.cat_inside:
            return hidden, torch.cat(aux, dim=-1)
        return hidden, aux


def build(tokens: int = 64, **kwargs) -> Tuple[CommunicatorDecoder, torch.Tensor]:
    model = CommunicatorDecoder(**kwargs).eval()
    return model, torch.randn(tokens, model.layers[0].o.in_features)
