"""Why the pass writes with a mutating custom op: a naive in-place rewrite placed before
AOTAutograd, measured against the list path, side by side in one run (CPU).

    PYTHONPATH=. python benchmarks/naive_rewrite.py [--tokens 8192] [--out FILE.json]

The decoder: 12 layers (RMSNorm + Linear + residual stream), hidden 256, fp32, captures of
``hidden + residual`` at the input of layers 2, 6 and 9, then ``torch.cat(aux, -1)``. Three
ways to collect the captures, each compiled with the stock ``eager`` / ``aot_eager`` /
``inductor`` backends (no pass):

- ``list``: the list path;
- ``naive``: the rewrite written out by hand before AOTAutograd: ``buf = torch.empty(T,
  3H)`` at the first capture, ``buf.narrow(-1, i*H, H).copy_(capture)`` at each;
- ``write_slice_``: the same, each write the pass's mutating custom op
  ``compile_pass::write_slice_`` (what the pass inserts), still compiled by the stock backend;
- ``list + pass``: the list path compiled by ``aux_capture`` with that inner: the op plus
  what the backend does around it (the aot_eager inner reinplaces the functionalized writes
  after AOTAutograd; the inductor inner lifts the buffer out of the graph, ``lift.py``).

Peak bytes (PyTorch profiler allocation events) in units of T*H*4 bytes (the packed result
is 3.0). AOTAutograd functionalizes each ``copy_`` into a slice of an intermediate buffer
into a ``slice_scatter`` producing a whole new buffer; nothing turns those back into
in-place writes under ``aot_eager``, and Inductor lowers the chain on an ``empty`` buffer as
one kernel with the producers kept alive until then. The custom op's declared mutation
survives functionalization as ``auto_functionalized`` and is written in place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compile_pass.backend import aux_capture_backend  # noqa: E402
from compile_pass.memory import measure_peak  # noqa: E402
from compile_pass.ops import write_slice_  # noqa: E402

H, LAYERS, CAPTURE_AT = 256, 12, (2, 6, 9)


class Decoder(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.norms = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(H)) for _ in range(LAYERS))
        self.proj = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, torch.zeros_like(x)
        aux, buf = [], None
        for i in range(LAYERS):
            if i in CAPTURE_AT:
                capture = hidden + residual
                if self.mode == "list":
                    aux.append(capture)
                else:
                    k = CAPTURE_AT.index(i)
                    if buf is None:
                        buf = capture.new_empty(capture.shape[0], H * len(CAPTURE_AT))
                    if self.mode == "naive":
                        buf.narrow(-1, k * H, H).copy_(capture)
                    else:
                        write_slice_(buf, capture, 1, k * H)
            residual = hidden + residual
            normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norms[i]
            hidden = self.proj[i](normed)
        return torch.cat(aux, -1) if self.mode == "list" else buf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out")
    args = ap.parse_args()
    x = torch.randn(args.tokens, H)
    unit = args.tokens * H * 4
    rows = []
    for backend in ("eager", "aot_eager", "inductor"):
        ref = None
        for mode in ("list", "naive", "write_slice_", "list + pass"):
            torch._dynamo.reset()
            compiler = aux_capture_backend(backend) if mode == "list + pass" else backend
            model = torch.compile(Decoder(mode.split(" ")[0]).eval(), backend=compiler)
            with torch.no_grad():
                model(x)  # compile
                peak = measure_peak(model, x)
            ref = peak.result if ref is None else ref  # this backend's list build
            rows.append({"backend": backend, "capture": mode, "peak_units": round(peak.bytes / unit, 2),
                         "bitwise_vs_list_build": bool(torch.equal(peak.result, ref))})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "tokens": args.tokens, "unit_bytes": unit,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
