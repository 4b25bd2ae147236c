"""SGLang's real ModelRunner extend (LlamaForCausalLM, CPU), plugin off vs on (``make sglang``)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_model_runner_extend_llama_dflash_k12_packed_in_place(tmp_path):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILE_PASS_SGLANG")}
    env.update(K="12", LAYERS="16", NREQ="4", LEN="512", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sglang_model_runner.py"), str(out)],
                       capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert res["bitwise"] and res["logits_equal"], res       # packed captures = list path's
    assert res["packed_views"] >= 1 and res["fallbacks"] == 0, res  # the logits pack was a view
    assert res["overhead_off"] >= 1.15 and res["overhead_on"] <= 1.01, res
