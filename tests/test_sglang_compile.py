"""``--enable-torch-compile``: the Inductor config the SGLang plugin scopes to SGLang's
compile (``make sglang``).

SGLang compiles ``model.forward`` with plain ``torch.compile`` (Inductor, whatever
``torch._inductor.config`` holds) inside its ``patch_model`` context. The plugin's around-hook
opens config patches with this project's passes for as long as that context is open. Tested
on that layer: the three keys chained after the user's passes inside, the config as it was
outside; through SGLang's own CPU ``patch_model``; the stock-Inductor clone-of-residual hazard
(a ``residual.clone()`` of an input a fused op mutates) returned as a copy; the held-out
communicator-style decoder (models/communicator.py) compiled whole by plain ``torch.compile``
equal to the uncompiled model, its cat rewritten into a packed buffer.
"""

from __future__ import annotations


import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
import torch._inductor.config as ic  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import models.communicator as communicator  # noqa: E402

from compile_pass.inductor_pass import (AuxCapturePass, CaptureTwinsPass,  # noqa: E402
                                        DistinctOutputsPass, ReturnedCopiesPass, _ChainedPass)
from compile_pass.integrations import sglang as p  # noqa: E402

pytestmark = pytest.mark.usefixtures("_fresh_dynamo")  # tests/conftest.py


def _flat(pass_):
    if isinstance(pass_, _ChainedPass):
        return _flat(pass_.first) + _flat(pass_.second)
    return [pass_]


@pytest.fixture(autouse=True)
def _inductor_config_restored():
    """Every test starts with the three keys unset and leaves Inductor's config as it was;
    no FX graph cache (a cache hit runs no pass)."""
    with ic.patch({**{k: None for k in p.INDUCTOR_KEYS}, "fx_graph_cache": False}):
        yield


@pytest.fixture
def plugin_config(monkeypatch):
    """Inductor's config inside the plugin's compile scope (what SGLang's compile sees)."""
    monkeypatch.delenv(p.ENV_COMPILE, raising=False)
    monkeypatch.setitem(p.STATE, "inductor", {})
    with p.compile_config_patch():
        yield ic


def test_three_keys_chained_after_the_users_passes_inside_the_scope_only(monkeypatch):
    def user_pre(g):
        return None

    def user_post(g):
        return None

    def user_joint(g):
        return None

    ic.post_grad_custom_pre_pass = user_pre
    ic.post_grad_custom_post_pass = user_post
    ic.joint_custom_pre_pass = user_joint
    monkeypatch.delenv(p.ENV_COMPILE, raising=False)
    with p.compile_config_patch():
        pre, post, joint = (_flat(getattr(ic, k)) for k in p.INDUCTOR_KEYS)
    assert pre[0] is user_pre and [type(x) for x in pre[1:]] == [CaptureTwinsPass]
    assert post[0] is user_post and [type(x) for x in post[1:]] == [AuxCapturePass, DistinctOutputsPass]
    assert joint[0] is user_joint and [type(x) for x in joint[1:]] == [ReturnedCopiesPass]
    # the process's config is the user's again once the scope closes
    assert (ic.post_grad_custom_pre_pass, ic.post_grad_custom_post_pass, ic.joint_custom_pre_pass) \
        == (user_pre, user_post, user_joint)


def test_sglangs_own_patch_model_scopes_the_passes(monkeypatch):
    """The around-hook on SGLang's CPU ``patch_model`` (its real context manager): the
    passes are set while its context is open, and only then."""
    from types import SimpleNamespace

    from sglang.srt.model_executor import cpu_graph_runner

    monkeypatch.delenv(p.ENV_COMPILE, raising=False)
    model = torch.nn.Linear(4, 4)
    group = SimpleNamespace(ca_comm=None)
    with p._compile_scope(cpu_graph_runner.patch_model, model, True, 4, group) as forward:
        inside = [type(x) for x in _flat(ic.post_grad_custom_post_pass)]
        assert callable(forward)
    assert inside == [AuxCapturePass, DistinctOutputsPass]
    assert ic.post_grad_custom_post_pass is None and ic.joint_custom_pre_pass is None
    with p._compile_scope(cpu_graph_runner.patch_model, model, False, 4, group) as forward:
        assert forward == model.forward  # compile off: SGLang's own forward, the scope still set


def test_none_set_gives_exactly_the_projects_passes(plugin_config):
    assert [type(x) for x in _flat(ic.post_grad_custom_pre_pass)] == [CaptureTwinsPass]
    assert [type(x) for x in _flat(ic.post_grad_custom_post_pass)] == [AuxCapturePass, DistinctOutputsPass]
    assert [type(x) for x in _flat(ic.joint_custom_pre_pass)] == [ReturnedCopiesPass]
    assert set(p.STATE["inductor"]) == set(p.INDUCTOR_KEYS)


def test_compile_switch_off_leaves_inductor_alone(monkeypatch):
    monkeypatch.setenv(p.ENV_COMPILE, "0")
    assert p.compile_config_patch() is None
    assert all(getattr(ic, k) is None for k in p.INDUCTOR_KEYS)


def test_lite_mode_sets_no_pass_and_says_so(monkeypatch):
    monkeypatch.delenv(p.ENV_COMPILE, raising=False)
    with ic.patch(use_post_grad_passes=False):
        with pytest.warns(RuntimeWarning, match="use_post_grad_passes is False .*lite mode"):
            assert p.compile_config_patch() is None


_W = torch.randn(8)


def _fused_then_clone(h, r):
    torch.ops.comm_test.fused_add_rmsnorm_(h, r, _W)
    return r.clone(), h * 2


@pytest.mark.inductor
@pytest.mark.parametrize("plugin", ["off", "on"])
def test_clone_of_a_mutated_residual_is_a_copy(plugin, request):
    """Stock Inductor hands back the mutated input for ``r.clone()``; with the plugin's
    config (plain ``torch.compile``, as SGLang compiles) it is a copy."""
    if plugin == "on":
        request.getfixturevalue("plugin_config")
    h, r = torch.randn(4, 8), torch.randn(4, 8)
    expected, _ = _fused_then_clone(h.clone(), r.clone())
    capture, _ = torch.compile(_fused_then_clone, backend="inductor", fullgraph=True)(h, r)
    r.add_(1.0)  # the next layer's fused op, in place
    if plugin == "off":
        # the hazard this guards against (seen on 2.11-2.14.1); if stock Inductor stops
        # aliasing, this branch says so
        assert capture.data_ptr() == r.data_ptr(), "stock Inductor no longer aliases"
    else:
        assert capture.data_ptr() != r.data_ptr()
        assert counters["aux_capture"]["outputs_kept_distinct"] >= 1
        assert torch.equal(capture, expected)


@pytest.mark.inductor
def test_communicator_decoder_whole_graph_equals_uncompiled_and_packs():
    """SGLang's way: the whole forward (cat included) compiled by plain torch.compile, the
    global config stock then as the plugin sets it; captures equal the uncompiled model's,
    the cat rewritten into a packed buffer, the compiled peak lower."""
    from compile_pass.memory import measure_peak

    model, x = communicator.build(tokens=512, num_layers=8, hidden=256, intermediate=256,
                                  capture_at=range(7), cat_inside=True)
    peaks = {}
    with torch.no_grad():
        ref_h, ref_aux = model(x)
        for plugin in ("off", "on"):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="inductor", fullgraph=True)
            if plugin == "on":
                with p.compile_config_patch():  # SGLang compiles inside patch_model's scope
                    compiled(x)
            else:
                compiled(x)
            peak = measure_peak(compiled, x)
            got_h, got_aux = peak.result
            torch.testing.assert_close(got_aux, ref_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
            peaks[plugin] = peak.bytes
    assert counters["aux_capture"]["groups_rewritten"] == 1, dict(counters["aux_capture"])
    assert peaks["on"] < peaks["off"], peaks
