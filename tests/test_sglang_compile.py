"""``--enable-torch-compile``: the Inductor config the SGLang plugin sets (``make sglang``).

SGLang compiles ``model.forward`` with plain ``torch.compile`` (Inductor, the global
``torch._inductor.config``). What the plugin sets there is tested on that layer: its three
keys chained after the user's passes, the stock-Inductor clone-of-residual hazard (a
``residual.clone()`` of an input a fused op mutates) returned as a copy, and the held-out
communicator-style decoder (models/communicator.py) compiled whole by plain
``torch.compile`` equal to the uncompiled model, its cat rewritten into a packed buffer.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
import torch._inductor.config as ic  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    """Every test starts with the three keys unset and leaves Inductor's config as it was
    (the plugin sets the global config); no FX graph cache (a cache hit runs no pass)."""
    with ic.patch({**{k: None for k in p.INDUCTOR_KEYS}, "fx_graph_cache": False}):
        yield


@pytest.fixture
def plugin_config(monkeypatch):
    """Inductor's global config as the plugin leaves it."""
    monkeypatch.delenv(p.ENV_COMPILE, raising=False)
    monkeypatch.setitem(p.STATE, "inductor", {})
    p._set_compile_pass()
    return ic


def test_three_keys_chained_after_the_users_passes(monkeypatch):
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
    p._set_compile_pass()
    pre, post, joint = (_flat(getattr(ic, k)) for k in p.INDUCTOR_KEYS)
    assert pre[0] is user_pre and [type(x) for x in pre[1:]] == [CaptureTwinsPass]
    assert post[0] is user_post and [type(x) for x in post[1:]] == [AuxCapturePass, DistinctOutputsPass]
    assert joint[0] is user_joint and [type(x) for x in joint[1:]] == [ReturnedCopiesPass]


def test_none_set_gives_exactly_the_projects_passes(plugin_config):
    assert [type(x) for x in _flat(ic.post_grad_custom_pre_pass)] == [CaptureTwinsPass]
    assert [type(x) for x in _flat(ic.post_grad_custom_post_pass)] == [AuxCapturePass, DistinctOutputsPass]
    assert [type(x) for x in _flat(ic.joint_custom_pre_pass)] == [ReturnedCopiesPass]
    assert set(p.STATE["inductor"]) == set(p.INDUCTOR_KEYS)


def test_compile_switch_off_leaves_inductor_alone(monkeypatch):
    monkeypatch.setenv(p.ENV_COMPILE, "0")
    p._set_compile_pass()
    assert all(getattr(ic, k) is None for k in p.INDUCTOR_KEYS)


_W = torch.randn(8)


def _fused_then_clone(h, r):
    torch.ops.comm_test.fused_add_rmsnorm_(h, r, _W)
    return r.clone(), h * 2


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
            if plugin == "on":
                p._set_compile_pass()
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="inductor", fullgraph=True)
            compiled(x)
            peak = measure_peak(compiled, x)
            got_h, got_aux = peak.result
            torch.testing.assert_close(got_aux, ref_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
            peaks[plugin] = peak.bytes
    assert counters["aux_capture"]["groups_rewritten"] == 1, dict(counters["aux_capture"])
    assert peaks["on"] < peaks["off"], peaks
