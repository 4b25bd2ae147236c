"""``draft_layout.plain_fc``: the one rule both engine plugins apply to a draft's ``fc``
before projecting into it (the same widths ``fuse_projection`` takes in a graph), and what
it refuses as not verified, each with the reason."""

import pytest
import torch
from torch import nn

from compile_pass.integrations.draft_layout import plain_fc

K, H = 3, 64


def _fc(out_features: int, **attrs) -> nn.Linear:
    fc = nn.Linear(K * H, out_features)
    for name, value in attrs.items():
        setattr(fc, name, value)
    return fc


def test_a_narrower_plain_fc_is_taken():
    fc = _fc(48)
    weight, bias, why = plain_fc(fc)
    assert why == "" and weight is fc.weight and bias is fc.bias


@pytest.mark.parametrize("out_features, reason", [(K * H, "fc is square"), (K * H + 8, "no narrower than the concat")])
def test_an_fc_no_narrower_than_the_concat_is_refused(out_features, reason):
    """The same rule as ``fuse_projection``: ``H_draft >= K*H`` saves nothing (before, the
    plugins took ``H_draft > K*H``, which ``fuse_projection`` refuses)."""
    weight, _, why = plain_fc(_fc(out_features))
    assert weight is None and reason in why


class LoRAWrapped(nn.Module):
    """vLLM's and SGLang's LoRA layers keep the wrapped linear as ``base_layer``."""

    def __init__(self):
        super().__init__()
        self.base_layer = _fc(48)
        self.weight = self.base_layer.weight


@pytest.mark.parametrize("fc, reason", [
    (LoRAWrapped(), "wrapped for LoRA"),
    (_fc(48, skip_bias_add=True), "skip_bias_add"),
    (_fc(48, output_size=48, input_size=K * H + 1), "re-laid after loading"),
    (_fc(48, output_size=96, tp_size=2, gather_output=False), "column-parallel"),
    (_fc(48, weight=nn.Parameter(torch.zeros(48, K * H, dtype=torch.int8), requires_grad=False)), "quantized"),
])
def test_what_is_not_verified_is_refused_with_the_reason(fc, reason):
    weight, bias, why = plain_fc(fc)
    assert weight is None and bias is None and reason in why, why


def test_an_engine_linear_that_declares_its_shape_is_taken():
    weight, _, why = plain_fc(_fc(48, output_size=48, input_size=K * H, skip_bias_add=False))
    assert why == "" and weight.shape == (48, K * H)
