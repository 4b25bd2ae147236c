"""Returned captures projected into a registered draft (``project_outputs``): what the vLLM
plugin's rewrite before the split does, on a plain ``torch.compile`` model."""

import pytest
import torch
from torch import nn

from compile_pass import AuxCaptureError, ProjectingAccumulator, draft_registry
from compile_pass.backend import aux_capture_backend
from compile_pass.projection import DraftProjection

H, K, H_DRAFT = 32, 3, 24


class Target(nn.Module):
    """Six layers, captures ``h + r`` at three of them, returned as a list (vLLM's models)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(6))

    def forward(self, x):
        aux, r = [], x
        for i, layer in enumerate(self.layers):
            h = torch.relu(layer(r))
            if i in (1, 3, 5):
                aux.append(h + r)
            r = h + r
        return r, aux


def _draft(combine: str):
    torch.manual_seed(4)
    fc = nn.Linear(K * H, H_DRAFT)
    norms = {"norm_before_fc": {"norm_before_fc": torch.rand(K * H) + 0.5},
             "fc_norms": {"fc_norms": [torch.rand(H) + 0.5 for _ in range(K)]}}.get(combine, {})
    return fc, norms


@pytest.fixture
def registered():
    names = []

    def register(name, combine="fc"):
        fc, norms = _draft(combine)
        draft_registry.register(name, f"test {combine}", lambda k: DraftProjection.build(
            k, fc.weight, fc_bias=fc.bias, **norms))
        names.append(name)
        return fc, norms

    yield register
    for name in names:
        draft_registry.unregister(name)
    torch._dynamo.reset()


@pytest.mark.parametrize("inner,combine", [
    ("eager", "fc"), ("eager", "fc_norms"), ("aot_eager", "norm_before_fc"),
    pytest.param("inductor", "norm_before_fc", marks=[pytest.mark.inductor, pytest.mark.compat])])
def test_returned_captures_become_the_projected_draft_input(registered, inner, combine):
    """One dynamic compile, two token counts: ``[T, H_draft]`` then ``[T, 0]`` stand-ins,
    bitwise the eager accumulator over the uncompiled captures; the target's output bitwise."""
    fc, norms = registered("t-draft", combine)
    model = Target().eval()
    backend = aux_capture_backend(inner, project_outputs="t-draft")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for n in (10, 17):
        x = torch.randn(n, H)
        with torch.no_grad():
            ref_h, ref_aux = model(x)
            out_h, out_aux = compiled(x)
        acc = ProjectingAccumulator(K, fc.weight, fc_bias=fc.bias, **norms)
        acc.extend(ref_aux)
        assert [tuple(a.shape) for a in out_aux] == [(n, H_DRAFT)] + [(n, 0)] * (K - 1)
        assert torch.equal(out_h, ref_h) and torch.equal(out_aux[0], acc.finalize())
    group = next(g for r in backend.results for g in r.groups if g.k == K)
    assert group.fused and "projected into the registered draft 't-draft'" in group.reason


def test_a_group_that_does_not_fit_stays_packed_and_says_why(registered):
    registered("other")  # fc is K*H wide; this target's group of 3 fits, so ask for 2 captures
    model = Target().eval()

    class TwoCaptures(Target):
        def forward(self, x):
            r, aux = super().forward(x)
            return r, aux[:2]

    two = TwoCaptures().eval()
    two.load_state_dict(model.state_dict())
    backend = aux_capture_backend("eager", project_outputs="other")
    with torch.no_grad():
        _, aux = torch.compile(two, backend=backend)(torch.randn(8, H))
    assert [tuple(a.shape) for a in aux] == [(8, H)] * 2
    group = next(g for r in backend.results for g in r.groups if g.k == 2)
    assert not group.fused and "the captures are 32 wide" in group.projection
    missing = aux_capture_backend("eager", project_outputs="nobody")
    torch._dynamo.reset()
    with torch.no_grad():
        _, aux = torch.compile(model, backend=missing)(torch.randn(8, H))
    assert len(aux) == K and aux[0].shape == (8, H)  # packed, as without the option
    assert "no draft named 'nobody'" in next(g for r in missing.results for g in r.groups).projection


def test_a_draft_changed_after_the_compile_is_an_error_not_a_wrong_input(registered):
    registered("changing")
    compiled = torch.compile(Target().eval(), backend=aux_capture_backend("eager", project_outputs="changing"))
    with torch.no_grad():
        compiled(torch.randn(4, H))
        registered("changing", "norm_before_fc")  # another combine under the same name
        with pytest.raises(AuxCaptureError, match="the graph was built for fc K=3"):
            compiled(torch.randn(4, H))
        draft_registry.unregister("changing")
        with pytest.raises(AuxCaptureError, match="no draft named 'changing'"):
            compiled(torch.randn(4, H))


def test_bad_project_outputs_option():
    with pytest.raises(TypeError, match="project_outputs"):
        aux_capture_backend("eager", project_outputs=3)
    with pytest.raises(TypeError, match="non-empty string"):
        draft_registry.register("", "x", lambda k: None)
