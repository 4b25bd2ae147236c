"""Tests of measure_peak (compile_pass/memory.py) and of what it says about the packer."""

from __future__ import annotations

import pytest
import torch

import models.llama
from compile_pass import AuxHiddenStateList, AuxHiddenStatePacker
from compile_pass.memory import Peak, allocation_trace, measure_peak

MiB = 2**20
FOUR_MIB_FP32 = MiB  # elements of a 4 MiB fp32 tensor


# --------------------------------------------------------------------------- basics


def _two_and_cat(device="cpu"):
    a = torch.ones(FOUR_MIB_FP32, device=device)
    b = torch.full((FOUR_MIB_FP32,), 2.0, device=device)
    return torch.cat([a, b])


def test_two_tensors_and_cat_peak_16_mib():
    peak = measure_peak(_two_and_cat)
    assert isinstance(peak, Peak)
    assert peak.bytes == 16 * MiB
    res = peak.result
    assert isinstance(res, torch.Tensor)
    assert res.shape == (2 * FOUR_MIB_FP32,)
    assert torch.equal(res[:FOUR_MIB_FP32], torch.ones(FOUR_MIB_FP32))
    assert torch.equal(res[FOUR_MIB_FP32:], torch.full((FOUR_MIB_FP32,), 2.0))


def test_result_and_kwargs_are_passed_through():
    sentinel = object()

    def fn(a, *, b):
        return (a, b)

    peak = measure_peak(fn, 1, b=sentinel)
    assert peak.result == (1, sentinel)
    assert peak.bytes == 0


def test_alloc_free_loop_peak_is_one_allocation():
    def fn():
        total = 0.0
        for _ in range(5):
            t = torch.ones(2 * MiB)  # 8 MiB fp32
            total += float(t[0])
            del t
        return total

    peak = measure_peak(fn)
    assert peak.bytes == 8 * MiB
    assert peak.result == 5.0
    sizes, _ = allocation_trace(fn)
    assert sizes.count(8 * MiB) == 5  # five allocations were seen, and five frees
    assert sizes.count(-8 * MiB) == 5


def test_inputs_allocated_before_the_call_count_zero():
    x = torch.randn(FOUR_MIB_FP32)
    zero = torch.zeros(())
    # x + zero: one fresh 4 MiB output, nothing else (zero is a preallocated 0-dim tensor)
    peak = measure_peak(lambda x: x + zero, x)
    assert peak.bytes == 4 * MiB
    assert torch.equal(peak.result, x)
    # x + 0 as well: the Python scalar is wrapped into a 0-dim tensor (a few bytes)
    peak0 = measure_peak(lambda x: x + 0, x)
    assert 4 * MiB <= peak0.bytes <= 4 * MiB + 1024
    assert torch.equal(peak0.result, x)
    # only views of the input: nothing allocated at all
    assert measure_peak(lambda x: x[: FOUR_MIB_FP32 // 2].view(2, -1), x).bytes == 0


def test_non_callable_raises_type_error():
    with pytest.raises(TypeError, match=r"measure_peak needs a callable, got int"):
        measure_peak(3)
    with pytest.raises(TypeError, match=r"measure_peak needs a callable, got Tensor"):
        measure_peak(torch.zeros(2))


# --------------------------------------------------------------------------- custom ops, Inductor


@torch.library.custom_op("cp_test_memory::alloc", mutates_args=())
def _alloc_op(x: torch.Tensor, numel: int) -> torch.Tensor:
    scratch = torch.ones(numel)  # internal scratch, freed before the op returns
    return x + scratch.sum()


@_alloc_op.register_fake
def _alloc_op_fake(x: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.empty_like(x)


def test_custom_op_internal_allocation_is_counted():
    x = torch.zeros(4)
    peak = measure_peak(torch.ops.cp_test_memory.alloc, x, 2 * MiB)  # 8 MiB scratch
    assert 8 * MiB <= peak.bytes <= 8 * MiB + 4096
    assert torch.equal(peak.result, torch.full((4,), float(2 * MiB)))


def _inductor_fn(x: torch.Tensor) -> torch.Tensor:
    a = x * 2.0
    b = x + 1.0
    return torch.cat([a, b])


@pytest.mark.inductor
def test_inductor_compiled_allocations_are_counted():
    compiled = torch.compile(_inductor_fn)
    x = torch.randn(FOUR_MIB_FP32)
    compiled(x)  # compile once, outside the measurement
    peak = measure_peak(compiled, x)
    # the 8 MiB output is allocated inside the compiled code; the intermediates may be fused
    assert 8 * MiB <= peak.bytes <= 16 * MiB + 64 * 1024
    assert torch.equal(peak.result, _inductor_fn(x))


# --------------------------------------------------------------------------- packer vs list


def _capture_k(collector, x, ws):
    for w in ws:
        collector.append(x + w)  # a fresh 1-capture temporary per append
    return collector


def test_list_vs_packer_micro():
    k = 4
    x = torch.randn(MiB // 4)  # 1 MiB captures
    ws = torch.arange(k, dtype=torch.float32)  # ws[i] is a view: no allocation

    def with_list():
        return torch.cat(list(_capture_k(AuxHiddenStateList(), x, ws)), dim=-1)

    def with_packer():
        return _capture_k(AuxHiddenStatePacker(k), x, ws).finalize()

    p_list = measure_peak(with_list)
    p_packer = measure_peak(with_packer)
    assert torch.equal(p_list.result, p_packer.result)
    assert p_list.bytes == 2 * k * MiB  # K captures + the cat output
    # the buffer and the temporary of the append in flight
    assert p_packer.bytes == k * MiB + MiB
    assert p_packer.bytes < p_list.bytes


def test_packer_peak_is_buffer_plus_one_capture():
    k = 4
    x = torch.randn(MiB // 4)
    ws = torch.arange(k, dtype=torch.float32)
    peak = measure_peak(lambda: _capture_k(AuxHiddenStatePacker(k), x, ws).finalize())
    assert peak.bytes == k * MiB + MiB


@pytest.fixture(scope="module")
def model_peaks():
    """Peak bytes of the DFlash capture-dominated model (K=8, T=2048) for none/list/packer, packed bytes, K."""
    peaks = {}
    packed_bytes = num_captures = None
    results = {}
    for mode in ("none", "list", "packer"):
        model, (ids, pos) = models.dflash.capture_dominated(capture_mode=mode, tokens=2048)
        with torch.no_grad():
            peak = measure_peak(model, ids, pos)
        peaks[mode] = peak.bytes
        results[mode] = peak.result
        if mode != "none":
            aux = peak.result[1]
            packed_bytes = aux.numel() * aux.element_size()
            num_captures = model.num_captures
    assert torch.equal(results["list"][1], results["packer"][1])
    assert torch.equal(results["list"][0], results["packer"][0])
    assert torch.equal(results["none"][0], results["packer"][0])
    assert results["none"][1] is None
    return peaks, packed_bytes, num_captures


def test_model_packer_overhead_bounded(model_peaks):
    peaks, packed_bytes, k = model_peaks
    one_capture = packed_bytes // k
    assert packed_bytes == 2048 * k * 256 * 4
    assert peaks["packer"] - peaks["none"] <= packed_bytes + one_capture, peaks


def test_model_list_peak_exceeds_packer(model_peaks):
    peaks, _, _ = model_peaks
    assert peaks["list"] > peaks["packer"], peaks


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_two_tensors_and_cat_peak_16_mib():
    device = torch.device("cuda")
    anchor = torch.empty(0, device=device)  # a CUDA tensor argument selects the CUDA path

    def fn(anchor):
        return _two_and_cat(anchor.device)

    measure_peak(fn, anchor)  # warm up the caching allocator and kernels
    peak = measure_peak(fn, anchor)
    assert peak.bytes == 16 * MiB
    assert peak.result.device.type == "cuda"
    assert torch.equal(peak.result.cpu(), _two_and_cat())


def test_measurements_print_only_what_the_measured_call_prints(capfd):
    """The profiler's start/stop lines (kineto's USDT probes) are dropped; anything else
    written to stderr, by the call or by the profiler, still reaches it."""
    import os

    def noisy():
        os.write(2, b"from the measured call\n")
        return torch.ones(4)

    measure_peak(noisy)
    err = capfd.readouterr().err
    assert "from the measured call" in err
    assert "profiler_start" not in err and "profiler_stop" not in err


def test_chatter_filter_keeps_other_lines(capfd):
    import os

    from compile_pass.memory import _profiler_chatter_dropped

    with _profiler_chatter_dropped():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:2026-12-03 13:00:17 1:1 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"a real warning\n")
        os.write(2, b"ERROR:2026-12-03 13:00:17 1:1 Other.cpp:9] gpuGetDeviceCount failed with code 35\n")
    err = capfd.readouterr().err
    assert err == ("a real warning\n"
                   "ERROR:2026-12-03 13:00:17 1:1 Other.cpp:9] gpuGetDeviceCount failed with code 35\n")
