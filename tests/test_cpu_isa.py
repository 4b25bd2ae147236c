"""Which CPU vector ISA the suite's kernels ran on: ATen's dispatch and Inductor's generated C++
both follow ``ATEN_CPU_CAPABILITY`` (``make test-isa`` sets ``avx2``; unset, both take the
CPU's best). A run under another ISA that silently kept the native one would test nothing new,
so this checks both sides pick what the variable names."""

import os

import pytest
import torch

pytestmark = pytest.mark.inductor

from torch._inductor import cpu_vec_isa  # noqa: E402

_ISA_FLAGS = {"avx2": "-mavx2", "avx512": "-mavx512f"}


def _requested() -> str:
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()


def test_aten_and_inductor_follow_aten_cpu_capability():
    requested = _requested()
    valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    picked = cpu_vec_isa.pick_vec_isa()
    if not requested:
        assert str(picked) == (valid[0] if valid else str(picked)), (picked, valid)
        return
    if requested not in _ISA_FLAGS:
        pytest.skip(f"ATEN_CPU_CAPABILITY={requested}: no vector ISA of Inductor's to check")
    if not any(requested in isa for isa in valid):
        pytest.skip(f"this CPU has no {requested} (Inductor's valid ISAs here: {valid})")
    assert torch.backends.cpu.get_cpu_capability().lower() == requested
    assert requested in str(picked), f"ATEN_CPU_CAPABILITY={requested} but Inductor picked {picked}"
    flags = picked.build_arch_flags()
    assert _ISA_FLAGS[requested] in flags, flags
    if requested == "avx2":
        assert "-mavx512" not in flags, flags


def test_inductor_vectorizes_on_the_picked_isa():
    """The generated kernel is vectorized (``at::vec::Vectorized``), to be built with the
    picked ISA's flags (the first test checks those)."""
    from torch._inductor.utils import run_and_get_code

    picked = cpu_vec_isa.pick_vec_isa()
    if not picked:
        pytest.skip(f"no vector ISA picked ({picked})")
    torch._dynamo.reset()
    x = torch.linspace(-1, 1, 1024)
    out, code = run_and_get_code(torch.compile(lambda t: torch.tanh(t * 2 + 1), backend="inductor"), x)
    assert out.shape == x.shape
    src = "\n".join(code)
    assert "at::vec::Vectorized<float>" in src, src[:2000]
