"""GPU peak memory of aux-hidden-state capture at real hidden sizes, every execution mode.

Llama-3.1-8B dimensions (hidden 4096, intermediate 14336, GQA 32/8, vocab 128256) cut to a
few layers, bf16, at thousands of tokens, on one CUDA device; models ``llama`` (K=3
captures) and ``dflash`` (K=5). Per model and token count, in one process, side by side:

- ``module``: the model run uncompiled: capture modes none / list (``torch.cat``) /
  packer / packer writing into a static ``aux_out`` buffer (``packer+aux_out``);
- ``eager``, ``inductor``, ``aot_eager``: ``torch.compile(dynamic=True)`` with the
  ``aux_capture`` backend object (not the entry-point name: works without pip install):
  list path with the pass off (``list``) and on (``list+pass``), the static buffer, the
  packer;
- ``inductor-ro``: the inductor inner with ``mode="reduce-overhead"`` (cudagraph trees);
- ``runner``: ``compile_pass.cudagraph.CudaGraphRunner`` capturing one CUDA graph at the
  token count around the ``eager`` execution's compiled model (the aux_capture backend's
  eager inner, i.e. the Dynamo graph run as is, rewritten for ``list+pass``).

One compile per (execution, variant) serves every token count (dynamic shapes). Order:
the executions without Inductor for every model, then each model's Inductor executions,
then aot_eager; ``--budget-s`` starts no new variant once spent, so it cuts the last.

Measured: peak bytes above the bytes live at the start of the call
(``compile_pass.memory.measure_peak``: ``torch.cuda.max_memory_allocated`` on CUDA, the
profiler's allocation events on CPU). A CUDA-graph replay allocates nothing; what matters
is the memory the graph's pool must hold, i.e. the peak while the graph is *recorded*:
``inductor-ro`` rows report the recording call (the second call at that size), ``runner``
rows the runner's ``capture_peak_bytes`` (the capture alone, after warm-up; on CPU, without
graphs: the construction's peak); ``replay_peak_bytes`` is the replay's. overhead = (peak -
peak of variant none in the same execution) / packed bytes. ``packer+aux_out`` rows
allocate the static buffer (``static_buffer_bytes``, max tokens rows) before the call, so
it is not in their peak: their overhead is the transient alone, the others include the
packed output (1.00). Bitwise: against the module list path (Inductor executions: their own
list path).

    python benchmarks/gpu_capture_memory.py --out bench-results/gpu_capture_memory.json
    python benchmarks/gpu_capture_memory.py --device cpu --config tiny --layers 3 --tokens 64,128 \
        --dtype float32                                               # dry run on CPU
    python benchmarks/gpu_capture_memory.py --render bench-results/gpu_capture_memory.json

The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _report  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
from compile_pass import pack_aux_hidden_states  # noqa: E402
from compile_pass.backend import aux_capture_backend  # noqa: E402
from compile_pass.cudagraph import CudaGraphRunner  # noqa: E402
from compile_pass.memory import measure_peak  # noqa: E402
from models.common import dflash_capture_layers  # noqa: E402
from models.llama import (  # noqa: E402
    LlamaModel,
    capture_dominated_config,
    llama_3_1_8b_config,
    tiny_config,
)

EXECUTIONS = ("module", "eager", "runner", "inductor", "inductor-ro", "aot_eager")
#: per execution, in the order run (the budget cuts the last ones first)
VARIANTS = {
    "module": ("none", "list", "packer", "packer+aux_out"),
    "eager": ("none", "list", "list+pass", "packer+aux_out", "packer"),
    "runner": ("none", "list", "list+pass", "packer+aux_out"),
    "inductor": ("none", "list", "list+pass", "packer+aux_out", "packer"),
    "inductor-ro": ("none", "list", "list+pass"),
    "aot_eager": ("none", "list", "list+pass", "packer+aux_out", "packer"),
}

Output = Tuple[torch.Tensor, Optional[torch.Tensor]]


def model_configs(config: str, layers: int) -> Dict[str, Any]:
    """``llama`` (Eagle3-like, K=3) and ``dflash`` (K=5) at Llama-3.1-8B dimensions, or the
    tiny / capture-dominated reference dimensions (CPU dry runs and CPU numbers)."""
    base = {"8b": llama_3_1_8b_config, "tiny": tiny_config,
            "capture_dominated": capture_dominated_config}[config]
    n = layers
    eagle3 = sorted({1, n // 2, n - 1}) if n >= 3 else list(range(n))
    return {
        "llama": base(num_layers=n, capture_layers=eagle3, max_position=32768),
        "dflash": base(num_layers=n, capture_layers=dflash_capture_layers(n, min(5, n)), max_position=32768),
    }


def build(cfg: Any, device: str, dtype: torch.dtype) -> LlamaModel:
    """Seeded model built directly on ``device`` (fast at 8B sizes)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg, capture_mode="list", dtype=dtype).eval()
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _packed(out: Any) -> Output:
    hidden, aux = out
    return hidden, (None if aux is None else pack_aux_hidden_states(aux))


def _equal(a: Output, b: Optional[Output]) -> Optional[bool]:
    if b is None or a[1] is None:
        return None
    return bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))


def _clone(out: Output) -> Output:
    return out[0].clone(), (None if out[1] is None else out[1].clone())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device: str = args.device
        self.dtype = getattr(torch, args.dtype)
        self.tokens = [int(t) for t in args.tokens.split(",")]
        self.max_tokens = max(self.tokens)
        self.rows: List[Dict[str, Any]] = []
        self.start = time.perf_counter()
        self.skipped: List[str] = []

    # ------------------------------------------------------------------ output

    def save(self) -> None:
        if not self.args.out:
            return
        _report.write_json(self.args.out, {
            "device": self.device,
            "device_name": torch.cuda.get_device_name() if self.device == "cuda" else "cpu",
            "seconds": time.perf_counter() - self.start, "skipped": self.skipped, "rows": self.rows})

    def add(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        r = row
        equal = _report.yes_no(r.get("bitwise_equal"))
        print(f"{r['model']:7} T={r['tokens']:>6} {r['execution']:12} {r['variant']:15} "
              f"peak {r['peak_bytes'] / 2**20:9.1f} MiB  packed {r['packed_bytes'] / 2**20:7.1f}  "
              f"overhead {r['overhead']:6.2f}  equal {equal:3}  {r.get('note', '')}", flush=True)
        self.save()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    # ------------------------------------------------------------------ runs

    def inputs(self, model: LlamaModel, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g).to(self.device)
        return ids, torch.arange(tokens, device=self.device)

    def static_buffer(self, model: LlamaModel) -> torch.Tensor:
        buf = torch.zeros(self.max_tokens, model.num_captures * model.config.hidden_size,
                          dtype=self.dtype, device=self.device)
        torch._dynamo.mark_static(buf)  # one symbol for T, not shared with the buffer's rows
        return buf

    def fn_for(self, model: LlamaModel, execution: str, variant: str
               ) -> Tuple[Callable[..., Any], Any]:
        """The callable of one (execution, variant) and its aux_capture backend (or None)."""
        model.capture_mode = {"none": "none", "list": "list", "list+pass": "list",
                              "packer": "packer", "packer+aux_out": "packer"}[variant]
        if execution == "module":
            return model, None
        inner = {"eager": "eager", "aot_eager": "aot_eager", "inductor": "inductor",
                 "inductor-ro": "inductor", "runner": "eager"}[execution]
        mode = "reduce-overhead" if execution == "inductor-ro" else None
        backend = aux_capture_backend(inner, rewrite=variant == "list+pass", mode=mode)
        torch._dynamo.reset()
        return torch.compile(model, backend=backend, dynamic=True, fullgraph=True), backend

    def run_execution(self, name: str, model: LlamaModel, execution: str,
                      references: Dict[Tuple[str, int], Output]) -> None:
        packed_width = model.num_captures * model.config.hidden_size
        elem = torch.finfo(self.dtype).bits // 8
        none_peak: Dict[int, int] = {}
        for variant in VARIANTS[execution]:
            if self.args.variants and variant not in self.args.variants.split(","):
                continue
            if self.over_budget():
                self.skipped.append(f"{name}/{execution}/{variant}")
                print(f"budget of {self.args.budget_s} s spent: skipping {name}/{execution}/{variant}", flush=True)
                continue
            compile_start = time.perf_counter()
            skips_before = counters["inductor"]["cudagraph_skips"]
            fn, backend = self.fn_for(model, execution, variant)
            buf = self.static_buffer(model) if variant == "packer+aux_out" else None
            for tokens in self.tokens:
                ids, pos = self.inputs(model, tokens)
                row = self.measure(execution, variant, fn, ids, pos, buf, packed_width, skips_before)
                packed = tokens * packed_width * elem
                if variant == "none":
                    none_peak[tokens] = row["peak_bytes"]
                reference_key = ("inductor" if execution == "inductor" else
                                 "inductor-ro" if execution == "inductor-ro" else "module", tokens)
                result = row.pop("result")
                if variant == "list" and reference_key[0] == execution:
                    references[reference_key] = _clone(result)
                equal = None if variant == "none" else _equal(result, references.get(reference_key))
                del result
                groups = [g for r in backend.results for g in r.groups] if backend is not None else []
                self.add({
                    "model": name, "tokens": tokens, "layers": model.config.num_layers,
                    "hidden": model.config.hidden_size, "k": model.num_captures,
                    "dtype": self.args.dtype, "device": self.device, "execution": execution,
                    "variant": variant, "packed_bytes": packed,
                    "overhead": (row["peak_bytes"] - none_peak.get(tokens, 0)) / packed,
                    "bitwise_equal": equal,
                    "reference": f"{reference_key[0]} list" if variant != "none" else None,
                    "static_buffer_bytes": None if buf is None else buf.numel() * elem,
                    "groups_rewritten": sum(g.decision.value == "rewrite" for g in groups) if groups else None,
                    "compile_and_run_seconds": time.perf_counter() - compile_start,
                    "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips_before,
                    **row,
                })
            del fn, backend, buf
            gc.collect()
            torch._dynamo.reset()
            if self.device == "cuda":
                torch.cuda.empty_cache()

    def measure(self, execution: str, variant: str, fn: Callable[..., Any], ids: torch.Tensor,
                pos: torch.Tensor, buf: Optional[torch.Tensor], packed_width: int,
                skips_before: int = 0) -> Dict[str, Any]:
        kwargs = {} if buf is None else {"aux_out": buf}
        if execution == "runner":
            fn(ids, pos, **kwargs)  # compile (if compiled) outside the measurement
            _sync(self.device)
            runner_box: List[CudaGraphRunner] = []

            def construct(_anchor: torch.Tensor) -> None:  # the anchor selects the device
                runner_box.append(CudaGraphRunner(
                    fn, [ids.shape[0]], (ids[:1], pos[:1]),
                    packed_width=packed_width if buf is not None else None,
                    packed_dtype=self.dtype if buf is not None else None,
                    measure_capture_memory=True))

            construct_peak = measure_peak(construct, ids).bytes
            runner = runner_box[0]
            tokens = ids.shape[0]
            # CUDA: the peak while the graph was recorded (the pool it needs); CPU: the
            # construction's (one direct call, the static packed buffer included)
            peak = runner.capture_peak_bytes.get(tokens, construct_peak)
            replay = measure_peak(runner, ids, pos)
            result = _clone(_packed(replay.result))
            note = (("CUDA graph, peak while recording" if runner.use_cuda_graphs
                     else "no CUDA graph (CPU), peak of construction")
                    + f", warm-up + capture {runner.capture_seconds[tokens]:.1f} s")
            replay_bytes = replay.bytes
            del runner_box, runner, replay
            return {"peak_bytes": peak, "replay_peak_bytes": replay_bytes, "result": result,
                    "construct_peak_bytes": construct_peak, "note": note}
        if execution == "inductor-ro":
            def step(_anchor: torch.Tensor) -> Output:
                if self.device == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                return _packed(fn(ids, pos, **kwargs))

            step(ids)  # warm-up: cudagraph trees record on the second call at a shape
            record = measure_peak(step, ids)
            record_bytes, result = record.bytes, _clone(record.result)
            del record
            replay = measure_peak(step, ids)
            replay_bytes = replay.bytes
            del replay
            note = f"cudagraph_skips since this compile: {counters['inductor']['cudagraph_skips'] - skips_before}"
            return {"peak_bytes": record_bytes, "replay_peak_bytes": replay_bytes, "result": result,
                    "note": note}
        _packed(fn(ids, pos, **kwargs))  # compile / warm up at this size
        _sync(self.device)
        peak = measure_peak(lambda _anchor: _packed(fn(ids, pos, **kwargs)), ids)
        return {"peak_bytes": peak.bytes, "replay_peak_bytes": None, "result": _clone(peak.result)}


def run_plan(names: List[str], executions: List[str]) -> List[Tuple[str, str]]:
    """(model, execution) pairs in priority order, so a time budget cuts the least wanted:
    the executions without Inductor for every model, then each model's Inductor executions
    (reduce-overhead first), then aot_eager."""
    cheap = [e for e in ("module", "eager", "runner") if e in executions]
    inductor = [e for e in ("inductor-ro", "inductor") if e in executions]
    rest = [e for e in executions if e not in cheap and e not in inductor]
    return ([(n, e) for e in cheap for n in names] + [(n, e) for n in names for e in inductor]
            + [(n, e) for e in rest for n in names])


def format_markdown(saved: Dict[str, Any]) -> str:
    """A saved run as a markdown table (one row per model, execution, variant and T), then
    what the time budget skipped."""
    table = _report.markdown_table(
        ("model", "T", "execution", "capture", "peak MiB", "packed MiB", "overhead", "bitwise",
         "replay peak MiB", "note"),
        [(r["model"], r["tokens"], r["execution"], r["variant"], f"{r['peak_bytes'] / 2**20:.1f}",
          f"{r['packed_bytes'] / 2**20:.1f}", f"{r['overhead']:.2f}", _report.yes_no(r["bitwise_equal"]),
          "" if r.get("replay_peak_bytes") is None else f"{r['replay_peak_bytes'] / 2**20:.1f}",
          r.get("note", "")) for r in saved["rows"]])
    if saved.get("skipped"):
        table += f"\n\nSkipped (time budget): {', '.join(saved['skipped'])}"
    return table


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--config", default="8b", choices=("8b", "tiny", "capture_dominated"))
    parser.add_argument("--models", default="llama,dflash")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--executions", default=",".join(EXECUTIONS))
    parser.add_argument("--variants", default=None,
                        help="comma list: run only these capture variants (default: all of each execution)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="start no new (execution, variant) after this many seconds")
    _report.add_output_args(parser, out_help="JSON file, rewritten after every row",
                            render_help="print a saved run as a markdown table, run nothing")
    args = parser.parse_args(argv)
    if args.render:
        return _report.render(args.render, "python benchmarks/gpu_capture_memory.py", format_markdown,
                              details=lambda saved: [saved["device_name"]])
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    executions = args.executions.split(",")
    unknown = sorted(set(executions) - set(EXECUTIONS))
    if unknown:
        parser.error(f"unknown executions {unknown}; choose from {', '.join(EXECUTIONS)}")
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass's records
    bench = Bench(args)
    configs = model_configs(args.config, args.layers)
    names = args.models.split(",")
    for name in names:
        if name not in configs:
            parser.error(f"unknown model {name!r}; choose from {', '.join(configs)}")
    with torch.no_grad():
        built = {name: build(configs[name], args.device, bench.dtype) for name in names}
        references: Dict[str, Dict[Tuple[str, int], Output]] = {name: {} for name in names}
        for name, execution in run_plan(names, executions):
            bench.run_execution(name, built[name], execution, references[name])
        del built, references
    gc.collect()
    bench.save()
    print(f"\n{len(bench.rows)} rows in {time.perf_counter() - bench.start:.0f} s"
          + (f"; skipped (budget): {', '.join(bench.skipped)}" if bench.skipped else "")
          + (f"; wrote {args.out}" if args.out else ""))
    bad = [r for r in bench.rows if r["bitwise_equal"] is False]
    for r in bad:
        print(f"NOT bitwise equal: {r['model']} T={r['tokens']} {r['execution']} {r['variant']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
