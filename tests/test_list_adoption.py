"""compile_pass.integrations.list_adoption on decoders that build their capture list inside
``forward`` (the style of SGLang 0.5.23's plain-list models), no engine imported: the pack is
a view of one buffer, values equal the list path bitwise, the transient spike is gone, and
anything that does not fit leaves the result as the list path's."""

import pytest
import torch
import torch.nn as nn

from compile_pass.integrations.list_adoption import adopting, complete, install
from compile_pass.memory import measure_peak
from compile_pass.packer import pack_aux_hidden_states

H, T = 64, 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, h):
        return h + torch.tanh(self.proj(h))


class PlainListDecoder(nn.Module):
    """``style``: where the model appends (before the layer call, after it, a sum, the
    last capture after the loop, layers called through ``.forward``: no boundary seen)."""

    def __init__(self, layers=8, capture=(1, 3, 5, 7), style="before"):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(H)
        self.layers_to_capture = list(capture)
        self.style = style

    def forward(self, h):
        aux_hidden_states = []
        residual = torch.zeros_like(h)
        for i, layer in enumerate(self.layers):
            if self.style == "before" and i in self.layers_to_capture:
                aux_hidden_states.append(h)
            if self.style == "sum" and i in self.layers_to_capture:
                aux_hidden_states.append(h + residual)
            h = layer.forward(h) if self.style == "dot_forward" else layer(h)
            residual = residual + 0.5 * h
            if self.style in ("after", "dot_forward") and i in self.layers_to_capture:
                aux_hidden_states.append(h)
        if len(self.layers) in self.layers_to_capture:
            aux_hidden_states.append(h)
        return self.norm(h), aux_hidden_states


def _serve(model, x, adopt):
    """The engine's side: one capturing forward, then the logits processor's pack."""
    if not adopt:
        h, aux = model(x)
        return h, pack_aux_hidden_states(aux)
    with adopting(model, len(model.layers_to_capture)) as state:
        h, aux = model(x)
        complete(aux)
        packed = pack_aux_hidden_states(aux)
    _serve.state = state
    return h, packed


def _overhead(model, x, adopt):
    """(peak with captures - peak without) / packed bytes, and the capturing run's result."""
    saved, model.layers_to_capture = model.layers_to_capture, []
    base = measure_peak(model, x).bytes
    model.layers_to_capture = saved
    peak = measure_peak(_serve, model, x, adopt)
    k = len(saved)
    return (peak.bytes - base) / (T * H * k * 4), peak.result


@pytest.fixture(scope="module")
def x():
    torch.manual_seed(0)
    return torch.randn(T, H)


@pytest.mark.parametrize("style", ["before", "after", "sum"])
@torch.no_grad()
def test_adopted_list_packs_into_one_buffer_bitwise(style, x):
    torch.manual_seed(1)
    capture = range(8) if style == "after" else range(1, 9)  # K=8, one after the loop
    model = PlainListDecoder(capture=capture, style=style)
    install(model)
    off, (h_ref, packed_ref) = _overhead(model, x, adopt=False)
    on, (h, packed) = _overhead(model, x, adopt=True)
    state = _serve.state
    assert state.reason is None and state.moved == 8 and state.boundaries > 0
    assert state.moves > 1 and not state.moved_all_at_once
    assert packed.data_ptr() == state.buffer.data_ptr() and packed.shape == (T, 8 * H)
    assert torch.equal(packed, packed_ref) and torch.equal(h, h_ref)
    assert off >= 1.5, off  # the list path: K captures and the cat alive together
    assert on <= 1.05, on


@torch.no_grad()
def test_capture_after_the_loop_is_moved_at_the_final_norm(x):
    model = PlainListDecoder(capture=(2, 5, 8))  # 8: the output of the last layer
    install(model)
    _, ref = _serve(model, x, adopt=False)
    _, packed = _serve(model, x, adopt=True)
    state = _serve.state
    assert state.moved == 3 and state.reason is None
    assert torch.equal(packed, ref) and packed.data_ptr() == state.buffer.data_ptr()


@torch.no_grad()
def test_layers_called_through_dot_forward_are_seen_only_at_the_final_norm(x):
    model = PlainListDecoder(style="dot_forward")
    install(model)
    _, ref = _serve(model, x, adopt=False)
    _, packed = _serve(model, x, adopt=True)
    assert _serve.state.boundaries == 1 and _serve.state.moved == 4  # all four, at the norm
    assert _serve.state.moves == 1 and _serve.state.moved_all_at_once
    assert torch.equal(packed, ref)


class TwoLists(PlainListDecoder):
    def forward(self, h):
        aux_hidden_states, norms = [], []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux_hidden_states.append(h)
                norms.append(h.norm(dim=-1, keepdim=True))
            h = layer(h)
        return self.norm(h), aux_hidden_states


class WrongShape(PlainListDecoder):
    def forward(self, h):
        aux_hidden_states = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux_hidden_states.append(h if i != 5 else h[:, : H // 2])
            h = layer(h)
        return self.norm(h), aux_hidden_states


class TooMany(PlainListDecoder):
    def forward(self, h):
        aux_hidden_states = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture or i == 6:
                aux_hidden_states.append(h)
            h = layer(h)
        return self.norm(h), aux_hidden_states


@pytest.mark.parametrize("cls,why", [(TwoLists, "ambiguous"), (WrongShape, "does not fit"),
                                     (TooMany, "more than K=4")])
@torch.no_grad()
def test_what_does_not_fit_stops_adoption_and_keeps_the_list_result(cls, why, x):
    model = cls()
    install(model)
    _, ref = _serve(model, x, adopt=False)
    _, packed = _serve(model, x, adopt=True)
    assert why in _serve.state.reason
    assert torch.equal(packed, ref)


class InPlaceBlock(Block):
    """Scales its input in place before using it (as a fused in-place norm does)."""

    def forward(self, h):
        h.mul_(0.5)
        return h + torch.tanh(self.proj(h))


class MutatesAfterAppend(PlainListDecoder):
    """Appends ``h``, which the next layer's call then scales in place: a clone on append
    (the packer's contract) keeps the value at the append; the bare list would not."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(InPlaceBlock() for _ in range(len(self.layers)))

    def forward(self, h):
        aux_hidden_states = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux_hidden_states.append(h)
            h = layer(h)
        return self.norm(h), aux_hidden_states


@torch.no_grad()
def test_an_entry_is_captured_as_it_was_at_the_boundary(x):
    model = MutatesAfterAppend()
    install(model)
    clones = []
    hooks = [model.layers[i].register_forward_pre_hook(lambda m, a: clones.append(a[0].clone()))
             for i in model.layers_to_capture]
    _, packed = _serve(model, x.clone(), adopt=True)
    for hk in hooks:
        hk.remove()
    assert torch.equal(packed, torch.cat(clones, dim=-1))
    _, bare = _serve(model, x.clone(), adopt=False)
    assert not torch.equal(bare, packed), "the bare list should see the in-place scaling"


@torch.no_grad()
def test_a_failing_hook_stops_adoption_and_never_breaks_the_forward(x, monkeypatch):
    from compile_pass.integrations import list_adoption

    model = PlainListDecoder()
    install(model)
    ref_h, ref = _serve(model, x, adopt=False)

    def boom(state):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(list_adoption, "_move_new_entries", boom)
    h, packed = _serve(model, x, adopt=True)
    assert "failed" in _serve.state.reason and "simulated" in _serve.state.reason
    assert torch.equal(h, ref_h) and torch.equal(packed, ref)


def test_hooks_do_nothing_without_an_adoption_and_install_is_idempotent(x):
    model = PlainListDecoder()
    n = install(model)
    assert n == len(model.layers) + 1 and install(model) == n
    with torch.no_grad():
        _, aux = model(x)
    assert all(t._base is None for t in aux)  # untouched: the model's own tensors


def test_an_entry_that_needs_grad_is_left_alone(x):
    model = PlainListDecoder()
    install(model)
    with adopting(model, 4) as state:
        _, aux = model(x.requires_grad_(False))
        complete(aux)
    assert "requires grad" in state.reason
    pack_aux_hidden_states(aux).sum().backward()  # the graph is intact
    assert model.layers[0].proj.weight.grad is not None


class NoFinalNorm(PlainListDecoder):
    """Appends after each layer call and returns without a final module call: its last
    capture has no boundary after it, only the pack."""

    def forward(self, h):
        aux_hidden_states = []
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i in self.layers_to_capture:
                aux_hidden_states.append(h)
        return h, aux_hidden_states


@torch.no_grad()
def test_the_pack_moves_what_no_boundary_saw_also_through_a_copy_of_the_list(x):
    model = NoFinalNorm(capture=(2, 5, 7))
    install(model)
    _, ref = _serve(model, x, adopt=False)
    with adopting(model, 3) as state:
        _, aux = model(x)
        assert state.moved == 2  # capture 2 (after layer 7) came after the last boundary
        assert complete([t.clone() for t in aux]) is None  # other tensors: not the adopted list
        pruned = [t for t in aux]  # SGLang's logits processor copies the list this way
        assert complete(pruned) is state and state.moved == 3
        packed = pack_aux_hidden_states(pruned)
    assert packed.data_ptr() == state.buffer.data_ptr() and torch.equal(packed, ref)
