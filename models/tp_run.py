"""Run the tensor-parallel Llama on N CPU ranks (gloo) and bring every rank's results back.

The parent calls :func:`run_ranks` with a list of :class:`TPCase`; it spawns ``world_size``
processes (``spawn`` start method), which meet through a ``FileStore`` file in a work directory
(no port to pick), and each rank:

1. builds the same seeded full :class:`~models.llama.LlamaModel` (:class:`ModelSpec`) and keeps
   its own shard (:func:`models.tp_llama.shard_llama`);
2. runs the TP model uncompiled on each input set (the reference its compiled runs must match);
3. per case: ``torch._dynamo.reset()``, ``torch.compile(tp, backend=aux_capture_backend(...),
   fullgraph=True, dynamic=...)``, runs every input set, and records the outputs, the backend's
   ``results`` (every capture group's decision and reason) and how many all-reduce calls each
   rewritten graph holds. An exception in a case is recorded as its traceback (and the rank stops
   there: its peers would otherwise wait in a collective);
4. writes a :class:`RankReport` to ``rank{r}.pt`` in the work directory.

The parent joins the ranks with a deadline, terminates any still running (those processes only),
and raises :class:`TPRunError` naming each rank that wrote no report with its exit code, so
assertions and failures are in the parent's process.

Inside each rank the FX graph and AOTAutograd caches are off: every rank compiles the same graph,
and a rank that hit a cache entry written by its peer would load the (already rewritten) code
without running the post-grad pass, so it would report no decisions. Inductor compiles in-process
(``compile_threads=1``) and each rank uses one intra-op thread.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "CaseReport",
    "ModelSpec",
    "RankReport",
    "TPCase",
    "TPRunError",
    "all_reduce_calls",
    "build_full",
    "run_ranks",
    "split_ops_supported",
]

log = logging.getLogger("compile_pass")

Outputs = Tuple[torch.Tensor, Optional[torch.Tensor]]

_ALL_REDUCE_CALL = re.compile(r"_c10d_functional\.all_reduce\w*(?:\.default)?\(")


#: forkserver where available: one torch import shared by all ranks (and by later runs), no
#: fork of a parent whose threads or compile workers may hold locks
_START_METHOD = "forkserver" if "forkserver" in __import__("multiprocessing").get_all_start_methods() else "spawn"


class TPRunError(RuntimeError):
    """A rank wrote no report (crashed, or was terminated at the deadline)."""


@dataclass(frozen=True)
class ModelSpec:
    """Which full model every rank builds: ``models.llama.tiny(**overrides)`` seeded ``seed``,
    capture mode ``list``, fp32; ``tokens`` gives one input set per entry (``dynamic=True``
    cases reuse one graph across them)."""

    tokens: Tuple[int, ...] = (32, 48)
    seed: int = 0
    overrides: Tuple[Tuple[str, Any], ...] = (("num_layers", 4), ("capture_layers", (1, 2, 3)))

    def __post_init__(self) -> None:
        if not self.tokens or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in self.tokens):
            raise ValueError(f"tokens must be a non-empty tuple of ints >= 1, got {self.tokens!r}")


def build_full(spec: ModelSpec) -> Tuple[torch.nn.Module, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """The seeded single-process model of ``spec`` and its input sets (one per ``spec.tokens``)."""
    import models.llama
    from models.common import example_inputs

    overrides = dict(spec.overrides)
    if "capture_layers" in overrides:
        overrides["capture_layers"] = list(overrides["capture_layers"])
    model, _ = models.llama.tiny(capture_mode="list", tokens=spec.tokens[0], seed=spec.seed, **overrides)
    inputs = [example_inputs(model.config, t, seed=spec.seed) for t in spec.tokens]
    return model, inputs


@dataclass(frozen=True)
class TPCase:
    """One compile of the TP model on every rank: ``aux_capture_backend(inner, rewrite=...,
    cost_model=..., [split_ops=...])`` with ``torch.compile(fullgraph=True, dynamic=dynamic)``."""

    name: str
    inner: str
    rewrite: bool = True
    cost_model: bool = False
    split_ops: Optional[Tuple[str, ...]] = None
    dynamic: bool = True
    #: how many of the spec's input sets to run (None: all); a static compile would recompile
    #: for a second token count
    num_inputs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_inputs is not None and (isinstance(self.num_inputs, bool)
                                            or not isinstance(self.num_inputs, int) or self.num_inputs < 1):
            raise ValueError(f"num_inputs must be None or an int >= 1, got {self.num_inputs!r}")

    def backend(self) -> Any:
        import compile_pass

        # the report counts the all-reduce calls in the code the pass saw: keep it
        kwargs: Dict[str, Any] = dict(rewrite=self.rewrite, cost_model=self.cost_model,
                                      keep_code_before=True)
        if self.split_ops is not None:
            kwargs["split_ops"] = list(self.split_ops)
        return compile_pass.aux_capture_backend(inner=self.inner, **kwargs)


@dataclass
class CaseReport:
    """What one case did on one rank: outputs per input set, and per graph the pass ran on its
    target, its groups (``k``, ``decision``, ``reason``) and its all-reduce call count."""

    name: str
    outputs: List[Outputs] = field(default_factory=list)
    targets: List[str] = field(default_factory=list)
    groups: List[List[Dict[str, Any]]] = field(default_factory=list)
    all_reduce_calls: List[int] = field(default_factory=list)
    pass_errors: List[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of compile + runs
    cpu_seconds: float = 0.0  # this process's CPU time for the same (less sensitive to a busy machine)
    error: Optional[str] = None

    def rewritten(self) -> List[Dict[str, Any]]:
        """Every group the pass rewrote, over all graphs."""
        return [g for graph in self.groups for g in graph if g["decision"] == "rewrite"]


@dataclass
class RankReport:
    """One rank's results: the uncompiled TP outputs per input set and each case's report."""

    rank: int
    world_size: int
    group_name: str = ""
    uncompiled: List[Outputs] = field(default_factory=list)
    cases: Dict[str, CaseReport] = field(default_factory=dict)
    seconds: float = 0.0
    error: Optional[str] = None


def all_reduce_calls(code: str) -> int:
    """How many ``_c10d_functional.all_reduce`` calls a graph's code holds."""
    return len(_ALL_REDUCE_CALL.findall(code))


def split_ops_supported() -> bool:
    """True if the backend accepts ``split_ops`` (constructing one with the eager inner works).

    False when that raises TypeError, ValueError or NotImplementedError naming ``split_ops``;
    any other failure propagates.
    """
    import compile_pass

    try:
        compile_pass.aux_capture_backend(inner="eager", split_ops=["_c10d_functional::all_reduce"])
    except (TypeError, ValueError, NotImplementedError) as exc:
        if "split_ops" in str(exc):
            return False
        raise
    return True


def _detach(outputs: Any) -> Outputs:
    hidden, aux = outputs
    return hidden.detach().clone(), (aux.detach().clone() if isinstance(aux, torch.Tensor) else aux)


def _run_case(case: TPCase, tp: torch.nn.Module, inputs: List[Tuple[torch.Tensor, torch.Tensor]]) -> CaseReport:
    report = CaseReport(case.name)
    torch._dynamo.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    backend = case.backend()
    compiled = torch.compile(tp, backend=backend, fullgraph=True, dynamic=case.dynamic)
    for args in inputs[:case.num_inputs]:
        report.outputs.append(_detach(compiled(*args)))
    report.seconds = time.perf_counter() - start
    report.cpu_seconds = time.process_time() - cpu_start
    for result in backend.results:
        report.targets.append(result.target)
        report.all_reduce_calls.append(all_reduce_calls(result.code_before))
        report.groups.append([dict(k=g.k, decision=g.decision.value, reason=g.reason, placement=g.placement)
                              for g in result.groups])
        if result.error is not None:
            report.pass_errors.append(result.error)
    return report


def _configure_rank() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch.set_num_threads(1)
    inductor_config.fx_graph_cache = False
    inductor_config.compile_threads = 1
    functorch_config.enable_autograd_cache = False


def _rank_main(rank: int, world_size: int, workdir: str, spec: ModelSpec, cases: Sequence[TPCase],
               collective_timeout_s: float) -> None:
    """Entry point of one rank (module level, so the ``spawn`` start method can import it)."""
    import torch.distributed as dist

    report = RankReport(rank, world_size)
    start = time.perf_counter()
    try:
        _configure_rank()
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            from models.tp_llama import shard_llama

            report.group_name = dist.group.WORLD.group_name
            full, inputs = build_full(spec)
            tp = shard_llama(full, rank, world_size, report.group_name)
            del full
            with torch.no_grad():
                report.uncompiled = [_detach(tp(*args)) for args in inputs]
                for case in cases:
                    try:
                        report.cases[case.name] = _run_case(case, tp, inputs)
                    except Exception:
                        report.cases[case.name] = CaseReport(case.name, error=traceback.format_exc())
                        break  # the peers may be waiting in a collective this rank never reaches
        finally:
            dist.destroy_process_group()
    except Exception:
        report.error = traceback.format_exc()
    report.seconds = time.perf_counter() - start
    torch.save(report, os.path.join(workdir, f"rank{rank}.pt"))


def run_ranks(cases: Sequence[TPCase], spec: ModelSpec = ModelSpec(), world_size: int = 2,
              timeout_s: float = 600.0, workdir: Optional[str] = None,
              collective_timeout_s: float = 300.0) -> List[RankReport]:
    """Run ``cases`` on ``world_size`` gloo ranks on CPU; return their reports, by rank.

    ``workdir`` (created if needed; a fresh temporary directory by default, removed afterwards)
    holds the FileStore and the report files. Raises :class:`TPRunError` if a rank wrote no
    report within ``timeout_s`` seconds (its exit code and the others' errors in the message).
    ``collective_timeout_s`` bounds how long a rank waits in a collective for its peers (it must
    exceed the compile-time skew between ranks).
    A rank's own exception is not raised: it is in ``RankReport.error`` / ``CaseReport.error``.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be distinct, got {names}")
    own_dir = workdir is None
    workdir = tempfile.mkdtemp(prefix="tp_run_") if own_dir else workdir
    os.makedirs(workdir, exist_ok=True)
    for stale in ["store"] + [f"rank{r}.pt" for r in range(world_size)]:
        if os.path.exists(os.path.join(workdir, stale)):
            os.remove(os.path.join(workdir, stale))
    try:
        ctx = mp.get_context(_START_METHOD)
        if _START_METHOD == "forkserver":
            # the server imports torch and these modules once; each rank forks from it
            ctx.set_forkserver_preload(["models.tp_llama", "models.tp_run"])
        procs = [ctx.Process(target=_rank_main, name=f"tp_rank{r}",
                             args=(r, world_size, workdir, spec, list(cases), collective_timeout_s))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        for p in procs:
            if p.is_alive():
                log.warning("tensor-parallel rank %s still running at the %.0f s deadline: terminated",
                            p.name, timeout_s)
                p.terminate()
                p.join(10.0)
        reports: List[Optional[RankReport]] = []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.pt")
            reports.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        missing = [r for r, rep in enumerate(reports) if rep is None]
        if missing:
            details = [f"rank {r}: no report (exit code {procs[r].exitcode})" for r in missing]
            details += [f"rank {rep.rank}: {rep.error}" for rep in reports if rep is not None and rep.error]
            raise TPRunError("tensor-parallel run failed:\n" + "\n".join(details))
        return reports  # type: ignore[return-value]
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
