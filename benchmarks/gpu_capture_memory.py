"""GPU peak memory of aux-hidden-state capture at real hidden sizes, every execution mode.

Llama-3.1-8B dimensions (hidden 4096, intermediate 14336, GQA 32/8, vocab 128256) cut to a
few layers, bf16, at thousands of tokens, on one CUDA device; models ``llama`` (K=3
captures) and ``dflash`` (K=5). Executions:

- ``module``: the model run uncompiled: capture modes none / list (``torch.cat``) /
  packer / packer writing into a static ``aux_out`` buffer (``packer+aux_out``);
- ``eager``, ``inductor``, ``aot_eager``: ``torch.compile(dynamic=True)`` with the
  ``aux_capture`` backend object (not the entry-point name: works without pip install):
  list path with the pass off (``list``) and on (``list+pass``), the static buffer, the
  packer;
- ``inductor-ro``: the inductor inner with ``mode="reduce-overhead"`` (cudagraph trees);
- ``runner``: one ``compile_pass.cudagraph.CudaGraphRunner`` per variant, capturing a CUDA
  graph at every ``--runner-tokens`` count in one memory pool around the ``eager``
  execution's compiled model (the Dynamo graph run as is, rewritten for ``list+pass``);
  ``packer+aux_out`` gives every size's graph the same static packed buffer. Its rows are
  the captured counts plus one count between two of them (padded to the next).

Rows (model, execution, variant, T) run in this order, so a time budget cuts the least
wanted: the Inductor list path against the pass (``STAGES[0]``: the point of the project),
then the runner at several token counts sharing one static buffer, then the baselines and
the rest. One compile per (model, execution, variant) serves every token count (dynamic
shapes); its first row pays for it. ``list+pass`` rows compile with ``cost_model=False``
except under the inductor inner (``--cost-model auto``): at the 8B sizes the cost model
rejects every group of the eager, aot_eager and runner graphs, and a row that rewrites
nothing would measure nothing. Each such row records whether the graph that ran it was
rewritten: ``rewritten``, ``groups_found`` / ``groups_rewritten`` and ``groups`` (the
rewritten ones and the model's K-capture group, with the cost model's estimates) describe
the compile serving the row, not a sum over recompiles; every row has ``compiles_in_row``
(Dynamo graphs compiled during it).

Every row runs in try/except: an error is recorded in the row (``error``, ``traceback``)
and the next row runs. Before a row starts, its cost is estimated (the mean duration of the
finished rows of its kind: same execution, compiling or not; otherwise of any execution,
compiling or not) and the row is skipped (listed in ``skipped``) if it would end past
``--budget-s``. The JSON is rewritten after every row; SIGINT or SIGTERM stop the run
with a final save (``interrupted``). ``--simulate-failure PATTERN`` (or the environment
variable ``COMPILE_PASS_SIMULATE_FAILURE``) makes the rows whose name
(``model/execution/variant/T``) matches the fnmatch pattern raise, to test all that.

Measured, on CUDA (the caching allocator's statistics, ``torch.cuda.memory_stats``, after
``gc.collect()`` and ``torch.cuda.empty_cache()``, peaks reset before the call), each above
the value at the start of the call: ``peak_bytes`` (``allocated_bytes.all.peak``, what
``max_memory_allocated`` and ``compile_pass.memory.measure_peak`` report: allocator blocks,
rounded up, a whole unsplit block counted), ``requested_peak_bytes``
(``requested_bytes.all.peak``: the bytes the tensors asked for) and ``reserved_peak_bytes``
(``reserved_bytes.all.peak``: what the allocator took from the driver). On CPU only
``peak_bytes``, from the profiler's allocation events (``measure_peak``).

A CUDA-graph replay allocates nothing; what matters is what the graph's private pool holds:
``runner`` rows report the peak while the ``P``-token graph was recorded
(``capture_peak_bytes`` / ``capture_requested_peak_bytes``, after warm-up) as their peak,
and ``pool_reserved_bytes``: the bytes of the segments owned by the runner's pool once
every size is captured (``torch.cuda.memory_snapshot``; one number for all of that runner's
rows). ``inductor-ro`` rows report the recording call (the second call at a size) and
``pool_reserved_bytes``: all private-pool segments after it (``pool_growth_bytes``: this
row's share). ``replay_peak_bytes``: the replay's own peak. On CPU the runner calls the
function directly (no graph): its peak is that call's.

Derived on every save: ``overhead`` = (peak - peak of variant none, same execution and T) /
packed bytes (``overhead_requested`` from the requested peaks), and for ``list+pass`` rows
``peak_minus_list_bytes`` (and the requested one): the pass against the list path. The
``packer+aux_out`` rows allocate the static buffer (``static_buffer_bytes``) before the
call, so it is not in their peak. Bitwise: against the module list path (Inductor
executions: their own list path; runner rows: the module list path at the padded size,
sliced).

    python benchmarks/gpu_capture_memory.py --out bench-results/gpu_capture_memory.json
    python benchmarks/gpu_capture_memory.py --device cpu --config tiny --layers 3 --tokens 64,128 \\
        --runner-tokens 32,64,128 --dtype float32                     # dry run on CPU
    python benchmarks/gpu_capture_memory.py --render bench-results/gpu_capture_memory.json
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

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
#: the capture variants of each execution
VARIANTS = {
    "module": ("none", "list", "packer", "packer+aux_out"),
    "eager": ("none", "list", "list+pass", "packer+aux_out", "packer"),
    "runner": ("none", "list", "list+pass", "packer+aux_out"),
    "inductor": ("none", "list", "list+pass", "packer+aux_out", "packer"),
    "inductor-ro": ("none", "list", "list+pass"),
    "aot_eager": ("none", "list", "list+pass", "packer+aux_out", "packer"),
}
#: the order rows run in, per stage every model: what proves the point first, so that a
#: time budget cuts the least wanted rows
STAGES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("inductor", ("list", "list+pass")),                   # the pass under Inductor
    ("runner", ("packer+aux_out", "list", "list+pass")),   # CUDA graphs, sizes, one buffer
    ("inductor", ("none", "packer+aux_out", "packer")),
    ("eager", ("list", "list+pass", "none", "packer+aux_out", "packer")),
    ("inductor-ro", ("list", "list+pass", "none")),
    ("module", ("none", "list", "packer", "packer+aux_out")),
    ("runner", ("none",)),
    ("aot_eager", ("list", "list+pass", "none", "packer+aux_out", "packer")),
)
CAPTURE_MODE = {"none": "none", "list": "list", "list+pass": "list", "packer": "packer",
                "packer+aux_out": "packer"}
INNER = {"eager": "eager", "aot_eager": "aot_eager", "inductor": "inductor",
         "inductor-ro": "inductor", "runner": "eager"}
SIMULATE_ENV = "COMPILE_PASS_SIMULATE_FAILURE"

Output = Tuple[torch.Tensor, Optional[torch.Tensor]]


class RowSpec(NamedTuple):
    model: str
    execution: str
    variant: str
    tokens: int
    #: runner rows: the captured token count the row replays (``tokens`` padded up)
    padded: Optional[int] = None

    @property
    def name(self) -> str:
        return f"{self.model}/{self.execution}/{self.variant}/{self.tokens}"


class SimulatedFailure(RuntimeError):
    """Raised by a row that ``--simulate-failure`` names."""


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


def runner_rows(captured: List[int]) -> List[Tuple[int, int]]:
    """(real tokens, captured size replayed) per runner row: every captured size, and one
    count between the two smallest (or below the only one), padded to the next size."""
    captured = sorted(captured)
    rows = [(t, t) for t in captured]
    if len(captured) >= 2:
        between = captured[1] - max(1, (captured[1] - captured[0]) // 2)
        if between not in captured:
            rows.append((between, captured[1]))
    elif captured[0] > 1:
        rows.append(((captured[0] + 1) // 2, captured[0]))
    return sorted(rows)


def plan(names: List[str], executions: List[str], variants: Optional[List[str]],
         tokens: List[int], captured: List[int]) -> List[RowSpec]:
    """Every row, in the order run (``STAGES``, then each model, variant and T)."""
    specs: List[RowSpec] = []
    for execution, stage_variants in STAGES:
        if execution not in executions:
            continue
        for name in names:
            for variant in stage_variants:
                if variants is not None and variant not in variants:
                    continue
                if execution == "runner":
                    specs += [RowSpec(name, execution, variant, t, p) for t, p in runner_rows(captured)]
                else:
                    specs += [RowSpec(name, execution, variant, t) for t in tokens]
    return specs


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


def _padded_inputs(ids: torch.Tensor, pos: torch.Tensor, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ids`` and ``pos`` padded with zeros to ``size`` rows, as the runner pads them."""
    pad = size - ids.shape[0]
    if pad == 0:
        return ids, pos
    return torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, pos.new_zeros(pad)])


def private_pool_bytes(pool: Any = None) -> int:
    """Bytes of the CUDA segments owned by graph pool ``pool`` (a
    ``torch.cuda.graph_pool_handle()``), or by any private pool when None: the memory CUDA
    graphs keep for themselves (``torch.cuda.memory_snapshot``'s ``segment_pool_id``)."""
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # a release without the keyword
        segments = torch.cuda.memory_snapshot()
    total = 0
    for segment in segments:
        owner = tuple(segment["segment_pool_id"])
        if (pool is None and owner != (0, 0)) or (pool is not None and owner == tuple(pool)):
            total += int(segment["total_size"])
    return total


@dataclass
class _Active:
    """What the rows of one (model, execution, variant) share: the compiled callable, its
    backend, the static buffer, the runner; dropped when the next variant starts."""

    key: Tuple[str, str, str]
    fn: Callable[..., Any]
    backend: Any
    buf: Optional[torch.Tensor]
    runner: Optional[CudaGraphRunner] = None
    #: the groups of the latest compile (the graph serving the rows since)
    groups: List[Any] = field(default_factory=list)
    runner_fields: Dict[str, Any] = field(default_factory=dict)
    skips_before: float = 0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device: str = args.device
        self.dtype = getattr(torch, args.dtype)
        self.elem = torch.finfo(self.dtype).bits // 8
        self.tokens = [int(t) for t in args.tokens.split(",")]
        self.runner_tokens = sorted(int(t) for t in args.runner_tokens.split(","))
        self.rows: List[Dict[str, Any]] = []
        self.skipped: List[Dict[str, Any]] = []
        self.start = time.perf_counter()
        self.durations: Dict[Tuple[str, bool], List[float]] = {}
        self.active: Optional[_Active] = None
        self.models: Dict[str, LlamaModel] = {}
        self.build_errors: Dict[str, str] = {}
        #: (model, reference kind, T, padded size) -> (hidden, packed aux)
        self.references: Dict[Tuple[str, str, int, int], Output] = {}
        self.interrupted = False
        self.complete = False

    # ------------------------------------------------------------------ output

    def device_info(self) -> Dict[str, Any]:
        if self.device != "cuda":
            return {"name": "cpu"}
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"name": props.name, "capability": f"{props.major}.{props.minor}",
                "total_memory_bytes": props.total_memory}

    def save(self) -> None:
        derive(self.rows)
        if not self.args.out:
            return
        _report.write_json(self.args.out, {
            "device": self.device,
            "device_name": self.device_info()["name"], "device_info": self.device_info(),
            "seconds": time.perf_counter() - self.start, "budget_s": self.args.budget_s,
            "complete": self.complete, "interrupted": self.interrupted,
            "simulate_failure": self.args.simulate_failure, "build_errors": self.build_errors,
            "skipped": self.skipped, "rows": self.rows})

    def add(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        self.save()
        r = row
        if r.get("error"):
            print(f"{r['name']:40} ERROR after {r['seconds']:.1f} s: {r['error']}", flush=True)
            return
        print(f"{r['name']:40} peak {_mib(r.get('peak_bytes')):>9} MiB  requested "
              f"{_mib(r.get('requested_peak_bytes')):>9}  packed {_mib(r['packed_bytes']):>8}  "
              f"equal {_report.yes_no(r.get('bitwise_equal')):3}  {r['seconds']:6.1f} s  "
              f"{r.get('note', '')}", flush=True)

    # ------------------------------------------------------------------ budget

    def estimate(self, execution: str, compiles: bool) -> float:
        """Seconds a row is expected to take: the mean of the finished rows of its kind
        (same execution, compiling or not), else of any execution's rows that compile (or
        not), else 0 (nothing to go by: it starts)."""
        same = self.durations.get((execution, compiles))
        if same:
            return sum(same) / len(same)
        alike = [d for (_, c), ds in self.durations.items() if c == compiles for d in ds]
        return sum(alike) / len(alike) if alike else 0.0

    # ------------------------------------------------------------------ rows

    def run_row(self, spec: RowSpec) -> None:
        key = (spec.model, spec.execution, spec.variant)
        compiles = self.active is None or self.active.key != key
        estimate = self.estimate(spec.execution, compiles)
        elapsed = time.perf_counter() - self.start
        if elapsed + estimate > self.args.budget_s:
            self.skipped.append({"row": spec.name, "estimated_seconds": round(estimate, 2),
                                 "elapsed_seconds": round(elapsed, 2)})
            print(f"{spec.name:40} skipped: {elapsed:.0f} s elapsed + {estimate:.0f} s estimated "
                  f"> budget {self.args.budget_s:.0f} s", flush=True)
            self.save()
            return
        model = self.models.get(spec.model)
        row: Dict[str, Any] = {
            "name": spec.name, "model": spec.model, "tokens": spec.tokens,
            "execution": spec.execution, "variant": spec.variant, "dtype": self.args.dtype,
            "device": self.device,
        }
        if model is not None:
            width = model.num_captures * model.config.hidden_size
            row.update(layers=model.config.num_layers, hidden=model.config.hidden_size,
                       k=model.num_captures, packed_bytes=spec.tokens * width * self.elem)
        start = time.perf_counter()
        try:
            if model is None:
                raise RuntimeError(f"building model {spec.model!r} failed: {self.build_errors.get(spec.model)}")
            if self.args.simulate_failure and fnmatch.fnmatchcase(spec.name, self.args.simulate_failure):
                raise SimulatedFailure(f"simulated failure of row {spec.name} "
                                       f"(--simulate-failure {self.args.simulate_failure!r})")
            row.update(self.measure_row(spec, model))
        except Exception as e:  # noqa: BLE001: recorded in the row, the next row runs
            row["error"] = f"{type(e).__name__}: {e}"[:4000]
            row["traceback"] = traceback.format_exc()[-8000:]
            self.release()
        row["seconds"] = time.perf_counter() - start
        row["estimated_seconds"] = estimate
        row["compiled_in_row"] = compiles
        self.durations.setdefault((spec.execution, compiles), []).append(row["seconds"])
        self.add(row)

    def release(self) -> None:
        """Drop the compiled state of the last variant (and its graphs' pool)."""
        self.active = None
        gc.collect()
        torch._dynamo.reset()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def activate(self, spec: RowSpec, model: LlamaModel) -> _Active:
        key = (spec.model, spec.execution, spec.variant)
        if self.active is not None and self.active.key == key:
            return self.active
        if self.active is not None:
            self.release()
        model.capture_mode = CAPTURE_MODE[spec.variant]
        fn: Callable[..., Any] = model
        backend = None
        if spec.execution != "module":
            mode = "reduce-overhead" if spec.execution == "inductor-ro" else None
            backend = aux_capture_backend(INNER[spec.execution], rewrite=spec.variant == "list+pass",
                                          cost_model=self.cost_model(spec), mode=mode)
            torch._dynamo.reset()
            fn = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
        buf = None
        if spec.variant == "packer+aux_out":
            rows = max(self.runner_tokens) if spec.execution == "runner" else max(self.tokens)
            buf = torch.zeros(rows, model.num_captures * model.config.hidden_size,
                              dtype=self.dtype, device=self.device)
            torch._dynamo.mark_static(buf)  # one symbol for T, not shared with the buffer's rows
        self.active = _Active(key, fn, backend, buf,
                              skips_before=counters["inductor"]["cudagraph_skips"])
        return self.active

    def cost_model(self, spec: RowSpec) -> bool:
        """The backend's ``cost_model`` for a row's compile (``--cost-model``)."""
        if spec.variant != "list+pass" or self.args.cost_model == "on":
            return True
        if self.args.cost_model == "off":
            return False
        return spec.execution == "inductor"

    def inputs(self, model: LlamaModel, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g).to(self.device)
        return ids, torch.arange(tokens, device=self.device)

    def module_reference(self, name: str, model: LlamaModel, ids: torch.Tensor, pos: torch.Tensor,
                         padded: int) -> Output:
        """The uncompiled model's list path at ``padded`` tokens (zero padding), sliced to
        the real count; cached. Restores the model's capture mode (compiled callables guard
        on it)."""
        tokens = ids.shape[0]
        key = (name, "module", tokens, padded)
        if key not in self.references:
            mode = model.capture_mode
            model.capture_mode = "list"
            try:
                hidden, aux = _packed(model(*_padded_inputs(ids, pos, padded)))
            finally:
                model.capture_mode = mode
            assert aux is not None
            self.references[key] = (hidden[:tokens].clone(), aux[:tokens].clone())
        return self.references[key]

    def measure(self, call: Callable[[], Any], anchor: torch.Tensor) -> Tuple[Dict[str, Any], Any]:
        """Peaks of one ``call()`` above the values at its start, and its result (module
        docstring). CPU: the profiler's allocations, ``peak_bytes`` only."""
        if self.device != "cuda":
            peak = measure_peak(lambda _anchor: call(), anchor)
            return {"peak_bytes": peak.bytes, "requested_peak_bytes": None,
                    "reserved_peak_bytes": None}, peak.result
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        result = call()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()

        def above(stat: str) -> Optional[int]:
            peak, current = after.get(f"{stat}.all.peak"), before.get(f"{stat}.all.current")
            return None if peak is None or current is None else int(peak - current)

        return {"peak_bytes": above("allocated_bytes"), "requested_peak_bytes": above("requested_bytes"),
                "reserved_peak_bytes": above("reserved_bytes")}, result

    def measure_row(self, spec: RowSpec, model: LlamaModel) -> Dict[str, Any]:
        graphs_before = counters["stats"]["unique_graphs"]
        active = self.activate(spec, model)
        results_before = len(active.backend.results) if active.backend is not None else 0
        ids, pos = self.inputs(model, spec.tokens)
        if spec.execution == "runner":
            fields = self.measure_runner(spec, model, active, ids, pos)
        elif spec.execution == "inductor-ro":
            fields = self.measure_reduce_overhead(active, ids, pos)
        else:
            kwargs = {} if active.buf is None else {"aux_out": active.buf}
            _packed(active.fn(ids, pos, **kwargs))  # compile / warm up at this size
            _sync(self.device)
            fields, result = self.measure(lambda: _packed(active.fn(ids, pos, **kwargs)), ids)
            fields["result"] = _clone(result)
            del result
        result = fields.pop("result")
        fields.update(self.compare(spec, model, ids, pos, result))
        del result
        fields["compiles_in_row"] = counters["stats"]["unique_graphs"] - graphs_before
        if active.backend is not None:
            new = active.backend.results[results_before:]
            if new:
                active.groups = [g for r in new for g in r.groups]
            if spec.variant == "list+pass":
                fields["cost_model"] = active.backend.cost_model
                rewritten = [g for g in active.groups if g.decision.value == "rewrite"]
                fields["rewritten"] = bool(rewritten)
                fields["groups_found"] = len(active.groups)
                fields["groups_rewritten"] = len(rewritten)
                # the rewritten groups and the model's own capture group (K captures), if not
                fields["groups"] = [_group_fields(g) for g in active.groups
                                    if g.decision.value == "rewrite" or g.k == model.num_captures]
                if not fields["rewritten"]:
                    fields["note"] = (fields.get("note", "") + "; " if fields.get("note") else "") + \
                        "no group rewritten: this row measures the list path"
        if active.buf is not None:
            fields["static_buffer_bytes"] = active.buf.numel() * self.elem
        return fields

    def compare(self, spec: RowSpec, model: LlamaModel, ids: torch.Tensor, pos: torch.Tensor,
                result: Output) -> Dict[str, Any]:
        """Bitwise equality against the row's reference (module docstring)."""
        if spec.variant == "none":
            return {"bitwise_equal": None, "reference": None}
        if spec.execution in ("inductor", "inductor-ro"):
            key = (spec.model, spec.execution, spec.tokens, spec.tokens)
            if spec.variant == "list":
                self.references[key] = result
                return {"bitwise_equal": None, "reference": "(the reference)"}
            return {"bitwise_equal": _equal(result, self.references.get(key)),
                    "reference": f"{spec.execution} list"}
        padded = spec.padded or spec.tokens
        reference = self.module_reference(spec.model, model, ids, pos, padded)
        about = "module list" + (f" at {padded} tokens, sliced" if padded != spec.tokens else "")
        return {"bitwise_equal": _equal(result, reference), "reference": about}

    def measure_reduce_overhead(self, active: _Active, ids: torch.Tensor,
                                pos: torch.Tensor) -> Dict[str, Any]:
        kwargs = {} if active.buf is None else {"aux_out": active.buf}

        def step() -> Output:
            if self.device == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            return _packed(active.fn(ids, pos, **kwargs))

        step()  # warm-up: cudagraph trees record on the second call at a shape
        _sync(self.device)
        pool_before = private_pool_bytes() if self.device == "cuda" else None
        fields, record = self.measure(step, ids)
        fields["result"] = _clone(record)
        del record
        if pool_before is not None:
            pool_after = private_pool_bytes()
            fields["pool_reserved_bytes"] = pool_after
            fields["pool_growth_bytes"] = pool_after - pool_before
        replay, replayed = self.measure(step, ids)
        del replayed
        fields["replay_peak_bytes"] = replay["peak_bytes"]
        skips = counters["inductor"]["cudagraph_skips"] - active.skips_before
        fields["cudagraph_skips"] = skips
        fields["note"] = f"peak of the recording call; cudagraph_skips since this compile: {skips}"
        return fields

    def measure_runner(self, spec: RowSpec, model: LlamaModel, active: _Active, ids: torch.Tensor,
                       pos: torch.Tensor) -> Dict[str, Any]:
        cuda = self.device == "cuda"
        if active.runner is None:
            # one runner per variant: every captured size in one pool, one static buffer
            pool_before = private_pool_bytes() if cuda else None
            start = time.perf_counter()
            active.runner = CudaGraphRunner(active.fn, self.runner_tokens, (ids[:1], pos[:1]),
                                            packed_out=active.buf, measure_capture_memory=cuda)
            _sync(self.device)
            active.runner_fields = {"construct_seconds": time.perf_counter() - start,
                                    "captured_tokens": list(active.runner.token_counts)}
            if active.runner.use_cuda_graphs:
                pool = private_pool_bytes(active.runner.pool)
                active.runner_fields.update(pool_reserved_bytes=pool,
                                            pool_growth_bytes=private_pool_bytes() - pool_before)
        runner = active.runner
        padded = runner.padded_size(spec.tokens)
        fields, out = self.measure(lambda: _packed(runner(ids, pos)), ids)
        in_buffer = None if active.buf is None else bool(out[1].data_ptr() == active.buf.data_ptr())
        fields["result"] = _clone(out)
        del out
        fields.update(active.runner_fields, padded_tokens=padded,
                      capture_seconds=runner.capture_seconds.get(padded),
                      replay_peak_bytes=fields["peak_bytes"])
        if in_buffer is not None:
            fields["aux_in_static_buffer"] = in_buffer
        if runner.use_cuda_graphs:
            fields["capture_peak_bytes"] = runner.capture_peak_bytes.get(padded)
            fields["capture_requested_peak_bytes"] = runner.capture_requested_peak_bytes.get(padded)
            fields["peak_bytes"] = fields["capture_peak_bytes"]
            fields["requested_peak_bytes"] = fields["capture_requested_peak_bytes"]
            fields["reserved_peak_bytes"] = None
            fields["note"] = (f"CUDA graph: peak while recording the {padded}-token graph; pool: "
                              f"{len(runner.token_counts)} sizes")
        else:
            fields["note"] = f"no CUDA graph ({self.device}): peak of the direct call at {padded} tokens"
        return fields


def _group_fields(group: Any) -> Dict[str, Any]:
    return {"k": group.k, "decision": group.decision.value, "reason": group.reason,
            "placement": group.placement, "estimated_peak_before": group.estimated_peak_before,
            "estimated_peak_after": group.estimated_peak_after}


def _mib(value: Optional[float]) -> str:
    return "" if value is None else f"{value / 2**20:.1f}"


def derive(rows: List[Dict[str, Any]]) -> None:
    """Fill in each row's ``overhead`` (against variant none, same model, execution and T)
    and, for ``list+pass`` rows, the difference with the list path; rows may come in any
    order, so this runs before every save."""
    ok = {(r["model"], r["execution"], r["variant"], r["tokens"]): r for r in rows if not r.get("error")}
    for r in rows:
        if r.get("error") or r.get("peak_bytes") is None:
            continue
        none = ok.get((r["model"], r["execution"], "none", r["tokens"]))
        for key, stat in (("overhead", "peak_bytes"), ("overhead_requested", "requested_peak_bytes")):
            value = None
            if none is not None and r.get(stat) is not None and none.get(stat) is not None and r["packed_bytes"]:
                value = (r[stat] - none[stat]) / r["packed_bytes"]
            r[key] = value
        if r["variant"] == "list+pass":
            listed = ok.get((r["model"], r["execution"], "list", r["tokens"]))
            for key, stat in (("peak_minus_list_bytes", "peak_bytes"),
                              ("requested_peak_minus_list_bytes", "requested_peak_bytes")):
                r[key] = (r[stat] - listed[stat] if listed is not None and r.get(stat) is not None
                          and listed.get(stat) is not None else None)


def format_markdown(saved: Dict[str, Any]) -> str:
    """A saved run as a markdown table (one row per model, execution, variant and T), then
    the rows the time budget skipped."""

    def overhead(value: Optional[float]) -> str:
        return "" if value is None else f"{value:.2f}"

    table = _report.markdown_table(
        ("model", "T", "execution", "capture", "peak MiB", "requested MiB", "overhead",
         "vs list MiB", "pool MiB", "rewritten", "bitwise", "note"),
        [(r["model"], r["tokens"], r["execution"], r["variant"], _mib(r.get("peak_bytes")),
          _mib(r.get("requested_peak_bytes")), overhead(r.get("overhead")),
          _mib(r.get("peak_minus_list_bytes")), _mib(r.get("pool_reserved_bytes")),
          _report.yes_no(r.get("rewritten")), _report.yes_no(r.get("bitwise_equal")),
          ("ERROR " + r["error"].splitlines()[0]) if r.get("error") else r.get("note", ""))
         for r in saved["rows"]])
    if saved.get("skipped"):
        table += "\n\nSkipped (time budget): " + ", ".join(
            s["row"] if isinstance(s, dict) else str(s) for s in saved["skipped"])
    return table


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--config", default="8b", choices=("8b", "tiny", "capture_dominated"))
    parser.add_argument("--models", default="llama,dflash")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--runner-tokens", default="1024,4096,16384",
                        help="token counts the runner captures (one graph each, one pool, one buffer)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--executions", default=",".join(EXECUTIONS))
    parser.add_argument("--variants", default=None,
                        help="comma list: run only these capture variants (default: all of each execution)")
    parser.add_argument("--cost-model", default="auto", choices=("auto", "on", "off"),
                        help="the backend's cost model for list+pass rows (auto: on for the inductor "
                             "inner only, where it rewrites at the 8B sizes)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="start no row whose estimated cost would end it past this many seconds")
    parser.add_argument("--simulate-failure", default=os.environ.get(SIMULATE_ENV) or None, metavar="PATTERN",
                        help=f"rows named like PATTERN (fnmatch on model/execution/variant/T) raise "
                             f"(default: ${SIMULATE_ENV})")
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
    variants = args.variants.split(",") if args.variants else None
    known_variants = {v for vs in VARIANTS.values() for v in vs}
    if variants is not None and set(variants) - known_variants:
        parser.error(f"unknown variants {sorted(set(variants) - known_variants)}; "
                     f"choose from {', '.join(sorted(known_variants))}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        captured = [int(t) for t in args.runner_tokens.split(",")]
    except ValueError as e:
        parser.error(f"--tokens and --runner-tokens take comma-separated ints: {e}")
    if min(tokens + captured) < 1 or len(set(captured)) != len(captured):
        parser.error("token counts must be >= 1 and --runner-tokens without duplicates")
    configs = model_configs(args.config, args.layers)
    names = args.models.split(",")
    for name in names:
        if name not in configs:
            parser.error(f"unknown model {name!r}; choose from {', '.join(configs)}")
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass's records
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)  # a final save, as on SIGINT
    bench = Bench(args)
    specs = plan(names, executions, variants, tokens, captured)
    print(f"{len(specs)} rows planned, budget {args.budget_s:.0f} s", flush=True)
    try:
        with torch.no_grad():
            for name in names:
                try:
                    bench.models[name] = build(configs[name], args.device, bench.dtype)
                except Exception as e:  # noqa: BLE001: its rows record the error
                    bench.build_errors[name] = f"{type(e).__name__}: {e}"
            for spec in specs:
                bench.run_row(spec)
        bench.complete = True
    except KeyboardInterrupt as e:
        bench.interrupted = True
        print(f"\ninterrupted ({e or 'SIGINT'}): saving the {len(bench.rows)} rows measured", flush=True)
    finally:
        bench.active = None
        bench.models.clear()
        bench.references.clear()
        bench.save()
        signal.signal(signal.SIGTERM, previous_sigterm)
    errors = [r for r in bench.rows if r.get("error")]
    bad = [r for r in bench.rows if r.get("bitwise_equal") is False]
    print(f"\n{len(bench.rows)} rows in {time.perf_counter() - bench.start:.0f} s"
          + (f", {len(errors)} with errors" if errors else "")
          + (f"; skipped (budget): {', '.join(s['row'] for s in bench.skipped)}" if bench.skipped else "")
          + (f"; wrote {args.out}" if args.out else ""))
    for r in bad:
        print(f"NOT bitwise equal: {r['name']}")
    for r in errors:
        print(f"ERROR in {r['name']}: {r['error'].splitlines()[0]}")
    if bench.interrupted:
        return 130
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
