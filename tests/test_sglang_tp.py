"""SGLang at TP=2 over gloo, two processes (``benchmarks/sglang_tp_shard.py``; skipped without
sglang): the Kimi-K2.5 Eagle3 draft's ``fc`` as SGLang builds it (``ColumnParallelLinear``,
``gather_output=False``) holds half the projection's rows on each rank and is refused with
that reason (the captures stay packed); a replicated ``fc`` is taken whole on every rank."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_column_parallel_fc_is_refused_on_every_rank_and_a_replicated_one_taken():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sglang_tp_shard.py")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 0, 1, 1]
    for r in rows:
        if r["fc"].startswith("kimi_k25"):
            assert r["weight"] == [48, 192] and not r["taken"], r
            assert "holds 48 of its 96 output rows" in r["why"] and "gather_output=False" in r["why"], r
        else:
            assert r["weight"] == [96, 192] and r["taken"] and r["out_features"] == 96, r
