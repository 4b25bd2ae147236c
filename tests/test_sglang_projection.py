"""The SGLang plugin's draft-input projection (``COMPILE_PASS_SGLANG_PROJECT``), without
SGLang: drafts shaped like SGLang 0.5.23's Eagle3 (``llama_eagle3.LlamaModel``) and DFlash
(``dflash.DFlashDraftModel``) models are read or refused with the reason; the packing list
projects each capture and holds no bytes of it; the logits-processor hook hands the
projected tensor on; DFlash's projection is skipped for an input already projected; the
draft-loading hook registers a draft worker's model only."""

import pytest
import torch
from torch import nn

from compile_pass import ProjectingAccumulator
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
    expected = sp.registered().accumulator()
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
    acc, why = sp.accumulator_for(K + 1, captures[0])
    assert acc is None and f"captures {K + 1} layers" in why
    acc, why = sp.accumulator_for(K, captures[0].double())
    assert acc is None and "float64" in why


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


def test_the_accumulator_is_the_packers_drop_in():
    acc = sp.DraftInput("eagle3", "x", sp.DraftProjection.build(K, torch.randn(HD, K * H))).accumulator()
    assert isinstance(acc, ProjectingAccumulator) and acc.copies_on_append


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
