"""One caller-owned static packed buffer for every token count (docs/cuda-graphs.md).

A reference model in ``capture_mode="packer"`` takes ``aux_out=buf`` (``[max_tokens,
K * hidden]``): its packer writes the captures into ``buf[:T]`` and the model returns that
view. Checked uncompiled and under one ``torch.compile(dynamic=True)`` per inner run at two
token counts: same address, bitwise equal to the uncompiled model, no recompile.
"""

from __future__ import annotations

from typing import List

import pytest
import torch


import models  # noqa: E402
from compile_pass import AuxCaptureError, aux_capture_backend  # noqa: E402

MAX_TOKENS = 48
SIZES = (16, 40)


@pytest.fixture(autouse=True)
def _clean():
    torch._dynamo.reset()
    with torch.no_grad():
        yield
    torch._dynamo.reset()


#: 4 layers (captures at the embedding output and two layer inputs) keep Dynamo traces short
SMALL = {"llama": dict(num_layers=4, capture_layers=[0, 2, 3]),
         "deepseek": dict(num_layers=4, capture_layers=[0, 2, 3]),
         "dflash": {}}


def _pair(name: str, **overrides):
    """(packer-mode model, list-mode reference with the same weights, inputs of MAX_TOKENS)."""
    overrides = {**SMALL[name], **overrides}
    model, inputs = models.build(name, "tiny", capture_mode="packer", tokens=MAX_TOKENS, **overrides)
    reference, _ = models.build(name, "tiny", capture_mode="list", tokens=MAX_TOKENS, **overrides)
    return model, reference, inputs


def _buffer(model, rows: int = MAX_TOKENS, dtype=torch.float32) -> torch.Tensor:
    return torch.full((rows, model.num_captures * model.config.hidden_size), float("nan"), dtype=dtype)


def _check(out, ref, buf: torch.Tensor, tokens: int, what: str) -> None:
    hidden, aux = out
    assert aux.data_ptr() == buf.data_ptr(), f"{what}: the captures are not in the caller's buffer"
    assert aux.shape == (tokens, buf.shape[1])
    assert torch.equal(hidden, ref[0]), f"{what}: hidden differs by {(hidden - ref[0]).abs().max().item():.3g}"
    assert torch.equal(aux, ref[1]), f"{what}: aux differs by {(aux - ref[1]).abs().max().item():.3g}"


@pytest.mark.parametrize("name", ["llama", "deepseek", "dflash"])
def test_uncompiled_model_writes_prefix_of_static_buffer(name):
    model, reference, (ids, pos) = _pair(name)
    buf = _buffer(model)
    for tokens in SIZES:
        out = model(ids[:tokens], pos[:tokens], aux_out=buf)
        _check(out, reference(ids[:tokens], pos[:tokens]), buf, tokens, f"{name} at {tokens}")
        if tokens == SIZES[0]:
            assert buf[tokens:].isnan().all(), "rows past the token count were written"
    # the signature without aux_out is unchanged
    hidden, aux = model(ids[:8], pos[:8])
    assert aux.data_ptr() != buf.data_ptr() and torch.equal(aux, reference(ids[:8], pos[:8])[1])


def test_aux_out_errors():
    model, reference, (ids, pos) = _pair("llama")
    with pytest.raises(ValueError, match="aux_out needs capture_mode='packer'.*'list'"):
        reference(ids, pos, aux_out=_buffer(model))
    with pytest.raises(AuxCaptureError, match="out buffer dtype is torch.float64"):
        model(ids, pos, aux_out=_buffer(model, dtype=torch.float64))
    with pytest.raises(AuxCaptureError, match=r"captures need at least \(48, 192\): 48 tokens, 3 x 64"):
        model(ids, pos, aux_out=_buffer(model, rows=40))
    with pytest.raises(AuxCaptureError, match=r"captures need at least \(48, 192\)"):
        model(ids, pos, aux_out=torch.zeros(MAX_TOKENS, 128))


def _compiled_at_two_sizes(name: str, inner: str, **overrides) -> None:
    model, reference, (ids, pos) = _pair(name, **overrides)
    if inner == "inductor":
        # Inductor's kernels round differently from eager (~1e-7 here): the bitwise reference is
        # Inductor's own list path (the pass off), as everywhere in this project
        eager_reference = reference
        reference = torch.compile(reference, backend=aux_capture_backend("inductor", rewrite=False),
                                  dynamic=True, fullgraph=True)
    buf = _buffer(model)
    backend = aux_capture_backend(inner)
    compiles: List[int] = []

    def counting(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, dynamic=True, fullgraph=True)
    first = compiled(ids[: SIZES[0]], pos[: SIZES[0]], aux_out=buf)
    _check(first, reference(ids[: SIZES[0]], pos[: SIZES[0]]), buf, SIZES[0], f"{name}/{inner} at {SIZES[0]}")
    assert buf[SIZES[0]:].isnan().all(), "rows past the token count were written"
    compiled_so_far = len(compiles)
    assert compiled_so_far >= 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = compiled(ids[: SIZES[1]], pos[: SIZES[1]], aux_out=buf)
    assert len(compiles) == compiled_so_far, "the second token count recompiled"
    _check(second, reference(ids[: SIZES[1]], pos[: SIZES[1]]), buf, SIZES[1], f"{name}/{inner} at {SIZES[1]}")
    if inner == "inductor":
        torch.testing.assert_close(second[1], eager_reference(ids[: SIZES[1]], pos[: SIZES[1]])[1],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name, inner", [("llama", "eager"), ("deepseek", "eager"), ("llama", "aot_eager")])
def test_compiled_dynamic_writes_one_buffer_at_two_sizes(name, inner):
    _compiled_at_two_sizes(name, inner)


@pytest.mark.inductor
def test_compiled_dynamic_writes_one_buffer_at_two_sizes_inductor():
    _compiled_at_two_sizes("llama", "inductor", num_layers=3, capture_layers=[0, 1, 2])


def test_buffer_rows_equal_to_first_token_count_need_mark_static():
    """Duck sizing: traced with T == the buffer's rows, Dynamo gives both one symbol and
    the next size recompiles; ``torch._dynamo.mark_static(buf)`` (what CudaGraphRunner does)
    keeps one graph."""
    model, reference, (ids, pos) = _pair("llama")
    for mark_static, expected_compiles in ((False, 2), (True, 1)):
        torch._dynamo.reset()
        buf = _buffer(model)
        if mark_static:
            torch._dynamo.mark_static(buf)
        compiles: List[int] = []

        def counting(gm, example_inputs):
            compiles.append(1)
            return gm.forward

        compiled = torch.compile(model, backend=counting, dynamic=True, fullgraph=True)
        for tokens in (MAX_TOKENS, SIZES[0]):
            # clones: a view's base would be guarded too (CudaGraphRunner marks its static
            # input buffers, the bases of its input views, static as well)
            out = compiled(ids[:tokens].clone(), pos[:tokens].clone(), aux_out=buf)
            _check(out, reference(ids[:tokens], pos[:tokens]), buf, tokens, f"mark_static={mark_static}")
        assert len(compiles) == expected_compiles, (mark_static, len(compiles))


def test_compiled_packer_writes_through_the_custom_op():
    """In a compiled graph the packer writes with ``compile_pass::write_slice_`` (kept in place
    by Inductor; a ``copy_`` into a slice would be functionalized into whole-buffer copies)."""
    model, reference, (ids, pos) = _pair("llama")
    buf = _buffer(model)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(model, backend=recording, fullgraph=True)(ids[:16], pos[:16], aux_out=buf)
    _check(out, reference(ids[:16], pos[:16]), buf, 16, "recorded graph")
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("compile_pass.write_slice_.default") == model.num_captures, targets
    assert not any(t.endswith("copy_") for t in targets), targets
