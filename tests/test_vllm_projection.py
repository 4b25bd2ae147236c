"""``COMPILE_PASS_VLLM_PROJECT=1`` against the real vllm package (``make vllm``: 0.33.0 and
0.34.0; skipped without vllm): the draft's combine taken when the draft is built, the
target's captures projected into one ``[T, H_draft]`` (compiled by vLLM's own stack with
eager and Inductor pieces, one compile over a symbolic token count; and uncompiled), the
speculators' concat and the draft's ``combine_hidden_states`` passing it on, the FULL-graph
buffers and DFlash's staging one ``H_draft`` wide."""

import os
import tempfile

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from compile_pass import ProjectingAccumulator, measure_peak  # noqa: E402
from compile_pass.integrations import vllm as plugin  # noqa: E402
from compile_pass.integrations import vllm_projection  # noqa: E402
import models.vllm_style as H  # noqa: E402
from models.vllm_drafts import eagle3_engine  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
CAPTURES = (1, 3, 5, 6, 7)
K, HIDDEN, H_DRAFT = len(CAPTURES), 256, 192


def _vllm_combine():
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    combine = Eagle3LlamaForCausalLM.combine_hidden_states
    return getattr(combine, "__wrapped__", combine)


def Eagle3Draft(combine: str = "fc") -> nn.Module:
    """The stand-in (for tests that take a draft apart); ``real_draft`` is vLLM's own class."""
    return H.Eagle3Draft(K, HIDDEN, H_DRAFT, combine)


def real_engine(combine: str = "fc", h_draft: int = H_DRAFT):
    """An engine's configs (a Llama target, vLLM's Eagle3 draft; ``models/vllm_drafts.py``)."""
    return eagle3_engine(tempfile.mkdtemp(prefix="cp-vllm-draft-"), hidden=HIDDEN, layers=max(CAPTURES) + 2,
                         h_draft=h_draft, capture_layers=CAPTURES, combine=combine)


def real_draft(engine, registers: bool = True) -> nn.Module:
    """vLLM's ``Eagle3LlamaForCausalLM`` built by its loader for ``engine``; with the
    projection on, its own ``__init__`` registers it as that engine's draft."""
    draft = engine.build_draft()
    assert type(draft).__name__ == "Eagle3LlamaForCausalLM"
    assert vllm_projection.is_registered(draft) == registers
    # vLLM's CPU build keeps a linear's weight plain when marked so (its repack would empty it)
    assert getattr(draft.model.fc, "_cpu_skip_gemm_dispatch", False) == registers
    if registers:
        assert vllm_projection._owner(engine.config) is draft
    return draft


@pytest.fixture
def projecting(monkeypatch):
    plugin.uninstall()
    monkeypatch.setenv(vllm_projection.ENV_PROJECT, "1")
    assert plugin.install()
    assert plugin._projecting()
    yield
    plugin.uninstall()


def _run_list(backend, caps, x, small, ref, mode="VLLM_COMPILE"):
    model, run, _ = H.build(backend, capture_at=caps, mode=mode)
    model.load_state_dict(ref.state_dict())
    others = [run(s) for s in small]  # the first call compiles (symbolic token count)
    return run, others


@pytest.mark.parametrize("backend,combine,mode", [
    ("eager", "fc", "VLLM_COMPILE"), ("eager", "norm_before_fc", "VLLM_COMPILE"), ("eager", "fc_norms", "VLLM_COMPILE"),
    pytest.param("inductor", "norm_before_fc", "VLLM_COMPILE", marks=pytest.mark.inductor),
    pytest.param("inductor", "fc_norms", "DYNAMO_TRACE_ONCE", marks=pytest.mark.inductor)])
def test_compiled_target_returns_the_projected_draft_input(projecting, backend, combine, mode):
    """vLLM's compile of the target (pieces split at attention, or the one graph of
    DYNAMO_TRACE_ONCE, vLLM's CPU platform's mode): the graph returns ``[T, H_draft]`` and
    ``[T, 0]`` stand-ins, the eager ``ProjectingAccumulator`` over the uncompiled model's
    captures at every token count (bitwise with eager pieces; Inductor pieces compute the
    captures with Inductor's own silu, an ulp off ATen's on some CPUs, so within rounding);
    the target's own output bitwise the same build without captures; the speculator's cat
    and the draft's combine pass it on."""
    exact = backend == "eager"  # eager pieces run ATen's kernels, as the uncompiled model
    ref = H.build("none", capture_at=CAPTURES)[0]
    torch.manual_seed(1)
    x = torch.randn(300, HIDDEN)
    small = [torch.randn(n, HIDDEN) for n in (5, 64)]
    before = plugin.stats["groups_projected"]
    engine = real_engine(combine)
    model, run, _ = H.build(backend, capture_at=CAPTURES, mode=mode,  # the target, then its draft (load_model)
                            speculative_config=engine.speculative_config)
    model.load_state_dict(ref.state_dict())
    draft = real_draft(engine)
    others = [run(s) for s in small]  # the first call compiles (symbolic token count)
    assert plugin.stats["groups_projected"] > before
    plain = H.build(backend, capture_at=(), mode=mode)  # the same build without captures
    plain[0].load_state_dict(ref.state_dict())
    for inp, (h, aux) in zip([*small, x], [*others, run(x)]):
        with torch.no_grad():
            rh, raux = ref(inp)
            acc = ProjectingAccumulator(K, draft.model.fc.weight, fc_norms=draft.model.fc_norm,
                                        norm_before_fc=draft.model.input_norm if draft.model.norm_before_fc else None)
            acc.extend(raux)
            expected = acc.finalize()
            listed = _vllm_combine()(draft, torch.cat(raux, -1))
        assert [tuple(a.shape) for a in aux] == [(inp.shape[0], H_DRAFT)] + [(inp.shape[0], 0)] * (K - 1)
        if exact:
            assert torch.equal(aux[0], expected)
        else:
            torch.testing.assert_close(aux[0], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(aux[0], listed, rtol=1e-5, atol=1e-5)  # vLLM's cat, then its combine
        plain_h = plain[1](inp)[0]
        assert torch.equal(h, plain_h)
        if exact:
            assert torch.equal(plain_h, rh)
        else:
            torch.testing.assert_close(plain_h, rh, rtol=1e-5, atol=1e-5)
        spec = __import__("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", fromlist=["x"])
        drafted = draft.combine_hidden_states(spec.torch.cat(aux, dim=-1))
        assert drafted.data_ptr() == aux[0].data_ptr()  # no copy, no second fc


@pytest.mark.parametrize("backend, mode", [
    ("eager", "VLLM_COMPILE"),
    pytest.param("inductor", "DYNAMO_TRACE_ONCE", marks=pytest.mark.inductor)])
def test_projected_peak_is_below_the_packed_buffer(projecting, backend, mode):
    """Overhead above the build without captures, in packed bytes, T=2048: the projected
    target is at the floor, H_draft/(K*H) plus the sum of squares' column (0.151), where the
    packer ends at 1.00; in eager pieces and in Inductor's one graph (there, with Inductor's
    buffer reuse on, the accumulator raised Inductor's peak estimate and it held a `[T, H]`
    buffer across an attention call: 0.200 here, 0.500 at K=3 in the benchmark)."""
    engine = real_engine("norm_before_fc")
    draft = real_draft(engine)
    ref = H.build("none", capture_at=CAPTURES)[0]
    x = torch.randn(2048, HIDDEN)
    peaks = {}
    spec = __import__("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", fromlist=["x"])
    for caps in ((), CAPTURES):
        model, run, _ = H.build(backend, mode=mode, capture_at=caps, speculative_config=engine.speculative_config)
        model.load_state_dict(ref.state_dict())
        run(torch.randn(7, HIDDEN))

        def full(x, run=run):
            h, aux = run(x)
            return h, (draft.combine_hidden_states(spec.torch.cat(aux, dim=-1)) if aux else None)

        peaks[bool(caps)] = measure_peak(full, x).bytes
        del model, run, full
        torch._dynamo.reset()
    overhead = (peaks[True] - peaks[False]) / (2048 * K * HIDDEN * 4)
    floor = (H_DRAFT + 1) / (K * HIDDEN)  # the accumulator and the sum of squares' fp32 column
    assert overhead <= floor + 0.01, (overhead, floor)


def test_uncompiled_target_projects_each_capture(projecting):
    """``_maybe_add_hidden_state`` outside torch.compile: a stand-in per capture, the
    finished projection in the list's first place, equal to the eager accumulator."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    from vllm.config import set_current_vllm_config

    engine = real_engine("fc_norms")
    draft = real_draft(engine)

    class M(EagleModelMixin):
        aux_hidden_state_layers = (0, 1, 2, 3, 4)

    torch.manual_seed(0)
    h, r = torch.randn(32, HIDDEN), torch.randn(32, HIDDEN)
    aux, captured = [], []
    m = M()
    with set_current_vllm_config(engine.config):  # the engine's forward
        for i in range(6):
            captured.append(h + r)
            aux = m._maybe_add_hidden_state(aux, i, h, r)
            h, r = h * 1.5 + 1, r + h
    acc = ProjectingAccumulator(K, draft.model.fc.weight, fc_norms=draft.model.fc_norm)
    acc.extend(captured[:K])
    assert len(aux) == K and torch.equal(aux[0], acc.finalize()) and all(a.shape == (32, 0) for a in aux[1:])


def test_full_cudagraph_buffers_and_dflash_staging_are_h_draft_wide(projecting):
    """FULL CUDA graphs: ``persistent_like`` of the projected outputs is one ``[max, H_draft]``
    buffer (and zero-byte stand-ins), not K ``[max, H]``; DFlash's staging buffer is
    ``[rows, H_draft]`` while a draft is registered, and its ``cat(..., out=)`` fills it."""
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    draft = real_draft(real_engine())
    mgr = object.__new__(ModelCudaGraphManager)
    outs = [torch.randn(512, H_DRAFT)] + [torch.empty(512, 0) for _ in range(K - 1)]
    mgr.aux_hidden_states = [torch.empty_like(x) for x in outs]  # capture()'s allocation
    assert sum(b.numel() for b in mgr.aux_hidden_states) == 512 * H_DRAFT
    assert "packed_aux_buffer" not in mgr.__dict__
    DFlashSpeculator = _dflash_speculator()
    assert hasattr(DFlashSpeculator.load_model, "__wrapped__")  # the seam: after the draft loads
    spec, other = object.__new__(DFlashSpeculator), object.__new__(DFlashSpeculator)
    spec.model, other.model = draft, Eagle3Draft()  # `other` loaded a draft that is not registered
    spec._aux_staging, other._aux_staging = torch.zeros(64, K * HIDDEN), torch.zeros(64, K * HIDDEN)
    assert vllm_projection.stage_projection(spec) and not vllm_projection.stage_projection(other)
    assert spec._aux_staging.shape == (64, H_DRAFT) and other._aux_staging.shape == (64, K * HIDDEN)
    module = __import__("vllm.v1.worker.gpu.spec_decode.dflash.speculator", fromlist=["x"])
    module.torch.cat([o[:40] for o in outs], dim=-1, out=spec._aux_staging[:40])
    assert torch.equal(spec._aux_staging[:40], outs[0][:40])
    # what the FULL graph's context step hands the draft: a row slice of its own staging
    staged = spec._aux_staging[:40]
    assert vllm_projection.staging_owner(staged) is draft and draft.combine_hidden_states(staged) is staged
    assert vllm_projection.staging_owner(spec._aux_staging[:40, :10]) is None
    assert vllm_projection.staging_owner(other._aux_staging[:40]) is None
    assert not vllm_projection.is_projection(staged)  # a staging is a contract with its draft, not a mark


def _dflash_speculator():
    try:
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    except ImportError:
        pytest.skip("this vLLM has no MRV2 DFlash speculator")
    return DFlashSpeculator


def _staging_speculator(draft, rows: int):
    """A ``DFlashSpeculator`` holding ``draft`` with a FULL-graph staging of ``rows`` rows,
    staged by the plugin's load seam; ``store(num_tokens, aux, graph_rows)`` runs vLLM's own
    ``_store_hidden_states`` and then what the captured context step does
    (``_prepare_graph_forward``: ``hidden_states[:n] = combine(staging[:n])``), returning
    the draft's input rows."""
    spec = object.__new__(_dflash_speculator())
    spec.model = draft
    spec._aux_staging = torch.zeros(rows, K * HIDDEN)
    assert vllm_projection.stage_projection(spec)
    spec.hidden_states = torch.full((rows * 2, draft.model.fc.weight.shape[0]), float("nan"))

    def store(num_tokens, aux, graph_rows):
        spec._store_hidden_states(num_tokens, None, aux, graph_rows)
        n = min(num_tokens, graph_rows)
        spec.hidden_states[:n].copy_(spec.model.combine_hidden_states(spec._aux_staging[:n]))
        return spec.hidden_states[:num_tokens].clone()

    return spec, store


def test_a_packing_step_beside_a_projected_staging_goes_through_the_drafts_fc(projecting):
    """The target packs in a step (a refused group, a pass error, another engine's
    recompile) while the registered draft's FULL-graph staging is ``[rows, H_draft]``: vLLM's
    own ``DFlashSpeculator._store_hidden_states`` stages the packed captures, and the draft's
    input equals vLLM's combine of the packed concat (its own ``fc``, as without the plugin),
    rows staged and rows combined eagerly alike. A projecting step before and after gives the
    projection. Before: the packed K*H columns were written into the H_draft-wide staging
    (torch resized the out= slice) and read back as a projection."""
    draft = real_draft(real_engine("norm_before_fc"))
    spec, store = _staging_speculator(draft, rows=48)
    torch.manual_seed(5)
    captures = [torch.randn(40, HIDDEN) for _ in range(K)]
    with torch.no_grad():
        expected = _vllm_combine()(draft, torch.cat(captures, -1))
        acc = ProjectingAccumulator(K, draft.model.fc.weight, norm_before_fc=draft.model.input_norm)
        acc.extend(captures)
        projection = acc.finalize()
    projected_list = [projection] + [projection.new_empty(40, 0) for _ in range(K - 1)]
    before = dict(vllm_projection.staging_stats)
    for num_tokens, graph_rows in ((40, 48), (40, 16)):  # all rows staged; 16 staged, 24 combined eagerly
        with torch.no_grad():
            got_projected = store(num_tokens, projected_list, graph_rows)
            got_packed = store(num_tokens, list(captures), graph_rows)
            again = store(num_tokens, projected_list, graph_rows)
        assert torch.equal(got_projected, projection) and torch.equal(again, projection)
        torch.testing.assert_close(got_packed, expected, rtol=1e-6, atol=1e-6)  # fc over other row counts
        assert not torch.isnan(got_packed).any()
    assert vllm_projection.staging_stats["packed_then_combined"] == before["packed_then_combined"] + 2
    assert vllm_projection.staging_stats["projected"] == before["projected"] + 4
    with pytest.raises(vllm_projection.AuxCaptureError, match="staging"):  # neither layout: named, not written
        module = __import__("vllm.v1.worker.gpu.spec_decode.dflash.speculator", fromlist=["x"])
        module.torch.cat([c[:8, :10] for c in captures], dim=-1, out=spec._aux_staging[:8])


def test_a_projection_is_passed_on_only_in_its_own_step(projecting):
    """A slice or a copy of a projection, or a later tensor in its buffer, is not a
    projection: only the tensor the speculator's concat handed on in that step. A
    projection reaching a draft of another width is an error, never given to ``fc``."""
    draft = real_draft(real_engine())
    spec_mod = __import__("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", fromlist=["x"])
    projection = torch.randn(16, H_DRAFT)
    handed = spec_mod.torch.cat([projection] + [projection.new_empty(16, 0)] * (K - 1), dim=-1)
    assert handed is projection and draft.combine_hidden_states(handed) is handed
    for not_marked in (projection[:8], projection.clone(), torch.randn(16, H_DRAFT)):
        with pytest.raises(RuntimeError):  # vLLM's own combine: fc reads K*H
            draft.combine_hidden_states(not_marked)
    other = real_draft(real_engine(h_draft=128))
    with pytest.raises(vllm_projection.AuxCaptureError, match="made for another draft"):
        other.combine_hidden_states(handed)


def test_draft_classes_are_patched_and_pass_projections_on(projecting):
    """The real draft classes: ``__init__`` registers, ``combine_hidden_states`` returns an
    input already ``H_draft`` wide as it is and runs vLLM's combine on anything else."""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    assert hasattr(Eagle3LlamaForCausalLM.__init__, "__wrapped__")
    draft = real_draft(real_engine("norm_before_fc"))
    projected = vllm_projection.mark_projection(torch.randn(9, H_DRAFT))
    assert Eagle3LlamaForCausalLM.combine_hidden_states(draft, projected) is projected
    unmarked = torch.randn(9, H_DRAFT)  # as wide as a projection, but not one the plugin made
    with pytest.raises(RuntimeError):  # vLLM's own combine: fc reads K*H
        Eagle3LlamaForCausalLM.combine_hidden_states(draft, unmarked)
    packed = torch.randn(9, K * HIDDEN)
    torch.testing.assert_close(Eagle3LlamaForCausalLM.combine_hidden_states(draft, packed),
                               _vllm_combine()(draft, packed))


def test_a_draft_not_recognised_is_named_and_packed(projecting):
    draft = Eagle3Draft("fc_norms")
    draft.model.fc_norm[1] = nn.LayerNorm(HIDDEN)
    with pytest.warns(RuntimeWarning, match="LayerNorm, not an RMSNorm"):
        assert not vllm_projection.register_draft(draft)
    assert vllm_projection.draft_name() is None
    q = Eagle3Draft()
    q.model.fc.weight = nn.Parameter(torch.zeros(H_DRAFT, K * HIDDEN, dtype=torch.int8), requires_grad=False)
    with pytest.warns(RuntimeWarning, match="quantized"):
        assert not vllm_projection.register_draft(q)


def test_projection_off_by_default(monkeypatch):
    plugin.uninstall()
    monkeypatch.delenv(vllm_projection.ENV_PROJECT, raising=False)
    try:
        assert plugin.install()
        assert not plugin._projecting()
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        assert not hasattr(Eagle3LlamaForCausalLM.combine_hidden_states, "__wrapped__")
    finally:
        plugin.uninstall()


def test_every_draft_class_present_is_patched(projecting):
    for module, name, optional in vllm_projection.DRAFT_CLASSES:
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except ImportError:
            assert optional
            continue
        assert hasattr(cls.__init__, "__wrapped__") and hasattr(cls.combine_hidden_states, "__wrapped__"), name


def test_dflash_draft_passes_a_projection_on(projecting):
    """vLLM's Qwen3 DFlash combine (``fc`` of the input cast to ``fc.params_dtype``): a
    projected input passes on; the packed one still goes through vLLM's check and ``fc``."""
    qwen3_dflash = pytest.importorskip("vllm.model_executor.models.qwen3_dflash")
    cls = qwen3_dflash.DFlashQwen3ForCausalLM

    class DFlashDraft(nn.Module):
        combine_hidden_states = cls.combine_hidden_states

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.use_aux_hidden_state = True
            self.model.fc = nn.Linear(K * HIDDEN, H_DRAFT, bias=False)
            self.model.fc.input_size, self.model.fc.params_dtype = K * HIDDEN, torch.float32

    DFlashDraft.__name__ = DFlashDraft.__qualname__ = "DFlashQwen3ForCausalLM"
    draft = DFlashDraft()
    assert vllm_projection.register_draft(draft)
    projected = vllm_projection.mark_projection(torch.randn(7, H_DRAFT))
    assert draft.combine_hidden_states(projected) is projected
    packed = torch.randn(7, K * HIDDEN)
    torch.testing.assert_close(draft.combine_hidden_states(packed), draft.model.fc(packed))


def test_a_square_fc_is_refused_and_never_applied_twice(projecting):
    """``H_draft == K*H``: a projection would be as wide as the packed captures (nothing to
    save) and could only be told from them by a mark. The draft is refused with the reason;
    the speculator's cat of the packed captures is vLLM's, and the combine applies ``fc``
    once, as without the plugin."""
    with pytest.warns(RuntimeWarning, match="fc is square"):
        square = real_draft(real_engine("fc", h_draft=K * HIDDEN), registers=False)
    assert not vllm_projection.is_registered(square)
    packed = torch.randn(9, K * HIDDEN)
    spec = __import__("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", fromlist=["x"])
    combined = square.combine_hidden_states(spec.torch.cat(list(packed.chunk(K, -1)), dim=-1))
    torch.testing.assert_close(combined, _vllm_combine()(square, packed), rtol=0, atol=0)
    torch.testing.assert_close(combined, square.model.fc(packed), rtol=0, atol=0)


def test_laguna_dflash_layout_is_named_not_taken(projecting):
    """Laguna's DFlash combine norms each slice and the result itself: not taken."""
    laguna = pytest.importorskip("vllm.model_executor.models.laguna_dflash")

    class LagunaDraft(nn.Module):
        combine_hidden_states = laguna.DFlashLagunaForCausalLM.combine_hidden_states

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.fc = nn.Linear(K * HIDDEN, H_DRAFT, bias=False)

    with pytest.warns(RuntimeWarning, match="a layout the plugin does not take"):
        assert not vllm_projection.register_draft(LagunaDraft())


def test_a_draft_whose_fc_weight_is_gone_leaves_the_target_packed_and_says_so(projecting):
    """vLLM's CPU build repacks ``fc`` for oneDNN after loading and leaves an empty weight
    (``dispatch_cpu_unquantized_gemm(remove_weight=True)``) where its linear method does not
    read the plugin's ``_cpu_skip_gemm_dispatch`` mark: the draft registered at construction
    no longer has columns to split. The compiled target stays packed (the
    speculator's concat a view of the packed captures) and one warning names why."""
    draft = Eagle3Draft()
    assert vllm_projection.register_draft(draft)
    draft.model.fc.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # after loading, on CPU
    ref = H.build("none", capture_at=CAPTURES)[0]
    x = torch.randn(40, HIDDEN)
    with pytest.warns(RuntimeWarning, match="packed, not projected: .*has no 2-D weight"):
        run, _ = _run_list("eager", CAPTURES, x, [x[:5]], ref)
    h, aux = run(x)
    with torch.no_grad():
        rh, raux = ref(x)
    assert [tuple(a.shape) for a in aux] == [(40, HIDDEN)] * K and torch.equal(h, rh)
    assert all(torch.equal(a, b) for a, b in zip(aux, raux))


def test_one_draft_per_engine_each_target_projects_into_its_own(projecting):
    """Two engines in one process, each with vLLM's Eagle3 draft (other widths, other
    combines): each target, compiled under its engine's config, projects into its own
    draft; a target of no engine is packed with the reason while both live (never the
    last draft built); a freed draft's registration goes with it."""
    import gc

    from compile_pass import draft_registry

    engines = {"a": real_engine("fc"), "b": real_engine("norm_before_fc", h_draft=128)}
    drafts = {name: real_draft(e) for name, e in engines.items()}
    names = {name: vllm_projection.draft_name(e.config) for name, e in engines.items()}
    assert None not in names.values() and names["a"] != names["b"]
    ref = H.build("none", capture_at=CAPTURES)[0]
    x = torch.randn(48, HIDDEN)
    with torch.no_grad():
        raux = ref(x)[1]
    for name, engine in engines.items():
        model, run, _ = H.build("eager", capture_at=CAPTURES, speculative_config=engine.speculative_config)
        model.load_state_dict(ref.state_dict())
        aux = run(x)[1]
        inner = drafts[name].model
        acc = ProjectingAccumulator(K, inner.fc.weight, norm_before_fc=inner.input_norm if inner.norm_before_fc else None)
        acc.extend(raux)
        assert aux[0].shape == (48, inner.fc.weight.shape[0]) and torch.equal(aux[0], acc.finalize()), name
    model, run, _ = H.build("eager", capture_at=CAPTURES)  # compiled outside either engine
    model.load_state_dict(ref.state_dict())
    with pytest.warns(RuntimeWarning, match="2 engines' drafts are registered in this process"):
        aux = run(x)[1]
    assert [tuple(a.shape) for a in aux] == [(48, HIDDEN)] * K  # packed: the captures as they are
    del drafts["b"]
    gc.collect()
    assert names["b"] not in draft_registry.registered_names() and names["a"] in draft_registry.registered_names()
    no_engine = H.build("eager", capture_at=CAPTURES)[2]  # a target's config naming no engine
    assert vllm_projection.draft_name(no_engine) == names["a"]  # one engine's draft left: such a target gets it
    assert vllm_projection.draft_name() is None  # a target whose config is not known at all: none


def _as_the_runner(model, config):
    """Call ``model`` as vLLM's model runner does in ``execute_model``: in its forward context,
    with no current config (vLLM sets that around load and the first compile, not here), so a
    first compile here stands for a recompile at run time."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.forward_context import set_forward_context

    def run(x):
        assert get_current_vllm_config_or_none() is None
        with set_forward_context(None, vllm_config=config), torch.no_grad():
            return model(x)

    return run


@pytest.mark.parametrize("mode", ["VLLM_COMPILE", "DYNAMO_TRACE_ONCE"])
def test_each_target_projects_only_into_its_own_engines_draft_where_the_runner_runs_it(projecting, mode):
    """Two engines in one process; engine A's draft registers, engine B's is refused (a
    square fc). Each target is compiled and run the way the model runner runs it (no current
    vLLM config: a compile inside ``execute_model``), compiled and uncompiled: A's target is
    projected into A's draft, B's is packed and B's draft applies its own fc. Before: B's
    target read no engine and was projected into the one registered draft, A's."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    engine_a, engine_b = real_engine("fc"), real_engine("fc", h_draft=K * HIDDEN)
    ref = H.build("none", capture_at=CAPTURES)[0]
    x = torch.randn(24, HIDDEN)
    with torch.no_grad():
        raux = ref(x)[1]
    targets = {}
    for name, engine in (("a", engine_a), ("b", engine_b)):
        model, _, config = H.build("eager", capture_at=CAPTURES, mode=mode, speculative_config=engine.speculative_config)
        model.load_state_dict(ref.state_dict())
        targets[name] = _as_the_runner(model, config)
    draft_a = real_draft(engine_a)
    with pytest.warns(RuntimeWarning, match="fc is square"):
        draft_b = real_draft(engine_b, registers=False)
    spec = __import__("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", fromlist=["x"])
    acc = ProjectingAccumulator(K, draft_a.model.fc.weight)
    acc.extend(raux)
    aux_a = targets["a"](x)[1]
    assert aux_a[0].shape == (24, H_DRAFT) and torch.equal(aux_a[0], acc.finalize())
    with pytest.warns(RuntimeWarning, match="this target's engine has no registered draft"):
        aux_b = targets["b"](x)[1]
    assert [tuple(a.shape) for a in aux_b] == [(24, HIDDEN)] * K
    drafted_b = draft_b.combine_hidden_states(spec.torch.cat(aux_b, dim=-1))
    torch.testing.assert_close(drafted_b, _vllm_combine()(draft_b, torch.cat(raux, -1)), rtol=0, atol=0)

    class Inner(EagleModelMixin):  # an uncompiled target's inner model: vLLM keeps its config on it
        aux_hidden_state_layers = tuple(range(K))

    for engine, width in ((engine_a, H_DRAFT), (engine_b, HIDDEN)):
        inner = Inner()
        inner.vllm_config = engine.config
        aux = []
        for i, capture in enumerate(raux):
            aux = inner._maybe_add_hidden_state(aux, i, capture, None)
        assert aux[0].shape == (24, width)
