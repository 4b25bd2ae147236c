"""The kernels a serving engine calls in prefill, as custom ops for engine-shaped ranks.

Each op has a fake kernel (shapes only: tracing, the meta device, real-size estimates) and
a CPU kernel that works in row chunks and allocates what the GPU kernel it stands for
allocates: its output and nothing of full size (``_CHUNK`` rows of temporaries at most).
In-place ops declare what they mutate, as vLLM's and SGLang's do.

Namespace ``engine``:

- ``rms_norm(x, w, eps) -> out`` and ``fused_add_rms_norm_(x, residual, w, eps)``
  (in place: ``residual += x``, then ``x = rms_norm(residual) * w``);
- ``silu_and_mul(x) -> out``: ``silu(x[:, :d]) * x[:, d:]``, ``d = x.shape[-1] // 2``;
- ``rotary_embedding_(positions, x, cos_sin_cache, num_heads, head_dim, offset, stride)``:
  NeoX RoPE in place on ``num_heads`` heads of ``x`` from column ``offset``, ``stride``
  columns apart (the q and k heads of a fused qkv projection, or MLA's rope parts);
- ``attention(q, k, v, scale) -> out``: causal GQA over the ``T`` tokens, ``q [T, h, d]``,
  ``k, v [T, kv, d]``, online softmax over key chunks;
- ``mla_attention(q, kv, k_pe, scale) -> out``: DeepSeek's MLA prefill: ``q [T, h, n + r]``,
  ``kv [T, h, n + v]`` (k nope, then v), ``k_pe [T, r]`` shared by the heads;
- ``all_reduce_(x)``: the tensor-parallel all-reduce in place (SGLang's path for prefill
  sizes); one process here: it moves nothing and allocates nothing;
- ``all_reduce(x) -> out``: the out-of-place all-reduce (vLLM's functional collective):
  allocates its output, like the real one;
- ``topk_softmax(logits, k) -> (weights, ids)``: the router;
- ``fused_moe(x, weights, ids, w13, w2) -> out``: routed experts as one kernel that
  allocates its output only;
- ``fused_moe_workspace_(out, cache13, cache2, cache3, x, weights, ids, w13, w2)``: the same
  with the workspaces of vLLM's Triton fused-MoE (``[T, k, 2 * inter]``, ``[T * k, inter]``
  and ``[T, k, hidden]``, the per-choice outputs summed into ``out``) passed in, so that a
  graph holds them as values of its own;
- ``all_to_all_dispatch(x, ids) -> recv``, ``grouped_experts(recv, ids, w13, w2, first)
  -> y`` and ``all_to_all_combine(y, weights) -> out``: expert parallelism, one process: a
  rank receives ``T * k`` rows (as many as it sends on average; its own tokens' rows stand
  for every rank's), runs the experts it holds on them and sends the results back.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F

__all__ = ["CHUNK"]

#: rows per chunk of the CPU kernels
CHUNK = 256


def _chunks(n: int, size: int = CHUNK):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


# --------------------------------------------------------------------------- norms


@torch.library.custom_op("engine::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    for s, e in _chunks(x.shape[0]):
        out[s:e] = _rms(x[s:e], weight, eps)
    return out


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("engine::fused_add_rms_norm_", mutates_args=("x", "residual"))
def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    for s, e in _chunks(x.shape[0]):
        residual[s:e] += x[s:e]
        x[s:e] = _rms(residual[s:e], weight, eps)


@fused_add_rms_norm_.register_fake
def _(x, residual, weight, eps):
    return None


# --------------------------------------------------------------------------- MLP


@torch.library.custom_op("engine::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], d))
    for s, e in _chunks(x.shape[0]):
        out[s:e] = F.silu(x[s:e, :d]) * x[s:e, d:]
    return out


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# --------------------------------------------------------------------------- RoPE


@torch.library.custom_op("engine::rotary_embedding_", mutates_args=("x",))
def rotary_embedding_(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                      num_heads: int, head_dim: int, offset: int, head_stride: int) -> None:
    """Head ``i`` is ``x[:, offset + i * head_stride:][:, :head_dim]``; its first
    ``cos_sin_cache.shape[-1]`` columns are rotated (NeoX halves)."""
    half = cos_sin_cache.shape[-1] // 2
    t = x.shape[0]
    heads = x.as_strided((t, num_heads, 2 * half), (x.stride(0), head_stride, 1),
                         x.storage_offset() + offset)
    for s, e in _chunks(t):
        cos, sin = cos_sin_cache[positions[s:e]].to(x.dtype).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rot = heads[s:e]
        x1, x2 = rot[..., :half].clone(), rot[..., half:].clone()
        rot[..., :half] = x1 * cos - x2 * sin
        rot[..., half:] = x2 * cos + x1 * sin


@rotary_embedding_.register_fake
def _(positions, x, cos_sin_cache, num_heads, head_dim, offset, head_stride):
    return None


# --------------------------------------------------------------------------- attention


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: torch.Tensor) -> None:
    """``out[t] = softmax(q[t] k[:t+1]^T * scale) v[:t+1]`` per head, in query chunks with an
    online softmax over key chunks. q ``[T, h, d]``, k ``[T, h, d]`` or ``[T, 1, d]``, v
    ``[T, h, dv]`` or ``[T, 1, dv]`` (broadcast over heads)."""
    t = q.shape[0]
    for qs, qe in _chunks(t, 64):
        qc = q[qs:qe].transpose(0, 1).float()  # [h, c, d]
        m = torch.full((qc.shape[0], qe - qs, 1), float("-inf"))
        denom = torch.zeros((qc.shape[0], qe - qs, 1))
        acc = torch.zeros((qc.shape[0], qe - qs, v.shape[-1]))
        for ks, ke in _chunks(qe, 256):
            kc = k[ks:ke].transpose(0, 1).float()  # [h or 1, c, d]
            vc = v[ks:ke].transpose(0, 1).float()
            scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
            rows = torch.arange(qs, qe).view(-1, 1)
            cols = torch.arange(ks, ke).view(1, -1)
            scores = scores.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            p = torch.exp(scores - m_new)
            correction = torch.exp(m - m_new)
            denom = denom * correction + p.sum(-1, keepdim=True)
            acc = acc * correction + torch.matmul(p, vc)
            m = m_new
        out[qs:qe] = (acc / denom).transpose(0, 1).to(out.dtype)


@torch.library.custom_op("engine::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    out = q.new_empty((q.shape[0], heads, v.shape[-1]))
    group = heads // kv_heads
    for g in range(kv_heads):
        hs = slice(g * group, (g + 1) * group)
        _causal_attention(q[:, hs], k[:, g:g + 1], v[:, g:g + 1], scale, out[:, hs])
    return out


@attention.register_fake
def _(q, k, v, scale):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


@torch.library.custom_op("engine::mla_attention", mutates_args=())
def mla_attention(q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, scale: float,
                  v_head_dim: int) -> torch.Tensor:
    nope = kv.shape[-1] - v_head_dim
    out = q.new_empty((q.shape[0], q.shape[1], v_head_dim))
    for h in range(q.shape[1]):  # one head at a time: k = [k_nope_h, k_pe]
        k = torch.cat([kv[:, h:h + 1, :nope], k_pe.unsqueeze(1)], dim=-1)
        _causal_attention(q[:, h:h + 1], k, kv[:, h:h + 1, nope:], scale, out[:, h:h + 1])
    return out


@mla_attention.register_fake
def _(q, kv, k_pe, scale, v_head_dim):
    return q.new_empty((q.shape[0], q.shape[1], v_head_dim))


# --------------------------------------------------------------------------- collectives


@torch.library.custom_op("engine::all_reduce_", mutates_args=("x",))
def all_reduce_(x: torch.Tensor) -> None:
    """One process: the sum over one rank is ``x`` itself."""


@all_reduce_.register_fake
def _(x):
    return None


@torch.library.custom_op("engine::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


# --------------------------------------------------------------------------- MoE


@torch.library.custom_op("engine::topk_softmax", mutates_args=())
def topk_softmax(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), ids


@topk_softmax.register_fake
def _(logits, k):
    return (logits.new_empty((logits.shape[0], k)),
            logits.new_empty((logits.shape[0], k), dtype=torch.long))


def _experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, out: torch.Tensor, first_expert: int = 0) -> None:
    """``out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for the experts this rank
    holds (``w13 [E, 2i, H]``, ``w2 [E, H, i]``, ids ``first_expert ..``), chunk by chunk."""
    for s, e in _chunks(x.shape[0]):
        acc = torch.zeros((e - s, out.shape[-1]), dtype=torch.float32)
        for j in range(ids.shape[1]):
            local = ids[s:e, j] - first_expert
            for expert in torch.unique(local).tolist():
                if not 0 <= expert < w13.shape[0]:
                    continue
                rows = (local == expert).nonzero().squeeze(1)
                h = F.linear(x[s:e][rows], w13[expert])
                y = F.linear(F.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:], w2[expert])
                acc[rows] += weights[s:e][rows, j:j + 1].float() * y.float()
        out[s:e] = acc.to(out.dtype)


@torch.library.custom_op("engine::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _experts(x, weights, ids, w13, w2, out)
    return out


@fused_moe.register_fake
def _(x, weights, ids, w13, w2):
    return torch.empty_like(x)


@torch.library.custom_op("engine::fused_moe_workspace_",
                         mutates_args=("out", "cache13", "cache2", "cache3"))
def fused_moe_workspace_(out: torch.Tensor, cache13: torch.Tensor, cache2: torch.Tensor,
                         cache3: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """``fused_moe`` writing ``out``; the workspaces are the Triton kernel's (their contents
    do not matter here, only that they exist while it runs)."""
    _experts(x, weights, ids, w13, w2, out)


@fused_moe_workspace_.register_fake
def _(out, cache13, cache2, cache3, x, weights, ids, w13, w2):
    return None


@torch.library.custom_op("engine::all_to_all_dispatch", mutates_args=())
def all_to_all_dispatch(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The ``T * k`` rows a rank receives, one per (token, choice), in token order."""
    return x.repeat_interleave(ids.shape[1], dim=0)


@all_to_all_dispatch.register_fake
def _(x, ids):
    return x.new_empty((x.shape[0] * ids.shape[1], x.shape[1]))


@torch.library.custom_op("engine::grouped_experts", mutates_args=())
def grouped_experts(recv: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    first_expert: int) -> torch.Tensor:
    """Each received row through its expert (rows of experts another rank holds: zero)."""
    out = torch.zeros_like(recv)
    flat = ids.reshape(-1) - first_expert
    for expert in torch.unique(flat).tolist():
        if not 0 <= expert < w13.shape[0]:
            continue
        rows = (flat == expert).nonzero().squeeze(1)
        for s, e in _chunks(rows.shape[0]):
            part = rows[s:e]
            h = F.linear(recv[part], w13[expert])
            out[part] = F.linear(F.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:], w2[expert])
    return out


@grouped_experts.register_fake
def _(recv, ids, w13, w2, first_expert):
    return torch.empty_like(recv)


@torch.library.custom_op("engine::all_to_all_combine", mutates_args=())
def all_to_all_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    k = weights.shape[1]
    out = y.new_empty((y.shape[0] // k, y.shape[1]))
    for s, e in _chunks(out.shape[0]):
        rows = y[s * k:e * k].view(e - s, k, -1).float()
        out[s:e] = (rows * weights[s:e].float().unsqueeze(-1)).sum(1).to(out.dtype)
    return out


@all_to_all_combine.register_fake
def _(y, weights):
    return y.new_empty((y.shape[0] // weights.shape[1], y.shape[1]))


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
