"""Tests of the eager aux-hidden-state packer (compile_pass/packer.py)."""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models.llama
from compile_pass import (
    AuxCaptureError,
    AuxHiddenStateList,
    AuxHiddenStatePacker,
    pack_aux_hidden_states,
)
from compile_pass.memory import measure_peak

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _captures(k: int, shape, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(k)]


def _packed(caps, out=None) -> torch.Tensor:
    p = AuxHiddenStatePacker(len(caps), out=out)
    for c in caps:
        p.append(c)
    return p.finalize()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 4)], ids=["2d", "3d"])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_finalize_equals_cat_at_append_time(dtype, shape, k):
    caps = _captures(k, shape, dtype)
    snapshot = torch.cat([c.clone() for c in caps], dim=-1)
    packer = AuxHiddenStatePacker(k)
    plain = AuxHiddenStateList()
    for c in caps:
        packer.append(c)
        plain.append(c)
    # mutate the first capture in place after it was appended
    caps[0].add_(1)
    out = packer.finalize()
    assert out.shape == (*shape[:-1], k * shape[-1])
    assert out.dtype == dtype
    assert torch.equal(out, snapshot)
    # the plain list kept a reference: it sees the new value
    assert torch.equal(plain[0], caps[0])
    assert not torch.equal(plain.finalize(), snapshot)
    assert torch.equal(plain.finalize(), torch.cat(caps, dim=-1))


def test_copies_on_append_flags():
    assert AuxHiddenStatePacker.copies_on_append is True
    assert AuxHiddenStatePacker(2).copies_on_append is True
    assert AuxHiddenStateList.copies_on_append is False
    assert AuxHiddenStateList().copies_on_append is False


def test_num_captures_property():
    assert AuxHiddenStatePacker(3).num_captures == 3


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("k", [0, -1])
def test_num_captures_below_one(k):
    with pytest.raises(AuxCaptureError, match=rf"num_captures must be >= 1, got {k}\b"):
        AuxHiddenStatePacker(k)


@pytest.mark.parametrize("k", [2.0, "2", None, True])
def test_num_captures_not_int(k):
    with pytest.raises(TypeError, match=r"num_captures must be an int, got " + type(k).__name__):
        AuxHiddenStatePacker(k)


def test_more_appends_than_k():
    caps = _captures(3, (4, 8))
    p = AuxHiddenStatePacker(2)
    p.append(caps[0])
    p.append(caps[1])
    with pytest.raises(AuxCaptureError, match=r"capture 3 exceeds num_captures=2"):
        p.append(caps[2])
    # the failed append did not count and did not corrupt the buffer
    assert len(p) == 2
    assert torch.equal(p.finalize(), torch.cat(caps[:2], dim=-1))


def test_finalize_before_k_appends():
    p = AuxHiddenStatePacker(2)
    with pytest.raises(AuxCaptureError, match=r"captured 0 of 2"):
        p.finalize()
    p.append(torch.randn(4, 8))
    with pytest.raises(AuxCaptureError, match=r"captured 1 of 2 aux hidden states"):
        p.finalize()
    with pytest.raises(ValueError, match=r"captured 1 of 2"):
        p.finalize()
    with pytest.raises(RuntimeError, match=r"captured 1 of 2"):
        p.finalize()
    caught = []
    for exc_type in (ValueError, RuntimeError):
        try:
            p.finalize()
        except exc_type as e:  # noqa: PERF203
            caught.append(type(e))
    assert caught == [AuxCaptureError, AuxCaptureError]
    assert issubclass(AuxCaptureError, ValueError)
    assert issubclass(AuxCaptureError, RuntimeError)


@pytest.mark.parametrize(
    "second, message",
    [
        (torch.randn(5, 8), r"capture 1 has leading shape \(5,\), the first capture had \(4,\)"),
        (torch.randn(2, 2, 8), r"capture 1 has leading shape \(2, 2\), the first capture had \(4,\)"),
        (torch.randn(4, 6), r"capture 1 has feature size 6, the first capture had 8"),
        (
            torch.randn(4, 8, dtype=torch.float16),
            re.escape("capture 1 has dtype torch.float16, the first capture had torch.float32"),
        ),
        (torch.empty(4, 8, device="meta"), r"capture 1 is on meta, the first capture was on cpu"),
    ],
    ids=["leading", "leading-rank", "feature", "dtype", "device"],
)
def test_capture_mismatch(second, message):
    first = torch.randn(4, 8)
    p = AuxHiddenStatePacker(3)
    p.append(first)
    with pytest.raises(AuxCaptureError, match=message):
        p.append(second)
    assert len(p) == 1  # a rejected capture does not count
    p.append(first + 1)
    assert len(p) == 2


def test_capture_mismatch_later_index():
    p = AuxHiddenStatePacker(3)
    p.append(torch.randn(4, 8))
    p.append(torch.randn(4, 8))
    with pytest.raises(AuxCaptureError, match=r"capture 2 has feature size 9, the first capture had 8"):
        p.append(torch.randn(4, 9))


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, None])
def test_non_tensor_capture(bad):
    p = AuxHiddenStatePacker(2)
    with pytest.raises(TypeError, match=r"a capture must be a torch.Tensor, got " + type(bad).__name__):
        p.append(bad)
    with pytest.raises(TypeError, match=r"a capture must be a torch.Tensor"):
        p.slot(bad)
    assert len(p) == 0


def test_zero_dim_capture():
    p = AuxHiddenStatePacker(2)
    with pytest.raises(AuxCaptureError, match=r"at least one dimension"):
        p.append(torch.tensor(1.0))
    assert len(p) == 0


def test_one_dim_captures():
    caps = _captures(3, (6,))
    out = _packed(caps)
    assert out.shape == (18,)
    assert torch.equal(out, torch.cat(caps, dim=-1))


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("shape", [(10, 8), (10, 3, 8)], ids=["2d", "3d"])
def test_out_prefix_buffer(shape):
    k, tokens = 3, 6
    out = torch.full((shape[0], *shape[1:-1], k * shape[-1]), -7.0)
    caps = _captures(k, (tokens, *shape[1:]))
    before_tail = out[tokens:].clone()
    res = _packed(caps, out=out)
    assert res.shape == (tokens, *shape[1:-1], k * shape[-1])
    assert res.data_ptr() == out.data_ptr()
    assert _ptr(res) == _ptr(out)
    assert torch.equal(res, torch.cat(caps, dim=-1))
    assert torch.equal(out[:tokens], torch.cat(caps, dim=-1))
    assert torch.equal(out[tokens:], before_tail)  # rows past the token count untouched


def test_out_reused_across_token_counts_without_allocating():
    k, h = 3, 8
    out = torch.zeros(64, k * h)
    results = []
    for tokens in (16, 40):
        caps = _captures(k, (tokens, h), seed=tokens)
        peak = measure_peak(_packed, caps, out=out)
        assert peak.bytes == 0, "the packer allocated although out= was given"
        res = peak.result
        assert res.data_ptr() == out.data_ptr()
        assert res.shape == (tokens, k * h)
        assert torch.equal(res, torch.cat(caps, dim=-1))
        results.append(res)
    # both results are prefixes of the same caller-owned buffer
    assert results[0].data_ptr() == results[1].data_ptr()


def test_out_exact_one_dim():
    caps = _captures(2, (5,))
    out = torch.empty(10)
    res = _packed(caps, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(res, torch.cat(caps))
    with pytest.raises(AuxCaptureError, match=r"out buffer is \(12,\), 1-D captures need exactly \(10,\)"):
        _packed(caps, out=torch.empty(12))


@pytest.mark.parametrize(
    "out, message",
    [
        (torch.empty(5, 24), r"out buffer is \(5, 24\), captures need at least \(8, 24\): 8 tokens, 3 x 8 features"),
        (torch.empty(16, 20), r"out buffer is \(16, 20\), captures need at least \(8, 24\): 8 tokens, 3 x 8 features"),
        (torch.empty(16, 2, 24), r"out buffer is \(16, 2, 24\), captures need at least \(8, 24\)"),
        (
            torch.empty(16, 24, dtype=torch.bfloat16),
            re.escape("out buffer dtype is torch.bfloat16, captures are torch.float32"),
        ),
        (torch.empty(16, 24, device="meta"), r"out buffer is on meta, captures are on cpu"),
    ],
    ids=["short", "feature", "rank", "dtype", "device"],
)
def test_out_mismatch(out, message):
    p = AuxHiddenStatePacker(3, out=out)
    with pytest.raises(AuxCaptureError, match=message):
        p.append(torch.randn(8, 8))
    assert len(p) == 0


@pytest.mark.parametrize("out", [[0.0] * 24, 1.0, "buf"])
def test_out_not_a_tensor(out):
    with pytest.raises(TypeError, match=r"out must be a torch.Tensor or None, got " + type(out).__name__):
        AuxHiddenStatePacker(3, out=out)


# --------------------------------------------------------------------------- reset


def test_reset_reuses_buffer():
    k = 3
    p = AuxHiddenStatePacker(k)
    first = _captures(k, (6, 8), seed=1)
    p.extend(first)
    res1 = p.finalize()
    ptr = res1.data_ptr()
    assert torch.equal(res1, torch.cat(first, dim=-1))
    p.reset()
    assert len(p) == 0
    with pytest.raises(AuxCaptureError, match=r"captured 0 of 3"):
        p.finalize()
    second = _captures(k, (6, 8), seed=2)
    peak = measure_peak(p.extend, second)
    assert peak.bytes == 0, "reset() should reuse the buffer, not allocate a new one"
    res2 = p.finalize()
    assert res2.data_ptr() == ptr
    assert torch.equal(res2, torch.cat(second, dim=-1))
    # the old result aliases the buffer: it now shows the second forward's values
    assert torch.equal(res1, torch.cat(second, dim=-1))


@pytest.mark.parametrize(
    "shape, dtype",
    [((7, 8), torch.float32), ((6, 4), torch.float32), ((6, 8), torch.float16)],
    ids=["tokens", "feature", "dtype"],
)
def test_reset_then_different_shape(shape, dtype):
    p = AuxHiddenStatePacker(2)
    p.extend(_captures(2, (6, 8)))
    p.finalize()
    p.reset()
    with pytest.raises(AuxCaptureError, match=r"reset\(\) reuses the packed buffer .*create a new packer"):
        p.append(torch.randn(*shape).to(dtype))
    assert len(p) == 0


def test_reset_then_different_device():
    p = AuxHiddenStatePacker(1)
    p.append(torch.randn(4, 8))
    p.finalize()
    p.reset()
    with pytest.raises(AuxCaptureError, match=r"reset\(\)"):
        p.append(torch.empty(4, 8, device="meta"))


def test_reset_with_out_allows_new_token_count():
    out = torch.zeros(32, 16)
    p = AuxHiddenStatePacker(2, out=out)
    a = _captures(2, (10, 8), seed=3)
    p.extend(a)
    assert torch.equal(p.finalize(), torch.cat(a, dim=-1))
    p.reset()
    b = _captures(2, (20, 8), seed=4)
    p.extend(b)
    res = p.finalize()
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(res, torch.cat(b, dim=-1))


# --------------------------------------------------------------------------- slot / capture / extend


def test_slot_writes_into_buffer():
    k = 3
    hs = _captures(k, (5, 8), seed=5)
    rs = _captures(k, (5, 8), seed=6)
    p = AuxHiddenStatePacker(k)
    slots = []
    for i, (h, r) in enumerate(zip(hs, rs)):
        s = p.slot(h)
        assert len(p) == i + 1
        assert s.shape == h.shape
        ret = torch.add(h, r, out=s)
        assert ret.data_ptr() == s.data_ptr()
        slots.append(s)
    res = p.finalize()
    assert torch.equal(res, torch.cat([h + r for h, r in zip(hs, rs)], dim=-1))
    for i, s in enumerate(slots):
        assert _ptr(s) == _ptr(res)
        assert s.data_ptr() == res[:, i * 8 :].data_ptr()
    with pytest.raises(AuxCaptureError, match=r"capture 4 exceeds num_captures=3"):
        p.slot(hs[0])


def test_slot_mixed_with_append():
    a, b = _captures(2, (4, 6), seed=7)
    p = AuxHiddenStatePacker(2)
    p.append(a)
    p.slot(b).copy_(b)
    assert torch.equal(p.finalize(), torch.cat([a, b], dim=-1))


@pytest.mark.parametrize("owned", [False, True])
def test_list_capture_clones_unless_owned(owned):
    h = torch.randn(4, 8)
    before = h.clone()
    aux = AuxHiddenStateList()
    aux.capture(h, owned=owned)
    assert len(aux) == 1
    if owned:
        assert aux[0] is h
        assert _ptr(aux[0]) == _ptr(h)
    else:
        assert aux[0] is not h
        assert _ptr(aux[0]) != _ptr(h)
    h.mul_(3)
    assert torch.equal(aux[0], h if owned else before)


def test_list_capture_default_clones():
    h = torch.randn(4, 8)
    aux = AuxHiddenStateList()
    aux.capture(h)
    assert _ptr(aux[0]) != _ptr(h)


@pytest.mark.parametrize("owned", [False, True])
def test_packer_capture_copies_either_way(owned):
    caps = _captures(2, (4, 8), seed=8)
    snapshot = torch.cat([c.clone() for c in caps], dim=-1)
    p = AuxHiddenStatePacker(2)
    for c in caps:
        p.capture(c, owned=owned)
    for c in caps:
        c.mul_(-2)
    res = p.finalize()
    assert all(_ptr(res) != _ptr(c) for c in caps)
    assert torch.equal(res, snapshot)


def test_extend_and_len():
    caps = _captures(4, (3, 5), seed=9)
    p = AuxHiddenStatePacker(4)
    assert len(p) == 0
    p.extend(caps[:1])
    assert len(p) == 1
    p.extend(iter(caps[1:]))  # any iterable
    assert len(p) == 4
    assert torch.equal(p.finalize(), torch.cat(caps, dim=-1))
    with pytest.raises(AuxCaptureError, match=r"capture 5 exceeds num_captures=4"):
        p.extend(caps[:1])
    lst = AuxHiddenStateList()
    lst.extend(caps)
    assert len(lst) == 4
    assert torch.equal(lst.finalize(), torch.cat(caps, dim=-1))


def test_extend_stops_at_first_error():
    caps = _captures(3, (3, 5), seed=10)
    p = AuxHiddenStatePacker(3)
    with pytest.raises(AuxCaptureError, match=r"capture 1 has feature size 4"):
        p.extend([caps[0], torch.randn(3, 4), caps[1]])
    assert len(p) == 1


def test_packer_does_not_keep_first_capture_alive():
    p = AuxHiddenStatePacker(2)
    h = torch.randn(4, 8)
    ref = weakref.ref(h)
    p.append(h)
    del h
    assert ref() is None


# --------------------------------------------------------------------------- pack_aux_hidden_states


def test_pack_tensor_returned_as_is():
    t = torch.randn(4, 12)
    assert pack_aux_hidden_states(t) is t


def test_pack_one_element_list():
    t = torch.randn(4, 12)
    assert pack_aux_hidden_states([t]) is t
    assert pack_aux_hidden_states(AuxHiddenStateList([t])) is t


@pytest.mark.parametrize("shape", [(6, 4, 15), (2, 6, 4, 15)], ids=["2d", "3d"])
def test_pack_adjacent_slices_is_a_view(shape):
    k, h = 3, 5
    assert shape[-1] == k * h
    buf = torch.randn(*shape)
    caps = [buf[..., i * h : (i + 1) * h] for i in range(k)]
    expected = torch.cat(caps, dim=-1)
    res = pack_aux_hidden_states(caps)
    assert res.data_ptr() == buf.data_ptr()
    assert _ptr(res) == _ptr(buf)
    assert res.shape == buf.shape
    assert torch.equal(res, expected)
    buf.add_(1)  # a view, not a copy
    assert torch.equal(res, buf)


def test_pack_adjacent_slices_of_inner_columns():
    buf = torch.randn(4, 20)
    caps = [buf[:, 2:6], buf[:, 6:10], buf[:, 10:14]]
    res = pack_aux_hidden_states(caps)
    assert res.data_ptr() == buf[:, 2:].data_ptr()
    assert torch.equal(res, buf[:, 2:14])


@pytest.mark.parametrize("rank", [2, 3])
def test_pack_prefix_view_of_bigger_buffer(rank):
    k, h, t = 3, 4, 5
    out = torch.randn(16, *([2] if rank == 3 else []), k * h)
    prefix = out[:t]
    caps = [prefix[..., i * h : (i + 1) * h] for i in range(k)]
    res = pack_aux_hidden_states(caps)
    assert res.shape == prefix.shape
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(res, torch.cat(caps, dim=-1))
    assert torch.equal(res, prefix)


def test_pack_of_packer_slots_is_a_view():
    caps = _captures(3, (5, 4), seed=11)
    out = torch.zeros(8, 12)
    p = AuxHiddenStatePacker(3, out=out)
    slots = []
    for c in caps:
        s = p.slot(c)
        s.copy_(c)
        slots.append(s)
    res = pack_aux_hidden_states(slots)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(res, p.finalize())


def _fallback_cases():
    buf = torch.randn(4, 12)
    other = torch.randn(4, 12)
    yield "shuffled", [buf[:, 4:8], buf[:, 0:4], buf[:, 8:12]]
    yield "gap", [buf[:, 0:4], buf[:, 5:9]]
    yield "two-buffers", [buf[:, 0:4], other[:, 4:8]]
    yield "overlap", [buf[:, 0:4], buf[:, 2:6]]
    yield "repeated", [buf[:, 0:4], buf[:, 0:4]]
    yield "separate", [torch.randn(4, 4), torch.randn(4, 4)]


@pytest.mark.parametrize("name, caps", list(_fallback_cases()), ids=[n for n, _ in _fallback_cases()])
def test_pack_falls_back_to_cat(name, caps):
    expected = torch.cat(caps, dim=-1)
    res = pack_aux_hidden_states(caps)
    assert all(_ptr(res) != _ptr(c) for c in caps)
    assert res.shape == expected.shape
    assert torch.equal(res, expected)


def test_pack_tuple_accepted():
    caps = _captures(2, (3, 4), seed=12)
    assert torch.equal(pack_aux_hidden_states(tuple(caps)), torch.cat(caps, dim=-1))


def test_pack_empty_list():
    with pytest.raises(AuxCaptureError, match=r"no aux hidden states to pack: the capture list is empty"):
        pack_aux_hidden_states([])
    with pytest.raises(AuxCaptureError, match=r"capture list is empty"):
        AuxHiddenStateList().finalize()


@pytest.mark.parametrize("bad", [None, 3, {"a": torch.zeros(2)}, (t for t in [torch.zeros(2)])], ids=["none", "int", "dict", "gen"])
def test_pack_non_list(bad):
    with pytest.raises(TypeError, match=r"must be a tensor or a list of tensors, got " + type(bad).__name__):
        pack_aux_hidden_states(bad)


def test_pack_list_with_non_tensor():
    with pytest.raises(TypeError, match=r"aux hidden state 1 is a float, not a tensor"):
        pack_aux_hidden_states([torch.zeros(2, 2), 1.0])
    with pytest.raises(TypeError, match=r"aux hidden state 0 is a list, not a tensor"):
        pack_aux_hidden_states([[1.0]])


# --------------------------------------------------------------------------- Dynamo


class CountingBackend:
    """A Dynamo backend that runs the captured graph as is and counts compilations."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.calls += 1
        return gm.forward


class PackerModule(torch.nn.Module):
    def __init__(self, k: int, h: int) -> None:
        super().__init__()
        self.k = k
        self.lins = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(k + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = AuxHiddenStatePacker(self.k)
        h = x
        for i, lin in enumerate(self.lins):
            if i < self.k:
                aux.append(h + 1)
            h = lin(h)
        return aux.finalize() * 1 + h.sum(-1, keepdim=True) * 0


def _pack_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    p = AuxHiddenStatePacker(4)
    h = x
    for i in range(4):
        h = torch.tanh(h * w + i)
        p.append(h)
    return p.finalize()


def test_dynamo_function_fullgraph_dynamic():
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = torch.compile(_pack_fn, backend=backend, fullgraph=True, dynamic=True)
    w = torch.randn(8)
    for tokens in (16, 40):
        x = torch.randn(tokens, 8)
        got = compiled(x, w)
        assert got.shape == (tokens, 32)
        assert torch.equal(got, _pack_fn(x, w))
    assert backend.calls == 1


def test_dynamo_module_fullgraph_dynamic():
    torch._dynamo.reset()
    torch.manual_seed(0)
    mod = PackerModule(3, 8).eval()
    backend = CountingBackend()
    compiled = torch.compile(mod, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (16, 40):
            x = torch.randn(tokens, 8)
            got = compiled(x)
            assert got.shape == (tokens, 24)
            assert torch.equal(got, mod(x))
    assert backend.calls == 1


def test_dynamo_llama_packer_mode():
    torch._dynamo.reset()
    model, (ids, pos) = models.llama.tiny(capture_mode="packer", tokens=16)
    ref_model, _ = models.llama.tiny(capture_mode="list", tokens=16)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    k, hidden = model.num_captures, model.config.hidden_size
    with torch.no_grad():
        for tokens in (16, 40):
            ids, pos = models.llama.example_inputs(model.config, tokens)
            got_h, got_aux = compiled(ids, pos)
            eager_h, eager_aux = model(ids, pos)
            list_h, list_aux = ref_model(ids, pos)
            assert got_aux.shape == (tokens, k * hidden)
            assert torch.equal(got_h, eager_h)
            assert torch.equal(got_aux, eager_aux)
            assert torch.equal(eager_aux, list_aux)
            assert torch.equal(eager_h, list_h)
    assert backend.calls == 1


# --------------------------------------------------------------------------- property


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 6),
    feature=st.integers(1, 17),
    tokens=st.integers(1, 33),
    dtype=st.sampled_from(DTYPES),
    three_d=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_packer_equals_cat(k, feature, tokens, dtype, three_d, seed):
    shape = (2, tokens, feature) if three_d else (tokens, feature)
    caps = _captures(k, shape, dtype, seed=seed)
    expected = torch.cat(caps, dim=-1)
    res = _packed(caps)
    assert res.dtype == dtype
    assert res.shape == expected.shape
    assert torch.equal(res, expected)
    assert torch.equal(pack_aux_hidden_states(list(caps)), expected)


def test_the_eager_import_does_not_load_the_compiler():
    """Model files import the packer; that must not import torch._dynamo or torch._inductor
    (a fresh interpreter, so nothing else imported them first)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from compile_pass import AuxHiddenStatePacker, AuxHiddenStateList, pack_aux_hidden_states, "
            "AuxHiddenStates, AuxCaptureError\n"
            "p = AuxHiddenStatePacker(2); p.append(torch.ones(3, 2)); p.append(torch.zeros(3, 2))\n"
            "assert pack_aux_hidden_states(p.finalize()).shape == (3, 4)\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
            "import compile_pass\n"
            "compile_pass.aux_capture_backend('eager')\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines == ["[]", "True"], out.stdout + out.stderr
