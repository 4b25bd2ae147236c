"""The capture pass: find -> plan -> estimate -> rewrite, one group at a time.

``run_capture_pass(gm, target)`` depends only on the graph and its target. Each group is
planned and priced (``cost.py``); an accepted group is first rewritten on a copy of the
graph, and only when that trial succeeds and lints is the same rewrite applied to
``gm.graph`` in place, so the graph always holds whole rewrites or none. A group is
accepted only where the estimated peak drops. Any exception inside the pass stops it
there, is logged with its reason and counted (``counters["aux_capture"]["pass_errors"]``);
it never fails the compile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch.fx as fx
from torch._dynamo.utils import counters

from compile_pass.cost import changed_span, inductor_computes_into, inductor_shared_storages, planned_peak
from compile_pass.dataflow import NodeTable, copy_graph, gc_paused, nbytes, tensor_value
from compile_pass.find import LAYER_DEPTH, find_capture_groups, find_output_groups
from compile_pass.groups import CaptureGroup, Decision, GroupKind, summarize
from compile_pass.lift import LiftedBuffers, LiftError, lift_packed_buffers
from compile_pass.liveness import LivenessModel, MemoryTimeline
from compile_pass.twins import capture_twins, capture_values
from compile_pass.plan import GraphFacts, plan_group
from compile_pass.rewrite import (RewriteError, check_rewrite, compute_writes_into_slices, rewrite_group,
                                  writes_of_arithmetic)

__all__ = ["Target", "PassResult", "run_capture_pass", "rewrite_graph", "TARGETS", "CODE_NOT_KEPT"]

log = logging.getLogger("compile_pass")

@dataclass(frozen=True)
class Target:
    """Where the rewritten graph goes, which decides how writes may be expressed.

    ``runs_as_is``: the graph is executed node by node afterwards (no functionalization),
    so ``out=`` recomputation into a slice is safe. ``inductor_cost``: estimate peaks the
    way Inductor runs a concat (pointwise and mm producers computed into its output).
    ``lift``: packed buffers become graph inputs that the compiled callable's caller
    allocates (``lift.py``), so the estimate allocates them before the graph runs; the
    graph goes to Inductor, which merges capture twins first (``twins.py``), so the
    estimates merge them too.
    """

    name: str
    runs_as_is: bool
    inductor_cost: bool
    autograd_free: bool = False  # the graph runs with autograd already handled (AOT, post-grad)
    hoist: bool = False  # functional graph a scheduler reordered: move producers up (plan.py)
    lift: bool = False
    #: the graph is the backend's own working copy, discarded if the pass fails: groups are
    #: rewritten in it directly after ``rewrite.check_rewrite``, without a trial copy each
    works_on_copy: bool = False


TARGETS: Dict[str, Target] = {
    "dynamo": Target("dynamo", runs_as_is=True, inductor_cost=False),  # eager inner
    # aot_eager inner: the forward graph after AOTAutograd
    "aot": Target("aot", runs_as_is=True, inductor_cost=False, autograd_free=True),
    # a callable inner: the Dynamo graph, functionalized by whatever comes next
    "dynamo_functional": Target("dynamo_functional", runs_as_is=False, inductor_cost=False),
    # Inductor's post-grad graph (AuxCapturePass): functional, lowered by Inductor next
    "post_grad": Target("post_grad", runs_as_is=False, inductor_cost=True, autograd_free=True,
                        hoist=True),
    # the inductor inner: the Dynamo graph, buffers lifted to inputs, then AOT and Inductor
    "dynamo_lifted": Target("dynamo_lifted", runs_as_is=False, inductor_cost=True, lift=True,
                            works_on_copy=True),
}


#: ``PassResult.code_before`` / ``code_after`` of a graph whose code was not kept
CODE_NOT_KEPT = ("# the graph's code was not kept: the pass changed it, or left it unchanged for a "
                 "compiler that edits it next (keep_code_before=True, estimate=True as the diff "
                 "tool runs it, or TORCH_TRACE keep it)\n")


@dataclass
class PassResult:
    """What one run of the pass did to one graph.

    ``code_before`` / ``code_after`` are the graph's code before and after the pass. The
    text costs about as much as the pass itself on a 7000-node graph, so it is generated
    only when needed: before the pass's first change, on first read from an unchanged graph
    that nothing edits later (a graph that runs as is, or the backend's working copy), and
    with ``estimate=True`` (the diff tool). Otherwise, for a graph the pass leaves unchanged
    and a compiler edits next (Inductor's post-grad graph), it is not kept: both read
    ``CODE_NOT_KEPT``.
    """

    target: str
    groups: List[CaptureGroup]
    _code_before: Optional[str]
    _code_after: Optional[str]
    timeline_before: Optional[MemoryTimeline] = None
    timeline_after: Optional[MemoryTimeline] = None
    seconds: float = 0.0  # the pass's own time: find, plan, price, rewrite, lift
    #: regenerating a changed module's Python code after the pass (``gm.recompile()``), which
    #: running or compiling the rewritten module needs in any case
    codegen_seconds: float = 0.0
    codegen_cpu_seconds: float = 0.0  # the same in CPU time of the process
    error: Optional[str] = None
    counts: Dict[str, int] = field(default_factory=dict)
    #: packed buffers made graph inputs (``Target.lift``): the compiled graph's caller allocates them
    lifted: Optional[LiftedBuffers] = None
    lift_note: str = ""  # why packed buffers stayed in the graph, if they did
    #: ``write_slice_`` calls of capture-only arithmetic made ``binary_into_slice_`` (lift targets)
    writes_computed_into: int = 0
    _unchanged_graph: Optional[fx.Graph] = field(default=None, repr=False, compare=False)
    #: generate the code before ahead of the graph's first change (else it is not kept then)
    _keep_code: bool = field(default=True, repr=False, compare=False)

    @property
    def code_before(self) -> str:
        if self._code_before is None:
            if self._unchanged_graph is None:
                return CODE_NOT_KEPT
            self._code_before = self._unchanged_graph.python_code("self").src
            self._unchanged_graph = None
        return self._code_before

    def keep_code_before(self, graph: fx.Graph) -> None:
        """``graph`` is about to change: generate the code before now (unless an unchanged
        graph is kept to read it from, or the result keeps no code: then it is dropped)."""
        if self._code_before is None and self._unchanged_graph in (None, graph):
            if self._keep_code:
                self._code_before = graph.python_code("self").src
            self._unchanged_graph = None

    @code_before.setter
    def code_before(self, code: str) -> None:
        self._code_before = code

    @property
    def code_after(self) -> str:
        return self.code_before if self._code_after is None else self._code_after

    @code_after.setter
    def code_after(self, code: str) -> None:
        self._code_after = code

    @property
    def changed(self) -> bool:
        return any(g.decision is Decision.REWRITE for g in self.groups)


def _liveness(graph: fx.Graph, target: Target, except_cat: Optional[fx.Node] = None,
              table: Optional[NodeTable] = None,
              twins: Optional[Mapping[fx.Node, fx.Node]] = None,
              groups: Optional[Sequence[CaptureGroup]] = None) -> LivenessModel:
    """The liveness model of ``graph`` as ``target``'s compiler runs it. ``twins``: the
    graph's capture twins if known (lifted targets merge them; found here otherwise);
    ``groups``: its groups as found, if at hand."""
    if not target.inductor_cost:
        return LivenessModel(graph, table=table)
    table = NodeTable.of(graph, table)
    if target.lift and twins is None:
        twins = capture_twins(capture_values(graph, table), table)
    shared = inductor_shared_storages(table, twins if target.lift else None, except_cat, groups)
    return LivenessModel(graph, shared, table=table)


def _liveness_without_fusion_into(state: "_GraphState", group: CaptureGroup) -> LivenessModel:
    """The liveness of ``state``'s graph with nothing computed into ``group``'s concat (its
    rewrite removes that fusion): the state's own model where nothing was."""
    shared = state.liveness.computed_into
    if not state.target.inductor_cost or (group.cat not in shared and group.cat not in shared.values()):
        return state.liveness
    return _liveness(state.gm.graph, state.target, except_cat=group.cat, table=state.table,
                     twins=state.twins, groups=state.groups)


def _mib(n: Optional[int]) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


class _GraphState:
    """Facts and liveness of the current graph, all from one ``NodeTable`` (the finder's),
    rebuilt only when the graph changes. ``groups``: the graph's groups as found."""

    def __init__(self, gm: fx.GraphModule, target: Target, table: NodeTable,
                 groups: Sequence[CaptureGroup]) -> None:
        self.gm, self.target, self.table = gm, target, table
        self.facts = GraphFacts(gm.graph, table)
        self.groups = groups
        self.twins = capture_twins(capture_values(gm.graph, table, groups), table) \
            if target.lift else {}
        self.twinned = frozenset(self.twins) | frozenset(self.twins.values())
        self.liveness = _liveness(gm.graph, target, table=table, twins=self.twins, groups=groups)
        self.peak = self.liveness.peak()


def _decide(state: _GraphState, group: CaptureGroup, cost_model: bool) -> bool:
    """Plan, trial-rewrite (on a copy) and price one group; accept it if the trial succeeds
    and the estimated peak drops (with ``cost_model=False``: whenever the trial succeeds)."""
    target = state.target
    packed = group.packed_value
    if packed is not None and packed.requires_grad and not target.autograd_free:
        group.reject("the captures require grad: in-place writes into a buffer have no autograd "
                     "formula here; under autograd use inner aot_eager or inductor (rewritten "
                     "after AOTAutograd), or capture under torch.no_grad()")
        return False
    written_input = _input_written_in_graph(group, state.table) if target.lift else None
    if written_input is not None:
        group.reject(f"capture {written_input} is a graph input the graph writes in place: stock "
                     f"Inductor can lose the write-back of such an input when a mutating op later "
                     f"overwrites its source, and only the list path's concat happens to hide it "
                     f"(docs/overview.md, fuzz seed 2); left to the list path")
        return False
    if target.lift and group.depth_span < LAYER_DEPTH:
        group.reject(f"its values are {group.depth_span} matmul(s) apart, within one layer "
                     f"(MLA's k = [k_nope, k_rope]): the model's own concat, left to Inductor, "
                     f"which computes its inputs into it")
        return False
    plan_group(group, state.facts, target.runs_as_is, hoist=target.hoist, into_op=target.lift,
               twinned=state.twinned)
    if group.decision is Decision.REJECT:
        return False
    before = state.peak
    trial: Optional[fx.Graph] = None
    if group.kind is GroupKind.OUTPUTS:
        # the saving is the caller's pack: its concat (all returned values live, plus the
        # packed copy) becomes a view of the buffer the rewritten graph returns
        trial, buffer = _trial_rewrite(state.gm.graph, group)
        if trial is None:
            return False
        before = max(before, state.liveness.live_bytes()[-1] + group.packed_bytes)
        trial_model = _liveness(trial, target)
        after = _lifted_peak(trial_model, buffer) if target.lift else trial_model.peak()
    elif target.hoist:
        # hoisting moves producers and shortens their inputs' lives (``planned_changes``
        # prices that); where the peak is reached outside what the rewrite changes it
        # cannot drop, and nothing more is priced
        span = changed_span(state.liveness, group) if cost_model else None
        if span is not None and state.liveness.max_outside(*span) >= before:
            group.estimated_peak_before, group.estimated_peak_after = before, before
            group.reject(f"estimated peak would not drop ({_mib(before)} -> at least "
                         f"{_mib(before)}): it is reached outside {_span_names(state.liveness, span)}, "
                         f"where the rewrite changes nothing")
            return False
        after = planned_peak(_liveness_without_fusion_into(state, group), group)
    else:
        # under Inductor's cost model the rewritten group's producers are no longer fused
        # into its concat, so they are priced on a model without that fusion
        if target.lift and _lifted_buffer_cannot_pay(state, group):
            return False
        after = planned_peak(_liveness_without_fusion_into(state, group), group,
                             buffer_born=0 if target.lift else None)
    group.estimated_peak_before, group.estimated_peak_after = before, after
    slack = _lift_slack(group) if target.lift else 0
    # returned captures: a tie still saves the caller's K*T*H copy (its pack becomes a view),
    # so only a rise rejects; a concat in the graph must lower the peak
    outputs = group.kind is GroupKind.OUTPUTS
    worse = after > before + slack if slack or outputs else after >= before
    if worse and cost_model:
        fused = [c for c in group.captures if inductor_computes_into(c.node, state.table)]
        change = "rise by more than one capture" if slack else "rise" if outputs else "not drop"
        why = f"estimated peak would {change} ({_mib(before)} -> {_mib(after)})"
        if target.inductor_cost and fused:
            why += (f"; Inductor already computes {len(fused)} of {group.k} captures straight "
                    f"into the concat output")
        group.reject(why)
        return False
    if trial is None and not _rewrite_fits(state, group):
        return False
    group.decision = Decision.REWRITE
    group.reason = f"estimated peak {_mib(before)} -> {_mib(after)} ({(after - before) / before:+.0%})"
    if worse:
        group.reason += "; rewritten because the cost model is off"
    elif outputs and after >= before:
        group.reason += "; a tie: the caller's pack becomes a view of the returned buffer"
    elif after >= before:
        group.reason += ("; within one capture of the list path: the buffer is allocated by the "
                         "caller, outside Inductor's memory plan, which the list path's concat "
                         "buffer changes")
    return True


def _input_written_in_graph(group: CaptureGroup, table: NodeTable) -> Optional[str]:
    """The name of a capture that is a graph input written in place by the graph, if any."""
    for capture in group.captures:
        node = capture.node
        if node.op != "placeholder":
            continue
        key = table.key.get(node)
        holders = table.holders.get(key, [node]) if key is not None else [node]
        if any(table.mutators.get(alias) for alias in holders):
            return node.name
    return None


def _lifted_buffer_cannot_pay(state: _GraphState, group: CaptureGroup) -> bool:
    """Reject ``group`` (True) without pricing its rewrite where a lifted buffer cannot pay:
    it is live from the start, so before the first capture is produced the rewritten graph
    holds what the graph holds now plus the packed bytes. If that alone exceeds the
    estimated peak by more than the slack (``_lift_slack``), no saving later can help
    (MLA's k join, one per layer: its inputs come right before it)."""
    produced = [2 * state.liveness.position[c.node] for c in group.captures
                if c.node.op not in ("placeholder", "get_attr")]
    first = min(produced, default=0)
    if first == 0:
        return False
    floor = state.liveness.max_outside(first, state.liveness.end) + group.packed_bytes
    if floor <= state.peak + _lift_slack(group):
        return False
    group.estimated_peak_before, group.estimated_peak_after = state.peak, floor
    group.reject(f"estimated peak would rise ({_mib(state.peak)} -> at least {_mib(floor)}): a "
                 f"buffer allocated before the graph runs is live through the peak before the "
                 f"first capture")
    return True


def _lift_slack(group: CaptureGroup) -> int:
    """How much cheaper the list path must be estimated, in bytes, before a lifted rewrite
    is rejected: one capture's bytes for captures taken a layer or more apart
    (``find.LAYER_DEPTH``), 0 for a concat of values one matmul apart (MLA's k join),
    which is the model's own computation and must pay for itself.

    With the buffer lifted out of the graph, Inductor plans every other buffer as in the
    build without captures, so the rewrite costs the packed bytes and no more. The list
    path's concat buffer inside the graph changes that plan: Inductor's wrapper keeps a
    freed buffer for a later one of the same size whenever its own estimated peak allows,
    which neither its estimate nor ours sees next to an opaque kernel's temporaries. That
    moves single activations, so a list path estimated cheaper by less than one capture
    is not trusted to be (measured: the capture-dominated Llama, estimated 16 KiB cheaper
    on the list path, paid 1.33x the packed bytes there and 1.00x rewritten).
    """
    if group.depth_span < LAYER_DEPTH:
        return 0
    return max(group.packed_bytes * c.width // max(sum(group.widths), 1) for c in group.captures)


def _span_names(model: LivenessModel, span: Tuple[int, int]) -> str:
    first, last = model.nodes[span[0] // 2], model.nodes[span[1] // 2]
    return f"{first.name} .. {last.name}"


def _trial_rewrite(graph: fx.Graph, group: CaptureGroup) -> Tuple[Optional[fx.Graph], Optional[fx.Node]]:
    """The planned rewrite applied to a copy of ``graph`` and the copy's buffer node;
    (None, None) (group rejected) if it fails."""
    trial, node_map = copy_graph(graph)
    try:
        buffer = rewrite_group(trial, group.replace_nodes(node_map))
        trial.lint()
    except RewriteError as e:  # a plan this graph cannot express: this group only
        group.reject(str(e))
        return None, None
    return trial, buffer  # any other exception is a pass error (run_capture_pass logs it)


def _rewrite_fits(state: _GraphState, group: CaptureGroup) -> bool:
    """Whether the planned rewrite can be expressed on the graph (else ``group`` is
    rejected): checked on the graph itself where it is a working copy, else by a trial
    rewrite of a copy of it."""
    if not state.target.works_on_copy:
        return _trial_rewrite(state.gm.graph, group)[0] is not None
    try:
        check_rewrite(state.gm.graph, group)
    except RewriteError as e:
        group.reject(str(e))
        return False
    return True


def _lifted_peak(model: LivenessModel, buffer: fx.Node) -> int:
    """Peak of a rewritten graph whose ``buffer`` is allocated before the graph runs."""
    key = model.keys_of[buffer][0]
    interval = model.intervals[key]
    return model.peak({key: interval._replace(born=0)})


def _record(result: PassResult) -> None:
    result.counts = summarize(result.groups)
    for key, n in result.counts.items():
        counters["aux_capture"][key] += n
    for g in result.groups:
        log.info("aux_capture[%s] %s K=%d widths=%s %s: %s: %s", result.target, g.key, g.k,
                 list(g.widths), g.dtype, g.decision.value, g.reason)


def _find_groups(gm: fx.GraphModule, table: NodeTable, concat: bool,
                 pack_outputs: bool) -> List[CaptureGroup]:
    groups = find_capture_groups(gm, table) if concat else []
    if pack_outputs:
        groups += find_output_groups(gm, table)
    return groups


def run_capture_pass(gm: fx.GraphModule, target: Target | str = "dynamo",
                     estimate: bool = False, cost_model: bool = True,
                     pack_outputs: bool = False, concat: bool = True,
                     original: Optional[fx.Graph] = None,
                     keep_code_before: bool = True) -> PassResult:
    """Rewrite every accepted capture group of ``gm`` (in place); never raises.

    ``estimate=True`` also records whole-graph memory timelines before and after, for the
    diff tool. ``cost_model=False`` rewrites every group that can be rewritten, whatever
    the estimate says (for tests and for measuring what the estimate predicts).
    ``concat``: rewrite concats of captures; ``pack_outputs``: also make captures the
    graph returns adjacent slices of one buffer (``find_output_groups``).
    ``original``: for a working copy (``Target.works_on_copy``), the graph it was copied
    from, if the caller owns it and nothing edits it while ``code_before`` may be read (not
    Dynamo's graph: Dynamo may empty it after the backend returns): the code before is then
    generated from it only if asked for. ``keep_code_before=False``: the code before a
    change is not generated (it costs about as much as the pass on a large graph); read
    from a graph the pass leaves unchanged, it still is. ``estimate=True`` keeps it.
    """
    with gc_paused():
        return _run_capture_pass(gm, TARGETS[target] if isinstance(target, str) else target,
                                 estimate, cost_model, pack_outputs, concat, original,
                                 keep_code_before or estimate)


def _run_capture_pass(gm: fx.GraphModule, target: Target, estimate: bool, cost_model: bool,
                      pack_outputs: bool, concat: bool, original: Optional[fx.Graph],
                      keep_code: bool) -> PassResult:
    start = time.perf_counter()
    # the graph's own code, not gm.code: earlier passes (Inductor's) may not have recompiled.
    # Read later from a graph nothing edits: a working copy's original, or the graph itself
    # while the pass leaves it unchanged (a graph run as is); else kept before the first change
    if original is not None and target.works_on_copy:
        unchanged: Optional[fx.Graph] = original
    else:
        unchanged = gm.graph if target.runs_as_is or target.works_on_copy else None
    result = PassResult(target.name, [], None, None, _unchanged_graph=unchanged, _keep_code=keep_code)
    if estimate:
        result.keep_code_before(gm.graph)
    graph_changed = False
    try:
        table = NodeTable(gm.graph)
        if estimate:
            result.timeline_before = _liveness(gm.graph, target, table=table).timeline()
        groups = _find_groups(gm, table, concat, pack_outputs)
        state: Optional[_GraphState] = None
        i = 0
        while i < len(groups):
            group = groups[i]
            i += 1
            result.groups.append(group)
            if group.decision is not Decision.FOUND:
                continue
            group.placement = target.name
            state = state or _GraphState(gm, target, table, groups)
            if not _decide(state, group, cost_model):
                continue
            # the trial on a copy (or the check) succeeded: the rewrite on the graph itself
            result.keep_code_before(gm.graph)  # the text before the graph's first change
            rewrite_group(gm.graph, group)
            state, graph_changed = None, True
            # the rewrite replaced nodes: find the remaining groups again on the new graph
            remaining = {g.key for g in groups[i:] if g.decision is Decision.FOUND}
            if remaining:
                table = NodeTable(gm.graph)
                groups = groups[:i] + [g for g in _find_groups(gm, table, concat, pack_outputs)
                                       if g.key in remaining]
            else:
                groups = groups[:i] + [g for g in groups[i:]]
        if target.lift:
            result.keep_code_before(gm.graph)
            # lifted first: a packer's buffer is allocated like its first capture, a reader
            # that would keep that capture from being computed into its slice
            graph_changed |= _lift_buffers(gm, result)
            graph_changed |= _writes_into_slices(gm, result)
        if graph_changed:
            codegen, codegen_cpu = time.perf_counter(), time.process_time()
            gm.recompile()  # the rewritten module's code, which compiling it needs anyway
            result.code_after = gm.code
            result.codegen_seconds = time.perf_counter() - codegen
            result.codegen_cpu_seconds = time.process_time() - codegen_cpu
        if estimate:
            result.timeline_after = _liveness(gm.graph, target).timeline()
            if result.lifted is not None:  # allocated by the caller, before the graph runs
                result.timeline_after = result.timeline_after.plus(_lifted_bytes(gm, result.lifted))
    except Exception as e:  # noqa: BLE001 - the pass must never break a compile
        result.error = f"{type(e).__name__}: {e}"
        gm.recompile()
        result.code_after = gm.code
        if not graph_changed and (result._code_before is None or result.code_after == result.code_before):
            log.warning("aux_capture pass failed, graph left unchanged: %s", result.error)
        elif target.works_on_copy:
            log.warning("aux_capture pass failed, the graph is compiled without it: %s", result.error)
        else:
            log.warning("aux_capture pass failed after completing some rewrites: %s", result.error)
        counters["aux_capture"]["pass_errors"] += 1
        return result
    finally:
        result.seconds = time.perf_counter() - start - result.codegen_seconds
    _record(result)
    return result


def _lifted_bytes(gm: fx.GraphModule, lifted: LiftedBuffers) -> int:
    """Bytes of ``gm``'s lifted buffers at the example sizes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return sum(nbytes(tensor_value(n)) for n in placeholders[lifted.num_inputs:])


def _writes_into_slices(gm: fx.GraphModule, result: PassResult) -> bool:
    """Writes of capture-only arithmetic (a packer's ``append(hidden + residual)``) computed
    into their slices (``rewrite.compute_writes_into_slices``); True if any was."""
    if not writes_of_arithmetic(gm.graph):
        return False
    table = NodeTable(gm.graph)
    twinned = capture_twins(capture_values(gm.graph, table, []), table)
    done = compute_writes_into_slices(gm.graph, table, frozenset(twinned) | frozenset(twinned.values()))
    if done:
        result.writes_computed_into = done
        log.info("aux_capture[%s] %d capture writes computed into their slices", result.target, done)
    return done > 0


def _lift_buffers(gm: fx.GraphModule, result: PassResult) -> bool:
    """Lift ``gm``'s packed buffers (rewritten groups' and packers') to graph inputs, in
    place, recorded in ``result``; True if the graph changed. A buffer that cannot be
    lifted stays in the graph (``result.lift_note`` says why)."""
    try:
        result.lifted = lift_packed_buffers(gm)
    except LiftError as e:
        result.lift_note = f"packed buffers stay in the graph: {e}"
        log.info("aux_capture[%s] %s", result.target, result.lift_note)
        return False
    if result.lifted is None:
        return False
    counters["aux_capture"]["buffers_lifted"] += len(result.lifted)
    for spec in result.lifted.buffers:
        log.info("aux_capture[%s] lifted %s: allocated by the caller of the compiled graph",
                 result.target, spec.describe())
    return True


def rewrite_graph(gm: fx.GraphModule, *, split_ops: Sequence[str] = (), pack_outputs: bool = False,
                  cost_model: bool = True, runs_as_is: bool = False) -> PassResult:
    """The pass for a backend that splits and compiles the Dynamo graph itself.

    Call it on the Dynamo graph before splitting it (SGLang's and vLLM's backends split
    with ``split_module`` and compile each piece): every capture write is a
    ``compile_pass::write_slice_`` call that declares its mutation, so a buffer allocated
    in one piece and written in later ones keeps its writes through each piece's
    functionalization and compiler. ``split_ops`` are only checked here (a warning for an
    op that does not exist or never appears); ``runs_as_is=True`` (pieces executed node
    by node, nothing functionalizes them) also allows ``out=`` recomputation into slices.
    Never raises for a graph it cannot handle: the result says why.
    """
    from compile_pass.split import count_split_op_calls

    if split_ops:
        count_split_op_calls(gm, split_ops)
    return run_capture_pass(gm, "dynamo" if runs_as_is else "dynamo_functional",
                            cost_model=cost_model, pack_outputs=pack_outputs)
