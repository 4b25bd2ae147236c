"""``options={"fuse_projection": True}``: a concat the draft's fc alone reads becomes one
``[T, H_draft]`` accumulator each capture is projected into (``compile_pass/fuse_projection.py``).

On a small decoder whose forward ends with the draft's input projection (a plain fc with
bias, DFlash's fc then a norm, an RMSNorm over the concat before fc, one RMSNorm per
capture): the group is fused under each inner, the graph holds one projection op per
capture and no concat or fc, the draft's input equals the list path's to rounding and the
eager ``ProjectingAccumulator``'s bit for bit, the target's own output is bitwise the build
without the option, the peak drops, one compile serves two token counts; where it cannot
fuse (a non-norm op before fc, a concat read twice) the group is packed as without the
option and ``projection`` says why."""

import pytest
import torch
from torch import nn

from compile_pass import aux_capture_backend, measure_peak
from compile_pass.projection import rms_norm

H, HD, LAYERS, CAPTURE = 64, 48, 6, (1, 3, 5)
PROJECT = torch.ops.compile_pass.project_into_.default
PROJECT_BINARY = torch.ops.compile_pass.project_binary_into_.default
BIAS = torch.ops.compile_pass.bias_into_.default
OPS = torch.ops.compile_pass


class TargetAndDraftInput(nn.Module):
    """Residual decoder capturing ``hidden + residual``; the draft's combine at the end."""

    def __init__(self, combine="plain", extra_reader=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(LAYERS))
        self.fc = nn.Linear(len(CAPTURE) * H, HD, bias=combine != "dflash")
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(len(CAPTURE) * H if combine == "norm_before_fc" else HD))
        self.fc_norms = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(H)) for _ in CAPTURE)
        self.combine, self.extra_reader = combine, extra_reader

    def accumulator(self):
        """The eager per-capture projection of the same combine."""
        from compile_pass import ProjectingAccumulator

        norms = {"norm_before_fc": {"norm_before_fc": self.norm}, "fc_norms": {"fc_norms": list(self.fc_norms)},
                 "dflash": {"norm_after_fc": self.norm}}.get(self.combine, {})
        return ProjectingAccumulator(len(CAPTURE), self.fc.weight, fc_bias=self.fc.bias, eps=1e-6, **norms)

    def forward(self, x):
        hidden, aux = _capture_loop(self.layers, x)
        packed = torch.cat(aux, dim=-1)
        if self.combine == "norm_before_fc":
            packed = rms_norm(packed, self.norm, 1e-6)
        elif self.combine == "fc_norms":
            packed = torch.cat([rms_norm(c, w, 1e-6) for c, w in zip(packed.split(H, dim=-1), self.fc_norms)], -1)
        elif self.combine == "gelu_before_fc":
            packed = torch.nn.functional.gelu(packed)
        draft_input = self.fc(packed)
        if self.combine == "dflash":
            draft_input = rms_norm(draft_input, self.norm, 1e-6)
        if self.extra_reader:
            return hidden, draft_input, packed.sum()
        return hidden, draft_input


def _capture_loop(layers, x):
    """The decoder: ``hidden + residual`` captured at ``CAPTURE``; (hidden, captures)."""
    hidden, residual, aux = x, torch.zeros_like(x), []
    for i, layer in enumerate(layers):
        if i in CAPTURE:
            aux.append(hidden + residual)
        residual = hidden + residual
        hidden = torch.tanh(layer(residual))
    return hidden, aux


def _compile(model, inner, fuse, **kw):
    torch._dynamo.reset()
    backend = aux_capture_backend(inner, fuse_projection=fuse)
    return torch.compile(model, backend=backend, **kw), backend


def _groups(backend):
    return [g for r in backend.results for g in r.groups]


def _run(model, inner, fuse, x):
    compiled, backend = _compile(model, inner, fuse)
    with torch.no_grad():
        compiled(x)
        peak = measure_peak(compiled, x)
    return peak, backend


def _eager_projection(model, x):
    """The draft input the eager ``ProjectingAccumulator`` computes from ``model``'s captures."""
    hidden, residual, acc = x, torch.zeros_like(x), model.accumulator()
    for i, layer in enumerate(model.layers):
        if i in CAPTURE:
            acc.append(hidden + residual)
        residual = hidden + residual
        hidden = torch.tanh(layer(residual))
    return acc.finalize()


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("combine", ["plain", "dflash", "norm_before_fc", "fc_norms"])
def test_fused_projection_under_each_inner(inner, combine):
    model = TargetAndDraftInput(combine).eval()
    x = torch.randn(2048, H)
    with torch.no_grad():
        ref_hidden, ref_draft = model(x)
        eager_projected = _eager_projection(model, x)
    peaks = {}
    for fuse in (False, True):
        peak, backend = _run(model, inner, fuse, x)
        hidden, draft = peak.result
        assert torch.equal(hidden, ref_hidden)  # the target's own output: bitwise
        group = [g for g in _groups(backend) if g.k == len(CAPTURE)][0]  # the captures' (fc_norms: and the norms')
        assert group.fused is fuse
        torch.testing.assert_close(draft, ref_draft, rtol=1e-5, atol=1e-5)
        if not fuse:
            assert torch.equal(draft, ref_draft)
        else:  # the norms folded in as the eager collector computes them: bit for bit
            assert torch.equal(draft, eager_projected)
        peaks[fuse] = peak.bytes
    assert peaks[True] < peaks[False], peaks
    assert "projected into the draft's accumulator" in group.reason


def test_the_fused_graph_holds_one_projection_per_capture_and_no_fc():
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = TargetAndDraftInput("plain").eval()
    backend = aux_capture_backend(inner, fuse_projection=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(64, H))
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    projections = [n for n in gm.graph.nodes if n.target in (PROJECT, PROJECT_BINARY)]
    assert len(projections) == len(CAPTURE) and targets.count(BIAS) == 1
    assert [n.args[-1] for n in projections] == [True, False, False]  # the first term written
    assert torch.cat not in targets and targets.count(torch._C._nn.linear) == LAYERS  # the fc is gone
    assert [n.args[-2] for n in projections] == [0, H, 2 * H]  # each capture's column block


@pytest.mark.parametrize("combine, ops", [
    ("norm_before_fc", {OPS.sum_squares_into_.default: 3, OPS.project_scaled_into_.default: 3,
                        OPS.rms_scale_.default: 1}),
    ("fc_norms", {OPS.project_normed_into_.default: 3})])
def test_a_norm_before_fc_is_folded_into_the_projection_ops(combine, ops):
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend = aux_capture_backend(inner, fuse_projection=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(TargetAndDraftInput(combine).eval(), backend=backend)(torch.randn(64, H))
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert {t: targets.count(t) for t in ops} == ops
    assert torch.rsqrt not in targets and torch.cat not in targets  # the norms and both concats are gone
    assert any("an RMSNorm" in g.reason for g in _groups(backend) if g.fused)


def test_off_by_default_and_said_why_where_it_cannot_fuse():
    x = torch.randn(64, H)
    for model, why in ((TargetAndDraftInput("plain"), None),
                       (TargetAndDraftInput("gelu_before_fc"), "neither the draft's fc nor a norm before it"),
                       (TargetAndDraftInput("plain", extra_reader=True), "readers, not one fc")):
        for fuse in (False, True):
            compiled, backend = _compile(model.eval(), "eager", fuse, fullgraph=True)
            with torch.no_grad():
                compiled(x)
            (group,) = [g for g in _groups(backend) if g.k == len(CAPTURE)]
            if why is None and fuse:
                assert group.fused
                continue
            assert not group.fused
            if fuse:
                assert why in group.projection, group.projection
            else:
                assert group.projection == ""


def test_one_compile_serves_two_token_counts():
    model = TargetAndDraftInput("plain").eval()
    compiled, backend = _compile(model, "aot_eager", True, dynamic=True)
    with torch.no_grad():
        for tokens in (40, 300):
            x = torch.randn(tokens, H)
            hidden, draft = compiled(x)
            ref_hidden, ref_draft = model(x)
            assert torch.equal(hidden, ref_hidden)
            torch.testing.assert_close(draft, ref_draft, rtol=1e-5, atol=1e-5)
    assert sum(g.fused for g in _groups(backend)) == 1 and len(backend.results) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("combine", ["norm_before_fc", "fc_norms"])
def test_norms_with_a_traced_eps_one_compile_two_token_counts(combine, dtype):
    """The engine-shaped rank's norms read ``eps`` from a module attribute, which Dynamo
    traces as a graph input (``item()``) under dynamic shapes: the norm is still matched,
    its eps node passed to the ops; each token count's draft input equals the eager
    ``ProjectingAccumulator``'s bit for bit, the target's output the uncompiled model's."""
    from models import draft_input

    model, _ = draft_input.tiny(k=3, combine=combine, dtype=dtype)
    projected, _ = draft_input.tiny(k=3, combine=combine, dtype=dtype, capture="projected")
    compiled, backend = _compile(model, "aot_eager", True, dynamic=True)
    with torch.no_grad():
        for tokens in (24, 100):
            inputs = draft_input.engine.example_inputs(model.target.config, tokens)
            hidden, draft = compiled(*inputs)
            ref_hidden, eager_projected = projected(*inputs)
            assert torch.equal(hidden, ref_hidden) and torch.equal(draft, eager_projected)
    assert sum(g.fused for g in _groups(backend)) == 1 and len(backend.results) == 1


@pytest.mark.inductor
def test_fused_projection_under_inductor():
    model = TargetAndDraftInput("plain").eval()
    x = torch.randn(2048, H)
    with torch.no_grad():
        ref_hidden, ref_draft = model(x)
    peaks = {}
    for fuse in (False, True):
        peak, backend = _run(model, "inductor", fuse, x)
        hidden, draft = peak.result
        torch.testing.assert_close(draft, ref_draft, rtol=1e-5, atol=1e-5)
        assert any(g.fused for g in _groups(backend)) is fuse
        peaks[fuse] = (peak.bytes, hidden)
    assert torch.equal(peaks[True][1], peaks[False][1])  # the target's output: as without the option
    assert peaks[True][0] < peaks[False][0], peaks


@pytest.mark.inductor
def test_norm_before_fc_under_inductor_beside_in_place_residual_norms():
    """The engine-shaped rank (in-place fused add-RMSNorm after each capture) with Eagle3's
    norm over the concat, fused under Inductor: each capture's sum of squares is taken inside
    an op at the capture, so the residual's later in-place update cannot reach it (stock
    Inductor reads it after the update when the sum is plain torch:
    benchmarks/inductor_norm_accumulate_repro.py). The draft input equals the eager
    ``ProjectingAccumulator``'s bit for bit; the target's output is as without the option."""
    from models import draft_input

    model, inputs = draft_input.tiny(tokens=64, k=3, combine="norm_before_fc")
    projected, _ = draft_input.tiny(tokens=64, k=3, combine="norm_before_fc", capture="projected")
    outputs = {}
    with torch.no_grad():
        _, eager_projected = projected(*inputs)
        for fuse in (False, True):
            compiled, backend = _compile(model, "inductor", fuse)
            outputs[fuse] = compiled(*inputs)
            assert any(g.fused for g in _groups(backend)) is fuse
    assert torch.equal(outputs[True][0], outputs[False][0])
    assert torch.equal(outputs[True][1], eager_projected)


@pytest.mark.inductor
def test_the_sum_of_squares_op_is_exact_where_stock_inductor_is_not():
    from inductor_norm_accumulate_repro import norm_before_fc_with_compile_pass_ops

    gen = torch.Generator().manual_seed(0)
    h, r = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    g, w = torch.randn(16, generator=gen), torch.randn(12, 16, generator=gen)
    eager = norm_before_fc_with_compile_pass_ops(h, r.clone(), g, w)
    torch._dynamo.reset()
    compiled = torch.compile(norm_before_fc_with_compile_pass_ops, backend="inductor", fullgraph=True)
    for a, b in zip(compiled(h, r.clone(), g, w), eager):
        assert torch.equal(a, b)


def test_explain_says_why_a_group_was_not_projected():
    from compile_pass import explain

    x = torch.randn(64, H)
    text = explain(TargetAndDraftInput("gelu_before_fc").eval(), x, fuse_projection=True).to_text()
    assert "(not projected: " in text and "neither the draft's fc nor a norm before it" in text, text
    text = explain(TargetAndDraftInput("plain").eval(), x, fuse_projection=True).to_text()
    assert "projected into the draft's accumulator" in text and "not projected" not in text, text


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_fused_projection_in_piecewise_graphs(inner):
    """Split at attention (the engines' piecewise graphs): the captures are projected in the
    pieces that make them, the draft's input read in the last one; the target's output is
    bitwise the uncompiled model's, one compile serves two token counts."""
    from models import draft_input, engine

    model, inputs = draft_input.tiny(tokens=64, k=3)
    torch._dynamo.reset()
    backend = aux_capture_backend(inner, fuse_projection=True, split_ops=["engine::attention"])
    compiled = torch.compile(model, backend=backend, dynamic=True)
    cfg = model.target.config
    with torch.no_grad():
        for tokens in (64, 200):
            inputs = engine.example_inputs(cfg, tokens)
            ref, out = model(*inputs), compiled(*inputs)
            assert torch.equal(out[0], ref[0])
            torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    assert backend.splits and all(s.num_pieces > 1 for s in backend.splits)
    groups = [g for r in backend.results for g in r.groups if g.k == 3]
    assert groups and all(g.fused for g in groups), [(g.decision, g.reason) for g in groups]


@pytest.mark.inductor
@pytest.mark.parametrize("fuse, user, expected", [(True, None, False), (True, True, True), (False, None, None)])
def test_a_graph_holding_an_accumulator_compiles_without_buffer_reuse(monkeypatch, fuse, user, expected):
    """Inductor's buffer reuse holds a freed buffer until a later allocation of its size
    wherever its own peak estimate has room, and the accumulator raises that estimate
    (vLLM's one graph: 0.500 of the packed bytes where the floor is 0.250, docs/vllm.md). A
    graph holding an accumulator is compiled with ``allow_buffer_reuse`` off unless the user
    set it; a graph without one gets Inductor's default."""
    import torch._inductor.compile_fx as inductor_compile

    from compile_pass.backend import holds_accumulator

    seen = []
    real = inductor_compile.compile_fx

    def recording(gm, example_inputs, config_patches=None, **kw):
        seen.append((holds_accumulator(gm), (config_patches or {}).get("allow_buffer_reuse")))
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(inductor_compile, "compile_fx", recording)
    model = TargetAndDraftInput("plain").eval()
    torch._dynamo.reset()
    options = {} if user is None else {"allow_buffer_reuse": user}
    compiled = torch.compile(model, backend=aux_capture_backend("inductor", fuse_projection=fuse, **options))
    with torch.no_grad():
        compiled(torch.randn(64, H))
    assert seen and seen[0] == (fuse, expected), seen  # the backend's call (compile_fx then calls itself)


class _PromotedBias(nn.Module):
    """A bf16 target whose draft input is ``cat @ W.T + b`` with an fp32 bias: the sum is
    computed in fp32 (the product rounded to bf16 first)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(H, H).to(torch.bfloat16) for _ in range(LAYERS))
        self.weight = nn.Parameter(torch.randn(HD, len(CAPTURE) * H, dtype=torch.bfloat16) / 8)
        self.bias = nn.Parameter(torch.randn(HD) * 100)  # fp32, large: its fp32 sum is not a bf16 value

    def forward(self, x):
        hidden, aux = _capture_loop(self.layers, x)
        return hidden, torch.cat(aux, dim=-1) @ self.weight.t() + self.bias


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_a_bias_of_another_dtype_keeps_the_promoted_output(inner):
    """``x @ W.T + b`` with a bf16 product and an fp32 bias: the fused draft input is fp32,
    as the list path's, within the projection's rounding of the product (a bias added into
    the bf16 accumulator would round it to bf16: off by up to 0.5 here, and bf16)."""
    model = _PromotedBias().eval()
    x = torch.randn(32, H, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)[1]
        compiled, backend = _compile(model, inner, True)
        got = compiled(x)[1]
    assert any(g.fused for g in _groups(backend)), [g.projection for g in _groups(backend)]
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0.26)  # bf16 product rounding, |x@W.T| < 64
    assert (got - model.bias).abs().max() < 64 and not torch.equal(got, got.to(torch.bfloat16).float())
