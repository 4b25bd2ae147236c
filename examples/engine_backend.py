"""A minimal engine-style torch.compile backend that splits the graph itself, with the pass.

Serving engines (SGLang's and vLLM's piecewise CUDA-graph backends) do not use a stock
backend: they take the Dynamo graph, split it at attention with ``split_module``, compile
each piece and capture CUDA graphs per batch size. This example is that shape, ~40 lines,
with one added call: ``compile_pass.rewrite_graph(gm, split_ops=...)`` on the whole Dynamo
graph *before* the split, so the aux-capture concat in the last piece becomes one packed
buffer written in place by the earlier pieces.

    PYTHONPATH=. python examples/engine_backend.py            # CPU: pieces compiled by Inductor
    PYTHONPATH=. python examples/engine_backend.py --inner eager --tokens 2048

It prints the pass's decision, the pieces, and the measured peak of the engine backend with
and without the pass (same split, same compiler), with a bitwise comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, List

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import compile_pass  # noqa: E402
import models  # noqa: E402

SPLIT_OPS = ["models::attention"]


def engine_backend(inner: str, use_pass: bool, log: List[str]) -> Callable[..., Any]:
    """A backend in the engines' shape: (rewrite) -> split at attention -> compile pieces."""

    def backend(gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        if use_pass:
            result = compile_pass.rewrite_graph(gm, split_ops=SPLIT_OPS)
            for group in result.groups:
                if group.k > 2:
                    log.append(f"pass: {group.key} K={group.k} {group.decision.value}: {group.reason}")
        # the engine's own split: a new piece at every attention call, attention alone
        piece, piece_of = 0, {}
        for node in gm.graph.nodes:
            at_split = compile_pass.split.split_op_name(node) in SPLIT_OPS
            piece += at_split
            piece_of[node] = piece
            piece += at_split
        split = split_module(gm, gm, lambda node: piece_of[node], keep_original_order=True)
        # compile every piece that is not an attention call, with fake inputs of the
        # compile's own fake mode (symbolic token count: one compile for all sizes)
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        compiled_pieces = 0

        class Compile(fx.Interpreter):
            def call_module(self, target, args, kwargs):
                nonlocal compiled_pieces
                submodule = self.fetch_attr(target)
                out = submodule(*args, **kwargs)
                is_attention = any(compile_pass.split.split_op_name(n) in SPLIT_OPS
                                   for n in submodule.graph.nodes)
                if inner == "inductor" and not is_attention:
                    from torch._inductor.compile_fx import compile_fx

                    if not isinstance(out, tuple):  # Inductor wants tuple outputs
                        output = next(n for n in reversed(submodule.graph.nodes) if n.op == "output")
                        output.args = ((output.args[0],),)
                        submodule.recompile()
                        fn = compile_fx(submodule, list(args))
                        setattr(split, target, _Piece(lambda *a, fn=fn: fn(*a)[0]))
                    else:
                        setattr(split, target, _Piece(compile_fx(submodule, list(args))))
                    compiled_pieces += 1
                return out

        with fake_mode:
            Compile(split).run(*fakes)
        log.append(f"split: {len(list(split.children()))} pieces, {compiled_pieces} compiled by {inner}")
        return split.forward

    return backend


class _Piece(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")

    runs = {}
    for use_pass in (False, True):
        torch._dynamo.reset()
        model, inputs = models.dflash.capture_dominated(capture_mode="list", tokens=args.tokens,
                                                         num_layers=6, k=4)
        log: List[str] = []
        compiled = torch.compile(model, backend=engine_backend(args.inner, use_pass, log),
                                 fullgraph=True, dynamic=True)
        with torch.no_grad():
            compiled(*inputs)  # compile + warm up
            peak = compile_pass.measure_peak(compiled, *inputs)
        runs[use_pass] = peak
        print(f"--- engine backend, pass {'on' if use_pass else 'off'}")
        for line in dict.fromkeys(log):  # Dynamo may compile twice: print each line once
            print("   ", line)
    packed = runs[True].result[1]
    packed_bytes = packed.numel() * packed.element_size()
    equal = all(torch.equal(a, b) for a, b in zip(runs[False].result, runs[True].result))
    print(f"peak without the pass {runs[False].bytes / 2**20:.1f} MiB, with it "
          f"{runs[True].bytes / 2**20:.1f} MiB (saved {(runs[False].bytes - runs[True].bytes) / packed_bytes:.2f}"
          f"x the packed {packed_bytes / 2**20:.1f} MiB); bitwise equal: {equal}")
    if torch.cuda.is_available():
        print("CUDA: capture the compiled model per token count with compile_pass.cudagraph "
              "(docs/cuda-graphs.md)")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
