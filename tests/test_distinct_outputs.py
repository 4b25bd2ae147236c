"""Outputs kept distinct from mutated inputs (``distinct_outputs.py``, ``DistinctOutputsPass``)
and one compile over a symbolic token count (``benchmarks/dynamic_tokens.py``).

Budget: the graph-level tests trace AOT graphs only; the Inductor tests compile the
communicator-style held-out decoder (models/communicator.py, 4 layers, 9 pieces when split)
once per configuration, the FX graph cache shared between them.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func


import models.communicator as communicator  # noqa: E402
from compile_pass import aux_capture_backend, pack_aux_hidden_states  # noqa: E402
from compile_pass.distinct_outputs import (RETURNED_COPY, keep_outputs_distinct,  # noqa: E402
                                           mark_returned_copies)

pytestmark = pytest.mark.usefixtures("_fresh_dynamo")  # tests/conftest.py

_W = torch.randn(8)


def _fused_then_clone(h, r):
    """The stock-Inductor reproduction: a mutating custom op, then a clone of what it mutated."""
    torch.ops.comm_test.fused_add_rmsnorm_(h, r, _W)
    return r.clone(), h * 2


def _add_then_clone(h, r):
    """The same with an aten in-place op: Inductor gives the sum a buffer of its own."""
    r.add_(h)
    return r.clone(), h * 2


def _aot_forward_graph(fn, *args) -> fx.GraphModule:
    graphs: List[fx.GraphModule] = []

    def forward(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.compile(fn, backend=aot_autograd(fw_compiler=forward, keep_inference_input_mutations=True),
                  fullgraph=True)(*args)
    return graphs[0]


def _after_noop_removal(gm: fx.GraphModule, marked: int) -> fx.Graph:
    """The AOT graph as Inductor's custom post pass sees it: the joint pre pass tagged
    ``marked`` values, then ``remove_noop_ops`` ran."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    assert len(mark_returned_copies(gm.graph)) == marked
    remove_noop_ops(gm.graph)
    return gm.graph


def test_only_returned_copies_of_values_written_back_into_inputs_are_cloned():
    h, r = torch.randn(4, 8), torch.randn(4, 8)
    graph = _after_noop_removal(_aot_forward_graph(_fused_then_clone, h.clone(), r.clone()), marked=1)
    output = next(iter(reversed(graph.nodes)))
    returned = output.args[0][0]
    assert returned.op == "call_function" and "getitem" in returned.name  # the clone is gone
    assert returned.meta[RETURNED_COPY]
    replaced = keep_outputs_distinct(graph)
    assert replaced == [returned]
    new = output.args[0][0]
    assert new.target is torch.ops.aten.clone.default and new.args == (returned,)
    assert new.meta["val"].shape == returned.meta["val"].shape
    graph.lint()
    assert keep_outputs_distinct(graph) == []  # idempotent: the clone is an output of its own

    plain = _after_noop_removal(_aot_forward_graph(_add_then_clone, h.clone(), r.clone()), marked=0)
    assert keep_outputs_distinct(plain) == []  # an aten result copied back: no extra copy


def _write_then_return_views(buf, h):
    """What ``pack_outputs`` compiles to with a lifted buffer: writes into a buffer the caller
    passes, then returns its slices (meant to alias it)."""
    torch.ops.compile_pass.write_slice_(buf, h * 2, 1, 0)
    torch.ops.compile_pass.write_slice_(buf, h * 3, 1, 8)
    return buf[:, :8], buf[:, 8:]


def test_views_meant_to_alias_a_written_input_are_not_cloned():
    import compile_pass.ops  # noqa: F401  (registers compile_pass::write_slice_)

    buf, h = torch.zeros(4, 16), torch.randn(4, 8)
    graph = _after_noop_removal(_aot_forward_graph(_write_then_return_views, buf, h), marked=0)
    assert keep_outputs_distinct(graph) == []


@pytest.mark.inductor
@pytest.mark.compat
def test_inductor_returns_a_copy_not_the_mutated_input():
    h, r = torch.randn(4, 8), torch.randn(4, 8)
    expected, _ = _fused_then_clone(h.clone(), r.clone())
    backend = aux_capture_backend("inductor", rewrite=False)
    with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit runs no pass
        capture, _ = torch.compile(_fused_then_clone, backend=backend, fullgraph=True)(h, r)
    assert capture.data_ptr() != r.data_ptr()
    assert backend.outputs_kept_distinct  # Inductor would have returned the input
    r.add_(1.0)  # the next layer's fused op, in place
    assert torch.equal(capture, expected)


_CONFIGS = {
    "pass off": dict(rewrite=False),
    "pass on": dict(),
    "pack_outputs": dict(pack_outputs=True),
    "cost model off": dict(pack_outputs=True, cost_model=False),
    "cat in the graph": dict(cat_inside=True),
}


@pytest.mark.inductor
@pytest.mark.parametrize("config", list(_CONFIGS))
def test_piecewise_inductor_captures_equal_the_uncompiled_model(config):
    """The held-out communicator decoder split at its attention op, pieces by Inductor: every
    configuration returns the uncompiled model's captures (all K held the last residual
    before DistinctOutputsPass)."""
    options = dict(_CONFIGS[config])
    cat_inside = options.pop("cat_inside", False)
    model, x = communicator.build(tokens=64, cat_inside=cat_inside)
    ref_hidden, ref_aux = model(x)
    ref = ref_aux if cat_inside else torch.cat(ref_aux, -1)
    backend = aux_capture_backend("inductor", split_ops=communicator.SPLIT_OPS, **options)
    uncached = config == "pass off"  # a cache hit runs no pass: see the pass work once
    with torch._inductor.config.patch(fx_graph_cache=not uncached):
        hidden, aux = torch.compile(model, backend=backend, fullgraph=True)(x)
    packed = aux if cat_inside else pack_aux_hidden_states(aux)
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    assert backend.splits and backend.splits[0].num_pieces == 5
    if uncached:
        assert backend.outputs_kept_distinct  # the hazard: 2 captures would be the residual
    if options.get("pack_outputs"):
        assert packed._base is not None  # the caller's pack is a view (a tie is rewritten)


# --------------------------------------------------------------------------- dynamic token counts


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_one_compile_serves_every_token_count(inner):
    from dynamic_tokens import run_sweep

    rows = run_sweep("dflash", "capture_dominated", [64, 160], [inner], k=4, num_layers=4)
    assert {r["scenario"] for r in rows} == {"cat", "outputs", "split"}
    for row in rows:
        assert row["recompiles"] == 0, row
        if row["variant"] != "none":
            assert row["bitwise_equal"] and row["equals_uncompiled"], row
    for row in rows:
        if row["variant"] == "list+pass":
            same = [r for r in rows if r["variant"] == "list" and r["scenario"] == row["scenario"]
                    and r["tokens"] == row["tokens"]]
            assert row["peak_bytes"] <= same[0]["peak_bytes"], row
            assert row["groups_rewritten"] >= 1
            if row["scenario"] == "outputs":
                assert row["pack_is_view"]


@pytest.mark.inductor
def test_one_inductor_compile_serves_every_token_count():
    from dynamic_tokens import run_sweep

    rows = run_sweep("dflash", "capture_dominated", [64, 160], ["inductor"], scenarios=["split", "outputs"],
                     k=4, num_layers=4)
    for row in rows:
        assert row["recompiles"] == 0, row
        if row["variant"] != "none":
            assert row["bitwise_equal"] and row["equals_uncompiled"], row
        if row["variant"] == "list+pass":
            # the packed bytes and nothing more: returned slices of the lifted buffer are views,
            # not copies (a DistinctOutputsPass that cloned every written-back output: 8.7)
            assert row["overhead"] <= 1.05, row
            if row["scenario"] == "outputs":
                assert row["pack_is_view"], row
