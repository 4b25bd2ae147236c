"""The CUDA-graph runner (``compile_pass.cudagraph``).

CPU tests (``use_cuda_graphs=False``: same static buffers, padding and slicing, the function
called directly) check the bookkeeping with the reference models; ``gpu``-marked tests
(skipped without CUDA) capture real graphs: the eager model, an ``aux_capture``-compiled
model (Inductor inner), and ``mode="reduce-overhead"`` (Inductor's cudagraph trees running
the rewritten graph).

Padding a causal decoder: the first ``T`` rows of its outputs do not depend on the rows
after them, but they are not bitwise equal to an unpadded ``T``-token run, because the
kernels block differently at a different row count (on CPU both ``F.linear`` at small ``M``
and the causal flash SDPA change the last bits, max abs diff ~1e-6 in fp32). So: the
runner is compared bitwise with the model run at the *padded* size and sliced, padding
independence is checked bitwise by changing the padded rows' contents, and the unpadded
run is compared with a tolerance.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from torch._dynamo.utils import counters


import models  # noqa: E402
from compile_pass import Decision, aux_capture_backend  # noqa: E402
from compile_pass.cudagraph import (  # noqa: E402
    CudaGraphRunner,
    StaticInputs,
    check_token_counts,
    map_tensors,
    padded_token_count,
)

TOKEN_COUNTS = (8, 16, 32)
REAL_SIZES = (3, 8, 13, 32)
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# --------------------------------------------------------------------------- helpers


def _model(name: str = "llama", mode: str = "packer", device: str = "cpu", dtype=torch.float32, **kw):
    model, _ = models.build(name, "tiny", capture_mode=mode, tokens=8, dtype=dtype, device=device, **kw)
    return model


def _inputs(model, tokens: int, device: str = "cpu", seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    return models.common.example_inputs(model.config, tokens, device=device, seed=seed)


def runner_for(model, fn: Optional[Callable[..., Any]] = None, token_counts: Sequence[int] = TOKEN_COUNTS,
               packed: bool = True, **kw: Any) -> CudaGraphRunner:
    """A runner over ``fn`` (default: the model) with the model's static packed buffer."""
    device = next(model.parameters()).device
    example = (torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device))
    if packed:
        kw.update(packed_width=model.num_captures * model.config.hidden_size,
                  packed_dtype=next(model.parameters()).dtype)
    return CudaGraphRunner(fn if fn is not None else model, token_counts, example, **kw)


def _padded(x: torch.Tensor, size: int, pad: int = 0) -> torch.Tensor:
    return torch.cat([x, x.new_full((size - x.shape[0], *x.shape[1:]), pad)])


def _reference_at_padded(fn, model, ids, pos, size: int, pad_ids: int = 0, pad_pos: int = 0):
    """``fn`` run directly on the inputs padded to ``size`` (own packed buffer), sliced to ``T``."""
    tokens = ids.shape[0]
    out = torch.zeros(size, model.num_captures * model.config.hidden_size,
                      dtype=next(model.parameters()).dtype, device=ids.device)
    hidden, aux = fn(_padded(ids, size, pad_ids), _padded(pos, size, pad_pos), aux_out=out)
    return hidden[:tokens], aux[:tokens]


def _no_recompile():
    return torch._dynamo.config.patch(error_on_recompile=True)


def _assert_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"{what}: output {i} {tuple(x.shape)} vs {tuple(y.shape)}"
        assert torch.equal(x, y), f"{what}: output {i} differs by {(x - y).abs().max().item():.3g}"


# --------------------------------------------------------------------------- sizes


def test_token_counts_sorted_and_validated():
    assert check_token_counts([32, 8, 16]) == (8, 16, 32)
    with pytest.raises(ValueError, match="must not be empty"):
        check_token_counts([])
    with pytest.raises(ValueError, match="duplicates"):
        check_token_counts([8, 8])
    with pytest.raises(ValueError, match=">= 1"):
        check_token_counts([0, 8])
    with pytest.raises(TypeError, match="must be ints"):
        check_token_counts([8.0])
    with pytest.raises(TypeError, match="sequence of ints"):
        check_token_counts(8)


def test_padded_token_count():
    counts = (8, 16, 32)
    assert [padded_token_count(counts, t) for t in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError, match="33 tokens is more than the largest captured token count 32"):
        padded_token_count(counts, 33)
    with pytest.raises(ValueError, match="at least 1 token"):
        padded_token_count(counts, 0)


def test_static_inputs_load_pads_and_keeps_addresses():
    s = StaticInputs([torch.zeros(1, dtype=torch.long), torch.zeros(1, 2)], max_tokens=8, pad_values=(-1, 0.5))
    ptrs = [b.data_ptr() for b in s.buffers]
    assert s.load([torch.arange(3), torch.ones(3, 2)], padded=4) == 3
    assert s.buffers[0][:4].tolist() == [0, 1, 2, -1]
    assert s.buffers[1][3].tolist() == [0.5, 0.5]
    assert all(v.data_ptr() == p for v, p in zip(s.views(4), ptrs))
    assert [tuple(v.shape) for v in s.views(4)] == [(4,), (4, 2)]


@pytest.mark.parametrize("inputs, match", [
    ([torch.zeros(3, dtype=torch.long)], "expected 2 inputs, got 1"),
    ([torch.zeros(3, dtype=torch.int32), torch.zeros(3, 2)], "input 0 has dtype torch.int32"),
    ([torch.zeros(3, dtype=torch.long), torch.zeros(3, 3)], r"input 1 is \(3, 3\); expected \(tokens, 2\)"),
    ([torch.zeros(3, dtype=torch.long), torch.zeros(4, 2)], "input 1 has 4 tokens, input 0 has 3"),
    ([torch.zeros(3, dtype=torch.long, device="meta"), torch.zeros(3, 2)], "input 0 is on meta"),
])
def test_static_inputs_reject_bad_inputs(inputs, match):
    s = StaticInputs([torch.zeros(1, dtype=torch.long), torch.zeros(1, 2)], max_tokens=8)
    with pytest.raises(ValueError, match=match):
        s.check(inputs)


def test_static_inputs_reject_bad_examples():
    with pytest.raises(ValueError, match="0-d"):
        StaticInputs([torch.tensor(1)], 8)
    with pytest.raises(TypeError, match="not a tensor"):
        StaticInputs([torch.zeros(1), 3], 8)
    with pytest.raises(ValueError, match="2 pad values for 1 inputs"):
        StaticInputs([torch.zeros(1)], 8, pad_values=(0, 1))


def test_map_tensors_keeps_structure():
    out = map_tensors(lambda t: t + 1, (torch.zeros(1), [None, {"a": torch.ones(1)}], 3))
    assert out[0].item() == 1 and out[1][0] is None and out[1][1]["a"].item() == 2 and out[2] == 3


# --------------------------------------------------------------------------- runner on CPU


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_runner_cpu_pads_slices_and_shares_one_packed_buffer(name):
    model = _model(name)
    runner = runner_for(model)
    assert not runner.use_cuda_graphs and runner.captured_sizes == ()
    buf = runner.packed_buffer
    assert tuple(buf.shape) == (32, model.num_captures * model.config.hidden_size)
    list_model = _model(name, mode="list")
    for tokens in REAL_SIZES:
        ids, pos = _inputs(model, tokens, seed=tokens)
        hidden, aux = runner(ids, pos)
        assert hidden.shape == (tokens, model.config.hidden_size)
        assert aux.shape == (tokens, buf.shape[1])
        assert aux.data_ptr() == buf.data_ptr(), "the packed captures are not in the static buffer"
        size = runner.padded_size(tokens)
        _assert_equal((hidden, aux), _reference_at_padded(model, model, ids, pos, size),
                      f"{tokens} tokens vs the model at {size} tokens")
        # an unpadded run agrees up to kernel blocking (see the module docstring)
        ref_hidden, ref_aux = list_model(ids, pos)
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(aux, ref_aux, rtol=1e-4, atol=1e-5)


def test_runner_cpu_real_rows_do_not_depend_on_padding():
    """Same padded size, different padded contents: the real rows are bitwise equal (causal)."""
    model = _model("llama")
    a = runner_for(model, pad_values=0)
    b = runner_for(model, pad_values=(5, 7))
    for tokens in (3, 13):
        ids, pos = _inputs(model, tokens, seed=tokens)
        out_a = [t.clone() for t in a(ids, pos)]
        out_b = [t.clone() for t in b(ids, pos)]
        size = a.padded_size(tokens)
        assert b.static_inputs.buffers[0][tokens:size].eq(5).all()
        assert b.static_inputs.buffers[1][tokens:size].eq(7).all()
        _assert_equal(out_a, out_b, f"{tokens} tokens, pad 0 vs pad 5/7")
        # the padded rows themselves did change: the padding reached the model
        assert not torch.equal(a.packed_buffer[tokens:size], b.packed_buffer[tokens:size])


def test_runner_cpu_caller_owned_buffer():
    model = _model("llama")
    width = model.num_captures * model.config.hidden_size
    out = torch.zeros(40, width)
    runner = runner_for(model, packed=False, packed_out=out)
    ids, pos = _inputs(model, 13)
    _, aux = runner(ids, pos)
    assert runner.packed_buffer is out and aux.data_ptr() == out.data_ptr()
    assert out[32:].eq(0).all(), "the runner wrote past its largest token count"


def test_runner_cpu_compiled_model_no_recompile():
    """One dynamic compile (aux_capture, eager inner) serves every size, writing the shared buffer."""
    torch._dynamo.reset()
    model = _model("llama", num_layers=4, capture_layers=[0, 2, 3])  # a short trace
    backend = aux_capture_backend("eager")
    calls: List[int] = []

    def counting(gm, example_inputs):
        calls.append(1)
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, dynamic=True, fullgraph=True)
    runner = runner_for(model, fn=compiled)
    assert len(calls) == 1, f"{len(calls)} compiles for {len(TOKEN_COUNTS)} sizes"
    with _no_recompile():
        for tokens in REAL_SIZES:
            ids, pos = _inputs(model, tokens, seed=tokens)
            hidden, aux = runner(ids, pos)
            assert aux.data_ptr() == runner.packed_buffer.data_ptr()
            size = runner.padded_size(tokens)
            _assert_equal((hidden, aux), _reference_at_padded(model, model, ids, pos, size),
                          f"compiled, {tokens} tokens vs the uncompiled model at {size}")
    assert len(calls) == 1
    torch._dynamo.reset()


def test_runner_errors():
    model = _model("llama")
    runner = runner_for(model)
    ids, pos = _inputs(model, 33)
    with pytest.raises(ValueError, match="33 tokens is more than the largest captured token count 32"):
        runner(ids, pos)
    with pytest.raises(ValueError, match="input 0 has dtype torch.int32"):
        runner(ids[:4].int(), pos[:4])
    with pytest.raises(ValueError, match=r"input 1 is \(4, 1\)"):
        runner(ids[:4], pos[:4, None])
    with pytest.raises(ValueError, match="expected 2 inputs, got 1"):
        runner(ids[:4])
    with pytest.raises(ValueError, match="input 0 is on meta"):
        runner(ids[:4].to("meta"), pos[:4])
    with pytest.raises(ValueError, match="at least 1 token"):
        runner(ids[:0], pos[:0])
    with pytest.raises(ValueError, match="use_cuda_graphs=True needs CUDA inputs"):
        runner_for(model, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="either packed_out or packed_width"):
        runner_for(model, packed_out=torch.zeros(32, 192))
    with pytest.raises(ValueError, match="at least 32 rows"):
        runner_for(model, packed=False, packed_out=torch.zeros(16, 192))
    with pytest.raises(TypeError, match="packed_dtype must be a torch.dtype"):
        runner_for(model, packed=False, packed_width=192)


def test_runner_rejects_function_that_ignores_the_buffer():
    list_model = _model("llama", mode="list")

    def ignores_out(ids, pos, aux_out):
        return list_model(ids, pos)

    with pytest.raises(ValueError, match=r"returned no output that is its prefix aux_out\[:32\]"):
        runner_for(list_model, fn=ignores_out)
    # a list-mode model refuses aux_out itself
    with pytest.raises(ValueError, match="aux_out needs capture_mode='packer'"):
        runner_for(list_model)


def test_runner_rejects_outputs_that_are_not_token_major():
    model = _model("llama")

    def reduces(ids, pos, aux_out):
        hidden, aux = model(ids, pos, aux_out=aux_out)
        return hidden.sum(), aux

    with pytest.raises(ValueError, match=r"output tensor 0 is \(\) at 32 tokens"):
        runner_for(model, fn=reduces)


def test_runner_without_packed_buffer_runs_list_mode():
    model = _model("llama", mode="list")
    runner = runner_for(model, packed=False)
    assert runner.packed_buffer is None
    ids, pos = _inputs(model, 13)
    hidden, aux = runner(ids, pos)
    ref_hidden, ref_aux = model(_padded(ids, 16), _padded(pos, 16))
    _assert_equal((hidden, aux), (ref_hidden[:13], ref_aux[:13]), "list mode, no packed buffer")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@gpu
def test_gpu_runner_eager_model_replays_bitwise():
    model = _model("llama", device="cuda")
    runner = runner_for(model)
    assert runner.use_cuda_graphs and runner.captured_sizes == TOKEN_COUNTS
    buf = runner.packed_buffer
    for tokens in REAL_SIZES:
        ids, pos = _inputs(model, tokens, device="cuda", seed=tokens)
        hidden, aux = runner(ids, pos)
        assert aux.data_ptr() == buf.data_ptr()
        size = runner.padded_size(tokens)
        ref = _reference_at_padded(model, model, ids, pos, size)
        _assert_equal((hidden, aux), ref, f"CUDA graph, {tokens} tokens vs eager at {size}")
    # a replay really recomputes: new inputs of the same size give the eager result again
    ids, pos = _inputs(model, 13, device="cuda", seed=99)
    hidden, aux = runner(ids, pos)
    _assert_equal((hidden, aux), _reference_at_padded(model, model, ids, pos, 16), "replay with new inputs")
    with pytest.raises(ValueError, match="more than the largest captured token count 32"):
        runner(*_inputs(model, 33, device="cuda"))


@pytest.mark.gpu
@pytest.mark.inductor
@gpu
def test_gpu_runner_compiled_model_shares_buffer():
    """aux_capture (Inductor inner), dynamic token count, captured at every size."""
    torch._dynamo.reset()
    model = _model("llama", device="cuda")
    compiled = torch.compile(model, backend=aux_capture_backend("inductor"), dynamic=True, fullgraph=True)
    runner = runner_for(model, fn=compiled)
    assert runner.captured_sizes == TOKEN_COUNTS
    # the reference: the compiled function called directly (no graph) on the runner's padded
    # static inputs, with a buffer like the runner's (same guards: no recompile)
    ref_buf = torch.zeros_like(runner.packed_buffer)
    torch._dynamo.mark_static(ref_buf)
    for tokens in REAL_SIZES:
        ids, pos = _inputs(model, tokens, device="cuda", seed=tokens)
        with _no_recompile():
            hidden, aux = runner(ids, pos)
        assert aux.data_ptr() == runner.packed_buffer.data_ptr()
        hidden, aux = hidden.clone(), aux.clone()
        size = runner.padded_size(tokens)
        with _no_recompile():
            ref_hidden, ref_aux = compiled(*runner.static_inputs.views(size), aux_out=ref_buf)
        assert ref_aux.data_ptr() == ref_buf.data_ptr()
        _assert_equal((hidden, aux), (ref_hidden[:tokens], ref_aux[:tokens]),
                      f"compiled CUDA graph, {tokens} tokens vs compiled direct at {size}")
        torch.testing.assert_close(aux, _reference_at_padded(model, model, ids, pos, size)[1],
                                   rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.inductor
@gpu
def test_gpu_runner_runs_the_rewritten_graph():
    """List mode compiled with the pass (Inductor inner): the rewritten graph is captured."""
    torch._dynamo.reset()
    model = _model("dflash", mode="list", device="cuda")
    backend = aux_capture_backend("inductor", cost_model=False)
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    runner = runner_for(model, fn=compiled, packed=False)
    groups = [g for r in backend.results for g in r.groups]
    assert any(g.decision is Decision.REWRITE and g.k == model.num_captures for g in groups), \
        [(g.k, g.decision.value, g.reason) for g in groups]
    for tokens in (5, 16, 29):
        ids, pos = _inputs(model, tokens, device="cuda", seed=tokens)
        out = [t.clone() for t in runner(ids, pos)]
        size = runner.padded_size(tokens)
        with _no_recompile():
            ref = [t[:tokens] for t in compiled(*runner.static_inputs.views(size))]
        _assert_equal(out, ref, f"rewritten graph in a CUDA graph, {tokens} tokens")
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.inductor
@gpu
def test_gpu_reduce_overhead_runs_rewritten_graph_in_cudagraph_trees():
    torch._dynamo.reset()
    counters.clear()
    model = _model("dflash", mode="list", device="cuda")
    ids, pos = _inputs(model, 32, device="cuda")
    backend = aux_capture_backend("inductor", mode="reduce-overhead", cost_model=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ptrs, results = [], []
    for _ in range(4):  # warm-up, record, replay, replay
        torch.compiler.cudagraph_mark_step_begin()
        hidden, aux = compiled(ids, pos)
        ptrs.append(aux.data_ptr())
        results.append((hidden.clone(), aux.clone()))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    groups = [g for r in backend.results for g in r.groups]
    assert any(g.decision is Decision.REWRITE and g.k == model.num_captures for g in groups), \
        [(g.k, g.decision.value, g.reason) for g in groups]
    # replays write their outputs into the graph's static memory: the same address although
    # the previous step's output was still referenced (a plain allocation could not reuse it)
    assert ptrs[2] == ptrs[3], ptrs
    for r in results[1:]:
        _assert_equal(r, results[0], "cudagraph tree step vs first step")
    torch._dynamo.reset()
    plain = torch.compile(model, backend=aux_capture_backend("inductor", cost_model=False), fullgraph=True)
    _assert_equal(results[-1], plain(ids, pos), "reduce-overhead vs the same compile without cudagraphs")
    torch._dynamo.reset()
