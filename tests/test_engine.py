"""Engine-shaped per-rank decoders (``models.engine``): capture modes, inners, and the pass's
decisions on full-size ranks traced on the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_pass import aux_capture_backend, pack_aux_hidden_states
from compile_pass.groups import Decision
from tools.static_estimate import estimate_at, trace_graph
from models import engine

pytestmark = pytest.mark.usefixtures("_fresh_dynamo")

#: a 70B TP=8 rank with widths / 8, four layers, captures at 1..3 (CPU, bf16)
LLAMA = engine.scaled(engine.llama_3_1_70b(tp=8, num_layers=4, capture_layers=(1, 2, 3)), 8)
DEEPSEEK = {moe: engine.scaled(engine.deepseek_v3(tp=8, moe=moe, num_layers=4, num_experts=16,
                                                  capture_layers=(0, 2, 3)), 16)
            for moe in engine.MOE_KINDS}
TOKENS = 96


def _run(cfg, mode, compile_with=None):
    model, inputs = engine.build(cfg, mode, tokens=TOKENS)
    fn = model if compile_with is None else torch.compile(model, backend=compile_with, dynamic=True,
                                                          fullgraph=True)
    with torch.no_grad():
        hidden, aux = fn(*inputs)
    return hidden, pack_aux_hidden_states(aux) if aux is not None else None, model, inputs


@pytest.mark.parametrize("cfg", [LLAMA, dataclasses.replace(LLAMA, all_reduce="functional"),
                                 *DEEPSEEK.values()], ids=lambda c: c.describe())
def test_capture_modes_agree_bitwise(cfg):
    none, _, model, inputs = _run(cfg, "none")
    listed = _run(cfg, "list")
    for mode in ("packer", "list_out"):
        hidden, aux, _, _ = _run(cfg, mode)
        assert torch.equal(hidden, none) and torch.equal(aux, listed[1])
    assert torch.equal(listed[0], none)
    assert listed[1].shape == (TOKENS, cfg.num_captures * cfg.hidden_size)
    # per rank: the logits of the last token over this rank's vocabulary shard
    logits = model.compute_logits(none, torch.tensor([TOKENS - 1]))
    assert logits.shape == (1, cfg.vocab_size // cfg.tp)


def test_rank_sizes_follow_the_tensor_parallel_cut():
    cfg = engine.llama_3_1_70b(tp=8)
    assert (cfg.heads, cfg.kv_heads, cfg.intermediate) == (8, 1, 3584)
    ep = engine.deepseek_v3(moe="dp_ep")
    assert (ep.heads, ep.local_experts, ep.expert_intermediate) == (128, 32, 2048)
    tp = engine.deepseek_v3(moe="tp_workspace")
    assert (tp.heads, tp.local_experts, tp.expert_intermediate) == (16, 256, 256)
    with pytest.raises(ValueError, match="moe must be None or one of"):
        engine.deepseek_v3(moe="dense")
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        engine.llama_3_1_8b(all_reduce="ring")
    with pytest.raises(ValueError, match="does not split over tp=3"):
        engine.llama_3_1_8b(tp=3)


@pytest.mark.parametrize("inner, cost_model", [("eager", True), ("aot_eager", False)])
def test_compiled_with_the_pass_is_bitwise(inner, cost_model):
    """Eager inner: the Dynamo graph holds the captures to the concat, the estimate drops.
    aot_eager: its graph frees them sooner (no drop at this size): rewritten regardless."""
    reference, ref_aux, _, _ = _run(LLAMA, "list")
    backend = aux_capture_backend(inner, cost_model=cost_model)
    hidden, aux, _, _ = _run(LLAMA, "list", backend)
    assert torch.equal(hidden, reference) and torch.equal(aux, ref_aux)
    groups = [g for r in backend.results for g in r.groups if g.k == LLAMA.num_captures]
    assert groups and groups[-1].decision is Decision.REWRITE, [g.reason for g in groups]


@pytest.mark.inductor
def test_inductor_with_the_pass_matches_the_build_without_captures():
    cfg = dataclasses.replace(LLAMA, num_layers=3, capture_layers=(0, 1, 2))
    none, _, _, _ = _run(cfg, "none", aux_capture_backend("inductor", rewrite=False))
    torch._dynamo.reset()
    backend = aux_capture_backend("inductor")
    hidden, aux, _, _ = _run(cfg, "list", backend)
    _, eager_aux, _, _ = _run(cfg, "list")
    assert torch.equal(hidden, none)
    assert torch.equal(aux, eager_aux)  # copies of the residual stream: bitwise anyway
    assert any(r.lifted is not None for r in backend.results)


@pytest.mark.slow
@pytest.mark.parametrize("cfg, rewritten", [(engine.llama_3_1_70b(tp=8), True),
                                            (engine.llama_3_1_8b(tp=1), False)],
                         ids=["70b-tp8", "8b-tp1"])
def test_decision_on_full_size_meta_ranks(cfg, rewritten):
    """At real sizes, bf16, 8192 tokens, Eagle3's 3 captures: a 70B rank at TP=8 pays for the
    concat (its MLP shrank by 8, its captures did not), an 8B model on one device does not."""
    model, inputs = engine.build(cfg, "list", tokens=8192, device="meta")
    gm, target = trace_graph(model, *inputs, inner="eager")
    assert cfg.num_layers == (80 if rewritten else 32)
    (estimate,) = estimate_at(gm, target, 8192, [8192])
    assert estimate.changed is rewritten, estimate.decisions
    if rewritten:
        assert estimate.peak_after < estimate.peak_before
    else:
        assert estimate.peak_after == estimate.peak_before
