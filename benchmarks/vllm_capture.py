"""Plugin off vs on inside vLLM 0.33.0's own compile stack (CPU), one process, side by side.

    ~/.cache/compile_pass/venv-vllm0.33.0/bin/python benchmarks/vllm_capture.py \\
        --out docs/results/vllm_capture_cpu.json

Rows: the vLLM-style decoder (``models/vllm_style.py``: 8 layers, K=5
returned captures, H=256, fp32, 2048 tokens; ``sum`` captures ``hidden + residual``,
``clone`` captures ``residual.clone()`` after an in-place fused norm) and one Llama 3.1 70B
TP=8 rank (``models/engine.py``, ``--engine-layers`` layers, ``--engine-captures`` K, bf16;
the default 4 layers capture Eagle3's layers of a 4-layer model, (1, 2): K=2), each compiled by
vLLM's VllmBackend with eager and Inductor pieces (``--mode DYNAMO_TRACE_ONCE``: one graph with
the stock eager / Inductor backend, as vLLM's CPU platform compiles). The speculator's own ``torch.cat``
statement packs (``spec_decode/target_dependent_ar/speculator.py``'s ``torch``).
overhead = (peak - peak of the same build without captures) / packed bytes; "bitwise": the
model's output equals the uncompiled model's, and the packed captures the uncompiled list
path's concat.
"""

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from compile_pass import measure_peak  # noqa: E402
from compile_pass.integrations import vllm as plugin  # noqa: E402
import models.vllm_style as H  # noqa: E402


def _cat(aux):
    import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as spec

    return spec.torch.cat(aux, dim=-1)


NO_PIECE_PASSES = False
MODE = "VLLM_COMPILE"


def measure(name, backend, make, inputs, warm):
    """make(captures: bool) -> (cls, kwargs); returns one row per plugin setting."""
    ref_cls, ref_kwargs = make(True)
    torch.manual_seed(0)
    ref = ref_cls(**ref_kwargs).eval()
    with torch.no_grad():
        rh, raux = ref(*inputs)
    rp = torch.cat(raux, -1)
    rows = []
    for on in (False, True):
        if on:
            assert plugin.install()
            if NO_PIECE_PASSES:  # the rewrite and the view cat; vLLM's config and pass manager as is
                for owner, attr, old in plugin._PATCHES.applied:
                    if attr in ("configure", "init_backend"):
                        setattr(owner, attr, old)
        else:
            plugin.uninstall()
        peaks, outs = {}, {}
        t = time.time()
        error = None
        for caps in (False, True):
            cls, kwargs = make(caps)
            try:
                model, run, _ = H.build(backend, cls=cls, mode=MODE, **kwargs)
                model.load_state_dict(ref.state_dict(), strict=False)
                run(*warm)
            except Exception as e:  # a build vLLM itself cannot compile: recorded, not measured
                error = f"{'with' if caps else 'without'} captures: {type(e).__name__}: {str(e)[:300]}"
                torch._dynamo.reset()
                break

            def full(*x, run=run):
                h, aux = run(*x)
                return h, (_cat(aux) if aux else None)

            p = measure_peak(full, *inputs)
            peaks[caps], outs[caps] = p.bytes, p.result
            del model, run, full, p  # one build's weights alive at a time (8 layers of a 70B rank: 1.7 GB)
            torch._dynamo.reset()
            gc.collect()
        nbytes = rp.numel() * rp.element_size()
        if error is not None:
            rows.append({"model": name, "pieces": backend, "mode": MODE, "plugin": on,
                         "error": error, "seconds": round(time.time() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        h, packed = outs[True]
        rows.append({
            "model": name, "pieces": backend, "mode": MODE, "plugin": on,
            "peak_mib": round(peaks[True] / 2**20, 2), "peak_no_capture_mib": round(peaks[False] / 2**20, 2),
            "packed_mib": round(nbytes / 2**20, 2),
            "overhead": round((peaks[True] - peaks[False]) / nbytes, 3),
            "model_bitwise": bool(torch.equal(h, rh)), "captures_bitwise": bool(torch.equal(packed, rp)),
            "captures_max_abs_diff": float((packed.float() - rp.float()).abs().max()),
            "seconds": round(time.time() - t, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def render(paths) -> str:
    """A markdown table of the rows of result files (``--render``), one line per row."""
    lines = ["| vllm | model | mode | pieces | plugin | peak MiB | no-capture MiB | packed MiB | overhead "
             "| model bitwise | captures bitwise (max abs diff) |", "|" + "---|" * 11]
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for r in result["rows"]:
            if "error" in r:
                lines.append(f"| {result['vllm']} | {r['model']} | {r['mode']} | {r['pieces']} | "
                             f"{'on' if r['plugin'] else 'off'} | {r['error'][:80]} ||||||")
                continue
            caps = "yes" if r["captures_bitwise"] else f"no ({r['captures_max_abs_diff']:.3g})"
            lines.append(f"| {result['vllm']} | {r['model']} | {r['mode']} | {r['pieces']} | "
                         f"{'on' if r['plugin'] else 'off'} | {r['peak_mib']} | {r['peak_no_capture_mib']} | "
                         f"{r['packed_mib']} | {r['overhead']:.2f} | {'yes' if r['model_bitwise'] else 'no'} | {caps} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", nargs="+", help="print result files as one markdown table, run nothing")
    ap.add_argument("--backends", default="eager,inductor")
    ap.add_argument("--styles", default="sum,clone")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--engine-layers", type=int, default=4)
    ap.add_argument("--engine-tokens", type=int, default=1024)
    ap.add_argument("--engine-captures", default="",
                    help="comma-separated K for the engine rank (models.engine.with_captures: "
                         "DFlash's K layers spread over the depth, Eagle3's for K=3); "
                         "empty: the config's default layers")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-piece-passes", action="store_true",
                    help="plugin on without its per-piece Inductor passes (diagnosis)")
    ap.add_argument("--mode", default="VLLM_COMPILE", choices=("VLLM_COMPILE", "DYNAMO_TRACE_ONCE"),
                    help="vLLM's compilation mode: VLLM_COMPILE splits at attention into pieces; "
                         "DYNAMO_TRACE_ONCE (what vLLM's CPU platform forces) compiles one graph")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    global NO_PIECE_PASSES, MODE
    NO_PIECE_PASSES, MODE = args.no_piece_passes, args.mode
    rows = []
    x = torch.randn(args.tokens, 256)
    for backend in args.backends.split(","):
        for style in [s for s in args.styles.split(",") if s]:
            def make(caps, style=style):
                return H.VllmStyleDecoder, {"style": style, "capture_at": (1, 3, 5, 6, 7) if caps else ()}
            rows += measure(f"vllm_style_{style}", backend, make, (x,), (torch.randn(64, 256),))
        if not args.no_engine:
            from models import engine

            base = engine.llama_3_1_70b(tp=8, num_layers=args.engine_layers)
            ks = [int(k) for k in args.engine_captures.split(",") if k] or [None]
            for k in ks:
                cfg = base if k is None else engine.with_captures(base, k)
                ids, pos = engine.example_inputs(cfg, args.engine_tokens)
                wids, wpos = engine.example_inputs(cfg, 64)

                def make_engine(caps, cfg=cfg):
                    return H.EngineRank, {"cfg": cfg, "capture_mode": "list_out" if caps else "none"}
                rows += measure(f"llama_3_1_70b_tp8_{args.engine_layers}l_k{cfg.num_captures}", backend,
                                make_engine, (ids, pos), (wids, wpos))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "vllm": __import__("vllm").__version__,
                       "tokens": args.tokens, "engine_tokens": args.engine_tokens,
                       "engine_layers": args.engine_layers, "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
