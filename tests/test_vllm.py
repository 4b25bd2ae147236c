"""The vLLM plugin against the real vllm package, each tested minor in its own venv
(``make vllm``: 0.33.0 and 0.34.0; skipped without vllm).

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


#: an Inductor build vs the uncompiled model: Inductor's C++ silu (an exp) rounds an ulp off
#: ATen's on some CPUs (AVX-512), and the layers after carry it on; a capture holding another
#: layer's residual is off by O(1)
INDUCTOR_CLOSE = dict(rtol=1e-5, atol=1e-5)


def _same(a, b, exact):
    """Bitwise where both sides run the same kernels, else within ``INDUCTOR_CLOSE``."""
    if exact:
        return torch.equal(a, b)
    torch.testing.assert_close(a, b, **INDUCTOR_CLOSE)
    return True


def _assert_plugin_rows(rows, overhead, rh, rp, rsmall, exact=True, list_build_right=True):
    """``exact``: eager pieces run ATen's kernels, as the uncompiled model does, so the outputs
    are bitwise its own. Inductor pieces (``exact=False``) are bitwise vLLM's Inductor builds
    without the plugin (the captures too where that list build is right: ``list_build_right``)
    and within ``INDUCTOR_CLOSE`` of the uncompiled model."""
    peak, h, packed, others = rows[True][True]
    assert overhead[True] <= 1.02, overhead
    # the model's own output is bitwise vLLM's build without the plugin, and without captures
    assert torch.equal(h, rows[False][True][1])
    assert torch.equal(h, rows[True][False][1])
    if not exact and list_build_right:
        # the captures are bitwise vLLM's Inductor list build's (the plugin off), at every token count
        _, _, off_packed, off_others = rows[False][True]
        assert torch.equal(packed, off_packed)
        for (oh, oaux), (fh, faux) in zip(others, off_others):
            assert torch.equal(oh, fh) and torch.equal(_speculator_cat(oaux), torch.cat(faux, -1))
    assert _same(h, rh, exact)
    # the captures equal the uncompiled list path's, at every token count
    assert _same(packed, rp, exact)
    for (oh, oaux), (sh, saux) in zip(others, rsmall):
        assert _same(oh, sh, exact)
        assert _same(_speculator_cat(oaux), torch.cat(saux, -1), exact)
    # the speculator's concat was a view of the graph's packed buffer
    assert plugin.stats["cat_views"] >= 1


BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_pieces_sum_captures(plugin_off, backend):
    before = dict(plugin.stats)
    rows, overhead, rh, rp, rsmall = _check(backend, "sum")
    assert overhead[False] >= 1.10, overhead  # the list path + the speculator's cat
    _assert_plugin_rows(rows, overhead, rh, rp, rsmall, exact=backend == "eager")
    assert plugin.stats["groups_rewritten"] > before["groups_rewritten"]
    if backend == "inductor":
        assert plugin.stats["piece_passes"] > before["piece_passes"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_one_graph_mode_dynamo_trace_once(plugin_off, backend):
    """DYNAMO_TRACE_ONCE (what vLLM's CPU platform forces): one graph, no split, the backend
    a stock name. The plugin's ``init_backend`` hands vLLM ``aux_capture`` with that inner
    and ``pack_outputs``: the returned captures are one buffer's slices, the speculator's
    concat a view, the outputs bitwise the uncompiled model's (eager) or vLLM's Inductor
    build without the plugin (inductor)."""
    before = dict(plugin.stats)
    rows, overhead, rh, rp, rsmall = _check(backend, "sum", mode="DYNAMO_TRACE_ONCE")
    assert overhead[False] >= 1.10, overhead
    _assert_plugin_rows(rows, overhead, rh, rp, rsmall, exact=backend == "eager")
    assert plugin.stats["groups_rewritten"] > before["groups_rewritten"]
    assert plugin.stats["piece_passes"] == before["piece_passes"]  # no split, no pieces


@pytest.mark.inductor
def test_vllm_one_graph_mode_with_aot_compile(plugin_off, tmp_path, monkeypatch):
    """vLLM's ahead-of-time compile (on by default with its compile cache, torch >= 2.10)
    refuses a backend result that is not a ``SerializableCallable``: the plugin's Inductor
    result is one, saved to vLLM's cache and loaded back by the next build (which vLLM then
    recompiles, as it does without the plugin on this mode: ``finalize_loading``): bitwise
    the first build, within Inductor's rounding of the uncompiled model."""
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
    outs = []
    for _ in range(2):
        model, run, _ = H.build("inductor", style="sum", capture_at=CAPTURES, mode="DYNAMO_TRACE_ONCE")
        model.load_state_dict(ref.state_dict())
        h, aux = run(x)
        outs.append((h.clone(), _speculator_cat(aux).clone()))
        _same(h, rh, exact=False)
        _same(outs[-1][1], torch.cat(raux, -1), exact=False)
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])
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
    users = dict(cfg.compilation_config.inductor_compile_config)
    inductor = cfg.compilation_config.init_backend(cfg)
    assert inductor.backend.inductor_options == users  # the backend installs its own passes
    cfg = H.vllm_config("aot_eager", mode="DYNAMO_TRACE_ONCE")
    assert cfg.compilation_config.init_backend(cfg) == "aot_eager"

    def broken(*args, **kwargs):
        raise RuntimeError("simulated")

    monkeypatch.setattr(plugin._OneGraphCapture, "__init__", broken)
    cfg = H.vllm_config("inductor", mode="DYNAMO_TRACE_ONCE")
    users = dict(cfg.compilation_config.inductor_compile_config)
    assert cfg.compilation_config.init_backend(cfg) == "inductor"
    assert cfg.compilation_config.inductor_compile_config == users  # stock Inductor as without us


@pytest.mark.inductor
def test_vllm_inductor_pieces_clone_captures(plugin_off):
    """``residual.clone()`` after an in-place fused norm: stock Inductor pieces hand back the
    mutated residual itself (the captures all read the last residual); with the plugin
    (DistinctOutputsPass in every piece) they equal the uncompiled model's (within Inductor's
    rounding: no list build here is right to compare with bitwise)."""
    rows, overhead, rh, rp, rsmall = _check("inductor", "clone")
    _assert_plugin_rows(rows, overhead, rh, rp, rsmall, exact=False, list_build_right=False)
    # the hazard, measured without the plugin: off by far more than rounding
    assert not torch.allclose(rows[False][True][2], rp, **INDUCTOR_CLOSE)


@pytest.mark.inductor
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


@pytest.mark.inductor
def test_vllm_inductor_pieces_capturing_leaves_the_model_bitwise(plugin_off):
    """Capturing ``hidden + residual`` before a norm that computes the same sum (vLLM's
    ``forward_native`` style) gives the down projection's ``mm`` a second reader in capture
    layers, and Inductor then stops folding ``mm + residual`` into ``addmm`` there (measured:
    16 addmm without captures, 11 with 5 captures: benchmarks/vllm_numerics.py), which rounds
    differently. The plugin wires ``CaptureTwinsPass`` into every piece's post-grad pre pass:
    with captures the model's output is bitwise the build without captures."""
    kw = dict(style="native", hidden=512, intermediate=1024)
    ref = H.build("none", capture_at=CAPTURES, **kw)[0]
    assert plugin.install()
    torch.manual_seed(4)
    x = torch.randn(256, 512)
    outs = {}
    for caps in ((), CAPTURES):
        model, run, _ = H.build("inductor", capture_at=caps, **kw)
        model.load_state_dict(ref.state_dict())
        outs[bool(caps)] = run(x)
    assert torch.equal(outs[True][0], outs[False][0])
    with torch.no_grad():
        _, raux = ref(x)
    packed = _speculator_cat(outs[True][1])
    assert torch.allclose(packed, torch.cat(raux, -1), rtol=0, atol=1e-5)


@pytest.mark.inductor
def test_vllm_inductor_pieces_keep_returned_clones_distinct(plugin_off, monkeypatch):
    """The plugin on, but no capture rewritten (here: the rewrite fails, so the graph is split
    unchanged): the pieces return the ``residual.clone()`` captures themselves. Inductor's
    ``remove_noop_ops`` and then vLLM's own ``UnsafeCloneEliminationPass`` drop those clones
    (both compare storages before reinplacing); ``ReturnedCopiesPass`` (the joint-graph pre
    pass, through ``VllmBackend.configure_post_pass``) tags them and ``DistinctOutputsPass``
    (right after vLLM's clone elimination) restores them: captures the uncompiled model's
    (within Inductor's rounding), at every token count of one compile."""
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
        _same(h, rh, exact=False)  # Inductor's silu vs ATen's: an ulp on some CPUs
        assert len(aux) == len(raux) and all(_same(a, b, exact=False) for a, b in zip(aux, raux))
    assert plugin.stats["rewrite_errors"] > before["rewrite_errors"]
    assert plugin.stats["configs_wired"] > before["configs_wired"]
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


def _concat_modules():
    """The runner / speculator modules whose concat the plugin makes a view, in this vLLM."""
    import importlib.util

    return [importlib.import_module(name) for name, _, _ in plugin.CONCAT_SITES
            if importlib.util.find_spec(name) is not None]


def test_every_seam_fits_this_vllm():
    """The probes find every seam the plugin relies on in this tested release; the V1 runner
    (and its concat) exists before 0.34 and is gone from 0.34 on (an optional seam)."""
    from compile_pass.integrations.seams import report

    probes = plugin.probe_vllm()
    assert all(p.fits for p in probes), report(probes)
    assert plugin.is_tested(plugin.vllm_version())
    v1 = next(p for p in probes if p.seam.name == "vllm.v1.worker.gpu_model_runner.torch")
    minor = tuple(int(x) for x in plugin.vllm_version().split(".")[:2])
    assert v1.state == ("absent" if minor >= (0, 34) else "ok"), v1
    assert len(_concat_modules()) == (2 if minor >= (0, 34) else 3)
    routes = [p for p in probes if p.seam.is_route]
    assert len(routes) == 2 and all(not p.patches for p in routes)


def _unpatched():
    """The objects the plugin would replace, as vLLM has them now."""
    import vllm.compilation.backends as backends
    from vllm.config.compilation import CompilationConfig

    return (backends.split_graph, CompilationConfig.__dict__["init_backend"],
            *[m.torch for m in _concat_modules()])


def test_a_seam_that_moved_is_named_and_nothing_is_patched(plugin_off, monkeypatch):
    import vllm.compilation.backends as backends

    def split_graph(gm, ops_in_another_order_and_name):  # another signature
        raise AssertionError

    monkeypatch.setattr(backends, "split_graph", split_graph)
    before = _unpatched()
    with pytest.warns(RuntimeWarning, match=r"split_graph: moved \(split_graph\['gm'"):
        assert not plugin.install()
    assert _unpatched() == before and not plugin.is_active()
    # a required seam that is gone entirely: named as well
    monkeypatch.undo()
    import vllm.model_executor.models.interfaces as itf

    monkeypatch.delattr(itf.EagleModelMixin, "_maybe_add_hidden_state")
    with pytest.warns(RuntimeWarning, match="_maybe_add_hidden_state is missing"):
        assert not plugin.install()
    assert not plugin.is_active()


def test_an_untested_minor_stays_off_unless_asked(plugin_off, monkeypatch):
    """A vLLM minor not in TESTED: off, the warning says what the probes found and how to
    try it anyway; with COMPILE_PASS_VLLM_UNTESTED=1 the probes alone decide."""
    monkeypatch.setattr(plugin, "TESTED", ("0.99",))
    monkeypatch.delenv(plugin.ENV_UNTESTED, raising=False)
    before = _unpatched()
    with pytest.warns(RuntimeWarning, match=r"is not a tested release \(tested: 0.99.x\); all 10 seams fit"
                                            r".*To try it anyway set COMPILE_PASS_VLLM_UNTESTED=1"):
        assert not plugin.install()
    assert _unpatched() == before
    monkeypatch.setenv(plugin.ENV_UNTESTED, "1")
    assert plugin.install() and plugin.is_active()


def _cache_key(config):
    """vLLM's compile-cache factors of ``config`` (``compile_factors`` from 0.34 on)."""
    return config.compile_factors() if hasattr(config, "compile_factors") else config.compute_hash()


def test_compile_cache_key_changes_with_the_plugin(plugin_off):
    """vLLM's own cache factors (no patch): the plugin's passes in ``inductor_compile_config``
    carry its uuid, so a config whose backend was built with the plugin on hashes apart from
    one built without it, and two plugin-on builds hash alike."""
    keys = {}
    for on in (False, True, True):
        if on:
            assert plugin.install()
        config = H.vllm_config("inductor")
        config.compilation_config.init_backend(config)
        keys.setdefault(on, []).append(_cache_key(config))
    plugin.uninstall()
    off_again = H.vllm_config("inductor")
    off_again.compilation_config.init_backend(off_again)
    assert keys[True][0] == keys[True][1] != keys[False][0] == _cache_key(off_again)
    # this project's passes hash as vLLM expects: str uuids
    from vllm.compilation.passes.inductor_pass import InductorPass

    class Elim(InductorPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "elim"

    assert plugin.install()
    config = H.vllm_config("inductor")
    config.compilation_config.init_backend(config)
    steps = [config.compilation_config.inductor_compile_config[s] for s in plugin._SLOTS]
    assert all(isinstance(p, InductorPass) and isinstance(p.uuid(), str) for p in steps)
    assert isinstance(plugin._distinct_after_class(InductorPass)(Elim()).uuid(), str)


def test_passes_wired_into_vllms_config(plugin_off):
    """Plugin on: each Inductor slot holds the user's pass (run first) then this project's;
    wiring twice adds nothing; the one-graph backend gets the user's config only."""
    from compile_pass.inductor_pass import CaptureTwinsPass, PieceWritesPass, ReturnedCopiesPass

    calls = []

    def users_pass(graph):
        calls.append("user")

    assert plugin.install()
    config = H.vllm_config("inductor")
    cc = config.compilation_config
    cc.inductor_compile_config["post_grad_custom_pre_pass"] = users_pass
    cc.init_backend(config)
    cc.init_backend(config)
    slots = cc.inductor_compile_config
    assert [type(slots[s].ours) for s in plugin._SLOTS] == [ReturnedCopiesPass, CaptureTwinsPass,
                                                             PieceWritesPass]
    assert slots["post_grad_custom_pre_pass"].before is users_pass
    assert slots["joint_custom_pre_pass"].before is None
    slots["post_grad_custom_pre_pass"](torch.fx.Graph())
    assert calls == ["user"]
    one = H.vllm_config("inductor", mode="DYNAMO_TRACE_ONCE")
    one.compilation_config.inductor_compile_config["post_grad_custom_pre_pass"] = users_pass
    users = dict(one.compilation_config.inductor_compile_config)
    backend = one.compilation_config.init_backend(one)
    assert backend.backend.inductor_options == users
    plugin.uninstall()
    off = H.vllm_config("inductor")
    off.compilation_config.init_backend(off)
    assert not any(k in off.compilation_config.inductor_compile_config for k in plugin._SLOTS)


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


def test_runner_cats_are_views_only_for_adjacent_slices(plugin_off):
    """Every concat site the plugin patches in this vLLM (MRV2's Eagle3 and DFlash
    speculators; the V1 runner before 0.34): a view for adjacent slices, a copy for a
    gather, torch's own cat otherwise."""
    assert plugin.install()
    modules = _concat_modules()
    assert modules
    buf = torch.randn(64, 3 * 16)
    aux = [buf[:, i * 16:(i + 1) * 16] for i in range(3)]
    n = 40
    for m in modules:
        view = m.torch.cat([h[:n] for h in aux], dim=-1)  # propose_draft_token_ids, Eagle3
        assert view.data_ptr() == buf.data_ptr() and torch.equal(view, buf[:n])
        rest = m.torch.cat([h[5:n] for h in aux], dim=-1)  # DFlash: rows after the FULL graph's
        assert rest.data_ptr() == buf[5:].data_ptr() and torch.equal(rest, buf[5:n])
        idx = torch.tensor([3, 1, 7])
        gathered = m.torch.cat([h[idx] for h in aux], dim=-1)  # a gather: still a copy
        assert torch.equal(gathered, buf[idx]) and gathered.data_ptr() != buf.data_ptr()
        separate = [torch.randn(8, 4) for _ in range(3)]
        assert torch.equal(m.torch.cat(separate, dim=-1), torch.cat(separate, dim=-1))
        assert torch.equal(m.torch.cat(separate), torch.cat(separate))  # other dims untouched
        staged = torch.empty(n, 48)
        m.torch.cat([h[:n] for h in aux], dim=-1, out=staged)  # DFlash's FULL-graph staging
        assert torch.equal(staged, buf[:n])


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
