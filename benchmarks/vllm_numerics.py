"""Does capturing change what the model computes, inside vLLM's piecewise Inductor stack?

    ~/.cache/compile_pass/venv-vllm0.34.0/bin/python benchmarks/vllm_numerics.py \\
        --out docs/results/vllm0.34.0_numerics_cpu.json

The vLLM-style decoder (``models/vllm_style.py``, ``native`` style: vLLM's
``RMSNorm.forward_native`` computes ``hidden + residual`` in torch, the same sum the
capture takes), 8 layers, hidden 512, intermediate 1024, fp32, compiled by vLLM's
``VllmBackend`` (VLLM_COMPILE, split at attention, Inductor pieces). For K = 3, 5, 8
capture layers, plugin off and on: the model's output with captures against the same
build without captures (max |diff|, bitwise), and the number of ``aten.addmm`` nodes in
the pieces' post-grad graphs (``TORCH_LOGS=post_grad_graphs``), where the difference
comes from: a capture is a second reader of the down projection's ``mm``, and Inductor
folds ``mm + residual`` into ``addmm`` only for a single reader.
"""

import argparse
import json
import logging
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from compile_pass.integrations import vllm as plugin  # noqa: E402
import models.vllm_style as H  # noqa: E402

LAYERS = {3: (2, 4, 5), 5: (1, 3, 5, 6, 7), 8: tuple(range(8))}


class _AddmmCounter(logging.Handler):
    """Counts ``aten.addmm`` nodes in the post-grad graphs Inductor logs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().count("aten.addmm.default(")


def build_and_run(caps, kw, state, x):
    counter = _AddmmCounter()
    log = logging.getLogger("torch._inductor.compile_fx")
    log.addHandler(counter)
    try:
        model, run, _ = H.build("inductor", capture_at=caps, **kw)
        model.load_state_dict(state)
        h, _ = run(x)
    finally:
        log.removeHandler(counter)
    torch._dynamo.reset()
    return h, counter.count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--captures", default="3,5,8")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch._logging.set_logs(post_grad_graphs=True)
    kw = dict(style="native", hidden=512, intermediate=1024)
    state = H.build("none", capture_at=(), **kw)[0].state_dict()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, 512)
    rows = []
    for k in (int(k) for k in args.captures.split(",")):
        for on in (False, True):
            if on:
                assert plugin.install()
            else:
                plugin.uninstall()
            h0, addmm0 = build_and_run((), kw, state, x)
            h1, addmm1 = build_and_run(LAYERS[k], kw, state, x)
            rows.append({"K": k, "plugin": on, "output_bitwise_vs_no_capture": bool(torch.equal(h0, h1)),
                         "max_abs_diff": float((h0 - h1).abs().max()),
                         "addmm_no_capture": addmm0, "addmm_with_captures": addmm1})
            print(json.dumps(rows[-1]), flush=True)
    plugin.uninstall()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "vllm": __import__("vllm").__version__,
                       "tokens": args.tokens, "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
