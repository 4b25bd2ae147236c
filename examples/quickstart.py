"""Quickstart: aux-hidden-state capture on the built-in reference Llama, on CPU.

1. Eager: the capture list (append + torch.cat) vs the AuxHiddenStatePacker.
2. Compiled: torch.compile(backend="aux_capture") with the pass off vs on, per inner, for the
   list path and for a model that uses the packer.
Every number below is measured in this run (peak bytes from the PyTorch profiler's
allocation events), side by side; overhead = (peak - peak without captures) / packed bytes.
"bitwise" compares the packed captures with the eager list path (Inductor rows: with
Inductor's list path without the pass); "model = none" compares the model's own output with
the same execution of the model without captures; "ms" is the median forward time of 5 runs
(this machine, whatever else runs on it).
3. Opt-in, changes rounding: the draft's input projected per capture (the draft's fc, and
   Eagle3's norm before it, applied to each capture as it is made: ``[T, K*H]`` never exists),
   on an engine-shaped rank whose forward ends in the draft's combine: overhead, time, and
   the draft input's largest error relative to the list path's.

    make demo            # or: PYTHONPATH=. python examples/quickstart.py [--tokens N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import models  # noqa: E402
from compile_pass import aux_capture_backend, measure_peak, pack_aux_hidden_states  # noqa: E402


def peak_of(model: torch.nn.Module, inputs) -> tuple:
    """(peak, (hidden, packed), median ms of 5 forwards)."""
    def forward():
        hidden, aux = model(*inputs)
        return hidden, pack_aux_hidden_states(aux) if aux is not None else None

    forward()  # warm up (and compile)
    measured = measure_peak(forward)
    return measured.bytes, measured.result, median_ms(forward)


def median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def projection_rows(tokens: int) -> list:
    """Section 3: list / packer / projected (eager ``ProjectingAccumulator``; the pass's
    ``fuse_projection`` under Inductor) on ``models.draft_input.tiny`` (8 layers, hidden 128,
    K=3, H_draft 96, fp32), with the plain fc and with Eagle3's norm before fc."""
    from models.draft_input import tiny

    rows = []
    for combine in ("plain", "norm_before_fc"):
        results = {}
        for label, capture, compiled in (("none", "none", False), ("list", "list", False), ("packer", "packer", False),
                                         ("projected", "projected", False), ("none, inductor", "none", "off"),
                                         ("list, inductor", "list", "off"), ("fused, inductor", "list", True)):
            model, inputs = tiny(tokens, combine=combine, capture=capture)
            if compiled:
                torch._dynamo.reset()
                # a static compile: over a symbolic token count stock Inductor fails on this
                # engine-shaped rank, with or without the pass (docs/projection.md, "Time")
                model = torch.compile(model, dynamic=False, backend=aux_capture_backend(
                    "inductor", **({"rewrite": False} if compiled == "off" else {"fuse_projection": True})))
            forward = (lambda model=model, inputs=inputs: model(*inputs))
            forward()
            measured = measure_peak(forward)
            results[label] = (measured.bytes, measured.result[1], median_ms(forward))
        listed = results["list"][1]
        packed_bytes = listed.shape[0] * 3 * 128 * 4
        for label in ("list", "packer", "projected", "list, inductor", "fused, inductor"):
            peak, draft_input, ms = results[label]
            base = results["none, inductor" if "inductor" in label else "none"][0]
            err = float((draft_input - listed).abs().max() / listed.abs().max())
            rows.append((combine, label, (peak - base) / packed_bytes, ms, err))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--model", default="dflash", choices=sorted(models.FACTORIES))
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
    parser.add_argument("--no-projection", action="store_true", help="skip section 3")
    args = parser.parse_args()
    factory = models.FACTORIES[args.model].capture_dominated
    mib = 2**20
    print(f"model: {args.model} capture_dominated, {args.tokens} tokens, fp32, CPU")

    rows = []
    with torch.no_grad():
        none_peak, none_hidden = None, None
        reference = None
        for mode in ("none", "list", "packer"):
            model, inputs = factory(capture_mode=mode, tokens=args.tokens)
            peak, (hidden, packed), ms = peak_of(model, inputs)
            if mode == "none":
                none_peak, none_hidden = peak, hidden
                continue
            reference = reference if reference is not None else packed
            rows.append(("eager", mode, peak, packed, none_peak, ms, torch.equal(packed, reference),
                         torch.equal(hidden, none_hidden)))

        for inner in args.inners.split(","):
            compiled_none = compiled_hidden = None
            # Inductor is compared with Inductor without the pass (its kernels round differently)
            inner_reference = None if inner == "inductor" else reference
            for label, mode, rewrite in (("none", "none", False), ("list", "list", False),
                                         ("list + pass", "list", True), ("packer", "packer", False),
                                         ("packer + pass", "packer", True)):
                model, inputs = factory(capture_mode=mode, tokens=args.tokens)
                torch._dynamo.reset()
                backend = aux_capture_backend(inner, rewrite=rewrite)
                compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
                peak, (hidden, packed), ms = peak_of(compiled, inputs)
                if mode == "none":
                    compiled_none, compiled_hidden = peak, hidden
                    continue
                inner_reference = inner_reference if inner_reference is not None else packed
                rows.append((f"compiled/{inner}", label, peak, packed, compiled_none, ms,
                             torch.equal(packed, inner_reference), torch.equal(hidden, compiled_hidden)))
                if rewrite and mode == "list":
                    for result in backend.results[-1:]:
                        for group in result.groups:
                            if group.k == model.num_captures:
                                print(f"  [{inner}] K={group.k} group: {group.decision.value}: {group.reason}")

    print()
    print(f"{'execution':20} {'capture':14} {'peak MiB':>9} {'packed MiB':>10} {'overhead':>9} {'ms':>8} "
          f"{'bitwise':>8} {'model = none':>13}")
    for execution, label, peak, packed, base, ms, equal, model_equal in rows:
        packed_bytes = packed.numel() * packed.element_size()
        print(f"{execution:20} {label:14} {peak / mib:9.1f} {packed_bytes / mib:10.1f} "
              f"{(peak - base) / packed_bytes:9.2f} {ms:8.1f} {'yes' if equal else 'NO':>8} "
              f"{'yes' if model_equal else 'NO':>13}")
    if not args.no_projection:
        with torch.no_grad():
            projected = projection_rows(args.tokens)
        print()
        print("Opt-in, changes rounding: the draft's input projected per capture (models.draft_input.tiny: "
              "K=3, hidden 128 -> H_draft 96, fp32; floor H_draft/(K*H) = 0.25)")
        print(f"{'combine':16} {'draft input':18} {'overhead':>9} {'ms':>8} {'rel err vs list':>16}")
        for combine, label, overhead, ms, err in projected:
            print(f"{combine:16} {label:18} {overhead:9.2f} {ms:8.1f} {err:16.1e}")
    return 0 if all(r[-2] and r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
