"""The one custom op the rewrite emits: an in-place write of a capture into its slice.

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

import torch

__all__ = ["write_slice_"]


@torch.library.custom_op("compile_pass::write_slice_", mutates_args=("buf",))
def write_slice_(buf: torch.Tensor, src: torch.Tensor, dim: int, start: int) -> None:
    """Copy ``src`` into ``buf[..., start:start+src.size(dim), ...]`` along ``dim``, in place."""
    buf.narrow(dim, start, src.size(dim)).copy_(src)


@write_slice_.register_fake
def _write_slice_fake(buf: torch.Tensor, src: torch.Tensor, dim: int, start: int) -> None:
    return None
