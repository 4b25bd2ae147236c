"""Tensor parallel: the capture pass on every rank of a 2-rank TP Llama, on CPU (gloo).

Spawns 2 ranks (models.tp_run.run_ranks). Each shards the same seeded tiny Llama (4 layers,
captures at the input of layers 1, 2, 3, i.e. after an all-reduce), runs its shard uncompiled,
then compiles it with the aux_capture backend per inner, and reports back. Printed per rank and
inner: the decision on the K-way aux concat, the all-reduce calls in the graph the pass saw,
whether the outputs are bitwise equal to the uncompiled TP model (Inductor: to Inductor without
the pass), and the largest difference from the single-process model (not bitwise: see
docs/tensor-parallel.md).

    PYTHONPATH=. python examples/tensor_parallel.py [--inners eager,aot_eager,inductor] [--split]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from models.tp_llama import ALL_REDUCE_OP  # noqa: E402
from models.tp_run import ModelSpec, TPCase, build_full, run_ranks, split_ops_supported  # noqa: E402


def _max_diff(outs, refs) -> str:
    """Largest abs difference over the input sets, for the hidden states and the packed aux."""
    hidden = max((o[0] - r[0]).abs().max().item() for o, r in zip(outs, refs))
    aux = max((o[1] - r[1]).abs().max().item() for o, r in zip(outs, refs))
    return f"hidden {hidden:.2e}, aux {aux:.2e}"


def _bitwise(outs, refs) -> bool:
    return all(torch.equal(a, b) for out, ref in zip(outs, refs) for a, b in zip(out, ref))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
    parser.add_argument("--split", action="store_true",
                        help=f"also compile each inner with split_ops=[{ALL_REDUCE_OP!r}]")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--cost-model", action="store_true",
                        help="keep the cost model on (the tiny model's eager/aot estimate shows no saving)")
    args = parser.parse_args()
    inners = [i for i in args.inners.split(",") if i]
    spec = ModelSpec()

    # The cost model stays on only where it accepts this tiny model's rewrite: Inductor's own
    # post-grad graph (its concat would copy the captures). Without a split, the eager and aot
    # graphs, and every split graph (rewritten on the Dynamo graph before the split), estimate
    # no saving at this size, so the pass is forced there unless --cost-model.
    cases = []
    for inner in inners:
        cases.append(TPCase(inner, inner, cost_model=args.cost_model or inner == "inductor"))
        if inner == "inductor":
            cases.append(TPCase("inductor_no_pass", "inductor", rewrite=False))
    if args.split:
        if not split_ops_supported():
            print("split_ops is not supported by this version of the backend: --split ignored")
        else:
            cases += [TPCase(f"split_{inner}", inner, cost_model=args.cost_model, split_ops=(ALL_REDUCE_OP,))
                      for inner in inners]
    forced = {c.name for c in cases if c.rewrite and not c.cost_model}

    full, inputs = build_full(spec)
    with torch.no_grad():
        reference = [full(*a) for a in inputs]
    k = full.num_captures
    print(f"tiny Llama, {full.config.num_layers} layers, captures {list(full.capture_layers)}, "
          f"tokens {list(spec.tokens)}, {args.world_size} ranks on CPU (gloo)")
    start = time.perf_counter()
    reports = run_ranks(cases, spec, args.world_size)
    print(f"all ranks done in {time.perf_counter() - start:.1f} s\n")

    failed = False
    for rep in reports:
        if rep.error:
            print(f"rank {rep.rank} failed:\n{rep.error}")
            failed = True
            continue
        tp_bitwise = _bitwise(rep.uncompiled, reference)
        print(f"rank {rep.rank}: uncompiled TP vs single process: bitwise {tp_bitwise}, max abs diff "
              f"{_max_diff(rep.uncompiled, reference)}")
        for name, case in rep.cases.items():
            if case.error:
                print(f"  {name:18s} FAILED:\n{case.error}")
                failed = True
                continue
            if name == "inductor_no_pass":
                continue
            groups = [g for graph in case.groups for g in graph if g["k"] == k]
            decision = "; ".join(f"{g['decision']} ({g['reason']})" for g in groups) or "no K-way group"
            base = rep.cases.get("inductor_no_pass") if case_inner(name) == "inductor" else None
            base_outputs = base.outputs if base is not None else rep.uncompiled
            against = "inductor without the pass" if base is not None else "uncompiled TP"
            bitwise = _bitwise(case.outputs, base_outputs)
            # a forced rewrite must happen; with the cost model on, a rejection is a decision
            failed |= not bitwise or (name in forced and not any(g["decision"] == "rewrite" for g in groups))
            print(f"  {name:16s} compile+run {case.seconds:5.1f} s wall, {case.cpu_seconds:5.1f} s CPU; "
                  f"all-reduce calls in the graph(s) the pass saw: {case.all_reduce_calls}")
            print(f"  {'':16s} bitwise vs {against}: {bitwise}; max abs diff vs single process: "
                  f"{_max_diff(case.outputs, reference)}")
            print(f"  {'':16s} aux concat (K={k}): {decision}")
    return 1 if failed else 0


def case_inner(name: str) -> str:
    return name[len("split_"):] if name.startswith("split_") else name


if __name__ == "__main__":
    sys.exit(main())
