"""The ``aux_capture`` torch.compile backend: entry point, inners, options, counters,
dynamic shapes, Inductor, the Inductor post-grad pass and the FX graph cache, failure
containment, and mutation semantics of the rewrite.

Budget: everything but the ``inductor``-marked tests runs the eager/aot_eager inners. The
Inductor tests compile the tiny Llama (fused_norm) three times (one module-scoped
reference shared by two tests) plus a few compiles of tiny hand-written functions.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import re
import warnings
from typing import Counter, List, Tuple

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._dynamo.utils import counters


import compile_pass  # noqa: E402
import compile_pass.capture_pass as capture_pass  # noqa: E402
import models.dflash  # noqa: E402
import models.llama  # noqa: E402
from compile_pass import (  # noqa: E402
    AuxCaptureBackend,
    Decision,
    Rejection,
    PassResult,
    Producer,
    Strategy,
    aux_capture_backend,
)
from compile_pass.backend import INNERS, MODES, aux_capture, backend_from_options  # noqa: E402
from compile_pass.dataflow import copy_graph  # noqa: E402
from compile_pass.inductor_pass import (AuxCapturePass, CaptureTwinsPass,  # noqa: E402
                                        DistinctOutputsPass, ReturnedCopiesPass)

WRITE = torch.ops.compile_pass.write_slice_.default


#: every test starts from a clean Dynamo cache and clean counters, without autograd
pytestmark = pytest.mark.usefixtures("_fresh_dynamo")  # tests/conftest.py


# --------------------------------------------------------------------------- helpers


def _tiny(tokens: int = 32, **overrides):
    return models.llama.tiny(capture_mode="list", tokens=tokens, **overrides)


def _assert_bitwise(out, ref) -> None:
    assert isinstance(out, tuple) and len(out) == len(ref)
    for i, (a, b) in enumerate(zip(out, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"output {i}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert torch.equal(a, b), f"output {i} differs (max abs diff {(a - b).abs().max().item()})"


def _assert_compiles_bitwise(model, inputs, backend, **compile_options) -> None:
    """``torch.compile(model, backend=backend, **compile_options)`` returns what the
    uncompiled model returns, bitwise."""
    ref = model(*inputs)
    _assert_bitwise(torch.compile(model, backend=backend, **compile_options)(*inputs), ref)


def _aux_group(result: PassResult, k: int):
    """The capture group of the model's K-way aux concat (RoPE's concats have k == 2)."""
    groups = [g for g in result.groups if g.k == k]
    assert len(groups) == 1, [(g.cat.name, g.k) for g in result.groups]
    return groups[0]


@dataclasses.dataclass
class RecordingBackend(AuxCaptureBackend):
    """The aux_capture backend keeping the graph each pass run saw and left (vLLM's
    TestBackend shape): tests check nodes, not generated code."""

    graphs_before: List[fx.Graph] = dataclasses.field(default_factory=list)
    graphs_after: List[fx.Graph] = dataclasses.field(default_factory=list)

    def _rewrite(self, gm, target, concat=True, pack_outputs=False):
        self.graphs_before.append(copy_graph(gm.graph)[0])
        return super()._rewrite(gm, target, concat, pack_outputs)

    def _on_result(self, result, graph):
        self.graphs_after.append(copy_graph(graph)[0])


def _targets(graph: fx.Graph) -> Counter:
    """How often each op is called in ``graph`` (calls of functions, methods and ops)."""
    return collections.Counter(n.target for n in graph.nodes if n.op in ("call_function", "call_method"))


CATS = (torch.cat, torch.ops.aten.cat.default)


def _is_write(node: fx.Node) -> bool:
    """A write into the packed buffer: write_slice_, or an out= recomputation."""
    return node.op == "call_function" and (node.target is WRITE or (
        isinstance(node.target, torch._ops.OpOverload) and node.target._overloadname == "out"))


def _num_writes(graph: fx.Graph) -> int:
    return sum(map(_is_write, graph.nodes))


def _decisions(results: List[PassResult]) -> Tuple[int, int, int]:
    groups = [g for r in results for g in r.groups]
    return (len(groups), sum(g.decision is Decision.REWRITE for g in groups),
            sum(g.decision is Decision.REJECT for g in groups))


def _tiny_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) + 1


# --------------------------------------------------------------------------- 1. entry point and callables


def test_entry_point_registers_the_backend():
    assert "aux_capture" in torch._dynamo.list_backends(exclude_tags=())
    assert torch._dynamo.lookup_backend("aux_capture") is aux_capture


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_by_name_bitwise_equal_to_eager(inner):
    model, inputs = _tiny()
    ref = model(*inputs)
    compiled = torch.compile(model, backend="aux_capture", options={"inner": inner}, fullgraph=True)
    _assert_bitwise(compiled(*inputs), ref)
    _assert_bitwise(compiled(*inputs), ref)  # second call: the cached compiled graph
    assert counters["aux_capture"]["groups_found"] >= 1
    assert counters["aux_capture"]["pass_errors"] == 0


def test_callable_backend_bitwise_equal_to_eager():
    model, inputs = _tiny()
    backend = compile_pass.aux_capture_backend(inner="eager")
    assert isinstance(backend, AuxCaptureBackend)
    _assert_compiles_bitwise(model, inputs, backend, fullgraph=True)
    assert len(backend.results) == 1 and backend.results[0].target == "dynamo"


# --------------------------------------------------------------------------- 2. what the rewrite does


def test_forced_rewrite_on_dynamo_graph_eager_inner():
    model, inputs = _tiny()
    k = model.num_captures
    backend = RecordingBackend(inner="eager", cost_model=False, keep_code_before=True)
    _assert_compiles_bitwise(model, inputs, backend, fullgraph=True)

    assert len(backend.results) == 1
    result = backend.results[0]
    assert result.error is None and result.target == "dynamo" and result.changed
    group = _aux_group(result, k)
    assert group.decision is Decision.REWRITE
    assert "rewritten because the cost model is off" in group.reason
    assert group.placement == "dynamo"
    assert group.widths == (model.config.hidden_size,) * k
    assert [c.offset for c in group.captures] == [i * model.config.hidden_size for i in range(k)]
    # the "add" capture producer is correctly rounded arithmetic: computed into its slice
    assert all(c.producer is Producer.EXACT_ARITHMETIC for c in group.captures)
    assert all(c.strategy is Strategy.COMPUTE_INTO for c in group.captures)

    (before,), (after,) = backend.graphs_before, backend.graphs_after
    cats_before, cats_after = (sum(_targets(g)[c] for c in CATS) for g in (before, after))
    assert cats_before - cats_after == 1  # only the K-way cat went
    assert cats_after >= 1  # RoPE's rotate-half cats stay
    assert _num_writes(before) == 0 and _num_writes(after) == k
    (buffer,) = [n for n in after.nodes if n.name == "aux_packed"]
    assert after.output_node().args[0][1] is buffer  # the model returns the buffer itself
    for write in filter(_is_write, after.nodes):  # every write lands in it (or a slot view of it)
        dest = write.kwargs.get("out", write.args[0])
        assert dest is buffer or buffer in dest.all_input_nodes, write.format_node()
    assert "aux_packed" in result.code_after and "aux_packed" not in result.code_before
    assert result.counts == {"groups_found": len(result.groups), "groups_rewritten": 1,
                             "groups_rejected": len(result.groups) - 1, "groups_projected": 0}


def test_forced_rewrite_on_aot_graph_aot_eager_inner():
    model, inputs = _tiny()
    k = model.num_captures
    backend = RecordingBackend(inner="aot_eager", cost_model=False, keep_code_before=True)
    _assert_compiles_bitwise(model, inputs, backend, fullgraph=True)

    assert len(backend.results) == 1
    result = backend.results[0]
    assert result.error is None and result.target == "aot"
    assert _aux_group(result, k).decision is Decision.REWRITE
    (before,), (after,) = backend.graphs_before, backend.graphs_after
    assert _targets(before)[torch.cat] == 0  # aten IR
    assert _targets(before)[torch.ops.aten.cat.default] - _targets(after)[torch.ops.aten.cat.default] == 1
    assert any(n.name == "aux_packed" for n in after.nodes)
    assert _num_writes(after) == k


def test_cost_model_keeps_tiny_graph_unchanged():
    model, inputs = _tiny()
    backend = AuxCaptureBackend(inner="eager")
    _assert_compiles_bitwise(model, inputs, backend)
    result = backend.results[0]
    group = _aux_group(result, model.num_captures)
    assert group.decision is Decision.REJECT
    assert group.rejection is Rejection.NO_SAVING and group.reason.startswith("estimated peak would not drop")
    assert group.estimated_peak_after >= group.estimated_peak_before
    assert not result.changed and result.code_after == result.code_before


def test_cost_model_rewrites_capture_dominated_dflash():
    model, inputs = models.dflash.capture_dominated(capture_mode="list", tokens=1024)
    k = model.num_captures
    assert k == 8
    backend = RecordingBackend(inner="eager")  # cost model on
    _assert_compiles_bitwise(model, inputs, backend)
    group = _aux_group(backend.results[0], k)
    assert group.decision is Decision.REWRITE, group.reason
    assert group.estimated_peak_after < group.estimated_peak_before
    assert re.match(r"estimated peak .* -> .* \(-\d+%\)$", group.reason), group.reason
    assert _num_writes(backend.graphs_after[0]) == k
    assert counters["aux_capture"]["groups_rewritten"] == 1


# --------------------------------------------------------------------------- 3. rewrite=False and counters


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_rewrite_false_records_nothing(inner):
    model, inputs = _tiny()
    backend = AuxCaptureBackend(inner=inner, rewrite=False, cost_model=False)
    _assert_compiles_bitwise(model, inputs, backend)
    assert backend.results == []
    assert sum(counters["aux_capture"].values()) == 0


def test_rewrite_false_by_name():
    model, inputs = _tiny()
    ref = model(*inputs)
    compiled = torch.compile(model, backend="aux_capture", options={"inner": "eager", "rewrite": False})
    _assert_bitwise(compiled(*inputs), ref)
    assert sum(counters["aux_capture"].values()) == 0


@pytest.mark.parametrize("cost_model", [True, False], ids=["cost_model", "forced"])
def test_counters_match_pass_decisions(cost_model):
    model, inputs = _tiny()
    backend = AuxCaptureBackend(inner="eager", cost_model=cost_model)
    torch.compile(model, backend=backend)(*inputs)
    found, rewritten, rejected = _decisions(backend.results)
    c = counters["aux_capture"]
    assert c["groups_found"] >= 1
    assert (c["groups_found"], c["groups_rewritten"], c["groups_rejected"]) == (found, rewritten, rejected)
    assert found == rewritten + rejected  # no group left undecided
    assert rewritten == (0 if cost_model else 1)
    assert c["pass_errors"] == 0
    # counters accumulate over compiles
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    assert counters["aux_capture"]["groups_found"] == 2 * found
    assert counters["aux_capture"]["groups_rewritten"] == 2 * rewritten


# --------------------------------------------------------------------------- 4. dynamic shapes


def test_dynamic_true_one_compile_for_two_token_counts():
    model, inputs16 = _tiny(tokens=16)
    inputs40 = models.llama.example_inputs(model.config, 40, seed=1)
    k, hidden = model.num_captures, model.config.hidden_size
    backend = AuxCaptureBackend(inner="eager", cost_model=False)
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    for inputs in (inputs16, inputs40):
        out = compiled(*inputs)
        _assert_bitwise(out, model(*inputs))
        assert out[1].shape == (inputs[0].shape[0], k * hidden)
    assert len(backend.results) == 1
    assert counters["stats"]["unique_graphs"] == 1
    assert _aux_group(backend.results[0], k).decision is Decision.REWRITE
    (alloc,) = [ln for ln in backend.results[0].code_after.splitlines() if "aux_packed = " in ln]
    assert "[16," not in alloc and f", {k * hidden}]" in alloc  # symbolic token dim


def test_mark_dynamic_with_dynamic_none():
    model, inputs16 = _tiny(tokens=16)
    inputs40 = models.llama.example_inputs(model.config, 40, seed=1)
    ids, pos = (t.clone() for t in inputs16)
    # positions index the RoPE cache and meet input_ids' rows, so both carry the token dim
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    backend = AuxCaptureBackend(inner="aot_eager", cost_model=False)
    compiled = torch.compile(model, backend=backend, dynamic=None)
    _assert_bitwise(compiled(ids, pos), model(*inputs16))
    out40 = compiled(*inputs40)
    _assert_bitwise(out40, model(*inputs40))
    assert out40[1].shape == (40, model.num_captures * model.config.hidden_size)
    assert len(backend.results) == 1
    assert _aux_group(backend.results[0], model.num_captures).decision is Decision.REWRITE


# --------------------------------------------------------------------------- 5. option errors

OPTION_ERRORS = [
    ({"innr": "eager"}, ValueError, r"unknown option\(s\) \['innr'\] for aux_capture"),
    ({"inner": "tvm"}, ValueError, r"unknown inner compiler 'tvm' for aux_capture"),
    ({"inner": 3}, TypeError, r"inner must be a name or a callable, got int"),
    ({"inner": "eager", "rewrite": "yes"}, TypeError, r"option 'rewrite' must be a bool, got 'yes'"),
    ({"inner": "eager", "cost_model": 1}, TypeError, r"option 'cost_model' must be a bool, got 1"),
    ({"inner": "eager", "max_autotune": True}, ValueError,
     r"Inductor options \['max_autotune'\] apply to the inductor inner only, not to inner=eager"),
    ({"inner": "aot_eager", "max_autotune": True}, ValueError, r"not to inner=aot_eager"),
]


@pytest.mark.parametrize("options,exc,match", OPTION_ERRORS,
                         ids=["unknown-key", "unknown-inner", "inner-int", "rewrite-str",
                              "cost-model-int", "inductor-opt-eager", "inductor-opt-aot"])
def test_backend_from_options_errors(options, exc, match):
    with pytest.raises(exc, match=match):
        backend_from_options(None, options)


@pytest.mark.parametrize("mode,options,exc,match", [
    ("fast", None, ValueError, r"unknown mode 'fast' for aux_capture"),
    ("fast", {"inner": "eager"}, ValueError, r"unknown mode 'fast'"),
    ("reduce-overhead", {"inner": "eager"}, ValueError,
     r"mode='reduce-overhead' applies to the inductor inner only, not to inner=eager"),
    ("max-autotune", {"inner": "aot_eager"}, ValueError, r"mode='max-autotune' applies to the inductor inner only"),
    (None, [("inner", "eager")], TypeError, r"options must be a dict, got list"),
    (None, "eager", TypeError, r"options must be a dict, got str"),
], ids=["unknown-mode", "unknown-mode-eager", "reduce-overhead-eager", "max-autotune-aot", "options-list",
        "options-str"])
def test_mode_and_options_type_errors(mode, options, exc, match):
    with pytest.raises(exc, match=match):
        backend_from_options(mode, options)


def test_direct_constructor_errors():
    with pytest.raises(TypeError, match="inner must be a name or a callable, got NoneType"):
        AuxCaptureBackend(inner=None)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['not_a_config'\]"):
        aux_capture_backend(not_a_config=1)
    with pytest.raises(TypeError, match="option 'rewrite' must be a bool"):
        aux_capture_backend("eager", rewrite=1)
    # a callable inner takes no mode or Inductor options either
    with pytest.raises(ValueError, match="not to inner=_tiny_fn"):
        aux_capture_backend(_tiny_fn, mode="max-autotune")


@pytest.mark.parametrize("make", [
    lambda: aux_capture_backend("cudagraphs"),
    lambda: AuxCaptureBackend(inner="cudagraphs"),
    lambda: backend_from_options(None, {"inner": "cudagraphs"}),
    lambda: backend_from_options(None, {"inner": "cudagraphs", "split_ops": ["models::attention"]}),
], ids=["aux_capture_backend", "constructor", "options", "options-split"])
def test_removed_cudagraphs_inner_names_the_alternatives(make):
    """The inner is gone (it captured on AOTAutograd's fake tensors and copied aux_out);
    the error says so and names both ways to CUDA graphs that remain."""
    assert "cudagraphs" not in INNERS
    with pytest.raises(ValueError, match="inner='cudagraphs' was removed") as info:
        make()
    message = str(info.value)
    assert "mode='reduce-overhead'" in message and "CudaGraphRunner" in message, message


def test_removed_cudagraphs_inner_through_torch_compile():
    compiled = torch.compile(_tiny_fn, backend=aux_capture, options={"inner": "cudagraphs"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="inner='cudagraphs' was removed"):
        compiled(torch.randn(4))


def test_valid_modes_and_options_construct():
    for mode in MODES:
        assert AuxCaptureBackend(mode=mode).mode == mode
    for inner in INNERS:
        backend = backend_from_options(None, {"inner": inner, "rewrite": False, "cost_model": False})
        assert (backend.inner, backend.rewrite, backend.cost_model) == (inner, False, False)
    backend = backend_from_options("max-autotune-no-cudagraphs", {"epilogue_fusion": False})
    assert backend.inner == "inductor" and backend.inductor_options == {"epilogue_fusion": False}
    assert backend_from_options("default", {"inner": "eager"}).mode == "default"


@pytest.mark.parametrize("kwargs", [dict(mode="lite"), dict(options={"use_post_grad_passes": False})],
                         ids=["mode-lite", "post-grad-passes-off"])
def test_lite_mode_turns_the_pass_off_out_loud(monkeypatch, kwargs):
    """Inductor's lite mode skips every post-grad and joint-graph pass, this project's too:
    the backend says so (a warning and a counter) and compiles as with ``rewrite=False``,
    never a silently half-applied pass."""
    import compile_pass.backend as backend_module

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches))
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    monkeypatch.setattr(backend_module, "_post_grad_off_warned", [])
    torch._dynamo.reset()
    before = counters["aux_capture"]["post_grad_passes_off"]
    x = torch.randn(4)
    with pytest.warns(RuntimeWarning, match=r"post-grad and joint-graph passes are off .*lite mode.*"
                                            r"capture pass needs them, so it is off"):
        out = torch.compile(_tiny_fn, backend="aux_capture", **kwargs)(x)
    assert torch.equal(out, _tiny_fn(x))
    assert counters["aux_capture"]["post_grad_passes_off"] == before + 1
    # the pass-off compile: no capture-twins pre pass, only the distinct-outputs pair
    assert "post_grad_custom_pre_pass" not in seen[-1]
    assert isinstance(seen[-1]["post_grad_custom_post_pass"], DistinctOutputsPass)


@pytest.mark.parametrize("kwargs,match", [
    (dict(options={"innr": "eager"}), r"unknown option\(s\) \['innr'\]"),
    (dict(options={"inner": "tvm"}), r"unknown inner compiler 'tvm'"),
    (dict(mode="fast"), r"unknown mode 'fast'"),
], ids=["unknown-key", "unknown-inner", "unknown-mode"])
def test_option_errors_through_torch_compile(kwargs, match):
    compiled = torch.compile(_tiny_fn, backend="aux_capture", **kwargs)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=match):
        compiled(torch.randn(4))


def test_mode_and_inductor_options_reach_compile_fx(monkeypatch):
    """The patches handed to compile_fx (spied: no Inductor compile happens)."""
    import torch._inductor.compile_fx
    import torch._inductor.config as inductor_config
    import torch._inductor.custom_graph_pass
    from torch._inductor import list_mode_options

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches))
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    x = torch.randn(4)
    mode_options = list_mode_options("max-autotune-no-cudagraphs")
    assert mode_options["max_autotune"] is True

    def compile_and_pop_passes(backend, **kwargs):
        torch._dynamo.reset()
        out = torch.compile(_tiny_fn, backend=backend, **kwargs)(x)
        assert torch.equal(out, _tiny_fn(x))
        # every Inductor compile: returned copies tagged before Inductor drops clones
        assert isinstance(seen[-1].pop("joint_custom_pre_pass", None), ReturnedCopiesPass)
        return (seen[-1].pop("post_grad_custom_pre_pass", None),
                seen[-1].pop("post_grad_custom_post_pass", None))

    # the pass runs on the Dynamo graph; Inductor gets the capture-twins pre pass and, as
    # every Inductor graph, DistinctOutputsPass last
    pre, post = compile_and_pop_passes("aux_capture", mode="max-autotune-no-cudagraphs")
    assert seen[-1] == mode_options and not seen[-1].get("triton.cudagraphs", False)
    assert isinstance(pre, CaptureTwinsPass) and isinstance(post, DistinctOutputsPass)

    backend = aux_capture_backend(mode="max-autotune-no-cudagraphs", cost_model=False, epilogue_fusion=False)
    pre, post = compile_and_pop_passes(backend)
    assert seen[-1] == {**mode_options, "epilogue_fusion": False}
    assert isinstance(pre, CaptureTwinsPass) and isinstance(post, DistinctOutputsPass)
    assert pre.merges is backend.twin_merges  # the backend sees what the pre pass merged
    assert backend.results and backend.results[-1].target == "dynamo_lifted"

    pre, post = compile_and_pop_passes("aux_capture")
    assert isinstance(pre, CaptureTwinsPass) and seen[-1] == {}  # default: no other patches
    # rewrite=False: Inductor as without the backend, outputs kept distinct from mutated inputs
    pre, post = compile_and_pop_passes("aux_capture", options={"rewrite": False})
    assert pre is None and isinstance(post, DistinctOutputsPass)
    assert seen[-1] == {}

    # CUDA-graph modes keep the buffer inside the graph: the pass runs after AOTAutograd
    pre, post = compile_and_pop_passes("aux_capture", mode="reduce-overhead")
    assert isinstance(pre, CaptureTwinsPass)
    assert isinstance(post.first, AuxCapturePass) and isinstance(post.second, DistinctOutputsPass)

    # a pre pass the user already set runs first, then the twins pass; a user's post pass
    # runs first too, then DistinctOutputsPass
    calls = []

    class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            calls.append("user")

        def uuid(self):
            return "user-pass"

    with inductor_config.patch(post_grad_custom_pre_pass=UserPass(), post_grad_custom_post_pass=UserPass()):
        chained, post = compile_and_pop_passes("aux_capture")
    assert not isinstance(chained, CaptureTwinsPass) and chained.uuid() is not None
    assert "user-pass" in str(chained.uuid())
    chained(torch.fx.Graph())
    assert calls == ["user"]
    assert isinstance(post.first, UserPass) and isinstance(post.second, DistinctOutputsPass)
    assert "user-pass" in post.uuid()


# --------------------------------------------------------------------------- 6. Inductor


@contextlib.contextmanager
def _no_graph_caches():
    """Inductor without the FX graph / AOTAutograd caches: a cache hit skips post-grad
    passes, so the capture pass (and its results and counters) would not run at all.
    Compiled kernels are still cached, which keeps warm reruns fast."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture(scope="module")
def fused_inductor_ref():
    """Tiny fused_norm Llama compiled by Inductor without the pass (the reference)."""
    torch._dynamo.reset()
    model, inputs = _tiny(tokens=16, capture_producer="fused_norm")
    with torch.no_grad(), _no_graph_caches():
        ref = torch.compile(model, backend="aux_capture", options={"rewrite": False})(*inputs)
    torch._dynamo.reset()
    return model, inputs, ref


@pytest.mark.inductor
def test_inductor_default_matches_inductor_without_pass(fused_inductor_ref):
    model, inputs, ref = fused_inductor_ref
    with _no_graph_caches():
        out = torch.compile(model, backend="aux_capture")(*inputs)
    _assert_bitwise(out, ref)
    assert out[1].shape == (16, model.num_captures * model.config.hidden_size)
    c = counters["aux_capture"]
    assert c["groups_found"] >= 1 and c["pass_errors"] == 0
    assert c["groups_found"] == c["groups_rewritten"] + c["groups_rejected"]


@pytest.mark.inductor
def test_inductor_forced_rewrite_fused_norm(fused_inductor_ref):
    model, inputs, ref = fused_inductor_ref
    k = model.num_captures
    backend = RecordingBackend(inner="inductor", cost_model=False)
    with _no_graph_caches():
        out = torch.compile(model, backend=backend)(*inputs)
    _assert_bitwise(out, ref)
    result = backend.results[-1]
    # the pass runs on the Dynamo graph, whose packed buffer then becomes a graph input
    assert result.error is None and result.target == "dynamo_lifted"
    group = _aux_group(result, k)
    assert group.decision is Decision.REWRITE and group.placement == "dynamo_lifted"
    assert all(c.producer is Producer.CUSTOM_OP for c in group.captures)
    # a graph Inductor lowers next gets custom-op writes only, never out= writes
    assert all(c.strategy is Strategy.COPY for c in group.captures)
    assert _targets(backend.graphs_after[-1])[WRITE] == _num_writes(backend.graphs_after[-1]) == k
    assert result.lifted is not None and len(result.lifted) == 1


@pytest.mark.inductor
def test_inductor_max_autotune_no_cudagraphs_tiny_function():
    def f(x, w):
        return torch.relu(x @ w)

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    out = torch.compile(f, backend="aux_capture", mode="max-autotune-no-cudagraphs")(x, w)
    torch.testing.assert_close(out, f(x, w))


# --------------------------------------------------------------------------- 7. AuxCapturePass


def test_aux_capture_pass_uuid():
    a, b, forced = AuxCapturePass(), AuxCapturePass(), AuxCapturePass(cost_model=False)
    assert a.uuid() is not None and isinstance(a.uuid(), (bytes, str))
    assert a.uuid() == b.uuid() == AuxCapturePass(cost_model=True).uuid()
    assert forced.uuid() != a.uuid()
    assert forced.uuid() == AuxCapturePass(cost_model=False).uuid()
    assert repr(forced) == "AuxCapturePass(cost_model=False)"
    with pytest.raises(TypeError, match="cost_model must be a bool, got 'no'"):
        AuxCapturePass(cost_model="no")


def test_pass_uuids_hash_only_what_the_passes_execute(tmp_path, monkeypatch):
    """The cache key covers the modules the passes import (found from their import
    statements), not the diff tool, the CLI, the engine plugins or the test tooling: editing
    those leaves every uuid as it was; editing a pass's module changes them."""
    import compile_pass.inductor_pass as ip

    names = {os.path.basename(f) for f in ip._source_files()}
    assert {"inductor_pass.py", "capture_pass.py", "twins.py", "distinct_outputs.py", "cost.py",
            "rewrite.py", "dataflow.py", "ops.py"} <= names
    assert not names & {"explainer.py", "__main__.py", "backend.py", "memory.py", "packer.py",
                        "cudagraph.py", "compat.py", "vllm.py", "sglang.py"}
    # the same closure over a copy of the package: a pass module edited -> another key
    import shutil

    copy = tmp_path / "compile_pass"
    shutil.copytree(os.path.dirname(ip.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(ip, "_PACKAGE_DIR", str(copy))
    monkeypatch.setattr(ip, "__file__", str(copy / "inductor_pass.py"))
    ip._source_files.cache_clear()
    try:
        before = ip.source_hash("x")
        (copy / "explainer.py").write_text((copy / "explainer.py").read_text() + "\n# edited\n")
        (copy / "__main__.py").write_text((copy / "__main__.py").read_text() + "\n# edited\n")
        ip._source_files.cache_clear()
        assert ip.source_hash("x") == before
        (copy / "twins.py").write_text((copy / "twins.py").read_text() + "\n# edited\n")
        ip._source_files.cache_clear()
        assert ip.source_hash("x") != before
    finally:
        monkeypatch.undo()
        ip._source_files.cache_clear()


def _three_matmuls(x, w1, w2, w3):
    a = x @ w1
    h = torch.relu(a) @ w2
    b = torch.relu(h) @ w3
    return torch.cat([a, b], dim=-1)


@pytest.mark.inductor
def test_aux_capture_pass_fx_graph_cache():
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # older torch
        from torch._inductor.utils import fresh_inductor_cache as fresh_cache
    import torch._inductor.config as inductor_config

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 8, generator=g) for _ in range(4)]
    expected = _three_matmuls(*args)

    def compile_with(custom_pass):
        torch._dynamo.reset()
        before = dict(counters["inductor"])
        with inductor_config.patch(post_grad_custom_post_pass=custom_pass, fx_graph_cache=True):
            out = torch.compile(_three_matmuls)(*args)
        after = counters["inductor"]
        delta = {key: after[key] - before.get(key, 0) for key in ("fxgraph_cache_miss", "fxgraph_cache_hit")}
        return out, delta

    with fresh_cache():
        first_pass = AuxCapturePass()
        out1, d1 = compile_with(first_pass)
        assert d1 == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 0}
        assert len(first_pass.results) == 1 and first_pass.results[0].target == "post_grad"
        (group,) = first_pass.results[0].groups
        assert group.decision is Decision.REJECT  # the estimate sees no drop on this graph
        assert group.rejection is Rejection.NO_SAVING and group.reason.startswith("estimated peak would not drop")

        second_pass = AuxCapturePass()  # same options: same uuid, a cache hit
        out2, d2 = compile_with(second_pass)
        assert d2 == {"fxgraph_cache_miss": 0, "fxgraph_cache_hit": 1}
        assert second_pass.results == []  # a hit does not run the pass

        rewritten: List[fx.Graph] = []
        forced = AuxCapturePass(cost_model=False,  # other options: other key, a miss
                                on_result=lambda result, graph: rewritten.append(copy_graph(graph)[0]))
        out3, d3 = compile_with(forced)
        assert d3 == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 0}
        (group,) = forced.results[0].groups
        assert group.decision is Decision.REWRITE
        assert _targets(rewritten[0])[WRITE] == 2

    torch.testing.assert_close(out1, expected)
    assert torch.equal(out2, out1) and torch.equal(out3, out1)


# --------------------------------------------------------------------------- 8. failure containment


@pytest.mark.parametrize("stage", ["rewrite_group", "plan_group"])
def test_pass_error_is_contained(stage, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(capture_pass, stage, boom)
    caplog.set_level(logging.WARNING, logger="compile_pass")
    model, inputs = _tiny()
    backend = AuxCaptureBackend(inner="eager", cost_model=False)
    _assert_compiles_bitwise(model, inputs, backend)

    assert counters["aux_capture"]["pass_errors"] == 1
    (result,) = backend.results
    assert result.error == "RuntimeError: injected"
    assert result.code_after == result.code_before
    assert "aux_packed" not in result.code_after
    assert not result.changed
    warnings = [r for r in caplog.records if r.name == "compile_pass" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "graph left unchanged" in warnings[0].getMessage()
    assert "injected" in warnings[0].getMessage()


def test_pass_error_under_aot_eager(monkeypatch):
    monkeypatch.setattr(capture_pass, "rewrite_group",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    model, inputs = _tiny()
    backend = AuxCaptureBackend(inner="aot_eager", cost_model=False)
    _assert_compiles_bitwise(model, inputs, backend)
    assert counters["aux_capture"]["pass_errors"] == 1
    assert "injected" in backend.results[0].error


def test_inner_compiler_errors_are_not_hidden():
    def bad_inner(gm, example_inputs):
        raise ValueError("inner boom")

    compiled = torch.compile(_tiny_fn, backend=aux_capture_backend(inner=bad_inner))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="inner boom"):
        compiled(torch.randn(4))
    assert counters["aux_capture"]["pass_errors"] == 0


def test_callable_inner_receives_rewritten_graph():
    model, inputs = _tiny()
    seen = []

    def inner(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    backend = aux_capture_backend(inner=inner, cost_model=False)
    _assert_compiles_bitwise(model, inputs, backend)
    (result,) = backend.results
    assert result.target == "dynamo_functional"
    assert [gm.code for gm in seen] == [result.code_after]
    # not a graph that runs as is: custom-op writes, no out= recomputation
    assert _targets(seen[0].graph)[WRITE] == _num_writes(seen[0].graph) == model.num_captures


# --------------------------------------------------------------------------- 9. mutation semantics


class _Three(nn.Module):
    """Three linear "layers": a matmul between captures makes a cross-layer group."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)


class MutatedCapture(_Three):
    def forward(self, x):
        aux = []
        h = self.l1(x)
        aux.append(h)
        h.add_(1)  # the cat reads the mutated value
        h2 = self.l2(h)
        aux.append(h2)
        h3 = self.l3(h2)
        aux.append(h3 * 2)
        return h3, torch.cat(aux, dim=-1)


class ClonedCapture(_Three):
    def forward(self, x):
        aux = []
        h = self.l1(x)
        aux.append(h.clone())
        h2 = self.l2(h)
        aux.append(h2.clone())
        return self.l3(h2), torch.cat(aux, dim=-1)


class SharedCapture(_Three):
    def forward(self, x):
        aux = []
        h = torch.relu(self.l1(x))
        aux.append(h)
        h2 = torch.sigmoid(self.l2(h)) + h  # the capture feeds later layers too
        aux.append(h2)
        h3 = self.l3(h2) + h
        return h3, torch.cat(aux, dim=-1)


class InputCapture(_Three):
    def forward(self, x):
        aux = [x]
        h = self.l1(x)
        h2 = self.l2(h)
        aux.append(h2)
        return h2, torch.cat(aux, dim=0)


class MixedDtypes(_Three):
    def forward(self, x):
        h = self.l1(x)
        h2 = self.l2(h)
        h3 = self.l3(h2).half()
        return (torch.cat([h, h3], dim=-1),)


class OneBlock(_Three):
    def forward(self, x):
        h = self.l1(x)
        return (torch.cat([h * 2, h + 1], dim=-1),)


def _compile_module(cls, inner, x, **kwargs):
    """(compiled output, uncompiled output, the pass result, the graph the pass left)."""
    model = cls()
    ref = model(x.clone())
    backend = RecordingBackend(inner=inner, cost_model=False, keep_code_before=True)
    out = torch.compile(model, backend=backend, fullgraph=True, **kwargs)(x.clone())
    assert len(backend.results) == 1
    return out, ref, backend.results[0], backend.graphs_after[0]


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
INNER_PARAMS = pytest.mark.parametrize("inner", ["eager", "aot_eager"])


@INNER_PARAMS
def test_capture_mutated_before_cat(inner):
    out, ref, result, graph = _compile_module(MutatedCapture, inner, X)
    _assert_bitwise(out, ref)
    assert result.error is None
    (group,) = result.groups
    assert group.decision is Decision.REWRITE
    first = group.captures[0]
    assert first.strategy is Strategy.COPY
    if inner == "eager":  # the Dynamo graph still has the in-place add_
        assert first.write_after is not None and first.write_after.name == "add_"
        assert first.write_after is not first.node
        assert "mutated in place" in first.note and "add_" in first.note
        # the write follows the mutation in the rewritten code
        order = list(graph.nodes)
        (mutation,) = [n for n in order if n.target == "add_"]
        (write,) = [n for n in order if n.target is WRITE and n.args[1].name == "h"]
        assert order.index(mutation) < order.index(write)
    else:  # functionalized: the capture is the add's output
        assert first.write_after is first.node


@INNER_PARAMS
def test_clone_feeding_only_the_cat_is_elided(inner):
    out, ref, result, graph = _compile_module(ClonedCapture, inner, X)
    _assert_bitwise(out, ref)
    (group,) = result.groups
    assert group.decision is Decision.REWRITE
    assert [c.producer for c in group.captures] == [Producer.CLONE, Producer.CLONE]
    assert [c.strategy for c in group.captures] == [Strategy.ELIDE_CLONE] * 2
    assert all("clone read only by the concat" in c.note for c in group.captures)
    assert "clone" in result.code_before
    assert not any(n.target in ("clone", torch.clone, torch.ops.aten.clone.default) for n in graph.nodes)
    assert _targets(graph)[WRITE] == 2


@INNER_PARAMS
def test_capture_shared_with_later_layers(inner):
    out, ref, result, graph = _compile_module(SharedCapture, inner, X)
    _assert_bitwise(out, ref)
    (group,) = result.groups
    assert group.decision is Decision.REWRITE
    assert _num_writes(graph) == 2


@INNER_PARAMS
def test_graph_input_capture(inner):
    out, ref, result, graph = _compile_module(InputCapture, inner, X)
    _assert_bitwise(out, ref)
    (group,) = result.groups
    assert group.decision is Decision.REWRITE and group.dim == 0
    assert group.captures[0].producer is Producer.GRAPH_INPUT
    assert group.captures[0].write_after is None
    assert "graph input" in group.captures[0].note


@INNER_PARAMS
def test_mixed_dtypes_rejected(inner):
    out, ref, result, graph = _compile_module(MixedDtypes, inner, X)
    _assert_bitwise(out, ref)
    (group,) = result.groups
    assert group.decision is Decision.REJECT and group.rejection is Rejection.MIXED_DTYPES
    assert re.match(r"capture 1 is torch\.float16, the concat result is torch\.float32 "
                    r"\(torch\.cat type-promotes mixed dtypes", group.reason), group.reason
    assert result.code_after == result.code_before


@INNER_PARAMS
def test_one_block_concat_rejected(inner):
    out, ref, result, graph = _compile_module(OneBlock, inner, X)
    _assert_bitwise(out, ref)
    (group,) = result.groups
    assert group.decision is Decision.REJECT
    assert group.rejection is Rejection.ONE_BLOCK
    assert "one block" in group.reason and "not a cross-layer capture" in group.reason
    assert result.code_after == result.code_before
    assert counters["aux_capture"]["groups_rejected"] == 1


def test_symbolic_concat_width_rejected():
    class TokenCat(_Three):
        def forward(self, x):
            h = self.l1(x)
            h3 = self.l3(self.l2(h))
            return (torch.cat([h, h3], dim=0),)  # along the dynamic token dim

    out, ref, result, graph = _compile_module(TokenCat, "eager", X, dynamic=True)
    _assert_bitwise(out, ref)
    (group,) = result.groups
    assert group.decision is Decision.REJECT
    assert group.rejection is Rejection.SYMBOLIC_WIDTH
    assert re.match(r"capture 0 has a symbolic width \w+ along the concat dim", group.reason), group.reason


# --------------------------------------------------------------------------- regressions


class MutatedAfterCat(_Three):
    def forward(self, x):
        aux = []
        h = self.l1(x)
        c = h + x  # exact arithmetic: planned COMPUTE_INTO under the eager inner
        aux.append(c)
        h3 = self.l3(self.l2(c)) + 1
        aux.append(h3)
        packed = torch.cat(aux, dim=-1)
        c.add_(1)  # after the cat: the cat must keep the old value
        return h3 + c, packed


class DuplicateCapture(_Three):
    def forward(self, x):
        c = self.l1(x) + x
        h3 = self.l3(self.l2(c)) + 1
        return h3, torch.cat([c, h3, c], dim=-1)


class DuplicateClone(_Three):
    def forward(self, x):
        h = self.l1(x)
        c = h.clone()
        h3 = self.l3(self.l2(h)) + 1
        return h3, torch.cat([c, h3, c], dim=-1)


class CaptureAlsoReturned(_Three):
    def forward(self, x):
        c = self.l1(x) + x
        h3 = self.l3(self.l2(c)) + 1
        return c, torch.cat([c, h3], dim=-1)


def test_capture_mutated_after_cat_eager_inner():
    out, ref, result, graph = _compile_module(MutatedAfterCat, "eager", X)
    _assert_bitwise(out, ref)


def test_capture_mutated_after_cat_aot_eager_inner():
    """The functional AOT graph has no post-cat mutation left: correct there."""
    out, ref, result, graph = _compile_module(MutatedAfterCat, "aot_eager", X)
    _assert_bitwise(out, ref)
    assert result.groups[0].decision is Decision.REWRITE


@pytest.mark.parametrize("cls", [DuplicateCapture, DuplicateClone])
@INNER_PARAMS
def test_duplicate_capture_is_rewritten(cls, inner):
    out, ref, result, graph = _compile_module(cls, inner, X)
    _assert_bitwise(out, ref)
    assert result.error is None, result.error
    assert result.groups[0].decision is Decision.REWRITE


@INNER_PARAMS
def test_returned_capture_does_not_alias_aux(inner):
    out, ref, result, graph = _compile_module(CaptureAlsoReturned, inner, X)
    _assert_bitwise(out, ref)
    assert out[0].untyped_storage().data_ptr() != out[1].untyped_storage().data_ptr()


# --------------------------------------------------------------------------- private torch APIs


def test_a_missing_private_api_compiles_without_the_pass(monkeypatch, caplog):
    """Take one private API away: the backend warns once, naming it and the torch version,
    and compiles exactly as with rewrite=False; it never fails the compile."""
    import torch._dynamo.utils

    from compile_pass import compat

    model, inputs = _tiny()
    reference = model(*inputs)
    monkeypatch.delattr(torch._dynamo.utils, "GmWrapper")
    monkeypatch.setattr(compat, "_warned", [])
    compat._checked.cache_clear()
    try:
        assert any("torch._dynamo.utils.GmWrapper" in m for m in compat.missing_private_apis())
        backend = AuxCaptureBackend(inner="eager", cost_model=False)
        with pytest.warns(RuntimeWarning, match=r"torch \S+ lacks private APIs the capture pass "
                                                r"uses: .*torch\._dynamo\.utils\.GmWrapper"):
            out = torch.compile(model, backend=backend)(*inputs)
        _assert_bitwise(out, reference)
        assert backend.results == [] and counters["aux_capture"]["unsupported_torch"] >= 1
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process: no second warning
            torch.compile(model, backend=AuxCaptureBackend(inner="eager"))(*inputs)
    finally:
        compat._checked.cache_clear()


def test_this_torch_has_every_private_api_the_pass_uses():
    from compile_pass.compat import PRIVATE_APIS, missing_private_apis

    assert len(PRIVATE_APIS) >= 10 and missing_private_apis() == []


def test_design_doc_lists_every_private_api():
    from compile_pass.compat import PRIVATE_APIS

    design = open(os.path.join(os.path.dirname(__file__), "..", "docs", "design.md")).read()
    assert all(f"`{api.name}`" in design for api in PRIVATE_APIS)


def test_code_before_is_kept_only_when_asked():
    """The code before a rewrite is text for people, generated only with
    ``keep_code_before=True`` (or the diff tool's estimate, or TORCH_TRACE); off, it reads
    CODE_NOT_KEPT and the rewrite is the same."""
    from compile_pass.capture_pass import CODE_NOT_KEPT

    _, _, kept, _ = _compile_module(ClonedCapture, "eager", X)  # keep_code_before=True
    torch._dynamo.reset()
    backend = AuxCaptureBackend(inner="eager", cost_model=False)
    torch.compile(ClonedCapture(), backend=backend, fullgraph=True)(X.clone())
    (dropped,) = backend.results
    assert dropped.changed and dropped.code_before == CODE_NOT_KEPT
    assert "clone" in kept.code_before
    assert dropped.code_after == kept.code_after
    with pytest.raises(TypeError, match="keep_code_before"):
        AuxCaptureBackend(keep_code_before="yes")


def _three_captures(x: torch.Tensor, w: torch.Tensor):
    aux = []
    h = x
    for i in range(4):
        if i in (1, 2, 3):
            aux.append(h + 1)
        h = torch.tanh(h @ w)
    return h, aux


@pytest.mark.inductor
def test_inductor_result_survives_torch_aot_compile(tmp_path):
    """torch's ahead-of-time compile (vLLM's ``VLLM_USE_AOT_COMPILE``) takes only a
    ``SerializableCallable``: the inductor inner's result with lifted buffers is one. Saved
    and loaded back, it computes what the in-process compile computes, bit for bit, and
    still returns the captures as adjacent slices of one buffer."""
    types = pytest.importorskip("torch._dynamo.aot_compile_types",
                                reason="this torch has no ahead-of-time compile")
    from compile_pass.lift import WithLiftedBuffers

    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    ref_h, ref_aux = torch.compile(_three_captures, backend=AuxCaptureBackend(pack_outputs=True),
                                   fullgraph=True)(x, w)
    backend = AuxCaptureBackend(pack_outputs=True)
    compiled = torch.compile(_three_captures, backend=backend, fullgraph=True)
    if not hasattr(compiled, "aot_compile"):
        pytest.skip("this torch's compiled functions have no aot_compile")
    aot = compiled.aot_compile(((x, w), {}))
    assert [g.decision for r in backend.results for g in r.groups] == [Decision.REWRITE]
    assert issubclass(WithLiftedBuffers, types.SerializableCallable)
    path = tmp_path / "artifact"
    aot.save_compiled_function(str(path))
    with open(path, "rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    for fn in (aot, loaded):
        h, aux = fn(x, w)
        assert torch.equal(h, ref_h) and torch.equal(torch.cat(aux, -1), torch.cat(ref_aux, -1))
        assert compile_pass.pack_aux_hidden_states(aux)._base is not None, "not one buffer's slices"
