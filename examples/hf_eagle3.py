"""Eagle3 captures from an HF transformers Llama, compiled with the aux_capture pass (CPU).

Builds a small random HF ``LlamaForCausalLM`` (no download: 8 layers, hidden 256, vocab
8192), wraps it the way Eagle3 training reads its target (``--style hidden_states``:
``output_hidden_states=True`` then ``torch.cat`` of layers [2, 4, 5]; ``--style hooks``:
forward hooks on those layers), compiles it with ``backend="aux_capture"``, prints what
the pass decided for the capture concat, and measures the peak memory of one forward,
side by side in this run: uncompiled (both styles), compiled without the pass, compiled
with it. "bitwise" compares with the uncompiled wrapper (Inductor: with Inductor without
the pass).

    PYTHONPATH=. python examples/hf_eagle3.py                    # needs: pip install 'compile-pass[hf]'
    PYTHONPATH=. python examples/hf_eagle3.py --style hooks --inner aot_eager --tokens 4096

overhead = (peak - peak of the same execution without captures) / packed bytes: 1.00 means
the packed ``[1, T, 3 * hidden]`` result is the only extra memory.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compile_pass import Decision, aux_capture_backend, measure_peak  # noqa: E402
from models import hf  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--style", default="hidden_states", choices=("hidden_states", "hooks"))
    parser.add_argument("--inner", default="eager", choices=("eager", "aot_eager", "inductor"))
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    transformers = hf.require_transformers()
    mib = 2**20

    def build(style: str):
        # seeded: every build has the same weights and input ids
        return hf.capture_dominated("llama", style, tokens=args.tokens)

    def peak(fn, ids):
        fn(ids)  # warm up (and compile)
        return measure_peak(fn, ids)

    wrapper, (ids,) = build(args.style)
    config = wrapper.model.config
    print(f"HF {type(wrapper.model).__name__} (transformers {transformers.__version__}): "
          f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}; "
          f"style {args.style}, captures {list(wrapper.capture_layers)}, {args.tokens} tokens, fp32, CPU")

    rows = []
    with torch.no_grad():
        none_module, _ = peak(build("none")[0], ids)
        module_peak, reference = peak(wrapper, ids)
        rows.append((f"uncompiled ({args.style})", module_peak, none_module, True))
        other = "hooks" if args.style == "hidden_states" else "hidden_states"
        other_peak, other_out = peak(build(other)[0], ids)
        rows.append((f"uncompiled ({other})", other_peak, none_module,
                     all(torch.equal(a, b) for a, b in zip(other_out, reference))))

        torch._dynamo.reset()
        none_compiled, _ = peak(torch.compile(build("none")[0], backend=aux_capture_backend(args.inner, rewrite=False),
                                              fullgraph=True), ids)
        for rewrite in (False, True):
            torch._dynamo.reset()
            backend = aux_capture_backend(args.inner, rewrite=rewrite)
            # the same as torch.compile(..., backend="aux_capture", options={"inner": ..., "rewrite": ...}),
            # with the backend object kept to read its decisions
            compiled = torch.compile(build(args.style)[0], backend=backend, fullgraph=True)
            compiled_peak, out = peak(compiled, ids)
            if not rewrite:
                no_pass_out = out
            # Inductor rounds differently from eager: compare it with Inductor without the pass
            ref = no_pass_out if args.inner == "inductor" else reference
            equal = all(torch.equal(a, b) for a, b in zip(out, ref))
            rows.append((f"compiled ({args.inner}), pass {'on' if rewrite else 'off'}", compiled_peak,
                         none_compiled, equal))
        packed = reference[1].numel() * reference[1].element_size()

    print("\npass decisions (graphs compiled with the pass on):")
    for result in backend.results:
        for group in result.groups:
            if group.widths == (config.hidden_size,) * len(wrapper.capture_layers):
                print(f"  [{result.target}] the K={group.k} capture concat ({group.cat.name}): "
                      f"{group.decision.value}: {group.reason}")
                for capture in group.captures:
                    print(f"      {capture.node.name:20} {capture.location:28} "
                          f"{capture.strategy.value if capture.strategy else '-'}")
        others = [g for g in result.groups if g.k < len(wrapper.capture_layers) or
                  g.widths != (config.hidden_size,) * g.k]
        rejected = sum(g.decision is Decision.REJECT for g in others)
        if others:
            print(f"  [{result.target}] {len(others)} other concats (RoPE), {rejected} left alone: "
                  f"{others[0].reason.split(':')[0]}")

    print(f"\n{'execution':32} {'peak MiB':>9} {'packed MiB':>10} {'overhead':>9} {'bitwise':>8}")
    for label, value, base, equal in rows:
        print(f"{label:32} {value / mib:9.1f} {packed / mib:10.1f} {(value - base) / packed:9.2f} "
              f"{'yes' if equal else 'NO':>8}")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
