"""Measured check of one served rank on the CPU: list path vs packer vs the pass, per inner,
next to the estimate of the same configuration.

One rank of Llama 3.1 70B at TP = 8 (real per-rank widths: hidden 8192, 8 query heads and 1
kv head of 128, MLP 3584 wide; ``models.engine``), a few layers, bf16, one process: the
all-reduce moves nothing but allocates what the real one allocates (nothing in place,
``--all-reduce inplace``; its output, ``functional``). In one run, side by side:

- uncompiled: capture modes none / list / packer;
- compiled with each inner (``eager``, ``aot_eager``, ``inductor``): none, the list path
  with the pass off and on, the packer with the pass off and on;
- the estimate of the same configuration (the graph traced on the meta device, priced by
  the liveness estimator the pass uses): peaks without captures, with the list, after the
  pass.

Overhead = (peak - peak without captures in the same execution) / packed bytes. Bitwise:
the packed captures against the uncompiled list path, the model's own output against the
same execution's build without captures. A compile that fails is a row with its error.

    python benchmarks/served_rank_check.py --out docs/results/served_rank_check_cpu.json
    python benchmarks/served_rank_check.py --layers 2 --tokens 256 --inners eager   # quick
    python benchmarks/served_rank_check.py --render docs/results/served_rank_check_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
from compile_pass import aux_capture_backend, pack_aux_hidden_states  # noqa: E402
from compile_pass.memory import measure_peak  # noqa: E402
from tools.static_estimate import estimate_at, graph_peak_at, trace_graph  # noqa: E402
from models import engine  # noqa: E402

VARIANTS = (("none", "none", False), ("list", "list", False), ("list+pass", "list", True),
            ("packer", "packer", False), ("packer+pass", "packer", True))


def _packed(aux: Any) -> Optional[torch.Tensor]:
    return None if aux is None else pack_aux_hidden_states(aux)


def _measure(fn: Any, inputs: Tuple[torch.Tensor, ...]) -> Tuple[int, Tuple[torch.Tensor, Any]]:
    def call(*args: torch.Tensor):
        hidden, aux = fn(*args)
        return hidden, _packed(aux)

    with torch.no_grad():
        call(*inputs)  # compile and warm up outside the measurement
        peak = measure_peak(call, *inputs)
    return peak.bytes, peak.result


def estimate(cfg: engine.EngineConfig, tokens: int) -> Dict[str, int]:
    """Estimated peaks of the same rank at ``tokens`` (Dynamo graph, as the eager inner runs
    it): without captures, the list path, after the pass."""
    model, inputs = engine.build(cfg, "none", tokens=tokens, device="meta")
    gm, _ = trace_graph(model, *inputs, inner="eager")
    none = graph_peak_at(gm, tokens, tokens)
    model, inputs = engine.build(cfg, "list", tokens=tokens, device="meta")
    gm, target = trace_graph(model, *inputs, inner="eager")
    (est,) = estimate_at(gm, target, tokens, [tokens])
    return {"none": none, "list": est.peak_before, "list+pass": est.peak_after}


def run(cfg: engine.EngineConfig, tokens: int, inners: List[str]) -> List[Dict[str, Any]]:
    start = time.perf_counter()
    model, inputs = engine.build(cfg, "none", tokens=tokens)
    print(f"built {cfg.describe()} in {time.perf_counter() - start:.0f} s", flush=True)
    packed = tokens * cfg.num_captures * cfg.hidden_size * 2
    rows: List[Dict[str, Any]] = []

    def row(execution: str, variant: str, peak: Optional[int], none_peak: Optional[int],
            result: Any, reference: Any, model_reference: Any, **extra: Any) -> Dict[str, Any]:
        r = {"rank": cfg.describe(), "layers": cfg.num_layers, "tokens": tokens,
             "execution": execution, "variant": variant, "peak_bytes": peak, "packed_bytes": packed,
             "overhead": (peak - none_peak) / packed if peak is not None and none_peak is not None else None,
             **extra}
        if result is not None and variant != "none":
            r["bitwise_equal"] = torch.equal(result[1], reference[1])
            r["model_equal_no_capture"] = torch.equal(result[0], model_reference[0])
        rows.append(r)
        print(format_table(rows[-1:], header=len(rows) == 1), flush=True)
        return r

    module: Dict[str, Tuple[int, Any]] = {}
    for mode in ("none", "list", "packer"):
        model.capture_mode = mode
        module[mode] = _measure(model, inputs)
    reference = module["list"][1]
    for mode, (peak, result) in module.items():
        row("module", mode, peak, module["none"][0], result, reference, module["none"][1])
    estimated = estimate(cfg, tokens)
    for variant, peak in estimated.items():
        row("estimate", variant, peak, estimated["none"], None, None, None)
    for inner in inners:
        compiled: Dict[str, Tuple[Optional[int], Any, Optional[str]]] = {}
        for variant, mode, rewrite in VARIANTS:
            model.capture_mode = mode
            torch._dynamo.reset()
            backend = aux_capture_backend(inner, rewrite=rewrite)
            fn = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
            begin = time.perf_counter()
            try:
                peak, result = _measure(fn, inputs)
                compiled[variant] = (peak, result, None, backend)
            except Exception as e:  # noqa: BLE001 - a compile that fails is reported as such
                first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
                compiled[variant] = (None, None, f"{type(e).__name__}: {first}"[:300], backend)
            compiled[variant] += (time.perf_counter() - begin,)
        none_peak, none_result = compiled["none"][0], compiled["none"][1]
        for variant, (peak, result, error, backend, seconds) in compiled.items():
            groups = [g for r in backend.results for g in r.groups if g.k == cfg.num_captures]
            extra: Dict[str, Any] = {"seconds": seconds, "error": error}
            if variant.endswith("+pass"):
                extra["decisions"] = [f"{g.decision.value}: {g.reason}" for g in groups[-1:]]
            row(inner, variant, peak, none_peak, result if none_result is not None else None,
                reference, none_result, **extra)
    return rows


def _mib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / 2**20:.0f}"


def format_table(rows: List[Dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(f"{'execution':10} {'variant':12} {'peak MiB':>9} {'overhead':>8} {'bitwise':>7} "
                     f"{'model=':>6}  error")
    for r in rows:
        overhead = f"{r['overhead']:.2f}" if r.get("overhead") is not None else ""
        lines.append(f"{r['execution']:10} {r['variant']:12} {_mib(r['peak_bytes']):>9} {overhead:>8} "
                     f"{_report.yes_no(r.get('bitwise_equal')):>7} "
                     f"{_report.yes_no(r.get('model_equal_no_capture')):>6}  {r.get('error') or ''}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    return _report.markdown_table(
        ("execution", "capture", "peak MiB", "packed MiB", "overhead", "bitwise", "model = no capture",
         "note"),
        [(r["execution"], r["variant"], _mib(r["peak_bytes"]), _mib(r["packed_bytes"]),
          f"{r['overhead']:.2f}" if r.get("overhead") is not None else "",
          _report.yes_no(r.get("bitwise_equal")), _report.yes_no(r.get("model_equal_no_capture")),
          r.get("error") or "") for r in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--captures", default="1,2,3", help="capture layers")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--all-reduce", default="inplace", choices=engine.ALL_REDUCE_KINDS)
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
    _report.add_output_args(parser)
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/served_rank_check.py",
                              lambda saved: format_markdown(saved["rows"]))
    cfg = engine.llama_3_1_70b(tp=8, num_layers=args.layers, all_reduce=args.all_reduce,
                               capture_layers=tuple(int(i) for i in args.captures.split(",")),
                               max_position=max(args.tokens, 1024))
    rows = run(cfg, args.tokens, args.inners.split(","))
    _report.write_out(args.out, {"rows": rows})
    bad = [r for r in rows if r.get("bitwise_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
