"""The capture pass: find -> plan -> price -> rewrite -> report, one group at a time.

``run_capture_pass(gm, target)`` depends only on the graph and its target. Each group is
planned (``plan.py``) and priced (``cost.py``); an accepted group is first rewritten on a
copy of the graph (or checked, where the graph is the backend's own working copy), and only
then on ``gm.graph`` itself, so the graph always holds whole rewrites or none. A group is
accepted only where the estimated peak drops. Any exception inside the pass stops it there,
is logged with its reason and counted (``counters["aux_capture"]["pass_errors"]``); it never
fails the compile.

Where the packed buffer lives is the one policy that differs between targets, decided once
per target (``Target.placement``): inside the graph, allocated right before its first write
(``InGraphBuffer``), or lifted out of it, a graph input the compiled callable allocates
(``LiftedBuffer``, the inductor inner: ``lift.py``), which changes what may be rewritten,
how a rewrite is priced, and what the pass does after the last group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch.fx as fx
from torch._dynamo.utils import counters

from compile_pass.cost import (changed_span, graph_liveness, inductor_computes_into, lift_slack, lifted_floor,
                               lifted_peak, planned_peak, without_fusion_into)
from compile_pass.dataflow import NodeTable, copy_graph, gc_paused, nbytes, op_name, tensor_value
from compile_pass.find import LAYER_DEPTH, classify_producer, find_capture_groups, find_output_groups, is_dtype_conversion
from compile_pass.draft_registry import lookup as lookup_draft
from compile_pass.fuse_projection import FcReader, fc_reading, fuse_into_accumulator, project_into_registered
from compile_pass.errors import AuxCaptureError
from compile_pass.groups import CaptureGroup, Decision, GroupKind, Producer, Rejection, summarize
from compile_pass.lift import LiftedBuffers, LiftError, lift_packed_buffers
from compile_pass.liveness import LivenessModel
from compile_pass.plan import GraphFacts, plan_group
from compile_pass.result import CODE_NOT_KEPT, PassResult
from compile_pass.rewrite import (RewriteError, check_rewrite, compute_writes_into_slices, rewrite_group,
                                  writes_of_arithmetic)
from compile_pass.twins import capture_twins, capture_values

__all__ = ["Target", "PassResult", "run_capture_pass", "rewrite_graph", "TARGETS", "CODE_NOT_KEPT",
           "InGraphBuffer", "LiftedBuffer"]

log = logging.getLogger("compile_pass")


class InGraphBuffer:
    """The packed buffer is allocated inside the graph, right before the group's first
    write; nothing else about the target changes what the pass may do."""

    lifted = False
    #: when the estimate allocates the packed buffer: None = right before its first write
    buffer_born: Optional[int] = None

    def twins(self, graph: fx.Graph, table: NodeTable,
              groups: Sequence[CaptureGroup]) -> Dict[fx.Node, fx.Node]:
        """The capture twins the compiler merges before it runs the graph: none."""
        return {}

    def refusal(self, group: CaptureGroup, table: NodeTable) -> Optional[Tuple[Rejection, str]]:
        """Why ``group`` may not be rewritten for this placement, before any planning."""
        return None

    def slack(self, group: CaptureGroup) -> int:
        """Bytes by which the rewrite may be estimated dearer than the list path."""
        return 0

    def floor(self, liveness: LivenessModel, peak: int, group: CaptureGroup) -> Optional[int]:
        """A peak the rewrite reaches whatever it saves later, if that alone rejects it."""
        return None

    def rewritten_peak(self, model: LivenessModel, buffer: fx.Node) -> int:
        """The estimated peak of a rewritten graph whose packed buffer is ``buffer``."""
        return model.peak()

    def finish(self, gm: fx.GraphModule, result: PassResult) -> bool:
        """After the last group; True if the graph changed."""
        return False


class LiftedBuffer(InGraphBuffer):
    """The packed buffers become graph inputs the compiled callable allocates (``lift.py``)
    and the graph goes to Inductor, which merges capture twins first (``twins.py``):

    - a capture that is a graph input the graph writes in place is left to the list path
      (stock Inductor can lose that write-back; fuzz seed 2), and so is a concat of values
      within one layer (MLA's ``k = [k_nope, k_rope]``: the buffer would live through the
      whole graph for a value one op needs);
    - the estimate allocates the buffer before the graph runs, rejects outright where that
      alone cannot pay (``cost.lifted_floor``), and trusts a list path estimated cheaper by
      less than one capture to be no cheaper (``cost.lift_slack``);
    - after the last group every packed buffer is lifted, and capture-only arithmetic
      written into its slice is computed there (``rewrite.compute_writes_into_slices``).
    """

    lifted = True
    buffer_born = 0

    def twins(self, graph: fx.Graph, table: NodeTable,
              groups: Sequence[CaptureGroup]) -> Dict[fx.Node, fx.Node]:
        return capture_twins(capture_values(graph, table, groups), table)

    def refusal(self, group: CaptureGroup, table: NodeTable) -> Optional[Tuple[Rejection, str]]:
        written_input = _input_written_in_graph(group, table)
        if written_input is not None:
            return Rejection.INPUT_WRITTEN_IN_GRAPH, (
                f"capture {written_input} is a graph input the graph writes in place: stock "
                f"Inductor can lose the write-back of such an input when a mutating op later "
                f"overwrites its source, and only the list path's concat happens to hide it "
                f"(docs/overview.md, fuzz seed 2); left to the list path")
        if group.depth_span < LAYER_DEPTH:
            return Rejection.WITHIN_ONE_LAYER, (
                f"its values are {group.depth_span} matmul(s) apart, within one layer "
                f"(MLA's k = [k_nope, k_rope]): the model's own concat, left to Inductor, "
                f"which computes its inputs into it")
        return None

    def slack(self, group: CaptureGroup) -> int:
        return lift_slack(group)

    def floor(self, liveness: LivenessModel, peak: int, group: CaptureGroup) -> Optional[int]:
        return lifted_floor(liveness, peak, group)

    def rewritten_peak(self, model: LivenessModel, buffer: fx.Node) -> int:
        return lifted_peak(model, buffer)

    def finish(self, gm: fx.GraphModule, result: PassResult) -> bool:
        result.keep_code_before(gm.graph)
        # lifted first: a packer's buffer is allocated like its first capture, a reader
        # that would keep that capture from being computed into its slice
        changed = _lift_buffers(gm, result)
        return _writes_into_slices(gm, result) or changed


@dataclass(frozen=True)
class Target:
    """Where the rewritten graph goes, which decides how writes may be expressed.

    ``runs_as_is``: the graph is executed node by node afterwards (no functionalization),
    so ``out=`` recomputation into a slice is safe. ``inductor_cost``: estimate peaks the
    way Inductor runs a concat (pointwise and mm producers computed into its output).
    ``placement``: where the packed buffer lives (``InGraphBuffer`` / ``LiftedBuffer``).
    """

    name: str
    runs_as_is: bool
    inductor_cost: bool
    autograd_free: bool = False  # the graph runs with autograd already handled (AOT, post-grad)
    hoist: bool = False  # functional graph a scheduler reordered: move producers up (plan.py)
    placement: InGraphBuffer = InGraphBuffer()
    #: the graph is the backend's own working copy, discarded if the pass fails: groups are
    #: rewritten in it directly after ``rewrite.check_rewrite``, without a trial copy each
    works_on_copy: bool = False

    @property
    def lift(self) -> bool:
        return self.placement.lifted

    def liveness(self, graph: fx.Graph, *, table: Optional[NodeTable] = None,
                 twins: Optional[Mapping[fx.Node, fx.Node]] = None, except_cat: Optional[fx.Node] = None,
                 groups: Optional[Sequence[CaptureGroup]] = None) -> LivenessModel:
        """``graph``'s liveness as this target's compiler runs it (``cost.graph_liveness``)."""
        return graph_liveness(graph, inductor_cost=self.inductor_cost, merge_twins=self.lift,
                              table=table, twins=twins, except_cat=except_cat, groups=groups)


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
    "dynamo_lifted": Target("dynamo_lifted", runs_as_is=False, inductor_cost=True,
                            placement=LiftedBuffer(), works_on_copy=True),
}


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
        self.twins = target.placement.twins(gm.graph, table, groups)
        self.twinned = frozenset(self.twins) | frozenset(self.twins.values())
        self.liveness = target.liveness(gm.graph, table=table, twins=self.twins, groups=groups)
        self.peak = self.liveness.peak()

    def liveness_without_fusion_into(self, group: CaptureGroup) -> LivenessModel:
        """The liveness with nothing computed into ``group``'s concat (its rewrite removes
        that fusion); the state's own where the target prices no such fusion."""
        if not self.target.inductor_cost:
            return self.liveness
        return without_fusion_into(self.liveness, self.gm.graph, group, merge_twins=self.target.lift,
                                   table=self.table, twins=self.twins, groups=self.groups)


def _fc_of(group: CaptureGroup) -> Optional[FcReader]:
    """The draft's fc reading ``group``'s concat, if ``fuse_projection`` can fuse it; else
    None with ``group.projection`` saying why not."""
    if group.kind is not GroupKind.CONCAT:
        group.projection = "returned captures: the caller projects them (ProjectingAccumulator)"
        return None
    if group.dim not in (-1, len(group.example_shape) - 1):
        group.projection = "the concat is not along the last dim"
        return None
    fc, why = fc_reading(group.cat, group.widths)
    group.projection = why
    return fc


def _fused_trial_peak(state: "_GraphState", group: CaptureGroup) -> Optional[int]:
    """The estimated peak of a copy of the graph with ``group`` rewritten and fused into the
    draft's accumulator; None (``group.projection`` says why) if that cannot be expressed."""
    trial, node_map = copy_graph(state.gm.graph)
    copy = group.replace_nodes(node_map)
    fc, _ = fc_reading(copy.cat, group.widths)
    try:
        buffer = rewrite_group(trial, copy)
        fuse_into_accumulator(trial, buffer, fc)
        trial.lint()
    except (RewriteError, ValueError) as e:
        group.projection = f"not fused: {e}"
        return None
    return state.target.liveness(trial).peak()


def _decide_fused(state: "_GraphState", group: CaptureGroup, cost_model: bool, combine: str) -> Optional[bool]:
    """``fuse_projection``: plan ``group`` for projection (copies, no slot views) and price
    the fused rewrite against the list path; None where it cannot be fused (the caller then
    decides it as a packed group)."""
    plan_group(group, state.facts, False, hoist=state.target.hoist, into_op=state.target.lift,
               twinned=state.twinned)
    if group.decision is Decision.REJECT:
        return False
    after = _fused_trial_peak(state, group)
    if after is None:
        group.decision, group.rejection = Decision.FOUND, None
        return None
    before = state.peak
    group.estimated_peak_before, group.estimated_peak_after = before, after
    if after >= before and cost_model:
        group.reject(Rejection.NO_SAVING, f"estimated peak with the draft's projection fused would not "
                                          f"drop ({_mib(before)} -> {_mib(after)})")
        return False
    group.decision, group.fused = Decision.REWRITE, True
    group.reason = (f"projected into the draft's accumulator ({combine}): estimated peak {_mib(before)} -> "
                    f"{_mib(after)} ({(after - before) / before:+.0%})")
    if after >= before:
        group.reason += "; rewritten because the cost model is off"
    return True


def _decide(state: _GraphState, group: CaptureGroup, cost_model: bool, fuse_projection: bool = False,
            project_outputs: bool = False) -> bool:
    """Plan, trial-rewrite (on a copy) and price one group; accept it if the trial succeeds
    and the estimated peak drops (with ``cost_model=False``: whenever the trial succeeds).
    ``fuse_projection``: a group the draft's fc alone reads is priced, and rewritten, with
    its captures projected into the draft's accumulator (``fuse_projection.py``).
    ``project_outputs``: returned captures are planned as copies (what
    ``project_into_registered`` turns into projections), never computed into slot views."""
    target, placement = state.target, state.target.placement
    packed = group.packed_value
    if packed is not None and packed.requires_grad and not target.autograd_free:
        group.reject(Rejection.REQUIRES_GRAD,
                     "the captures require grad: in-place writes into a buffer have no autograd "
                     "formula here; under autograd use inner aot_eager or inductor (rewritten "
                     "after AOTAutograd), or capture under torch.no_grad()")
        return False
    refusal = placement.refusal(group, state.table)
    if refusal is not None:
        group.reject(*refusal)
        return False
    fc = _fc_of(group) if fuse_projection else None
    if fc is not None:
        fused = _decide_fused(state, group, cost_model, fc.describe())
        if fused is not None:
            return fused
    if target.inductor_cost and cost_model and group.kind is GroupKind.CONCAT \
            and _pointwise_readers_only(group, state.table):
        group.reject(Rejection.FUSED_INTO_READERS,
                     "every reader of the concat is pointwise (a norm over it, say): Inductor computes the "
                     "concat inside their kernels and never holds it, so a packed buffer could only add one")
        return False
    copies_only = project_outputs and group.kind is GroupKind.OUTPUTS
    plan_group(group, state.facts, target.runs_as_is and not copies_only, hoist=target.hoist,
               into_op=target.lift, twinned=state.twinned)
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
        after = placement.rewritten_peak(target.liveness(trial), buffer)
    elif target.hoist:
        # hoisting moves producers and shortens their inputs' lives (``planned_changes``
        # prices that); where the peak is reached outside what the rewrite changes it
        # cannot drop, and nothing more is priced
        span = changed_span(state.liveness, group) if cost_model else None
        if span is not None and state.liveness.max_outside(*span) >= before:
            group.estimated_peak_before, group.estimated_peak_after = before, before
            group.reject(Rejection.PEAK_ELSEWHERE,
                         f"estimated peak would not drop ({_mib(before)} -> at least "
                         f"{_mib(before)}): it is reached outside {_span_names(state.liveness, span)}, "
                         f"where the rewrite changes nothing")
            return False
        after = planned_peak(state.liveness_without_fusion_into(group), group)
    else:
        floor = placement.floor(state.liveness, state.peak, group)
        if floor is not None:
            group.estimated_peak_before, group.estimated_peak_after = state.peak, floor
            group.reject(Rejection.LIFTED_CANNOT_PAY,
                         f"estimated peak would rise ({_mib(state.peak)} -> at least {_mib(floor)}): a "
                         f"buffer allocated before the graph runs is live through the peak before the "
                         f"first capture")
            return False
        # under Inductor's cost model the rewritten group's producers are no longer fused
        # into its concat, so they are priced on a model without that fusion
        after = planned_peak(state.liveness_without_fusion_into(group), group,
                             buffer_born=placement.buffer_born)
    group.estimated_peak_before, group.estimated_peak_after = before, after
    slack = placement.slack(group)
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
        group.reject(Rejection.NO_SAVING, why)
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


#: ops whose outputs are views of their input's pieces (read through ``getitem``)
_SPLITS = ("split", "split_with_sizes", "tensor_split", "chunk", "unbind")


def _pointwise_readers_only(group: CaptureGroup, table: NodeTable) -> bool:
    """Whether every reader of ``group``'s concat (through views of it) is a pointwise op
    or a dtype conversion (a bf16 norm's upcast):
    Inductor can then compute the concat inside its readers' kernels and never hold it
    (measured: a norm over the concat before the draft's fc, K=8, Inductor: the list path
    1.77x the packed bytes, a packed buffer 1.86x; one norm per capture, read through a
    split of the concat, alike), so packing can only add a buffer."""
    todo, seen = [group.cat], set()
    while todo:
        node = todo.pop()
        for reader in node.users:
            if reader in seen:
                continue
            seen.add(reader)
            kind = classify_producer(reader, table) if reader.op != "output" else None
            if kind is Producer.VIEW or op_name(reader) in _SPLITS:  # a split: its pieces are views
                todo.append(reader)
            elif kind not in (Producer.POINTWISE, Producer.EXACT_ARITHMETIC) \
                    and not is_dtype_conversion(reader, table):
                return False
    return bool(seen)


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
        group.reject(Rejection.NOT_EXPRESSIBLE, str(e))
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
        group.reject(Rejection.NOT_EXPRESSIBLE, str(e))
        return False
    return True


def _record(result: PassResult) -> None:
    result.counts = summarize(result.groups)
    for key, n in result.counts.items():
        counters["aux_capture"][key] += n
    for g in result.groups:
        why = f" [{g.rejection.value}]" if g.rejection is not None else ""
        log.info("aux_capture[%s] %s K=%d widths=%s %s: %s%s: %s", result.target, g.key, g.k,
                 list(g.widths), g.dtype, g.decision.value, why, g.reason)


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
                     keep_code_before: bool = True, fuse_projection: bool = False,
                     project_outputs: Optional[str] = None) -> PassResult:
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
    ``fuse_projection=True``: a concat the draft's ``fc`` alone reads is projected per
    capture into one ``[*, H_draft]`` accumulator (``fuse_projection.py``; changes rounding).
    ``project_outputs``: the name of a registered draft (``draft_registry``): a rewritten
    group of returned captures that fits it returns its projected input instead (changes
    rounding the same way).
    """
    with gc_paused():
        return _run_capture_pass(gm, TARGETS[target] if isinstance(target, str) else target,
                                 estimate, cost_model, pack_outputs, concat, original,
                                 keep_code_before or estimate, fuse_projection, project_outputs)


def _run_capture_pass(gm: fx.GraphModule, target: Target, estimate: bool, cost_model: bool,
                      pack_outputs: bool, concat: bool, original: Optional[fx.Graph],
                      keep_code: bool, fuse_projection: bool = False,
                      project_outputs: Optional[str] = None) -> PassResult:
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
            result.timeline_before = target.liveness(gm.graph, table=table).timeline()
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
            if not _decide(state, group, cost_model, fuse_projection, project_outputs is not None):
                continue
            # the trial on a copy (or the check) succeeded: the rewrite on the graph itself
            result.keep_code_before(gm.graph)  # the text before the graph's first change
            fc = fc_reading(group.cat, group.widths)[0] if group.fused else None
            buffer = rewrite_group(gm.graph, group)
            if fc is not None:
                fuse_into_accumulator(gm.graph, buffer, fc)
            elif group.kind is GroupKind.OUTPUTS and project_outputs is not None:
                _project_returned(gm.graph, buffer, group, project_outputs)
            state, graph_changed = None, True
            # The rewrite erased or replaced nodes the remaining groups may refer to (the
            # concat and its readers, an elided clone, a hoisted producer, a capture two
            # groups share) and their facts (producers, storages, write points) were read
            # from the graph before it. So the remaining groups are found again on the new
            # graph, by key, from one new table: each later stage then reads facts of the
            # graph it changes, and a group's planning never sees a stale node.
            remaining = {g.key for g in groups[i:] if g.decision is Decision.FOUND}
            if remaining:
                table = NodeTable(gm.graph)
                groups = groups[:i] + [g for g in _find_groups(gm, table, concat, pack_outputs)
                                       if g.key in remaining]
        graph_changed |= target.placement.finish(gm, result)
        if graph_changed:
            codegen, codegen_cpu = time.perf_counter(), time.process_time()
            gm.recompile()  # the rewritten module's code, which compiling it needs anyway
            result.code_after = gm.code
            result.codegen_seconds = time.perf_counter() - codegen
            result.codegen_cpu_seconds = time.process_time() - codegen_cpu
        if estimate:
            result.timeline_after = target.liveness(gm.graph).timeline()
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


def _project_returned(graph: fx.Graph, buffer: fx.Node, group: CaptureGroup, draft_name: str) -> None:
    """A rewritten group of returned captures made the registered draft's projected input
    (``fuse_projection.project_into_registered``) where it fits the draft; else left packed,
    ``group.projection`` saying why."""
    try:
        draft = lookup_draft(draft_name)
    except AuxCaptureError as e:
        group.projection = str(e)
        return
    if len(set(group.widths)) != 1:
        group.projection = f"the returned captures differ in width ({list(group.widths)})"
        return
    signature, why = draft.fits(group.k, group.widths[0], group.dtype, group.device)
    if signature is None:
        group.projection = why
        return
    try:
        project_into_registered(graph, buffer, group.cat, group.output_indices, draft_name, signature)
    except ValueError as e:
        group.projection = f"not projected: {e}"
        return
    group.fused = True
    group.projection = f"projected into the registered draft {draft_name!r} ({draft.owner}: {signature.describe()})"
    group.reason += f"; {group.projection}"


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
                  cost_model: bool = True, runs_as_is: bool = False,
                  project_outputs: Optional[str] = None) -> PassResult:
    """The pass for a backend that splits and compiles the Dynamo graph itself.

    Call it on the Dynamo graph before splitting it (SGLang's and vLLM's backends split
    with ``split_module`` and compile each piece): every capture write is a
    ``compile_pass::write_slice_`` call that declares its mutation, so a buffer allocated
    in one piece and written in later ones keeps its writes through each piece's
    functionalization and compiler. ``split_ops`` are only checked here (a warning for an
    op that does not exist or never appears); ``runs_as_is=True`` (pieces executed node
    by node, nothing functionalizes them) also allows ``out=`` recomputation into slices.
    ``project_outputs``: a registered draft's name (``draft_registry``; with
    ``pack_outputs``): returned captures that fit it are returned projected.
    Never raises for a graph it cannot handle: the result says why.
    """
    from compile_pass.split import count_split_op_calls

    if split_ops:
        count_split_op_calls(gm, split_ops)
    return run_capture_pass(gm, "dynamo" if runs_as_is else "dynamo_functional",
                            cost_model=cost_model, pack_outputs=pack_outputs, project_outputs=project_outputs)
