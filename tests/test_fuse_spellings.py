"""``fuse_projection`` on the spellings real code writes for the draft's combine: the split of
the concat into per-capture chunks (split / chunk / tensor_split / split_with_sizes, explicit
slices, narrow, negative starts, positive or negative dims), the RMSNorm (``F.rms_norm``,
``torch.nn.RMSNorm``, HF's ``LlamaRMSNorm`` forward, vLLM's ``forward_native`` with its
casts written at each use) and ``fc`` (``nn.Linear``, ``F.linear``, ``x @ W.T + b``,
``torch.addmm``). Each is fused under the eager and aot_eager inners (torch IR and aten IR),
the draft's input bitwise the eager ``ProjectingAccumulator``'s and within rounding of the
cat-then-combine, the target's output bitwise the build without the option; a spelling
that cannot be fused (an ``unbind`` of a reshaped concat) is packed and the reason names
the node."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compile_pass import ProjectingAccumulator, aux_capture_backend
from tools.fuzz_combine import EPS, NORMS, splits_for

H, HD, K, CAPTURE = 64, 48, 3, (1, 3, 5)


SPLITS = splits_for(K, H)  # the fuzzer's spellings (tools/fuzz_combine.py), every one here
FCS = {
    "nn.Linear": lambda m, x: m.fc(x),
    "F.linear": lambda m, x: F.linear(x, m.fc.weight, m.fc.bias),
    "x @ W.T + b": lambda m, x: x @ m.fc.weight.T + m.fc.bias,
    "addmm(b, x, W.t())": lambda m, x: torch.addmm(m.fc.bias, x, m.fc.weight.t()),
}


class Target(nn.Module):
    """A residual decoder capturing ``hidden + residual``, the draft's combine at the end."""

    def __init__(self, combine, split=None, norm="F.rms_norm", fc="nn.Linear"):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(6))
        self.fc = nn.Linear(K * H, HD)
        self.whole = nn.RMSNorm(K * H, eps=EPS)
        with torch.no_grad():
            self.whole.weight.copy_(1 + 0.1 * torch.randn(K * H))
        self.chunks = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(H)) for _ in range(K))
        self.combine, self.split, self.norm, self.fc_spelling = combine, split, norm, fc

    def forward(self, x):
        hidden, residual, aux = x, torch.zeros_like(x), []
        for i, layer in enumerate(self.layers):
            if i in CAPTURE:
                aux.append(hidden + residual)
            residual = hidden + residual
            hidden = torch.tanh(layer(residual))
        packed = torch.cat(aux, -1)
        if self.combine == "fc_norms":
            packed = torch.cat([NORMS[self.norm](c, w) for c, w in zip(SPLITS[self.split](packed), self.chunks)], -1)
        elif self.combine == "norm_before_fc":
            packed = self.whole(packed) if self.norm == "nn.RMSNorm" else NORMS[self.norm](packed, self.whole.weight)
        return hidden, FCS[self.fc_spelling](self, packed)

    def accumulator(self):
        norms = {"norm_before_fc": {"norm_before_fc": self.whole.weight},
                 "fc_norms": {"fc_norms": list(self.chunks)}}.get(self.combine, {})
        return ProjectingAccumulator(K, self.fc.weight, fc_bias=self.fc.bias, eps=EPS, **norms)

    def eager_projection(self, x):
        hidden, residual, acc = x, torch.zeros_like(x), self.accumulator()
        for i, layer in enumerate(self.layers):
            if i in CAPTURE:
                acc.append(hidden + residual)
            residual = hidden + residual
            hidden = torch.tanh(layer(residual))
        return acc.finalize()


def _compiled(model, inner, fuse, x, dynamic=None):
    torch._dynamo.reset()
    backend = aux_capture_backend(inner, fuse_projection=fuse)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=dynamic)(x)
    groups = [g for r in backend.results for g in r.groups if g.k == K]  # the captures' first (fc_norms: the
    assert groups                                                         # normed chunks' concat after it)
    return out, groups[0]


CASES = ([("fc_norms", s, "F.rms_norm", "nn.Linear") for s in SPLITS]
         + [(c, "split(H, dim=-1)", n, "nn.Linear") for n in NORMS for c in ("fc_norms", "norm_before_fc")]
         + [("norm_before_fc", None, "nn.RMSNorm", "nn.Linear")]
         + [(c, "split(H, dim=-1)", "F.rms_norm", f) for f in FCS for c in ("plain", "norm_before_fc")])


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("combine,split,norm,fc", CASES, ids=[" / ".join(map(str, c)) for c in CASES])
def test_every_spelling_is_fused_bitwise_to_the_eager_accumulator(inner, combine, split, norm, fc):
    model = Target(combine, split, norm, fc).eval()
    x = torch.randn(256, H)
    with torch.no_grad():
        ref_hidden, ref_draft = model(x)
        eager_projected = model.eager_projection(x)
    (hidden, draft), group = _compiled(model, inner, True, x)
    assert group.fused, group.projection or group.reason
    assert torch.equal(draft, eager_projected)
    torch.testing.assert_close(draft, ref_draft, rtol=1e-5, atol=1e-5)
    (plain_hidden, _), _ = _compiled(model, inner, False, x)
    assert torch.equal(hidden, plain_hidden)
    assert torch.equal(hidden, ref_hidden)  # eager and aot_eager run ATen's kernels, as the module


@pytest.mark.parametrize("split", list(SPLITS))
def test_every_split_is_fused_with_a_symbolic_token_count(split):
    """aten IR with a symbolic token count keeps what a static one drops: ``p[:, a:b]`` and
    ``view(-1, K, H)[:, i]`` are ``slice(p, 0, 0, max)`` (all of dim 0) before the last-dim
    slice or the row ``select`` (the fuzzer's seeds 580 and 40 were packed for it)."""
    model = Target("fc_norms", split, "F.rms_norm", "nn.Linear").eval()
    x = torch.randn(96, H)
    with torch.no_grad():
        eager_projected = model.eager_projection(x)
    (hidden, draft), group = _compiled(model, "aot_eager", True, x, dynamic=True)
    assert group.fused, group.projection or group.reason
    assert torch.equal(draft, eager_projected)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("combine", ["fc_norms", "norm_before_fc"])
@pytest.mark.parametrize("kernel", ["cp_fuzz_combine::fused_rms_norm", "cp_fuzz_combine::rms_norm_out"])
def test_an_engines_fused_norm_kernel_is_packed_and_the_reason_names_the_op(inner, combine, kernel):
    """A fused RMSNorm custom op (functional, or writing an ``out=`` tensor as vLLM's
    ``_C.rms_norm``) has no arithmetic in the graph: refused, its name in the reason."""
    model = Target(combine, "split(H, dim=-1)").eval()
    op = getattr(torch.ops.cp_fuzz_combine, kernel.split("::")[1])
    norm = (lambda c, w: op(c, w, EPS)) if kernel.endswith("fused_rms_norm") else None

    def out_norm(c, w):
        out = torch.empty_like(c)
        op(out, c, w, EPS)
        return out
    NORMS["kernel"] = norm or out_norm
    try:
        model.norm = "kernel"
        x = torch.randn(64, H)
        with torch.no_grad():
            ref_hidden, ref_draft = model(x)
        (hidden, draft), group = _compiled(model, inner, True, x)
    finally:
        del NORMS["kernel"]
    assert not group.fused
    assert kernel in group.projection and "opaque" in group.projection, group.projection
    assert torch.equal(hidden, ref_hidden) and torch.equal(draft, ref_draft)
