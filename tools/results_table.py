"""Markdown tables of a results file, for the docs (the numbers come from the JSON; rerun
the benchmark named in the file to change them).

    python -m tools.results_table projection docs/results/projection_memory_cpu.json \\
        docs/results/projection_memory_inductor_cpu.json --dtype bfloat16
    python -m tools.results_table acceptance docs/results/draft_acceptance_cpu.json
    python -m tools.results_table engine-projection docs/results/sglang_projection_{llama,qwen3}_*.json

``engine-projection``: one row per ``benchmarks/sglang_model_runner.py`` result run with
``PROJECT=`` (list / packer / projected through SGLang's ModelRunner).

``projection``: one row per combine and K, one column per execution (uncompiled: the list
path / the packer / ``ProjectingAccumulator``; compiled: the list path / the pass / the pass
with ``fuse_projection`` / the projected collector compiled), each the peak overhead over
the packed bytes (``benchmarks/projection_memory.py``), then the draft input's max abs and
relative error per combine (eager accumulator and the pass). ``acceptance``: ``benchmarks/draft_acceptance.py``'s rows.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Sequence

EXECUTIONS = ("module", "eager", "aot_eager", "inductor")
COMBINES = ("plain", "norm_before_fc", "fc_norms", "dflash")


def _rows(paths: Sequence[str]) -> List[Dict[str, Any]]:
    return [row for path in paths for row in json.load(open(path))["rows"]]


def projection_table(rows: List[Dict[str, Any]], dtype: str) -> str:
    rows = [r for r in rows if r["dtype"] == dtype]
    executions = [e for e in EXECUTIONS if any(r["execution"] == e for r in rows)]
    ks = sorted({r["K"] for r in rows})
    head = ["combine", "K"] + ["uncompiled: list / packer / projected" if e == "module" else
                               f"{e}: list / pass / fused / projected" for e in executions]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for combine in COMBINES:
        for k in ks:
            cells = [combine, str(k)]
            for e in executions:
                match = [r for r in rows if r["combine"] == combine and r["K"] == k and r["execution"] == e]
                if not match:
                    cells.append("-")
                    continue
                names = ("list", "packer", "projected") if e == "module" else ("list", "pass", "fused", "projected")
                cells.append(" / ".join(f"{match[0][f'overhead_{n}']:.2f}" for n in names))
            if any(cell != "-" for cell in cells[2:]):  # a combine and K measured under some execution
                lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += error_table(rows)
    lines.append("")
    equal = all(r[k] for r in rows for k in r if k.startswith("model_equal"))
    lines.append(f"the target's own output bitwise equal to the build without captures in every row: {equal}")
    return "\n".join(lines)


def _span(values: List[float]) -> str:
    return "-" if not values else f"{min(values):.2g}" if min(values) == max(values) else \
        f"{min(values):.2g}..{max(values):.2g}"


def error_table(rows: List[Dict[str, Any]]) -> List[str]:
    """The draft input's error against the list path's (cat, then the combine), per combine:
    max abs and max relative (abs / max |list path's|), over K and executions, for the eager
    ``ProjectingAccumulator`` (``projected``) and the pass (``fused``, compiled rows)."""
    head = ["combine", "projected: max abs", "projected: max rel", "the pass (fused): max abs",
            "the pass (fused): max rel"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for combine in COMBINES:
        mine = [r for r in rows if r["combine"] == combine]
        if not mine:
            continue
        cells = [combine]
        for name in ("projected", "fused"):
            for kind in ("abs_err", "rel_err"):
                cells.append(_span([r[f"{kind}_{name}"] for r in mine if f"{kind}_{name}" in r]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def acceptance_table(rows: List[Dict[str, Any]]) -> str:
    head = ["combine", "dtype", "draft input max abs / rel diff", "first token agrees", "all gamma tokens agree",
            "accepted length: cat", "accepted length: per capture", "fp32 accumulator: rel diff / first token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fp32 = (f"{r['fp32_accumulate_max_rel_diff']:.2g} / {r['fp32_accumulate_first_token_agreement']:.2%}"
                if "fp32_accumulate_max_rel_diff" in r else "-")
        absolute = f"{r['draft_input_max_abs_diff']:.2g} / " if "draft_input_max_abs_diff" in r else ""
        lines.append(f"| {r['combine']} | {r['dtype']} | {absolute}{r['draft_input_max_rel_diff']:.2g} | "
                     f"{r['first_token_agreement']:.2%} | {r['all_tokens_agreement']:.2%} | "
                     f"{r['accepted_length_cat']:.4f} | {r['accepted_length_per_capture']:.4f} | {fp32} |")
    return "\n".join(lines)


def engine_projection_table(results: List[Dict[str, Any]]) -> str:
    """One row per engine run with a projected draft input (``benchmarks/sglang_model_runner.py``
    with ``PROJECT=``): the list path, the packer, the projection, side by side, and the
    projected input's error against the draft's own cat-then-project; with ``DRAFT=sglang``
    also the dtype and how many of SGLang's draft's greedy proposals are the same from the
    projected input as from the packed captures."""
    proposals = all("proposal_agreement" in r for r in results)
    head = ["model", "K", "combine", "H -> H_draft"] + (["dtype"] if proposals else []) + [
        "list", "packer", "projected", "max abs / rel error"] + (
        ["draft proposals equal"] if proposals else []) + ["logits = no capture"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(results, key=lambda r: (r["model"], r["K"], r["combine"])):
        cells = [r["model"], r["K"], r["combine"], f"{r['hidden']} -> {r['draft_hidden']}"]
        cells += [r["dtype"]] if proposals else []
        cells += [f"{r['overhead_off']:.2f}", f"{r['overhead_on']:.2f}", f"**{r['overhead_projected']:.2f}**",
                  f"{r['max_abs_vs_cat_then_project']:.2g} / {r['max_rel_vs_cat_then_project']:.2g}"]
        cells += [f"{100 * r['proposal_agreement']:.2f}% of {r['proposals']}"] if proposals else []
        cells += [r["logits_equal_no_capture_projected"] and r["logits_equal_no_capture"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("projection", "acceptance", "engine-projection"))
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if args.kind == "engine-projection":  # one result per file
        print(engine_projection_table([json.load(open(path)) for path in args.paths]))
        return
    rows = _rows(args.paths)
    print(projection_table(rows, args.dtype) if args.kind == "projection" else acceptance_table(rows))


if __name__ == "__main__":
    main()
