"""The capture pass on graphs directly: finding, planning, pricing, rewriting.

Graphs come from Dynamo (torch IR) and from AOTAutograd (aten IR) through capturing
backends; each rewritten graph is run as is and compared bitwise with the original.
"""

from __future__ import annotations

import operator
import random
from typing import Callable, List

import pytest
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

import models
from compile_pass import find as find_module
from compile_pass import find_capture_groups, run_capture_pass
from compile_pass.capture_pass import TARGETS
from compile_pass.dataflow import copy_graph
from compile_pass.find import classify_producer
from compile_pass.cost import planned_peak
from compile_pass.groups import Decision, Producer, Rejection, Strategy
from compile_pass.liveness import LivenessModel, estimate_memory
from compile_pass.memory import measure_peak
from compile_pass.plan import GraphFacts, plan_group


def dynamo_graph(fn: Callable, *args, grad: bool = False) -> fx.GraphModule:
    """The Dynamo graph of ``fn``, with dim 0 of the tensor arguments (tokens) dynamic."""
    graphs: List[fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    token_args = [a for a in args if isinstance(a, torch.Tensor) and a.shape[0] == args[0].shape[0]]
    for a in token_args:
        torch._dynamo.mark_dynamic(a, 0)
    with torch.set_grad_enabled(grad):
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def aot_graph(fn: Callable, *args) -> fx.GraphModule:
    graphs: List[fx.GraphModule] = []

    def fw(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=fw), dynamic=True, fullgraph=True)(*args)
    return graphs[0]


@torch.no_grad()
def run_graph(gm: fx.GraphModule, *args):
    """Run a Dynamo graph as is with the inputs Dynamo lifted (sizes, then tensors, params)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = []
    tensors = iter(args)
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            values.append(None)  # filled below from the first tensor's size
        else:
            values.append(next(tensors))
    for i, node in enumerate(placeholders):
        if values[i] is None:
            expr = node.meta["example_value"].node.expr
            for p, v in zip(placeholders, values):
                ev = p.meta.get("example_value")
                if isinstance(ev, torch.Tensor) and v is not None:
                    dims = [d for d, s in enumerate(ev.shape)
                            if isinstance(s, torch.SymInt) and s.node.expr == expr]
                    if dims:
                        values[i] = v.shape[dims[0]]
                        break
    return gm(*values)


class Decoder(torch.nn.Module):
    """A capture-dominated toy decoder: cheap layers, captures of hidden + residual."""

    def __init__(self, layers: int = 8, hidden: int = 64, capture_at=(1, 3, 5), dtype=torch.float32):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, dtype=dtype)
                                           for _ in range(layers))
        self.capture_at = tuple(capture_at)

    def forward(self, x):
        aux = []
        residual = torch.zeros_like(x)
        for i, linear in enumerate(self.linears):
            if i in self.capture_at:
                aux.append(x + residual)
            residual = residual + x
            x = linear(x).relu()
        return x, torch.cat(aux, dim=-1)


@pytest.fixture(scope="module")
def decoder_and_input():
    torch.manual_seed(0)
    return Decoder().eval(), torch.randn(512, 64)


def test_find_on_dynamo_graph_reports_the_group(decoder_and_input):
    model, x = decoder_and_input
    gm = dynamo_graph(model, x)
    groups = find_capture_groups(gm)
    assert len(groups) == 1
    g = groups[0]
    assert g.decision is Decision.FOUND and g.k == 3
    assert g.dim == 1 and g.widths == (64, 64, 64)
    assert g.dtype == torch.float32 and g.device.type == "cpu"
    assert g.example_shape == (512, 192) and g.shape[1] == "192" and not g.shape[0].isdigit()
    assert g.packed_bytes == 512 * 192 * 4
    assert [c.offset for c in g.captures] == [0, 64, 128]
    assert all(c.producer is Producer.EXACT_ARITHMETIC for c in g.captures)
    assert all("aux.append(x + residual)" in c.source and "test_capture_pass.py" in c.source
               for c in g.captures)
    # finding does not change the graph
    assert [n for n in gm.graph.nodes if n.target is torch.cat] == [g.cat]


def test_find_on_aot_graph(decoder_and_input):
    model, x = decoder_and_input
    gm = aot_graph(model, x)
    groups = find_capture_groups(gm)
    assert [g.k for g in groups] == [3]
    assert groups[0].widths == (64, 64, 64)
    assert all(c.producer is Producer.EXACT_ARITHMETIC for c in groups[0].captures)


@pytest.mark.parametrize("target", ["dynamo", "dynamo_functional"])
def test_rewrite_is_bitwise_and_lowers_estimate(decoder_and_input, target):
    model, x = decoder_and_input
    gm = dynamo_graph(model, x)
    before = run_graph(gm, x, *[p for p in model.parameters()])
    with torch.no_grad():
        reference = model(x)
    assert torch.equal(before[1], reference[1])
    result = run_capture_pass(gm, target, estimate=True)
    assert result.error is None
    [group] = result.groups
    assert group.decision is Decision.REWRITE, group.reason
    assert group.estimated_peak_after < group.estimated_peak_before
    assert "aux_packed" in result.code_after and "torch.cat" not in result.code_after
    expected = Strategy.COMPUTE_INTO if TARGETS[target].runs_as_is else Strategy.COPY
    assert [c.strategy for c in group.captures] == [expected] * 3
    after = run_graph(gm, x, *[p for p in model.parameters()])
    assert torch.equal(after[0], reference[0]) and torch.equal(after[1], reference[1])
    # a second token count through the same (symbolic) graph
    y = torch.randn(77, 64)
    assert torch.equal(run_graph(gm, y, *model.parameters())[1], model(y)[1])


def test_planned_peak_matches_the_rewritten_graph(decoder_and_input):
    """The cost model prices the plan on the original graph: check against the real rewrite."""
    model, x = decoder_and_input
    for target in ("dynamo", "dynamo_functional"):
        gm = dynamo_graph(model, x)
        [group] = find_capture_groups(gm)
        plan_group(group, GraphFacts(gm.graph), TARGETS[target].runs_as_is)
        predicted = planned_peak(LivenessModel(gm.graph), group)
        run_capture_pass(gm, target, cost_model=False)
        assert estimate_memory(gm.graph).peak_bytes == predicted, target


def test_estimate_matches_measured_peak_of_graph_run_as_is(decoder_and_input):
    model, x = decoder_and_input
    x = torch.randn(4096, 64)
    for rewrite in (False, True):
        gm = dynamo_graph(model, x)
        if rewrite:
            assert run_capture_pass(gm, "dynamo").changed
        estimated = estimate_memory(gm.graph).peak_bytes
        with torch.no_grad():
            measured = measure_peak(run_graph, gm, x, *model.parameters()).bytes
        assert abs(measured - estimated) <= 0.05 * measured, (rewrite, measured, estimated)


def test_mutation_after_capture_moves_the_write():
    def fn(x, w):
        aux = []
        h = x @ w
        aux.append(h)
        h.mul_(2.0)  # the cat reads the mutated value
        g = (h @ w).relu()
        aux.append(g)
        return torch.cat(aux, dim=-1)

    x, w = torch.randn(16, 8), torch.randn(8, 8)
    gm = dynamo_graph(fn, x, w)
    result = run_capture_pass(gm, "dynamo", cost_model=False)
    [group] = result.groups
    first = group.captures[0]
    assert first.strategy is Strategy.COPY and "mutated in place" in first.note
    assert first.write_after is not None and "mul_" in first.write_after.name
    assert torch.equal(run_graph(gm, x, w)[0], fn(x.clone(), w))


def test_clone_feeding_only_the_concat_is_elided():
    def fn(x, w):
        aux = []
        for _ in range(3):
            x = (x @ w).sin()
            aux.append(x.clone())
            x.add_(1.0)  # the producer is mutated after the clone: the clone is the snapshot
        return torch.cat(aux, dim=-1)

    x, w = torch.randn(16, 8), torch.randn(8, 8)
    gm = dynamo_graph(fn, x, w)
    assert sum(n.target == "clone" for n in gm.graph.nodes) == 3
    result = run_capture_pass(gm, "dynamo", cost_model=False)
    [group] = result.groups
    assert [c.strategy for c in group.captures] == [Strategy.ELIDE_CLONE] * 3
    assert ".clone()" not in result.code_after
    assert torch.equal(run_graph(gm, x, w)[0], fn(x.clone(), w))


def test_capture_with_later_readers_stays_correct():
    def fn(x, w):
        aux = []
        for _ in range(3):
            h = x + 1.0
            y = x * 2.0
            c = h + y
            aux.append(c)
            x = (c @ w).tanh() + c  # the capture is read again by the next layer
        return x, torch.cat(aux, dim=-1)

    x, w = torch.randn(32, 8), torch.randn(8, 8)
    gm = dynamo_graph(fn, x, w)
    result = run_capture_pass(gm, "dynamo", cost_model=False)
    assert result.groups[0].decision is Decision.REWRITE
    out = run_graph(gm, x, w)
    ref = fn(x, w)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_rejections_carry_reasons():
    def mixed(x, w):
        a = x @ w
        b = (a @ w).to(torch.float64)
        return torch.cat([a, b], dim=-1)

    def one_block(x, w):
        h = x @ w
        return torch.cat([h.sin(), h.cos()], dim=-1)

    x, w = torch.randn(8, 4), torch.randn(4, 4)
    [g] = run_capture_pass(dynamo_graph(mixed, x, w), "dynamo").groups
    assert g.decision is Decision.REJECT and g.rejection is Rejection.MIXED_DTYPES
    assert "torch.float64" in g.reason and "type-promotes" in g.reason
    [g] = run_capture_pass(dynamo_graph(one_block, x, w), "dynamo").groups
    assert g.decision is Decision.REJECT and g.rejection is Rejection.ONE_BLOCK and "one block" in g.reason
    assert g.to_dict()["rejection"] == "one block"
    with pytest.raises(TypeError, match="a rejection needs a Rejection, got 'why'"):
        g.reject("why", "detail")


def test_captures_that_require_grad_are_left_alone(decoder_and_input):
    model, x = decoder_and_input
    gm = dynamo_graph(model, x, grad=True)
    [g] = run_capture_pass(gm, "dynamo", cost_model=False).groups
    assert g.rejection is Rejection.REQUIRES_GRAD and "require grad" in g.reason
    # after AOTAutograd the forward graph runs without autograd: rewritten
    gm = aot_graph(model, x)
    [g] = run_capture_pass(gm, "aot", cost_model=False).groups
    assert g.decision is Decision.REWRITE


def test_no_drop_is_rejected_with_the_estimates():
    model, inputs = models.llama.tiny(capture_mode="list", tokens=16)
    gm = dynamo_graph(model, *inputs)
    result = run_capture_pass(gm, "dynamo")
    capture_groups = [g for g in result.groups if g.k == model.num_captures]
    assert len(capture_groups) == 1
    g = capture_groups[0]
    assert g.rejection is Rejection.NO_SAVING and "would not drop" in g.reason
    assert g.estimated_peak_before is not None and g.estimated_peak_after >= g.estimated_peak_before
    assert not result.changed and result.code_after == result.code_before


def compile_with_pass(fn: Callable, target: str = "dynamo", **pass_options):
    """``fn`` compiled by a backend that runs the pass on the Dynamo graph, then runs it as is."""
    results = []

    def backend(gm, example_inputs):
        results.append(run_capture_pass(gm, target, **pass_options))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True), results


def test_pass_on_capture_dominated_dflash_rewrites_with_cost_model():
    model, inputs = models.dflash.capture_dominated(capture_mode="list", tokens=512)
    compiled, results = compile_with_pass(model)
    with torch.no_grad():
        reference = model(*inputs)
        out = compiled(*inputs)
    [g] = [g for g in results[0].groups if g.k == model.num_captures]
    assert g.decision is Decision.REWRITE, g.reason
    assert all("aux.append(hidden_states + residual)" in c.source for c in g.captures)
    assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])


def test_the_pass_reads_the_graph_in_a_fixed_number_of_sweeps(monkeypatch):
    """The pass's cost, counted rather than timed: one ``NodeTable`` sweep of a graph it
    leaves unchanged and a fixed number of liveness models, however many groups it finds
    (the time itself is benchmarks/pass_speed.py's, and test_scale.py's linearity check)."""
    from compile_pass.dataflow import NodeTable
    from compile_pass.liveness import LivenessModel

    counts = {"tables": 0, "liveness": 0}
    for cls, key in ((NodeTable, "tables"), (LivenessModel, "liveness")):
        def init(self, *a, _orig=cls.__init__, _key=key, **k):
            counts[_key] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(cls, "__init__", init)
    model, inputs = models.llama.tiny(capture_mode="list", tokens=16)
    result = run_capture_pass(dynamo_graph(model, *inputs), "dynamo")
    assert not result.changed and result.groups
    assert counts == {"tables": 1, "liveness": 1}, counts
    assert result.seconds > 0 and result.codegen_seconds == 0


def test_captures_are_located_at_their_layers():
    """nn_module_stack metadata names the block each capture feeds (Eagle3: [2, L//2, L-3])."""
    model, inputs = models.llama.tiny(capture_mode="list", tokens=16)
    gm = dynamo_graph(model, *inputs)
    [group] = [g for g in find_capture_groups(gm) if g.k == model.num_captures]
    expected = [f"input of layers.{i}" for i in model.config.layers_to_capture]
    assert [c.location for c in group.captures] == expected


# -- the node table: one sweep of per-node facts that find, plan and liveness share ---------


def _reference_depths(graph: fx.Graph) -> dict:
    """Layer depths by their definition: classify every node, count MATMUL / BATCHED_MATMUL
    / CUSTOM_OP producers (not one output of a multi-output op), and in-place writes."""
    from compile_pass.dataflow import mutated_inputs, storage_key, tensor_value

    def key(n):
        v = tensor_value(n)
        return storage_key(v) if v is not None else None

    boundaries = {Producer.MATMUL, Producer.BATCHED_MATMUL, Producer.CUSTOM_OP}
    depth, written_at = {}, {}
    for n in graph.nodes:
        base = max([depth[a] for a in n.all_input_nodes] + [written_at.get(key(a), 0) for a in n.all_input_nodes],
                   default=0)
        if n.op == "call_function" and n.target is not operator.getitem and classify_producer(n) in boundaries:
            base += 1
        depth[n] = base
        for m in mutated_inputs(n):
            if key(m) is not None:
                written_at[key(m)] = base
    return depth


@pytest.fixture(scope="module")
def deepseek_graphs():
    """Dynamo and AOT graphs of the tiny DeepSeek (MLA, MoE, an in-place fused add-RMSNorm
    custom op on the residual, multi-output ops)."""
    model, inputs = models.deepseek.tiny(capture_mode="list", tokens=16)
    return {"dynamo": dynamo_graph(model, *inputs), "aot": aot_graph(model, *inputs)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dynamo", "aot"])
def test_node_table_agrees_with_the_per_node_functions(deepseek_graphs, kind):
    from compile_pass.dataflow import NodeTable, mutated_inputs, storage_key, tensor_value

    graph = deepseek_graphs[kind].graph
    table = NodeTable(graph)
    assert table.nodes == list(graph.nodes)
    for i, n in enumerate(graph.nodes):
        value = tensor_value(n)
        assert table.position[n] == i and table.value[n] is value
        assert table.key[n] == (storage_key(value) if value is not None else None)
        assert table.writes.get(n, []) == mutated_inputs(n)
        assert classify_producer(n, table) is classify_producer(n), n.format_node()
    if kind == "dynamo":  # AOTAutograd functionalizes the write
        assert table.writes, "the fused add-RMSNorm writes the residual in place"
    # the fast boundary rule (op kind from the target, views ruled out by storage) gives
    # the depths the definition gives
    assert find_module._layer_depths(table) == _reference_depths(graph)
    # the indexed lookup of concats finds what a sweep finds, in graph order; so does the
    # sweep it falls back to without fx's index
    from compile_pass.dataflow import cat_nodes, is_cat, nodes_calling

    swept = [n for n in graph.nodes if is_cat(n)]
    assert swept and cat_nodes(graph) == swept

    class Unindexed:
        nodes = graph.nodes

    targets = {n.target for n in swept}
    assert nodes_calling(Unindexed(), swept[0].op, targets) == nodes_calling(graph, swept[0].op, targets)


def test_node_table_is_rebuilt_for_a_changed_graph(deepseek_graphs):
    from compile_pass.dataflow import NodeTable

    graph = copy_graph(deepseek_graphs["dynamo"].graph)[0]
    table = NodeTable(graph)
    assert NodeTable.of(graph, table) is table
    assert NodeTable.of(copy_graph(graph)[0], table) is not table  # another graph
    placeholder = next(iter(graph.nodes))
    with graph.inserting_after(placeholder):
        graph.call_function(torch.ops.aten.clone.default, (placeholder,))
    rebuilt = NodeTable.of(graph, table)
    assert rebuilt is not table and len(rebuilt.nodes) == len(table.nodes) + 1


def test_provenance_is_read_from_the_graph_as_found():
    """Source lines and locations are read on first use, from the graph as it was found:
    rewriting it afterwards does not change what the captures report."""
    model, inputs = models.llama.tiny(capture_mode="list", tokens=16)
    gm = dynamo_graph(model, *inputs)
    expected = [f"input of layers.{i}" for i in model.config.layers_to_capture]
    result = run_capture_pass(gm, "dynamo", cost_model=False)
    [group] = [g for g in result.groups if g.k == model.num_captures]
    assert group.decision is Decision.REWRITE, group.reason
    assert [c.location for c in group.captures] == expected
    assert all("aux.append" in c.source for c in group.captures)


# -- pricing under hoisting: a peak reached where the rewrite changes nothing cannot drop ----


def _post_grad_cases():
    model, inputs = models.deepseek.tiny(capture_mode="list", tokens=16)
    yield "deepseek", aot_graph(model, *inputs)
    model, inputs = models.dflash.capture_dominated(capture_mode="list", tokens=64)
    yield "dflash", aot_graph(model, *inputs)


@pytest.fixture(scope="module")
def post_grad_graphs():
    return dict(_post_grad_cases())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek", "dflash"])
@pytest.mark.parametrize("target", ["aot", "post_grad"])  # post_grad: Inductor's cost model
def test_changed_span_bounds_what_the_rewrite_changes(post_grad_graphs, name, target):
    """Outside ``changed_span`` the rewritten copy's live bytes equal the original's, node
    for node, for every group the hoisting planner plans on these graphs."""
    from compile_pass.capture_pass import _trial_rewrite
    from compile_pass.cost import changed_span

    gm = post_grad_graphs[name]
    checked = 0
    for group in find_capture_groups(gm):
        plan_group(group, GraphFacts(gm.graph), runs_as_is=False, hoist=True)
        if group.decision is not Decision.FOUND:
            continue
        model = TARGETS[target].liveness(gm.graph)
        first, last = changed_span(model, group)
        trial, _ = _trial_rewrite(gm.graph, group)
        assert trial is not None, group.reason
        before, after = model.timeline(), TARGETS[target].liveness(trial).timeline()
        live_after = dict(zip(after.node_names, after.live_bytes))
        compared = 0
        for i, (node, live) in enumerate(zip(before.node_names, before.live_bytes)):
            if (2 * i < first or 2 * i > last) and node in live_after:
                assert live_after[node] == live, (group.key, node)
                compared += 1
        assert compared > 0
        checked += 1
    assert checked >= (2 if name == "deepseek" else 1)


@pytest.mark.parametrize("name", ["deepseek", "dflash"])
def test_skipping_trials_outside_the_span_keeps_every_decision(post_grad_graphs, name, monkeypatch):
    """The shortcut decides exactly as pricing every group on a rewritten copy does."""
    import compile_pass.capture_pass as capture_pass_module

    def decisions():
        result = run_capture_pass(fx.GraphModule(post_grad_graphs[name], copy_graph(post_grad_graphs[name].graph)[0]),
                                  "post_grad")
        assert result.error is None, result.error
        return {g.key: g.decision for g in result.groups}, result

    fast, fast_result = decisions()
    monkeypatch.setattr(capture_pass_module, "changed_span", lambda model, group: None)
    slow, _ = decisions()
    assert fast == slow
    shortcut = [g for g in fast_result.groups if "where the rewrite changes nothing" in g.reason]
    if name == "deepseek":  # MLA's k joins, one per layer, each far from the peak
        assert shortcut
    else:  # the capture group's span holds the peak: priced in full
        assert not shortcut


@pytest.mark.parametrize("name", ["deepseek", "dflash"])
@pytest.mark.parametrize("target", ["aot", "post_grad"])
def test_hoisted_plans_are_priced_as_their_rewritten_graph(post_grad_graphs, name, target):
    """``planned_peak`` on the original intervals equals the peak of the rewritten copy for
    every group the hoisting planner plans (the post_grad target: Inductor's cost model),
    on the graph as AOTAutograd makes it and with every capture producer moved right
    before its concat, as Inductor's locality reordering moves them."""
    from compile_pass.capture_pass import _trial_rewrite

    original = post_grad_graphs[name]
    for reorder in (False, True):
        gm = fx.GraphModule(original, copy_graph(original.graph)[0])
        if reorder:
            for group in find_capture_groups(gm):
                if group.decision is Decision.FOUND:
                    for c in group.captures:
                        if c.node.op == "call_function" and len(c.node.users) == 1:
                            group.cat.prepend(c.node)
        hoisted = 0
        for group in find_capture_groups(gm):
            plan_group(group, GraphFacts(gm.graph), runs_as_is=False, hoist=True)
            if group.decision is not Decision.FOUND:
                continue
            hoisted += sum(c.hoist_after is not None for c in group.captures)
            model = TARGETS[target].liveness(gm.graph, except_cat=group.cat)
            trial, _ = _trial_rewrite(gm.graph, group)
            assert trial is not None, group.reason
            assert planned_peak(model, group) == TARGETS[target].liveness(trial).peak(), \
                (group.key, reorder)
        assert hoisted > 0 or not reorder


def _liveness_facts(model):
    return (model.intervals, model.live_bytes(), model.peak(), model.keys_of,
            {key: list(nodes) for key, nodes in model.nodes_of.items() if nodes})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek", "dflash", "deepseek_dynamo"])
def test_derived_liveness_equals_a_sweep_from_scratch(request, name):
    """The plain model (from holders and last readers) and a model with ``computed_into``
    (derived from the plain one) equal the whole-graph sweep, for Inductor's own concat map
    and for random maps (values computed into later or earlier values, graph inputs,
    chains), on functional graphs and on a Dynamo graph with in-place writes."""
    from compile_pass.dataflow import NodeTable
    from compile_pass.liveness import LivenessModel

    if name == "deepseek_dynamo":
        gm = request.getfixturevalue("deepseek_graphs")["dynamo"]
    else:
        gm = request.getfixturevalue("post_grad_graphs")[name]
    table = NodeTable(gm.graph)
    target = TARGETS["dynamo_lifted" if name == "deepseek_dynamo" else "post_grad"]
    inductor = target.liveness(gm.graph, table=table)
    assert inductor.computed_into, "Inductor computes some producers into a concat here"
    maps = [dict(inductor.computed_into)]
    rng = random.Random(0)
    values = [n for n in table.nodes if table.storages[n] and n.op != "output"]
    for _ in range(20):
        maps.append({rng.choice(values): rng.choice(values) for _ in range(rng.randint(1, 12))})
    for computed_into in maps:
        computed_into = {n: t for n, t in computed_into.items() if n is not t}
        derived = LivenessModel(gm.graph, computed_into, table=table)
        swept = LivenessModel(gm.graph, computed_into, table=table, _from_scratch=True)
        assert _liveness_facts(derived) == _liveness_facts(swept)
        probe = next(iter(derived.intervals))
        assert derived.last_read(probe) == swept.last_read(probe)
    assert table.plain_liveness is not None
    assert _liveness_facts(table.plain_liveness) == _liveness_facts(
        LivenessModel(gm.graph, table=table, _from_scratch=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_concat_only_a_norm_reads_is_left_to_inductor(dtype):
    """A norm over the concat (Eagle3's ``norm_before_fc``; in bf16 it reads the concat
    through an upcast): Inductor computes the concat inside the norm's kernels, so under an
    Inductor target (the inductor inner's Dynamo graph) the group is rejected as ``FUSED_INTO_READERS``; under the eager inner (which holds the concat) it is
    priced as any other."""
    w = torch.randn(3 * 32, dtype=dtype)
    layers = [torch.randn(32, 32, dtype=dtype) / 6 for _ in range(4)]

    def f(x):
        aux, h = [], x
        for i in range(4):
            h = torch.tanh(h @ layers[i]) @ layers[i]  # two matmuls a layer
            aux.append(h + x)
        packed = torch.cat(aux[:3], dim=-1)
        pf = packed.float()
        normed = (pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
        return h, normed

    x = torch.randn(64, 32, dtype=dtype)
    for target in ("dynamo_lifted", "dynamo"):
        gm = dynamo_graph(f, x)
        (group,) = [g for g in run_capture_pass(gm, target).groups if g.k == 3]
        if target == "dynamo":  # priced as usual
            assert group.rejection is not Rejection.FUSED_INTO_READERS, group.reason
        else:
            assert group.rejection is Rejection.FUSED_INTO_READERS, (target, group.decision, group.reason)


def test_is_dtype_conversion_reads_values_not_spelling():
    from compile_pass.find import is_dtype_conversion

    def f(x):
        return x.float(), x.to(torch.float32), x.to("cpu"), x.view(-1).float(), x.reshape(4, -1)

    gm = dynamo_graph(f, torch.randn(8, 4, dtype=torch.bfloat16))
    found = {n.name: is_dtype_conversion(n) for n in gm.graph.nodes if n.op in ("call_method", "call_function")}
    conversions = [name for name, yes in found.items() if yes]
    assert len(conversions) == 3, found  # float(), to(float32), the view's float(); not to("cpu") or reshape
