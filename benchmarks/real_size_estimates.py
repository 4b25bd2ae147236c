"""Estimated peak memory of one rank of served models, per tensor-parallel cut: list path vs the pass.

Nothing real is allocated: each engine-shaped rank (``models.engine``: per-rank widths, fused
in-place norms, opaque kernels allocating their outputs) is built on the meta device in bf16
with the layers its model really has, traced once per capture set with the token count
symbolic (``tools.static_estimate``), and the capture pass runs on a copy of the
graph at each token count with ``estimate=True``: the liveness estimator and cost model the
backend uses, and the pass's own decision on the full-size graph.

Rows: Llama 3.1 8B at TP = 1/2/4/8, 70B at TP = 2/4/8, 405B at TP = 8, DeepSeek-V3 at TP = 8
with tensor-parallel experts (``tp_workspace``: the fused-MoE kernel's workspaces held by the
graph; ``output_only``: a kernel allocating its output only) and with DP attention + EP = 8;
Eagle3's K = 3 and DFlash-like K = 5 / 8; T = 4096 / 8192 / 16384. Per row: per-rank peak
without captures, with the list, with the pass; overhead = (peak - peak without captures) /
packed bytes; GiB the pass saves per rank.

    python benchmarks/real_size_estimates.py --out docs/results/real_size_estimates.json
    python benchmarks/real_size_estimates.py --render docs/results/real_size_estimates.json --summary 16384
    python benchmarks/real_size_estimates.py --ranks llama-3.1-70b@8 --captures 3 --tokens 8192
    python benchmarks/real_size_estimates.py --check-small   # the estimator vs measured peaks

``--inner`` picks the graph the pass prices: ``eager`` (default: the Dynamo graph, target
``dynamo``, what a graph run as is holds), or ``inductor`` (the same graph, target
``dynamo_lifted``: Inductor's concat lowering modelled, the buffer lifted out of the graph).

``--check-small`` checks the estimator where it can be measured: the reference models'
tiny and capture-dominated configs (fp32, real tensors), each compiled the way the eager
inner runs it, without and with the pass (cost model off), estimate vs ``measure_peak``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
import models  # noqa: E402
from tools.static_estimate import (  # noqa: E402
    check_against_measured, estimate_at, graph_peak_at, trace_graph,
)
from models import engine  # noqa: E402

TRACED_TOKENS = 4096  # the example token count of each trace (any count works: it is symbolic)

#: rank name -> its config: "model@tp" (DeepSeek: "deepseek-v3@8:moe")
RANKS: Dict[str, engine.EngineConfig] = {
    **{f"llama-3.1-8b@{tp}": engine.llama_3_1_8b(tp=tp) for tp in (1, 2, 4, 8)},
    **{f"llama-3.1-70b@{tp}": engine.llama_3_1_70b(tp=tp) for tp in (2, 4, 8)},
    "llama-3.1-405b@8": engine.llama_3_1_405b(tp=8),
    **{f"deepseek-v3@8:{moe}": engine.deepseek_v3(tp=8, moe=moe) for moe in engine.MOE_KINDS},
}
_TARGET = {"eager": "dynamo", "inductor": "dynamo_lifted"}


def run(ranks: List[str], inner: str, captures: List[int], tokens: List[int]) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    for rank in ranks:
        base = RANKS[rank]
        start = time.perf_counter()
        model, inputs = engine.build(base, "none", tokens=TRACED_TOKENS, device="meta")
        gm, _ = trace_graph(model, *inputs, inner="eager")
        none_peaks = {n: graph_peak_at(gm, TRACED_TOKENS, n) for n in tokens}
        print(f"{rank} none: traced in {time.perf_counter() - start:.0f} s", flush=True)
        del gm, model
        for k in captures:
            cfg = engine.with_captures(base, k)
            start = time.perf_counter()
            model, inputs = engine.build(cfg, "list", tokens=TRACED_TOKENS, device="meta")
            gm, _ = trace_graph(model, *inputs, inner="eager")
            trace_seconds = time.perf_counter() - start
            for est in estimate_at(gm, _TARGET[inner], TRACED_TOKENS, tokens):
                packed = est.tokens * k * cfg.hidden_size * 2  # bf16
                none = none_peaks[est.tokens]
                rows.append({
                    "rank": rank, "model": cfg.name, "tp": cfg.tp, "moe": cfg.moe, "ep": cfg.ep,
                    "description": cfg.describe(), "num_layers": cfg.num_layers,
                    "hidden": cfg.hidden_size, "inner": inner, "target": _TARGET[inner],
                    "k": k, "capture_layers": list(cfg.layers_to_capture), "tokens": est.tokens,
                    "nodes": len(gm.graph.nodes), "peak_none": none, "peak_list": est.peak_before,
                    "peak_pass": est.peak_after, "packed_bytes": packed,
                    "overhead_list": (est.peak_before - none) / packed,
                    "overhead_pass": (est.peak_after - none) / packed,
                    "saved_bytes": est.peak_before - est.peak_after,
                    "concat_bytes": est.concat_bytes, "rewritten": est.changed,
                    "decisions": est.decisions, "pass_seconds": est.pass_seconds,
                    "trace_seconds": trace_seconds, "error": est.error,
                })
                print(format_table(rows[-1:], header=len(rows) == 1), flush=True)
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
        lines.append(f"{'rank':28} {'K':>2} {'T':>6} {'none GiB':>9} {'list GiB':>9} {'pass GiB':>9} "
                     f"{'packed':>7} {'ovh list':>8} {'ovh pass':>8} {'saved GiB':>9} {'rewritten':>9}")
    for r in rows:
        lines.append(f"{r['rank']:28} {r['k']:>2} {r['tokens']:>6} {_gib(r['peak_none']):>9} "
                     f"{_gib(r['peak_list']):>9} {_gib(r['peak_pass']):>9} {_gib(r['packed_bytes']):>7} "
                     f"{r['overhead_list']:8.2f} {r['overhead_pass']:8.2f} {_gib(r['saved_bytes']):>9} "
                     f"{'yes' if r['rewritten'] else 'no':>9}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    return _report.markdown_table(
        ("rank", "layers", "K", "T", "peak none GiB", "peak list GiB", "peak pass GiB", "packed GiB",
         "overhead list", "overhead pass", "saved GiB", "rewritten"),
        [(r["description"], r["num_layers"], r["k"], r["tokens"], _gib(r["peak_none"]),
          _gib(r["peak_list"]), _gib(r["peak_pass"]), _gib(r["packed_bytes"]),
          f"{r['overhead_list']:.2f}", f"{r['overhead_pass']:.2f}", _gib(r["saved_bytes"]),
          "yes" if r["rewritten"] else "no") for r in rows])


def _rank_label(r: Dict[str, Any]) -> str:
    if r["moe"] == "dp_ep":
        return f"{r['model']}, DP-attention + EP={r['ep']}"
    moe = {"tp_workspace": ", fused-MoE workspaces", "output_only": ", MoE output only"}.get(r["moe"], "")
    return f"{r['model']}, TP={r['tp']}{moe}"


def format_summary(rows: List[Dict[str, Any]], tokens: int) -> str:
    """One row per rank: overhead of the list path and with the pass for each K (ratios are
    the same at every token count: raises ValueError where they are not), GiB saved per
    rank at ``tokens``."""
    ks = sorted({r["k"] for r in rows})
    cells = []
    for rank in dict.fromkeys(r["rank"] for r in rows):
        group = [r for r in rows if r["rank"] == rank]
        cell = [_rank_label(group[0]), str(group[0]["num_layers"])]
        saved = []
        for k in ks:
            of_k = [r for r in group if r["k"] == k]
            ratios = {(round(r["overhead_list"], 2), round(r["overhead_pass"], 2)) for r in of_k}
            if len(ratios) != 1:
                raise ValueError(f"{rank} K={k}: ratios differ between token counts: {ratios}")
            (listed, passed), = ratios
            cell.append(f"{listed:.2f} -> {passed:.2f}")
            at = next(r for r in of_k if r["tokens"] == tokens)
            saved.append(_gib(at["saved_bytes"]))
        cells.append(tuple(cell + [" / ".join(saved)]))
    return _report.markdown_table(
        ("rank (bf16)", "layers", *(f"K={k}: list -> pass" for k in ks),
         f"saved per rank at {tokens} tokens, GiB (K={'/'.join(map(str, ks))})"), cells)


def format_saved(saved: Dict[str, Any], summary_tokens: Optional[int] = None) -> str:
    """A saved run (``--render``): its table (the estimator check's, if it is one), or the
    summary at ``summary_tokens`` tokens."""
    if summary_tokens is not None:
        return format_summary(saved["rows"], summary_tokens)
    return (format_check if saved.get("check_small") else format_markdown)(saved["rows"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default=",".join(RANKS), help=f"some of {', '.join(RANKS)}")
    parser.add_argument("--inner", default="eager", choices=sorted(_TARGET))
    parser.add_argument("--captures", default="3,5,8", help="K values: 3 is Eagle3's layers, others DFlash's")
    parser.add_argument("--tokens", default="4096,8192,16384")
    _report.add_output_args(parser)
    parser.add_argument("--summary", type=int, default=None, metavar="T",
                        help="with --render: one row per rank, GiB saved at T tokens")
    parser.add_argument("--check-small", action="store_true",
                        help="estimate vs measured peaks of the small reference configs (--tokens)")
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/real_size_estimates.py",
                              lambda saved: format_saved(saved, args.summary))
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.check_small:
        rows = check_small(tokens)
        if args.out:
            _report.write_json(args.out, {"check_small": True, "rows": rows}, argv=argv)
            print(f"wrote {args.out}")
        return 0 if all(r["bitwise_equal"] for r in rows) else 1
    ranks = args.ranks.split(",")
    unknown = [r for r in ranks if r not in RANKS]
    if unknown:
        parser.error(f"unknown rank(s) {unknown}; expected some of {', '.join(RANKS)}")
    try:
        captures = [int(k) for k in args.captures.split(",")]
    except ValueError:
        parser.error(f"--captures: comma-separated ints, got {args.captures!r}")
    start = time.perf_counter()
    rows = run(ranks, args.inner, captures, tokens)
    print(f"\n{format_table(rows)}\n\n{time.perf_counter() - start:.0f} s")
    if args.out:
        _report.write_json(args.out, {"rows": rows}, argv=argv)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
