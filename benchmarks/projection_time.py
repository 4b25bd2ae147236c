"""Forward time of the projection against the list path and the packer, decode sizes to
prefill, and the ops the projection adds per capture per forward.

    PYTHONPATH=. python benchmarks/projection_time.py --out docs/results/projection_time_cpu.json
    PYTHONPATH=. python benchmarks/projection_time.py --render docs/results/projection_time_cpu.json

Model: ``models/draft_input.TargetWithDraftInput`` over one Llama 3.1 70B TP=8 rank scaled
1/8 (hidden 1024; ``--layers`` layers, K=3 captures of ``hidden + residual`` spread over the
depth), fp32, the draft's combine at the end of the forward (``H_draft`` = 0.75 H), so each
forward ends in the draft's input. Rows, per combine (plain fc with bias, ``norm_before_fc``,
``fc_norms``, DFlash) and token count:

- ``list``: the engines' list, ``torch.cat``, then the draft's combine (uncompiled);
- ``packer``: ``AuxHiddenStatePacker``, then the combine;
- ``proj1``: ``ProjectingAccumulator``, ``append(hidden + residual)``;
- ``proj2``: the same, ``append(hidden, residual)`` (vLLM's plugin's call);
- ``inductor_list`` / ``inductor_fused``: the list build compiled by ``aux_capture`` with
  Inductor, the pass off / with ``fuse_projection``, at ``--inductor-tokens`` (a static
  compile per token count: over a symbolic one stock Inductor fails on this model, with or
  without the pass).

Each row's time is the median of ``--repeats`` runs taken round-robin over the rows of one
(combine, T), one thread (``torch.set_num_threads(1)``), after a warm-up; ``ratio`` is that
median over the list row's of the same execution (eager rows over ``list``, Inductor rows
over ``inductor_list``). The packer's ratio (it only moves bytes) shows the noise. ``ops``:
the top-level operator calls the profiler records in one forward, less views and
allocations without a fill (``NO_KERNEL``): on a GPU each is a kernel launch;
``ops_added_per_capture``: (ops - the list row's ops) / K at that T, with ``ops_added`` /
``ops_removed`` by name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compile_pass.backend import aux_capture_backend  # noqa: E402
from benchmarks.projection_memory import warm_up_for_capture  # noqa: E402
from models import engine  # noqa: E402
from models.draft_input import COMBINES, TargetWithDraftInput  # noqa: E402

EAGER_ROWS = ("list", "packer", "proj1", "proj2")
COMPILED_ROWS = ("inductor_list", "inductor_fused")
TOKENS = (1, 4, 16, 64, 256, 2048)


def build(cfg, combine: str, capture: str, state=None, dtype=torch.float32, device="cpu") -> TargetWithDraftInput:
    torch.manual_seed(0)
    model = TargetWithDraftInput(cfg, combine, capture, int(cfg.hidden_size * 0.75), dtype=dtype).eval()
    if state is not None:
        model.load_state_dict(state)
    return model.to(device)


def runners(cfg, combine: str, compiled: bool, dtype=torch.float32, device="cpu") -> Dict[str, Callable]:
    """Row name -> forward(input_ids, positions), every row on the same weights."""
    base = build(cfg, combine, "list", dtype=dtype, device=device)
    state = base.state_dict()
    rows = {"list": base, **{name: build(cfg, combine, capture, state, dtype, device) for name, capture in
                             (("packer", "packer"), ("proj1", "projected"), ("proj2", "projected_pairs"))}}
    if compiled:
        # one static compile per token count: stock Inductor (torch 2.13) fails to compile this
        # model over a symbolic token count (decompose_auto_functionalized's assertion on the
        # engine's in-place fused norm), with the pass or without it
        torch._dynamo.reset()
        for name, options in (("inductor_list", {"rewrite": False}), ("inductor_fused", {"fuse_projection": True})):
            rows[name] = torch.compile(build(cfg, combine, "list", state, dtype, device), dynamic=False,
                                       backend=aux_capture_backend("inductor", **options))
    return rows


#: operators that launch no kernel (views, metadata, allocation without a fill)
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "view", "reshape", "narrow", "t", "transpose", "slice", "select", "as_strided", "expand", "unsqueeze",
    "squeeze", "permute", "detach", "alias", "_unsafe_view", "split", "split_with_sizes", "chunk", "unbind",
    "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "resolve_conj", "resolve_neg", "numel",
    "size", "stride", "dim", "is_nonzero", "_reshape_alias", "result_type"))


def op_counts(fn: Callable, inputs) -> Counter:
    """Top-level operator calls the profiler records in one forward, by name, less those
    that launch no kernel (``NO_KERNEL``): on a GPU each is a launch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*inputs)
    return Counter(e.name for e in prof.events() if e.cpu_parent is None and e.name not in NO_KERNEL
                   and not e.name.startswith(("ProfilerStep", "Torch-Compiled", "## ")))


def in_cuda_graph(fn: Callable, inputs) -> Callable:
    """``fn(*inputs)`` captured in one CUDA graph (after warm-up on a side stream); the
    returned callable replays it (a decode step as CUDA-graph runners run it)."""
    warm_up_for_capture(fn, inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs)
    return lambda *_: graph.replay()


def time_rows(rows: Dict[str, Callable], inputs, repeats: int) -> Dict[str, float]:
    """Median seconds per forward, the rows taken round-robin ``repeats`` times (on CUDA,
    each forward between two synchronizations)."""
    cuda = inputs[0].device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in rows.values():  # warm-up (and, for compiled rows, the first call's compile)
        for _ in range(5):
            fn(*inputs)
    samples: Dict[str, List[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            sync()
            t = time.perf_counter()
            fn(*inputs)
            sync()
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(cfg, combines, tokens, repeats: int, compiled_tokens=(), dtype=torch.float32, device="cpu",
            graph_tokens: int = 0) -> List[dict]:
    """Rows per combine and token count (the Inductor rows at ``compiled_tokens``, compiled
    for each); on CUDA, token counts up to ``graph_tokens`` run each eager row captured in a
    CUDA graph (decode steps), larger ones eagerly (prefill)."""
    out = []
    k = len(cfg.layers_to_capture)
    for combine in combines:
        for t in tokens:
            built = runners(cfg, combine, t in compiled_tokens, dtype, device)
            inputs = engine.example_inputs(cfg, t, device=device)
            graphed = device == "cuda" and t <= graph_tokens
            with torch.no_grad():
                rows = {name: in_cuda_graph(fn, inputs) if graphed and not name.startswith("inductor") else fn
                        for name, fn in built.items()}
                medians = time_rows(rows, inputs, repeats)
                ops = {name: op_counts(fn, inputs) for name, fn in built.items()}
            for name, seconds in medians.items():
                ref = "inductor_list" if name.startswith("inductor") else "list"
                added, removed = ops[name] - ops[ref], ops[ref] - ops[name]
                out.append({"combine": combine, "tokens": t, "row": name, "cuda_graph": graphed,
                            "ms": round(seconds * 1e3, 4),
                            "ratio": round(seconds / medians[ref], 3), "ops": sum(ops[name].values()),
                            "ops_added_per_capture": round((sum(ops[name].values()) - sum(ops[ref].values())) / k, 2),
                            "ops_added": dict(added), "ops_removed": dict(removed)})
                print(json.dumps(out[-1]), flush=True)
    return out


def render(path: str) -> str:
    with open(path) as f:
        result = json.load(f)
    rows = result["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    names = [n for n in (*EAGER_ROWS, *COMPILED_ROWS) if any(r["row"] == n for r in rows)][1:]
    names = [n for n in names if n != "inductor_list"]
    lines = ["| combine | row | " + " | ".join(f"T={t}" for t in tokens) + " | ops added per capture (T=4) |",
             "|" + "---|" * (len(tokens) + 3)]
    for combine in dict.fromkeys(r["combine"] for r in rows):
        for name in names:
            by = {r["tokens"]: r for r in rows if r["combine"] == combine and r["row"] == name}
            if not by:
                continue
            cells = [f"{by[t]['ratio']:.2f}" if t in by else "-" for t in tokens]
            added = by.get(4, by[min(by)])["ops_added_per_capture"]
            lines.append(f"| {combine} | {name} | " + " | ".join(cells) + f" | {added:+g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", help="print a result file as a markdown table, run nothing")
    ap.add_argument("--combines", default=",".join(COMBINES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--inductor-tokens", default="4,64,2048",
                    help="token counts with the Inductor rows (each a static compile)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--scale", type=int, default=8, help="the 70B TP=8 rank's widths divided by this")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-graph-tokens", type=int, default=64,
                    help="on CUDA: token counts up to this run in a CUDA graph (decode steps)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    if args.device == "cpu":
        torch.set_num_threads(1)
    cfg = engine.with_captures(engine.scaled(engine.llama_3_1_70b(tp=8, num_layers=args.layers), args.scale), 3)
    dtype = getattr(torch, args.dtype)
    compiled = () if args.no_inductor else tuple(int(t) for t in args.inductor_tokens.split(","))
    rows = measure(cfg, args.combines.split(","), [int(t) for t in args.tokens.split(",")], args.repeats,
                   compiled, dtype, args.device, args.cuda_graph_tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "argv": sys.argv[1:], "hidden": cfg.hidden_size,
                       "layers": args.layers, "k": len(cfg.layers_to_capture), "dtype": args.dtype,
                       "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
