"""A DeepSeek-V2/V3-style decoder (MLA + MoE) whose residual stream is mutated in place.

Token layout is 1-D: ``forward(input_ids [T], positions [T])``, hidden states ``[T, hidden]``.

Residual stream, vLLM/SGLang style with the in-place fused kernel
``models::fused_add_rms_norm_(hidden, residual, w, eps)`` (``residual += hidden``, then
``hidden = rms_norm(residual) * w``, both in place):

- layer 0: ``residual = hidden`` (the embedding output, a fresh tensor, no clone needed)
  and ``hidden = rms_norm(hidden)`` out of place;
- every later layer input, every post-attention norm and the final norm call the
  in-place op, so after layer 0 **one** residual tensor is mutated through the whole forward.

Capture: at the input of each capture layer ``i``, after the input add-norm, the residual
holds ``hidden + residual`` (layer 0: the embedding output). It is captured with
``aux.capture(residual)``: :class:`~compile_pass.AuxHiddenStateList` clones it (a bare
``append`` would keep a reference that later in-place adds overwrite) and the packer
copies it into its slice. Those snapshots are the values the compiler pass must preserve.

MoE: softmax router, top-k, optional renormalisation, routed experts computed densely
(every expert on every token, weighted by a ``[T, E]`` routing matrix that is zero off the
top-k), plus shared experts. No data-dependent control flow; cost is ``E`` times a sparse
MoE, fine at tiny sizes. The first ``first_k_dense`` layers use a dense MLP.

MLA: q low-rank (``q_a_proj -> norm -> q_b_proj``, or ``q_proj`` if ``q_lora_rank`` is
None), ``kv_a_proj_with_mqa -> (compressed kv, k_rope)``, ``kv_a_layernorm``,
``kv_b_proj -> (k_nope, v)``, NeoX RoPE on the rope parts, attention through
``models::attention`` with qk head dim ``nope + rope`` and v head dim ``v_head_dim``.
DeepSeek-V3's sigmoid/grouped routing and YaRN are not modelled (values, not graph shape).

``forward`` returns ``(hidden_states, aux)`` like :class:`models.llama.LlamaModel`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import nn

from models.common import (
    build_seeded,
    example_inputs,
    RMSNorm,
    RotaryEmbedding,
    _softmax_scale,
    attention,
    check_capture_layers,
    check_capture_mode,
    eagle3_capture_layers,
    finish_aux,
    fused_add_rms_norm_,
    init_weights_,
    make_aux,
    rms_norm,
)
from models.llama import LlamaMLP

__all__ = [
    "FACTORY_NAMES",
    "DeepseekConfig",
    "DeepseekModel",
    "capture_dominated",
    "capture_dominated_config",
    "deepseek_v3_config",
    "example_inputs",
    "tiny",
    "tiny_config",
]

FACTORY_NAMES = ("tiny", "capture_dominated")

ForwardOutput = Tuple[torch.Tensor, Union[torch.Tensor, List[torch.Tensor], None]]


@dataclass
class DeepseekConfig:
    """DeepSeek-V2/V3 dimensions plus what to capture (``None`` -> Eagle3 default layers)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the first ``first_k_dense`` layers
    moe_intermediate_size: int  # each routed / shared expert
    num_layers: int
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense: int
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 8192
    capture_layers: Optional[List[int]] = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} not in [1, n_routed_experts={self.n_routed_experts}]"
            )
        self.layers_to_capture  # validate

    @property
    def layers_to_capture(self) -> Tuple[int, ...]:
        """The validated capture layer ids (ascending, distinct, in ``[0, num_layers)``)."""
        layers = self.capture_layers
        if layers is None:
            layers = eagle3_capture_layers(self.num_layers)
        return check_capture_layers(layers, self.num_layers)

    @property
    def num_captures(self) -> int:
        return len(self.layers_to_capture)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def tiny_config(**overrides) -> DeepseekConfig:
    """8 layers (captures [2, 4, 5]; layer 0 dense, 1-7 MoE with 4 experts, top-2)."""
    cfg = DeepseekConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_layers=8, num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense=1, max_position=4096,
    )
    return dataclasses.replace(cfg, **overrides)


def capture_dominated_config(**overrides) -> DeepseekConfig:
    """Cheap layers, small vocab: at thousands of tokens the captures dominate memory."""
    cfg = DeepseekConfig(
        vocab_size=256, hidden_size=256, intermediate_size=64, moe_intermediate_size=16,
        num_layers=12, num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense=1, max_position=32768,
    )
    return dataclasses.replace(cfg, **overrides)


def deepseek_v3_config(**overrides) -> DeepseekConfig:
    """DeepSeek-V3 dimensions (no MTP layer; ~670B parameters without lm_head)."""
    cfg = DeepseekConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_layers=61, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense=3, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position=163840,
    )
    return dataclasses.replace(cfg, **overrides)


class MLAttention(nn.Module):
    """Multi-head latent attention, unabsorbed (k_nope and v materialised per head).

    ``rotary_emb`` (over ``qk_rope_head_dim``) is shared by all layers of a model.
    """

    def __init__(self, cfg: DeepseekConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = _softmax_scale(self.qk_head_dim)
        h, nh = cfg.hidden_size, cfg.num_heads
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_head_dim, h, bias=False)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        nh = self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(-1, nh, self.qk_head_dim)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        compressed_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.rope], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv)).view(-1, nh, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, nh, self.rope)), dim=-1)
        out = attention(q, k, v.contiguous(), self.scale)
        return self.o_proj(out.view(-1, nh * self.v_head_dim))


class MoE(nn.Module):
    """Softmax top-k router over ``E`` stacked SwiGLU experts, computed densely, plus shared experts.

    ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` hold the routed experts (one
    parameter each, as fused-MoE kernels store them). Output:
    ``scaling * sum_{e in topk(t)} w_te * expert_e(x_t) + shared(x_t)``.
    """

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = nn.Linear(h, e, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = (
            LlamaMLP(h, i * cfg.n_shared_experts) if cfg.n_shared_experts > 0 else None
        )

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, E]``: the (renormalised) top-k softmax probabilities, zero elsewhere."""
        probs = self.gate(x).float().softmax(dim=-1)
        topk_w, topk_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, topk_ids, topk_w).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.routing_weights(x)  # [T, E]
        xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)  # [E, T, H]
        gate, up = torch.bmm(xe, self.w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
        expert_out = torch.bmm(nn.functional.silu(gate) * up, self.w_down.transpose(1, 2))  # [E, T, H]
        out = (expert_out * routing.t().unsqueeze(-1)).sum(dim=0)
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    """``norm_input`` (in-place add-norm) and ``forward`` (attention, in-place post-norm, MLP/MoE).

    ``norm_input(hidden, residual) -> (hidden, residual)``: for ``residual is None``
    returns ``(rms_norm(hidden), hidden)``; otherwise mutates both arguments in place
    and returns them. ``forward(positions, normed, residual) -> (mlp_out, residual)``
    mutates ``residual`` (adds the attention output) and returns it.
    """

    def __init__(self, cfg: DeepseekConfig, layer_id: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, rotary_emb)
        self.mlp: nn.Module = (
            LlamaMLP(cfg.hidden_size, cfg.intermediate_size) if layer_id < cfg.first_k_dense else MoE(cfg)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def norm_input(
        self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:
            return rms_norm(hidden_states, norm.weight, norm.eps), hidden_states
        fused_add_rms_norm_(hidden_states, residual, norm.weight, norm.eps)
        return hidden_states, residual

    def forward(
        self, positions: torch.Tensor, normed: torch.Tensor, residual: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        hidden_states = self.self_attn(positions, normed)
        norm = self.post_attention_layernorm
        fused_add_rms_norm_(hidden_states, residual, norm.weight, norm.eps)
        return self.mlp(hidden_states), residual


class DeepseekModel(nn.Module):
    """Embedding, decoder layers, final in-place add-norm; captures K aux hidden states.

    Same conventions as :class:`models.llama.LlamaModel`: settable validated
    ``capture_mode``, ``forward(input_ids, positions) -> (hidden [T, H], aux)``,
    Normal(0, 0.02) weights from the global RNG (fp32, cast to ``dtype``), inference-only,
    meta-device constructible.
    """

    def __init__(self, cfg: DeepseekConfig, capture_mode: str = "list", dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.config = cfg
        self.capture_layers: Tuple[int, ...] = cfg.layers_to_capture
        self._capture_set = frozenset(self.capture_layers)
        self.capture_mode = capture_mode
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope_theta)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, rotary_emb) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        init_weights_(self)
        self.requires_grad_(False)
        if dtype is not None:
            self.to(dtype)

    @property
    def capture_mode(self) -> str:
        return self._capture_mode

    @capture_mode.setter
    def capture_mode(self, mode: str) -> None:
        self._capture_mode = check_capture_mode(mode)

    @property
    def num_captures(self) -> int:
        return len(self.capture_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                aux_out: Optional[torch.Tensor] = None) -> ForwardOutput:
        """``input_ids``, ``positions``: ``[T]`` int64. Returns ``(hidden [T, H], aux)``.

        ``aux_out`` (capture_mode "packer" only): a static ``[max_tokens, K * hidden]``
        buffer; the captures are written into ``aux_out[:T]`` and ``aux`` is that view.
        """
        mode = self._capture_mode
        aux = make_aux(mode, self.num_captures, out=aux_out)
        hidden_states = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer.norm_input(hidden_states, residual)
            if aux is not None and i in self._capture_set:
                # Borrowed: later fused_add_rms_norm_ calls overwrite this residual.
                aux.capture(residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        fused_add_rms_norm_(hidden_states, residual, self.norm.weight, self.norm.eps)
        return hidden_states, finish_aux(mode, aux)


def build_model(
    cfg: DeepseekConfig,
    capture_mode: str = "list",
    tokens: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
) -> Tuple[DeepseekModel, Tuple[torch.Tensor, torch.Tensor]]:
    """Seeded :class:`DeepseekModel` (built on CPU, then moved) in eval mode, plus example inputs."""
    return build_seeded(DeepseekModel, cfg, capture_mode, tokens, dtype, seed, device)


def tiny(
    capture_mode: str = "list",
    tokens: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    **overrides,
) -> Tuple[DeepseekModel, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`tiny_config` model and inputs; ``overrides`` replace config fields."""
    return build_model(tiny_config(**overrides), capture_mode, tokens, dtype, seed, device)


def capture_dominated(
    capture_mode: str = "list",
    tokens: int = 8192,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    **overrides,
) -> Tuple[DeepseekModel, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`capture_dominated_config` model and inputs; ``overrides`` replace config fields."""
    return build_model(capture_dominated_config(**overrides), capture_mode, tokens, dtype, seed, device)
