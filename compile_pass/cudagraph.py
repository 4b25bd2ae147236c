"""CUDA-graph runner: one graph per token count, one memory pool, one static packed buffer.

Serving engines run decode (and small batches) through CUDA graphs captured at a fixed list
of token counts. A batch of ``T`` real tokens is padded up to the next captured count
``P >= T``: the real inputs are copied into the first ``T`` rows of static input buffers,
the ``P``-token graph is replayed, and the outputs are sliced back to ``T`` rows. The aux
hidden states go into **one** static packed buffer ``[max_tokens, K * hidden]`` that every
size's graph writes a prefix of (``buf[:P]``), so the draft model finds them at one address
whatever the batch size, and no size allocates its own packed output.

:class:`CudaGraphRunner` does exactly that. Invariants, for every call ``runner(*inputs)``
with ``T = inputs[0].shape[0]`` real tokens and ``P = runner.padded_size(T)``:

- each input has one static buffer ``[max_tokens, *trailing]`` shared by all sizes; rows
  ``[:T]`` hold this call's inputs and rows ``[T:P]`` hold the input's pad value;
- the function runs (or its ``P``-token graph replays) on the ``[:P]`` views of those
  buffers, with ``out_kwarg=packed_buffer`` (the whole max-size buffer); it must write its
  packed captures into ``packed_buffer[:P]`` and return that view;
- every tensor output is token-major (leading dim ``P``) and is returned sliced to ``[:T]``:
  views of static memory, **valid until the next call of the runner (any size)**;
- a token count above the largest captured one, or an input of the wrong dtype, device
  or trailing shape, raises ValueError before anything runs.

Padding is only sound for functions whose first ``T`` output rows do not depend on rows
after them (causal decoders, per-token layers); ``tests/test_cudagraph.py`` checks that for
the reference models by changing the padded rows' contents.

``use_cuda_graphs=False`` (the default off CUDA) keeps the same static buffers, padding and
slicing but calls the function directly instead of replaying a graph: the bookkeeping is
tested on CPU, and the graph mode differs only in :func:`capture_cuda_graph`.

The pieces are separate so a piecewise runner (one graph per piece and size, sharing the
pool) can reuse them: :func:`check_token_counts` / :func:`padded_token_count` (size
buckets), :class:`StaticInputs` (static buffers, copy-in and padding),
:func:`capture_cuda_graph` (warm-up on a side stream, capture into a shared pool) and
:func:`map_tensors` (slicing outputs).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "CapturedGraph",
    "CudaGraphRunner",
    "StaticInputs",
    "capture_cuda_graph",
    "check_token_counts",
    "map_tensors",
    "padded_token_count",
]

log = logging.getLogger("compile_pass")

PadValue = Union[int, float, bool]


# --------------------------------------------------------------------------- sizes


def check_token_counts(token_counts: Sequence[int]) -> Tuple[int, ...]:
    """The captured token counts, validated (ints >= 1, no duplicates), ascending."""
    if isinstance(token_counts, (str, bytes)) or not isinstance(token_counts, Sequence):
        raise TypeError(f"token_counts must be a sequence of ints, got {type(token_counts).__name__}")
    if len(token_counts) == 0:
        raise ValueError("token_counts must not be empty")
    for t in token_counts:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token counts must be ints, got {t!r} ({type(t).__name__})")
        if t < 1:
            raise ValueError(f"token counts must be >= 1, got {t}")
    if len(set(token_counts)) != len(token_counts):
        raise ValueError(f"token_counts has duplicates: {list(token_counts)}")
    return tuple(sorted(token_counts))


def padded_token_count(token_counts: Sequence[int], tokens: int) -> int:
    """The smallest captured count ``>= tokens``; ValueError if ``tokens`` is below 1 or
    above the largest captured count. ``token_counts`` must be ascending (as
    :func:`check_token_counts` returns them)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    if tokens < 1:
        raise ValueError(f"a batch needs at least 1 token, got {tokens}")
    for t in token_counts:
        if t >= tokens:
            return t
    raise ValueError(
        f"{tokens} tokens is more than the largest captured token count {token_counts[-1]} "
        f"(captured: {list(token_counts)})"
    )


# --------------------------------------------------------------------------- static inputs


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


class StaticInputs:
    """One static ``[max_tokens, *trailing]`` buffer per input, shared by every token count.

    Built from example inputs (only their dtype, device and trailing shape are used; dim 0
    is the token dim). :meth:`load` copies real inputs into rows ``[:T]`` and fills the
    rows ``[T:padded]`` with each input's pad value; :meth:`views` gives the ``[:P]``
    prefixes a function or graph runs on. The buffers never move, so a graph captured on
    ``views(P)`` reads whatever :meth:`load` last wrote.
    """

    def __init__(self, example_inputs: Sequence[torch.Tensor], max_tokens: int,
                 pad_values: Union[PadValue, Sequence[PadValue]] = 0) -> None:
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, Sequence):
            raise TypeError("example_inputs must be a sequence of tensors (one per function input)")
        if len(example_inputs) == 0:
            raise ValueError("example_inputs must not be empty: the runner needs at least one token-major input")
        for i, t in enumerate(example_inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"example input {i} is a {type(t).__name__}, not a tensor")
            if t.dim() < 1:
                raise ValueError(f"example input {i} is 0-d; inputs must be token-major (dim 0 = tokens)")
        devices = {t.device for t in example_inputs}
        if len(devices) != 1:
            raise ValueError(f"example inputs are on several devices: {sorted(str(d) for d in devices)}")
        if isinstance(pad_values, (int, float, bool)):
            pads: List[PadValue] = [pad_values] * len(example_inputs)
        else:
            pads = list(pad_values)
            if len(pads) != len(example_inputs):
                raise ValueError(f"{len(pads)} pad values for {len(example_inputs)} inputs")
            for p in pads:
                if not isinstance(p, (int, float, bool)):
                    raise TypeError(f"pad values must be numbers, got {p!r}")
        self.device: torch.device = next(iter(devices))
        self.max_tokens = max_tokens
        self.pad_values: Tuple[PadValue, ...] = tuple(pads)
        self.buffers: Tuple[torch.Tensor, ...] = tuple(
            torch.full((max_tokens, *t.shape[1:]), p, dtype=t.dtype, device=self.device)
            for t, p in zip(example_inputs, pads)
        )
        for buf in self.buffers:
            # The views handed to a function are prefixes of these buffers and Dynamo guards
            # their bases' sizes: a static base keeps the largest size (T == max_tokens) from
            # sharing T's symbol, which would make every smaller size recompile.
            torch._dynamo.mark_static(buf)

    def check(self, inputs: Sequence[torch.Tensor]) -> int:
        """Validate ``inputs`` against the buffers; return their token count ``T``."""
        if len(inputs) != len(self.buffers):
            raise ValueError(f"expected {len(self.buffers)} inputs, got {len(inputs)}")
        tokens: Optional[int] = None
        for i, (x, buf) in enumerate(zip(inputs, self.buffers)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} is a {type(x).__name__}, not a tensor")
            if x.dtype != buf.dtype:
                raise ValueError(f"input {i} has dtype {x.dtype}, the static buffer is {buf.dtype}")
            if x.device != buf.device:
                raise ValueError(f"input {i} is on {x.device}, the static buffer is on {buf.device}")
            if x.dim() != buf.dim() or tuple(x.shape[1:]) != tuple(buf.shape[1:]):
                raise ValueError(
                    f"input {i} is {tuple(x.shape)}; expected (tokens, "
                    f"{', '.join(str(s) for s in buf.shape[1:])}) like its static buffer {_describe(buf)}"
                )
            if tokens is None:
                tokens = x.shape[0]
            elif x.shape[0] != tokens:
                raise ValueError(f"input {i} has {x.shape[0]} tokens, input 0 has {tokens}")
        assert tokens is not None
        return tokens

    def load(self, inputs: Sequence[torch.Tensor], padded: int) -> int:
        """Copy ``inputs`` (``T`` rows each) into rows ``[:T]``, pad rows ``[T:padded]``; return ``T``."""
        tokens = self.check(inputs)
        if not tokens <= padded <= self.max_tokens:
            raise ValueError(f"cannot pad {tokens} tokens to {padded} (max {self.max_tokens})")
        for x, buf, pad in zip(inputs, self.buffers, self.pad_values):
            buf[:tokens].copy_(x)
            if padded > tokens:
                buf[tokens:padded].fill_(pad)
        return tokens

    def views(self, tokens: int) -> Tuple[torch.Tensor, ...]:
        """The ``[:tokens]`` prefix of every buffer (views: no copy, stable addresses)."""
        return tuple(buf[:tokens] for buf in self.buffers)


# --------------------------------------------------------------------------- outputs


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in nested tuples/lists/dicts; other leaves are kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        mapped = [map_tensors(fn, o) for o in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
    if isinstance(obj, list):
        return [map_tensors(fn, o) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _tensor_leaves(obj: Any) -> List[torch.Tensor]:
    leaves: List[torch.Tensor] = []
    map_tensors(leaves.append, obj)
    return leaves


def _check_outputs(outputs: Any, tokens: int, packed: Optional[torch.Tensor], out_kwarg: str) -> None:
    """Every tensor output is token-major; with a packed buffer, one output is ``packed[:tokens]``."""
    leaves = _tensor_leaves(outputs)
    for i, t in enumerate(leaves):
        if t.dim() < 1 or t.shape[0] != tokens:
            raise ValueError(
                f"output tensor {i} is {tuple(t.shape)} at {tokens} tokens: the runner slices "
                f"outputs to the real token count, so every tensor output must have the token "
                f"count as its leading dim"
            )
    if packed is None:
        return
    for t in leaves:
        if (t.data_ptr() == packed.data_ptr() and tuple(t.shape) == (tokens, *packed.shape[1:])
                and t.stride() == packed.stride()):
            return
    raise ValueError(
        f"the function was given {out_kwarg}={_describe(packed)} but returned no output that "
        f"is its prefix {out_kwarg}[:{tokens}]: it must write its packed captures there and "
        f"return that view (e.g. a reference model in capture_mode='packer')"
    )


# --------------------------------------------------------------------------- capture


class CapturedGraph(NamedTuple):
    """A captured CUDA graph, the outputs its replays rewrite, and (when asked) the peak
    bytes allocated while it was recorded: what its memory pool had to provide, as the
    allocator's blocks (``capture_peak_bytes``, rounded up, whole unsplit blocks counted)
    and as the bytes the tensors requested (``capture_requested_peak_bytes``, the
    ``requested_bytes.all.peak`` statistic; None where the torch build lacks it)."""

    graph: "torch.cuda.CUDAGraph"
    outputs: Any
    capture_peak_bytes: Optional[int]
    capture_requested_peak_bytes: Optional[int] = None


def capture_cuda_graph(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None,
                       *, pool: Any = None, stream: Optional["torch.cuda.Stream"] = None,
                       warmup_iters: int = 3, measure_memory: bool = False) -> CapturedGraph:
    """Warm ``fn(*args, **kwargs)`` up on a side stream, then capture it into a CUDA graph.

    As the CUDA-graph docs prescribe: ``warmup_iters`` eager runs on ``stream`` (a side
    stream; lazy initialisation, cuBLAS workspaces and ``torch.compile``'s compilation
    happen there, not during capture), then one capture on the same stream into ``pool``
    (a ``torch.cuda.graph_pool_handle()`` shared by every graph of a runner; None: a
    private pool). The outputs of the captured run live in memory the graph owns: each
    ``graph.replay()`` recomputes them in place from whatever the ``args`` tensors hold.
    ``measure_memory=True`` resets the device's peak-memory statistics and records the
    peak above the bytes allocated when the capture starts, allocated and requested.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("capture_cuda_graph needs CUDA")
    if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 1:
        raise ValueError(f"warmup_iters must be an int >= 1, got {warmup_iters!r}")
    kwargs = kwargs or {}
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start = 0
    start_requested: Optional[int] = None
    if measure_memory:
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        start_requested = torch.cuda.memory_stats().get("requested_bytes.all.current")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = fn(*args, **kwargs)
    torch.cuda.synchronize()
    peak = requested = None
    if measure_memory:
        peak = torch.cuda.max_memory_allocated() - start
        requested_peak = torch.cuda.memory_stats().get("requested_bytes.all.peak")
        if start_requested is not None and requested_peak is not None:
            requested = requested_peak - start_requested
    return CapturedGraph(graph, outputs, peak, requested)


class CudaGraphRunner:
    """Run ``fn`` through one CUDA graph per token count, padded, with one static packed buffer.

    ``fn(*inputs, **{out_kwarg: packed_buffer}) -> outputs``: ``inputs`` are token-major
    tensors (dim 0 = tokens), every tensor output is token-major, and (when a packed
    buffer is configured) ``fn`` writes its packed captures into ``packed_buffer[:P]`` and
    returns that view, as the reference models do in ``capture_mode="packer"`` with
    ``aux_out=``. ``fn`` may be an ``nn.Module``, a ``torch.compile``'d one, or any
    function that does no host synchronisation (it is captured).

    Arguments:

    - ``token_counts``: the sizes to capture (e.g. ``[8, 16, 32, 64]``); a call with ``T``
      tokens replays the smallest captured size ``>= T``.
    - ``example_inputs``: one tensor per input, any token count: their dtype, device and
      trailing shape define the static input buffers (values unused).
    - ``packed_width`` and ``packed_dtype``: allocate the static packed buffer
      ``[max_tokens, packed_width]`` (zeros); or ``packed_out``: a caller-owned contiguous
      buffer ``[>= max_tokens, width]`` to use instead. Either is marked static for Dynamo
      (``torch._dynamo.mark_static``), as are the static input buffers. Neither: no packed
      buffer, ``fn`` is called without ``out_kwarg`` (outputs then live in the graph pool).
    - ``pad_values``: what padded input rows hold (one number, or one per input).
    - ``use_cuda_graphs``: None = on CUDA devices only; False runs ``fn`` directly on the
      same static buffers (the CPU path); True on a non-CUDA device is an error.
    - ``pool``: a ``torch.cuda.graph_pool_handle()`` to share with other runners (a piece
      runner, the draft model's graphs); None creates one shared by this runner's graphs.
    - ``warmup_iters``: eager runs per size before its capture.
    - ``measure_capture_memory``: record ``capture_peak_bytes[size]`` and
      ``capture_requested_peak_bytes[size]`` (resets the device's peak-memory statistics
      around each capture).

    Graphs are captured at construction, largest size first (smaller graphs then reuse the
    pool memory the largest one's intermediates freed). Outputs are views of static
    memory, valid until the next call of the runner, whatever its size: a graph's outputs
    may sit in blocks that another size's graph uses for intermediates, which is why the
    graphs may replay in any order under that contract.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        token_counts: Sequence[int],
        example_inputs: Sequence[torch.Tensor],
        *,
        packed_width: Optional[int] = None,
        packed_dtype: Optional[torch.dtype] = None,
        packed_out: Optional[torch.Tensor] = None,
        out_kwarg: str = "aux_out",
        pad_values: Union[PadValue, Sequence[PadValue]] = 0,
        use_cuda_graphs: Optional[bool] = None,
        pool: Any = None,
        warmup_iters: int = 3,
        measure_capture_memory: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not isinstance(out_kwarg, str) or not out_kwarg.isidentifier():
            raise ValueError(f"out_kwarg must be a keyword name, got {out_kwarg!r}")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 1:
            raise ValueError(f"warmup_iters must be an int >= 1, got {warmup_iters!r}")
        self.fn = fn
        self.token_counts: Tuple[int, ...] = check_token_counts(token_counts)
        self.max_tokens: int = self.token_counts[-1]
        self.out_kwarg = out_kwarg
        self.warmup_iters = warmup_iters
        self.static_inputs = StaticInputs(example_inputs, self.max_tokens, pad_values)
        self.device: torch.device = self.static_inputs.device
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        if use_cuda_graphs and (self.device.type != "cuda" or not torch.cuda.is_available()):
            raise ValueError(f"use_cuda_graphs=True needs CUDA inputs, the example inputs are on {self.device}")
        self.use_cuda_graphs: bool = bool(use_cuda_graphs)
        self.packed_buffer: Optional[torch.Tensor] = self._packed_buffer(packed_width, packed_dtype, packed_out)
        self.pool: Any = None
        if self.use_cuda_graphs:
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        elif pool is not None:
            raise ValueError("pool applies to CUDA graphs only (use_cuda_graphs is False)")
        self._graphs: Dict[int, "torch.cuda.CUDAGraph"] = {}
        self._outputs: Dict[int, Any] = {}
        #: seconds spent warming up and capturing each size
        self.capture_seconds: Dict[int, float] = {}
        self.measure_capture_memory = bool(measure_capture_memory)
        #: with ``measure_capture_memory`` (CUDA graphs only): per size, the peak bytes allocated
        #: while its graph was recorded, above those allocated before (its share of the pool)
        self.capture_peak_bytes: Dict[int, int] = {}
        #: the same peak in bytes requested by tensors (``requested_bytes.all.peak``), unrounded
        self.capture_requested_peak_bytes: Dict[int, int] = {}
        self._capture_all()

    # ------------------------------------------------------------------ setup

    def _packed_buffer(self, width: Optional[int], dtype: Optional[torch.dtype],
                       out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if out is not None:
            if width is not None or dtype is not None:
                raise ValueError("give either packed_out or packed_width/packed_dtype, not both")
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"packed_out must be a tensor, got {type(out).__name__}")
            if out.dim() < 2 or out.shape[0] < self.max_tokens:
                raise ValueError(
                    f"packed_out is {tuple(out.shape)}; it needs at least {self.max_tokens} rows "
                    f"(the largest token count) and a feature dim"
                )
            if out.device != self.device:
                raise ValueError(f"packed_out is on {out.device}, the inputs are on {self.device}")
            if not out.is_contiguous():
                raise ValueError("packed_out must be contiguous (each size writes its [:tokens] prefix)")
            return self._mark_static(out)
        if width is None:
            if dtype is not None:
                raise ValueError("packed_dtype given without packed_width")
            return None
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"packed_width must be an int >= 1 (K * hidden), got {width!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"packed_dtype must be a torch.dtype when packed_width is given, got {dtype!r}")
        return self._mark_static(torch.zeros(self.max_tokens, width, dtype=dtype, device=self.device))

    @staticmethod
    def _mark_static(buf: torch.Tensor) -> torch.Tensor:
        """Keep Dynamo from giving the buffer's rows the token count's symbol.

        Under ``torch.compile(dynamic=True)`` the largest size is traced with
        ``T == max_tokens``; duck sizing would then give both the same symbol and every
        smaller size would recompile. A static buffer shape keeps one graph for all sizes.
        """
        torch._dynamo.mark_static(buf)
        return buf

    def _kwargs(self) -> Dict[str, Any]:
        return {} if self.packed_buffer is None else {self.out_kwarg: self.packed_buffer}

    def _capture_all(self) -> None:
        kwargs = self._kwargs()
        mode = "CUDA graph" if self.use_cuda_graphs else "direct (no CUDA graph)"
        stream = torch.cuda.Stream(self.device) if self.use_cuda_graphs else None
        for tokens in reversed(self.token_counts):  # largest first
            start = time.perf_counter()
            args = self.static_inputs.views(tokens)
            try:
                if self.use_cuda_graphs:
                    with torch.cuda.device(self.device):
                        captured = capture_cuda_graph(self.fn, args, kwargs, pool=self.pool, stream=stream,
                                                      warmup_iters=self.warmup_iters,
                                                      measure_memory=self.measure_capture_memory)
                    self._graphs[tokens] = captured.graph
                    self._outputs[tokens] = outputs = captured.outputs
                    if captured.capture_peak_bytes is not None:
                        self.capture_peak_bytes[tokens] = captured.capture_peak_bytes
                    if captured.capture_requested_peak_bytes is not None:
                        self.capture_requested_peak_bytes[tokens] = captured.capture_requested_peak_bytes
                else:
                    outputs = self.fn(*args, **kwargs)
            except Exception:
                log.error("cudagraph runner: preparing the %d-token %s failed", tokens, mode)
                raise
            _check_outputs(outputs, tokens, self.packed_buffer, self.out_kwarg)
            self.capture_seconds[tokens] = time.perf_counter() - start
            log.info("cudagraph runner: %s for %d tokens ready in %.2f s", mode, tokens,
                     self.capture_seconds[tokens])

    # ------------------------------------------------------------------ running

    @property
    def captured_sizes(self) -> Tuple[int, ...]:
        """Token counts with a captured CUDA graph (empty when ``use_cuda_graphs`` is False)."""
        return tuple(sorted(self._graphs))

    def padded_size(self, tokens: int) -> int:
        """The captured token count a call with ``tokens`` real tokens runs at."""
        return padded_token_count(self.token_counts, tokens)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Pad ``inputs`` to the next captured size, run, return the outputs sliced to ``T``.

        The returned tensors are views of static memory (the packed one of
        ``packed_buffer``), overwritten by the next call.
        """
        tokens = self.static_inputs.check(inputs)
        padded = self.padded_size(tokens)
        self.static_inputs.load(inputs, padded)
        if self.use_cuda_graphs:
            self._graphs[padded].replay()
            outputs = self._outputs[padded]
        else:
            outputs = self.fn(*self.static_inputs.views(padded), **self._kwargs())
            _check_outputs(outputs, padded, self.packed_buffer, self.out_kwarg)
        return map_tensors(lambda t: t[:tokens], outputs)
