"""Stock Inductor, no compile_pass: Eagle3's ``norm_before_fc`` accumulated per capture as plain
torch next to an engine's in-place residual op. ``x = h + r`` (the capture) feeds a sum of
squares used only at the end and, times the norm's weight, an opaque op accumulating into the
draft's buffer; a later custom op then adds into ``r`` in place. Inductor computes the sum of
squares after that write (from the updated ``r``); aot_eager and eager do not. Prints the max
abs difference from eager of each output, under aot_eager and Inductor; then the same with the
ops ``fuse_projection`` emits (``compile_pass::sum_squares_into_``, ``project_scaled_into_``,
``rms_scale_``), which take the sum of squares inside an op at the capture: exact under both.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/inductor_norm_accumulate_repro.py
"""

from __future__ import annotations

import torch

import compile_pass.ops  # noqa: F401  (registers compile_pass::*)


@torch.library.custom_op("repro::accumulate_", mutates_args=("acc",))
def accumulate_(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    acc.addmm_(x, w.t())


@accumulate_.register_fake
def _(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    return None


@torch.library.custom_op("repro::residual_add_", mutates_args=("r",))
def residual_add_(r: torch.Tensor, h: torch.Tensor) -> None:
    r.add_(h)


@residual_add_.register_fake
def _(r: torch.Tensor, h: torch.Tensor) -> None:
    return None


def norm_before_fc_accumulated(h: torch.Tensor, r: torch.Tensor, g: torch.Tensor, w: torch.Tensor):
    acc = torch.zeros(h.shape[0], w.shape[0])
    x = h + r                                   # the capture
    sumsq = x.pow(2).sum(-1, keepdim=True)      # read only at the end
    accumulate_(acc, x * g, w)                  # its term, scaled by the norm's weight
    residual_add_(r, h)                         # the engine's next fused add: r += h in place
    return acc * torch.rsqrt(sumsq / h.shape[1] + 1e-6), r


def norm_before_fc_with_compile_pass_ops(h: torch.Tensor, r: torch.Tensor, g: torch.Tensor, w: torch.Tensor):
    ops = torch.ops.compile_pass
    acc = torch.empty(h.shape[0], w.shape[0])
    sumsq = torch.empty(h.shape[0], 1)
    x = h + r
    ops.sum_squares_into_(sumsq, x, None, "", True)
    ops.project_scaled_into_(acc, x, None, "", g, w, 0, True)
    residual_add_(r, h)
    ops.rms_scale_(acc, sumsq, h.shape[1], 1e-6, None)
    return acc, r


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    h, r = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    g, w = torch.randn(16, generator=gen), torch.randn(12, 16, generator=gen)
    for fn in (norm_before_fc_accumulated, norm_before_fc_with_compile_pass_ops):
        eager = fn(h, r.clone(), g, w)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            out = torch.compile(fn, backend=backend, fullgraph=True)(h, r.clone(), g, w)
            diffs = ", ".join(f"{(a - b).abs().max().item():.3g}" for a, b in zip(out, eager))
            print(f"torch {torch.__version__} {fn.__name__} {backend}: max abs diff vs eager "
                  f"(projection, residual) {diffs}")


if __name__ == "__main__":
    main()
