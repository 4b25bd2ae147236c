"""FULL CUDA-graph mode with the vLLM plugin's one static aux buffer, without vLLM.

``make gpu-check`` runs the ``gpu`` test here (``pytest -m gpu tests``: torch only, no vLLM on
that machine); the CPU test runs the same bookkeeping everywhere (``make test``, ``make vllm``).
``_Manager`` copies what vllm 0.33.0's ``ModelCudaGraphManager`` does with the aux hidden
states (``v1/worker/gpu/cudagraph_utils.py``): ``capture()`` runs the model at the largest
size, allocates ``self.aux_hidden_states = [torch.empty_like(x) for x in aux]`` on the first
capture and copies ``self.aux_hidden_states[i][:n] = aux`` inside the graph;
``run_fullgraph()`` replays and returns ``[x[:n] for x in self.aux_hidden_states]``; the
speculator then runs ``torch.cat(aux, -1)``. With the plugin, vLLM's class gets the plugin's
``_PackedAuxBuffers`` descriptor for ``aux_hidden_states`` (K column views of one
``[max_tokens, K*H]`` buffer) and the speculator's ``torch`` is ``_ViewCatTorch``: here the
same two objects are put on a class of our own.
"""

from typing import List, Optional

import pytest
import torch

from compile_pass.integrations import vllm as plugin

HAS_CUDA = torch.cuda.is_available()
H, K, MAX_TOKENS = 64, 4, 256


class _Model(torch.nn.Module):
    """K captures of ``hidden + residual`` returned as a list (vLLM's models)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(H, H) / H ** 0.5) for _ in range(K + 1))

    def forward(self, x: torch.Tensor):
        h, r = x @ self.w[0], torch.zeros_like(x)
        aux = []
        for w in self.w[1:]:
            aux.append(h + r)
            r = r + h
            h = torch.tanh(r @ w)
        return h, aux


class _Manager:
    """ModelCudaGraphManager's aux bookkeeping (FULL mode, last pipeline rank)."""

    def __init__(self) -> None:
        self.hidden_states: Optional[torch.Tensor] = None
        self.aux_hidden_states: List[torch.Tensor] = []
        self.graph = None

    def _body(self, model, x, num_tokens):
        hidden_states, aux_hidden_states = model(x)
        if self.hidden_states is None:
            self.hidden_states = torch.empty_like(hidden_states)
        self.hidden_states[:num_tokens] = hidden_states
        if not self.aux_hidden_states:
            self.aux_hidden_states = [torch.empty_like(x) for x in aux_hidden_states]
        for i, aux in enumerate(aux_hidden_states):
            self.aux_hidden_states[i][:num_tokens] = aux

    def capture(self, model, x, num_tokens, cuda_graph: bool) -> None:
        if not cuda_graph:
            self._body(model, x, num_tokens)
            return
        self._body(model, x, num_tokens)  # warm-up, as vLLM runs before capturing
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body(model, x, num_tokens)

    def run_fullgraph(self, model, x, num_tokens):
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body(model, x, MAX_TOKENS)
        return self.hidden_states[:num_tokens], [x[:num_tokens] for x in self.aux_hidden_states]


class _PluginManager(_Manager):
    aux_hidden_states = plugin._PackedAuxBuffers()


def _run(device: str, on: bool, n: int):
    """(packed captures at n tokens, reference, bytes the concat allocated, static aux bytes,
    the manager)."""
    cuda_graph = device == "cuda"
    model = _Model().to(device)
    x = torch.zeros(MAX_TOKENS, H, device=device)  # the static input buffer
    torch.manual_seed(1)
    x.copy_(torch.randn(MAX_TOKENS, H))
    mgr = (_PluginManager if on else _Manager)()
    cat = plugin._ViewCatTorch(torch).cat if on else torch.cat  # the speculator's torch.cat
    with torch.no_grad():
        mgr.capture(model, x, MAX_TOKENS, cuda_graph)
        torch.manual_seed(2)
        x.copy_(torch.randn(MAX_TOKENS, H))  # the next batch's inputs, in place
        ref = torch.cat(model(x)[1], -1)[:n]  # at the captured size: the graph's shapes
        if cuda_graph:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        _, aux = mgr.run_fullgraph(model, x, n)
        packed = cat(aux, dim=-1)
        if cuda_graph:
            torch.cuda.synchronize()
            cat_bytes = torch.cuda.max_memory_allocated() - before
        else:
            cat_bytes = 0 if packed.data_ptr() == aux[0].data_ptr() else packed.numel() * packed.element_size()
    static = sum(t.untyped_storage().nbytes() for t in {id(a.untyped_storage()): a for a in
                                                        mgr.aux_hidden_states}.values())
    return packed, ref, cat_bytes, static, mgr


def _check(device: str) -> None:
    n = 100
    off, ref_off, cat_off, static_off, _ = _run(device, False, n)
    on, ref_on, cat_on, static_on, mgr = _run(device, True, n)
    assert torch.equal(off, ref_off) and torch.equal(on, ref_on) and torch.equal(on, off)
    # one [MAX_TOKENS, K*H] buffer: as many static bytes as vLLM's K buffers
    assert static_on == static_off == MAX_TOKENS * K * H * 4
    assert mgr.packed_aux_buffer.shape == (MAX_TOKENS, K * H)
    assert on.data_ptr() == mgr.packed_aux_buffer.data_ptr()  # the concat is a view
    # the concat after replay: [n, K*H] allocated without the plugin, nothing with it
    assert cat_off >= n * K * H * 4 and cat_on == 0, (cat_off, cat_on)


def test_full_graph_bookkeeping_one_static_buffer_cpu():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_full_cudagraph_one_static_buffer():
    """A real CUDA graph captured at the largest size and replayed at fewer tokens: the
    captures are copied into K column views of one static buffer inside the graph, the
    concat after replay is that buffer's view (no allocation), bitwise the list path's."""
    _check("cuda")


# ------------------------------------------------- the draft's input projected (COMPILE_PASS_VLLM_PROJECT)
H_DRAFT = 48


class _Draft(torch.nn.Module):
    """A draft's input side as vLLM's Eagle3 holds it: ``model.fc``, ``model.input_norm``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.model = torch.nn.Module()
        self.model.norm_before_fc = True
        self.model.input_norm = _RMSNorm(K * H).to(device)
        self.model.fc = torch.nn.Linear(K * H, H_DRAFT, bias=False).to(device)

    def combine_hidden_states(self, hidden_states):
        return self.model.fc(self.model.input_norm(hidden_states))


class _RMSNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        from compile_pass.projection import rms_norm

        return rms_norm(x, self.weight, self.variance_epsilon)


def _check_projected(device: str) -> None:
    """The target compiled with ``project_outputs`` (what the plugin's rewrite before vLLM's
    split does) under the FULL-graph bookkeeping: vLLM's ``persistent_like`` of each output
    is one ``[MAX_TOKENS, H_draft]`` buffer (and zero-byte stand-ins), the speculator's
    concat after replay is that buffer's view, equal bit for bit to the eager accumulator
    over the list path's captures, and the draft's combine passes it on."""
    from compile_pass import ProjectingAccumulator
    from compile_pass.backend import aux_capture_backend
    from compile_pass.integrations import vllm_projection

    cuda_graph, n = device == "cuda", 100
    draft = _Draft(device)
    name = vllm_projection.register_draft(draft)  # outside any engine: named by its registration
    assert name
    try:
        model = _Model().to(device)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aux_capture_backend(
            "eager", project_outputs=name), dynamic=False)
        x = torch.zeros(MAX_TOKENS, H, device=device)
        torch.manual_seed(1)
        x.copy_(torch.randn(MAX_TOKENS, H))
        mgr = _PluginManager()
        with torch.no_grad():
            mgr.capture(compiled, x, MAX_TOKENS, cuda_graph)
            torch.manual_seed(2)
            x.copy_(torch.randn(MAX_TOKENS, H))
            acc = ProjectingAccumulator.for_draft(K, draft.model.fc, norm_before_fc=draft.model.input_norm)
            acc.extend(model(x)[1])
            ref = acc.finalize()[:n]
            if cuda_graph:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            _, aux = mgr.run_fullgraph(compiled, x, n)
            drafted = plugin._ViewCatTorch(torch).cat(aux, dim=-1)
            if cuda_graph:
                torch.cuda.synchronize()
                assert torch.cuda.max_memory_allocated() - before == 0
        static = sum(t.untyped_storage().nbytes() for t in mgr.aux_hidden_states)
        assert static == MAX_TOKENS * H_DRAFT * 4  # where vLLM keeps K [MAX_TOKENS, H]: MAX_TOKENS * K * H * 4
        assert [tuple(t.shape) for t in mgr.aux_hidden_states] == [(MAX_TOKENS, H_DRAFT)] + [(MAX_TOKENS, 0)] * (K - 1)
        assert drafted.data_ptr() == mgr.aux_hidden_states[0].data_ptr() and torch.equal(drafted, ref)
    finally:
        vllm_projection.clear()
        torch._dynamo.reset()


def test_full_graph_bookkeeping_projected_cpu():
    _check_projected("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_full_cudagraph_projected_one_h_draft_buffer():
    """A real CUDA graph: the projection ops captured in it, one ``[max, H_draft]`` static
    buffer, the concat after replay a view of it (0 bytes), bitwise the eager accumulator."""
    _check_projected("cuda")
