"""The SGLang plugin and the packer against the installed sglang 0.5.23 (``make sglang``)."""

import ast
import dataclasses
import inspect
import json
import os
import pathlib
import subprocess
import sys
import types
import warnings

import pytest

sglang = pytest.importorskip("sglang")

import torch  # noqa: E402

from compile_pass.packer import AuxHiddenStatePacker, pack_aux_hidden_states  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
import sglang.srt.layers.aux_hidden_states as sg_aux  # noqa: E402

SG_MODELS = pathlib.Path(sglang.__file__).parent / "srt" / "models"


# ---- item 3: the packer against SGLang's packer and its call sites ----------------------

def test_for_batch_signature_matches_sglangs():
    ours = inspect.signature(AuxHiddenStatePacker.for_batch)
    theirs = inspect.signature(sg_aux.AuxHiddenStatePacker.for_batch)
    assert list(ours.parameters) == list(theirs.parameters)


def test_forward_batch_has_the_buffer_field_for_batch_reads():
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    assert "aux_hidden_states_buffer" in {f.name for f in dataclasses.fields(ForwardBatch)}


@pytest.mark.parametrize("with_buffer", [False, True])
def test_for_batch_same_result_as_sglangs(with_buffer):
    torch.manual_seed(0)
    T, H, K = 5, 8, 3
    caps = [torch.randn(T, H) for _ in range(K)]
    results = []
    for cls in (sg_aux.AuxHiddenStatePacker, AuxHiddenStatePacker):
        buf = torch.full((T, K * H), float("nan")) if with_buffer else None
        batch = types.SimpleNamespace(aux_hidden_states_buffer=buf)
        p = cls.for_batch(batch, K)
        for c in caps:
            p.capture(c, owned=False)
        out = p.finalize()
        if with_buffer:  # SGLang's exact [T, K*H] buffer: written in place, returned whole
            assert out.data_ptr() == buf.data_ptr() and out.shape == buf.shape
        results.append(out)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[1], torch.cat(caps, -1))


def test_out_accepts_sglangs_exact_and_our_prefix_buffer():
    T, H, K = 4, 6, 2
    caps = [torch.randn(T, H) for _ in range(K)]
    for rows in (T, 3 * T):  # SGLang: exactly T rows; ours also max_T rows
        buf = torch.zeros(rows, K * H)
        p = AuxHiddenStatePacker(K, out=buf)
        p.extend(caps)
        out = p.finalize()
        assert out.shape == (T, K * H) and out.data_ptr() == buf.data_ptr()
        assert torch.equal(out, torch.cat(caps, -1))
    with pytest.raises(ValueError):  # SGLang's packer rejects the prefix buffer
        sg = sg_aux.AuxHiddenStatePacker(K, out=torch.zeros(3 * T, K * H))
        sg.extend(caps)


def _packer_calls():
    """Every call of ``AuxHiddenStatePacker(...)`` / ``.for_batch(...)`` in SGLang's models."""
    calls = []
    for path in sorted(SG_MODELS.glob("*.py")):
        src = path.read_text(errors="replace")
        if "AuxHiddenStatePacker" not in src:
            continue
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "AuxHiddenStatePacker":
                calls.append((path.stem, "__init__", node))
            elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                  and f.value.id == "AuxHiddenStatePacker"):
                calls.append((path.stem, f.attr, node))
    return calls


def test_sglang_call_sites_bind_to_our_packer():
    calls = _packer_calls()
    assert {m for m, _, _ in calls} >= {"deepseek_v2", "mimo_v2", "kimi_k3"}, calls
    for model, method, node in calls:
        fn = AuxHiddenStatePacker.__init__ if method == "__init__" else getattr(
            AuxHiddenStatePacker, method)
        sig = inspect.signature(fn)
        args = [object()] * len(node.args)
        kwargs = {k.arg: object() for k in node.keywords if k.arg}
        if method == "__init__":
            args = [object()] + args  # self
        sig.bind(*args, **kwargs)  # raises TypeError naming the mismatch


def test_sglang_packer_methods_all_present():
    theirs = {n for n, v in vars(sg_aux.AuxHiddenStatePacker).items()
              if not n.startswith("_") or n in ("__len__", "__init__")}
    missing = {n for n in theirs if not hasattr(AuxHiddenStatePacker, n)}
    assert not missing


def test_our_pack_is_sglangs_plus_a_view():
    caps = [torch.randn(3, 4) for _ in range(3)]
    assert torch.equal(pack_aux_hidden_states(caps), sg_aux.pack_aux_hidden_states(caps))
    buf = torch.randn(3, 12)
    sl = [buf[:, i * 4:(i + 1) * 4] for i in range(3)]
    v = pack_aux_hidden_states(sl)
    assert v.data_ptr() == buf.data_ptr() and torch.equal(v, sg_aux.pack_aux_hidden_states(sl))


# ---- item 1: the plugin through SGLang's own loader and registry -------------------------

def _run(code_or_args, env_extra, script=True, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_PASS_SGLANG",
                                                                        "SGLANG_PLUGINS"))}
    env.update(env_extra)
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable] + (code_or_args if script else ["-c", code_or_args])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


def test_entry_point_declared_and_visible():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "aux_capture"]
    assert eps and eps[0].value == "compile_pass.integrations.sglang:register"


CHECK_OFF = """
import sglang.srt.layers.aux_hidden_states as a
orig = a.AuxHiddenStateList, a.pack_aux_hidden_states
from sglang.srt.plugins import load_plugins
load_plugins()
from compile_pass.integrations import sglang as p
print(int(a.AuxHiddenStateList is orig[0]), int(a.pack_aux_hidden_states is orig[1]), p.STATE['reason'])
"""


def test_plugin_inactive_unless_asked():
    r = _run(CHECK_OFF, {}, script=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("1 1 COMPILE_PASS_SGLANG is not set")


def test_plugin_on_measured_and_bitwise():
    r = _run([str(ROOT / "benchmarks" / "sglang_capture.py")],
             {"COMPILE_PASS_SGLANG": "1", "SGLANG_PLUGINS": "aux_capture"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout[r.stdout.index("{"):])
    assert all(res["checks"][k] for k in res["checks"] if k != "sglang"), res["checks"]
    assert res["fallbacks"] == 0
    for row in res["rows"]:
        assert row["bitwise"] and row["model_output_equal"] and row["on_is_one_buffer"], row
        assert row["overhead_off"] >= 1.3 and row["overhead_on"] <= 1.01, row


def test_unexpected_layout_warns_and_leaves_sglang_alone(monkeypatch):
    from compile_pass.integrations import sglang as p

    class NotAList:
        pass

    monkeypatch.setattr(sg_aux, "AuxHiddenStateList", NotAList)
    monkeypatch.setitem(p.STATE, "active", False)

    class Registry:
        registered = []

        @classmethod
        def register(cls, *a, **k):
            cls.registered.append(a)

        @classmethod
        def apply_hooks(cls):
            raise AssertionError("must not apply")

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert p.enable(registry=Registry) is False
    assert any("AuxHiddenStateList" in str(x.message) for x in w)
    assert Registry.registered == [] and sg_aux.AuxHiddenStateList is NotAList


def test_list_falls_back_to_clone_when_capture_does_not_fit():
    from compile_pass.integrations import sglang as p

    cls = p._make_list_class(sg_aux.AuxHiddenStateList)
    tok = p._num_captures.set(2)
    try:
        aux = cls()
        a, b = torch.randn(4, 3), torch.randn(5, 3)  # second capture: other leading shape
        aux.capture(a)
        with pytest.warns(RuntimeWarning, match="does not fit"):
            aux.capture(b)
        assert torch.equal(aux[0], a) and torch.equal(aux[1], b) and aux[1] is not b
        no_k = cls()
        p._num_captures.set(None)
        no_k.capture(a)  # K unknown: SGLang's own clone
        assert no_k[0] is not a and torch.equal(no_k[0], a)
    finally:
        p._num_captures.reset(tok)


def test_list_falls_back_to_clone_when_writing_fails(monkeypatch):
    """An error inside the packing write (e.g. the buffer's allocation) is a warning naming
    it; that capture and the rest of the forward are SGLang's clones, the values unchanged."""
    from compile_pass.integrations import sglang as p

    cls = p._make_list_class(sg_aux.AuxHiddenStateList)

    def boom(self, hidden):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(cls, "_cp_write_slice", boom)
    tok = p._num_captures.set(2)
    try:
        aux = cls()
        a, b = torch.randn(4, 3), torch.randn(4, 3)
        with pytest.warns(RuntimeWarning, match="simulated"):
            aux.capture(a)
        aux.append(b)
        assert torch.equal(aux[0], a) and aux[0] is not a and aux[1] is b
        assert torch.equal(p.pack_view(aux), torch.cat([a, b], -1))
    finally:
        p._num_captures.reset(tok)


def test_runner_hook_reads_k_from_layers_to_capture():
    from compile_pass.integrations import sglang as p

    inner = torch.nn.Module()
    inner.layers_to_capture = [2, 5, 9, 11]
    outer = torch.nn.Module()
    outer.model = inner
    seen = []
    runner = types.SimpleNamespace(model=outer)
    p._runner_forward(lambda self: seen.append(p._num_captures.get()), runner)
    assert seen == [4] and p._num_captures.get() is None


def test_covered_models_from_installed_source():
    """Per architecture: Llama and its subclass Mistral, Qwen3, and Qwen3-MoE (whose loop
    comes from qwen2_moe) pack through the list class; Gemma3 is a plain-list model;
    DeepSeek-V3 packs itself; Glm4ForCausalLM cannot be made to capture in 0.5.23."""
    from tools.sglang_covered_models import architectures

    archs, _ = architectures()
    by_name = {a.name: a for a in archs}
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert by_name[name].settable and by_name[name].style == "AuxHiddenStateList", by_name[name]
    assert by_name["Qwen3MoeForCausalLM"].loop == "qwen2_moe.Qwen2MoeModel"
    assert by_name["Gemma3ForCausalLM"].style == "plain list"
    assert by_name["DeepseekV3ForCausalLM"].style == "packer"
    assert not by_name["Glm4ForCausalLM"].settable
    assert sum(a.style == "AuxHiddenStateList" and bool(a.settable) for a in archs) >= 30


def test_docs_covered_list_is_the_generated_one():
    from tools.sglang_covered_models import markdown

    doc = (ROOT / "docs" / "sglang.md").read_text()
    block = doc.split("<!-- covered: BEGIN -->\n")[1].split("\n<!-- covered: END -->")[0]
    assert block == markdown()


def test_runner_hook_sees_capture_layers_changed_after_first_forward():
    from compile_pass.integrations import sglang as p

    inner = torch.nn.Module()
    inner.layers_to_capture = []
    outer = torch.nn.Module()
    outer.model = inner
    runner, seen = types.SimpleNamespace(model=outer), []
    p._runner_forward(lambda self: seen.append(p._num_captures.get()), runner)
    inner.layers_to_capture = [1, 2, 3]  # set_eagle3_layers_to_capture after a forward
    p._runner_forward(lambda self: seen.append(p._num_captures.get()), runner)
    assert seen == [None, 3]


class _HolderLayers(torch.nn.Module):
    """A layer-loop module's parts (layers, a final norm, ``layers_to_capture``), no loop."""

    def __init__(self, with_layers=True, dot_forward=False):
        super().__init__()
        if with_layers:
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.norm = torch.nn.LayerNorm(8)
        self.layers_to_capture = [0, 2, 3]
        self.dot_forward = dot_forward



class PlainListHolder(_HolderLayers):
    """Appends its captures to a plain ``[]`` built in ``forward`` (gemma3_causal's style,
    read from this class's source); its layers called as ``layer.forward(x)`` with
    ``dot_forward``."""

    def forward(self, x):
        aux_hidden_states = []
        for i, layer in enumerate(getattr(self, "layers", [])):
            if i in self.layers_to_capture:
                aux_hidden_states.append(x + 1)
            x = layer.forward(x) if self.dot_forward else layer(x)  # called from forward itself
        return (self.norm(x) if hasattr(self, "norm") else x), aux_hidden_states


class HelperListHolder(_HolderLayers):
    """The same loop with its capture list made by a helper: no capture style in its
    source, so no adoption (the list is SGLang's cat's, as for an AuxHiddenStateList model)."""

    def forward(self, x):
        captures = list()
        for i, layer in enumerate(getattr(self, "layers", [])):
            if i in self.layers_to_capture:
                captures.append(x + 1)
            x = layer.forward(x) if self.dot_forward else layer(x)
        return (self.norm(x) if hasattr(self, "norm") else x), captures


def test_capture_style_read_from_the_real_model_files():
    from compile_pass.integrations import sglang as p
    from sglang.srt.models import gemma3_causal, llama

    from sglang.srt.models import qwen3_moe

    assert p.capture_style(gemma3_causal.Gemma3TextModel) == "plain list"
    assert p.capture_style(llama.LlamaModel) == "AuxHiddenStateList"
    # its loop is inherited from qwen2_moe.Qwen2MoeModel, another file
    assert p.capture_style(qwen3_moe.Qwen3MoeModel) == "AuxHiddenStateList"
    assert p.capture_style(PlainListHolder) == "plain list" and p.capture_style(HelperListHolder) is None


@torch.no_grad()  # as SGLang's forward runs; a capture that needs grad is not adopted
def test_plain_list_model_is_adopted_and_its_pack_is_a_view():
    """A holder classified from the real gemma3_causal.py (a plain ``[]``) gets the adoption
    hooks; its captures end in one buffer and SGLang's pack returns a view of it, with the
    bytes of the list path. A holder from llama.py (AuxHiddenStateList) gets no hooks."""
    from compile_pass.integrations import sglang as p

    torch.manual_seed(0)
    x = torch.randn(5, 8)
    if p.STATE["orig_pack"] is None:
        p.STATE["orig_pack"] = sg_aux.pack_aux_hidden_states
    results = {}
    for holder_class in (PlainListHolder, HelperListHolder):
        torch.manual_seed(1)
        holder = holder_class()
        outer = torch.nn.Module()
        outer.model = holder
        runner = types.SimpleNamespace(model=outer)

        def run(self):
            out, aux = self.model.model(x)
            return out, p.pack_view(aux)

        before = p.STATE["adopted"]
        out, packed = p._runner_forward(run, runner)
        results[holder_class] = (out, packed, p.STATE["adopted"] - before,
                                 hasattr(holder, "_compile_pass_list_adoption_hooks"))
    torch.manual_seed(1)
    ref_out, ref_aux = HelperListHolder()(x)
    gem = results[PlainListHolder]
    llama = results[HelperListHolder]
    assert gem[2] == 1 and gem[3], "the plain-list holder was not adopted"
    assert llama[2] == 0 and not llama[3], "a holder with no plain-list style got adoption hooks"
    assert gem[1]._base is not None, "the pack of an adopted list should be a view of its buffer"
    assert llama[1]._base is None, "SGLang's cat of separate captures is a new tensor"
    for out, packed, *_ in (gem, llama):
        assert torch.equal(out, ref_out)
        assert torch.equal(packed, torch.cat(ref_aux, -1))


def test_plain_list_model_with_no_layers_warns_once():
    from compile_pass.integrations import sglang as p

    holder = PlainListHolder(with_layers=False)
    outer = torch.nn.Module()
    outer.model = holder
    runner = types.SimpleNamespace(model=outer)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p._runner_forward(lambda self: None, runner)
        p._runner_forward(lambda self: None, runner)
    named = [x for x in w if "no layers to observe" in str(x.message)]
    assert len(named) == 1, [str(x.message) for x in w]
    assert "PlainListHolder" in str(named[0].message)


@torch.no_grad()
def test_plain_list_model_calling_layer_forward_is_named_once():
    """Layers called as ``layer.forward(x)`` run no hook: the captures are all moved at the
    final norm, in one step, which saves nothing; the plugin says so once per class."""
    from compile_pass.integrations import sglang as p

    if p.STATE["orig_pack"] is None:
        p.STATE["orig_pack"] = sg_aux.pack_aux_hidden_states
    holder = PlainListHolder(dot_forward=True)
    outer = torch.nn.Module()
    outer.model = holder
    runner = types.SimpleNamespace(model=outer)
    x = torch.randn(5, 8)

    def run(self):
        out, aux = self.model.model(x)
        return p.pack_view(aux)

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        packed = p._runner_forward(run, runner)
        p._runner_forward(run, runner)
    named = [x for x in w if "no layer call between its captures" in str(x.message)]
    assert len(named) == 1, [str(x.message) for x in w]
    assert p.STATE["adoption"]["moves"] == 1 and p.STATE["adoption"]["moved"] == 3
    _, ref_aux = holder(x)
    assert torch.equal(packed, torch.cat(ref_aux, -1))


def test_an_error_in_the_runner_hook_never_fails_the_forward(monkeypatch):
    """The plugin's own work around ``ModelRunner.forward`` raising: a warning naming it,
    and the forward's own result."""
    from compile_pass.integrations import sglang as p

    def boom(model):
        raise RuntimeError("capture layers unreadable (simulated)")

    monkeypatch.setattr(p, "_capture_holder", boom)
    runner = types.SimpleNamespace(model=torch.nn.Module())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = p._runner_forward(lambda self, x: x * 2, runner, 21)
    assert out == 42
    assert any("simulated" in str(x.message) and "as without the plugin" in str(x.message)
               for x in w), [str(x.message) for x in w]
    assert p._num_captures.get() is None
