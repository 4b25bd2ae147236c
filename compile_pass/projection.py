"""The draft's input projection applied as each capture is made: ``[T, K*H]`` never exists.

Eagle3 and DFlash drafts read the packed captures once, through their input projection:
optionally an RMSNorm over the whole ``K*H`` concat (vLLM's Eagle3 ``norm_before_fc``) or one
RMSNorm per ``H``-wide chunk (``fc_norm``), then ``fc: Linear(K*H -> H_draft)``, then
optionally an RMSNorm of the result (DFlash's ``hidden_norm``). ``fc`` is linear, so with
``W_k`` the k-th ``H``-wide column block of its weight::

    fc(cat(x_1..x_K)) = sum_k x_k @ W_k^T + b

A per-chunk norm is applied to ``x_k`` before its term. A norm over the whole concat factors
out per token: accumulate ``sum_k (x_k * g_k) @ W_k^T`` and ``sum_k ||x_k||^2``, then scale
once by ``rsqrt(sum / (K*H) + eps)``. So one ``[T, H_draft]`` accumulator replaces the packed
buffer. Opt-in: the K partial products are rounded and summed instead of one GEMM, which
changes the last bits (measured in docs/projection.md).

``DraftProjection`` says what the draft does; ``ProjectingAccumulator`` is the eager
collector (call-compatible with the packer where that makes sense: ``append``, ``capture``,
``len``, ``finalize``, ``reset``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from compile_pass.ops import project_rows_, rms_norm, row_blocks, row_step, sum_squares_rows_  # the pass's ops
from compile_pass.errors import AuxCaptureError

__all__ = ["RMSNormSpec", "DraftProjection", "ProjectingAccumulator", "accumulate_term_", "project_term_", "finish_", "rms_norm"]


@dataclass(frozen=True)
class RMSNormSpec:
    """One RMSNorm: its weight and epsilon."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, norm: Any, width: Optional[int], eps: float, what: str) -> "RMSNormSpec":
        """From an engine's norm module (``.weight`` and ``.variance_epsilon`` / ``.eps``) or
        a weight tensor (``eps`` then applies); ``width``: the size its weight must have."""
        if isinstance(norm, torch.Tensor):
            weight, norm_eps = norm, eps
        elif isinstance(getattr(norm, "weight", None), torch.Tensor):
            weight = norm.weight
            norm_eps = next((float(getattr(norm, a)) for a in ("variance_epsilon", "eps", "epsilon")
                             if isinstance(getattr(norm, a, None), (int, float))), eps)
        else:
            raise TypeError(f"{what} must be an RMSNorm module (with .weight) or a weight tensor, "
                            f"got {type(norm).__name__}")
        if weight.dim() != 1 or (width is not None and weight.shape[0] != width):
            raise AuxCaptureError(f"{what} weight is {tuple(weight.shape)}, expected ({width},)")
        return cls(weight.detach(), norm_eps)


def _quantized(fc_weight: Any) -> Optional[str]:
    """Why ``fc_weight`` cannot be split into per-capture column blocks, if it cannot."""
    if not isinstance(fc_weight, torch.Tensor):
        return f"the fc weight is a {type(fc_weight).__name__}, not a tensor"
    if not fc_weight.dtype.is_floating_point or fc_weight.dtype in (
            getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        return f"the fc weight is {fc_weight.dtype} (a quantized fc)"
    if type(fc_weight) is not torch.Tensor and not isinstance(fc_weight, torch.nn.Parameter):
        return f"the fc weight is a {type(fc_weight).__name__} (a tensor subclass, e.g. quantized)"
    return None


@dataclass(frozen=True)
class DraftProjection:
    """The draft's input projection over K packed captures of ``hidden`` features each:
    ``norm_before_fc`` (over the whole ``K*hidden``) or ``fc_norms`` (one per capture),
    then ``fc`` (``weight`` ``[H_draft, K*hidden]``, ``bias``), then ``norm_after_fc``."""

    num_captures: int
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    norm_before_fc: Optional[RMSNormSpec] = None
    fc_norms: Optional[Tuple[RMSNormSpec, ...]] = None
    norm_after_fc: Optional[RMSNormSpec] = None

    @classmethod
    def build(cls, num_captures: int, fc_weight: Any, *, fc_bias: Optional[torch.Tensor] = None,
              norm_before_fc: Any = None, fc_norms: Optional[Sequence[Any]] = None,
              norm_after_fc: Any = None, eps: float = 1e-6) -> "DraftProjection":
        """Check and normalize the draft's parts (errors name what does not fit)."""
        if isinstance(num_captures, bool) or not isinstance(num_captures, int):
            raise TypeError(f"num_captures must be an int, got {type(num_captures).__name__}")
        if num_captures < 1:
            raise AuxCaptureError(f"num_captures must be >= 1, got {num_captures}")
        why = _quantized(fc_weight)
        if why is not None:
            raise AuxCaptureError(f"{why}: it cannot be split into per-capture column blocks; "
                                  f"keep the packer (AuxHiddenStatePacker) for this draft")
        if fc_weight.dim() != 2:
            raise AuxCaptureError(f"the fc weight is {tuple(fc_weight.shape)}, expected [H_draft, K*hidden]")
        width = fc_weight.shape[1]
        if width % num_captures:
            raise AuxCaptureError(f"the fc weight's width {width} is not K*hidden for K={num_captures}")
        hidden = width // num_captures
        if norm_before_fc is not None and fc_norms is not None:
            raise AuxCaptureError("norm_before_fc and fc_norms are two ways to norm the captures: give one")
        if fc_bias is not None and tuple(fc_bias.shape) != (fc_weight.shape[0],):
            raise AuxCaptureError(f"the fc bias is {tuple(fc_bias.shape)}, expected ({fc_weight.shape[0]},)")
        chunk_norms = None
        if fc_norms is not None:
            fc_norms = list(fc_norms)
            if len(fc_norms) == 1:
                fc_norms = fc_norms * num_captures  # one norm shared by every chunk
            if len(fc_norms) != num_captures:
                raise AuxCaptureError(f"{len(fc_norms)} fc_norms for K={num_captures} captures")
            chunk_norms = tuple(RMSNormSpec.of(n, hidden, eps, f"fc_norms[{i}]") for i, n in enumerate(fc_norms))
        return cls(
            num_captures, fc_weight.detach(), fc_bias.detach() if fc_bias is not None else None,
            RMSNormSpec.of(norm_before_fc, width, eps, "norm_before_fc") if norm_before_fc is not None else None,
            chunk_norms,
            RMSNormSpec.of(norm_after_fc, fc_weight.shape[0], eps, "norm_after_fc")
            if norm_after_fc is not None else None,
        )

    @property
    def hidden(self) -> int:
        return self.weight.shape[1] // self.num_captures

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def block(self, k: int) -> torch.Tensor:
        """``W_k``: the columns of ``fc``'s weight that capture ``k`` multiplies."""
        h = self.hidden
        return self.weight[:, k * h:(k + 1) * h]

    def reference(self, packed: torch.Tensor) -> torch.Tensor:
        """What the draft computes from the packed ``[*, K*hidden]`` captures (cat, then project)."""
        x = packed
        if self.norm_before_fc is not None:
            x = rms_norm(x, self.norm_before_fc.weight, self.norm_before_fc.eps)
        elif self.fc_norms is not None:
            chunks = x.split(self.hidden, dim=-1)
            x = torch.cat([rms_norm(c, n.weight, n.eps) for c, n in zip(chunks, self.fc_norms)], dim=-1)
        out = torch.nn.functional.linear(x, self.weight, self.bias)
        if self.norm_after_fc is not None:
            out = rms_norm(out, self.norm_after_fc.weight, self.norm_after_fc.eps)
        return out


def _term_transform(p: DraftProjection, k: int) -> Optional[Callable[[torch.Tensor, slice], torch.Tensor]]:
    """What capture ``k`` goes through before its projection: its own norm (``fc_norms``),
    its block of a whole-concat norm's weight (``norm_before_fc``), or nothing."""
    if p.fc_norms is not None:
        norm = p.fc_norms[k]
        return lambda x, _: rms_norm(x, norm.weight, norm.eps)
    if p.norm_before_fc is not None:
        scale = p.norm_before_fc.weight[k * p.hidden:(k + 1) * p.hidden]
        return lambda x, _: x * scale
    return None


def project_term_(p: DraftProjection, acc: torch.Tensor, hidden: torch.Tensor, k: int, first: bool,
                  other: Optional[torch.Tensor] = None, op: str = "") -> None:
    """``acc (+)= transform_k(hidden) @ W_k^T`` (``first``: written, ``acc`` may hold
    anything before; ``other``: the capture is ``op(hidden, other)``, formed a row block at a
    time), the arithmetic of the compiled ops (``ops.project_rows_``)."""
    project_rows_(acc, hidden, p.weight, k * p.hidden, first, _term_transform(p, k), other=other, op=op)


def accumulate_term_(p: DraftProjection, acc: torch.Tensor, sumsq: Optional[torch.Tensor], hidden: torch.Tensor,
                     k: int, first: bool, other: Optional[torch.Tensor] = None, op: str = "") -> None:
    """Add capture ``k``'s term to ``acc`` and, for a norm over the concat, its sum of
    squares to ``sumsq`` (fp32 ``[*lead, 1]``; ``ops.sum_squares_into_``): eager and
    compiled agree bit for bit. The capture is ``hidden``, or ``op(hidden, other)`` formed
    a row block at a time."""
    if p.norm_before_fc is not None:
        if sumsq is None:
            raise AuxCaptureError("a norm over the concat needs its sum-of-squares buffer")
        sum_squares_rows_(sumsq, hidden, other, op, first)
    project_term_(p, acc, hidden, k, first, other=other, op=op)


def finish_(p: DraftProjection, acc: torch.Tensor, sumsq: Optional[torch.Tensor]) -> torch.Tensor:
    """``acc`` after every term: the whole-concat norm's per-token scale, the bias, the norm
    after ``fc``, applied in place; returns ``acc``."""
    if p.norm_before_fc is not None:
        scale = torch.rsqrt(sumsq / (p.num_captures * p.hidden) + p.norm_before_fc.eps)
        acc.mul_(scale if acc.dtype == torch.float32 else scale.to(acc.dtype))
    if p.bias is not None:
        acc.add_(p.bias.to(acc.dtype))
    if p.norm_after_fc is not None:
        acc.copy_(rms_norm(acc, p.norm_after_fc.weight, p.norm_after_fc.eps))
    return acc


class ProjectingAccumulator:
    """Drop-in for the packer when the packed captures exist only to be projected by the
    draft: each capture is projected as it is appended and summed into one
    ``[*lead, H_draft]`` accumulator (``finalize()`` returns the draft's projected input).

    Invariant: after ``n`` appends the accumulator holds ``sum_{k<n}`` of the captures'
    projected terms (each capture as it was at its append); ``finalize()`` returns the
    projection only when ``n == num_captures``. ``accumulate_dtype``: the accumulator's
    dtype (default: the captures'; ``torch.float32`` sums the bf16/fp16 partial products
    exactly, at 2x the accumulator's bytes). Nothing of ``[*lead, K*hidden]`` is allocated.
    """

    copies_on_append = True  # the term is computed at the append: later mutation is not seen

    def __init__(self, num_captures: int, fc_weight: Any, *, fc_bias: Optional[torch.Tensor] = None,
                 norm_before_fc: Any = None, fc_norms: Optional[Sequence[Any]] = None,
                 norm_after_fc: Any = None, eps: float = 1e-6,
                 accumulate_dtype: Optional[torch.dtype] = None) -> None:
        if accumulate_dtype is not None and (not isinstance(accumulate_dtype, torch.dtype)
                                             or not accumulate_dtype.is_floating_point):
            raise TypeError(f"accumulate_dtype must be a floating torch.dtype or None, got {accumulate_dtype!r}")
        self.projection = DraftProjection.build(
            num_captures, fc_weight, fc_bias=fc_bias, norm_before_fc=norm_before_fc, fc_norms=fc_norms,
            norm_after_fc=norm_after_fc, eps=eps)
        self.accumulate_dtype = accumulate_dtype
        self._acc: Optional[torch.Tensor] = None
        self._sumsq: Optional[torch.Tensor] = None  # norm_before_fc: sum of squares per token
        self._lead: Optional[tuple] = None
        self._dtype: Optional[torch.dtype] = None
        self._idx = 0

    @classmethod
    def for_draft(cls, num_captures: int, fc: torch.nn.Module, **norms: Any) -> "ProjectingAccumulator":
        """From the draft's ``fc`` module (``nn.Linear``-like: ``.weight``, ``.bias``)."""
        return cls(num_captures, getattr(fc, "weight", fc), fc_bias=getattr(fc, "bias", None), **norms)

    @property
    def num_captures(self) -> int:
        return self.projection.num_captures

    def _check(self, hidden: torch.Tensor) -> None:
        p = self.projection
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"a capture must be a torch.Tensor, got {type(hidden).__name__}")
        if self._idx >= p.num_captures:
            raise AuxCaptureError(f"capture {self._idx + 1} exceeds num_captures={p.num_captures}")
        if hidden.dim() < 1 or hidden.shape[-1] != p.hidden:
            raise AuxCaptureError(f"capture {self._idx} has {hidden.shape[-1] if hidden.dim() else 0} "
                                  f"features, the fc weight's width {p.weight.shape[1]} is "
                                  f"K*hidden = {p.num_captures}*{p.hidden}")
        if hidden.dtype != p.weight.dtype:
            raise AuxCaptureError(f"capture {self._idx} is {hidden.dtype}, the fc weight {p.weight.dtype}")
        if hidden.device != p.weight.device:
            raise AuxCaptureError(f"capture {self._idx} is on {hidden.device}, the fc weight on {p.weight.device}")
        if self._lead is not None and tuple(hidden.shape[:-1]) != self._lead:
            raise AuxCaptureError(f"capture {self._idx} has leading shape {tuple(hidden.shape[:-1])}, "
                                  f"the first capture had {self._lead}")

    def append(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None) -> None:
        """Project ``hidden`` (capture ``len(self)``), or ``hidden + residual`` (a decoder's
        input to the next layer, formed a row block at a time, never whole), and add its term
        to the accumulator."""
        self._check(hidden)
        if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != hidden.shape
                                     or residual.dtype != hidden.dtype or residual.device != hidden.device):
            got = (f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
                   if isinstance(residual, torch.Tensor) else type(residual).__name__)
            raise AuxCaptureError(f"capture {self._idx}'s residual is {got}, its hidden state "
                                  f"{tuple(hidden.shape)} {hidden.dtype} on {hidden.device}")
        op = "add" if residual is not None else ""
        p, k = self.projection, self._idx
        if self._acc is None:
            self._lead, self._dtype = tuple(hidden.shape[:-1]), hidden.dtype
            self._acc = hidden.new_zeros((*self._lead, p.out_features), dtype=self.accumulate_dtype or hidden.dtype)
            if p.norm_before_fc is not None:
                self._sumsq = hidden.new_zeros((*self._lead, 1), dtype=torch.float32)
        if self._acc.dtype == hidden.dtype:
            # the compiled ops' own arithmetic: one rounding of the running sum per capture
            accumulate_term_(p, self._acc, self._sumsq, hidden, k, first=False, other=residual, op=op)
        else:  # each block's term in the captures' dtype, summed in the accumulator's
            if self._sumsq is not None:
                sum_squares_rows_(self._sumsq, hidden, residual, op, False)
            rows, width, block_of = row_blocks(hidden, residual, op)
            transform, out = _term_transform(p, k), self._acc.view(-1, p.out_features)
            step = row_step(rows, width, hidden.element_size())
            for r in range(0, rows, step):
                span = slice(r, r + step)
                x = block_of(span)
                out[span].add_((transform(x, span) if transform is not None else x) @ p.block(k).t())
        self._idx += 1

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        """Same as ``append``: the projection is the snapshot, owned or not."""
        self.append(hidden)

    def extend(self, hiddens: Sequence[torch.Tensor]) -> None:
        for hidden in hiddens:
            self.append(hidden)

    def __len__(self) -> int:
        return self._idx

    def finalize(self) -> torch.Tensor:
        """The draft's projected input ``[*lead, H_draft]``; raises unless K were captured."""
        p = self.projection
        if self._idx != p.num_captures:
            raise AuxCaptureError(f"captured {self._idx} of {p.num_captures} aux hidden states")
        out = self._acc
        if out.dtype == self._dtype:
            return finish_(p, out, self._sumsq)
        if self._sumsq is not None:
            out = out.mul_(torch.rsqrt(self._sumsq / (p.num_captures * p.hidden) + p.norm_before_fc.eps))
        if p.bias is not None:
            out = out.add_(p.bias.to(out.dtype))
        out = out.to(self._dtype)
        if p.norm_after_fc is not None:
            out = rms_norm(out, p.norm_after_fc.weight, p.norm_after_fc.eps)
        return out

    def reset(self) -> None:
        """Start the next forward (a new accumulator is allocated at its first capture; the
        tensor ``finalize()`` returned stays the caller's)."""
        self._acc = self._sumsq = None
        self._lead = self._dtype = None
        self._idx = 0
