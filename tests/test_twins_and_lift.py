"""Capture twins (``twins.py``) and lifted packed buffers (``lift.py``), on graphs directly.

Twins are merged on aten graphs from AOTAutograd, as Inductor's pre pass sees them; every
merged graph is run and compared bitwise with the original. Lifting runs on Dynamo graphs:
the lifted graph, called through ``WithLiftedBuffers``, must return what the original did.
"""

from __future__ import annotations

from typing import Callable, List

import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import compile_pass.ops  # noqa: F401
from compile_pass import AuxHiddenStatePacker
from compile_pass.capture_pass import run_capture_pass
from compile_pass.dataflow import NodeTable, copy_graph
from compile_pass.inductor_pass import AuxCapturePass, CaptureTwinsPass, chain_post_grad_passes
from compile_pass.lift import (LiftError, WithLiftedBuffers, copy_module, find_packed_buffers,
                               lift_packed_buffers)
from compile_pass.groups import Decision, Rejection
from compile_pass.twins import capture_values, merge_capture_twins, twin_of

pytestmark = pytest.mark.usefixtures("_fresh_dynamo")

_ADD = torch.ops.aten.add.Tensor


def _aot_graph(fn: Callable, *args) -> fx.GraphModule:
    graphs: List[fx.GraphModule] = []

    def fw(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.compile(fn, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(*args)
    return graphs[0]


def _sglang_layers(x: torch.Tensor, ws: List[torch.Tensor]) -> torch.Tensor:
    """Three layers, captures at the input of layers 1 and 2: ``aux.append(h + residual)``,
    then the layer's own ``residual = h + residual``."""
    aux, residual, h = [], x, x
    for i, w in enumerate(ws):
        if i:
            aux.append(h + residual)
            residual = h + residual
        h = torch.relu(residual @ w)
    return torch.cat([h] + aux, dim=-1)


def _inputs(n: int = 3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), [torch.randn(8, 8, generator=g) for _ in range(n)]


def test_twins_are_merged_and_values_stay_bitwise():
    x, ws = _inputs()
    gm = _aot_graph(_sglang_layers, x, ws)
    args = [x, *ws]
    expected = fx.Interpreter(gm).run(*args)
    adds_before = sum(n.target is _ADD for n in gm.graph.nodes)
    merged = merge_capture_twins(gm.graph)
    gm.recompile()
    assert len(merged) == 2  # one twin per capture
    assert sum(n.target is _ADD for n in gm.graph.nodes) == adds_before - 2
    for merge in merged:
        assert merge.op.startswith("add") and "merged into its twin" in merge.describe()
    # each capture the concat reads is now the residual the next layer reads
    table = NodeTable(gm.graph)
    for capture in capture_values(gm.graph, table):
        if capture.target is _ADD:
            assert twin_of(capture, table) is None
            assert any(u.target is torch.ops.aten.mm.default for u in capture.users)
    torch.testing.assert_close(fx.Interpreter(gm).run(*args), expected, rtol=0, atol=0)


def _projected_layers(x: torch.Tensor, fc: torch.Tensor, *ws: torch.Tensor) -> List[torch.Tensor]:
    """``_sglang_layers`` with its captures projected, as ``fuse_projection`` rewrites them:
    ``project_into_`` reads each whole capture, ``project_scaled_into_`` forms the last one
    from its two inputs."""
    acc, residual, h = x.new_empty(x.shape[0], fc.shape[0]), x, x
    for i, w in enumerate(ws):
        if i == 1:
            torch.ops.compile_pass.project_into_(acc, h + residual, fc, 0, True)
        elif i == 2:
            torch.ops.compile_pass.project_scaled_into_(acc, h, residual, "add", None, fc, x.shape[1], False)
        if i:
            residual = h + residual
        h = torch.relu(residual @ w)
    return [h, acc]


def test_a_projected_capture_is_merged_with_its_twin():
    """A capture ``project_into_`` reads whole is a capture value, so Inductor's pre pass
    merges it with the residual it equals (else Inductor holds both: one capture-sized
    buffer above the list path, found by tools/fuzz_combine under Inductor); a capture the
    op forms from ``h`` and ``residual`` itself has no value to merge."""
    x, ws = _inputs()
    fc = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    gm = _aot_graph(_projected_layers, x, fc, *ws)
    args = [x, fc, *ws]
    expected = fx.Interpreter(gm).run(*args)
    assert all(torch.equal(a, b) for a, b in zip(expected, _projected_layers(*args)))
    table = NodeTable(gm.graph)
    captured = capture_values(gm.graph, table)
    assert [n.target for n in captured] == [_ADD]  # project_into_'s; not project_scaled_into_'s pair
    merged = merge_capture_twins(gm.graph)
    gm.recompile()
    assert len(merged) == 1 and merged[0].op.startswith("add")
    torch.testing.assert_close(fx.Interpreter(gm).run(*args), expected, rtol=0, atol=0)


def test_a_capture_projected_into_a_registered_draft_is_merged_with_its_twin():
    """``project_registered_`` (``project_outputs``: the engines' one graph) given the whole
    capture reads a capture value too; traced with fake tensors, no draft registered."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def layers(x, w0, w1):
        acc, residual, h = x.new_empty(x.shape[0], 4), x, torch.relu(x @ w0)
        torch.ops.compile_pass.project_registered_(acc, h + residual, None, "", "d", "sig", 0, 1, True)
        residual = h + residual
        return torch.relu(residual @ w1), acc

    x, ws = _inputs(2)
    gm = make_fx(layers, tracing_mode="fake")(x, *ws)
    assert [n.target for n in capture_values(gm.graph)] == [_ADD]
    merged = merge_capture_twins(gm.graph)
    assert len(merged) == 1 and merged[0].op.startswith("add")
    assert sum(n.target is _ADD for n in gm.graph.nodes) == 1


def test_no_merge_across_a_mutation_of_an_argument():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first = graph.call_function(_ADD, (a, b))
    graph.call_function(torch.ops.aten.add_.Tensor, (a, b))  # a changes between the two sums
    second = graph.call_function(_ADD, (a, b))
    cat = graph.call_function(torch.ops.aten.cat.default, ([first, second], -1))
    graph.output(cat)
    for node in graph.nodes:  # fake values: one storage per placeholder
        node.meta["val"] = torch.empty(4, 2, device="meta") if node.op != "output" else None
    graph.find_nodes(op="call_function", target=torch.ops.aten.add_.Tensor)[0].meta["val"] = \
        a.meta["val"]
    table = NodeTable(graph)
    assert twin_of(first, table) is None and twin_of(second, table) is None


def test_random_and_mutating_ops_have_no_twins():
    graph = fx.Graph()
    x = graph.placeholder("x")
    r1 = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    r2 = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    graph.output(graph.call_function(torch.ops.aten.cat.default, ([r1, r2],)))
    for node in graph.nodes:
        node.meta["val"] = torch.empty(4, device="meta") if node.op != "output" else None
    table = NodeTable(graph)
    assert twin_of(r1, table) is None  # seeded random: two draws, not one value


def test_twins_pass_chains_after_a_user_pre_pass_and_keys_the_cache():
    calls = []

    def user_pass(graph: fx.Graph) -> None:
        calls.append(len(graph.nodes))

    twins = CaptureTwinsPass()
    chained = chain_post_grad_passes(user_pass, twins)
    x, ws = _inputs()
    gm = _aot_graph(_sglang_layers, x, ws)
    chained(gm.graph)
    assert calls and len(twins.merges) == 2
    # the FX graph cache key covers both passes; a plain callable makes the chain uncacheable
    assert chained.uuid() is None
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            user_pass(graph)

        def uuid(self):
            return "user-v1"

    keyed = chain_post_grad_passes(UserPass(), CaptureTwinsPass())
    assert "user-v1" in keyed.uuid() and twins.uuid() in keyed.uuid()
    assert CaptureTwinsPass().uuid() == twins.uuid() != AuxCapturePass().uuid()


# --------------------------------------------------------------------------- lifting


def _dynamo_graph(fn: Callable, *args) -> fx.GraphModule:
    graphs: List[fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.mark_dynamic(args[0], 0)
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _packer_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    aux = AuxHiddenStatePacker(3)
    h = x
    for _ in range(3):
        h = torch.relu(h @ w)
        aux.append(h + 1)
    return aux.finalize()


def _call_as_dynamo(gm: fx.GraphModule, x: torch.Tensor, w: torch.Tensor, lifted=None):
    """Call a Dynamo graph (symbolic token count first, then the tensors)."""
    values = []
    tensors = iter([x, w])
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name.endswith("_input"):
            continue
        value = node.meta["example_value"]
        values.append(x.shape[0] if isinstance(value, torch.SymInt) else next(tensors))
    fn = WithLiftedBuffers(gm.forward, lifted) if lifted is not None else gm.forward
    return fn(*values)


def test_a_packers_buffer_is_lifted_and_allocated_per_call():
    x, w = torch.randn(12, 8), torch.randn(8, 8)
    gm = _dynamo_graph(_packer_model, x, w)
    (buffer,) = find_packed_buffers(gm.graph)
    before = gm.code
    lifted_gm = copy_module(gm)
    lifted = lift_packed_buffers(lifted_gm)
    lifted_gm.recompile()
    assert gm.code == before  # Dynamo's own graph is not changed
    assert lifted is not None and len(lifted) == 1 and find_packed_buffers(lifted_gm.graph) == []
    spec = lifted.buffers[0]
    assert spec.dtype == torch.float32 and len(spec.sizes) == 2 and spec.sizes[1] == 24
    assert not isinstance(spec.sizes[0], int)  # the token count stays symbolic
    placeholders = [n for n in lifted_gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[-1].name == spec.name and lifted.num_inputs == len(placeholders) - 1
    for tokens in (12, 5):  # one graph, every token count
        xt = torch.randn(tokens, 8)
        expected = _packer_model(xt, w)
        (out,) = _call_as_dynamo(lifted_gm, xt, w, lifted)
        assert out.shape == (tokens, 24) and torch.equal(out, expected)


def test_a_size_no_input_carries_cannot_be_lifted():
    x, w = torch.randn(12, 8), torch.randn(8, 8)
    gm = _dynamo_graph(_packer_model, x, w)
    for node in gm.graph.nodes:  # forget where the token count comes from
        if node.op == "placeholder":
            value = node.meta["example_value"]
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] != 8:
                node.meta["example_value"] = torch.empty(12, 8, device="meta")
            elif isinstance(value, torch.SymInt):
                node.meta["example_value"] = 12
    before = gm.code
    with pytest.raises(LiftError, match="is not read off any graph input"):
        lift_packed_buffers(gm)
    gm.recompile()
    assert gm.code == before  # nothing lifted


def test_lifted_target_prices_the_buffer_from_the_start():
    x, ws = _inputs(4)
    gm = _dynamo_graph(_sglang_layers, x, ws)
    result = run_capture_pass(fx.GraphModule(gm, copy_graph(gm.graph)[0]), "dynamo_lifted",
                              cost_model=False)
    (group,) = [g for g in result.groups if g.k == 4]
    assert group.placement == "dynamo_lifted" and group.depth_span >= 2
    assert group.estimated_peak_after >= group.packed_bytes


def _peak_first(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The peak comes before the first capture: a 16-wide temporary, gone by then; the
    captures are a layer (two matmuls) apart."""
    scale = torch.tanh(x.repeat(1, 16)).sum(-1, keepdim=True)
    c1 = (x * scale) @ w1
    c2 = torch.relu(torch.relu(c1) @ w2) @ w1
    return torch.cat([c1, c2], dim=-1)


def _decide_lifted(fn: Callable, *args):
    gm = _dynamo_graph(fn, *args)
    result = run_capture_pass(gm, "dynamo_lifted")
    (group,) = [g for g in result.groups if g.estimated_peak_before is not None]
    return group


def test_lifted_rewrite_is_rejected_where_the_list_path_is_clearly_cheaper():
    x, w = torch.randn(64, 8), torch.randn(8, 8)
    group = _decide_lifted(_peak_first, x, w, w)
    # a lifted buffer lives through the early peak; the list path's concat comes after it
    assert group.decision is Decision.REJECT and group.depth_span >= 2
    assert group.rejection is Rejection.LIFTED_CANNOT_PAY and group.reason.startswith("estimated peak would rise")
    assert group.estimated_peak_after > group.estimated_peak_before + group.packed_bytes // 2


def test_lifted_rewrite_is_taken_within_one_capture_of_the_list_path():
    x, ws = _inputs(4)
    group = _decide_lifted(_sglang_layers, x, ws)
    assert group.decision is Decision.REWRITE
    capture = group.packed_bytes // group.k
    assert group.estimated_peak_after <= group.estimated_peak_before + capture
    if group.estimated_peak_after >= group.estimated_peak_before:
        assert "within one capture of the list path" in group.reason


def _engine_style(x: torch.Tensor, ws: List[torch.Tensor]) -> torch.Tensor:
    """Captures of ``h + residual`` that nothing else reads (the residual is updated by an
    op of its own, as a fused in-place add-RMSNorm does): no twin."""
    aux, residual, h = [], x * 1.0, x
    for i, w in enumerate(ws):
        if i:
            aux.append(h + residual)
        residual = torch.addcmul(residual, h, h)
        h = torch.relu(residual @ w)
    return torch.cat(aux, dim=-1)


@pytest.mark.parametrize("fn, strategy", [(_engine_style, "compute into slice (op)"),
                                          (_sglang_layers, "copy")])
def test_capture_only_arithmetic_is_computed_into_its_slice(fn, strategy):
    """Under the lifted target an add read only by the concat, without a twin, becomes
    ``binary_into_slice_`` (no temporary); an add with a twin stays a copy (Inductor merges
    it with the model's own add)."""
    x, ws = _inputs(4)
    gm = _dynamo_graph(fn, x, ws)
    work = copy_module(gm)
    result = run_capture_pass(work, "dynamo_lifted", cost_model=False)
    (group,) = [g for g in result.groups if g.decision is Decision.REWRITE]
    computed = [c for c in group.captures if c.producer.value == "exact arithmetic"]
    assert computed and all(c.strategy.value == strategy for c in computed)
    binary_into = [n for n in work.graph.nodes if n.target is torch.ops.compile_pass.binary_into_slice_.default]
    assert bool(binary_into) == (strategy != "copy")
    expected = fn(x, ws)
    (out,) = _call_lifted(work, result.lifted, x, ws)
    assert torch.equal(out, expected)


def _packer_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    aux = AuxHiddenStatePacker(3)
    h, r = x, x * 0.5
    for _ in range(3):
        h = torch.relu(h @ w)
        aux.append(h + r)  # read by the packer alone
        r = r * 2.0
    return aux.finalize()


def test_a_packers_sums_are_computed_into_the_lifted_buffer():
    x, w = torch.randn(12, 8), torch.randn(8, 8)
    gm = _dynamo_graph(_packer_sums, x, w)
    work = copy_module(gm)
    result = run_capture_pass(work, "dynamo_lifted")
    assert result.lifted is not None and result.writes_computed_into == 3
    targets = [n.target for n in work.graph.nodes]
    assert targets.count(torch.ops.compile_pass.write_slice_.default) == 0
    assert targets.count(torch.ops.compile_pass.binary_into_slice_.default) == 3
    (out,) = _call_as_dynamo(work, x, w, result.lifted)
    assert torch.equal(out, _packer_sums(x, w))


def _call_lifted(gm: fx.GraphModule, lifted, x: torch.Tensor, ws: List[torch.Tensor]):
    values, tensors = [], iter([x, *ws])
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name.endswith("_input"):
            continue
        value = node.meta["example_value"]
        values.append(x.shape[0] if isinstance(value, torch.SymInt) else next(tensors))
    return WithLiftedBuffers(gm.forward, lifted)(*values)


def _twin_concats(x: torch.Tensor, w: torch.Tensor):
    a = x @ w
    b = torch.relu(torch.relu(a) @ w) @ w
    return torch.cat([a, b], dim=-1), torch.cat([a, b], dim=-1)  # the same concat twice


def test_twin_concats_share_one_storage_without_a_cycle():
    """Two identical concats returned (twins of each other) with the same inputs: Inductor's
    model maps the later concat to the earlier and their inputs into the earlier one."""
    from compile_pass.cost import inductor_shared_storages
    from compile_pass.find import find_capture_groups

    x, w = torch.randn(16, 8), torch.randn(8, 8)
    gm = _dynamo_graph(_twin_concats, x, w)
    table = NodeTable(gm.graph)
    cats = [g.cat for g in find_capture_groups(gm, table)]
    assert len(cats) == 2
    shared = inductor_shared_storages(table, {cats[1]: cats[0]}, groups=find_capture_groups(gm, table))
    assert shared[cats[1]] == cats[0]
    inputs = cats[0].args[0]
    assert all(shared[a] == cats[0] for a in inputs)


@pytest.mark.parametrize("seed", [20, 90])
def test_a_second_group_is_priced_after_the_first_is_rewritten(seed):
    """Fuzz cases with a second concat over the first's captures: once the first group is
    rewritten its concat is gone, and the second is priced on the new graph (it raised
    KeyError before: Inductor's concat model read the first group's erased concat)."""
    from tools.fuzz import build_case, random_spec

    spec = random_spec(seed)
    module, inputs = build_case(spec)
    graphs: List[fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*[t.clone() for t in inputs])
    result = run_capture_pass(copy_module(graphs[-1]), "dynamo_lifted", cost_model=False)
    assert result.error is None
    assert sum(g.decision is Decision.REWRITE for g in result.groups) >= 2


def test_a_working_copys_code_before_is_read_from_its_original():
    """A caller that owns the graph a working copy was made from hands it as ``original``:
    the code before is generated from it only when read, and it is the graph before the
    rewrite."""
    x, w = torch.randn(12, 8), torch.randn(8, 8)
    gm = _dynamo_graph(_packer_model, x, w)
    expected = gm.graph.python_code("self").src
    work = copy_module(gm)
    result = run_capture_pass(work, "dynamo_lifted", original=gm.graph)
    assert result.error is None and result.lifted is not None
    assert result._code_before is None  # nothing generated during the pass
    assert result.code_before == expected
    assert result.code_after != result.code_before
