"""The logits store hook of SGLang's plain-list layout (``sglang_compile._store_hook``), on a
stand-in with the signature of sglang 0.5.14's ``LogitsProcessor._get_hidden_states_to_store``
(no SGLang needed): adjacent slices of one buffer come back as its view, anything else goes to
SGLang's own concat with no second concat alive beside it."""

from types import SimpleNamespace

import torch

from compile_pass.integrations import sglang_compile
from compile_pass.memory import measure_peak

T, H, K = 512, 64, 4


def sglang_store(self, hidden_states, logits_metadata, aux_hidden_states=None,
                 hidden_states_before_norm=None):
    """SGLang's FULL branch: the captures concatenated along the last dim."""
    return torch.cat(aux_hidden_states, dim=-1)


def _metadata():
    mode = SimpleNamespace(need_capture=lambda: True, is_full=lambda: True)
    return SimpleNamespace(capture_hidden_mode=mode)


def test_adjacent_slices_come_back_as_the_buffers_view():
    buf = torch.randn(T, K * H)
    aux = [buf[:, i * H:(i + 1) * H] for i in range(K)]
    meta, hidden = _metadata(), torch.randn(T, H)
    before = sglang_compile.STATE["packed"]
    peak = measure_peak(lambda: sglang_compile._store_hook(sglang_store, None, hidden, meta,
                                                           aux_hidden_states=aux))
    assert peak.result.data_ptr() == buf.data_ptr() and torch.equal(peak.result, buf)
    assert sglang_compile.STATE["packed"] == before + 1
    assert peak.bytes < T * H * 4  # nothing of the packed size allocated


def test_separate_captures_get_one_concat_only():
    """Not one buffer's slices: SGLang's own concat, and nothing else of that size alive
    (the hook once built its own concat first and kept it while SGLang built a second)."""
    aux = [torch.randn(T, H) for _ in range(K)]
    meta, hidden = _metadata(), torch.randn(T, H)
    before = sglang_compile.STATE["packed"]
    peak = measure_peak(lambda: sglang_compile._store_hook(sglang_store, None, hidden, meta,
                                                           aux_hidden_states=aux))
    packed_bytes = T * K * H * 4
    assert torch.equal(peak.result, torch.cat(aux, -1))
    assert packed_bytes <= peak.bytes < 1.5 * packed_bytes, peak.bytes / packed_bytes
    assert sglang_compile.STATE["packed"] == before
