"""A Llama-3-style decoder that captures Eagle3 aux hidden states, written like SGLang models.

Token layout is 1-D: ``forward(input_ids [T], positions [T])`` with hidden states
``[T, hidden]``. The residual stream is an SGLang-style ``(hidden_states, residual)`` pair;
the pre-norm sum ``hidden_states + residual`` at the input of layer ``i`` is what Eagle3
captures for each ``i`` in ``capture_layers`` (for layer 0, where there is no residual yet,
the embedding output ``hidden_states`` itself).

Two capture producers (``LlamaConfig.capture_producer``):

- ``"add"``: input norms are the pure-PyTorch :class:`~models.common.RMSNorm`; the capture
  is a separate ``aux.append(hidden_states + residual)`` before the layer, as SGLang does
  (a packer's ``slot`` takes the sum directly: ``torch.add(h, r, out=aux.slot(h))``).
- ``"fused_norm"``: input/post-attention norms are the functional custom op
  ``models::add_rms_norm``; the capture is its ``new_residual`` output, taken with
  ``aux.capture(new_residual, owned=True)`` (a fresh tensor, no clone): the capture
  producers are custom-op outputs.

Both producers, and all capture modes, compute the same values: final hidden states are
bitwise equal, and the packed captures are bitwise equal across list/packer/list_out.

``forward`` returns ``(hidden_states, aux)``: ``hidden_states`` is the final-normed
``[T, hidden]`` (no lm_head); ``aux`` per :func:`models.common.finish_aux`
(``[T, K * hidden]`` for list/packer, a list of K ``[T, hidden]`` for list_out, None for
none). The model is inference-only (parameters have ``requires_grad=False``).
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
    add_rms_norm,
    attention,
    check_capture_layers,
    check_capture_mode,
    eagle3_capture_layers,
    finish_aux,
    init_weights_,
    make_aux,
    rms_norm,
)

__all__ = [
    "FACTORY_NAMES",
    "CAPTURE_PRODUCERS",
    "LlamaConfig",
    "LlamaModel",
    "capture_dominated",
    "capture_dominated_config",
    "example_inputs",
    "llama_3_1_70b_config",
    "llama_3_1_8b_config",
    "tiny",
    "tiny_config",
]

CAPTURE_PRODUCERS = ("add", "fused_norm")
#: The factories a CLI may call by name: each returns ``(model, (input_ids, positions))``.
FACTORY_NAMES = ("tiny", "capture_dominated")

ForwardOutput = Tuple[torch.Tensor, Union[torch.Tensor, List[torch.Tensor], None]]


@dataclass
class LlamaConfig:
    """Llama dimensions plus what to capture.

    ``capture_layers=None`` means Eagle3's default for ``num_layers``
    (:func:`models.common.eagle3_capture_layers`); resolved by :attr:`layers_to_capture`
    so ``dataclasses.replace(cfg, num_layers=...)`` re-derives it.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position: int = 8192
    capture_layers: Optional[List[int]] = None
    capture_producer: str = "add"

    def __post_init__(self) -> None:
        if self.capture_producer not in CAPTURE_PRODUCERS:
            raise ValueError(
                f"unknown capture_producer {self.capture_producer!r}; expected one of {', '.join(CAPTURE_PRODUCERS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
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


def tiny_config(**overrides) -> LlamaConfig:
    """8 layers (captures [2, 4, 5]), hidden 64: a forward is milliseconds on CPU."""
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=8,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=4096,
    )
    return dataclasses.replace(cfg, **overrides)


def capture_dominated_config(**overrides) -> LlamaConfig:
    """Cheap layers, small vocab: at thousands of tokens the captures dominate memory."""
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=64, num_layers=12,
        num_heads=2, num_kv_heads=1, head_dim=32, rope_theta=10000.0, max_position=32768,
    )
    return dataclasses.replace(cfg, **overrides)


def llama_3_1_8b_config(**overrides) -> LlamaConfig:
    """Llama 3.1 8B dimensions (rope scaling not modelled)."""
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_eps=1e-5, rope_theta=500000.0,
        max_position=131072,
    )
    return dataclasses.replace(cfg, **overrides)


def llama_3_1_70b_config(**overrides) -> LlamaConfig:
    """Llama 3.1 70B dimensions (rope scaling not modelled)."""
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_eps=1e-5, rope_theta=500000.0,
        max_position=131072,
    )
    return dataclasses.replace(cfg, **overrides)


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE, GQA through ``models::attention``, o_proj.

    ``rotary_emb`` is shared by all layers of a model (one cos/sin cache).
    """

    def __init__(self, cfg: LlamaConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = _softmax_scale(cfg.head_dim)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = attention(q, k, v, self.scale)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with a fused gate_up projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer, split so the model loop can capture between the input norm and the body.

    ``norm_input(hidden, residual) -> (normed, residual)`` does the input add-norm;
    ``forward(positions, normed, residual) -> (mlp_out, residual)`` does attention, the
    post-attention add-norm and the MLP. Neither mutates its arguments.
    """

    def __init__(self, cfg: LlamaConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.fused = cfg.capture_producer == "fused_norm"
        self.self_attn = LlamaAttention(cfg, rotary_emb)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def _add_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # layer 0: the residual stream starts as the embedding output
            return rms_norm(x, norm.weight, norm.eps), x
        if self.fused:
            return add_rms_norm(x, residual, norm.weight, norm.eps)
        return norm(x, residual)

    def norm_input(
        self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._add_norm(self.input_layernorm, hidden_states, residual)

    def forward(
        self, positions: torch.Tensor, normed: torch.Tensor, residual: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        attn_out = self.self_attn(positions, normed)
        normed, residual = self._add_norm(self.post_attention_layernorm, attn_out, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    """Embedding, ``num_layers`` decoder layers, final norm; captures K aux hidden states.

    ``capture_mode`` (one of :data:`models.common.CAPTURE_MODES`, settable; a bad value
    raises ValueError) chooses the accumulator; it changes neither the computed hidden
    states nor the captured values. Weights are Normal(0, 0.02) from the global RNG (norm
    weights 1), built in fp32 and cast to ``dtype``. Constructible on the meta device.
    """

    def __init__(self, cfg: LlamaConfig, capture_mode: str = "list", dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.config = cfg
        self.capture_layers: Tuple[int, ...] = cfg.layers_to_capture
        self._capture_set = frozenset(self.capture_layers)
        self.capture_mode = capture_mode
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary_emb) for _ in range(cfg.num_layers))
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
        fused = self.config.capture_producer == "fused_norm"
        hidden_states = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        for i, layer in enumerate(self.layers):
            capture = aux is not None and i in self._capture_set
            if capture and not fused:
                if residual is None:
                    aux.capture(hidden_states, owned=False)
                elif getattr(aux, "copies_on_append", False) and not torch.compiler.is_compiling():
                    # a packer hands out the slice: the sum is computed straight into it
                    # (eager only: Dynamo does not trace a non-contiguous out=)
                    torch.add(hidden_states, residual, out=aux.slot(hidden_states))
                else:
                    aux.append(hidden_states + residual)
            normed, new_residual = layer.norm_input(hidden_states, residual)
            if capture and fused:
                # layer 0's residual *is* the embedding output (borrowed); later ones are
                # fresh outputs of models::add_rms_norm.
                aux.capture(new_residual, owned=residual is not None)
            hidden_states, residual = layer(positions, normed, new_residual)
        if fused:
            hidden_states, _ = add_rms_norm(hidden_states, residual, self.norm.weight, self.norm.eps)
        else:
            hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, finish_aux(mode, aux)


def build_model(
    cfg: LlamaConfig,
    capture_mode: str = "list",
    tokens: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
) -> Tuple[LlamaModel, Tuple[torch.Tensor, torch.Tensor]]:
    """Seeded :class:`LlamaModel` (built on CPU, then moved) in eval mode, plus example inputs."""
    return build_seeded(LlamaModel, cfg, capture_mode, tokens, dtype, seed, device)


def tiny(
    capture_mode: str = "list",
    tokens: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    **overrides,
) -> Tuple[LlamaModel, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`tiny_config` model and inputs; ``overrides`` replace config fields (e.g. ``capture_producer``)."""
    return build_model(tiny_config(**overrides), capture_mode, tokens, dtype, seed, device)


def capture_dominated(
    capture_mode: str = "list",
    tokens: int = 8192,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    **overrides,
) -> Tuple[LlamaModel, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`capture_dominated_config` model and inputs; ``overrides`` replace config fields."""
    return build_model(capture_dominated_config(**overrides), capture_mode, tokens, dtype, seed, device)
