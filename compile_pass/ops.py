"""The custom ops the rewrite emits: in-place writes of captures into their slices (and,
with ``fuse_projection``, into the draft's projected accumulator).

``compile_pass::write_slice_(buf, src, dim, start)`` copies ``src`` into
``buf.narrow(dim, start, src.size(dim))`` and declares that it mutates ``buf``. Declared
mutation is what makes the write survive every place the rewritten graph can go:

- a graph that runs as is (Dynamo graph under the ``eager`` inner, the functional aten
  graph after AOTAutograd under ``aot_eager``): the op writes in place;
- a Dynamo graph compiled by Inductor: functionalization wraps it in
  ``auto_functionalized`` and Inductor's reinplacing turns it back into the in-place
  call, because the buffer has no other reader (an ``aten.slice``+``copy_`` would instead
  become a whole-buffer ``slice_scatter``, measured worse, see docs/design.md).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

__all__ = ["write_slice_", "binary_into_slice_", "project_into_", "project_binary_into_", "bias_into_",
           "project_normed_into_", "project_scaled_into_", "sum_squares_into_", "rms_scale_", "rms_norm",
           "project_rows_", "sum_squares_rows_", "row_step", "BLOCK_FRACTION", "WHOLE_CAPTURE_BYTES",
           "BINARY_OPS", "MUTATED_ARG"]

#: the correctly rounded binary ops ``binary_into_slice_`` computes (aten op names)
BINARY_OPS = ("add", "sub", "mul", "div")

#: ``flexible_layout``: the writes read their sources with any strides, so Inductor realizes
#: a source where it is computed instead of copying it to the strides traced (its default
#: for custom ops). The copy is what breaks a compile: the source's other readers keep an
#: unrealized expression over its inputs and, after a later in-place op writes those inputs
#: (a fused add-norm), recompute it from the written values (docs/piecewise.md section 6).
_TAGS = (torch._C.Tag.flexible_layout,)


@torch.library.custom_op("compile_pass::write_slice_", mutates_args=("buf",), tags=_TAGS)
def write_slice_(buf: torch.Tensor, src: torch.Tensor, dim: int, start: int) -> None:
    """Copy ``src`` into ``buf[..., start:start+src.size(dim), ...]`` along ``dim``, in place."""
    buf.narrow(dim, start, src.size(dim)).copy_(src)


@write_slice_.register_fake
def _write_slice_fake(buf: torch.Tensor, src: torch.Tensor, dim: int, start: int) -> None:
    return None


@torch.library.custom_op("compile_pass::binary_into_slice_", mutates_args=("buf",), tags=_TAGS)
def binary_into_slice_(buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str, dim: int,
                       start: int) -> None:
    """``buf.narrow(dim, start, w) = op(a, b)``, computed straight into the slice (``out=``):
    a capture that is one correctly rounded add/sub/mul/div needs no temporary of its own.
    Bitwise equal to ``op(a, b)`` computed anywhere else (each element is one IEEE operation
    on the same two operands). ``w`` is the broadcast width of ``a`` and ``b`` along ``dim``."""
    if op not in BINARY_OPS:
        raise ValueError(f"binary_into_slice_: op must be one of {BINARY_OPS}, got {op!r}")
    width = torch.broadcast_shapes(a.shape, b.shape)[dim]
    getattr(torch, op)(a, b, out=buf.narrow(dim, start, width))


@binary_into_slice_.register_fake
def _binary_into_slice_fake(buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str, dim: int,
                            start: int) -> None:
    return None


# ----------------------------------------------------------- the draft's projection, per capture
@torch.library.custom_op("compile_pass::project_into_", mutates_args=("acc",), tags=_TAGS)
def project_into_(acc: torch.Tensor, src: torch.Tensor, weight: torch.Tensor, start: int,
                  first: bool) -> None:
    """``acc (+)= src @ weight[:, start:start+h].T``, in place (``h``: ``src``'s last dim;
    ``first``: the accumulator's first term, written rather than added, so ``acc`` may come
    uninitialized). ``fuse_projection.py`` emits one per capture of a group the draft's
    ``fc`` reads."""
    project_rows_(acc, src, weight, start, first)


@project_into_.register_fake
def _project_into_fake(acc: torch.Tensor, src: torch.Tensor, weight: torch.Tensor, start: int,
                       first: bool) -> None:
    return None


@torch.library.custom_op("compile_pass::project_binary_into_", mutates_args=("acc",), tags=_TAGS)
def project_binary_into_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str,
                         weight: torch.Tensor, start: int, first: bool) -> None:
    """``project_into_`` of ``op(a, b)`` (a capture the rewrite computes at its write, as
    ``binary_into_slice_`` does for a packed buffer)."""
    if op not in BINARY_OPS:
        raise ValueError(f"project_binary_into_: op must be one of {BINARY_OPS}, got {op!r}")
    project_rows_(acc, a, weight, start, first, other=b, op=op)


@project_binary_into_.register_fake
def _project_binary_into_fake(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str,
                              weight: torch.Tensor, start: int, first: bool) -> None:
    return None


@torch.library.custom_op("compile_pass::bias_into_", mutates_args=("acc",), tags=_TAGS)
def bias_into_(acc: torch.Tensor, bias: torch.Tensor) -> None:
    """``acc += bias``, in place: the fc's bias, once, after every capture's term."""
    acc.add_(bias)


@bias_into_.register_fake
def _bias_into_fake(acc: torch.Tensor, bias: torch.Tensor) -> None:
    return None


# --------------------------------------- the draft's norms before fc, folded into the projection
def capture_value(a: torch.Tensor, b: Optional[torch.Tensor], op: str) -> torch.Tensor:
    """A capture: ``a``, or ``op(a, b)`` where the rewrite computes it at its write."""
    if b is None:
        return a
    if op not in BINARY_OPS:
        raise ValueError(f"the capture's op must be one of {BINARY_OPS}, got {op!r}")
    return getattr(torch, op)(a, b)


#: a capture larger than ``WHOLE_CAPTURE_BYTES`` is formed, transformed and projected
#: ``1/BLOCK_FRACTION`` of its rows at a time: the per-capture ops' temporaries
#: (``hidden + residual``, a norm's fp32 upcast, its scaled rows) are then a bounded fraction
#: of one capture, never the whole ``[T, H]``
BLOCK_FRACTION = 8
#: a capture of at most this many bytes is formed, normed and projected whole: one GEMM and
#: its norm's ops once, whatever T (on a GPU each op is a launch per capture per step; at
#: decode sizes 8 blocks cost 1.12-1.31x the list build's forward time on a CPU, one GEMM
#: 1.04-1.07x, docs/projection.md "Time"). 1 MiB: every decode batch up to 64 tokens of a
#: bf16 target of H <= 8192 and up to 256 tokens of an fp32 one of H = 1024 is whole, its
#: temporaries at most 3 MiB (the fp32 upcast); every memory table of the project (2048
#: tokens, captures of 2 MiB and up) is blocked as before
WHOLE_CAPTURE_BYTES = 1 << 20


def row_step(rows: int, width: int, itemsize: int) -> int:
    """Rows per block of a capture of ``rows`` x ``width`` elements of ``itemsize`` bytes:
    all of them up to ``WHOLE_CAPTURE_BYTES``, else ``1/BLOCK_FRACTION`` of them."""
    if rows * width * itemsize <= WHOLE_CAPTURE_BYTES:
        return max(1, rows)
    return max(1, -(-rows // BLOCK_FRACTION))


def row_blocks(a: torch.Tensor, b: Optional[torch.Tensor], op: str
                ) -> Tuple[int, int, Callable[[slice], torch.Tensor]]:
    """(rows, width, block(span)): the capture ``a`` or ``op(a, b)`` as ``[rows, width]``,
    formed a row span at a time (``b`` of another shape, a broadcast: formed whole)."""
    if b is not None and b.shape != a.shape:
        a, b = capture_value(a, b, op), None
    h = a.shape[-1]
    rows_a = a.reshape(-1, h)
    if b is None:
        return rows_a.shape[0], h, lambda span: rows_a[span]
    if op not in BINARY_OPS:
        raise ValueError(f"the capture's op must be one of {BINARY_OPS}, got {op!r}")
    rows_b, fn = b.reshape(-1, h), getattr(torch, op)
    return rows_a.shape[0], h, lambda span: fn(rows_a[span], rows_b[span])


def project_rows_(acc: torch.Tensor, src: torch.Tensor, weight: torch.Tensor, start: int, first: bool,
                  transform: Optional[Callable[[torch.Tensor, slice], torch.Tensor]] = None,
                  other: Optional[torch.Tensor] = None, op: str = "") -> None:
    """``acc (+)= transform(capture) @ weight[:, start:start+h].T``, the capture ``src`` (or
    ``op(src, other)``) formed, transformed (``transform`` gets the block and its row slice)
    and projected a row block at a time (``row_step``), each block before the next is made:
    nothing of the whole capture's size is allocated. A capture that is already a tensor and
    needs no transform makes no temporary: one GEMM. The eager accumulator and the compiled
    ops both come here, so they agree bit for bit."""
    n, h, block_of = row_blocks(src, other, op)
    out = acc.view(-1, acc.shape[-1])
    block = weight.narrow(1, start, h).t()
    step = max(1, n) if transform is None and other is None else row_step(n, h, src.element_size())
    for r in range(0, n, step):
        span = slice(r, r + step)
        x = block_of(span)
        if transform is not None:
            x = transform(x, span)
        if first:
            torch.mm(x, block, out=out[span])
        else:
            out[span].addmm_(x, block)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: Union[float, torch.Tensor]) -> torch.Tensor:
    """RMSNorm as vLLM's and SGLang's ``forward_native`` compute it: in fp32, cast back to
    ``x``'s dtype, then times ``weight`` (``eps``: a number or a 0-dim tensor, added alike)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight if weight is not None else xf.to(x.dtype)


@torch.library.custom_op("compile_pass::project_normed_into_", mutates_args=("acc",), tags=_TAGS)
def project_normed_into_(acc: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                         norm_weight: Optional[torch.Tensor], eps: float, eps_tensor: Optional[torch.Tensor],
                         weight: torch.Tensor, start: int, first: bool) -> None:
    """``acc (+)= rms_norm(src, norm_weight, eps) @ weight[:, start:start+h].T``: a capture's
    own norm (the draft's per-capture ``fc_norm``) applied, then its term (``project_into_``).
    ``eps_tensor``, if given, is the eps (a 0-dim tensor: a traced float input)."""
    epsilon = eps_tensor if eps_tensor is not None else eps
    project_rows_(acc, a, weight, start, first, lambda x, _: rms_norm(x, norm_weight, epsilon), other=b, op=op)


@project_normed_into_.register_fake
def _project_normed_into_fake(acc: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                              norm_weight: Optional[torch.Tensor], eps: float, eps_tensor: Optional[torch.Tensor],
                              weight: torch.Tensor, start: int, first: bool) -> None:
    return None


@torch.library.custom_op("compile_pass::project_scaled_into_", mutates_args=("acc",), tags=_TAGS)
def project_scaled_into_(acc: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                         norm_weight: Optional[torch.Tensor], weight: torch.Tensor, start: int,
                         first: bool) -> None:
    """``acc (+)= (src * norm_weight[start:start+h]) @ weight[:, start:start+h].T``: a capture's
    term under a norm over the whole concat, before that norm's per-token scale
    (``rms_scale_`` applies it once, from ``sum_squares_into_``'s sums)."""
    if norm_weight is None:
        project_rows_(acc, a, weight, start, first, other=b, op=op)
        return
    scale = norm_weight.narrow(0, start, a.shape[-1])
    project_rows_(acc, a, weight, start, first, lambda x, _: x * scale, other=b, op=op)


@project_scaled_into_.register_fake
def _project_scaled_into_fake(acc: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                              norm_weight: Optional[torch.Tensor], weight: torch.Tensor, start: int,
                              first: bool) -> None:
    return None


@torch.library.custom_op("compile_pass::sum_squares_into_", mutates_args=("sumsq",), tags=_TAGS)
def sum_squares_into_(sumsq: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                      first: bool) -> None:
    """``sumsq (+)= sum(src**2, -1, keepdim)`` in fp32 (``sumsq``: fp32 ``[*lead, 1]``): the
    capture's share of a norm over the whole concat, taken when the capture is made (a
    later in-place write into the capture's inputs cannot reach it)."""
    sum_squares_rows_(sumsq, a, b, op, first)


def sum_squares_rows_(sumsq: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                      first: bool) -> None:
    """``sum_squares_into_``'s arithmetic, called without the dispatcher (the eager
    accumulator: the same kernels, none of a custom op's per-call overhead)."""
    n, h, block_of = row_blocks(a, b, op)  # formed and upcast a row block at a time
    sums, step = sumsq.view(-1, 1), row_step(n, h, a.element_size())
    for r in range(0, n, step):
        span = slice(r, r + step)
        square = torch.linalg.vector_norm(block_of(span), 2, dim=-1, keepdim=True, dtype=torch.float32).square_()
        if first:
            sums[span].copy_(square)
        else:
            sums[span].add_(square)


@sum_squares_into_.register_fake
def _sum_squares_into_fake(sumsq: torch.Tensor, a: torch.Tensor, b: Optional[torch.Tensor], op: str,
                           first: bool) -> None:
    return None


@torch.library.custom_op("compile_pass::rms_scale_", mutates_args=("acc",), tags=_TAGS)
def rms_scale_(acc: torch.Tensor, sumsq: torch.Tensor, width: int, eps: float,
               eps_tensor: Optional[torch.Tensor]) -> None:
    """``acc *= rsqrt(sumsq / width + eps)``: the per-token scale of a norm over the whole
    ``width``-wide concat, once, after every capture's term (``eps_tensor``: as in
    ``project_normed_into_``)."""
    scale = torch.rsqrt(sumsq / width + (eps_tensor if eps_tensor is not None else eps))
    acc.mul_(scale if acc.dtype == torch.float32 else scale.to(acc.dtype))


@rms_scale_.register_fake
def _rms_scale_fake(acc: torch.Tensor, sumsq: torch.Tensor, width: int, eps: float,
                    eps_tensor: Optional[torch.Tensor]) -> None:
    return None


#: each op the rewrite emits -> the argument it mutates (``reinplace.py`` undoes their
#: functionalization where that is exact)
MUTATED_ARG = {write_slice_._opoverload: "buf", binary_into_slice_._opoverload: "buf",
               project_into_._opoverload: "acc", project_binary_into_._opoverload: "acc",
               bias_into_._opoverload: "acc", project_normed_into_._opoverload: "acc",
               project_scaled_into_._opoverload: "acc", sum_squares_into_._opoverload: "sumsq",
               rms_scale_._opoverload: "acc"}
