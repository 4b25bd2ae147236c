"""Building blocks shared by the reference decoder models.

Everything here is plain PyTorch in the 1-D token layout serving engines use: a batch is
``T`` tokens, hidden states are ``[T, hidden]``, and nothing branches on tensor values, so
Dynamo traces a whole forward with ``fullgraph=True, dynamic=True`` (``T`` symbolic).

Custom ops (registered on import, namespace ``models``):

- ``models::attention(q, k, v, scale)``: causal attention over the ``T`` tokens. Engines
  split their graphs at the attention op; a pass can do the same at this one.
- ``models::fused_add_rms_norm_(x, residual, weight, eps)``: in place, ``residual += x``
  then ``x = rms_norm(residual) * weight`` (the fused kernel vLLM/SGLang call).
- ``models::add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)``: the same
  computation, functional: two fresh tensors, no mutation.

All three compute the norm with :func:`rms_norm`, so the eager module, the functional op
and the in-place op give bitwise equal results for equal inputs.

Capture modes (how a model collects its K aux hidden states):

- ``"none"``: no capture; the model returns ``None`` for aux.
- ``"list"``: an :class:`~compile_pass.AuxHiddenStateList`; the model ends with
  ``torch.cat(aux, dim=-1)`` (the pattern the compiler pass rewrites).
- ``"packer"``: an :class:`~compile_pass.AuxHiddenStatePacker`; the model returns
  ``aux.finalize()`` (the eager fix). ``forward(..., aux_out=buf)`` hands the packer a
  caller-owned static buffer ``[max_tokens, K * hidden]`` (one buffer shared by every
  token count, as CUDA-graph runners need): the captures land in ``buf[:T]`` and the
  model returns that view (docs/cuda-graphs.md).
- ``"list_out"``: an :class:`~compile_pass.AuxHiddenStateList` returned as a plain Python
  list of the K captures; the caller packs it (``compile_pass.pack_aux_hidden_states``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from compile_pass import AuxHiddenStateList, AuxHiddenStatePacker

__all__ = [
    "CAPTURE_MODES",
    "AuxAccumulator",
    "RMSNorm",
    "RotaryEmbedding",
    "add_rms_norm",
    "apply_rotary",
    "attention",
    "check_capture_layers",
    "check_capture_mode",
    "dflash_capture_layers",
    "eagle3_capture_layers",
    "finish_aux",
    "fused_add_rms_norm_",
    "init_weights_",
    "make_aux",
    "rms_norm",
]

#: The ways a model can collect its aux hidden states; see the module docstring.
CAPTURE_MODES: Tuple[str, ...] = ("none", "list", "packer", "list_out")

#: What :func:`make_aux` returns for a capturing mode.
AuxAccumulator = Union[AuxHiddenStateList, AuxHiddenStatePacker]


# --------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in fp32, returned in ``x.dtype``.

    Never writes to ``x``; the result is a fresh tensor.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an optional residual add, SGLang-style.

    ``norm(x)`` returns ``rms_norm(x)``; ``norm(x, residual)`` returns
    ``(rms_norm(x + residual), x + residual)``. Neither form mutates its inputs.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        summed = x + residual
        return rms_norm(summed, self.weight, self.eps), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@torch.library.custom_op("models::fused_add_rms_norm_", mutates_args=("x", "residual"))
def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``.

    After the call ``residual`` holds the pre-norm sum (the value Eagle3 captures) and
    ``x`` the normed layer input; both tensors keep their storage. Later calls on the
    same ``residual`` overwrite it, so a capture of it must be a snapshot.
    """
    if x.shape != residual.shape:
        raise ValueError(f"x is {tuple(x.shape)}, residual is {tuple(residual.shape)}")
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


@fused_add_rms_norm_.register_fake
def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    return None


@torch.library.custom_op("models::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Functional add-RMSNorm: ``(rms_norm(x + residual) * weight, x + residual)``.

    Both outputs are fresh tensors (a custom op's outputs never alias its inputs), so a
    capture of ``new_residual`` may be taken with ``owned=True``.
    """
    if x.shape != residual.shape:
        raise ValueError(f"x is {tuple(x.shape)}, residual is {tuple(residual.shape)}")
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


@add_rms_norm.register_fake
def _add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


# --------------------------------------------------------------------------- attention


@torch.library.custom_op("models::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``T`` tokens: q ``[T, nh, hd]``, k ``[T, nkv, hd]``, v ``[T, nkv, hd_v]``.

    ``nh`` must be a multiple of ``nkv`` (GQA: each kv head serves ``nh // nkv``
    consecutive query heads). Returns a contiguous ``[T, nh, hd_v]`` tensor.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if num_kv_heads != num_heads:
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # [1, heads, T, hd] with one head dim for q, k and v: the layout the CPU's blocked
    # flash kernel takes, whose memory is O(T * hd) rather than O(T^2) (the capture-
    # dominated configs rely on it). MLA's narrower v is zero-padded; each output column
    # depends on its own v column only, so the padding does not change the result.
    head_dim_v = v.shape[-1]
    if head_dim_v < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - head_dim_v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale,
    )
    return out[0, ..., :head_dim_v].transpose(0, 1).contiguous()


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


# --------------------------------------------------------------------------- RoPE


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE on ``x [T, heads, rot_dim]`` with ``cos``/``sin [T, rot_dim/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """NeoX-style rotary embedding with a precomputed ``[max_position, rot_dim]`` cache.

    The cache (first half cos, second half sin) is a non-persistent buffer; positions
    must be ``< max_position``. Rope scaling (Llama 3.1's, DeepSeek's YaRN) is not
    modelled: it changes values, not the graph.
    """

    def __init__(self, rot_dim: int, max_position: int, theta: float = 10000.0) -> None:
        super().__init__()
        if rot_dim % 2:
            raise ValueError(f"rot_dim must be even, got {rot_dim}")
        self.rot_dim = rot_dim
        self.max_position = max_position
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, nh, rot_dim]`` and ``k [T, nkv, rot_dim]``; returns new tensors."""
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"rot_dim={self.rot_dim}, max_position={self.max_position}"


# --------------------------------------------------------------------------- init


def init_weights_(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) for every Linear/Embedding weight and 2+-D parameter; norms stay 1.

    Draws from the global RNG in module order, so ``torch.manual_seed`` fixes it. Works
    on the meta device (draws nothing).
    """
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=std)


# --------------------------------------------------------------------------- capture


def check_capture_mode(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`CAPTURE_MODES`, else raise ValueError."""
    if mode not in CAPTURE_MODES:
        raise ValueError(f"unknown capture mode {mode!r}; expected one of {', '.join(CAPTURE_MODES)}")
    return mode


def make_aux(mode: str, num_captures: int, out: Optional[torch.Tensor] = None) -> Optional[AuxAccumulator]:
    """A fresh accumulator for ``mode``: list/list_out -> AuxHiddenStateList, packer -> packer(K), none -> None.

    ``out`` (packer mode only) is a caller-owned static buffer ``[max_tokens, K * hidden]``
    shared across token counts: the packer writes ``out[:T]`` and allocates nothing
    (``AuxHiddenStatePacker(K, out=out)``). Any other mode with ``out`` raises ValueError.
    """
    check_capture_mode(mode)
    if out is not None and mode != "packer":
        raise ValueError(
            f"aux_out needs capture_mode='packer' (the packer writes out[:tokens]); "
            f"the model's capture_mode is {mode!r}"
        )
    if mode == "none":
        return None
    if mode == "packer":
        return AuxHiddenStatePacker(num_captures, out=out)
    return AuxHiddenStateList()


def finish_aux(mode: str, aux: Optional[AuxAccumulator]) -> Union[torch.Tensor, List[torch.Tensor], None]:
    """What a forward returns for its captures.

    list -> ``torch.cat(captures, dim=-1)`` (``[T, K * hidden]``, cat done in the model);
    packer -> ``aux.finalize()`` (same shape and bits); list_out -> a plain ``list`` of
    the K ``[T, hidden]`` captures; none -> ``None``.
    """
    check_capture_mode(mode)
    if mode == "none":
        return None
    assert aux is not None
    if mode == "list":
        # list(...) so Dynamo sees a plain list of tensors (it cannot proxy a list subclass).
        return torch.cat(list(aux), dim=-1)
    if mode == "packer":
        return aux.finalize()
    return list(aux)


def check_capture_layers(layers: Sequence[int], num_layers: int) -> Tuple[int, ...]:
    """Validate capture layer ids: ints in ``[0, num_layers)``, distinct, ascending, non-empty."""
    out = tuple(layers)
    if not out:
        raise ValueError("capture_layers must not be empty")
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ValueError(f"capture layer {i!r} is not an int in [0, {num_layers})")
    if list(out) != sorted(set(out)):
        raise ValueError(f"capture_layers must be distinct and ascending, got {list(out)}")
    return out


def eagle3_capture_layers(num_layers: int) -> List[int]:
    """Eagle3's default capture layers ``[2, L // 2, L - 3]``, clamped, deduplicated, sorted.

    Each id is clamped to ``[0, L - 1]``, so small models capture fewer than 3 layers:
    L=1 -> [0], L=2 -> [0, 1], L=3 -> [0, 1, 2], L=4 -> [1, 2], L=6 -> [2, 3],
    L=8 -> [2, 4, 5], L=32 -> [2, 16, 29].
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    ids = {min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)}
    return sorted(ids)


def dflash_capture_layers(num_layers: int, k: int = 5) -> List[int]:
    """``k`` distinct layer ids spread evenly (rounded half up) over ``[1, L - 3]``.

    If that range has fewer than ``k`` layers the whole ``[0, L - 1]`` is used instead.
    Raises ValueError if ``k < 1`` or ``k > L``. E.g. (10, 5) -> [1, 3, 4, 6, 7],
    (32, 5) -> [1, 8, 15, 22, 29].
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if k < 1 or k > num_layers:
        raise ValueError(f"cannot capture {k} distinct layers of a {num_layers}-layer model")
    lo, hi = 1, num_layers - 3
    if hi - lo + 1 < k:
        lo, hi = 0, num_layers - 1
    if k == 1:
        return [(lo + hi) // 2]
    span, steps = hi - lo, k - 1
    # floor(lo + i * span / steps + 1/2): step >= 1, so the ids are strictly increasing.
    ids = [lo + (2 * i * span + steps) // (2 * steps) for i in range(k)]
    assert len(set(ids)) == k and ids == sorted(ids), ids
    return ids


def _softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def example_inputs(cfg: Any, tokens: int, device: Optional[Union[str, torch.device]] = None,
                   seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, positions)`` for any reference config (``vocab_size``, ``max_position``):
    ``tokens`` ids drawn from a CPU generator seeded ``seed``, positions ``0..T-1``."""
    if not 1 <= tokens <= cfg.max_position:
        raise ValueError(f"tokens must be in [1, {cfg.max_position}], got {tokens}")
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    return input_ids.to(device), torch.arange(tokens).to(device)


def build_seeded(model_cls: Callable[..., nn.Module], cfg: Any, capture_mode: str = "list",
                 tokens: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: Optional[Union[str, torch.device]] = None
                 ) -> Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor]]:
    """``model_cls(cfg)`` seeded with ``seed`` (built on CPU, then moved), in eval mode, and
    its example inputs."""
    torch.manual_seed(seed)
    model = model_cls(cfg, capture_mode=capture_mode, dtype=dtype).eval()
    if device is not None:
        model.to(device)
    return model, example_inputs(cfg, tokens, device=device, seed=seed)
