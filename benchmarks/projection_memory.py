"""The draft's input projection, per capture, against the list path and the packer: peak
memory side by side in one run, numerics, and the time of the K small GEMMs against one.

    PYTHONPATH=. python benchmarks/projection_memory.py --out docs/results/projection_memory_cpu.json
    PYTHONPATH=. python benchmarks/projection_memory.py --inners eager,inductor --ks 3,8 --dtypes bfloat16

Model: one Llama 3.1 70B TP=8 rank from ``models/engine.py`` scaled by ``--scale`` (hidden
8192/scale, the rank's attention and MLP widths), ``--layers`` layers, K capture layers spread
over the depth (``models.engine.with_captures``), the draft's input projection at the end of
the forward (``models/draft_input.py``: ``plain`` fc with bias, ``norm_before_fc``,
``fc_norms``, DFlash ``fc`` + norm; H_draft = ``--draft-ratio`` x hidden). Rows per combine, K
and dtype: the captures collected by the list path (+ cat + combine), the packer (+ combine),
and projected per capture (``ProjectingAccumulator``), each run uncompiled (``module``); or
compiled by ``aux_capture`` with an inner: the list path with the pass off (``list``), on
(``pass``), on with ``fuse_projection`` (``fused``), and the projected collector compiled
(``projected``); or (``cudagraph``) the uncompiled variants captured in one CUDA graph,
the peak being the bytes the graph's pool holds (on CPU, the dry run, the forward
measured as ``module``: ``graph_captured`` false). overhead = (peak - peak of the same execution without
captures or combine) / packed bytes ``T*K*H``: 1.00 means the packed buffer's bytes, the
packer's cost. "abs err": max |draft input - the list path's|; "rel err": that / max |the
list path's|.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compile_pass.backend import aux_capture_backend  # noqa: E402
from compile_pass.memory import measure_peak  # noqa: E402
from models import engine  # noqa: E402
from models.draft_input import COMBINES, TargetWithDraftInput  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def config(k: int, layers: int, scale: int) -> engine.EngineConfig:
    return engine.with_captures(engine.scaled(engine.llama_3_1_70b(tp=8, num_layers=layers), scale), k)


#: per execution: (row name, capture, backend options): module rows run uncompiled
MODULE_VARIANTS = (("list", "list", None), ("packer", "packer", None), ("projected", "projected", None))
COMPILED_VARIANTS = (("list", "list", {"rewrite": False}), ("pass", "list", {}),
                     ("fused", "list", {"fuse_projection": True}), ("projected", "projected", {}))


class GraphPeak:
    """What a captured CUDA graph holds: the bytes allocated while capturing it (its private
    pool: every tensor the forward makes, the outputs included), and its replay's outputs."""

    def __init__(self, nbytes: int, result) -> None:
        self.bytes, self.result = nbytes, result


def warm_up_for_capture(fn, inputs) -> None:
    """Two runs of ``fn(*inputs)`` on a side stream, as a CUDA graph's capture wants first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def graph_peak(fn, inputs) -> GraphPeak:
    """``fn(*inputs)`` captured in a CUDA graph (after two warm-up runs on a side stream) and
    replayed once. Off CUDA (the dry run) the same forward measured by the profiler."""
    if inputs[0].device.type != "cuda":
        return measure_peak(fn, *inputs)
    warm_up_for_capture(fn, inputs)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    held = torch.cuda.max_memory_allocated() - base
    graph.replay()
    torch.cuda.synchronize()
    result = tuple(t.clone() for t in out)
    del graph
    return GraphPeak(held, result)


def run_row(cfg, combine, capture, dtype, draft_hidden, inner, inputs, state, options=None):
    model = TargetWithDraftInput(cfg, combine, capture, draft_hidden, dtype=dtype).eval()
    model.load_state_dict(state)
    model.to(inputs[0].device)
    if inner == "cudagraph":  # the uncompiled forward captured in one CUDA graph
        with torch.no_grad():
            return graph_peak(model, inputs)
    fn = model if inner == "module" else torch.compile(
        model, backend=aux_capture_backend(inner, **(options or {})), dynamic=False)
    with torch.no_grad():
        fn(*inputs)  # compile / warm up
        peak = measure_peak(fn, *inputs)
    torch._dynamo.reset()
    return peak


def gemm_time_ratio(cfg, draft_hidden, dtype, tokens, repeats=5, device="cpu"):
    """Wall time of K GEMMs [T, H] x [H, H_draft] summed in place against one [T, K*H] GEMM."""
    k, h = len(cfg.layers_to_capture), cfg.hidden_size
    xs = [torch.randn(tokens, h, dtype=dtype, device=device) for _ in range(k)]
    w = torch.randn(draft_hidden, k * h, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    packed = torch.cat(xs, -1)

    def one():
        return packed @ w.t()

    def per_capture():
        acc = xs[0] @ w[:, :h].t()
        for i in range(1, k):
            acc.addmm_(xs[i], w[:, i * h:(i + 1) * h].t())
        return acc

    times = {}
    for name, fn in (("one", one), ("per_capture", per_capture)):
        fn()
        best = float("inf")
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - start)
        times[name] = best
    return times["per_capture"] / times["one"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--combines", default=",".join(COMBINES))
    ap.add_argument("--ks", default="3,5,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--inners", default="module")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--draft-ratio", type=float, default=0.75)
    ap.add_argument("--device", default="cpu", help="cpu (peaks from the profiler) or cuda (max_memory_allocated)")
    ap.add_argument("--out")
    ap.add_argument("--time-only", action="store_true",
                    help="only the K-GEMMs-vs-one time ratio per dtype and K (on a quiet machine)")
    args = ap.parse_args()
    rows = []
    if args.time_only:
        for dtype_name in args.dtypes.split(","):
            for k in (int(x) for x in args.ks.split(",")):
                cfg = config(k, args.layers, args.scale)
                ratio = gemm_time_ratio(cfg, int(cfg.hidden_size * args.draft_ratio), DTYPES[dtype_name], args.tokens,
                                        repeats=20, device=args.device)
                rows.append({"device": args.device, "dtype": dtype_name, "K": k, "tokens": args.tokens,
                             "gemm_time_ratio": round(ratio, 3)})
                print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"torch": torch.__version__, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
        return
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for k in (int(x) for x in args.ks.split(",")):
            cfg = config(k, args.layers, args.scale)
            draft_hidden = int(cfg.hidden_size * args.draft_ratio)
            inputs = engine.example_inputs(cfg, args.tokens, device=args.device)
            packed = args.tokens * k * cfg.hidden_size * torch.tensor([], dtype=dtype).element_size()
            ratio = gemm_time_ratio(cfg, draft_hidden, dtype, args.tokens, device=args.device)
            for combine in args.combines.split(","):
                torch.manual_seed(0)
                state = TargetWithDraftInput(cfg, combine, "list", draft_hidden, dtype=dtype).state_dict()
                for inner in args.inners.split(","):
                    variants = MODULE_VARIANTS if inner in ("module", "cudagraph") else COMPILED_VARIANTS
                    peaks = {"none": run_row(cfg, combine, "none", dtype, draft_hidden, inner, inputs, state)}
                    for name, capture, options in variants:
                        peaks[name] = run_row(cfg, combine, capture, dtype, draft_hidden, inner, inputs, state,
                                              options)
                    ref = peaks["list"].result[1].float()
                    row = {"device": args.device, "combine": combine, "K": k, "hidden": cfg.hidden_size,
                           "draft_hidden": draft_hidden,
                           "dtype": dtype_name, "tokens": args.tokens, "execution": inner,
                           "graph_captured": inner == "cudagraph" and args.device == "cuda",
                           "packed_mib": round(packed / 2**20, 2), "gemm_time_ratio": round(ratio, 2)}
                    for name, _, _ in variants:
                        row[f"overhead_{name}"] = round((peaks[name].bytes - peaks["none"].bytes) / packed, 3)
                        abs_err = float((peaks[name].result[1].float() - ref).abs().max())
                        row[f"abs_err_{name}"] = abs_err
                        row[f"rel_err_{name}"] = abs_err / float(ref.abs().max())
                        row[f"model_equal_{name}"] = bool(torch.equal(peaks[name].result[0], peaks["none"].result[0]))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
