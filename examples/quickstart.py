"""Quickstart: aux-hidden-state capture on the built-in reference Llama, on CPU.

1. Eager: the capture list (append + torch.cat) vs the AuxHiddenStatePacker.
2. Compiled: torch.compile(backend="aux_capture") with the pass off vs on, per inner, for the
   list path and for a model that uses the packer.
Every number below is measured in this run (peak bytes from the PyTorch profiler's
allocation events), side by side; overhead = (peak - peak without captures) / packed bytes.
"bitwise" compares the packed captures with the eager list path (Inductor rows: with
Inductor's list path without the pass); "model = none" compares the model's own output with
the same execution of the model without captures.

    make demo            # or: PYTHONPATH=. python examples/quickstart.py [--tokens N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import models  # noqa: E402
from compile_pass import aux_capture_backend, measure_peak, pack_aux_hidden_states  # noqa: E402


def peak_of(model: torch.nn.Module, inputs) -> tuple:
    def forward():
        hidden, aux = model(*inputs)
        return hidden, pack_aux_hidden_states(aux) if aux is not None else None

    forward()  # warm up (and compile)
    return measure_peak(forward)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--model", default="dflash", choices=sorted(models.FACTORIES))
    parser.add_argument("--inners", default="eager,aot_eager,inductor")
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
            peak, (hidden, packed) = peak_of(model, inputs)
            if mode == "none":
                none_peak, none_hidden = peak, hidden
                continue
            reference = reference if reference is not None else packed
            rows.append(("eager", mode, peak, packed, none_peak, torch.equal(packed, reference),
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
                peak, (hidden, packed) = peak_of(compiled, inputs)
                if mode == "none":
                    compiled_none, compiled_hidden = peak, hidden
                    continue
                inner_reference = inner_reference if inner_reference is not None else packed
                rows.append((f"compiled/{inner}", label, peak, packed, compiled_none,
                             torch.equal(packed, inner_reference), torch.equal(hidden, compiled_hidden)))
                if rewrite and mode == "list":
                    for result in backend.results[-1:]:
                        for group in result.groups:
                            if group.k == model.num_captures:
                                print(f"  [{inner}] K={group.k} group: {group.decision.value}: {group.reason}")

    print()
    print(f"{'execution':20} {'capture':14} {'peak MiB':>9} {'packed MiB':>10} {'overhead':>9} "
          f"{'bitwise':>8} {'model = none':>13}")
    for execution, label, peak, packed, base, equal, model_equal in rows:
        packed_bytes = packed.numel() * packed.element_size()
        print(f"{execution:20} {label:14} {peak / mib:9.1f} {packed_bytes / mib:10.1f} "
              f"{(peak - base) / packed_bytes:9.2f} {'yes' if equal else 'NO':>8} "
              f"{'yes' if model_equal else 'NO':>13}")
    return 0 if all(r[-2] and r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
