"""Tensor-parallel :class:`~models.llama.LlamaModel` over ``torch.distributed`` (Megatron-style).

Each of ``tp_size`` ranks holds a shard of every decoder layer:

- column-parallel ``qkv_proj`` and ``gate_up_proj``: rank ``r`` keeps the rows of its
  ``num_heads / tp_size`` query heads, ``num_kv_heads / tp_size`` kv heads and
  ``intermediate_size / tp_size`` gate and up features (no communication);
- row-parallel ``o_proj`` and ``down_proj``: rank ``r`` keeps the matching input columns and
  computes a partial ``[T, hidden]`` sum, which :func:`all_reduce_sum` adds up over the ranks.

Embedding, norms and the rotary cache are replicated. After each all-reduce the residual stream is
the same on every rank, so the Eagle3 captures (``hidden_states + residual`` at the input of the
capture layers, taken after the all-reduce) and their concat are computed on every rank, and the
capture pass rewrites them on every rank.

The all-reduce is one call of the functional collective ``_c10d_functional::all_reduce``
(:data:`ALL_REDUCE_OP`) followed by ``_c10d_functional::wait_tensor``: no Python-side async
tensor and no in-place op, so Dynamo records both calls in the graph (``fullgraph=True``), eager
and compiled code run the same ops, and a backend that splits graphs at named ops (serving
engines split at all-reduce) can name :data:`ALL_REDUCE_OP`.

Numerics: the column-parallel matmuls compute each output element over the full hidden dim,
as the single-process model does, but a row-parallel matmul adds ``tp_size`` partial dot
products in a different order than one full matmul, so a TP model's outputs are close to,
not bitwise equal to, the single-process model's (ranks agree with each other bitwise: the
all-reduce hands every rank the same sum).

Weights come from a full model: :func:`shard_state_dict` slices its state for one rank and
:func:`shard_llama` builds the rank's :class:`TPLlamaModel` from it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from models.llama import LlamaConfig, LlamaDecoderLayer, LlamaModel
from models.common import RotaryEmbedding

__all__ = [
    "ALL_REDUCE_OP",
    "TPLlamaDecoderLayer",
    "TPLlamaModel",
    "all_reduce_sum",
    "check_tp",
    "local_config",
    "shard_llama",
    "shard_state_dict",
]

#: The op a graph splitter names to split at the all-reduce (``split_ops=[ALL_REDUCE_OP]``).
ALL_REDUCE_OP = "_c10d_functional::all_reduce"


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``x`` over the ranks of the process group named ``group_name``; a new tensor.

    Two functional ops, both recorded by Dynamo: ``_c10d_functional.all_reduce`` (returns a fresh
    tensor, ``x`` is not written) and ``_c10d_functional.wait_tensor`` (returns once it is summed).
    """
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def check_tp(cfg: LlamaConfig, tp_size: int, tp_rank: Optional[int] = None) -> None:
    """Raise ValueError unless ``cfg`` shards evenly over ``tp_size`` ranks (and ``tp_rank`` is one).

    Heads, kv heads and the intermediate size must each be multiples of ``tp_size`` (engines
    replicate kv heads when there are fewer than ranks; that is not modelled here).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if tp_rank is not None and (isinstance(tp_rank, bool) or not isinstance(tp_rank, int)
                                or not 0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp_size:
            raise ValueError(f"{name}={value} is not a multiple of tp_size={tp_size}")


def local_config(cfg: LlamaConfig, tp_size: int) -> LlamaConfig:
    """The per-rank shapes: heads, kv heads and intermediate size divided by ``tp_size``."""
    check_tp(cfg, tp_size)
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // tp_size, num_kv_heads=cfg.num_kv_heads // tp_size,
        intermediate_size=cfg.intermediate_size // tp_size,
    )


class TPLlamaDecoderLayer(LlamaDecoderLayer):
    """:class:`~models.llama.LlamaDecoderLayer` on local shapes, with an all-reduce after each
    row-parallel linear (``o_proj``, ``down_proj``): its outputs are full sums, equal on all ranks."""

    def __init__(self, local_cfg: LlamaConfig, rotary_emb: RotaryEmbedding, group_name: str) -> None:
        super().__init__(local_cfg, rotary_emb)
        self.group_name = group_name

    def forward(
        self, positions: torch.Tensor, normed: torch.Tensor, residual: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        attn_out = all_reduce_sum(self.self_attn(positions, normed), self.group_name)
        normed, residual = self._add_norm(self.post_attention_layernorm, attn_out, residual)
        return all_reduce_sum(self.mlp(normed), self.group_name), residual


class TPLlamaModel(LlamaModel):
    """One rank of a tensor-parallel :class:`~models.llama.LlamaModel`.

    ``forward`` is :meth:`LlamaModel.forward` unchanged (same capture loop, same ``(hidden,
    aux)`` outputs, full ``[T, hidden]`` and ``[T, K * hidden]`` on every rank); only the layers
    are :class:`TPLlamaDecoderLayer` on :func:`local_config` shapes. ``config`` is the full
    config, ``local_config`` the per-rank one. Weights start unset (random): load a shard with
    :func:`shard_llama` / :func:`shard_state_dict`. The process group named ``group_name``
    must exist before the first forward.
    """

    def __init__(self, cfg: LlamaConfig, tp_size: int, group_name: str, capture_mode: str = "list",
                 dtype: Optional[torch.dtype] = None) -> None:
        if not isinstance(group_name, str) or not group_name:
            raise TypeError(f"group_name must be a process group's name (a non-empty str), got {group_name!r}")
        local = local_config(cfg, tp_size)
        # embedding, rotary cache, final norm and capture set as the full model's (none of them
        # depends on the sharded sizes); the plain local layers are replaced below
        super().__init__(local, capture_mode=capture_mode)
        rotary_emb = self.layers[0].self_attn.rotary_emb
        self.layers = nn.ModuleList(TPLlamaDecoderLayer(local, rotary_emb, group_name)
                                    for _ in range(cfg.num_layers))
        self.config = cfg
        self.local_config = local
        self.tp_size = tp_size
        self.group_name = group_name
        self.requires_grad_(False)
        if dtype is not None:
            self.to(dtype)


def _rows(w: torch.Tensor, sizes: Tuple[int, ...], rank: int, tp_size: int) -> torch.Tensor:
    """Column-parallel shard of a fused ``[sum(sizes), in]`` weight: rank's chunk of each block."""
    return torch.cat([block.chunk(tp_size, dim=0)[rank] for block in w.split(list(sizes), dim=0)], dim=0)


def shard_state_dict(state: Dict[str, torch.Tensor], cfg: LlamaConfig, tp_rank: int,
                     tp_size: int) -> Dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s shard of a full :class:`LlamaModel` state dict (contiguous copies).

    ``qkv_proj``: the rank's q, k and v head rows, fused in that order; ``gate_up_proj``: its gate
    and up rows; ``o_proj`` / ``down_proj``: the matching input columns; everything else whole.
    Query head ``j`` of rank ``r`` keeps its GQA kv head because both are contiguous chunks.
    Raises ValueError for a config that does not shard evenly or a state of another shape.
    """
    check_tp(cfg, tp_size, tp_rank)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        "self_attn.qkv_proj.weight": (q + 2 * kv, cfg.hidden_size),
        "self_attn.o_proj.weight": (cfg.hidden_size, q),
        "mlp.gate_up_proj.weight": (2 * cfg.intermediate_size, cfg.hidden_size),
        "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
    }
    out: Dict[str, torch.Tensor] = {}
    for key, w in state.items():
        suffix = key.split(".", 2)[-1] if key.startswith("layers.") else None
        if suffix in expected and tuple(w.shape) != expected[suffix]:
            raise ValueError(f"{key} is {tuple(w.shape)}, the config needs {expected[suffix]}")
        if suffix == "self_attn.qkv_proj.weight":
            w = _rows(w, (q, kv, kv), tp_rank, tp_size)
        elif suffix == "mlp.gate_up_proj.weight":
            w = _rows(w, (cfg.intermediate_size, cfg.intermediate_size), tp_rank, tp_size)
        elif suffix in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w = w.chunk(tp_size, dim=1)[tp_rank]
        out[key] = w.contiguous().clone()
    return out


def shard_llama(full: LlamaModel, tp_rank: int, tp_size: int, group_name: str,
                capture_mode: Optional[str] = None) -> TPLlamaModel:
    """Rank ``tp_rank``'s :class:`TPLlamaModel` holding its shard of ``full``'s weights.

    Same config, dtype and device as ``full``; ``capture_mode`` defaults to ``full``'s. The
    shard loads strictly (every key, every shape), in eval mode.
    """
    if not isinstance(full, LlamaModel) or isinstance(full, TPLlamaModel):
        raise TypeError(f"shard_llama needs a full models.llama.LlamaModel, got {type(full).__name__}")
    cfg = full.config
    state = shard_state_dict(full.state_dict(), cfg, tp_rank, tp_size)
    param = next(full.parameters())
    with torch.device(param.device):
        tp = TPLlamaModel(cfg, tp_size, group_name, capture_mode=capture_mode or full.capture_mode,
                          dtype=param.dtype)
    tp.load_state_dict(state, strict=True)
    return tp.eval()
