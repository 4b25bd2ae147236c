"""Differential fuzzing of the capture pass: random decoder-like modules, compiled with the
pass on, compared bit for bit with the module run without it.

One case is a :class:`CaseSpec` drawn from a seed (:func:`random_spec`): a small decoder
(``Linear`` layers over a residual stream) whose forward takes K captures at chosen layers,
each made by a chosen *producer kind*, and returns ``(final_hidden, torch.cat(aux, dim))``
(plus a second concat when ``extra_cat`` is set). :func:`build_case` makes the module and its
inputs; :func:`run_case` compiles it with ``aux_capture_backend(inner, cost_model=False)`` and
compares outputs, and any inputs the module mutates, bitwise with:

- the eager module, for the ``eager`` and ``aot_eager`` inners;
- for ``inductor`` (its kernels may round differently from eager): the model's own output
  (the final hidden state) and the inputs it mutates against Inductor's build of the same
  module *without captures* (it returns ``(h,)`` only), the captures against the same
  Inductor compile with ``rewrite=False`` (the list build), or, where they differ, against
  that build with capture twins merged (``CaptureTwinsPass``: the captures read the model's
  own values, whose ``addmm`` may round differently from the list build's ``mm`` + ``add``;
  counted as ``twin_rounding`` with the largest difference), or against that build with
  every concat input computed in a kernel of its own (``RealizeConcatInputs``), as the
  pass's writes read them: stock Inductor computes a ``mm`` / ``addmm`` input straight into
  the concat's slice and inlines a pointwise input into the concat's kernel, and either can
  round differently on CPU (GEMM output layout; a ``tanh`` on the scalar instead of the vector
  path); counted as ``own_kernel_rounding``). Every Inductor compile runs
  with ``emulate_precision_casts=True`` (``INDUCTOR_OPTIONS``): by default Inductor keeps
  fused fp16/bf16 intermediates in fp32, and the rewrite, which materializes captures for
  ``write_slice_``, changes fusion and so the last bits of low-precision outputs
  (``run_case(..., inductor_options={})`` shows it). Every Inductor case is also compared
  with the uncompiled module, within ``UNCOMPILED_TOLERANCE`` (Inductor's rounding), at
  every token count it runs: a bug the list build and the pass share (a capture returned
  as the residual a later piece overwrites) cannot pass as "equal to the reference".

Besides bitwise equality a case records what the pass reported: exceptions it contained
(``pass_errors``) and reports that contradict the spec (``anomalies``: e.g. a concat dim read
wrongly). Equality and compile failures decide ``ok``; the others are counted separately.

Producer kinds (``KINDS``): ``pointwise`` (h + r, h * r, sigmoid, type promotion...),
``matmul`` (mm, linear, bmm), ``clone``, ``graph_input`` (a forward input or a module buffer
captured directly), ``slice_view`` (a narrow/slice of the hidden state, the residual or a
temporary), ``non_contiguous`` (transposed, expanded or strided views), ``custom_op``
(``cp_fuzz::scale`` and the two-output ``cp_fuzz::scale_pair``), ``shared`` (the capture also
feeds later layers), ``mutated_after`` (mutated in place after it is taken and before the cat,
by ``mul_``, a view's ``add_``, ``setitem``, ``copy_``, ``out=``, ``relu(inplace=True)`` or a
mutating custom op: the cat sees the mutated value) and ``mutated_after_cat`` (mutated after
the cat: the cat must not see it, and the mutated value reaches the output). Case-wide knobs:
dtype, ``[T, H]`` or ``[B, T, H]``, the concat dim (last or another, positive or negative),
capture order and duplicates, how the residual is updated (functional, ``add_``, a fused
mutating custom op that also mutates the input at layer 0), the concat's spelling
(``torch.cat``/``concat``/``concatenate``), custom ops called through the packet or
``.default``, a mutation of the concat's result, a capture read after the cat, and a second
concat (early or late, optionally over a slice of the first one's result).

Two knobs exercise backend options (drawn last, ~0.25 each, so older seeds keep every other
field; ``CaseSpec.with_knobs`` forces them):

- ``return_list``: the module returns ``(h, *aux)`` (the captures in ``cat_order``, no
  concat) and is compiled with ``pack_outputs=True``; the returned captures may come back
  as adjacent slices of one buffer, so the aliasing check exempts pairs of them (and
  nothing else). The knobs of the packed tensor (``mutate_packed``, ``extra_cat``) are off.
- ``split``: the module calls the functional ``cp_fuzz::barrier`` (``h.clone()``) after
  every layer and is compiled with ``split_ops=["cp_fuzz::barrier"]``: captures and the
  concat land in different pieces. A split that misses a barrier is an anomaly.

Two more, drawn after those:

- ``communicator`` (0.2): SGLang's fused-norm style: the residual is updated by the fused
  in-place op and clone/pointwise captures become ``residual.clone()``, taken right after
  their layer's fused op and overwritten by the next one; such cases are split (``split``) with chance 0.625,
  so the captured residual crosses pieces (``distinct_outputs.py``).
- ``dynamic_tokens`` (0.3, where the token count is free: the concat not along the token
  dim, no buffer captures): the token dim is marked dynamic, and the one compile also runs
  at two more counts, each compared as the first (recompiles are counted, not failed).

Both compiles of a case (with and without the pass) use the same backend options. An
``inductor`` mismatch also compares both compiles with eager, to tell a wrong reference
apart: Inductor itself (torch 2.13) miscompiles ``e.copy_(h[:, :1]); add_norm_(h, r)`` when
``e`` and ``h`` are graph inputs (``e`` receives ``h`` after the write), which ``split`` makes
of a ``mutated_after`` ``input:copy_`` capture and the fused residual
(``run_case(random_spec(2).with_knobs(split=True), "inductor")``: the pass hides it).

Replay one case: ``run_case(random_spec(seed), "aot_eager")``. Fuzz from the shell::

    python -m tools.fuzz --cases 300 --inners eager,aot_eager --inductor-every 50
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from compile_pass.backend import aux_capture_backend
from compile_pass.groups import Decision, GroupKind

__all__ = [
    "KINDS",
    "VARIANTS",
    "DTYPES",
    "SPLIT_OP",
    "CaptureSpec",
    "CaseSpec",
    "CaseResult",
    "random_spec",
    "build_case",
    "run_case",
    "fuzz",
    "format_summary",
    "main",
]

KINDS = ("pointwise", "matmul", "clone", "graph_input", "slice_view", "non_contiguous",
         "custom_op", "shared", "mutated_after", "mutated_after_cat")

#: per kind, the ways it is made (a variant is drawn per capture)
VARIANTS: Dict[str, Tuple[str, ...]] = {
    "pointwise": ("add", "mul", "sub", "div", "alpha", "scalar", "sigmoid", "promote"),
    "matmul": ("mm", "linear", "bmm"),
    "clone": ("hidden", "temp", "of_view"),
    "graph_input": ("input", "input_used", "buffer"),
    "slice_view": ("hidden", "residual", "temp", "getitem"),
    "non_contiguous": ("transpose", "expand", "stack"),
    "custom_op": ("scale", "pair"),
    "shared": ("add", "mm", "clone", "custom"),
    # base producer x mutation, e.g. "clone:view_add_"
    "mutated_after": tuple(f"{b}:{m}" for b in ("add", "clone", "mm", "input")
                           for m in ("mul_", "add_", "view_add_", "setitem", "copy_", "custom_",
                                     "out_", "relu_"))
    + ("view:mul_", "view:base_mul_"),
    "mutated_after_cat": tuple(f"{b}:{m}" for b in ("add", "sub", "clone", "mm", "input")
                               for m in ("mul_", "add_", "view_add_", "setitem")),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: how a layer updates the residual stream: ``r = r + h``; ``r.add_(h)``; or the mutating custom
#: op ``cp_fuzz::add_norm_(h, r)`` (SGLang's fused add-RMSNorm: ``r += h``, then ``h = norm(r)``,
#: both in place; at layer 0 ``h`` is the graph input ``x``)
RESIDUAL_MODES = ("functional", "inplace", "fused_op")

#: how the concat is spelled (all become ``aten.cat`` after AOTAutograd)
CAT_FNS = ("cat", "cat_positional", "cat_tensors_kw", "concat", "concatenate")

#: the op a ``split`` case calls after every layer (``h.clone()``), and splits its graph at
SPLIT_OP = "cp_fuzz::barrier"

#: knobs of the packed tensor, off in ``return_list`` cases (they return no packed tensor)
_NO_PACKED_KNOBS = dict(mutate_packed=False, extra_cat=None, extra_late=False, extra_packed_view=False)

#: the chance ``random_spec`` draws ``return_list`` (kept only where no knob of the packed
#: tensor is on: ~0.77 of cases, so ~0.25 in all) and ``split``
RETURN_LIST_DRAW = 1 / 3
SPLIT_DRAW = 0.25
#: the chance of a communicator-style case (then split with chance 0.625) and of a compile
#: over a dynamic token count run at 2 more counts (kept where ``tokens_free``)
COMMUNICATOR_DRAW = 0.2
DYNAMIC_DRAW = 0.3


# --------------------------------------------------------------------------- custom ops


def _register_ops() -> None:
    """Custom ops of the generated modules, registered once per process: the functional
    ``cp_fuzz::scale`` and two-output ``cp_fuzz::scale_pair`` (opaque layer boundaries for the
    pass's depth check), the mutating ``cp_fuzz::add_one_`` (a mutation known only from the
    schema), ``cp_fuzz::add_norm_`` (an SGLang-style fused add-norm, mutating h and r) and the
    functional ``cp_fuzz::barrier`` (``h.clone()``: where ``split`` cases split the graph)."""
    if hasattr(torch.ops.cp_fuzz, "scale"):
        return

    @torch.library.custom_op("cp_fuzz::scale", mutates_args=())
    def scale(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    @scale.register_fake
    def _(x: torch.Tensor, s: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("cp_fuzz::scale_pair", mutates_args=())
    def scale_pair(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x * 0.5, x * 2.0

    @scale_pair.register_fake
    def _(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.custom_op("cp_fuzz::add_one_", mutates_args=("x",))
    def add_one_(x: torch.Tensor) -> None:
        x.add_(1.0)

    @add_one_.register_fake
    def _(x: torch.Tensor) -> None:
        return None

    @torch.library.custom_op("cp_fuzz::barrier", mutates_args=())
    def barrier(h: torch.Tensor) -> torch.Tensor:
        return h.clone()

    @barrier.register_fake
    def _(h: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(h)

    @torch.library.custom_op("cp_fuzz::add_norm_", mutates_args=("h", "r"))
    def add_norm_(h: torch.Tensor, r: torch.Tensor) -> None:
        r.add_(h)
        h.copy_(r * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(r.dtype))

    @add_norm_.register_fake
    def _(h: torch.Tensor, r: torch.Tensor) -> None:
        return None


if __name__ != "__main__":  # run as a script, the imported tools.fuzz registers them
    _register_ops()


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class CaptureSpec:
    """One capture: taken at the start of ``layer`` (before that layer runs)."""

    layer: int
    kind: str
    variant: str
    width: int  # size along the concat dim
    offset: int = 0  # slice_view: start of the slice
    mutate_layer: Optional[int] = None  # mutated_after: mutated at this layer (== layers: before the cat)

    def describe(self) -> str:
        s = f"{self.kind}/{self.variant}@L{self.layer}:w{self.width}"
        if self.offset:
            s += f"+{self.offset}"
        if self.mutate_layer is not None:
            s += f">mutL{self.mutate_layer}"
        return s


@dataclass(frozen=True)
class CaseSpec:
    """A fuzz case: everything ``build_case`` needs, drawn from ``seed`` by ``random_spec``."""

    seed: int
    layers: int
    dtype: str  # key of DTYPES
    leading: str  # "2d": [T, H]; "3d": [B, T, H]
    tokens: int
    hidden: int
    batch: int  # 1 for "2d" (unused)
    cat_dim: int  # as passed to torch.cat (may be negative)
    captures: Tuple[CaptureSpec, ...]  # in production order (sorted by layer)
    cat_order: Tuple[int, ...]  # the concat's inputs, as indices into captures (may repeat)
    residual: str = "functional"  # one of RESIDUAL_MODES
    cat_fn: str = "cat"  # one of CAT_FNS
    op_call: str = "packet"  # custom ops called as torch.ops.cp_fuzz.op(...) or op.default(...)
    mutate_packed: bool = False  # packed.mul_(2) after the cat
    read_after_cat: Optional[int] = None  # a capture read after the cat (into the final hidden)
    extra_cat: Optional[Tuple[int, ...]] = None  # a second concat of these captures, also returned
    extra_late: bool = False  # the second concat comes after the post-cat mutations
    extra_packed_view: bool = False  # the second concat also takes a slice of the first's result
    return_list: bool = False  # return (h, *aux) (no concat) and compile with pack_outputs=True
    split: bool = False  # cp_fuzz::barrier after every layer; compile with split_ops at it
    #: communicator style (SGLang's fused-norm models): the residual is updated by the fused
    #: in-place op and clone/pointwise captures become ``residual.clone()`` (taken after the
    #: previous layer's fused op, overwritten by the next): the hazard of distinct_outputs.py
    communicator: bool = False
    #: extra token counts the same compile also runs (token dim marked dynamic); () = static
    dynamic_tokens: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.return_list and (self.mutate_packed or self.extra_cat is not None):
            raise ValueError(
                f"seed {self.seed}: return_list returns the captures without a concat, so the "
                f"knobs of the packed tensor must be off (mutate_packed={self.mutate_packed}, "
                f"extra_cat={self.extra_cat}); use spec.with_knobs(return_list=True)")

    def with_knobs(self, return_list: Optional[bool] = None, split: Optional[bool] = None,
                   communicator: Optional[bool] = None,
                   dynamic_tokens: Optional[Tuple[int, ...]] = None) -> "CaseSpec":
        """This case with ``return_list`` / ``split`` / ``communicator`` / ``dynamic_tokens``
        forced (None: kept); forcing ``return_list`` on also turns off the knobs of the
        packed tensor it no longer has, ``communicator`` on makes the residual the fused op's
        and the clone/pointwise captures residual clones, and ``dynamic_tokens`` is dropped
        where the token count is not free (``tokens_free``)."""
        spec = self
        if return_list is not None:
            spec = replace(spec, return_list=return_list,
                           **(_NO_PACKED_KNOBS if return_list else {}))
        if split is not None:
            spec = replace(spec, split=split)
        if communicator is not None:
            spec = _as_communicator(spec) if communicator else replace(spec, communicator=False)
        if dynamic_tokens is not None:
            spec = replace(spec, dynamic_tokens=tuple(dynamic_tokens) if spec.tokens_free else ())
        return spec

    @property
    def token_dim(self) -> int:
        return 0 if self.leading == "2d" else 1

    @property
    def tokens_free(self) -> bool:
        """The module runs at any token count: the concat is not along the token dim and no
        capture is a module buffer (its shape holds the token count)."""
        return self.dim != self.token_dim and not any(
            c.kind == "graph_input" and c.variant == "buffer" for c in self.captures)

    @property
    def backend_options(self) -> Dict[str, Any]:
        """``aux_capture_backend`` options of this case (both compiles of a case use them)."""
        return dict(pack_outputs=self.return_list,
                    split_ops=[SPLIT_OP] if self.split else [])

    @property
    def shape(self) -> Tuple[int, ...]:
        """The hidden state's shape."""
        if self.leading == "2d":
            return (self.tokens, self.hidden)
        return (self.batch, self.tokens, self.hidden)

    @property
    def dim(self) -> int:
        """The concat dim, non-negative."""
        return self.cat_dim % len(self.shape)

    @property
    def widths(self) -> Tuple[int, ...]:
        return tuple(c.width for c in self.captures)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(c.kind for c in self.captures)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def capture_shape(self, i: int) -> Tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = self.captures[i].width
        return tuple(shape)

    def _uses_custom_ops(self) -> bool:
        return self.residual == "fused_op" or self.split or any(
            c.kind == "custom_op" or c.variant in ("custom",) or c.variant.endswith(":custom_")
            for c in self.captures)

    def describe(self) -> str:
        parts = [
            f"seed={self.seed}", f"L={self.layers}", self.dtype,
            "x".join(map(str, self.shape)), f"cat(dim={self.cat_dim})",
            "caps=[" + ", ".join(c.describe() for c in self.captures) + "]",
        ]
        if list(self.cat_order) != list(range(len(self.captures))):
            parts.append(f"order={list(self.cat_order)}")
        if self.residual != "functional":
            parts.append(f"residual={self.residual}")
        if self.cat_fn != "cat" and not self.return_list:
            parts.append(f"cat_fn={self.cat_fn}")
        if self.op_call != "packet" and self._uses_custom_ops():
            parts.append(f"op_call={self.op_call}")
        if self.mutate_packed:
            parts.append("mutate_packed")
        if self.read_after_cat is not None:
            parts.append(f"read_after_cat={self.read_after_cat}")
        if self.extra_cat is not None:
            parts.append(f"extra_cat={list(self.extra_cat)}" + ("+packed_view" if self.extra_packed_view
                                                              else "") + (",late" if self.extra_late else ""))
        if self.return_list:
            parts.append("return_list")
        if self.split:
            parts.append("split")
        if self.communicator:
            parts.append("communicator")
        if self.dynamic_tokens:
            parts.append(f"dynamic_tokens={list(self.dynamic_tokens)}")
        return " ".join(parts)


def _as_communicator(spec: CaseSpec) -> CaseSpec:
    """``spec`` in communicator style (``CaseSpec.communicator``)."""
    captures = tuple(replace(c, kind="clone", variant="residual") if c.kind in ("clone", "pointwise")
                     else c for c in spec.captures)
    return replace(spec, communicator=True, residual="fused_op", captures=captures)


def _after_fused_op(spec: CaseSpec, c: CaptureSpec) -> bool:
    """A communicator capture: the residual cloned right after its layer's fused op."""
    return spec.communicator and spec.residual == "fused_op" and c.variant == "residual"


def _is_forward_input(c: CaptureSpec) -> bool:
    """The capture is a tensor passed to forward (after ``x``)."""
    return (c.kind == "graph_input" and c.variant != "buffer"
            or c.kind in ("mutated_after", "mutated_after_cat") and c.variant.startswith("input:"))


def _other_dim(spec: CaseSpec) -> int:
    """A dim other than the concat dim (for expand / view mutations)."""
    return 0 if spec.dim != 0 else 1


def random_spec(seed: int) -> CaseSpec:
    """The case of ``seed`` (deterministic: a seeded ``random.Random``)."""
    rng = random.Random(seed)
    layers = rng.randint(3, 8)
    dtype = rng.choice(sorted(DTYPES))
    leading = rng.choice(["2d", "3d"])
    tokens, hidden = rng.randint(4, 24), rng.randint(4, 16)
    if leading == "2d":
        batch = 1
        cat_dim = rng.choices([-1, 1, 0], weights=[6, 2, 1])[0]
    else:
        batch = rng.randint(1, 3)
        cat_dim = rng.choices([-1, 2, 1, -2, 0], weights=[4, 2, 2, 1, 1])[0]
        if cat_dim == 0 and batch == 1:
            batch = rng.randint(2, 4)
    shape = (tokens, hidden) if leading == "2d" else (batch, tokens, hidden)
    dim = cat_dim % len(shape)
    full = shape[dim]

    k = rng.randint(2, 5)
    if rng.random() < 0.1:  # all at one layer: often one block, rejected by the pass
        at = rng.randrange(layers)
        positions = [at] * k
    else:
        positions = sorted(rng.randrange(layers) for _ in range(k))
    all_full = rng.random() < 0.5
    captures = []
    for layer in positions:
        kind = rng.choice(KINDS)
        variants = [v for v in VARIANTS[kind] if not (v == "bmm" and leading == "2d")]
        variant = rng.choice(variants)
        width = full if all_full or rng.random() < 0.4 else rng.randint(1, full)
        if rng.random() < 0.03:
            width = 0  # an empty capture: legal for torch.cat
        offset = 0
        mutate_layer = None
        if kind == "slice_view":
            if full > 1 and width >= full:
                width = rng.randint(1, full - 1)
            offset = rng.randint(0, full - width)
        if kind == "mutated_after":
            mutate_layer = rng.randint(layer, layers)
        captures.append(CaptureSpec(layer, kind, variant, width, offset, mutate_layer))

    order = list(range(k))
    if rng.random() < 0.25:
        rng.shuffle(order)
    if rng.random() < 0.12:
        order.insert(rng.randrange(k + 1), rng.randrange(k))  # one capture concatenated twice
    extra, extra_view = None, False
    if rng.random() < 0.15:
        extra_view = rng.random() < 0.5
        extra = tuple(rng.sample(range(k), rng.randint(1 if extra_view else 2, k)))
    fields = dict(
        seed=seed, layers=layers, dtype=dtype, leading=leading, tokens=tokens, hidden=hidden,
        batch=batch, cat_dim=cat_dim, captures=tuple(captures), cat_order=tuple(order),
        residual=rng.choices(RESIDUAL_MODES, weights=[6, 2, 2])[0],
        cat_fn=rng.choices(CAT_FNS, weights=[6, 1, 1, 1, 1])[0],
        op_call=rng.choice(["packet", "overload"]),
        mutate_packed=rng.random() < 0.1,
        read_after_cat=rng.randrange(k) if rng.random() < 0.2 else None,
        extra_cat=extra,
        extra_late=extra is not None and rng.random() < 0.5,
        extra_packed_view=extra_view,
    )
    # the newest knobs last, so that every seed keeps the fields drawn above; both are drawn
    # in every case (one stream for all seeds), return_list kept only where it fits
    return_list = rng.random() < RETURN_LIST_DRAW
    split = rng.random() < SPLIT_DRAW
    return_list = return_list and not fields["mutate_packed"] and fields["extra_cat"] is None
    # drawn after every older field (older seeds keep them)
    communicator = rng.random() < COMMUNICATOR_DRAW
    if communicator and not split:
        split = rng.random() < 0.5  # the hazard needs the residual to cross pieces
    dynamic = rng.random() < DYNAMIC_DRAW
    extra_counts = tuple(sorted({max(2, tokens + rng.randint(-3, 9)), tokens * 2} - {tokens}))
    spec = CaseSpec(**fields, return_list=return_list, split=split)
    if communicator:
        spec = _as_communicator(spec)
    if dynamic and spec.tokens_free:
        spec = replace(spec, dynamic_tokens=extra_counts)
    return spec


# --------------------------------------------------------------------------- the module


class FuzzDecoder(nn.Module):
    """A small decoder over a residual stream whose forward follows a ``CaseSpec``."""

    def __init__(self, spec: CaseSpec) -> None:
        super().__init__()
        #: False: forward returns ``(h,)`` only: the build without captures (``run_case``)
        self.returns_captures = True
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        dt, H = spec.torch_dtype, spec.hidden

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dt)

        self.layers = nn.ModuleList()
        for _ in range(spec.layers):
            lin = nn.Linear(H, H, bias=True)
            with torch.no_grad():
                lin.weight.copy_(rand(H, H, scale=H ** -0.5))
                lin.bias.copy_(rand(H, scale=0.1))
            self.layers.append(lin.to(dt))
        last = spec.dim == len(spec.shape) - 1
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for i, c in enumerate(spec.captures):
            out = c.width if last else H
            self.weights.append(nn.Parameter(rand(H, out, scale=H ** -0.5)))
            self.biases.append(nn.Parameter(rand(out, scale=0.1)))
            self.register_buffer(f"const{i}", rand(*spec.capture_shape(i)))
        self._last = last

    # ---- helpers

    def _op(self, name: str) -> Any:
        packet = getattr(torch.ops.cp_fuzz, name)
        return packet if self.spec.op_call == "packet" else packet.default

    def _take(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """``t`` narrowed to capture ``i``'s width along the concat dim (``t`` if full)."""
        d, w = self.spec.dim, self.spec.captures[i].width
        return t if t.shape[d] == w else t.narrow(d, 0, w)

    def _matmul(self, h: torch.Tensor, i: int, variant: str) -> torch.Tensor:
        W, b = self.weights[i], self.biases[i]
        x = h if self._last else self._take(h, i)  # last dim: W maps H -> width
        if variant == "linear":
            return F.linear(x, W.t(), b)
        if variant == "bmm" and x.dim() == 3:
            return torch.bmm(x, W.expand(x.shape[0], *W.shape))
        return x @ W

    def _produce(self, i: int, h: torch.Tensor, r: torch.Tensor, inputs: Dict[int, torch.Tensor],
                 state: Dict[str, Any]) -> torch.Tensor:
        spec, c = self.spec, self.spec.captures[i]
        d, take = spec.dim, (lambda t: self._take(t, i))
        kind, variant = c.kind, c.variant
        if kind in ("shared", "mutated_after", "mutated_after_cat"):
            variant = variant.split(":")[0]
            kind = {"add": "pointwise", "sub": "pointwise", "mm": "matmul", "clone": "clone",
                    "custom": "custom_op", "input": "graph_input", "view": "slice_view"}[variant]
            variant = {"mm": "mm", "clone": "temp", "custom": "scale", "input": "input",
                       "view": "temp"}.get(variant, variant)
        if kind == "pointwise":
            a, b = take(h), take(r)
            if variant == "add":
                return a + b
            if variant == "mul":
                return a * b
            if variant == "sub":
                return a - b
            if variant == "div":
                return a / (b.abs() + 1.0)
            if variant == "alpha":
                return torch.add(a, b, alpha=0.5)
            if variant == "scalar":
                return a * 0.5 + 0.25
            if variant == "sigmoid":
                return torch.sigmoid(a)
            if variant == "promote":
                return a.float() + b.float()
        if kind == "matmul":
            return self._matmul(h, i, variant)
        if kind == "clone":
            if variant == "hidden":
                return h.clone() if take(h) is h else take(h).clone()
            if variant == "temp":
                return (take(h) * take(r)).clone()
            if variant == "of_view":  # clone of a (possibly non-contiguous) view
                return h.narrow(d, h.shape[d] - c.width, c.width).clone()
            if variant == "residual":  # communicator: the residual the next fused op overwrites
                return take(r).clone()
        if kind == "graph_input":
            if variant == "buffer":
                return getattr(self, f"const{i}")
            x = inputs[i]
            if variant == "input_used":
                state["r_bias"].append(x.mean(dim=d, keepdim=True))
            return x
        if kind == "slice_view":
            if variant == "hidden":
                return h.narrow(d, c.offset, c.width)
            if variant == "residual":
                return r.narrow(d, c.offset, c.width)
            if variant == "temp":
                t = h * r
                state.setdefault("bases", {})[i] = t
                return t.narrow(d, c.offset, c.width)
            if variant == "getitem":
                index = (slice(None),) * d + (slice(c.offset, c.offset + c.width),)
                return h[index]
        if kind == "non_contiguous":
            if variant == "transpose":
                u = (take(h) + take(r)).transpose(-1, -2).contiguous()
                return u.transpose(-1, -2)
            if variant == "expand":
                a = take(h)
                return a.narrow(_other_dim(spec), 0, 1).expand(a.shape)
            if variant == "stack":
                return torch.stack([take(h), take(r)], dim=-1)[..., 0]
        if kind == "custom_op":
            if variant == "scale":
                return self._op("scale")(take(h), 0.5)
            if variant == "pair":
                return self._op("scale_pair")(take(h))[1]
        raise ValueError(f"unknown producer {c.kind}/{c.variant}")

    def _mutate(self, i: int, cap: torch.Tensor, h: torch.Tensor, how: str,
                state: Dict[str, Any]) -> None:
        if how == "mul_":
            cap.mul_(2.0)
        elif how == "add_":
            cap.add_(1.0)
        elif how == "view_add_":
            cap.narrow(_other_dim(self.spec), 0, 1).add_(1.0)
        elif how == "setitem":
            cap[0] = 0.5
        elif how == "copy_":
            cap.copy_(self._take(h, i))
        elif how == "base_mul_":
            state["bases"][i].mul_(2.0)
        elif how == "out_":
            torch.mul(cap, 2.0, out=cap)
        elif how == "relu_":
            F.relu(cap, inplace=True)
        elif how == "custom_":
            self._op("add_one_")(cap)
        else:
            raise ValueError(f"unknown mutation {how}")

    def _cat(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        fn, dim = self.spec.cat_fn, self.spec.cat_dim
        if fn == "cat_positional":
            return torch.cat(tensors, dim)
        if fn == "cat_tensors_kw":
            return torch.cat(tensors=tensors, dim=dim)
        if fn == "concat":
            return torch.concat(tensors, dim=dim)
        if fn == "concatenate":
            return torch.concatenate(tensors, axis=dim)
        return torch.cat(tensors, dim=dim)

    def _extra_cat(self, caps: Dict[int, torch.Tensor], packed: torch.Tensor) -> torch.Tensor:
        tensors = [caps[i] for i in self.spec.extra_cat]
        if self.spec.extra_packed_view:  # a view of the first concat's result
            tensors.append(packed.narrow(self.spec.dim, 0, min(1, packed.shape[self.spec.dim])))
        return self._cat(tensors)

    # ---- forward

    def forward(self, x: torch.Tensor, *extra: torch.Tensor):
        spec = self.spec
        d = spec.dim
        graph_inputs = [i for i, c in enumerate(spec.captures) if _is_forward_input(c)]
        inputs = dict(zip(graph_inputs, extra))
        state: Dict[str, Any] = {"r_bias": []}
        caps: Dict[int, torch.Tensor] = {}
        h, r = x, x * 0.5
        for layer_index, layer in enumerate(self.layers):
            for i, c in enumerate(spec.captures):
                if c.layer != layer_index or _after_fused_op(spec, c):
                    continue
                cap = self._produce(i, h, r, inputs, state)
                caps[i] = cap
                if c.kind == "shared":  # feeds the later layers through the residual
                    r = r + (cap if cap.shape == r.shape else cap.mean(dim=d, keepdim=True))
            for i, c in enumerate(spec.captures):
                if c.kind == "mutated_after" and c.mutate_layer == layer_index:
                    self._mutate(i, caps[i], h, c.variant.split(":")[1], state)
            for bias in state["r_bias"]:
                r = r + bias
            state["r_bias"] = []
            if spec.residual == "fused_op":
                self._op("add_norm_")(h, r)
                for i, c in enumerate(spec.captures):  # communicator: the fused op's residual
                    if c.layer == layer_index and _after_fused_op(spec, c):
                        caps[i] = self._produce(i, h, r, inputs, state)
                h = torch.tanh(layer(h))
            else:
                if spec.residual == "inplace":
                    r.add_(h)
                else:
                    r = r + h
                h = torch.tanh(layer(r))
            if spec.split:  # where the backend splits the graph (split_ops)
                h = self._op("barrier")(h)
        for i, c in enumerate(spec.captures):
            if c.kind == "mutated_after" and c.mutate_layer == spec.layers:
                self._mutate(i, caps[i], h, c.variant.split(":")[1], state)

        aux = [caps[i] for i in spec.cat_order]
        if spec.return_list:  # the captures returned for the caller to pack (pack_outputs)
            packed = None
            outputs = [None, *aux]
        else:
            packed = self._cat(aux)
            outputs = [None, packed]
        if spec.extra_cat is not None and not spec.extra_late:
            outputs.append(self._extra_cat(caps, packed))
        if spec.mutate_packed:
            packed.mul_(2.0)
        for i, c in enumerate(spec.captures):
            if c.kind == "mutated_after_cat":
                self._mutate(i, caps[i], h, c.variant.split(":")[1], state)
                h = h + caps[i].mean(dim=d, keepdim=True)
        if spec.read_after_cat is not None:
            h = h + caps[spec.read_after_cat].mean(dim=d, keepdim=True)
        if spec.extra_cat is not None and spec.extra_late:
            outputs.append(self._extra_cat(caps, packed))
        outputs[0] = h
        if not self.returns_captures:  # the build without captures: the model's own output
            return (h,)
        return tuple(outputs)


def build_case(spec: CaseSpec) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """The module of ``spec`` and its inputs (``x`` then one tensor per captured input)."""
    return FuzzDecoder(spec).eval(), case_inputs(spec)


def case_inputs(spec: CaseSpec, tokens: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
    """The inputs of ``spec``'s module at ``tokens`` tokens (default ``spec.tokens``; another
    count needs ``spec.tokens_free``)."""
    if tokens is not None and tokens != spec.tokens:
        if not spec.tokens_free:
            raise ValueError(f"seed {spec.seed}: the module's shapes hold the token count "
                             f"({spec.tokens}); it cannot run at {tokens} tokens")
        spec = replace(spec, tokens=tokens)
    g = torch.Generator().manual_seed(spec.seed + 1_000_003)
    dt = spec.torch_dtype
    inputs = [torch.randn(*spec.shape, generator=g).to(dt)]
    for i, c in enumerate(spec.captures):
        if _is_forward_input(c):
            inputs.append(torch.randn(*spec.capture_shape(i), generator=g).to(dt))
    return tuple(inputs)


# --------------------------------------------------------------------------- running a case


@dataclass
class CaseResult:
    spec: CaseSpec
    inner: str
    equal: bool  # outputs (and mutated inputs) bitwise equal to the reference
    compile_error: Optional[str]  # compile or run of the rewritten module failed
    rewritten: int  # groups rewritten (all graphs of the compile)
    rejected: int  # groups rejected
    reasons: List[str]  # "decision: reason" per group
    strategies: List[str] = field(default_factory=list)  # per capture of rewritten groups
    pass_errors: List[str] = field(default_factory=list)  # exceptions the pass contained
    anomalies: List[str] = field(default_factory=list)  # pass reports that contradict the spec
    outputs_rewritten: int = 0  # of ``rewritten``: output groups (return_list cases)
    outputs_rejected: int = 0  # of ``rejected``: output groups
    pieces: List[int] = field(default_factory=list)  # compute pieces per split graph (split cases)
    #: output pairs sharing storage in the compiled module only (allowed: returned captures
    #: packed by pack_outputs)
    aliased: List[Tuple[int, int]] = field(default_factory=list)
    #: inductor: the captures differ from the list build's only as the list build with
    #: capture twins merged computes them (fused vs unfused add): their largest difference
    twin_rounding: Optional[float] = None
    #: inductor: the captures differ from the list build's only as a list build whose concat
    #: inputs are computed in kernels of their own computes them (``RealizeConcatInputs``:
    #: stock Inductor computes a GEMM into the concat's slice or a pointwise input inside
    #: the concat's kernel, which can round differently): their largest difference
    own_kernel_rounding: Optional[float] = None
    #: inductor: the list build (pass off) changes the model's own output, vs no captures
    list_changes_model: bool = False
    #: inductor: ... and the pass keeps the list build's output (a capture Inductor would
    #: otherwise have fused away), not the build without captures'
    model_as_list: bool = False
    #: inductor: the list build's captures are further from eager's than
    #: ``UNCOMPILED_TOLERANCE`` and the pass's are within it (Inductor without the pass is wrong)
    reference_wrong: bool = False
    #: dynamic cases: token counts run through the one compile, and backend calls after the
    #: first run (a recompile: Dynamo specialized the count; not a failure of the pass)
    token_counts: List[int] = field(default_factory=list)
    recompiles: int = 0
    detail: str = ""  # what differed
    baseline: str = ""  # on failure: the same compile with rewrite=False ("ok" / what failed)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.equal and self.compile_error is None

    def describe(self) -> str:
        status = "ok" if self.ok else ("COMPILE FAILURE" if self.compile_error else "MISMATCH")
        notes = [n for n, on in (("list build wrong vs eager, the pass right", self.reference_wrong),
                                 ("captures rounded as computed outside the concat, the list "
                                  "build computes them into it",
                                  self.own_kernel_rounding is not None),
                                 ("model output as the list build's (a capture Inductor would fuse away)",
                                  self.model_as_list)) if on]
        if notes:
            status += f" ({'; '.join(notes)})"
        s = f"[{self.inner}] {status}: {self.spec.describe()}"
        if self.compile_error:
            s += f"\n    error: {self.compile_error}"
        if self.detail:
            s += f"\n    differs: {self.detail}"
        if self.baseline:
            s += f"\n    rewrite=False: {self.baseline}"
        if self.reasons:
            s += "\n    groups: " + " | ".join(self.reasons)
        if self.pass_errors:
            s += "\n    pass errors: " + " | ".join(self.pass_errors)
        if self.anomalies:
            s += "\n    anomalies: " + " | ".join(self.anomalies)
        s += f"\n    replay: run_case(random_spec({self.spec.seed}), {self.inner!r})"
        return s


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def _difference(got: Sequence[Any], ref: Sequence[Any], what: str) -> Optional[str]:
    """None if bitwise equal, else where and how they differ."""
    if len(got) != len(ref):
        return f"{what}: {len(got)} values, expected {len(ref)}"
    for j, (a, b) in enumerate(zip(got, ref)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if a != b:
                return f"{what}[{j}]: {a!r} != {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what}[{j}]: {tuple(a.shape)}/{a.dtype}, expected {tuple(b.shape)}/{b.dtype}"
        if not torch.equal(_bits(a), _bits(b)):
            bad = _bits(a) != _bits(b)
            diff = (a.float() - b.float()).abs()
            return (f"{what}[{j}] {tuple(a.shape)}: {int(bad.sum())}/{bad.numel()} elements differ, "
                    f"max abs diff {diff.max().item():.4g}, first at {tuple(bad.nonzero()[0].tolist())}")
    return None


def _aliasing(outputs: Sequence[Any]) -> set:
    """Pairs of output positions that share storage."""
    pairs = set()
    tensors = [(j, t) for j, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.numel()]
    for x, (i, a) in enumerate(tensors):
        for j, b in tensors[x + 1:]:
            if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                pairs.add((i, j))
    return pairs


#: the backend of the last compile started (to report pass decisions of a failed compile)
_LAST_BACKEND: List[Any] = []


def _clone_inputs(inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.clone() for t in inputs]


#: Inductor options of both compiles of an ``inductor`` case. Without precision-cast emulation
#: Inductor keeps fused fp16/bf16 intermediates in fp32, so any change of fusion (which the
#: rewrite makes: a capture read by ``write_slice_`` is materialized) changes rounding.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


class RealizeConcatInputs(CustomGraphPass):
    """Inductor post-grad pre pass of an oracle build: every computed tensor a concat reads
    goes through ``cp_fuzz::barrier`` (an opaque ``clone``) first, so Inductor computes it in
    a kernel of its own and copies it into the concat, as it does for a value the pass's
    ``write_slice_`` reads. Stock Inductor instead computes a concat's ``mm`` / ``addmm``
    input straight into the concat's slice (``extern_kernels.mm(out=slice)``: the GEMM
    rounds by output layout and alignment) and inlines a pointwise input into the concat's
    kernel (where a transcendental such as ``tanh`` can take the scalar rather than the
    vector path): both can change the last bit on CPU. ``then``: a pass run first."""

    def __init__(self, then: Optional[Any] = None) -> None:
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.then is not None:
            self.then(graph)
        barrier = torch.ops.cp_fuzz.barrier.default
        for cat in list(graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)):
            inputs = list(cat.args[0])
            for j, value in enumerate(inputs):
                if not isinstance(value, torch.fx.Node) or value.op != "call_function" \
                        or not isinstance(value.meta.get("val"), torch.Tensor):
                    continue
                with graph.inserting_before(cat):
                    realized = graph.call_function(barrier, (value,))
                realized.meta["val"] = torch.empty_like(value.meta["val"])
                inputs[j] = realized
            cat.args = (inputs, *cat.args[1:])

    def uuid(self) -> str:
        return f"realize_concat_inputs:{self.then.uuid() if self.then is not None else ''}"


def _compiled_run(module: nn.Module, inputs: Sequence[torch.Tensor], inner: str, rewrite: bool,
                  cost_model: bool, inductor_options: Optional[Dict[str, Any]] = None,
                  backend_options: Optional[Dict[str, Any]] = None, twins_only: bool = False,
                  inputs_realized: bool = False):
    """(outputs, inputs after the run, backend) of one fresh compile; raises what it raises.

    ``backend_options``: ``pack_outputs`` / ``split_ops`` (``CaseSpec.backend_options``).
    ``twins_only`` (inductor, ``rewrite=False``): Inductor merges capture twins
    (``CaptureTwinsPass``) but nothing is rewritten: the captures as the rewrite computes them.
    ``inputs_realized`` (inductor, ``rewrite=False``, with ``twins_only``): every computed
    concat input is computed in a kernel of its own and copied (``RealizeConcatInputs``)."""
    runs, backend, _ = _compiled_runs(module, [inputs], inner, rewrite, cost_model, inductor_options,
                                      backend_options, twins_only, inputs_realized=inputs_realized)
    return runs[0][0], runs[0][1], backend


def _compiled_runs(module: nn.Module, input_sets: Sequence[Sequence[torch.Tensor]], inner: str,
                   rewrite: bool, cost_model: bool, inductor_options: Optional[Dict[str, Any]] = None,
                   backend_options: Optional[Dict[str, Any]] = None, twins_only: bool = False,
                   token_dim: int = 0, inputs_realized: bool = False):
    """One fresh compile run on each of ``input_sets``: ([(outputs, inputs after), ...],
    backend, recompiles). With more than one set the first set's token dim (``token_dim`` of
    every input) is marked dynamic, so one graph can serve every count; ``recompiles``
    counts backend calls after the first run."""
    torch._dynamo.reset()
    options = dict(INDUCTOR_OPTIONS if inductor_options is None else inductor_options) \
        if inner == "inductor" else {}
    if twins_only:
        from compile_pass.inductor_pass import CaptureTwinsPass

        options["post_grad_custom_pre_pass"] = CaptureTwinsPass()
    if inputs_realized:
        twins = options.get("post_grad_custom_pre_pass")
        options["post_grad_custom_pre_pass"] = RealizeConcatInputs(twins)
    backend = aux_capture_backend(inner, rewrite=rewrite, cost_model=cost_model,
                                  **(backend_options or {}), **options)
    _LAST_BACKEND[:] = [backend]
    calls = [0]

    def counting(gm: Any, example_inputs: Any) -> Any:
        calls[0] += 1
        return backend(gm, example_inputs)

    compiled = torch.compile(module, backend=counting, fullgraph=True, dynamic=False)
    runs = []
    first_calls = 0
    for n, inputs in enumerate(input_sets):
        args = _clone_inputs(inputs)
        if len(input_sets) > 1 and n == 0:
            for t in args:
                torch._dynamo.mark_dynamic(t, token_dim)
        if inner == "inductor" and rewrite:
            # caches would skip the post-grad pass (and its report) on a hit
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config

            with inductor_config.patch(fx_graph_cache=False), \
                    functorch_config.patch(enable_autograd_cache=False):
                out = compiled(*args)
        else:
            out = compiled(*args)
        if n == 0:
            first_calls = calls[0]
        runs.append((tuple(out), args))
    return runs, backend, calls[0] - first_calls


def _error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


def _compare(out, args, ref_out, ref_args, packed_outputs: Sequence[int] = ()) -> Optional[str]:
    """None if outputs and inputs after the run are bitwise equal and no two outputs share
    storage that the reference's do not; ``packed_outputs``: output positions that may share
    storage with each other (the captures a ``pack_outputs`` compile returns as adjacent
    slices of one buffer), and with nothing else."""
    diff = _difference(out, ref_out, "output") or _difference(args, ref_args, "input after run")
    if diff is None:
        packed = set(packed_outputs)
        extra = {(i, j) for i, j in _aliasing(out) - _aliasing(ref_out)
                 if not (i in packed and j in packed)}
        if extra:
            diff = f"outputs {sorted(extra)} share storage in the compiled module only"
    return diff


def _packed_outputs(spec: CaseSpec) -> Tuple[int, ...]:
    """Output positions of the returned captures (``return_list``): ``(h, *aux)``."""
    return tuple(range(1, 1 + len(spec.cat_order))) if spec.return_list else ()


def _packed_shape(spec: CaseSpec) -> Tuple[int, ...]:
    shape = list(spec.shape)
    shape[spec.dim] = sum(spec.captures[i].width for i in spec.cat_order)
    return tuple(shape)


def _anomalies(spec: CaseSpec, group: Any) -> List[str]:
    """Facts the pass got wrong about the spec's main concat (its shape and K identify it)."""
    if group.kind is not GroupKind.CONCAT:
        return []
    inputs = group.cat.args[0] if group.cat.args else group.cat.kwargs.get("tensors", ())
    if tuple(group.example_shape) != _packed_shape(spec) or len(inputs) != len(spec.cat_order):
        return []
    if group.dim != spec.dim:
        return [f"{group.cat.name}: concat dim read as {group.dim}, the concat is along dim "
                f"{spec.dim} ({spec.cat_fn}, dim={spec.cat_dim}); {group.decision.value}: {group.reason}"]
    return []


def _compare_inductor(result: CaseResult, module: nn.Module, inputs: Sequence[torch.Tensor],
                      out: Sequence[Any], args: Sequence[Any], ref_out: Sequence[Any],
                      ref_args: Sequence[Any], cost_model: bool,
                      inductor_options: Optional[Dict[str, Any]]) -> Optional[str]:
    """The rule under Inductor, None where it holds, else what broke it:

    - the model's own output and the inputs it mutates equal the build without captures
      (``returns_captures=False``) bit for bit; where the list build (pass off) differs from
      that build too and the pass equals the list build, the capture itself is what Inductor
      would have fused away (an ``mm`` output read by a fused ``add``): counted as
      ``model_as_list``, the pass changes nothing the list path did not;
    - the captures equal the list build's, or, where they do not, the list build's with
      capture twins merged (``result.twin_rounding`` records how far the list build's are:
      a fused vs unfused add), or, where the list build is within ``UNCOMPILED_TOLERANCE``
      of eager (it only rounds differently), the list build's with every concat input
      computed in a kernel of its own (``result.own_kernel_rounding``), or eager's where the
      list build is itself wrong
      (``result.reference_wrong``: Inductor without the pass is further from eager than
      ``UNCOMPILED_TOLERANCE``, the pass within it);
    - outputs share storage only as the reference's do (and returned captures)."""
    spec = result.spec
    module.returns_captures = False
    try:
        nc_out, nc_args, _ = _compiled_run(module, inputs, "inductor", False, cost_model,
                                           inductor_options, spec.backend_options)
    finally:
        module.returns_captures = True
    result.list_changes_model = _difference(ref_out[:1], nc_out, "") is not None \
        or _difference(ref_args, nc_args, "") is not None
    model_diff = _difference(out[:1], nc_out, "model output (vs the build without captures)") \
        or _difference(args, nc_args, "input after run (vs the build without captures)")
    if model_diff is not None:
        as_list = _difference(out[:1], ref_out[:1], "") is None and \
            _difference(args, ref_args, "") is None
        if not (result.list_changes_model and as_list):
            return model_diff
        result.model_as_list = True
    packed = tuple(i - 1 for i in _packed_outputs(spec))  # positions among out[1:]
    capture_diff = _compare(out[1:], args, ref_out[1:], ref_args, packed)
    if capture_diff is not None:
        twin_out, twin_args, _ = _compiled_run(module, inputs, "inductor", False, cost_model,
                                               inductor_options, spec.backend_options,
                                               twins_only=True)
        if _compare(out[1:], args, twin_out[1:], twin_args, packed) is None:
            result.twin_rounding = _largest_difference(out[1:], ref_out[1:])
        else:
            eager_args = _clone_inputs(inputs)
            eager_out = tuple(module(*eager_args))

            def off_eager(o: Sequence[Any], a: Sequence[Any]) -> Optional[str]:
                return _close_to_uncompiled(o[1:], a, eager_out[1:], eager_args, spec.torch_dtype,
                                            spec.tokens)

            if off_eager(ref_out, ref_args) is None:
                # the list build rounds: the pass must equal, bit for bit, the list build
                # whose concat inputs are computed in kernels of their own
                realized = _inputs_realized_run(module, inputs, cost_model, inductor_options,
                                                spec.backend_options)
                if _compare(out[1:], args, *realized, packed) is not None:
                    return (f"captures: {capture_diff} (and vs the list build with twins merged, "
                            f"and with its concat inputs realized)")
                result.own_kernel_rounding = _largest_difference(out[1:], ref_out[1:])
            elif off_eager(out, args) is not None:
                return f"captures: {capture_diff} (and vs the list build with twins merged)"
            else:
                # the list build is further from eager's captures (or the inputs it mutates)
                # than Inductor's rounding (a stock Inductor bug: docs/piecewise.md section 6),
                # the pass within it
                result.reference_wrong = True
    extra = {(i, j) for i, j in _aliasing(out) - _aliasing(ref_out)
             if not (i in _packed_outputs(spec) and j in _packed_outputs(spec))}
    if extra:
        return f"outputs {sorted(extra)} share storage in the compiled module only"
    return None


def _largest_difference(got: Sequence[Any], ref: Sequence[Any]) -> float:
    return max((((a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
                for a, b in zip(got, ref) if isinstance(a, torch.Tensor)), default=0.0)


def _inputs_realized_run(module: nn.Module, inputs: Sequence[torch.Tensor], cost_model: bool,
                         inductor_options: Optional[Dict[str, Any]],
                         backend_options: Optional[Dict[str, Any]]) -> Tuple[Sequence[Any], Sequence[Any]]:
    """(captures, inputs after the run) of the list build with twins merged and every
    concat input computed in a kernel of its own (``RealizeConcatInputs``)."""
    out, args, _ = _compiled_run(module, inputs, "inductor", False, cost_model, inductor_options,
                                 backend_options, twins_only=True, inputs_realized=True)
    return out[1:], args


#: ``atol = rtol`` of an Inductor case vs the uncompiled module, per dtype: Inductor's own
#: rounding (fused or reassociated reductions, ``addmm`` vs ``mm`` + ``add``) stays well
#: inside it over these few tanh layers; an aliasing bug (a capture holding a later residual)
#: is off by O(1)
UNCOMPILED_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _close_to_uncompiled(out: Sequence[Any], args: Sequence[Any], eager_out: Sequence[Any],
                         eager_args: Sequence[Any], dtype: torch.dtype, tokens: int) -> Optional[str]:
    """None if outputs and mutated inputs are within ``UNCOMPILED_TOLERANCE`` of the
    uncompiled module's, else what differs."""
    tol = UNCOMPILED_TOLERANCE[dtype]
    for what, got, ref in (("output", out, eager_out), ("input after run", args, eager_args)):
        if len(got) != len(ref):
            return f"{what}: {len(got)} values, the uncompiled module {len(ref)}"
        for j, (a, b) in enumerate(zip(got, ref)):
            if not isinstance(a, torch.Tensor):
                continue
            if a.shape != b.shape:
                return f"{what}[{j}] at {tokens} tokens: shape {tuple(a.shape)}, uncompiled {tuple(b.shape)}"
            if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol, equal_nan=True):
                worst = (a.float() - b.float()).abs().max().item()
                return (f"{what}[{j}] at {tokens} tokens vs the uncompiled module: max abs diff "
                        f"{worst:.4g} (tolerance {tol:g})")
    return None


def run_case(spec: CaseSpec, inner: str, cost_model: bool = False,
             inductor_options: Optional[Dict[str, Any]] = None) -> CaseResult:
    """Compile ``spec``'s module with the pass (``inner``) and compare it bitwise with the
    reference: eager for ``eager``/``aot_eager``; for ``inductor`` the rule of
    ``_compare_inductor`` (the model's output vs the Inductor build without captures, the
    captures vs the Inductor list build). Compile errors are recorded.

    ``inductor_options``: Inductor config of both ``inductor`` compiles (default
    ``INDUCTOR_OPTIONS``; pass ``{}`` for Inductor's defaults)."""
    start = time.perf_counter()
    module, inputs = build_case(spec)
    input_sets = [inputs] + [case_inputs(spec, t) for t in spec.dynamic_tokens]
    result = CaseResult(spec, inner, equal=False, compile_error=None, rewritten=0, rejected=0,
                        reasons=[], token_counts=[spec.tokens, *spec.dynamic_tokens])

    def compiled_runs(rewrite: bool):
        return _compiled_runs(module, input_sets, inner, rewrite, cost_model, inductor_options,
                              spec.backend_options, token_dim=spec.token_dim)

    with torch.no_grad():
        eager_runs = []
        for one in input_sets:  # the uncompiled module: the oracle of every inner
            eager_args = _clone_inputs(one)
            eager_runs.append((tuple(module(*eager_args)), eager_args))
        if inner == "inductor":
            try:
                ref_runs, _, _ = compiled_runs(False)
            except Exception as e:  # noqa: BLE001
                result.compile_error = f"reference (rewrite=False) failed: {_error(e)}"
                result.baseline = "failed too (reference)"
                result.seconds = time.perf_counter() - start
                return result
        else:
            ref_runs = eager_runs
        ref_out, ref_args = ref_runs[0]
        try:
            runs, _, result.recompiles = compiled_runs(True)
            out, args = runs[0]
        except Exception as e:  # noqa: BLE001
            result.compile_error = _error(e)
            out = None
        backend = _LAST_BACKEND[0]
        if out is not None and inner == "inductor":
            diff = _compare_inductor(result, module, inputs, out, args, ref_out, ref_args,
                                     cost_model, inductor_options)
            # every count: vs the uncompiled module within Inductor's rounding; the extra
            # counts also bitwise vs the list build, unless the first count already showed
            # the list build rounding (twins, concat kernels) or wrong (reference_wrong) there
            exact = result.twin_rounding is None and result.own_kernel_rounding is None \
                and not result.reference_wrong
            for n, ((o, a), (eo, ea)) in enumerate(zip(runs, eager_runs)):
                tokens = result.token_counts[n]
                diff = diff or _close_to_uncompiled(o, a, eo, ea, spec.torch_dtype, tokens)
                if n and exact and diff is None:
                    diff = _compare(o[1:], a, ref_runs[n][0][1:], ref_runs[n][1],
                                    tuple(i - 1 for i in _packed_outputs(spec)))
                    diff = diff and f"at {tokens} tokens, vs the list build: {diff}"
            result.aliased = sorted(_aliasing(out) - _aliasing(ref_out))
            result.equal = diff is None
            result.detail = diff or ""
        elif out is not None:
            diff = None
            for n, ((o, a), (ro, ra)) in enumerate(zip(runs, ref_runs)):
                diff = _compare(o, a, ro, ra, _packed_outputs(spec))
                if diff is not None:
                    diff = f"at {result.token_counts[n]} tokens: {diff}" if n else diff
                    break
            result.aliased = sorted(_aliasing(out) - _aliasing(ref_out))
            result.equal = diff is None
            result.detail = diff or ""
        # what the pass did (also when the compile failed after the pass ran)
        for pr in backend.results:
            if pr.error:
                result.pass_errors.append(f"{pr.target}: {pr.error}")
            for g in pr.groups:
                outputs = g.kind is GroupKind.OUTPUTS
                if g.decision is Decision.REWRITE:
                    result.rewritten += 1
                    result.outputs_rewritten += int(outputs)
                    result.strategies.extend(c.strategy.value for c in g.captures if c.strategy)
                elif g.decision is Decision.REJECT:
                    result.rejected += 1
                    result.outputs_rejected += int(outputs)
                result.reasons.append(f"{pr.target}/{g.cat.name} K={g.k} {g.decision.value}: {g.reason}")
                result.anomalies.extend(_anomalies(spec, g))
        result.pieces = [split.num_pieces for split in backend.splits]
        if spec.split and out is not None:
            cuts = [len(split.op_pieces) for split in backend.splits]
            if not cuts or cuts != [spec.layers] * len(cuts):
                result.anomalies.append(f"split at {cuts} barrier calls per graph, expected "
                                        f"{spec.layers} (one per layer)")
        if not result.ok and inner != "inductor":
            # is it the pass? the same compile with the pass off
            try:
                b_out, b_args, _ = _compiled_run(module, inputs, inner, False, cost_model,
                                                 backend_options=spec.backend_options)
                b_diff = _compare(b_out, b_args, ref_out, ref_args, _packed_outputs(spec))
                result.baseline = "ok (the failure comes from the pass)" if b_diff is None \
                    else f"differs too: {b_diff}"
            except Exception as e:  # noqa: BLE001
                result.baseline = f"fails too: {_error(e)}"
        elif not result.ok and out is not None:
            # Inductor: which of the two compiles is off? (each differs from eager by rounding
            # at most; a large difference in the reference is a bug of Inductor itself)
            eager_args = _clone_inputs(inputs)
            eager_out = tuple(module(*eager_args))
            result.baseline = (
                f"vs eager: {_difference(ref_out, eager_out, 'output') or 'bitwise equal'} "
                f"(with the pass, vs eager: {_difference(out, eager_out, 'output') or 'bitwise equal'})")
    torch._dynamo.reset()
    result.seconds = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------- fuzzing


def fuzz(n: int, inners: Sequence[str], start_seed: int = 0, inductor_every: int = 0,
         cost_model: bool = False, progress: Optional[Any] = None) -> Dict[str, Any]:
    """Run seeds ``start_seed .. start_seed+n-1`` under each of ``inners`` (and under
    ``inductor`` on every ``inductor_every``-th case, when > 0); return a summary dict."""
    inners = list(inners)
    per_inner: Dict[str, Dict[str, int]] = {}
    failing: List[Tuple[int, str, str]] = []
    details: List[str] = []
    reasons: Counter = Counter()
    strategies: Counter = Counter()
    kinds: Counter = Counter()
    knobs: Counter = Counter({"return_list": 0, "split": 0, "communicator": 0, "dynamic_tokens": 0})
    start = time.perf_counter()
    for case in range(n):
        seed = start_seed + case
        spec = random_spec(seed)
        kinds.update(spec.kinds)
        knobs.update(name for name in ("return_list", "split", "communicator", "dynamic_tokens")
                     if getattr(spec, name))
        run_inners = list(inners)
        if inductor_every > 0 and case % inductor_every == 0 and "inductor" not in run_inners:
            run_inners.append("inductor")
        for inner in run_inners:
            stats = per_inner.setdefault(inner, dict(runs=0, mismatches=0, compile_failures=0,
                                                     groups_rewritten=0, groups_rejected=0,
                                                     outputs_rewritten=0, outputs_rejected=0,
                                                     pass_errors=0, anomalies=0, twin_rounding=0,
                                                     twin_rounding_max=0.0, own_kernel_rounding=0,
                                                     own_kernel_rounding_max=0.0, list_changes_model=0,
                                                     model_as_list=0, reference_wrong=0,
                                                     token_counts_run=0, recompiles=0))
            try:
                r = run_case(spec, inner, cost_model=cost_model)
            except Exception as e:  # noqa: BLE001 - a bug of the generator itself: report it
                r = CaseResult(spec, inner, False, f"harness error: {_error(e)}", 0, 0, [],
                               detail=traceback.format_exc(limit=3))
            stats["runs"] += 1
            stats["token_counts_run"] += len(r.token_counts)
            stats["recompiles"] += r.recompiles
            stats["groups_rewritten"] += r.rewritten
            stats["groups_rejected"] += r.rejected
            stats["outputs_rewritten"] += r.outputs_rewritten
            stats["outputs_rejected"] += r.outputs_rejected
            stats["pass_errors"] += len(r.pass_errors)
            stats["anomalies"] += len(r.anomalies)
            if r.twin_rounding is not None:
                stats["twin_rounding"] += 1
                stats["twin_rounding_max"] = max(stats["twin_rounding_max"], r.twin_rounding)
            if r.own_kernel_rounding is not None:
                stats["own_kernel_rounding"] += 1
                stats["own_kernel_rounding_max"] = max(stats["own_kernel_rounding_max"],
                                                        r.own_kernel_rounding)
                details.append(r.describe())
            stats["list_changes_model"] += int(r.list_changes_model)
            stats["model_as_list"] += int(r.model_as_list)
            stats["reference_wrong"] += int(r.reference_wrong)
            if r.reference_wrong or r.model_as_list:
                details.append(r.describe())
            strategies.update(r.strategies)
            for reason in r.reasons:
                reasons[_reason_key(reason)] += 1
            if r.compile_error is not None:
                stats["compile_failures"] += 1
            elif not r.equal:
                stats["mismatches"] += 1
            if not r.ok or r.pass_errors or r.anomalies:
                if not r.ok:
                    failing.append((seed, inner, spec.describe()))
                    if progress is not None:  # as it happens: a long run may be cut short
                        print(r.describe(), file=progress, flush=True)
                details.append(r.describe())
        if progress is not None and (case + 1) % 25 == 0:
            bad = len(failing)
            print(f"  {case + 1}/{n} cases, {bad} failing, {time.perf_counter() - start:.0f}s",
                  file=progress, flush=True)
    return {
        "cases": n,
        "start_seed": start_seed,
        "inners": per_inner,
        "failing": failing,
        "details": details,
        "decisions": dict(reasons.most_common()),
        "strategies": dict(strategies.most_common()),
        "kinds": dict(kinds.most_common()),
        "knobs": dict(knobs),
        "seconds": round(time.perf_counter() - start, 1),
    }


def _reason_key(reason: str) -> str:
    """A reason without node names and numbers, for counting."""
    text = reason.split(" ", 2)[-1]  # drop "target/cat K=.."
    return re.sub(r"\d+(\.\d+)?", "#", text)[:140]


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [f"{summary['cases']} cases from seed {summary['start_seed']} in {summary['seconds']}s"]
    for inner, s in summary["inners"].items():
        lines.append(f"  {inner:10s} runs={s['runs']} mismatches={s['mismatches']} "
                     f"compile_failures={s['compile_failures']} rewritten={s['groups_rewritten']} "
                     f"rejected={s['groups_rejected']} pass_errors={s['pass_errors']} "
                     f"anomalies={s['anomalies']} (output groups: "
                     f"rewritten={s['outputs_rewritten']} rejected={s['outputs_rejected']}) "
                     f"token counts run={s.get('token_counts_run', 0)} recompiles={s.get('recompiles', 0)}")
        if s.get("twin_rounding") or s.get("own_kernel_rounding") or s.get("list_changes_model") \
                or s.get("reference_wrong"):
            lines.append(f"  {'':10s} captures as the model computes them (twins merged) where "
                         f"the list build rounds differently: {s['twin_rounding']} cases, largest "
                         f"difference {s['twin_rounding_max']:.3g}; captures as computed outside "
                         f"the concat where the list build computes them into it: "
                         f"{s.get('own_kernel_rounding', 0)} cases, largest difference "
                         f"{s.get('own_kernel_rounding_max', 0.0):.3g}; list build (pass off) changes "
                         f"the model's own output: {s['list_changes_model']} cases, of which the "
                         f"pass keeps the list build's: {s['model_as_list']}; list build wrong vs "
                         f"eager, the pass right: {s['reference_wrong']}")
    lines.append("  cases per knob: " + ", ".join(f"{k}: {v}" for k, v in summary["knobs"].items()))
    lines.append("  strategies: " + ", ".join(f"{k}={v}" for k, v in summary["strategies"].items()))
    lines.append("  decisions:")
    lines.extend(f"    {v:5d}  {k}" for k, v in summary["decisions"].items())
    if summary["failing"]:
        lines.append(f"FAILING ({len(summary['failing'])}):")
        lines.extend(f"  seed={seed} inner={inner}: {desc}" for seed, inner, desc in summary["failing"])
    if summary["details"]:
        lines.append("DETAILS:")
        lines.extend(summary["details"])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--inners", default="eager,aot_eager",
                        help="comma-separated inners run on every case (eager, aot_eager, inductor)")
    parser.add_argument("--inductor-every", type=int, default=0,
                        help="also run inductor on every K-th case (0: never)")
    parser.add_argument("--start-seed", type=int, default=0)
    parser.add_argument("--cost-model", action="store_true",
                        help="keep the cost model on (default off: rewrite every valid group)")
    args = parser.parse_args(argv)
    inners = [s.strip() for s in args.inners.split(",") if s.strip()]
    summary = fuzz(args.cases, inners, start_seed=args.start_seed,
                   inductor_every=args.inductor_every, cost_model=args.cost_model,
                   progress=sys.stderr)
    print(format_summary(summary))
    bad = sum(s["mismatches"] + s["compile_failures"] for s in summary["inners"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    import tools.fuzz as _fuzz  # one copy of the module (and of its custom ops)

    sys.exit(_fuzz.main())
