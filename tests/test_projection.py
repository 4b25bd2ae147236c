"""``compile_pass.ProjectingAccumulator``: the draft's input projection applied as each capture
is made. Against the draft's own cat-then-project (``DraftProjection.reference``) for every
combine (plain ``fc``, ``norm_before_fc``, ``fc_norms``, DFlash's ``fc`` + ``hidden_norm``),
fp32 and bf16; its memory against the packer's and the list path's; its errors."""

import pytest
import torch

from compile_pass import AuxCaptureError, AuxHiddenStatePacker, ProjectingAccumulator
from compile_pass.memory import measure_peak
from compile_pass.ops import WHOLE_CAPTURE_BYTES
from compile_pass.projection import DraftProjection

K, H, HD, T = 3, 64, 48, 96


class EngineRMSNorm(torch.nn.Module):
    """An engine's norm module: ``weight`` and ``variance_epsilon`` (vLLM's and SGLang's names)."""

    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width))
        self.variance_epsilon = eps


def _combine(name, dtype):
    torch.manual_seed(0)
    fc = torch.nn.Linear(K * H, HD, bias=True).to(dtype)
    norms = {"plain": {}, "norm_before_fc": {"norm_before_fc": EngineRMSNorm(K * H).to(dtype)},
             "fc_norms": {"fc_norms": [EngineRMSNorm(H).to(dtype) for _ in range(K)]},
             "dflash": {"norm_after_fc": EngineRMSNorm(HD).to(dtype)}}[name]
    return fc, norms


def _captures(dtype, n=K):
    torch.manual_seed(1)
    return [torch.randn(T, H, dtype=dtype) * (1 + i) for i in range(n)]


COMBINES = ["plain", "norm_before_fc", "fc_norms", "dflash"]


@pytest.mark.parametrize("name", COMBINES)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_projected_per_capture_equals_cat_then_project(name, dtype, tolerance):
    fc, norms = _combine(name, dtype)
    acc = ProjectingAccumulator.for_draft(K, fc, **norms)
    xs = _captures(dtype)
    for x in xs:
        acc.append(x)
    out = acc.finalize()
    ref = acc.projection.reference(torch.cat(xs, -1))
    assert out.shape == (T, HD) and out.dtype == dtype
    rel = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert rel < tolerance, rel
    if name == "norm_before_fc":  # the module's epsilon is the one used
        assert acc.projection.norm_before_fc.eps == 1e-5


def test_a_capture_mutated_after_its_append_is_projected_as_it_was():
    fc, _ = _combine("plain", torch.float32)
    acc = ProjectingAccumulator.for_draft(K, fc)
    xs = _captures(torch.float32)
    ref = acc.projection.reference(torch.cat(xs, -1))
    for x in xs:
        acc.append(x)
        x.mul_(3.0)  # a fused in-place norm writing the residual after the capture
    torch.testing.assert_close(acc.finalize(), ref, rtol=2e-6, atol=2e-6)


def test_accumulator_bytes_instead_of_the_packed_buffer():
    """K captures made one after another (each freed after its append): the accumulator is
    the only extra, H_draft / (K*H) of the packed bytes, where the packer keeps K*H and the
    list path K captures plus their cat."""
    torch.manual_seed(0)
    k, h, hd, t = 8, 256, 192, 1024
    fc = torch.nn.Linear(k * h, hd, bias=False)

    def run(kind):
        collect = (ProjectingAccumulator.for_draft(k, fc) if kind == "projected"
                   else AuxHiddenStatePacker(k) if kind == "packer" else [])
        base = torch.zeros(t, h)
        for i in range(k):
            x = base + i  # a capture made here, not kept by the model
            if kind != "none":
                collect.append(x)
            del x
        if kind == "none":
            return None
        if kind == "list":
            return fc(torch.cat(collect, -1))
        return collect.finalize() if kind == "projected" else fc(collect.finalize())

    peaks = {kind: measure_peak(run, kind) for kind in ("none", "list", "packer", "projected")}
    packed = k * h * t * 4
    overhead = {kind: (peaks[kind].bytes - peaks["none"].bytes) / packed for kind in peaks}
    for kind in ("packer", "projected"):
        torch.testing.assert_close(peaks[kind].result, peaks["list"].result, rtol=1e-5, atol=1e-4)
    assert overhead["projected"] <= 1.5 * hd / (k * h), overhead  # the accumulator: 0.09
    assert overhead["packer"] >= 1.0 and overhead["list"] >= 1.9, overhead  # measured 1.00 and 1.97


def test_fp32_accumulation_of_bf16_captures():
    fc, _ = _combine("plain", torch.bfloat16)
    acc = ProjectingAccumulator.for_draft(K, fc, accumulate_dtype=torch.float32)
    xs = _captures(torch.bfloat16)
    for x in xs:
        acc.append(x)
    out = acc.finalize()
    ref = acc.projection.reference(torch.cat(xs, -1))
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2


def test_reset_starts_the_next_forward():
    fc, _ = _combine("plain", torch.float32)
    acc = ProjectingAccumulator.for_draft(K, fc)
    xs = _captures(torch.float32)
    for x in xs:
        acc.append(x)
    first = acc.finalize()
    acc.reset()
    assert len(acc) == 0
    for x in xs:
        acc.capture(x, owned=True)
    assert torch.equal(acc.finalize(), first)


def _acc(**kw):
    torch.manual_seed(0)
    return ProjectingAccumulator(K, torch.randn(HD, K * H), **kw)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: ProjectingAccumulator(K, torch.randn(HD, K * H + 1)), AuxCaptureError,
     r"the fc weight's width 193 is not K\*hidden for K=3"),
    (lambda: ProjectingAccumulator(K, torch.randint(0, 5, (HD, K * H), dtype=torch.int8)), AuxCaptureError,
     r"the fc weight is torch.int8 \(a quantized fc\): it cannot be split .* keep the packer"),
    (lambda: ProjectingAccumulator(K, torch.randn(K * H)), AuxCaptureError, r"expected \[H_draft, K\*hidden\]"),
    (lambda: ProjectingAccumulator(0, torch.randn(HD, K * H)), AuxCaptureError, r"num_captures must be >= 1"),
    (lambda: ProjectingAccumulator("3", torch.randn(HD, K * H)), TypeError, r"num_captures must be an int"),
    (lambda: _acc(fc_bias=torch.randn(HD + 1)), AuxCaptureError, r"the fc bias is \(49,\), expected \(48,\)"),
    (lambda: _acc(norm_before_fc=torch.ones(H)), AuxCaptureError, r"norm_before_fc weight is \(64,\), expected \(192,\)"),
    (lambda: _acc(fc_norms=[torch.ones(H)] * 2), AuxCaptureError, r"2 fc_norms for K=3 captures"),
    (lambda: _acc(norm_before_fc=torch.ones(K * H), fc_norms=[torch.ones(H)]), AuxCaptureError, r"give one"),
    (lambda: _acc(norm_after_fc="rms"), TypeError, r"norm_after_fc must be an RMSNorm module .* got str"),
    (lambda: _acc(accumulate_dtype=torch.int32), TypeError, r"accumulate_dtype must be a floating torch.dtype"),
], ids=["width", "quantized", "not-2d", "k0", "k-str", "bias", "norm-width", "norm-count", "two-norms",
        "norm-type", "acc-dtype"])
def test_bad_drafts_are_named(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_captures_are_named():
    acc = _acc()
    with pytest.raises(AuxCaptureError, match=r"capture 0 has 32 features, the fc weight's width 192 is K\*hidden = 3\*64"):
        acc.append(torch.randn(T, 32))
    with pytest.raises(AuxCaptureError, match=r"capture 0 is torch.float64, the fc weight torch.float32"):
        acc.append(torch.randn(T, H, dtype=torch.float64))
    with pytest.raises(AuxCaptureError, match=r"capture 0 is on meta, the fc weight on cpu"):
        acc.append(torch.empty(T, H, device="meta"))
    acc.append(torch.randn(T, H))
    with pytest.raises(AuxCaptureError, match=r"capture 1 has leading shape \(95,\), the first capture had \(96,\)"):
        acc.append(torch.randn(T - 1, H))
    with pytest.raises(AuxCaptureError, match=r"captured 1 of 3 aux hidden states"):
        acc.finalize()
    acc.append(torch.randn(T, H))
    acc.append(torch.randn(T, H))
    with pytest.raises(AuxCaptureError, match=r"capture 4 exceeds num_captures=3"):
        acc.append(torch.randn(T, H))


def test_one_norm_module_shared_by_every_chunk():
    norm = EngineRMSNorm(H)
    projection = DraftProjection.build(K, torch.randn(HD, K * H), fc_norms=[norm])
    assert len(projection.fc_norms) == K
    assert {n.weight.data_ptr() for n in projection.fc_norms} == {norm.weight.data_ptr()}


@pytest.mark.parametrize("name", COMBINES)
@pytest.mark.parametrize("dtype,accumulate", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.bfloat16, torch.float32)])
def test_hidden_plus_residual_is_projected_as_their_sum_without_forming_it(name, dtype, accumulate):
    """``append(hidden, residual)`` (a decoder's next-layer input): what
    ``append(hidden + residual)`` gives (bitwise where both run the same row-block kernels,
    within rounding where the formed sum is one GEMM), and the sum is formed a row block at a time:
    the peak of one append stays below one capture's bytes above the accumulator."""
    fc, norms = _combine(name, dtype)
    # a capture above WHOLE_CAPTURE_BYTES (blocks of 1/8 of the rows: a whole [t, H]
    # temporary would be 8x a block)
    t = 4 * WHOLE_CAPTURE_BYTES // (H * dtype.itemsize)
    torch.manual_seed(2)
    pairs = [(torch.randn(t, H, dtype=dtype), torch.randn(t, H, dtype=dtype)) for _ in range(K)]
    summed = ProjectingAccumulator.for_draft(K, fc, accumulate_dtype=accumulate, **norms)
    split = ProjectingAccumulator.for_draft(K, fc, accumulate_dtype=accumulate, **norms)
    for h, r in pairs:
        summed.append(h + r)
        split.append(h, r)
    if norms and "norm_after_fc" not in norms:  # both formed and normed in the same row blocks: the same kernels
        assert torch.equal(split.finalize(), summed.finalize())
    else:  # a formed sum is one GEMM, the pair 8 row-block GEMMs: other kernels, equal within rounding
        torch.testing.assert_close(split.finalize(), summed.finalize(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-5 if dtype == torch.float32 else 2e-2)

    def append_all(sum_first):
        acc = ProjectingAccumulator.for_draft(K, fc, accumulate_dtype=accumulate, **norms)
        for h, r in pairs:
            acc.append(h + r) if sum_first else acc.append(h, r)
        return acc  # the appends alone (finalize's own temporaries are another matter)

    acc_bytes = t * HD * (accumulate or dtype).itemsize
    capture = t * H * dtype.itemsize
    extra = {s: measure_peak(append_all, s).bytes - acc_bytes for s in (True, False)}
    assert extra[False] <= 0.75 * capture, (extra[False] / capture, name)  # blocks of 1/8 of the rows
    assert extra[True] - extra[False] >= 0.5 * capture, (extra, name)  # the whole sum never made


def test_a_residual_unlike_its_hidden_state_is_named():
    acc = ProjectingAccumulator(K, torch.randn(HD, K * H))
    with pytest.raises(AuxCaptureError, match=r"capture 0's residual is \(96, 32\) torch.float32 on cpu, its hidden "
                                               r"state \(96, 64\) torch.float32 on cpu"):
        acc.append(torch.randn(T, H), torch.randn(T, 32))
    with pytest.raises(AuxCaptureError, match=r"capture 0's residual is list"):
        acc.append(torch.randn(T, H), [])


def _ops_per_append(acc, captures, residuals=None):
    """aten op calls per ``append`` (the profiler's count), as a dict of name -> calls."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, c in enumerate(captures):
            acc.append(c, residuals[i]) if residuals is not None else acc.append(c)
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


@pytest.mark.parametrize("name", COMBINES)
def test_a_capture_at_decode_size_is_one_gemm_and_its_norm_ops_once(name):
    """Blocking bounds the temporaries of a large capture; at decode sizes it would only
    multiply kernel launches (8 GEMMs of T/8 rows, and the norm's ops 8 times, per capture
    per step). A capture of at most ``WHOLE_CAPTURE_BYTES`` is formed, normed and projected
    whole: one GEMM (``mm``, or ``addmm`` after the first) per capture; one above it, 8."""
    fc, norms = _combine(name, torch.float32)
    for t, gemms in ((16, 1), (WHOLE_CAPTURE_BYTES // (H * 4), 1), (WHOLE_CAPTURE_BYTES // (H * 4) + 8, 8)):
        hidden = [torch.randn(t, H) for _ in range(K)]
        residual = [torch.randn(t, H) for _ in range(K)]
        acc = ProjectingAccumulator.for_draft(K, fc, **norms)
        ops = _ops_per_append(acc, hidden, residual)
        assert ops["aten::mm"] + ops["aten::addmm_"] == K * gemms, (t, dict(ops))
        if name == "fc_norms":  # the per-capture norm's rsqrt: once per block
            assert ops["aten::rsqrt"] == K * gemms, (t, dict(ops))
