"""Stock Inductor, no compile_pass: a value read before a custom op writes its inputs in place
is recomputed after the write for its later readers, where a custom op also reads it (that op
gets a copy) or where it is inlined into the residual the op writes (docs/piecewise.md
section 6). Prints the max abs difference from eager per reader.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/inductor_inplace_repro.py
"""

from __future__ import annotations

import torch


@torch.library.custom_op("repro::add_norm_", mutates_args=("h", "r"))
def add_norm_(h: torch.Tensor, r: torch.Tensor) -> None:
    r.add_(h)
    h.copy_(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6))


@add_norm_.register_fake
def _(h: torch.Tensor, r: torch.Tensor) -> None:
    return None


@torch.library.custom_op("repro::scale", mutates_args=())
def scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@scale.register_fake
def _(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.empty_like(x)


def custom_op_reader(x: torch.Tensor, y: torch.Tensor):
    """The op gets a copy of c at its traced strides; c's other reader recomputes it."""
    r = x * 0.5
    c = x[:, :4] * r[:, :4]
    out = scale(c, 0.5)
    add_norm_(x, r)
    return x.tanh() + c.mean(1, keepdim=True), out


def pointwise_reader(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r = x * 0.5
    c1 = x + r  # read before the op ...
    r = r + c1  # ... and inlined into the residual the op writes
    add_norm_(x, r)
    return c1 * 2


def cat_reader(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the list path of a capture
    r = x * 0.5
    c1 = x + r
    r = r + c1
    add_norm_(x, r)
    return torch.cat([y, c1], dim=1)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 11, generator=gen), torch.randn(6, 11, generator=gen)
    for fn in (custom_op_reader, pointwise_reader, cat_reader):
        torch._dynamo.reset()
        eager = fn(x.clone(), y)
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)(x.clone(), y)
        pairs = zip(compiled, eager) if isinstance(eager, tuple) else [(compiled, eager)]
        worst = max((a - b).abs().max().item() for a, b in pairs)
        print(f"torch {torch.__version__} {fn.__name__}: max abs diff vs eager {worst:.3g}")


if __name__ == "__main__":
    main()
