"""Peak memory of Eagle3 captures from an HF transformers model, per capture style, with and
without the aux_capture pass, measured side by side in one process (CPU).

The model is ``models.hf.capture_dominated``: a random HF Llama (or ``--family``) with cheap
layers around a wide residual stream (hidden 256, MLP 64, 2 heads of 32), 8 decoder layers,
Eagle3's captures [2, 4, 5], vocab 8192 (32x hidden, as in Llama 3) and causal SDPA without
a materialized mask (``models.hf.CAUSAL_SDPA``). ``--num-layers/--hidden/--intermediate/
--vocab/--layers`` change it.
Styles (``models.hf``): ``hidden_states`` (``output_hidden_states=True`` + cat),
``hooks`` (forward hooks + cat), ``selected_hidden_states`` (``output_hidden_states=[i..]``
+ cat), each against ``none`` (no capture) in the same execution:

- ``module``: the wrapper run uncompiled;
- per inner compiler: ``torch.compile(wrapper, backend=aux_capture_backend(inner,
  rewrite=False|True), fullgraph=True)``.

overhead = (peak - peak of ``none`` in the same execution) / packed bytes: 1.00 means the
packed ``[1, T, K * hidden]`` result is the only extra. "bitwise" compares with the
uncompiled hidden_states wrapper; Inductor rows compare with Inductor: without the pass, with
the first style's no-pass row; with the pass, with the same style's no-pass row.

    PYTHONPATH=. python benchmarks/hf_capture.py                       # llama, 2048 tokens
    PYTHONPATH=. python benchmarks/hf_capture.py --family qwen3 --inners eager --tokens 8192
    PYTHONPATH=. python benchmarks/hf_capture.py --render docs/results/hf_capture_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
from compile_pass import aux_capture_backend, measure_peak  # noqa: E402
from models import hf  # noqa: E402

STYLES = ("hidden_states", "hooks", "selected_hidden_states")
INNERS = ("eager", "aot_eager", "inductor")


def _equal(a: Tuple[torch.Tensor, Optional[torch.Tensor]], b: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (a[1] is None or torch.equal(a[1], b[1]))


def bench(family: str, tokens: int, layers: Tuple[int, ...], inners: List[str], styles: List[str],
          **config: Any) -> List[Dict[str, Any]]:
    """Every row of one configuration; see the module docstring for the columns."""
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False  # the pass must really run, memory measured fresh

    def build(style: str):
        return hf.capture_dominated(family, style, tokens=tokens, layers=layers, **config)

    def measure(fn, inputs) -> Tuple[int, Any]:
        fn(*inputs)  # warm up (and compile)
        return measure_peak(fn, *inputs)

    rows: List[Dict[str, Any]] = []

    def row(execution: str, style: str, variant: str, peak: int, packed: int, none_peak: int,
            equal: Optional[bool], **extra: Any) -> None:
        rows.append({"family": family, "tokens": tokens, "layers": list(layers), "config": config,
                     "execution": execution, "style": style, "variant": variant, "peak_bytes": peak,
                     "packed_bytes": packed, "overhead": (peak - none_peak) / packed if packed else 0.0,
                     "bitwise_equal": equal, **extra})

    with torch.no_grad():
        model, inputs = build("none")
        none_peak, _ = measure(model, inputs)
        module: Dict[str, Tuple[int, Any]] = {}
        for style in styles:
            model, inputs = build(style)
            module[style] = measure(model, inputs)
            del model
        reference = module[styles[0]][1]
        packed = reference[1].numel() * reference[1].element_size()
        row("module", "none", "", none_peak, packed, none_peak, None)
        for style in styles:
            row("module", style, "", module[style][0], packed, none_peak, _equal(module[style][1], reference))

        for inner in inners:
            inductor_reference = None  # Inductor rounds differently: its rows compare with Inductor
            model, inputs = build("none")
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=aux_capture_backend(inner, rewrite=False), fullgraph=True)
            inner_none, _ = measure(compiled, inputs)
            row(inner, "none", "", inner_none, packed, inner_none, None)
            for style in styles:
                no_pass = None
                for rewrite in (False, True):
                    model, inputs = build(style)
                    torch._dynamo.reset()
                    backend = aux_capture_backend(inner, rewrite=rewrite)
                    compiled = torch.compile(model, backend=backend, fullgraph=True)
                    peak, result = measure(compiled, inputs)
                    if inner == "inductor":
                        if inductor_reference is None:
                            inductor_reference = result  # the first style without the pass
                        ref = no_pass if rewrite else inductor_reference
                    else:
                        ref = reference
                    extra: Dict[str, Any] = {}
                    if rewrite:
                        hidden = model.model.config.hidden_size  # the capture concat, not RoPE's
                        groups = [g for r in backend.results for g in r.groups
                                  if g.widths == (hidden,) * len(layers)]
                        extra["decisions"] = [f"{g.decision.value}: {g.reason}" for g in groups]
                    else:
                        no_pass = result
                    row(inner, style, "pass" if rewrite else "no pass", peak, packed, inner_none,
                        _equal(result, ref), **extra)
                    del model, compiled
    return rows


def format_markdown(rows: List[Dict[str, Any]]) -> str:
    return _report.markdown_table(
        ("execution", "style", "pass", "peak MiB", "packed MiB", "overhead", "bitwise", "decision"),
        [(r["execution"], r["style"], r["variant"], f"{r['peak_bytes'] / 2**20:.2f}",
          f"{r['packed_bytes'] / 2**20:.2f}", f"{r['overhead']:.2f}", _report.yes_no(r["bitwise_equal"]),
          "; ".join(r.get("decisions", []))) for r in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama", choices=hf.FAMILIES)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--attn", default=hf.CAUSAL_SDPA, choices=(hf.CAUSAL_SDPA, "sdpa"),
                        help="attention implementation; HF's 'sdpa' materializes a [T, T] mask when compiled")
    parser.add_argument("--experts", default=None, choices=("grouped_mm", "batched_mm"),
                        help="DeepSeek-V3's experts_implementation (default: transformers' own)")
    parser.add_argument("--layers", default=None,
                        help="capture layers, e.g. 2,4,5 (input of decoder layer i); default: "
                             "models.hf.default_layers (Eagle3's [2, L//2, L-3] for L >= 7)")
    parser.add_argument("--inners", default=",".join(INNERS))
    parser.add_argument("--styles", default=",".join(STYLES))
    _report.add_output_args(parser, render_help="print a saved run as markdown, run nothing")
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "PYTHONPATH=. python benchmarks/hf_capture.py",
                              lambda saved: format_markdown(saved["rows"]),
                              details=lambda saved: [f"transformers {saved['transformers']}"])
    transformers = hf.require_transformers()
    layers = tuple(int(i) for i in args.layers.split(",")) if args.layers else tuple(hf.default_layers(args.num_layers))
    styles = args.styles.split(",")
    for style in styles:
        if style not in STYLES:
            parser.error(f"unknown style {style!r}; expected some of {', '.join(STYLES)}")
    config = dict(num_layers=args.num_layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  vocab_size=args.vocab)
    if args.attn != hf.CAUSAL_SDPA:
        config["attn_implementation"] = args.attn
    if args.experts is not None:
        config["experts_implementation"] = args.experts
    rows = bench(args.family, args.tokens, layers, args.inners.split(","), styles, **config)
    print(f"{args.family} {config}, captures {list(layers)}, {args.tokens} tokens, fp32, CPU "
          f"(torch {torch.__version__}, transformers {transformers.__version__})")
    print(format_markdown(rows))
    _report.write_out(args.out, {"rows": rows}, argv=argv, versions={"transformers": transformers.__version__})
    return 0 if all(r["bitwise_equal"] in (None, True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
