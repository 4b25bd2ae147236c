"""How far Inductor's compiled ``torch.tanh`` is from eager ATen's on this CPU, under the vector
ISA ``ATEN_CPU_CAPABILITY`` selects (unset: the CPU's best; avx2; avx512; default: scalar):

    for isa in "" avx2 default; do env ${isa:+ATEN_CPU_CAPABILITY=$isa} \\
        TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/isa_tanh_ulp.py; done

One line each: the ISA ATen and Inductor picked and the largest difference. Nonzero means an
Inductor-vs-eager bitwise comparison of a transcendental fails on this CPU.
"""

import os

import torch
from torch._inductor import cpu_vec_isa

x = torch.linspace(-1, 1, 320) * 2 + 1
compiled = torch.compile(torch.tanh, backend="inductor")(x)
diff = (compiled - torch.tanh(x)).abs().max().item()
print(f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')} "
      f"aten={torch.backends.cpu.get_cpu_capability()} inductor={cpu_vec_isa.pick_vec_isa()} "
      f"max|compiled - eager| tanh = {diff:.3g}")
