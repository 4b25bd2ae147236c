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


#: one tensor-parallel rank's proportions (Llama 3.1 70B at TP=8: attention and MLP widths
#: cut by 8, the hidden state not), scaled to hidden 1024
TP_RANK = dict(HIDDEN="1024", HEADS="2", KV_HEADS="1", INTER="448", LAYERS="12", NREQ="4", LEN="512")

#: case: (benchmark environment, model class, plain-list adopted, least list-path overhead)
EXTEND_CASES = {
    "llama_dflash_k12": (dict(K="12", LAYERS="16", NREQ="4", LEN="512"), "LlamaForCausalLM", 0, 1.15),
    # routed experts only: a shared expert's gate is a Triton kernel (no CPU driver)
    "qwen2_moe_k12": (dict(ARCH="qwen2_moe", K="12", LAYERS="16", NREQ="4", LEN="512"),
                      "Qwen2MoeForCausalLM", 0, 1.03),
    # a plain [] in its forward (no class to swap): the list adopted at the layer calls
    "gemma3_plain_list_k8": (dict(ARCH="gemma3", K="8", **TP_RANK), "Gemma3ForCausalLM", 1, 1.1),
    # SGLang's RMSNorm with a residual in place, as its fused kernel runs (docs/sglang.md); the
    # capture layers set by SGLang's DFlash path (the model's set_dflash_layers_to_capture)
    "llama_tp_rank_fused_norm_dflash_k8": (dict(NORM="fused", K="8", SETTER="dflash", **TP_RANK),
                                           "LlamaForCausalLM", 0, 1.3),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_model_runner_extend_packed_in_place(tmp_path, case):
    """One FULL-capture extend, plugin off then on: the packed captures and the logits equal
    the list path's, the logits equal the build without captures, the logits processor's pack
    is a view, and the list path's overhead drops to 1.00."""
    env, model, adopted, least_off = EXTEND_CASES[case]
    res = _bench(tmp_path, **env)
    assert res["model"] == model and res["adopted"] == adopted, res
    assert res["hidden"] == int(env.get("HIDDEN", 256)) and res["norm"] == env.get("NORM", "native"), res
    assert res["bitwise"] and res["logits_equal"], res       # packed captures = list path's
    assert res["logits_equal_no_capture"], res               # capturing leaves the model as is
    assert res["packed_views"] >= 1 and res["fallbacks"] == 0, res  # the logits pack was a view
    assert res["overhead_off"] >= least_off and res["overhead_on"] <= 1.01, res
    assert res["setter"] == env.get("SETTER", "direct") and len(res["capture_layers"]) == int(env["K"]), res
    if "bypass_bitwise" in res:
        # model.forward without ModelRunner.forward around it, as SGLang's CUDA-graph runners
        # capture it: K from the model configure_aux_hidden_state_capture set up, packed too
        assert res["bypass_bitwise"] and res["bypass_overhead_on"] <= 1.01 and res["packed_views"] == 2, res


@pytest.mark.inductor  # COMPILE=1: SGLang's Inductor compile of model.forward (in the subprocess)
def test_enable_torch_compile_forward_plugin_on_equals_off(tmp_path):
    """SGLang's compile of model.forward (its set_torch_compile_config and patch_model):
    with the plugin (its list, and its passes scoped to patch_model's context by the
    around-hook) the same graphs, peak and outputs; the capture pass ran in that compile."""
    res = _bench(tmp_path, COMPILE="1", K="3", LAYERS="4", NREQ="2", LEN="256")
    assert res["on_vs_off_bitwise"], res
    assert res["compiled_peak_on"] <= res["compiled_peak_off"], res
    assert res["on_max_abs_vs_uncompiled"] < 1e-4 and res["logits_on_max_abs_vs_uncompiled"] < 1e-4, res
    assert set(res["plugin_inductor"]) == {"post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                                           "joint_custom_pre_pass"}
    assert res["aux_capture"].get("groups_found", 0) >= 1, res  # the pass ran inside SGLang's compile


@pytest.mark.inductor  # COMPILE=1, as above
def test_enable_torch_compile_forward_hands_the_draft_its_projected_input(tmp_path):
    """COMPILE_PASS_SGLANG_PROJECT=1 and SGLang's compiled model.forward: the packing list,
    traced by Dynamo in each graph SGLang's CPU build breaks the forward into, projects each
    capture as it is made, so the draft, whose CUDA-graph buffers are H_draft wide with the
    option, reads [T, H_draft] from compiled batches too, within rounding of the draft's own
    cat-then-project; logits as without the option; the compiled batch's capture overhead is
    the accumulator's H_draft / (K*H) of the packed bytes, where the packer's is 1.00."""
    res = _bench(tmp_path, COMPILE="1", PROJECT="norm_before_fc", K="3", LAYERS="4", NREQ="2", LEN="256")
    assert res["compiled_stored_shape"] == [res["tokens"], 256], res
    assert res["compiled_max_rel_vs_cat_then_project"] < 1e-5, res
    assert res["compiled_logits_projected_equal_on"] and res["on_vs_off_bitwise"], res
    assert res["compiled_overhead_on"] >= 0.99, res  # the packer, compiled
    assert res["compiled_overhead_projected"] <= 256 / (3 * 256) + 0.02, res


#: case: (benchmark environment, model class) for COMPILE_PASS_SGLANG_PROJECT
PROJECT_CASES = {
    "llama_tp_rank_fused_norm_before_fc_k8": (dict(NORM="fused", K="8", PROJECT="norm_before_fc", DRAFT_HIDDEN="768",
                                                   **TP_RANK), "LlamaForCausalLM"),
    "qwen3_fc_norms_k3": (dict(ARCH="qwen3", K="3", LAYERS="8", NREQ="2", LEN="256", PROJECT="fc_norms"),
                          "Qwen3ForCausalLM"),
    # SGLang's own DFlash draft (dflash.DFlashDraftModel), the layers SGLang's DFlash path sets:
    # its worker's project_target_hidden of the stored input against its own of the packed one
    "llama_sglang_dflash_draft_k4": (dict(SETTER="dflash", DRAFT="sglang_dflash", PROJECT="dflash", K="4",
                                          LAYERS="8", NREQ="2", LEN="128"), "LlamaForCausalLM"),
}


@pytest.mark.parametrize("case", list(PROJECT_CASES))
def test_model_runner_extend_projects_each_capture_for_the_draft(tmp_path, case):
    """COMPILE_PASS_SGLANG_PROJECT=1 with an Eagle3 draft registered: the logits processor
    stores the draft's input [T, H_draft], projected as each capture was made, within
    rounding of the draft's own cat-then-project of the list path's captures; the target's
    logits equal the build without captures; the overhead is below the packer's 1.00."""
    env, model = PROJECT_CASES[case]
    res = _bench(tmp_path, **env)
    tokens, draft_hidden = res["tokens"], int(env.get("DRAFT_HIDDEN", env.get("HIDDEN", 256)))
    bypass = env.get("SETTER", "direct") == "direct"  # the bypassing forward ran too
    assert res["model"] == model and res["projected_forwards"] == 1 + bypass, res
    assert res["stored_shape"] == [tokens, draft_hidden], res
    # the Eagle3 draft's CUDA-graph buffers (DFlash's worker projects outside them)
    dflash = env.get("DRAFT") == "sglang_dflash"
    assert res["draft_cuda_graph_input_width"] == (int(env["K"]) * res["hidden"] if dflash else draft_hidden), res
    assert res["max_rel_vs_cat_then_project"] < 1e-5, res
    assert res["logits_equal_no_capture_projected"], res
    assert res["overhead_projected"] < res["overhead_on"] <= 1.01, res
    # model.forward without ModelRunner.forward around it (SGLang's CUDA-graph captures)
    assert not bypass or (res["bypass_projected_equal"]
                          and abs(res["bypass_overhead_projected"] - res["overhead_projected"]) <= 0.01), res


def test_sglang_draft_proposes_from_the_projected_input_as_from_the_packed_captures(tmp_path):
    """DRAFT=sglang: SGLang's own Eagle3 draft (llama_eagle3.LlamaForCausalLMEagle3) runs the
    extend batch twice, from the list path's packed captures (it applies its norm and fc) and
    from the projected input (it reads it as is), in bf16, where the projection's K partial
    products round differently from one GEMM: nearly every greedy proposal is the same."""
    res = _bench(tmp_path, DTYPE="bfloat16", DRAFT="sglang", PROJECT="norm_before_fc", K="3", LAYERS="4",
                 NREQ="2", LEN="128")
    assert res["draft"] == "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3" and res["dtype"] == "bfloat16", res
    assert res["proposals"] == res["tokens"] and res["proposal_agreement"] >= 0.95, res
    assert 0 < res["max_rel_vs_cat_then_project"] < 0.05 and res["draft_hidden_max_rel"] < 0.05, res
    assert res["logits_equal_no_capture_projected"] and res["bitwise"], res
