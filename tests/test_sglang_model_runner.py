"""SGLang's real ModelRunner extend on the CPU, plugin off vs on (``make sglang``):
LlamaForCausalLM, Qwen2MoeForCausalLM and Gemma3ForCausalLM (a plain-list model; tiny random
configs), and Llama's ``model.forward``
compiled as SGLang's ``--enable-torch-compile`` compiles it (``benchmarks/sglang_model_runner.py``)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(tmp_path, **env_extra):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_PASS_SGLANG")}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sglang_model_runner.py"), str(out)],
                       capture_output=True, text=True, env=env, timeout=500, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(out.read_text())


def test_model_runner_extend_llama_dflash_k12_packed_in_place(tmp_path):
    res = _bench(tmp_path, K="12", LAYERS="16", NREQ="4", LEN="512")
    assert res["bitwise"] and res["logits_equal"], res       # packed captures = list path's
    assert res["logits_equal_no_capture"], res               # capturing leaves the model as is
    assert res["packed_views"] >= 1 and res["fallbacks"] == 0, res  # the logits pack was a view
    assert res["overhead_off"] >= 1.15 and res["overhead_on"] <= 1.01, res


def test_model_runner_extend_qwen2_moe_k12_packed_in_place(tmp_path):
    """An MoE class (routed experts; no shared expert: its gate is a Triton kernel)."""
    res = _bench(tmp_path, ARCH="qwen2_moe", K="12", LAYERS="16", NREQ="4", LEN="512")
    assert res["model"] == "Qwen2MoeForCausalLM"
    assert res["bitwise"] and res["logits_equal"], res
    assert res["packed_views"] >= 1 and res["fallbacks"] == 0, res
    assert res["overhead_off"] >= 1.03 and res["overhead_on"] <= 1.01, res


#: one tensor-parallel rank's proportions (Llama 3.1 70B at TP=8: attention and MLP widths
#: cut by 8, the hidden state not), scaled to hidden 1024
TP_RANK = dict(HIDDEN="1024", HEADS="2", KV_HEADS="1", INTER="448", LAYERS="12", NREQ="4", LEN="512")


def test_model_runner_extend_gemma3_plain_list_adopted(tmp_path):
    """Gemma3ForCausalLM appends to a plain ``[]`` in its forward (no class to swap): the
    plugin adopts the list at the layer boundaries; the logits processor's pack is a view."""
    res = _bench(tmp_path, ARCH="gemma3", K="8", **TP_RANK)
    assert res["model"] == "Gemma3ForCausalLM" and res["adopted"] == 1, res
    assert res["bitwise"] and res["logits_equal"] and res["logits_equal_no_capture"], res
    assert res["packed_views"] >= 1 and res["fallbacks"] == 0, res
    assert res["overhead_off"] >= 1.1 and res["overhead_on"] <= 1.01, res


def test_model_runner_extend_llama_tp_rank_fused_norm_k8(tmp_path):
    """SGLang's RMSNorm with a residual in place (as its fused kernel runs), one TP rank's
    widths: the list path's cat spike is above 1.00 from K=5 (docs/sglang.md)."""
    res = _bench(tmp_path, NORM="fused", K="8", **TP_RANK)
    assert res["norm"] == "fused" and res["hidden"] == 1024, res
    assert res["bitwise"] and res["logits_equal"] and res["logits_equal_no_capture"], res
    assert res["packed_views"] >= 1 and res["fallbacks"] == 0, res
    assert res["overhead_off"] >= 1.3 and res["overhead_on"] <= 1.01, res


def test_enable_torch_compile_forward_plugin_on_equals_off(tmp_path):
    """SGLang's compile of model.forward (its set_torch_compile_config and patch_model):
    with the plugin (its list and its Inductor config) the same graphs, peak and outputs."""
    res = _bench(tmp_path, COMPILE="1", K="3", LAYERS="4", NREQ="2", LEN="256")
    assert res["on_vs_off_bitwise"], res
    assert res["compiled_peak_on"] <= res["compiled_peak_off"], res
    assert res["on_max_abs_vs_uncompiled"] < 1e-4 and res["logits_on_max_abs_vs_uncompiled"] < 1e-4, res
    assert set(res["plugin_inductor"]) == {"post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                                           "joint_custom_pre_pass"}
