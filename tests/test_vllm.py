"""The vLLM plugin against the real vllm 0.33.0 package (``make vllm``; skipped without vllm).

Decoders built the way vLLM builds models (``@support_torch_compile``, VllmConfig with
mode VLLM_COMPILE, split at an attention custom op), compiled by vLLM's own stack with
eager and Inductor pieces, one compile over a symbolic token count run at several counts,
plugin off vs on side by side in one process.
"""

import os

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from compile_pass import measure_peak  # noqa: E402
from compile_pass.integrations import vllm as plugin  # noqa: E402
import models.vllm_style as H  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
CAPTURES = (1, 3, 5, 6, 7)
TOKENS = 2048


@pytest.fixture
def plugin_off():
    plugin.uninstall()
    yield
    plugin.uninstall()


def _speculator_cat(aux):
    import vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator as spec

    return spec.torch.cat(aux, dim=-1)  # the speculator's own statement, through its global


def _measure(backend, style, ref, on, mode="VLLM_COMPILE"):
    """{captures?: (peak bytes, hidden, packed, outputs at other token counts)}."""
    if on:
        assert plugin.install()
    else:
        plugin.uninstall()
    out = {}
    torch.manual_seed(1)
    x = torch.randn(TOKENS, 256)
    small = [torch.randn(n, 256) for n in (5, 64, 100)]
    for caps in ((), CAPTURES):
        model, run, _ = H.build(backend, style=style, capture_at=caps, mode=mode)
        model.load_state_dict(ref.state_dict())
        others = [run(s) for s in small]  # the first call compiles (symbolic token count)

        def full(x):
            h, aux = run(x)
            return h, (_speculator_cat(aux) if aux else None)

        p = measure_peak(full, x)
        out[bool(caps)] = (p.bytes, p.result[0], p.result[1], others)
    return out, x, small


def _check(backend, style, mode="VLLM_COMPILE"):
    ref = H.build("none", style=style, capture_at=CAPTURES)[0]
    rows = {}
    for on in (False, True):
        rows[on], x, small = _measure(backend, style, ref, on, mode)
    with torch.no_grad():
        rh, raux = ref(x)
        rsmall = [ref(s) for s in small]
    packed_bytes = torch.cat(raux, -1).numel() * 4
    overhead = {on: (rows[on][True][0] - rows[on][False][0]) / packed_bytes for on in rows}
    return rows, overhead, rh, torch.cat(raux, -1), rsmall


def _assert_plugin_rows(rows, overhead, rh, rp, rsmall):
    peak, h, packed, others = rows[True][True]
    assert overhead[True] <= 1.02, overhead
    # the model's own output is bitwise vLLM's build without the plugin, and without captures
    assert torch.equal(h, rows[False][True][1])
    assert torch.equal(h, rows[True][False][1])
    assert torch.equal(h, rh)
    # the captures equal the uncompiled list path's, at every token count
    assert torch.equal(packed, rp)
    for (oh, oaux), (sh, saux) in zip(others, rsmall):
        assert torch.equal(oh, sh)
        assert torch.equal(_speculator_cat(oaux), torch.cat(saux, -1))
    # the speculator's concat was a view of the graph's packed buffer
    assert plugin.stats["cat_views"] >= 1


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_vllm_pieces_sum_captures(plugin_off, backend):
    before = dict(plugin.stats)
    rows, overhead, rh, rp, rsmall = _check(backend, "sum")
    assert overhead[False] >= 1.10, overhead  # the list path + the speculator's cat
    _assert_plugin_rows(rows, overhead, rh, rp, rsmall)
    assert plugin.stats["groups_rewritten"] > before["groups_rewritten"]
    if backend == "inductor":
        assert plugin.stats["piece_passes"] > before["piece_passes"]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_vllm_one_graph_mode_dynamo_trace_once(plugin_off, backend):
    """DYNAMO_TRACE_ONCE (what vLLM's CPU platform forces): one graph, no split, the backend
    a stock name. The plugin's ``init_backend`` hands vLLM ``aux_capture`` with that inner
    and ``pack_outputs``: the returned captures are one buffer's slices, the speculator's
    concat a view, the outputs bitwise the uncompiled model's."""
    before = dict(plugin.stats)
    rows, overhead, rh, rp, rsmall = _check(backend, "sum", mode="DYNAMO_TRACE_ONCE")
    assert overhead[False] >= 1.10, overhead
    _assert_plugin_rows(rows, overhead, rh, rp, rsmall)
    assert plugin.stats["groups_rewritten"] > before["groups_rewritten"]
    assert plugin.stats["piece_passes"] == before["piece_passes"]  # no split, no pieces


def test_vllm_one_graph_mode_with_aot_compile(plugin_off, tmp_path, monkeypatch):
    """vLLM's ahead-of-time compile (on by default with its compile cache, torch >= 2.10)
    refuses a backend result that is not a ``SerializableCallable``: the plugin's Inductor
    result is one, saved to vLLM's cache and loaded back by the next build (which vLLM then
    recompiles, as it does without the plugin on this mode: ``finalize_loading``)."""
    from vllm.compilation.counter import compilation_counter

    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ref = H.build("none", style="sum", capture_at=CAPTURES)[0]
    assert plugin.install()
    saved = compilation_counter.num_aot_artifacts_saved
    torch.manual_seed(3)
    x = torch.randn(300, 256)
    with torch.no_grad():
        rh, raux = ref(x)
    for _ in range(2):
        model, run, _ = H.build("inductor", style="sum", capture_at=CAPTURES, mode="DYNAMO_TRACE_ONCE")
        model.load_state_dict(ref.state_dict())
        h, aux = run(x)
        assert torch.equal(h, rh) and torch.equal(_speculator_cat(aux), torch.cat(raux, -1))
    assert compilation_counter.num_aot_artifacts_saved > saved
    assert list(tmp_path.rglob("model")), "no AOT artifact in vLLM's cache"


def test_init_backend_wraps_only_one_graph_modes_stock_names(plugin_off, monkeypatch):
    """VLLM_COMPILE keeps VllmBackend; DYNAMO_TRACE_ONCE's ``inductor`` / ``eager`` become the
    capture backend (Inductor with vLLM's config); ``aot_eager`` and a backend that cannot be
    built stay vLLM's, the latter with a log line."""
    from vllm.compilation.backends import VllmBackend

    assert plugin.install()
    cfg = H.vllm_config("inductor", mode="VLLM_COMPILE")
    assert isinstance(cfg.compilation_config.init_backend(cfg), VllmBackend)
    for name in ("inductor", "eager"):
        cfg = H.vllm_config(name, mode="DYNAMO_TRACE_ONCE")
        got = cfg.compilation_config.init_backend(cfg)
        assert isinstance(got, plugin._OneGraphCapture) and got.inner == name
        assert got.backend.pack_outputs
    assert got.backend.inductor_options == {}
    cfg = H.vllm_config("inductor", mode="DYNAMO_TRACE_ONCE")
    inductor = cfg.compilation_config.init_backend(cfg)
    assert inductor.backend.inductor_options == dict(cfg.compilation_config.inductor_compile_config)
    cfg = H.vllm_config("aot_eager", mode="DYNAMO_TRACE_ONCE")
    assert cfg.compilation_config.init_backend(cfg) == "aot_eager"

    def broken(*args, **kwargs):
        raise RuntimeError("simulated")

    monkeypatch.setattr(plugin._OneGraphCapture, "__init__", broken)
    cfg = H.vllm_config("inductor", mode="DYNAMO_TRACE_ONCE")
    assert cfg.compilation_config.init_backend(cfg) == "inductor"


def test_vllm_inductor_pieces_clone_captures(plugin_off):
    """``residual.clone()`` after an in-place fused norm: stock Inductor pieces hand back the
    mutated residual itself (the captures all read the last residual); with the plugin
    (DistinctOutputsPass in every piece) they equal the uncompiled model's."""
    rows, overhead, rh, rp, rsmall = _check("inductor", "clone")
    _assert_plugin_rows(rows, overhead, rh, rp, rsmall)
    assert not torch.equal(rows[False][True][2], rp)  # the hazard, measured without the plugin


def test_vllm_inductor_pieces_native_norm(plugin_off):
    """vLLM's ``RMSNorm.forward_native`` style (the norm's ``hidden + residual`` in torch: a
    piece computes the capture's sum a second time), Inductor pieces. Inductor fuses the
    norm's sum differently from the uncompiled model (about 1e-6 off, plugin on or off), so
    here the plugin's build is compared bitwise with vLLM's build without the plugin."""
    ref = H.build("none", style="native", capture_at=CAPTURES)[0]
    rows = {on: _measure("inductor", "native", ref, on)[0] for on in (False, True)}
    packed_bytes = TOKENS * 256 * 4 * len(CAPTURES)
    overhead = {on: (rows[on][True][0] - rows[on][False][0]) / packed_bytes for on in rows}
    assert overhead[False] >= 1.10 and overhead[True] <= 1.02, overhead
    _, h_off, packed_off, others_off = rows[False][True]
    _, h_on, packed_on, others_on = rows[True][True]
    assert torch.equal(h_on, h_off) and torch.equal(packed_on, packed_off)
    for (a, aux_a), (b, aux_b) in zip(others_on, others_off):
        assert torch.equal(a, b) and torch.equal(_speculator_cat(aux_a), torch.cat(aux_b, -1))


def test_vllm_inductor_pieces_keep_returned_clones_distinct(plugin_off, monkeypatch):
    """The plugin on, but no capture rewritten (here: the rewrite fails, so the graph is split
    unchanged): the pieces return the ``residual.clone()`` captures themselves. Inductor's
    ``remove_noop_ops`` and then vLLM's own ``UnsafeCloneEliminationPass`` drop those clones
    (both compare storages before reinplacing); ``ReturnedCopiesPass`` (the joint-graph pre
    pass, through ``VllmBackend.configure_post_pass``) tags them and ``DistinctOutputsPass``
    (right after vLLM's clone elimination) restores them: captures bitwise the uncompiled
    model's, at every token count of one compile."""
    import compile_pass
    from torch._dynamo.utils import counters

    def refuse(*args, **kwargs):
        raise RuntimeError("no rewrite in this test")

    ref = H.build("none", style="clone", capture_at=CAPTURES)[0]
    assert plugin.install()
    monkeypatch.setattr(compile_pass, "rewrite_graph", refuse)
    before = dict(plugin.stats)
    kept = counters["aux_capture"]["outputs_kept_distinct"]
    model, run, _ = H.build("inductor", style="clone", capture_at=CAPTURES)
    model.load_state_dict(ref.state_dict())
    torch.manual_seed(2)
    for n in (5, 300):
        x = torch.randn(n, 256)
        h, aux = run(x)
        with torch.no_grad():
            rh, raux = ref(x)
        assert torch.equal(h, rh)
        assert len(aux) == len(raux) and all(torch.equal(a, b) for a, b in zip(aux, raux))
    assert plugin.stats["rewrite_errors"] > before["rewrite_errors"]
    assert plugin.stats["joint_pre_passes"] > before["joint_pre_passes"]
    assert plugin.stats["distinct_passes"] > before["distinct_passes"]
    assert counters["aux_capture"]["outputs_kept_distinct"] >= kept + len(CAPTURES)


def test_register_does_nothing_unless_asked(plugin_off, monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    import vllm.compilation.backends as backends

    split = backends.split_graph
    plugin.register()
    assert not plugin.is_active() and backends.split_graph is split
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    assert plugin.is_active() and backends.split_graph is not split
    plugin.uninstall()
    assert backends.split_graph is split


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert eps["aux_capture"].load() is plugin.register


def test_a_vllm_that_differs_gets_a_warning_and_no_patch(plugin_off, monkeypatch):
    import vllm.compilation.backends as backends
    import vllm.v1.worker.gpu_model_runner as runner

    def split_graph(gm, ops, extra):  # another signature
        raise AssertionError

    monkeypatch.setattr(backends, "split_graph", split_graph)
    torch_before = runner.torch
    with pytest.warns(RuntimeWarning, match="split_graph"):
        assert not plugin.install()
    assert backends.split_graph is split_graph and runner.torch is torch_before
    assert not plugin.is_active()
    monkeypatch.undo()
    monkeypatch.setattr(plugin, "SUPPORTED", "0.99")
    with pytest.warns(RuntimeWarning, match="written for vllm 0.99"):
        assert not plugin.install()


def test_compile_cache_key_changes_with_the_plugin(plugin_off):
    config = H.vllm_config("eager")
    off = config.compute_hash()
    assert plugin.install()
    on = config.compute_hash()
    plugin.uninstall()
    assert on != off and len(on) == len(off) and config.compute_hash() == off
    # this project's passes hash as vLLM expects: str uuids
    from vllm.compilation.passes.inductor_pass import InductorPass
    from compile_pass.inductor_pass import ReturnedCopiesPass

    class Elim(InductorPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "elim"

    pieces = [plugin._piece_pass_class(InductorPass)(), plugin._distinct_after_class(InductorPass)(Elim()),
              ReturnedCopiesPass()]
    assert all(isinstance(p.uuid(), str) for p in pieces)


def test_full_cudagraph_keeps_one_static_buffer(plugin_off):
    """MRV2's ModelCudaGraphManager allocates its persistent aux buffers as a list on the
    first capture; with the plugin they are K column views of one [max_tokens, K*H]
    buffer, replay's slices are adjacent, and the speculator's concat is that buffer's view."""
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    assert plugin.install()
    mgr = object.__new__(ModelCudaGraphManager)
    mgr.aux_hidden_states = []  # __init__'s assignment
    outs = [torch.randn(512, 32) for _ in range(4)]  # the model's outputs at the largest size
    mgr.aux_hidden_states = [torch.empty_like(x) for x in outs]  # capture()'s allocation
    buf = mgr.packed_aux_buffer
    assert buf.shape == (512, 128)
    for i, aux in enumerate(outs):  # capture()'s copy into the persistent buffers
        mgr.aux_hidden_states[i][:300] = aux[:300]
    replay = [x[:300] for x in mgr.aux_hidden_states]  # run_fullgraph's return
    packed = _speculator_cat(replay)
    assert packed.data_ptr() == buf.data_ptr() and torch.equal(packed, torch.cat([o[:300] for o in outs], -1))
    plugin.uninstall()
    mgr2 = object.__new__(ModelCudaGraphManager)
    mgr2.aux_hidden_states = [torch.empty_like(x) for x in outs]
    assert "packed_aux_buffer" not in mgr2.__dict__  # plugin off: vLLM's K buffers


def test_v1_runner_cat_is_a_view_only_for_adjacent_slices(plugin_off):
    import vllm.v1.worker.gpu_model_runner as runner

    assert plugin.install()
    buf = torch.randn(64, 3 * 16)
    aux = [buf[:, i * 16:(i + 1) * 16] for i in range(3)]
    n = 40
    view = runner.torch.cat([h[:n] for h in aux], dim=-1)  # propose_draft_token_ids
    assert view.data_ptr() == buf.data_ptr() and torch.equal(view, buf[:n])
    idx = torch.tensor([3, 1, 7])
    gathered = runner.torch.cat([h[idx] for h in aux], dim=-1)  # a gather: still a copy
    assert torch.equal(gathered, buf[idx]) and gathered.data_ptr() != buf.data_ptr()
    separate = [torch.randn(8, 4) for _ in range(3)]
    assert torch.equal(runner.torch.cat(separate, dim=-1), torch.cat(separate, dim=-1))
    assert torch.equal(runner.torch.cat(separate), torch.cat(separate))  # other dims untouched


def test_uncompiled_models_capture_into_one_buffer(plugin_off):
    """EagleModelMixin._maybe_add_hidden_state outside torch.compile (breakable CUDA graphs
    turn compile off for ~30 architectures): each capture is written into its slice."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    class M(EagleModelMixin):
        aux_hidden_state_layers = (0, 2, 3)

    def forward(m):
        torch.manual_seed(0)
        h, r = torch.randn(32, 8), torch.randn(32, 8)
        aux = []
        for i in range(5):
            aux = m._maybe_add_hidden_state(aux, i, h, r if i else None)
            h, r = h * 1.5 + 1, r + h
        return aux

    ref = forward(M())
    assert plugin.install()
    got = forward(M())
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == 3
    packed = _speculator_cat(got)
    assert packed.data_ptr() == got[0].data_ptr() and torch.equal(packed, torch.cat(ref, -1))
