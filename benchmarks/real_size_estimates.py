"""Estimated peak memory of real-size models (Llama 3.1 8B/70B, DeepSeek-V3): list path vs the pass.

Nothing real is allocated: each model is built on the meta device in bf16 with the layer
count its config really has, traced once per capture mode with the token count symbolic
(``compile_pass.static_estimate``), and the capture pass runs on a copy of the graph at each
token count with ``estimate=True``: the liveness estimator and cost model the backend uses.

Per model, inner (``eager``: the Dynamo graph; ``aot_eager``: AOTAutograd's forward graph),
capture (Eagle3's K=3 layers; DFlash-like K spread over the depth) and token count:
estimated peak without captures (mode ``none``), with the list path, and after the pass;
overhead = (peak - peak without captures) / packed bytes, as in docs/benchmarks.md.

``deepseek-v3+fused-moe`` is DeepSeek-V3 with each routed-expert block replaced by one opaque
op (``real_size::fused_moe``, output [T, hidden]), the way serving engines call a fused MoE
kernel: the reference model computes every expert densely ([E, T, ...] intermediates), which
no engine does and which dominates its peak.

    python benchmarks/real_size_estimates.py --out docs/results/real_size_estimates.json
    python benchmarks/real_size_estimates.py --render docs/results/real_size_estimates.json
    python benchmarks/real_size_estimates.py --models llama-3.1-8b --inners eager --tokens 4096
    python benchmarks/real_size_estimates.py --check-small   # the estimator vs measured peaks

``--check-small`` checks the estimator where it can be measured: the reference models' tiny
and capture-dominated configs (fp32, real tensors), each compiled the way the eager inner
runs it, without and with the pass (cost model off), estimate vs ``measure_peak``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
import models  # noqa: E402
from compile_pass.static_estimate import (  # noqa: E402
    check_against_measured, estimate_at, graph_peak_at, trace_graph,
)
from models.common import dflash_capture_layers, eagle3_capture_layers  # noqa: E402
from models.deepseek import MoE, DeepseekModel, deepseek_v3_config  # noqa: E402
from models.llama import LlamaModel, llama_3_1_70b_config, llama_3_1_8b_config  # noqa: E402

TRACED_TOKENS = 4096  # the example token count of each trace (any count works: it is symbolic)


@torch.library.custom_op("real_size::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, routing: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor) -> torch.Tensor:
    """Routed experts as one op: ``sum_e routing[:, e] * down_e(silu(gate_e(x)) * up_e(x))``.

    Computed densely here (it only ever runs on meta tensors in this script); an engine's
    kernel visits each token's top-k experts and keeps its workspace to itself.
    """
    gate, up = torch.einsum("th,eih->eti", x, w_gate_up).chunk(2, dim=-1)
    out = torch.einsum("eti,ehi->eth", nn.functional.silu(gate) * up, w_down)
    return (out * routing.t().unsqueeze(-1)).sum(dim=0)


@fused_moe.register_fake
def _fused_moe_fake(x: torch.Tensor, routing: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


class FusedMoE(MoE):
    """``models.deepseek.MoE`` with the routed experts computed by ``real_size::fused_moe``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fused_moe(x, self.routing_weights(x), self.w_gate_up, self.w_down)
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _fuse_moe(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module) is MoE:
            module.__class__ = FusedMoE
    return model


#: name -> (model class, config factory, post-build hook)
MODELS: Dict[str, Tuple[type, Callable[..., Any], Callable[[nn.Module], nn.Module]]] = {
    "llama-3.1-8b": (LlamaModel, llama_3_1_8b_config, lambda m: m),
    "llama-3.1-70b": (LlamaModel, llama_3_1_70b_config, lambda m: m),
    "deepseek-v3": (DeepseekModel, deepseek_v3_config, lambda m: m),
    "deepseek-v3+fused-moe": (DeepseekModel, deepseek_v3_config, _fuse_moe),
}


def capture_layers(spec: str, num_layers: int) -> List[int]:
    """``eagle3`` -> [2, L//2, L-3]; ``dflashK`` -> K layers spread over the depth."""
    if spec == "eagle3":
        return eagle3_capture_layers(num_layers)
    if spec.startswith("dflash") and spec[len("dflash"):].isdigit():
        return dflash_capture_layers(num_layers, int(spec[len("dflash"):]))
    raise ValueError(f"unknown capture {spec!r}: expected eagle3 or dflashK (e.g. dflash5)")


def build_meta(model_name: str, capture_mode: str, layers: Optional[List[int]],
               dtype: torch.dtype) -> Tuple[nn.Module, Any]:
    """The model on the meta device (no memory), in ``dtype``, capturing ``layers``."""
    cls, config, hook = MODELS[model_name]
    cfg = config(capture_layers=layers)
    with torch.device("meta"):
        model = hook(cls(cfg, capture_mode=capture_mode, dtype=dtype).eval())
    return model, cfg


def meta_inputs(tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(tokens, dtype=torch.long, device="meta"),
            torch.arange(tokens, device="meta"))


def run(model_names: List[str], inners: List[str], captures: List[str], tokens: List[int],
        dtype: torch.dtype) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    for model_name in model_names:
        for inner in inners:
            start = time.perf_counter()
            model, cfg = build_meta(model_name, "none", None, dtype)
            gm, _ = trace_graph(model, *meta_inputs(TRACED_TOKENS), inner=inner)
            none_peaks = {n: graph_peak_at(gm, TRACED_TOKENS, n) for n in tokens}
            print(f"{model_name} {inner} none: traced in {time.perf_counter() - start:.0f} s", flush=True)
            del gm, model
            for capture in captures:
                layers = capture_layers(capture, cfg.num_layers)
                start = time.perf_counter()
                model, _ = build_meta(model_name, "list", layers, dtype)
                gm, target = trace_graph(model, *meta_inputs(TRACED_TOKENS), inner=inner)
                trace_seconds = time.perf_counter() - start
                for est in estimate_at(gm, target, TRACED_TOKENS, tokens):
                    packed = est.tokens * len(layers) * cfg.hidden_size * dtype.itemsize
                    none = none_peaks[est.tokens]
                    rows.append({
                        "model": model_name, "num_layers": cfg.num_layers, "hidden": cfg.hidden_size,
                        "dtype": str(dtype).replace("torch.", ""), "inner": inner, "target": target,
                        "capture": capture, "k": len(layers), "capture_layers": layers,
                        "tokens": est.tokens, "nodes": len(gm.graph.nodes),
                        "peak_none": none, "peak_list": est.peak_before, "peak_pass": est.peak_after,
                        "packed_bytes": packed,
                        "overhead_list": (est.peak_before - none) / packed,
                        "overhead_pass": (est.peak_after - none) / packed,
                        "concat_bytes": est.concat_bytes,
                        "rewritten": est.changed, "decisions": est.decisions,
                        "pass_seconds": est.pass_seconds, "trace_seconds": trace_seconds,
                        "error": est.error,
                    })
                    print(format_table(rows[-1:], header=not rows[:-1]), flush=True)
                del gm, model
    return rows


def check_small(tokens: List[int]) -> List[Dict[str, Any]]:
    """Estimated / measured peak of the reference models' small configs, before and after
    the pass, at each token count."""
    rows = []
    for name in ("llama", "deepseek", "dflash"):
        for config in ("tiny", "capture_dominated"):
            for n in tokens:
                model, inputs = models.build(name, config, capture_mode="list", tokens=n)
                check = check_against_measured(model, *inputs)
                rows.append({"model": name, "config": config, "tokens": n,
                             "estimated_before": check.estimated_before,
                             "measured_before": check.measured_before,
                             "estimated_after": check.estimated_after,
                             "measured_after": check.measured_after,
                             "error_before": check.errors[0], "error_after": check.errors[1],
                             "rewritten": check.rewritten, "bitwise_equal": check.bitwise_equal})
                print(format_check(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def format_check(rows: List[Dict[str, Any]], header: bool = True) -> str:
    columns = ("model", "config", "T", "estimated / measured MiB, no pass", "error",
               "estimated / measured MiB, pass", "error", "bitwise")
    return _report.markdown_table(
        columns if header else None,
        [(r["model"], r["config"], r["tokens"],
          f"{r['estimated_before'] / 2**20:.2f} / {r['measured_before'] / 2**20:.2f}",
          f"{100 * r['error_before']:+.1f}%",
          f"{r['estimated_after'] / 2**20:.2f} / {r['measured_after'] / 2**20:.2f}",
          f"{100 * r['error_after']:+.1f}%", "yes" if r["bitwise_equal"] else "NO") for r in rows])


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_table(rows: List[Dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(f"{'model':22} {'inner':9} {'capture':8} {'K':>2} {'T':>6} {'none GiB':>9} "
                     f"{'list GiB':>9} {'pass GiB':>9} {'packed':>7} {'ovh list':>8} {'ovh pass':>8} "
                     f"{'rewritten':>9} {'concat':>7}")
    for r in rows:
        concat = f"{r['concat_bytes'] / r['peak_list']:.2f}" if r.get("concat_bytes") else ""
        lines.append(f"{r['model']:22} {r['inner']:9} {r['capture']:8} {r['k']:>2} {r['tokens']:>6} "
                     f"{_gib(r['peak_none']):>9} {_gib(r['peak_list']):>9} {_gib(r['peak_pass']):>9} "
                     f"{_gib(r['packed_bytes']):>7} {r['overhead_list']:8.2f} {r['overhead_pass']:8.2f} "
                     f"{'yes' if r['rewritten'] else 'no':>9} {concat:>7}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    return _report.markdown_table(
        ("model", "layers", "graph", "capture", "K", "T", "peak none GiB", "peak list GiB", "peak pass GiB",
         "packed GiB", "overhead list", "overhead pass", "at the concat / peak", "rewritten"),
        [(r["model"], r["num_layers"], r["target"], r["capture"], r["k"], r["tokens"], _gib(r["peak_none"]),
          _gib(r["peak_list"]), _gib(r["peak_pass"]), _gib(r["packed_bytes"]), f"{r['overhead_list']:.2f}",
          f"{r['overhead_pass']:.2f}",
          f"{r['concat_bytes'] / r['peak_list']:.2f}" if r.get("concat_bytes") else "",
          "yes" if r["rewritten"] else "no") for r in rows])


def format_summary(rows: List[Dict[str, Any]], tokens: int) -> str:
    """One row per model and capture; raises ValueError if a ratio differs between token
    counts or graphs (then the full table is the summary)."""
    cells = []
    keys: List[Tuple[str, str]] = []
    for r in rows:
        if (r["model"], r["capture"]) not in keys:
            keys.append((r["model"], r["capture"]))
    for model, capture in keys:
        group = [r for r in rows if (r["model"], r["capture"]) == (model, capture)]
        ratios = {(round(r["overhead_list"], 2), round(r["overhead_pass"], 2),
                   round(r["concat_bytes"] / r["peak_list"], 2), r["rewritten"]) for r in group}
        if len(ratios) != 1:
            raise ValueError(f"{model} {capture}: ratios differ between token counts or graphs: {ratios}")
        (overhead_list, overhead_pass, concat, rewritten), = ratios
        r = next(r for r in group if r["tokens"] == tokens)
        cells.append((model, r["num_layers"], capture, r["k"], _gib(r["peak_none"]), _gib(r["packed_bytes"]),
                      f"{overhead_list:.2f}", f"{overhead_pass:.2f}", f"{concat:.2f}",
                      "rewritten" if rewritten else "left (no drop)"))
    return _report.markdown_table(
        ("model", "layers", "capture", "K", f"peak without captures at T={tokens}, GiB",
         f"packed at {tokens}, GiB", "overhead list", "overhead + pass", "at the concat / peak", "pass decision"),
        cells)


def format_saved(saved: Dict[str, Any], summary_tokens: Optional[int] = None) -> str:
    """A saved run (``--render``): its table (the estimator check's, if it is one), or the
    summary at ``summary_tokens`` tokens."""
    if summary_tokens is not None:
        return format_summary(saved["rows"], summary_tokens)
    return (format_check if saved.get("check_small") else format_markdown)(saved["rows"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--inners", default="eager,aot_eager")
    parser.add_argument("--captures", default="eagle3,dflash5,dflash8")
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    _report.add_output_args(parser)
    parser.add_argument("--summary", type=int, default=None, metavar="T",
                        help="with --render: one row per model and capture, sizes at T tokens")
    parser.add_argument("--check-small", action="store_true",
                        help="estimate vs measured peaks of the small reference configs (--tokens)")
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/real_size_estimates.py",
                              lambda saved: format_saved(saved, args.summary))
    if args.check_small:
        rows = check_small([int(t) for t in args.tokens.split(",")])
        if args.out:
            _report.write_json(args.out, {"check_small": True, "rows": rows}, argv=argv)
            print(f"wrote {args.out}")
        return 0 if all(r["bitwise_equal"] for r in rows) else 1
    model_names = args.models.split(",")
    unknown = [m for m in model_names if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; expected some of {', '.join(MODELS)}")
    for capture in args.captures.split(","):
        capture_layers(capture, 64)  # validate the spelling before tracing anything
    start = time.perf_counter()
    rows = run(model_names, args.inners.split(","), args.captures.split(","),
               [int(t) for t in args.tokens.split(",")], getattr(torch, args.dtype))
    print(f"\n{format_table(rows)}\n\n{time.perf_counter() - start:.0f} s")
    if args.out:
        _report.write_json(args.out, {"rows": rows}, argv=argv)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
