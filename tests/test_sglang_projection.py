"""The SGLang plugin's draft-input projection (``COMPILE_PASS_SGLANG_PROJECT``), without
SGLang: drafts shaped like SGLang 0.5.23's Eagle3 (``llama_eagle3.LlamaModel``) and DFlash
(``dflash.DFlashDraftModel``) models are read or refused with the reason; the packing list
projects each capture and holds no bytes of it; the logits-processor hook hands the
projected tensor on; DFlash's projection is skipped for an input already projected; the
draft-loading hook registers a draft worker's model only."""

import pytest
import torch
from torch import nn

from compile_pass import ProjectingAccumulator, draft_registry
from compile_pass.integrations import sglang as plugin
from compile_pass.integrations import sglang_projection as sp

K, H, HD = 3, 16, 12


class RMSNorm(nn.Module):  # the attributes SGLang's RMSNorm has
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight


class Eagle3Inner(nn.Module):
    def __init__(self, combine="plain", fc=None):
        super().__init__()
        self.num_aux_hidden_states = K
        self.fc = fc if fc is not None else nn.Linear(K * H, HD, bias=False)
        self.input_norm = RMSNorm(K * H) if combine == "norm_before_fc" else \
            nn.LayerNorm(K * H) if combine == "layer_norm" else None
        self.fc_norm = nn.ModuleList(RMSNorm(H) for _ in range(K)) if combine == "fc_norms" else None


class Draft(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.model = inner


class DFlashDraftModel(nn.Module):  # named as SGLang's, so its own project_target_hidden is recognized
    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"hidden_size": HD})()
        self.num_context_features = K
        self.fc = nn.Linear(K * H, HD, bias=False)
        self.hidden_norm = RMSNorm(HD)

    def project_target_hidden(self, target_hidden):
        if target_hidden.shape[-1] != K * H:
            raise ValueError("DFLASH target_hidden feature dim mismatch")
        return self.hidden_norm.weight * self.fc(target_hidden)


class FakeQuantMethod:
    pass


@pytest.fixture(autouse=True)
def _clean():
    sp.clear()
    yield
    sp.clear()
    plugin.STATE["project"] = False


@pytest.mark.parametrize("combine", ["plain", "norm_before_fc", "fc_norms"])
def test_eagle3_drafts_are_read_with_their_norms(combine):
    found, why = sp.draft_input_of(Draft(Eagle3Inner(combine)))
    assert found is not None, why
    assert found.kind == "eagle3" and found.num_captures == K and found.projection.out_features == HD
    assert (found.projection.norm_before_fc is not None) is (combine == "norm_before_fc")
    assert (found.projection.fc_norms is not None) is (combine == "fc_norms")


def test_a_square_fc_is_refused_so_the_draft_never_takes_a_projection_for_its_packed_input():
    """SGLang's Eagle3 drafts apply ``fc`` only to an input whose width differs from their
    hidden size, and DFlash's projection is skipped by width: with ``H_draft == K*H`` a
    projected input could not be told from the packed one. Refused with the reason."""
    found, why = sp.draft_input_of(Draft(Eagle3Inner(fc=nn.Linear(K * H, K * H, bias=False))))
    assert found is None and "fc is square" in why, why
    dflash = DFlashDraftModel()
    dflash.fc = nn.Linear(K * H, K * H, bias=False)
    found, why = sp.draft_input_of(dflash)
    assert found is None and "fc is square" in why, why


def test_drafts_that_do_not_fit_are_refused_with_the_reason():
    quantized = nn.Linear(K * H, HD, bias=False)
    quantized.quant_method = FakeQuantMethod()
    for model, why in ((Draft(Eagle3Inner(fc=quantized)), "quantized (FakeQuantMethod)"),
                       (Draft(Eagle3Inner("layer_norm")), "LayerNorm, not an RMSNorm"),
                       (nn.Linear(4, 4), "no Eagle3 or DFlash input projection")):
        found, reason = sp.draft_input_of(model)
        assert found is None and why in reason, reason
        assert not sp.register_draft(model) and sp.registered() is None


def _packing_list(n, tokens=5):
    """A packing list as the plugin installs it, fed n captures inside a capturing forward."""
    cls = plugin._make_list_class(type("AuxHiddenStateList", (list,), {
        "capture": lambda self, h, owned=False: self.append(h if owned else h.clone())}))
    captures = [torch.randn(tokens, H) for _ in range(n)]
    lst = cls()
    token = plugin._num_captures.set(K)
    try:
        for c in captures:
            lst.capture(c)
    finally:
        plugin._num_captures.reset(token)
    return lst, captures


@pytest.mark.parametrize("combine", ["plain", "norm_before_fc", "fc_norms"])
def test_the_packing_list_projects_each_capture_and_keeps_no_bytes_of_it(combine):
    inner = Eagle3Inner(combine)
    assert sp.register_draft(Draft(inner))
    plugin.STATE["project"] = True
    lst, captures = _packing_list(K)
    assert len(lst) == K and all(e.shape == (5, 0) for e in lst)  # [T, 0] stand-ins: no bytes
    expected = ProjectingAccumulator(K, inner.fc.weight, norm_before_fc=inner.input_norm, fc_norms=inner.fc_norm)
    for c in captures:
        expected.append(c)
    assert torch.equal(plugin.projected_input(lst), expected.finalize())

    def logits_forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        return aux_hidden_states

    lst, captures = _packing_list(K)
    stored = plugin._logits_forward(logits_forward, None, None, None, None, None, lst)
    assert isinstance(stored, torch.Tensor) and stored.shape == (5, HD)
    packed = torch.cat(captures, -1)  # the draft's own combine of the same captures
    ref = inner.fc(packed) if combine == "plain" else None
    if ref is not None:
        torch.testing.assert_close(stored, ref, rtol=1e-5, atol=1e-5)


def test_without_a_fitting_draft_the_list_packs():
    plugin.STATE["project"] = True
    lst, captures = _packing_list(K)  # nothing registered
    assert plugin.projected_input(lst) is None
    assert torch.equal(torch.cat(list(lst), -1), torch.cat(captures, -1))
    assert sp.register_draft(Draft(Eagle3Inner()))
    plan, why = sp.plan_for(K + 1, captures[0])
    assert plan is None and f"captures {K + 1} layers" in why
    plan, why = sp.plan_for(K, captures[0].double())
    assert plan is None and "float64" in why
    assert sp.plan_for(None, captures[0])[0] == sp.capture_plan()  # K unknown: the draft's, checked at the end


def test_dflash_skips_its_projection_for_a_projected_input():
    draft = DFlashDraftModel()
    assert sp.register_draft(draft) and sp.registered().kind == "dflash"
    packed = torch.randn(5, K * H)
    original = DFlashDraftModel.project_target_hidden
    assert torch.equal(sp.projected_target_hidden(original, draft, packed), draft.project_target_hidden(packed))
    projected = torch.randn(5, HD)
    assert torch.equal(sp.projected_target_hidden(original, draft, projected), draft.hidden_norm(projected))


def test_the_load_hook_registers_a_draft_workers_model_only():
    class Runner:
        def __init__(self, draft):
            self.is_draft_worker, self.model = draft, Draft(Eagle3Inner())

    def load_model(self):
        return "loaded"

    assert plugin._runner_load(load_model, Runner(False)) == "loaded" and sp.registered() is None
    assert plugin._runner_load(load_model, Runner(True)) == "loaded" and sp.registered().kind == "eagle3"


def test_the_drafts_cuda_graph_buffers_are_sized_for_the_projected_input():
    """``get_draft_input_from_target_hidden_dim`` sizes the draft's CUDA-graph static
    hidden-state buffers (draft extend, prefill): K*H becomes H_draft while an Eagle3
    draft's input is projected; any other width, or no draft, is SGLang's."""
    def width(model_runner):
        return model_runner

    assert sp.draft_input_width(width, K * H) == K * H  # nothing registered
    assert sp.register_draft(Draft(Eagle3Inner("norm_before_fc")))
    assert sp.draft_input_width(width, K * H) == HD
    assert sp.draft_input_width(width, H) == H  # a draft that does not read the captures' concat
    sp.clear()
    assert sp.register_draft(DFlashDraftModel())
    assert sp.draft_input_width(width, K * H) == K * H  # DFlash: its own workers' buffers


def _list_class():
    return plugin._make_list_class(type("AuxHiddenStateList", (list,), {
        "capture": lambda self, h, owned=False: self.append(h if owned else h.clone())}))


def _logits_forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
    return aux_hidden_states  # what the logits processor would store for the draft


@pytest.mark.parametrize("combine", ["plain", "norm_before_fc", "fc_norms"])
@pytest.mark.parametrize("where", ["layer graphs", "one graph"])
def test_a_forward_dynamo_traces_projects_each_capture_as_the_eager_list_does(combine, where):
    """--enable-torch-compile: the captures are projected by the same ops inside the graphs
    Dynamo traces (each layer its own graph, the layer loop eager, as SGLang's CPU build
    breaks; or the whole forward, list and logits hook included, one graph); the draft's
    input equals the eager list's bit for bit and the list keeps no capture's bytes."""
    inner = Eagle3Inner(combine)
    assert sp.register_draft(Draft(inner))
    plugin.STATE["project"] = True
    cls = _list_class()
    x0 = torch.randn(7, H)

    def layer(x, capture):
        y = torch.sin(x) * 1.5 + x
        capture(y)
        return y

    def forward(x, layer_fn):
        aux, h = cls(), x
        for _ in range(K):
            h = layer_fn(h, aux.capture)
        return h, plugin._logits_forward(_logits_forward, None, None, None, None, None, aux), aux

    torch._dynamo.reset()
    eager_h, eager_input, eager_aux = forward(x0, layer)
    finished = draft_registry.finished_count(sp.REGISTRY_NAME)
    for _ in range(2):  # what confirms the projection, compiled as eager: the finishing op's count
        if where == "layer graphs":
            h, projected, aux = forward(x0, torch.compile(layer, backend="aot_eager", fullgraph=True))
            assert all(e.shape == (7, 0) for e in aux)
        else:
            h, projected = torch.compile(lambda x: forward(x, layer)[:2], backend="aot_eager", fullgraph=True)(x0)
    assert draft_registry.finished_count(sp.REGISTRY_NAME) == finished + 2
    assert torch.equal(h, eager_h) and projected.shape == (7, HD)
    assert torch.equal(projected, eager_input)
    assert all(e.shape == (7, 0) for e in eager_aux)
    if combine == "plain":  # the draft's own cat-then-fc of the same captures
        captures = []
        forward(x0, lambda x, _: layer(x, captures.append))
        torch.testing.assert_close(projected, inner.fc(torch.cat(captures, -1)), rtol=1e-5, atol=1e-5)


@pytest.mark.inductor
def test_inductor_compiled_layers_project_bitwise_equal_to_the_eager_list():
    """The projection made inside Inductor-compiled layers equals, bit for bit, the eager
    list's projection of the same captures. The captures themselves are the compiled build's
    own (returned beside the layer's output): Inductor's ``tanh`` may differ from ATen's by an
    ulp on some CPUs, so an eager forward's captures are not the reference."""
    inner = Eagle3Inner("norm_before_fc")
    assert sp.register_draft(Draft(inner))
    plugin.STATE["project"] = True
    cls = _list_class()

    def layer(x, capture):
        y = x * 2 + 1
        capture(y)
        return torch.tanh(y), y

    torch._dynamo.reset()
    compiled_layer = torch.compile(layer, fullgraph=True)
    aux, h, captures = cls(), torch.linspace(-1, 1, 5 * H).reshape(5, H), []
    for _ in range(K):
        h, y = compiled_layer(h, aux.capture)
        captures.append(y.clone())
    compiled_projection = plugin.projected_input(aux)

    eager_aux = cls()
    for y in captures:
        eager_aux.capture(y)
    assert torch.equal(compiled_projection, plugin.projected_input(eager_aux))


def test_a_projection_left_incomplete_or_overrun_is_a_clear_error():
    assert sp.register_draft(Draft(Eagle3Inner()))
    plugin.STATE["project"] = True
    lst, _ = _packing_list(K - 1)  # K-1 captures: the draft reads K
    with pytest.raises(plugin.AuxCaptureError, match=f"captured {K - 1} hidden states.*reads {K}"):
        plugin._logits_forward(_logits_forward, None, None, None, None, None, lst)
    lst, _ = _packing_list(K)
    with pytest.raises(plugin.AuxCaptureError, match=f"capture {K} .*does not fit"):
        lst.capture(torch.randn(5, H))
    lst, _ = _packing_list(1)
    with pytest.raises(plugin.AuxCaptureError, match="capture 1 .*first capture"):
        lst.capture(torch.randn(6, H))


def test_k_comes_from_the_configured_model_where_model_runner_forward_is_bypassed():
    """SGLang's CUDA-graph runners call ``model.forward`` themselves: K is that of the model
    ``configure_aux_hidden_state_capture`` set capture layers on."""
    class Target(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers_to_capture = []

        def set_eagle3_layers_to_capture(self, ids):
            self.layers_to_capture = list(ids)

    def configure(*, model, eagle_use_aux_hidden_state, eagle_aux_hidden_state_layer_ids, **_):
        if eagle_use_aux_hidden_state:
            model.set_eagle3_layers_to_capture(eagle_aux_hidden_state_layer_ids)

    target = Target()
    plugin._capturing_models.clear()
    assert plugin._configured_k() is None
    plugin._configure_capture(configure, model=target, eagle_use_aux_hidden_state=True,
                              eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4], dflash_use_aux_hidden_state=False)
    plugin._configure_capture(configure, model=nn.Linear(2, 2), eagle_use_aux_hidden_state=False,
                              eagle_aux_hidden_state_layer_ids=None, dflash_use_aux_hidden_state=False)
    assert plugin._configured_k() == 4
    lst = _list_class()()
    for _ in range(4):  # no ModelRunner.forward around: packed with K=4 all the same
        lst.capture(torch.randn(3, H))
    assert plugin.pack_view(lst).shape == (3, 4 * H) and lst._cp_packer is not None
    plugin._capturing_models.clear()


def test_the_draft_is_registered_by_name_for_the_capture_ops():
    from compile_pass import draft_registry

    assert sp.register_draft(Draft(Eagle3Inner("fc_norms")))
    draft = draft_registry.lookup(sp.REGISTRY_NAME)
    assert draft.projection(K).fc_norms is not None
    with pytest.raises(plugin.AuxCaptureError, match=f"reads {K} captures, not {K + 1}"):
        draft.projection(K + 1)
    sp.clear()
    assert sp.REGISTRY_NAME not in draft_registry.registered_names()
