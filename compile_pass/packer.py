"""The eager aux-hidden-state packer: the runtime fix the compiler pass reproduces.

Eagle3/DFlash draft models read hidden states captured at K layers of the target model.
Collected in a list and concatenated at the end, the K captures and the packed result are
alive together at the ``torch.cat``: a transient ~2x of the packed bytes. The packer
allocates the packed ``[*leading, K * feature]`` buffer on the first capture and copies
each capture into its slice as it is appended, so nothing but the buffer outlives a
capture.

The API is call-compatible with the packer of SGLang's ``aux_hidden_states`` module
(``for_batch``, ``slot``, ``append``, ``extend``, ``capture``, ``len``, ``finalize``), so model code
written against it runs unchanged; the extras (``out=`` prefix buffers, ``reset()``,
shape/dtype/device checks) are documented on each method.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import torch

from compile_pass.errors import AuxCaptureError
from compile_pass.ops import write_slice_

__all__ = [
    "AuxCaptureError",
    "AuxHiddenStatePacker",
    "AuxHiddenStateList",
    "AuxHiddenStates",
    "AuxHiddenStateAccumulator",
    "pack_aux_hidden_states",
    "packed_view",
]

#: What a model hands its caller: one packed ``[*leading, K * hidden]`` tensor or the K captures.
AuxHiddenStates = Union[torch.Tensor, List[torch.Tensor]]


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


class AuxHiddenStateList(list):
    """A plain capture list whose ``capture`` snapshots borrowed storage.

    ``copies_on_append`` is False: ``append`` keeps a reference, so a producer that later
    mutates the tensor in place (a fused add-RMSNorm on the residual) must go through
    ``capture`` (which clones unless ``owned=True``) or clone itself.
    """

    copies_on_append = False

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        """Append ``hidden``; clone it first unless the caller transfers ownership."""
        self.append(hidden if owned else hidden.clone())

    def finalize(self) -> torch.Tensor:
        """Pack the captures into one ``[*leading, K * feature]`` tensor."""
        return pack_aux_hidden_states(self)


class AuxHiddenStatePacker:
    """Drop-in for the ``[]`` a model appends its K captures to.

    Invariant: after ``n`` appends, slices ``0..n-1`` of the buffer hold the captures,
    bit for bit, as they were at their append; ``finalize()`` returns the buffer only
    when ``n == num_captures``.

    ``out`` is an optional caller-owned buffer ``[max_tokens, *middle, K * feature]``
    (a CUDA-graph static buffer shared across batch sizes). Captures of ``tokens`` rows
    are written into ``out[:tokens]`` and ``finalize()`` returns that prefix view; the
    packer never allocates when ``out`` is given. SGLang's exact ``[tokens, K * feature]``
    buffer is the case ``max_tokens == tokens`` (``finalize()`` returns it whole).
    """

    #: ``append`` copies, so producers may mutate a tensor after capturing it.
    copies_on_append = True

    def __init__(self, num_captures: int, out: Optional[torch.Tensor] = None) -> None:
        if isinstance(num_captures, bool) or not isinstance(num_captures, int):
            raise TypeError(f"num_captures must be an int, got {type(num_captures).__name__}")
        if num_captures < 1:
            raise AuxCaptureError(f"num_captures must be >= 1, got {num_captures}")
        if out is not None and not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        self._num_captures = num_captures
        self._out = out
        self._buffer: Optional[torch.Tensor] = None
        self._feature_size: Optional[int] = None
        # what the first capture fixed (never the capture itself: it must not outlive its copy)
        self._leading: Optional[tuple] = None
        self._dtype: Optional[torch.dtype] = None
        self._device: Optional[torch.device] = None
        self._idx = 0

    @classmethod
    def for_batch(cls, forward_batch, num_captures: int) -> "AuxHiddenStatePacker":
        """A packer writing into ``forward_batch.aux_hidden_states_buffer`` when the batch
        carries one (SGLang's decode graph runner hands every graph size a prefix of one
        static buffer, ``[T, K * hidden]``), else allocating on the first capture.

        Same call as SGLang 0.5.23's ``AuxHiddenStatePacker.for_batch``. A batch object
        without that attribute is treated as carrying no buffer.
        """
        return cls(num_captures, out=getattr(forward_batch, "aux_hidden_states_buffer", None))

    @property
    def num_captures(self) -> int:
        return self._num_captures

    def _packed_buffer_for(self, like: torch.Tensor) -> torch.Tensor:
        """The packed buffer a first capture shaped like ``like`` is written into."""
        feature = like.shape[-1]
        shape = (*like.shape[:-1], feature * self._num_captures)
        if self._out is None:
            if self._buffer is not None:  # after reset(): reuse, same shape only
                if (tuple(self._buffer.shape) != tuple(shape) or self._buffer.dtype != like.dtype
                        or self._buffer.device != like.device):
                    raise AuxCaptureError(
                        f"reset() reuses the packed buffer {_describe(self._buffer)}, but the "
                        f"next forward's captures need {tuple(shape)} {like.dtype} on {like.device}; "
                        f"create a new packer for a new shape"
                    )
                return self._buffer
            return like.new_empty(shape)
        out = self._out
        if out.dtype != like.dtype:
            raise AuxCaptureError(f"out buffer dtype is {out.dtype}, captures are {like.dtype}")
        if out.device != like.device:
            raise AuxCaptureError(f"out buffer is on {out.device}, captures are on {like.device}")
        if like.dim() < 2:
            if tuple(out.shape) != tuple(shape):
                raise AuxCaptureError(
                    f"out buffer is {tuple(out.shape)}, 1-D captures need exactly {tuple(shape)}"
                )
            return out
        if (
            out.dim() != like.dim()
            or tuple(out.shape[1:]) != tuple(shape[1:])
            or out.shape[0] < like.shape[0]
        ):
            raise AuxCaptureError(
                f"out buffer is {tuple(out.shape)}, captures need at least "
                f"({like.shape[0]}, {', '.join(str(s) for s in shape[1:])}): "
                f"{like.shape[0]} tokens, {self._num_captures} x {feature} features"
            )
        return out[: like.shape[0]]

    def _check_like_first(self, like: torch.Tensor) -> None:
        if like.shape[-1] != self._feature_size:
            raise AuxCaptureError(
                f"capture {self._idx} has feature size {like.shape[-1]}, "
                f"the first capture had {self._feature_size}"
            )
        if tuple(like.shape[:-1]) != self._leading:
            raise AuxCaptureError(
                f"capture {self._idx} has leading shape {tuple(like.shape[:-1])}, "
                f"the first capture had {self._leading}"
            )
        if like.dtype != self._dtype:
            raise AuxCaptureError(
                f"capture {self._idx} has dtype {like.dtype}, the first capture had {self._dtype}"
            )
        if like.device != self._device:
            raise AuxCaptureError(
                f"capture {self._idx} is on {like.device}, the first capture was on {self._device}"
            )

    def slot(self, like: torch.Tensor) -> torch.Tensor:
        """Take the next capture's view of the packed buffer, shaped like ``like``.

        The slot counts as appended: a producer writes the capture into it in place
        (``torch.add(h, r, out=packer.slot(h))``), with no temporary.
        """
        if not isinstance(like, torch.Tensor):
            raise TypeError(f"a capture must be a torch.Tensor, got {type(like).__name__}")
        if like.dim() < 1:
            raise AuxCaptureError("a capture must have at least one dimension (the feature dim)")
        if self._idx >= self._num_captures:
            raise AuxCaptureError(
                f"capture {self._idx + 1} exceeds num_captures={self._num_captures}"
            )
        if self._feature_size is None:
            self._buffer = self._packed_buffer_for(like)
            self._feature_size = like.shape[-1]
            self._leading = tuple(like.shape[:-1])
            self._dtype, self._device = like.dtype, like.device
        else:
            self._check_like_first(like)
        start = self._idx * self._feature_size
        self._idx += 1
        return self._buffer[..., start : start + self._feature_size]

    def append(self, hidden: torch.Tensor) -> None:
        """Copy ``hidden`` into its slice now; later mutation of ``hidden`` is not seen.

        Eager: ``slot.copy_(hidden)``. Inside a compiled graph (no autograd through the
        capture) the copy is the mutating custom op ``compile_pass::write_slice_``: an
        in-place ``copy_`` into a slice is functionalized by AOTAutograd into whole-buffer
        ``slice_scatter`` copies (peaks up to 5.85x the packed bytes measured, with an
        ``out=`` buffer), while the op's declared mutation is kept as one in-place write
        (docs/cuda-graphs.md has the numbers).
        """
        slot = self.slot(hidden)
        if torch.compiler.is_compiling() and not (hidden.requires_grad and torch.is_grad_enabled()):
            start = (self._idx - 1) * hidden.shape[-1]
            write_slice_(self._buffer, hidden, hidden.dim() - 1, start)
        else:
            slot.copy_(hidden)

    def extend(self, hiddens: Iterable[torch.Tensor]) -> None:
        for hidden in hiddens:
            self.append(hidden)

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        """Same as ``append``: the copy into the buffer is the snapshot, owned or not."""
        self.append(hidden)

    def __len__(self) -> int:
        return self._idx

    def finalize(self) -> torch.Tensor:
        """Return the packed buffer; raise if the number of captures is not ``num_captures``."""
        if self._idx != self._num_captures:
            raise AuxCaptureError(
                f"captured {self._idx} of {self._num_captures} aux hidden states"
            )
        assert self._buffer is not None
        return self._buffer

    def reset(self) -> None:
        """Start the next forward, writing into the same buffer (same shape required).

        The tensor returned by the previous ``finalize()`` aliases that buffer and is
        overwritten by the next forward's captures.
        """
        self._idx = 0
        self._feature_size = None
        self._leading = self._dtype = self._device = None


#: Both collectors accept borrowed values through ``capture``.
AuxHiddenStateAccumulator = Union[AuxHiddenStateList, AuxHiddenStatePacker]


def packed_view(captures: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``torch.cat(captures, dim=-1)`` without a copy, where that is possible; else None.

    The contract between the capture side (the packer, the pass's ``pack_outputs``, the
    engine plugins' static buffers) and the consumer side (an engine's concat): when the
    captures are adjacent last-dim slices of one buffer, in order (same dtype, device,
    leading shape and strides, unit stride in the last dim, each starting where the
    previous one ends), the packed result is a view of that buffer and equals the concat
    bit for bit. Anything else (a gather, separate tensors, a gap, another order) is None,
    and the caller concatenates. Never called inside a traced graph (storages are not
    real there): callers check ``torch.compiler.is_compiling()`` first.
    """
    if len(captures) == 0 or not all(isinstance(t, torch.Tensor) for t in captures):
        return None
    first = captures[0]
    if first.dim() < 1 or first.stride(-1) != 1:
        return None
    storage_ptr = first.untyped_storage().data_ptr()
    lead, strides = tuple(first.shape[:-1]), first.stride()[:-1]
    offset = first.storage_offset() + first.shape[-1]
    for t in captures[1:]:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or t.dim() != first.dim()
            or tuple(t.shape[:-1]) != lead
            or t.stride()[:-1] != strides
            or t.stride(-1) != 1
            or t.untyped_storage().data_ptr() != storage_ptr
            or t.storage_offset() != offset
        ):
            return None
        offset += t.shape[-1]
    total = offset - first.storage_offset()
    if total > first.untyped_storage().nbytes() // first.element_size():
        return None
    return first.as_strided((*lead, total), first.stride(), first.storage_offset())


def pack_aux_hidden_states(aux_hidden_states: AuxHiddenStates) -> torch.Tensor:
    """One ``[*leading, K * feature]`` tensor from a packed tensor or a list of captures.

    A tensor is returned as is; a one-element list returns its element; a list whose
    tensors are adjacent slices of one buffer along the last dim, in order, returns a
    view of that buffer (no copy); any other list is concatenated along the last dim.
    """
    if isinstance(aux_hidden_states, torch.Tensor):
        return aux_hidden_states
    if not isinstance(aux_hidden_states, (list, tuple)):
        raise TypeError(
            "aux hidden states must be a tensor or a list of tensors, "
            f"got {type(aux_hidden_states).__name__}"
        )
    if len(aux_hidden_states) == 0:
        raise AuxCaptureError("no aux hidden states to pack: the capture list is empty")
    for i, t in enumerate(aux_hidden_states):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"aux hidden state {i} is a {type(t).__name__}, not a tensor")
    if len(aux_hidden_states) == 1:
        return aux_hidden_states[0]
    if not torch.compiler.is_compiling():
        view = packed_view(aux_hidden_states)
        if view is not None:
            return view
    return torch.cat(list(aux_hidden_states), dim=-1)

