"""``compile_pass/norm_match.py``: an RMSNorm recognized from the nodes reading a tensor, in
Dynamo's torch IR and in aten IR, spelled the ways engines and HF models write it; anything
that is not one (a LayerNorm, a mean without keepdim, an intermediate read elsewhere) is
refused with the node that broke it."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from compile_pass.norm_match import chunk_readers, match_rms_norm
from compile_pass.ops import rms_norm


def engine_native(x, w):  # vLLM's / SGLang's forward_native
    return rms_norm(x, w, 1e-5)


def hf_llama(x, w):  # transformers' LlamaRMSNorm: weight first, variance via pow + mean
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + 1e-6)
    return w * h.to(x.dtype)


def squared_by_mul(x, w):  # x * x, torch.mean, no weight
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)


def functional(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def layer_norm_like(x, w):  # subtracts the mean: not an RMSNorm
    c = x - x.mean(-1, keepdim=True)
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def no_keepdim(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1).unsqueeze(-1) + 1e-5) * w


def rsqrt_read_twice(x, w):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x * r * w, r


EXPECTED = {engine_native: (True, 1e-5), hf_llama: (True, 1e-6), squared_by_mul: (False, 1e-6),
            functional: (True, 1e-5)}


def _dynamo_graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0].graph


def _aten_graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args).graph


def _input(graph):
    return next(n for n in graph.nodes if n.op == "placeholder")


@pytest.mark.parametrize("ir", [_dynamo_graph, _aten_graph])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", list(EXPECTED), ids=lambda f: f.__name__)
def test_rms_norms_are_recognized_with_weight_and_eps(fn, dtype, ir):
    x, w = torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)
    graph = ir(fn, x, w)
    match, why = match_rms_norm(_input(graph))
    assert match is not None, why
    has_weight, eps = EXPECTED[fn]
    assert (match.weight is not None) is has_weight
    if has_weight:
        assert match.weight.op == "placeholder" and match.weight is not _input(graph)
    assert match.eps == pytest.approx(eps)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    returned = output.args[0]
    returned = returned[0] if isinstance(returned, (list, tuple)) else returned
    assert match.output is returned and match.output in match.interior


@pytest.mark.parametrize("ir", [_dynamo_graph, _aten_graph])
@pytest.mark.parametrize("fn, broke", [(layer_norm_like, "square and scale"), (no_keepdim, "keepdim"),
                                       (rsqrt_read_twice, "rsqrt")], ids=["layer_norm", "no_keepdim", "read_twice"])
def test_what_is_not_an_rms_norm_is_refused_with_the_reason(fn, broke, ir):
    graph = ir(fn, torch.randn(4, 16), torch.randn(16))
    match, why = match_rms_norm(_input(graph))
    assert match is None and broke in why, why


@pytest.mark.parametrize("ir", [_dynamo_graph, _aten_graph])
def test_chunks_of_the_captures_widths(ir):
    def split(x):
        return [c * 2 for c in x.split([8, 8, 16], dim=-1)]

    def slices(x):
        return x[:, 16:] * 2, x[:, :8] + 1, x[:, 8:16] - 1

    for fn in (split, slices):
        graph = ir(fn, torch.randn(4, 32))
        chunks, _, why = chunk_readers(_input(graph), [8, 8, 16])
        assert chunks is not None, why
        assert [c.meta.get("val", c.meta.get("example_value")).shape[-1] for c in chunks] == [8, 8, 16]
        chunks, _, why = chunk_readers(_input(graph), [16, 16])
        assert chunks is None and why
