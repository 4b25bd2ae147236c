"""One compile over a symbolic token count, run at several counts: peak memory side by side.

As vLLM and SGLang compile (``dynamic=True``, the token dimension symbolic), each variant is
compiled once, at the first token count, then run at every count under
``torch.compiler.set_stance("fail_on_recompile")``: a recompile is an error, so one graph
serves all counts. Scenarios:

- ``cat``: the concat inside the graph (capture mode ``list``);
- ``outputs``: the graph returns its captures and the caller packs them (``list_out``;
  with the pass: ``pack_outputs=True``, the caller's pack a view);
- ``split``: the graph split at ``models::attention`` (``split_ops``), pieces compiled by
  the inner, the concat in the last piece.

``recompiles`` counts backend calls after the first run (0: one graph served every count;
Dynamo may call the backend twice during that first run when it restarts its analysis).
Variants: ``none`` (no captures), ``list`` (the pass off, ``rewrite=False``), ``list+pass``.
Overhead = (peak - peak of ``none``, same inner, scenario and count) / packed bytes. Every
row is compared bitwise with its reference (eager/aot_eager: the uncompiled model; Inductor:
the same Inductor compile with the pass off) and, for Inductor, with the uncompiled model
within ``INDUCTOR_ATOL`` (Inductor's own rounding).

    python benchmarks/dynamic_tokens.py --out docs/results/dynamic_tokens_cpu.json
    python benchmarks/dynamic_tokens.py --render docs/results/dynamic_tokens_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report  # noqa: E402
import models  # noqa: E402
from compile_pass import aux_capture_backend, measure_peak, pack_aux_hidden_states  # noqa: E402
from models.common import example_inputs  # noqa: E402

SPLIT_OPS = ["models::attention"]
SCENARIOS = ("cat", "outputs", "split")
#: Inductor vs the uncompiled model: reassociated reductions and fused matmul epilogues
INDUCTOR_ATOL = 1e-4

_MODES = {"cat": "list", "outputs": "list_out", "split": "list"}


def _options(scenario: str, variant: str) -> Dict[str, Any]:
    options: Dict[str, Any] = {"rewrite": variant == "list+pass"}
    if scenario == "outputs" and variant == "list+pass":
        options["pack_outputs"] = True
    if scenario == "split":
        options["split_ops"] = SPLIT_OPS
    return options


def _packed_call(fn: Callable[..., Any]) -> Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    def run(*inputs: torch.Tensor):
        hidden, aux = fn(*inputs)
        return hidden, None if aux is None else pack_aux_hidden_states(aux)
    return run


def _equal(a, b) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (
        a[1] is None or torch.equal(a[1], b[1]))


def _close(a, b, atol: float) -> bool:
    def close(x, y):
        return x is None and y is None or (x is not None and y is not None and
                                           torch.allclose(x, y, atol=atol, rtol=atol))
    return close(a[0], b[0]) and close(a[1], b[1])


def run_sweep(model_name: str, config: str, tokens: Sequence[int], inners: Sequence[str],
              scenarios: Sequence[str] = SCENARIOS, **model_kwargs: Any) -> List[Dict[str, Any]]:
    """The rows for one model config: every (inner, scenario, variant) compiled once and run
    at each of ``tokens``."""
    factory = getattr(models.FACTORIES[model_name], config)
    rows: List[Dict[str, Any]] = []

    def build(mode: str):
        model, _ = factory(capture_mode=mode, tokens=tokens[0], seed=0, **model_kwargs)
        return model

    with torch.no_grad():
        reference_model = build("list")
        cfg = reference_model.cfg if hasattr(reference_model, "cfg") else reference_model.config
        inputs = {t: example_inputs(cfg, t) for t in tokens}
        references = {t: _packed_call(reference_model)(*inputs[t]) for t in tokens}
        for inner in inners:
            for scenario in scenarios:
                measured: Dict[str, Dict[int, Tuple[int, Any]]] = {}
                compiles: Dict[str, int] = {}
                for variant in ("none", "list", "list+pass"):
                    model = build("none" if variant == "none" else _MODES[scenario])
                    torch._dynamo.reset()
                    backend = aux_capture_backend(inner, **_options(scenario, variant))
                    count = [0]

                    def counting(gm, example_inputs, backend=backend, count=count):
                        count[0] += 1
                        return backend(gm, example_inputs)

                    fn = _packed_call(torch.compile(model, backend=counting, dynamic=True, fullgraph=True))
                    fn(*inputs[tokens[0]])
                    compiled_first = count[0]
                    measured[variant] = {}
                    with torch.compiler.set_stance("fail_on_recompile"):
                        for t in tokens:
                            fn(*inputs[t])  # warm at this count (no recompile allowed)
                            peak, result = measure_peak(fn, *inputs[t])
                            measured[variant][t] = (peak, result)
                    compiles[variant] = count[0] - compiled_first
                    rewritten = sum(g.decision.value == "rewrite" for r in backend.results for g in r.groups)
                    measured[variant]["rewritten"] = rewritten  # type: ignore[assignment]
                    del model, fn
                for t in tokens:
                    packed = references[t][1].numel() * references[t][1].element_size()
                    none_peak = measured["none"][t][0]
                    for variant in ("none", "list", "list+pass"):
                        peak, result = measured[variant][t]
                        row = {"model": model_name, "config": config, "inner": inner, "scenario": scenario,
                               "variant": variant, "tokens": t, "peak_bytes": peak, "packed_bytes": packed,
                               "overhead": (peak - none_peak) / packed, "recompiles": compiles[variant],
                               "groups_rewritten": measured[variant]["rewritten"]}
                        if variant != "none":
                            ref = measured["list"][t][1] if inner == "inductor" else references[t]
                            row["bitwise_equal"] = _equal(result, ref)
                            row["equals_uncompiled"] = (_close(result, references[t], INDUCTOR_ATOL)
                                                        if inner == "inductor" else row["bitwise_equal"])
                            if scenario == "outputs":
                                row["pack_is_view"] = result[1]._base is not None
                        rows.append(row)
                print(format_table(rows[-3 * len(tokens):]), flush=True)
    return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'model':7} {'inner':9} {'scenario':8} {'variant':10} {'T':>5} {'peak MiB':>9} "
             f"{'overhead':>8} {'equal':>5} {'~eager':>6} {'view':>5} recompiles"]
    for r in rows:
        lines.append(f"{r['model']:7} {r['inner']:9} {r['scenario']:8} {r['variant']:10} {r['tokens']:>5} "
                     f"{r['peak_bytes'] / 2**20:>9.1f} {r['overhead']:>8.2f} "
                     f"{str(r.get('bitwise_equal', '')):>5} {str(r.get('equals_uncompiled', '')):>6} "
                     f"{str(r.get('pack_is_view', '')):>5} {r['recompiles']}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    return _report.markdown_table(
        ("model", "inner", "scenario", "variant", "T", "peak MiB", "overhead (x packed)", "bitwise equal",
         "equals uncompiled", "pack is a view", "recompiles"),
        [(r["model"], r["inner"], r["scenario"], r["variant"], r["tokens"], f"{r['peak_bytes'] / 2**20:.1f}",
          f"{r['overhead']:.2f}", r.get("bitwise_equal", ""), r.get("equals_uncompiled", ""),
          r.get("pack_is_view", ""), r["recompiles"]) for r in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dflash")
    parser.add_argument("--configs", default="capture_dominated")
    parser.add_argument("--tokens", default="256,1024,4096")
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    _report.add_output_args(parser)
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/dynamic_tokens.py",
                              lambda saved: format_markdown(saved["rows"]))
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: List[Dict[str, Any]] = []
    for model_name in args.models.split(","):
        for config in args.configs.split(","):
            rows += run_sweep(model_name, config, tokens, args.inners.split(","), args.scenarios.split(","))
    print()
    print(format_table(rows))
    _report.write_out(args.out, {"rows": rows})
    ok = all(r.get("bitwise_equal", True) and r.get("equals_uncompiled", True) and r["recompiles"] == 0
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
