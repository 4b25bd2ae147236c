"""The reference decoder models: capture modes agree, captures are the right values, Dynamo traces them."""

from __future__ import annotations


import pytest
import torch


import models  # noqa: E402
from compile_pass import AuxHiddenStateList, pack_aux_hidden_states  # noqa: E402
from models import common, deepseek, dflash, llama  # noqa: E402

#: (id, FACTORIES name, config overrides): every model, plus llama with custom-op capture producers.
VARIANTS = [
    ("llama", "llama", {}),
    ("llama_fused", "llama", {"capture_producer": "fused_norm"}),
    ("deepseek", "deepseek", {}),
    ("dflash", "dflash", {}),
]
VARIANT_IDS = [v[0] for v in VARIANTS]
PACKING_MODES = ("list", "packer", "list_out")
T = 16


def _build(variant, mode, tokens=T, **kw):
    _, name, overrides = variant
    return models.build(name, "tiny", mode, tokens=tokens, **overrides, **kw)


def _run_all_modes(variant, tokens=T):
    out = {}
    for mode in common.CAPTURE_MODES:
        model, inputs = _build(variant, mode, tokens)
        with torch.no_grad():
            out[mode] = model(*inputs)
    return model, out


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_capture_modes_agree(variant):
    model, out = _run_all_modes(variant)
    k, hidden = model.num_captures, model.config.hidden_size
    assert k == len(model.capture_layers) == model.config.num_captures
    ref_hidden = out["none"][0]
    assert ref_hidden.shape == (T, hidden) and torch.isfinite(ref_hidden).all()
    assert out["none"][1] is None
    for mode in common.CAPTURE_MODES:
        assert torch.equal(out[mode][0], ref_hidden), mode
    assert isinstance(out["list"][1], torch.Tensor)
    assert isinstance(out["packer"][1], torch.Tensor)
    listed = out["list_out"][1]
    assert type(listed) is list and len(listed) == k
    assert all(t.shape == (T, hidden) for t in listed)
    ref_aux = out["list"][1]
    assert ref_aux.shape == (T, k * hidden)
    for mode in PACKING_MODES:
        assert torch.equal(pack_aux_hidden_states(out[mode][1]), ref_aux), mode


def test_model_capture_layers():
    assert _build(VARIANTS[0], "list")[0].capture_layers == (2, 4, 5)
    assert _build(VARIANTS[2], "list")[0].capture_layers == (2, 4, 5)
    m = _build(VARIANTS[3], "list")[0]
    assert m.capture_layers == (1, 3, 4, 6, 7) and m.num_captures == 5
    m = llama.LlamaModel(llama.tiny_config(capture_layers=[0, 7]))
    assert m.capture_layers == (0, 7)
    with pytest.raises(ValueError):
        llama.tiny_config(capture_layers=[3, 8])
    with pytest.raises(ValueError):
        llama.tiny_config(capture_layers=[4, 2])


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_captures_are_values_at_capture_time(variant):
    """Capture ``j`` equals the pre-norm residual sum entering capture layer ``j``, snapshotted then."""
    model, inputs = _build(variant, "list_out")
    seen = {}

    def hook(i):
        def pre(mod, args):  # args = (positions, normed, residual): residual is hidden + residual
            seen[i] = args[2].clone()
        return pre

    handles = [model.layers[i].register_forward_pre_hook(hook(i)) for i in model.capture_layers]
    with torch.no_grad():
        _, captured = model(*inputs)
    for h in handles:
        h.remove()
    assert sorted(seen) == list(model.capture_layers)
    for j, i in enumerate(model.capture_layers):
        assert torch.equal(captured[j], seen[i]), i
    # consecutive captures differ: they really are different layers' values
    assert not torch.equal(captured[0], captured[-1])


def test_capture_layer_zero_is_embedding():
    for name in ("llama", "deepseek"):
        module = models.FACTORIES[name]
        model, inputs = module.tiny("list_out", tokens=T, capture_layers=[0, 3])
        with torch.no_grad():
            _, captured = model(*inputs)
            assert torch.equal(captured[0], model.embed_tokens(inputs[0]))


def test_llama_producers_agree():
    add, inputs = llama.tiny("list", tokens=T)
    fused, _ = llama.tiny("list", tokens=T, capture_producer="fused_norm")
    with torch.no_grad():
        ha, aa = add(*inputs)
        hf, af = fused(*inputs)
    assert torch.equal(ha, hf) and torch.equal(aa, af)


class _NoCloneList(AuxHiddenStateList):
    """The bug the clone prevents: keep a reference to the borrowed residual."""

    def capture(self, hidden, *, owned=False):
        self.append(hidden)


def test_deepseek_residual_is_mutated_in_place(monkeypatch):
    model, inputs = deepseek.tiny("list", tokens=T)
    with torch.no_grad():
        _, correct = model(*inputs)
        monkeypatch.setattr(deepseek, "make_aux", lambda mode, k, out=None: _NoCloneList())
        model.capture_mode = "list_out"
        final_hidden, aliased = model(*inputs)
    assert len(aliased) == model.num_captures
    # every reference is the one residual tensor, overwritten in place by the later layers
    assert len({t.data_ptr() for t in aliased}) == 1
    assert all(torch.equal(t, aliased[0]) for t in aliased)
    assert not torch.equal(pack_aux_hidden_states(aliased), correct)
    for j in range(model.num_captures):
        assert not torch.equal(aliased[j], correct[:, j * 64 : (j + 1) * 64])


# --------------------------------------------------------------------------- Dynamo

COMPILE_CASES = [(v, m) for v in (VARIANTS[0], VARIANTS[2]) for m in common.CAPTURE_MODES] + [
    (VARIANTS[1], "list"),
    (VARIANTS[1], "packer"),
    (VARIANTS[3], "list"),
]


@pytest.mark.parametrize(
    "variant,mode", COMPILE_CASES, ids=[f"{v[0]}-{m}" for v, m in COMPILE_CASES]
)
def test_compile_fullgraph_dynamic(variant, mode):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, _ = _build(variant, mode)
    module = models.FACTORIES[variant[1]]
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (16, 24):
            inputs = module.example_inputs(model.config, tokens, seed=tokens)
            h_c, a_c = compiled(*inputs)
            h_e, a_e = model(*inputs)
            assert torch.equal(h_c, h_e)
            if mode == "none":
                assert a_c is None
            else:
                assert type(a_c) is type(a_e)
                assert torch.equal(pack_aux_hidden_states(a_c), pack_aux_hidden_states(a_e))
    assert len(graphs) == 1, "expected one graph for both token counts"
    nodes = list(graphs[0].graph.nodes)
    targets = {str(n.target) for n in nodes if n.op == "call_function"}
    assert any("models.attention" in t for t in targets)
    if variant[1] == "deepseek":
        assert any("models.fused_add_rms_norm_" in t for t in targets)
    if variant[0] == "llama_fused":
        assert any("models.add_rms_norm" in t for t in targets)
    if mode == "list":  # the pattern the pass rewrites: cat of the K captures feeding the output
        k = model.num_captures
        output = next(n for n in nodes if n.op == "output")
        cats = [
            n for n in nodes
            if n.target is torch.cat and isinstance(n.args[0], (list, tuple)) and len(n.args[0]) == k
            and n in output.all_input_nodes + [a for a in output.args[0] if isinstance(a, torch.fx.Node)]
        ]
        assert cats, "no K-way cat at the graph output"


# --------------------------------------------------------------------------- real sizes, meta


def _num_params(model):
    return sum(p.numel() for p in model.parameters())


def test_real_sizes_on_meta():
    with torch.device("meta"):
        m8 = llama.LlamaModel(llama.llama_3_1_8b_config(), capture_mode="packer", dtype=torch.bfloat16)
        m70 = llama.LlamaModel(llama.llama_3_1_70b_config())
        v3 = deepseek.DeepseekModel(deepseek.deepseek_v3_config(), capture_mode="list")
    assert 7e9 < _num_params(m8) < 8.5e9  # ~7.50e9: no lm_head
    assert 6.8e10 < _num_params(m70) < 7.1e10  # ~6.95e10
    assert 6.5e11 < _num_params(v3) < 6.8e11  # ~6.70e11 (no MTP, no lm_head)
    assert m8.capture_layers == (2, 16, 29) and m70.capture_layers == (2, 40, 77)
    assert v3.capture_layers == (2, 30, 58)
    assert next(m8.parameters()).device.type == "meta"
    ids, pos = llama.example_inputs(m8.config, 8, device="meta")
    h, aux = m8(ids, pos)
    assert h.shape == (8, 4096) and aux.shape == (8, 3 * 4096) and aux.dtype == torch.bfloat16
    ids, pos = deepseek.example_inputs(v3.config, 8, device="meta")
    h, aux = v3(ids, pos)
    assert h.shape == (8, 7168) and aux.shape == (8, 3 * 7168)


# --------------------------------------------------------------------------- API


def test_bad_capture_mode():
    with pytest.raises(ValueError, match="none, list, packer, list_out"):
        llama.tiny("concat")
    model, _ = deepseek.tiny()
    with pytest.raises(ValueError, match="unknown capture mode 'bogus'"):
        model.capture_mode = "bogus"
    assert model.capture_mode == "list"
    with pytest.raises(ValueError, match="capture mode"):
        common.make_aux("x", 3)
    with pytest.raises(ValueError, match="llama, deepseek, dflash"):
        models.build("gpt")
    with pytest.raises(ValueError, match="tiny, capture_dominated"):
        models.build("llama", "huge")
    with pytest.raises(ValueError, match="capture_producer"):
        llama.tiny_config(capture_producer="mul")


def test_capture_layer_helpers():
    e3 = common.eagle3_capture_layers
    assert [e3(n) for n in (1, 2, 3, 4, 6, 8, 32, 80)] == [
        [0], [0, 1], [0, 1, 2], [1, 2], [2, 3], [2, 4, 5], [2, 16, 29], [2, 40, 77]
    ]
    df = common.dflash_capture_layers
    assert df(10, 5) == [1, 3, 4, 6, 7]
    assert df(12, 6) == [1, 3, 4, 6, 7, 9]
    for n in range(1, 40):
        for k in range(1, n + 1):
            ids = df(n, k)
            assert len(ids) == k and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < n
    with pytest.raises(ValueError):
        df(4, 5)
    with pytest.raises(ValueError):
        e3(0)


def test_determinism_dtype_and_factories():
    a, inputs = llama.tiny(seed=3)
    b, inputs_b = llama.tiny(seed=3)
    assert torch.equal(inputs[0], inputs_b[0]) and torch.equal(inputs[1], torch.arange(32))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    c, _ = llama.tiny(seed=4)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    m, inputs = deepseek.tiny("packer", tokens=8, dtype=torch.bfloat16)
    with torch.no_grad():
        h, aux = m(*inputs)
    assert h.dtype == aux.dtype == torch.bfloat16 and torch.isfinite(aux).all()
    for name, module in models.FACTORIES.items():
        cfg = module.capture_dominated_config()
        assert cfg.hidden_size >= 256 and cfg.max_position >= 8192, name
    assert dflash.capture_dominated_config().num_captures == 8


def test_custom_ops():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 8), torch.randn(5, 8), torch.rand(8) + 0.5
    normed, summed = common.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, common.rms_norm(x + r, w, 1e-6))
    x2, r2 = x.clone(), r.clone()
    assert common.fused_add_rms_norm_(x2, r2, w, 1e-6) is None
    assert torch.equal(r2, summed) and torch.equal(x2, normed)
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 4)
    out = common.attention(q, k, v, 0.5)
    assert out.shape == (6, 4, 4) and out.is_contiguous()
    # token 0 attends only to itself; head h uses kv head h // 2
    assert torch.allclose(out[0], v[0].repeat_interleave(2, dim=0))
    # causal: the first tokens' outputs do not depend on later tokens
    out3 = common.attention(q[:3], k[:3], v[:3], 0.5)
    assert torch.allclose(out[:3], out3, atol=1e-6)
    torch.library.opcheck(torch.ops.models.attention.default, (q, k, v, 0.5))
    torch.library.opcheck(torch.ops.models.add_rms_norm.default, (x, r, w, 1e-6))
    torch.library.opcheck(torch.ops.models.fused_add_rms_norm_.default, (x.clone(), r.clone(), w, 1e-6))
