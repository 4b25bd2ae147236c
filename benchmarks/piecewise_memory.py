"""Peak memory where serving engines lose it: piecewise graphs and captures returned as outputs.

For each reference model, config, token count and inner compiler, in one process, side by
side (CPU: profiler allocation events; CUDA: max_memory_allocated):

- ``piecewise``: the Dynamo graph split at ``models::attention`` (``split_ops``), each piece
  compiled by the inner; capture mode none, the list path with the pass off
  (``rewrite=False``, same split) and with the pass on. The cat sits in the last piece,
  the captures in earlier ones.
- ``outputs``: the model returns its captures as a list (mode ``list_out``) and the caller
  packs them with ``pack_aux_hidden_states``; the graph as is vs ``pack_outputs=True``
  (the graph returns adjacent slices of one buffer; the caller's pack is a view).

Overhead = (peak - peak of mode none in the same execution) / packed bytes. Every row is
checked bitwise against the uncompiled model (Inductor rows: against Inductor with the pass
off), and the ``outputs`` rows say whether the caller's pack was a view (no copy).

    python benchmarks/piecewise_memory.py                      # default sweep (CPU)
    python benchmarks/piecewise_memory.py --models dflash --inners aot_eager --tokens 2048
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
import models  # noqa: E402
from compile_pass import aux_capture_backend, measure_peak, pack_aux_hidden_states  # noqa: E402

SPLIT_OPS = ["models::attention"]


def _caller(fn: Callable[..., Any]) -> Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    def run(*inputs: torch.Tensor):
        hidden, aux = fn(*inputs)
        return hidden, None if aux is None else pack_aux_hidden_states(aux)
    return run


def _equal(a: Tuple[torch.Tensor, Optional[torch.Tensor]], b: Tuple[torch.Tensor, Optional[torch.Tensor]]
           ) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (
        a[1] is None or torch.equal(a[1], b[1]))


def bench_one(model_name: str, config: str, tokens: int, inners: List[str], device: str,
              dtype: torch.dtype, scenarios: List[str]) -> List[Dict[str, Any]]:
    factory = getattr(models.FACTORIES[model_name], config)
    rows: List[Dict[str, Any]] = []

    def build(mode: str):
        model, inputs = factory(capture_mode=mode, tokens=tokens, dtype=dtype, seed=0)
        return model.to(device), tuple(t.to(device) for t in inputs)

    def measure(mode: str, inner: str, **options: Any):
        model, inputs = build(mode)
        torch._dynamo.reset()
        backend = aux_capture_backend(inner, **options)
        fn = _caller(torch.compile(model, backend=backend, dynamic=True, fullgraph=True))
        fn(*inputs)
        peak, result = measure_peak(fn, *inputs)
        return peak, result, backend

    with torch.no_grad():
        model, inputs = build("list")
        reference = _caller(model)(*inputs)
        packed = reference[1].numel() * reference[1].element_size()
        del model
        for inner in inners:
            for scenario in scenarios:
                if scenario == "piecewise":
                    variants = (("none", "none", dict(rewrite=False, split_ops=SPLIT_OPS)),
                                ("list", "list", dict(rewrite=False, split_ops=SPLIT_OPS)),
                                ("list+pass", "list", dict(rewrite=True, split_ops=SPLIT_OPS)))
                else:
                    variants = (("none", "none", dict(rewrite=False)),
                                ("outputs+cat", "list_out", dict(rewrite=False)),
                                ("pack_outputs", "list_out", dict(rewrite=True, pack_outputs=True)))
                measured: Dict[str, Any] = {}
                for variant, mode, options in variants:
                    measured[variant] = measure(mode, inner, **options)
                inner_reference = measured[variants[1][0]][1] if inner == "inductor" else reference
                none_peak = measured["none"][0]
                for variant, (peak, result, backend) in measured.items():
                    groups = [g for r in backend.results for g in r.groups if g.decision.value == "rewrite"]
                    row = {
                        "model": model_name, "config": config, "tokens": tokens, "device": device,
                        "dtype": str(dtype).replace("torch.", ""), "inner": inner, "scenario": scenario,
                        "variant": variant, "peak_bytes": peak, "packed_bytes": packed,
                        "overhead": (peak - none_peak) / packed,
                        "bitwise_equal": None if variant == "none" else _equal(result, inner_reference),
                        "pieces": [s.num_pieces for s in backend.splits],
                        "groups_rewritten": len(groups),
                    }
                    if scenario == "outputs" and variant != "none":
                        row["pack_is_view"] = result[1]._base is not None
                    rows.append(row)
                print(format_table(rows[-len(variants):]), flush=True)
    return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'model':8} {'config':17} {'T':>6} {'inner':9} {'scenario':9} {'variant':12} "
             f"{'peak MiB':>9} {'overhead':>8} {'equal':>5} {'view':>5} pieces"]
    for r in rows:
        lines.append(
            f"{r['model']:8} {r['config']:17} {r['tokens']:>6} {r['inner']:9} {r['scenario']:9} "
            f"{r['variant']:12} {r['peak_bytes'] / 2**20:>9.1f} {r['overhead']:>8.2f} "
            f"{str(r['bitwise_equal']):>5} {str(r.get('pack_is_view', '')):>5} {r['pieces'][:1]}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    return _report.markdown_table(
        ("model", "config", "T", "inner", "scenario", "variant", "peak MiB", "overhead (x packed)",
         "bitwise equal", "pack is a view", "pieces"),
        [(r["model"], r["config"], r["tokens"], r["inner"], r["scenario"], r["variant"],
          f"{r['peak_bytes'] / 2**20:.1f}", f"{r['overhead']:.2f}",
          "" if r["bitwise_equal"] is None else r["bitwise_equal"],
          r.get("pack_is_view", ""), r["pieces"][0] if r["pieces"] else "") for r in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dflash,llama")
    parser.add_argument("--configs", default="capture_dominated")
    parser.add_argument("--tokens", default="2048")
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
    parser.add_argument("--scenarios", default="piecewise,outputs")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    _report.add_output_args(parser)
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/piecewise_memory.py",
                              lambda saved: format_markdown(saved["rows"]))
    rows: List[Dict[str, Any]] = []
    for model_name in args.models.split(","):
        for config in args.configs.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows += bench_one(model_name, config, tokens, args.inners.split(","), args.device,
                                  getattr(torch, args.dtype), args.scenarios.split(","))
    print()
    print(format_table(rows))
    _report.write_out(args.out, {"rows": rows})
    return 0 if all(r["bitwise_equal"] in (None, True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
