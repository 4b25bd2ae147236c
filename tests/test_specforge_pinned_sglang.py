"""SpecForge 0.2.0's offline capture on its pinned sglang 0.5.14 (``make specforge``): the
plugin's compiler way in (``compile_pass.integrations.sglang_compile``), plugin off vs on, on
SGLang's real ``LlamaForCausalLM`` through SpecForge's ``OfflineSGLangCaptureBackend``
(``benchmarks/specforge_capture.py``). Skipped on any other SGLang."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

sglang = pytest.importorskip("sglang")
if sglang.__version__ != "0.5.14":
    pytest.skip(f"sglang {sglang.__version__}: these tests are for 0.5.14 (SpecForge 0.2.0's pin)",
                allow_module_level=True)
pytest.importorskip("specforge")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(tmp_path, **env_extra):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_PASS_SGLANG")}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "specforge_capture.py"), str(out)],
                       capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(out.read_text())


def test_plugin_enables_the_compiler_way_in_on_the_plain_list_layout():
    from compile_pass.integrations.seams import report
    from compile_pass.integrations.sglang_seams import PLAIN_LIST, layout, probe_sglang

    probes = probe_sglang()
    assert layout(probes) == PLAIN_LIST, report(probes)
    import importlib.util

    assert importlib.util.find_spec("sglang.srt.layers.aux_hidden_states") is None


def test_dflash_k12_compiled_inner_model_packs_in_place(tmp_path):
    """The compiled inner model returns adjacent slices, the logits store hands back the view:
    the compiled list path's spike (1.38x the packed bytes here: the K captures beside SGLang's
    own cat) goes to 1.00, and the captures and final hidden states equal the eager list path's
    bit for bit."""
    res = _bench(tmp_path, K="12", LAYERS="16", NREQ="4", LEN="512", INNER="eager")
    assert res["plugin_active"] and res["compiled"] >= 1 and res["failed"] == [], res
    assert res["aux_bitwise"] and res["last_hidden_bitwise"] and res["compiled_pass_off_bitwise"], res
    assert res["packed_views"] >= 1, res
    assert res["overhead_compiled_pass_off_vs_compiled_base"] >= 1.25, res
    assert res["overhead_on_vs_compiled_base"] <= 1.01, res
    assert res["peak_on"] < res["peak_off"], res


@pytest.mark.inductor  # INNER=inductor (in the subprocess)
def test_eagle3_k3_inductor_within_rounding_of_the_eager_list_path(tmp_path):
    """Inductor, the plugin's default inner, Eagle3's default layers [2, L//2, L-3]: every
    capture within Inductor's rounding of SGLang's eager list path, the logits store a view."""
    res = _bench(tmp_path, K="3", LAYERS="8", NREQ="2", LEN="256", INNER="inductor")
    assert res["inner"] == "inductor" and res["failed"] == [], res
    assert res["capture_layers"] == [2, 4, 5], res
    assert res["aux_max_abs_vs_plugin_off"] < 1e-4, res
    assert res["packed_views"] >= 1, res


def test_a_compiled_forward_that_fails_falls_back_to_eager(tmp_path):
    """Without a CPU kernel for SGLang's attention op the compiled forward raises: the plugin
    warns, puts SGLang's eager forward back, and the batch's outputs equal the plugin-off run."""
    res = _bench(tmp_path, K="7", LAYERS="8", NREQ="2", LEN="256", INNER="eager", NO_CPU_ATTENTION="1")
    assert res["failed"] and "unified_attention_with_output" in " ".join(res["failed"]), res
    assert res["aux_bitwise"] and res["last_hidden_bitwise"], res
