"""Engine-shaped decoders: one tensor-parallel rank of a served model, run as SGLang and
vLLM run prefill, capturing Eagle3 / DFlash aux hidden states.

What makes a rank engine-shaped (and unlike ``models.llama`` / ``models.deepseek``, which
stay as tests of generality):

- per-rank sizes: column-parallel projections (qkv, gate_up, MLA's q_b / kv_b) keep
  ``1 / tp`` of their outputs, row-parallel ones (o_proj, down) ``1 / tp`` of their inputs
  and produce a partial ``[T, hidden]`` sum that an all-reduce adds up; the hidden state,
  the residual, every capture and the packed buffer stay ``[T, hidden]``;
- fused kernels as custom ops (``models.engine_ops``): in-place fused add-RMSNorm (the
  residual stream is one tensor mutated through the forward), fused SiLU-and-mul, in-place
  RoPE on the qkv projection, attention allocating its output only;
- the all-reduce in place (``all_reduce="inplace"``, SGLang's path for prefill sizes) or
  out of place (``"functional"``, vLLM's functional collective, which allocates its output);
- captures of ``hidden + residual`` at the start of the capture layers, their concat after
  the final norm (what a logits processor does), logits of the last token of each
  sequence in ``compute_logits``, outside the forward (as vLLM's runner calls it).

Configs: Llama 3.1 8B / 70B / 405B, and DeepSeek-V3 (MLA; ``moe`` one of ``"tp_workspace"``:
tensor-parallel experts in one fused kernel with the Triton kernel's workspaces held by the
graph, ``"output_only"``: the same kernel allocating its output only, ``"dp_ep"``:
data-parallel attention (all heads on the rank's own tokens) and 8-way expert parallelism
with all-to-all dispatch and combine). Real sizes are built on the meta device (traced,
estimated: ``benchmarks/real_size_estimates.py``); ``scaled(cfg, factor)`` shrinks widths
for CPU runs.

``forward(input_ids [T], positions [T], aux_out=None)`` returns ``(hidden [T, hidden],
aux)``, ``aux`` per ``models.common.finish_aux`` (capture modes of ``models.common``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

import models.engine_ops  # noqa: F401  (registers the engine:: ops)
from models.common import (
    check_capture_layers, check_capture_mode, dflash_capture_layers, eagle3_capture_layers,
    finish_aux, make_aux,
)
from models.engine_ops import softmax_scale

__all__ = ["EngineConfig", "EngineDecoder", "MOE_KINDS", "ALL_REDUCE_KINDS", "llama_3_1_8b",
           "llama_3_1_70b", "llama_3_1_405b", "deepseek_v3", "scaled", "with_captures",
           "build", "example_inputs", "SERVED"]

MOE_KINDS = ("tp_workspace", "output_only", "dp_ep")
ALL_REDUCE_KINDS = ("inplace", "functional")
ops = torch.ops.engine


@dataclass(frozen=True)
class EngineConfig:
    """A served model and how one rank of it is cut (``tp``; ``moe="dp_ep"``: ``ep``)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tp: int = 1
    all_reduce: str = "inplace"
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position: int = 16384
    capture_layers: Optional[Tuple[int, ...]] = None  # None: Eagle3's default
    # MLA (attention="mla")
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE (moe is not None)
    moe: Optional[str] = None
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0
    ep: int = 1

    def __post_init__(self) -> None:
        if self.all_reduce not in ALL_REDUCE_KINDS:
            raise ValueError(f"all_reduce must be one of {ALL_REDUCE_KINDS}, got {self.all_reduce!r}")
        if self.moe is not None and self.moe not in MOE_KINDS:
            raise ValueError(f"moe must be None or one of {MOE_KINDS}, got {self.moe!r}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")
        for name, value in (("num_heads", self.num_heads // self.attention_tp * self.attention_tp),
                            ("intermediate_size", self.intermediate_size // self.tp * self.tp)):
            if value != getattr(self, name):
                raise ValueError(f"{name} {getattr(self, name)} does not split over tp={self.tp}")
        if self.moe == "dp_ep" and self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts do not split over ep={self.ep}")
        self.layers_to_capture  # validate

    # ------------------------------------------------------------------ per rank

    @property
    def attention_tp(self) -> int:
        """Ranks the attention heads are split over (DP attention: none)."""
        return 1 if self.moe == "dp_ep" else self.tp

    @property
    def heads(self) -> int:
        return self.num_heads // self.attention_tp

    @property
    def kv_heads(self) -> int:
        """KV heads on a rank: replicated where there are fewer than ranks."""
        return max(1, self.num_kv_heads // self.attention_tp)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.tp

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep if self.moe == "dp_ep" else self.num_experts

    @property
    def expert_intermediate(self) -> int:
        return self.moe_intermediate_size if self.moe == "dp_ep" else self.moe_intermediate_size // self.tp

    @property
    def layers_to_capture(self) -> Tuple[int, ...]:
        layers = self.capture_layers if self.capture_layers is not None \
            else eagle3_capture_layers(self.num_layers)
        return check_capture_layers(layers, self.num_layers)

    @property
    def num_captures(self) -> int:
        return len(self.layers_to_capture)

    def describe(self) -> str:
        rank = f"TP={self.tp}" if self.moe != "dp_ep" else f"DP-attention + EP={self.ep}"
        moe = f", MoE {self.moe}" if self.moe else ""
        return f"{self.name} {rank}{moe}, all-reduce {self.all_reduce}, K={self.num_captures}"


# --------------------------------------------------------------------------- configs


def llama_3_1_8b(tp: int = 1, **overrides) -> EngineConfig:
    cfg = EngineConfig("llama-3.1-8b", 128256, 4096, 32, 32, 8, 128, 14336, tp=tp)
    return dataclasses.replace(cfg, **overrides)


def llama_3_1_70b(tp: int = 8, **overrides) -> EngineConfig:
    cfg = EngineConfig("llama-3.1-70b", 128256, 8192, 80, 64, 8, 128, 28672, tp=tp)
    return dataclasses.replace(cfg, **overrides)


def llama_3_1_405b(tp: int = 8, **overrides) -> EngineConfig:
    cfg = EngineConfig("llama-3.1-405b", 128256, 16384, 126, 128, 8, 128, 53248, tp=tp)
    return dataclasses.replace(cfg, **overrides)


def deepseek_v3(tp: int = 8, moe: str = "tp_workspace", **overrides) -> EngineConfig:
    cfg = EngineConfig(
        "deepseek-v3", 129280, 7168, 61, 128, 128, 192, 18432, tp=tp, rms_eps=1e-6,
        rope_theta=10000.0, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe=moe, num_experts=256,
        top_k=8, moe_intermediate_size=2048, num_shared_experts=1, first_k_dense=3,
        ep=8 if moe == "dp_ep" else 1)
    return dataclasses.replace(cfg, **overrides)


#: the served configurations of docs/scale.md: name -> config factory
SERVED = {"llama-3.1-8b": llama_3_1_8b, "llama-3.1-70b": llama_3_1_70b,
          "llama-3.1-405b": llama_3_1_405b, "deepseek-v3": deepseek_v3}


def scaled(cfg: EngineConfig, factor: int, **overrides) -> EngineConfig:
    """``cfg`` with every width divided by ``factor`` (heads keep their count, head dims
    shrink; per-rank proportions stay), a small vocabulary and position table: a rank that
    runs on a CPU with the shape of the served one."""
    def div(n: int) -> int:
        return max(1, n // factor) if n else 0

    small = dataclasses.replace(
        cfg, vocab_size=1024, hidden_size=div(cfg.hidden_size), head_dim=div(cfg.head_dim),
        intermediate_size=div(cfg.intermediate_size), max_position=8192,
        q_lora_rank=div(cfg.q_lora_rank), kv_lora_rank=div(cfg.kv_lora_rank),
        qk_nope_head_dim=div(cfg.qk_nope_head_dim),
        qk_rope_head_dim=max(2, div(cfg.qk_rope_head_dim)) if cfg.qk_rope_head_dim else 0,
        v_head_dim=div(cfg.v_head_dim), moe_intermediate_size=div(cfg.moe_intermediate_size),
        name=f"{cfg.name}/{factor}")
    return dataclasses.replace(small, **overrides)


def with_captures(cfg: EngineConfig, k: int) -> EngineConfig:
    """Eagle3's 3 layers for ``k == 3``, else DFlash's ``k`` layers spread over the depth."""
    layers = eagle3_capture_layers(cfg.num_layers) if k == 3 else dflash_capture_layers(cfg.num_layers, k)
    return dataclasses.replace(cfg, capture_layers=tuple(layers))


# --------------------------------------------------------------------------- model


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _all_reduce(cfg: EngineConfig, x: torch.Tensor, over: int) -> torch.Tensor:
    """The sum of ``x`` over ``over`` ranks, in place or not per ``cfg.all_reduce``."""
    if over == 1:
        return x
    if cfg.all_reduce == "inplace":
        ops.all_reduce_(x)
        return x
    return ops.all_reduce(x)


class _Attention(nn.Module):
    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.qkv = _weight((h + 2 * kv) * hd, cfg.hidden_size)
        self.o = _weight(cfg.hidden_size, h * hd)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        h, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
        qkv = F.linear(x, self.qkv)
        ops.rotary_embedding_(positions, qkv, cos_sin, h + kv, hd, 0, hd)  # q and k heads, in place
        t = qkv.shape[0]
        q = qkv[:, :h * hd].view(t, h, hd)
        k = qkv[:, h * hd:(h + kv) * hd].view(t, kv, hd)
        v = qkv[:, (h + kv) * hd:].view(t, kv, hd)
        out = ops.attention(q, k, v, softmax_scale(hd))
        return F.linear(out.view(t, h * hd), self.o)


class _MLAttention(nn.Module):
    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nope, rope, v = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_a = _weight(cfg.q_lora_rank, cfg.hidden_size)
        self.q_a_norm = nn.Parameter(torch.ones(cfg.q_lora_rank), requires_grad=False)
        self.q_b = _weight(h * (nope + rope), cfg.q_lora_rank)
        self.kv_a = _weight(cfg.kv_lora_rank + rope, cfg.hidden_size)
        self.kv_a_norm = nn.Parameter(torch.ones(cfg.kv_lora_rank), requires_grad=False)
        self.kv_b = _weight(h * (nope + v), cfg.kv_lora_rank)
        self.o = _weight(cfg.hidden_size, h * v)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        h, nope, rope, v = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        t = x.shape[0]
        q = F.linear(ops.rms_norm(F.linear(x, self.q_a), self.q_a_norm, cfg.rms_eps), self.q_b)
        kv_a = F.linear(x, self.kv_a)
        # RoPE in place on each head's rope part of q and on the shared k_pe
        ops.rotary_embedding_(positions, q, cos_sin, h, rope, nope, nope + rope)
        ops.rotary_embedding_(positions, kv_a, cos_sin, 1, rope, cfg.kv_lora_rank, rope)
        kv = F.linear(ops.rms_norm(kv_a[:, :cfg.kv_lora_rank], self.kv_a_norm, cfg.rms_eps), self.kv_b)
        out = ops.mla_attention(q.view(t, h, nope + rope), kv.view(t, h, nope + v),
                                kv_a[:, cfg.kv_lora_rank:], softmax_scale(nope + rope), v)
        return F.linear(out.view(t, h * v), self.o)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = _weight(2 * intermediate, hidden)
        self.down = _weight(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(ops.silu_and_mul(F.linear(x, self.gate_up)), self.down)


class _MoE(nn.Module):
    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__()
        self.cfg = cfg
        i = cfg.expert_intermediate
        self.gate = _weight(cfg.num_experts, cfg.hidden_size)
        self.w13 = _weight(cfg.local_experts, 2 * i, cfg.hidden_size)
        self.w2 = _weight(cfg.local_experts, cfg.hidden_size, i)
        self.shared = _MLP(cfg.hidden_size, cfg.num_shared_experts * i) if cfg.num_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, ids = ops.topk_softmax(F.linear(x, self.gate), cfg.top_k)
        if cfg.moe == "output_only":
            routed = ops.fused_moe(x, weights, ids, self.w13, self.w2)
        elif cfg.moe == "tp_workspace":
            t, i = x.shape[0], cfg.expert_intermediate
            routed = torch.empty_like(x)
            cache13 = x.new_empty((t, cfg.top_k, 2 * i))
            cache2 = x.new_empty((t * cfg.top_k, i))
            cache3 = x.new_empty((t, cfg.top_k, x.shape[1]))
            ops.fused_moe_workspace_(routed, cache13, cache2, cache3, x, weights, ids, self.w13, self.w2)
        else:  # dp_ep: this rank holds experts [0, local) and receives T * k rows
            recv = ops.all_to_all_dispatch(x, ids)
            routed = ops.all_to_all_combine(ops.grouped_experts(recv, ids, self.w13, self.w2, 0), weights)
        if self.shared is not None:
            routed = routed + self.shared(x)
        return routed


class _Layer(nn.Module):
    def __init__(self, cfg: EngineConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.attn = _MLAttention(cfg) if cfg.attention == "mla" else _Attention(cfg)
        if cfg.moe is not None and index >= cfg.first_k_dense:
            self.mlp: nn.Module = _MoE(cfg)
        else:
            self.mlp = _MLP(cfg.hidden_size, cfg.intermediate)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                cos_sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if residual is None:
            residual, hidden = hidden, ops.rms_norm(hidden, self.input_norm, cfg.rms_eps)
        else:
            ops.fused_add_rms_norm_(hidden, residual, self.input_norm, cfg.rms_eps)
        hidden = _all_reduce(cfg, self.attn(positions, hidden, cos_sin), cfg.attention_tp)
        ops.fused_add_rms_norm_(hidden, residual, self.post_norm, cfg.rms_eps)
        mlp_tp = 1 if isinstance(self.mlp, _MoE) and cfg.moe == "dp_ep" else cfg.tp
        return _all_reduce(cfg, self.mlp(hidden), mlp_tp), residual


class EngineDecoder(nn.Module):
    """One rank of ``cfg`` (see the module docstring). Weights are Normal(0, 0.02) from the
    global RNG (norm weights 1) in fp32, cast to ``dtype``; on the meta device nothing is
    drawn. Inference only."""

    def __init__(self, cfg: EngineConfig, capture_mode: str = "list",
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.config = cfg
        self.capture_mode = check_capture_mode(capture_mode)
        self.capture_layers = cfg.layers_to_capture
        self.embed = _weight(cfg.vocab_size // cfg.attention_tp, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.lm_head = _weight(cfg.vocab_size // cfg.tp, cfg.hidden_size)
        rot = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        for p in self.parameters():
            if p.dim() >= 2 and p.device.type != "meta":
                nn.init.normal_(p, std=0.02)
        if dtype is not None:
            self.to(dtype)

    @property
    def num_captures(self) -> int:
        return len(self.capture_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                aux_out: Optional[torch.Tensor] = None, aux: Any = None, pairs: bool = False):
        """``aux``: a collector to capture into instead of the capture mode's (anything with
        ``append`` / ``capture`` / ``finalize``, e.g. a ``ProjectingAccumulator``); the
        forward then returns its ``finalize()``. ``pairs``: hand it ``append(hidden,
        residual)`` (as vLLM's ``_maybe_add_hidden_state`` does) instead of the formed sum."""
        cfg = self.config
        collector_given = aux is not None
        if not collector_given:
            aux = make_aux(self.capture_mode, self.num_captures, out=aux_out)
        # vocab-parallel embedding: this rank's rows, then the all-reduce
        hidden = F.embedding(input_ids % self.embed.shape[0], self.embed)
        hidden = _all_reduce(cfg, hidden, cfg.attention_tp)
        residual: Optional[torch.Tensor] = None
        for i, layer in enumerate(self.layers):
            if aux is not None and i in self.capture_layers:
                if residual is None:
                    aux.capture(hidden)  # the embedding becomes the residual, mutated later
                elif pairs:
                    aux.append(hidden, residual)
                else:
                    aux.append(hidden + residual)
            hidden, residual = layer(positions, hidden, residual, self.cos_sin)
        ops.fused_add_rms_norm_(hidden, residual, self.final_norm, cfg.rms_eps)
        if collector_given:
            return hidden, aux.finalize()
        return hidden, finish_aux(self.capture_mode, aux)  # the logits processor's concat

    def compute_logits(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary shard for the last token of each sequence."""
        return F.linear(hidden[last_token_index], self.lm_head)


def example_inputs(cfg: EngineConfig, tokens: int, device: Union[str, torch.device, None] = None,
                   seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    positions = torch.arange(tokens) % cfg.max_position
    return ids.to(device), positions.to(device)


def build(cfg: EngineConfig, capture_mode: str = "list", tokens: int = 64,
          dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          device: Union[str, torch.device, None] = None
          ) -> Tuple[EngineDecoder, Tuple[torch.Tensor, torch.Tensor]]:
    """A seeded rank of ``cfg`` and its example inputs; ``device="meta"``: real sizes, no memory."""
    torch.manual_seed(seed)
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            model = EngineDecoder(cfg, capture_mode, dtype=dtype).eval()
    else:
        model = EngineDecoder(cfg, capture_mode, dtype=dtype).eval()
        if device is not None:
            model.to(device)
    return model, example_inputs(cfg, tokens, device, seed)
