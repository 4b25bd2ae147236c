"""Peak memory of aux-hidden-state capture: list path vs packer vs the compiler pass.

For each reference model, config and token count, in one process, side by side:
- module rows (the model run eagerly, uncompiled): capture modes none / list / packer /
  list_out (+ the caller's pack);
- compiled rows, per inner compiler: mode none, the list path with the pass off
  (``rewrite=False``) and with the pass on.

Columns: measured peak (CPU: profiler allocation events; CUDA: max_memory_allocated), the
packed bytes, overhead = (peak - peak of mode none in the same execution) / packed, the
wall-time ratio pass/no-pass (medians of repeated runs), the pass's own time per graph,
and whether the result is bitwise equal to the reference (eager list path; Inductor rows:
Inductor without the pass).

    python benchmarks/capture_memory.py                       # the default sweep (CPU)
    python benchmarks/capture_memory.py --models dflash --inners eager --tokens 4096
    python benchmarks/capture_memory.py --models llama:fused_norm   # captures from a custom op
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
import models  # noqa: E402
from compile_pass import pack_aux_hidden_states  # noqa: E402
from compile_pass.backend import aux_capture_backend  # noqa: E402
from compile_pass.memory import measure_peak  # noqa: E402

CONFIGS = ("capture_dominated", "tiny")
INNERS = ("eager", "aot_eager", "inductor")
#: compiled rows per inner: (row name, capture mode, pass on)
COMPILED_VARIANTS = (("none", "none", False), ("list", "list", False), ("list+pass", "list", True),
                     ("packer", "packer", False), ("packer+pass", "packer", True))


def _packed(aux: Any) -> Optional[torch.Tensor]:
    if aux is None:
        return None
    return pack_aux_hidden_states(aux)


def _caller(model: torch.nn.Module) -> Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """The forward plus the caller's pack (a no-op for packed results, a cat for lists)."""

    def run(*inputs: torch.Tensor):
        hidden, aux = model(*inputs)
        return hidden, _packed(aux)

    return run


def _median_seconds(fn: Callable[[], Any], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _equal(a: Tuple[torch.Tensor, Optional[torch.Tensor]], b: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> bool:
    if (a[1] is None) != (b[1] is None):
        return False
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


def bench_one(model_name: str, config: str, tokens: int, inners: List[str], repeats: int,
              device: str, dtype: torch.dtype) -> List[Dict[str, Any]]:
    base_name, _, producer = model_name.partition(":")  # "llama:fused_norm": custom-op captures
    module = models.FACTORIES[base_name]
    factory = getattr(module, config)
    overrides = {"capture_producer": producer} if producer else {}
    rows: List[Dict[str, Any]] = []

    def build(mode: str):
        model, inputs = factory(capture_mode=mode, tokens=tokens, dtype=dtype, seed=0, **overrides)
        return model.to(device), tuple(t.to(device) for t in inputs)

    def row(execution: str, variant: str, peak: int, packed: int, none_peak: int,
            equal: Optional[bool], seconds: float, **extra: Any) -> Dict[str, Any]:
        return {"model": model_name, "config": config, "tokens": tokens, "device": device,
                "dtype": str(dtype).replace("torch.", ""), "execution": execution, "variant": variant,
                "peak_bytes": peak, "packed_bytes": packed,
                "overhead": (peak - none_peak) / packed if packed else 0.0,
                "bitwise_equal": equal, "seconds": seconds, **extra}

    with torch.no_grad():
        eager: Dict[str, Tuple[int, Any, float]] = {}
        for mode in ("none", "list", "packer", "list_out"):
            model, inputs = build(mode)
            fn = _caller(model)
            fn(*inputs)
            peak, result = measure_peak(fn, *inputs)
            eager[mode] = (peak, result, _median_seconds(lambda: fn(*inputs), repeats, device))
            del model
        reference = eager["list"][1]
        packed = reference[1].numel() * reference[1].element_size()
        for mode, (peak, result, seconds) in eager.items():
            rows.append(row("module", mode, peak, packed, eager["none"][0],
                            None if mode == "none" else _equal(result, reference), seconds))

        for inner in inners:
            compiled: Dict[str, Tuple[int, Any, float, Any]] = {}
            for variant, mode, rewrite in COMPILED_VARIANTS:
                model, inputs = build(mode)
                torch._dynamo.reset()
                backend = aux_capture_backend(inner, rewrite=rewrite)
                fn = _caller(torch.compile(model, backend=backend, dynamic=True, fullgraph=True))
                fn(*inputs)
                peak, result = measure_peak(fn, *inputs)
                seconds = _median_seconds(lambda: fn(*inputs), repeats, device)
                compiled[variant] = (peak, result, seconds, backend)
            none_peak = compiled["none"][0]
            inner_reference = compiled["list"][1] if inner == "inductor" else reference
            model_reference = compiled["none"][1][0]
            for variant, (peak, result, seconds, backend) in compiled.items():
                extra: Dict[str, Any] = {}
                if variant != "none":
                    # capturing must not change what the model computes: its output equals
                    # the same compile of the model without captures, bit for bit
                    extra["model_equal_no_capture"] = torch.equal(result[0], model_reference)
                    if inner == "inductor" and not _equal(result, inner_reference):
                        extra["captures_max_abs_diff"] = \
                            (result[1].double() - inner_reference[1].double()).abs().max().item()
                if variant.endswith("+pass"):
                    base = compiled[variant[:-len("+pass")]]
                    groups = [g for r in backend.results for g in r.groups]
                    extra.update({
                        "time_ratio_vs_no_pass": seconds / base[2],
                        "pass_seconds_per_graph": [r.seconds for r in backend.results],
                        "groups_rewritten": sum(g.decision.value == "rewrite" for g in groups),
                        "decisions": [f"{g.cat.name}: {g.decision.value}: {g.reason}"
                                      for g in groups if g.k > 2 or g.decision.value == "rewrite"],
                        "buffers_lifted": sum(len(r.lifted) for r in backend.results if r.lifted),
                        "twins_merged": len(backend.twin_merges),
                    })
                rows.append(row(inner, variant, peak, packed, none_peak,
                                None if variant == "none" else _equal(result, inner_reference),
                                seconds, **extra))
    return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
    header = (f"{'model':16} {'config':17} {'T':>6} {'execution':10} {'variant':11} "
              f"{'peak MiB':>9} {'packed':>7} {'overhead':>8} {'equal':>6} {'model=':>6} {'t ratio':>7} "
              f"{'pass ms':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = f"{r['time_ratio_vs_no_pass']:.2f}" if "time_ratio_vs_no_pass" in r else ""
        pass_ms = (f"{1000 * max(r['pass_seconds_per_graph']):.1f}"
                   if r.get("pass_seconds_per_graph") else "")
        equal = _report.yes_no(r["bitwise_equal"])
        model_equal = _report.yes_no(r.get("model_equal_no_capture"))
        lines.append(
            f"{r['model']:16} {r['config']:17} {r['tokens']:>6} {r['execution']:10} {r['variant']:11} "
            f"{r['peak_bytes'] / 2**20:9.1f} {r['packed_bytes'] / 2**20:7.1f} {r['overhead']:8.2f} "
            f"{equal:>6} {model_equal:>6} {ratio:>7} {pass_ms:>8}")
    return "\n".join(lines)


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        pass_ms = (f"{1000 * max(r['pass_seconds_per_graph']):.0f}"
                   if r.get("pass_seconds_per_graph") else "")
        ratio = f"{r['time_ratio_vs_no_pass']:.2f}" if "time_ratio_vs_no_pass" in r else ""
        cells.append((r["model"], r["config"], r["tokens"], r["execution"], r["variant"],
                      f"{r['peak_bytes'] / 2**20:.1f}", f"{r['packed_bytes'] / 2**20:.1f}",
                      f"{r['overhead']:.2f}", _report.yes_no(r["bitwise_equal"]),
                      _report.yes_no(r.get("model_equal_no_capture")), ratio, pass_ms))
    return _report.markdown_table(("model", "config", "T", "execution", "capture", "peak MiB", "packed MiB",
                                   "overhead", "bitwise", "model = no capture", "time pass/no pass",
                                   "pass ms"), cells)


def format_summary(rows: List[Dict[str, Any]]) -> str:
    """One row per model and config: the overhead of each execution and capture variant
    (``module`` list / packer, then per inner list / list+pass / packer / packer+pass), and
    whether every row kept the model's output equal to the build without captures."""
    columns: List[Tuple[str, str]] = []
    for r in rows:
        key = (r["execution"], r["variant"])
        if r["variant"] not in ("none", "list_out") and key not in columns:
            columns.append(key)
    cells = []
    for model, config in dict.fromkeys((r["model"], r["config"]) for r in rows):
        group = {(r["execution"], r["variant"]): r for r in rows
                 if (r["model"], r["config"]) == (model, config)}
        model_equal = all(r.get("model_equal_no_capture", True) for r in group.values())
        cells.append((model, config,
                      *(f"{group[c]['overhead']:.2f}" if c in group else "" for c in columns),
                      "yes" if model_equal else "NO"))
    return _report.markdown_table(
        ("model", "config", *(f"{e}: {v}" for e, v in columns), "model = no capture"), cells)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,deepseek,dflash")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--inners", default=",".join(INNERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    _report.add_output_args(parser)
    parser.add_argument("--summary", action="store_true",
                        help="with --render: one row per model and config, overheads only")
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/capture_memory.py",
                              lambda saved: (format_summary if args.summary else format_markdown)(saved["rows"]))
    dtype = getattr(torch, args.dtype)
    rows: List[Dict[str, Any]] = []
    for model_name in args.models.split(","):
        for config in args.configs.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows.extend(bench_one(model_name, config, tokens, args.inners.split(","),
                                      args.repeats, args.device, dtype))
                print(format_table(rows[-(4 + len(COMPILED_VARIANTS) * len(args.inners.split(","))):]),
                      flush=True)
    print()
    print(format_table(rows))
    _report.write_out(args.out, {"rows": rows})
    return 0 if all(r["bitwise_equal"] in (None, True) and r.get("model_equal_no_capture", True)
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
