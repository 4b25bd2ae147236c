"""Differential fuzzer for ``fuse_projection``: random decoders whose forward ends with a
draft's combine, in the spellings real code writes.

    python -m tools.fuzz_combine --cases 200 --start-seed 0 --inners eager,aot_eager
    python -m tools.fuzz_combine --cases 50 --inners inductor

A case (``CombineSpec``, from a seed) is a residual decoder capturing ``hidden + residual``
at K layers and ending with the draft's combine of their concat: K (2-8), the capture width
H, H_draft below / equal to / above H, the combine (a plain ``fc``, an RMSNorm over the
concat then ``fc``, one RMSNorm per capture then ``fc``, DFlash's ``fc`` then a norm), its
spelling (the split, the norm, the ``fc``: ``SPLITS``, ``NORMS``, ``FCS``), bias or not,
fp32 or bf16, static or dynamic token count, one graph or pieces split at a custom op, and
sometimes a hazard the pass must leave packed: a norm whose intermediate is also returned,
a LayerNorm instead of an RMSNorm, or an engine's fused RMSNorm kernel (an opaque custom op,
functional or writing an ``out=`` tensor).

Oracle, per case and inner, against the same inner compiled without the option:
- the target's own output bitwise equal (the option only moves the draft's input);
- the draft's input within ``TOLERANCE`` (relative to its scale) of the eager module's
  cat-then-combine, at every token count run;
- a hazard case is not fused (and then its draft input is bitwise the build without the option);
- the peak (the PyTorch profiler's allocations) never above the build without the option;
- coverage: how many combines of each spelling were fused and how many refused.
A summary line per inner: ``runs= fused= refused= wrong= crashed= above_list= hazards_fused=``,
then the coverage per spelling. Exit status 1 on any wrong, crashed, above_list or
hazards_fused case.
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6
#: the draft input's largest difference from the eager cat-then-combine, relative to its
#: largest magnitude: K rounded partial products summed instead of one GEMM (fp32), or
#: partial products rounded to bf16 one by one (bf16, docs/projection.md measures 4e-3 to 9e-3)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def hf_llama_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + EPS)
    return w * x.to(dtype)


def vllm_native_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vLLM's ``RMSNorm.forward_native`` without a residual, the cast written at each use."""
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + EPS)).to(x.dtype) * w


def splits_for(k: int, h: int) -> Dict[str, Callable[[torch.Tensor], Sequence[torch.Tensor]]]:
    """The ways real code cuts a ``[T, k*h]`` concat into its ``k`` captures' columns."""
    return {
        "split(H, dim=-1)": lambda p: p.split(h, dim=-1),
        "chunk(K, dim=-1)": lambda p: p.chunk(k, dim=-1),
        "torch.chunk(p, K, last)": lambda p: torch.chunk(p, k, p.dim() - 1),
        "tensor_split(K, dim=-1)": lambda p: torch.tensor_split(p, k, dim=-1),
        "split([H]*K, -1)": lambda p: torch.split(p, [h] * k, dim=-1),
        "p[..., a:b]": lambda p: [p[..., i * h:(i + 1) * h] for i in range(k)],
        "p[:, a:b]": lambda p: [p[:, i * h:(i + 1) * h] for i in range(k)],
        "narrow(-1, a, H)": lambda p: [p.narrow(-1, i * h, h) for i in range(k)],
        "p[..., -a:-b]": lambda p: [p[..., -(k - i) * h:(-(k - i - 1) * h) or None] for i in range(k)],
        "unflatten(-1, (K, H)).unbind(-2)": lambda p: p.unflatten(-1, (k, h)).unbind(-2),
        "view(-1, K, H)[:, i]": lambda p: [p.view(-1, k, h)[:, i] for i in range(k)],
    }


SPLIT_NAMES = tuple(splits_for(2, 1))
NORMS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "F.rms_norm": lambda c, w: F.rms_norm(c, (c.shape[-1],), w, EPS),
    "LlamaRMSNorm": hf_llama_rms,
    "vllm forward_native": vllm_native_rms,
}
FCS = ("nn.Linear", "F.linear", "x @ W.T (+ b)", "addmm / mm")
COMBINES = ("plain", "norm_before_fc", "fc_norms", "dflash")
HAZARDS = (None, "norm intermediate returned", "LayerNorm", "fused norm op", "fused norm op (out=)")


@torch.library.custom_op("cp_fuzz_combine::barrier", mutates_args=())
def barrier(h: torch.Tensor) -> torch.Tensor:
    """An opaque op the piecewise cases split at (an engine's attention, say)."""
    return h.clone()


@barrier.register_fake
def _(h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("cp_fuzz_combine::fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An engine's fused RMSNorm kernel as an opaque functional op (SGLang's ``rmsnorm``)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@fused_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cp_fuzz_combine::rms_norm_out", mutates_args=("out",))
def rms_norm_out(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """An engine's fused RMSNorm kernel writing a given output (vLLM's ``_C.rms_norm``)."""
    out.copy_(F.rms_norm(x, (x.shape[-1],), weight, eps))


@rms_norm_out.register_fake
def _(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    return None


@dataclass(frozen=True)
class CombineSpec:
    seed: int
    k: int
    hidden: int
    draft: int
    layers: int
    capture_at: Tuple[int, ...]
    combine: str
    split: str
    norm: str
    fc: str
    bias: bool
    dtype: str
    dynamic: bool
    piecewise: bool
    hazard: Optional[str]
    tokens: Tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def spellings(self) -> Tuple[str, ...]:
        """The spellings this case exercises (combine, fc, split, norm), for coverage counts."""
        parts = [f"combine={self.combine}", f"fc={self.fc}"]
        if self.combine == "fc_norms":
            parts.append(f"split={self.split}")
        if self.combine != "plain":
            opaque = self.hazard in ("LayerNorm", "fused norm op", "fused norm op (out=)")
            parts.append(f"norm={f'{self.hazard} (hazard)' if opaque else self.norm}")
        if self.hazard is not None:
            parts.append(f"hazard={self.hazard}")
        parts += [f"graph={'pieces' if self.piecewise else 'one'}", f"T={'dynamic' if self.dynamic else 'static'}",
                  f"dtype={self.dtype}", f"bias={self.bias}"]
        return tuple(parts)

    def spelling(self) -> str:
        return " ".join(self.spellings())

    def describe(self) -> str:
        return (f"seed={self.seed} K={self.k} H={self.hidden} H_draft={self.draft} {self.spelling()} "
                f"bias={self.bias} {self.dtype} dynamic={self.dynamic} piecewise={self.piecewise} "
                f"hazard={self.hazard} T={self.tokens}")


def random_spec(seed: int) -> CombineSpec:
    rng = random.Random(seed)
    k = rng.choice((2, 3, 3, 4, 5, 8))
    hidden = rng.choice((16, 32, 48, 64))
    draft = rng.choice((hidden // 2, hidden, 2 * hidden, k * hidden + 8))
    layers = k + rng.randint(1, 3)
    capture_at = tuple(sorted(rng.sample(range(layers), k)))
    combine = rng.choice(COMBINES)
    norm = rng.choice(tuple(NORMS) + (("nn.RMSNorm",) if combine == "norm_before_fc" else ()))
    hazard = rng.choice(HAZARDS) if combine in ("norm_before_fc", "fc_norms") and rng.random() < 0.2 else None
    dynamic = rng.random() < 0.3
    tokens = (rng.choice((64, 96, 160, 256)),) + ((rng.choice((24, 40)),) if dynamic else ())
    return CombineSpec(seed, k, hidden, draft, layers, capture_at, combine, rng.choice(SPLIT_NAMES), norm,
                       rng.choice(FCS), rng.random() < 0.6, rng.choice(("float32", "bfloat16")), dynamic,
                       rng.random() < 0.3, hazard, tokens)


class CombineDecoder(nn.Module):
    """``spec``'s decoder: returns ``(hidden, draft_input)``, or ``(hidden, draft_input,
    norm_intermediate)`` for the hazard that returns the norm's mean square."""

    def __init__(self, spec: CombineSpec) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(spec.seed)
        h, k, dt = spec.hidden, spec.k, spec.torch_dtype
        self.spec = spec
        self.layers = nn.ParameterList(nn.Parameter((torch.randn(h, h, generator=g) / h ** 0.5).to(dt))
                                       for _ in range(spec.layers))
        self.fc = nn.Linear(k * h, spec.draft, bias=spec.bias).to(dt)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(spec.draft, k * h, generator=g) / (k * h) ** 0.5)
            if spec.bias:
                self.fc.bias.copy_(torch.randn(spec.draft, generator=g) * 0.1)
        width = spec.draft if spec.combine == "dflash" else k * h
        self.whole = nn.RMSNorm(width, eps=EPS).to(dt)
        self.layer_norm = nn.LayerNorm(width, eps=EPS).to(dt)
        with torch.no_grad():
            self.whole.weight.copy_(1 + 0.1 * torch.randn(width, generator=g))
        self.chunks = nn.ParameterList(nn.Parameter((1 + 0.1 * torch.randn(h, generator=g)).to(dt)) for _ in range(k))
        self._split = splits_for(k, h)[spec.split]

    def _norm(self, x: torch.Tensor, w: torch.Tensor, whole: bool) -> torch.Tensor:
        if self.spec.hazard == "LayerNorm":
            return F.layer_norm(x, (x.shape[-1],), w, None, EPS)
        if self.spec.hazard == "fused norm op":
            return fused_rms_norm(x, w, EPS)
        if self.spec.hazard == "fused norm op (out=)":
            out = torch.empty_like(x)
            rms_norm_out(out, x, w, EPS)
            return out
        if self.spec.norm == "nn.RMSNorm" and whole:
            return self.whole(x)
        return NORMS[self.spec.norm](x, w)

    def _fc(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.fc.weight, self.fc.bias
        if self.spec.fc == "nn.Linear":
            return self.fc(x)
        if self.spec.fc == "F.linear":
            return F.linear(x, w, b)
        if self.spec.fc == "x @ W.T (+ b)":
            return x @ w.T + b if b is not None else x @ w.T
        return torch.addmm(b, x, w.t()) if b is not None else torch.mm(x, w.t())

    def forward(self, x: torch.Tensor):
        spec = self.spec
        hidden, residual, aux = x, torch.zeros_like(x), []
        for i, w in enumerate(self.layers):
            if i in spec.capture_at:
                aux.append(hidden + residual)
            residual = hidden + residual
            hidden = torch.tanh(residual @ w)
            if spec.piecewise and i == spec.layers // 2:
                hidden = barrier(hidden)
        packed = torch.cat(aux, dim=-1)
        extra = None
        if spec.combine == "norm_before_fc":
            if spec.hazard == "norm intermediate returned":
                extra = packed.float().pow(2).mean(-1, keepdim=True)
                packed = (packed.float() * torch.rsqrt(extra + EPS)).to(packed.dtype) * self.whole.weight
            else:
                packed = self._norm(packed, self.whole.weight, whole=True)
        elif spec.combine == "fc_norms":
            pieces = list(self._split(packed))
            if spec.hazard == "norm intermediate returned":
                extra = pieces[0].float().pow(2).mean(-1, keepdim=True)
                first = (pieces[0].float() * torch.rsqrt(extra + EPS)).to(packed.dtype) * self.chunks[0]
                normed = [first] + [self._norm(c, w, whole=False) for c, w in zip(pieces[1:], self.chunks[1:])]
            else:
                normed = [self._norm(c, w, whole=False) for c, w in zip(pieces, self.chunks)]
            packed = torch.cat(normed, dim=-1)
        draft_input = self._fc(packed)
        if spec.combine == "dflash":
            draft_input = self._norm(draft_input, self.whole.weight, whole=True)
        return (hidden, draft_input) if extra is None else (hidden, draft_input, extra)


@dataclass
class CaseResult:
    spec: CombineSpec
    inner: str
    fused: bool = False
    wrong: str = ""
    crashed: str = ""
    above_list: bool = False
    hazard_fused: bool = False
    rel_error: float = 0.0
    reason: str = ""


def _compile(model: nn.Module, inner: str, fuse: bool, dynamic: bool):
    from compile_pass import aux_capture_backend

    torch._dynamo.reset()
    options = {"fuse_projection": fuse}
    if model.spec.piecewise:
        options["split_ops"] = ["cp_fuzz_combine::barrier"]
    backend = aux_capture_backend(inner, **options)
    return torch.compile(model, backend=backend, dynamic=bool(dynamic)), backend


def run_case(spec: CombineSpec, inner: str) -> CaseResult:
    """One case under ``inner``: compiled with and without ``fuse_projection``, checked."""
    from compile_pass import measure_peak

    result = CaseResult(spec, inner)
    try:
        model = CombineDecoder(spec).eval()
        g = torch.Generator().manual_seed(spec.seed + 1)
        inputs = [torch.randn(t, spec.hidden, generator=g).to(spec.torch_dtype) for t in spec.tokens]

        def build_and_measure(fuse: bool):
            """The build with or without the option: its backend, its outputs over every
            input (one compile per token count, or one symbolic compile), its peak at every
            token count."""
            compiled, backend = _compile(model, inner, fuse, spec.dynamic)
            with torch.no_grad():
                outputs = [compiled(x) for x in inputs]
                return backend, outputs, [measure_peak(compiled, x).bytes for x in inputs]

        outs, peaks = {}, {}
        for fuse in (False, True):
            backend, outs[fuse], peaks[fuse] = build_and_measure(fuse)
            errors = [r.error for r in backend.results if r.error]
            if errors:  # the pass failed and the graph compiled without it: a finding, never a refusal
                raise RuntimeError(f"the pass failed (fuse_projection={fuse}): {errors[0]}")
            if fuse:
                groups = [g_ for r in backend.results for g_ in r.groups if g_.k == spec.k]
                result.fused = any(g_.fused for g_ in groups)
                result.reason = next((g_.projection or g_.reason for g_ in groups if not g_.fused), "") \
                    if not result.fused else ""
        with torch.no_grad():
            eager = [model(x) for x in inputs]
        for on, off, ref in zip(outs[True], outs[False], eager):
            if not torch.equal(on[0], off[0]):
                result.wrong = "the target's output differs from the build without the option"
                break
            if spec.hazard is not None and not torch.equal(on[1], off[1]):
                result.wrong = "a hazard case's draft input differs from the build without the option"
                break
            scale = ref[1].float().abs().max().item() or 1.0
            err = (on[1].float() - ref[1].float()).abs().max().item() / scale
            result.rel_error = max(result.rel_error, err)
            if not err <= TOLERANCE[spec.torch_dtype]:
                result.wrong = f"the draft input is {err:.3g} (relative) from the eager cat-then-combine"
                break
        if any(on > off for on, off in zip(peaks[True], peaks[False])):
            # the first build a process measures can come out a few bytes below the same
            # build measured again (seen: the option off, 105984 then 105992 bytes): the list
            # path is measured once more, after the fused build, before a run is called above
            peaks[False] = [max(a, b) for a, b in zip(peaks[False], build_and_measure(False)[2])]
        result.above_list = any(on > off for on, off in zip(peaks[True], peaks[False]))
        result.hazard_fused = spec.hazard is not None and result.fused
    except Exception as e:  # noqa: BLE001 - a crash is a finding, recorded with its traceback
        result.crashed = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    return result


def summarize(results: Sequence[CaseResult], inner: str) -> Tuple[str, bool]:
    """The summary lines of one inner's results, and whether it is clean."""
    mine = [r for r in results if r.inner == inner]
    fused = Counter(k for r in mine if r.fused for k in r.spec.spellings())
    refused = Counter(k for r in mine if not r.fused for k in r.spec.spellings())
    counts = dict(runs=len(mine), fused=sum(r.fused for r in mine), refused=sum(not r.fused for r in mine),
                  wrong=sum(bool(r.wrong) for r in mine), crashed=sum(bool(r.crashed) for r in mine),
                  above_list=sum(r.above_list for r in mine), hazards_fused=sum(r.hazard_fused for r in mine))
    lines = [f"  {inner:9s} " + " ".join(f"{k}={v}" for k, v in counts.items())
             + f" max_rel_error_fp32={max((r.rel_error for r in mine if r.spec.dtype == 'float32'), default=0):.3g}"
             + f" max_rel_error_bf16={max((r.rel_error for r in mine if r.spec.dtype == 'bfloat16'), default=0):.3g}"]
    for spelling in sorted(set(fused) | set(refused)):
        lines.append(f"    {spelling}: fused {fused[spelling]}, refused {refused[spelling]}")
    reasons = Counter(r.reason.split(":")[0][:90] for r in mine if not r.fused and not r.crashed)
    for reason, n in reasons.most_common():
        lines.append(f"    refused ({n}): {reason}")
    for r in mine:
        if r.wrong or r.crashed or r.above_list or r.hazard_fused:
            what = r.wrong or r.crashed or ("peak above the list path" if r.above_list else "hazard fused")
            lines.append(f"    FAIL {r.spec.describe()}: {what}")
    clean = not (counts["wrong"] or counts["crashed"] or counts["above_list"] or counts["hazards_fused"])
    return "\n".join(lines), clean


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--start-seed", type=int, default=0)
    parser.add_argument("--inners", default="eager,aot_eager")
    args = parser.parse_args(argv)
    inners = [i for i in args.inners.split(",") if i]
    unknown = sorted(set(inners) - {"eager", "aot_eager", "inductor"})
    if unknown:
        parser.error(f"unknown inner(s) {unknown}: eager, aot_eager, inductor")
    results = [run_case(random_spec(seed), inner)
               for seed in range(args.start_seed, args.start_seed + args.cases) for inner in inners]
    ok = True
    print(f"fuzz_combine seeds {args.start_seed}..{args.start_seed + args.cases - 1}")
    for inner in inners:
        text, clean = summarize(results, inner)
        print(text)
        ok = ok and clean
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
