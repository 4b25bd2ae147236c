"""Measured peak memory of one call: what every memory claim in this project rests on.

``measure_peak(fn, *args)`` runs ``fn`` once and returns the peak of bytes allocated
*during* the call, above what was live when it started (inputs and weights count as 0):

- CUDA (any tensor argument on a CUDA device): the caching allocator's peak statistics,
  ``max_memory_allocated() - memory_allocated()`` taken around the call.
- CPU: the PyTorch profiler's raw allocation events (``profile_memory=True``): every
  allocation and free, with its signed size, summed in time order; the maximum of the
  running sum is the peak. This counts allocations made inside Inductor-compiled code
  and inside custom ops, which tensor-level hooks do not see.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Callable, Iterator, List, NamedTuple, Tuple

import torch

__all__ = ["Peak", "measure_peak", "allocation_trace"]


class Peak(NamedTuple):
    """Peak bytes allocated during a call above the bytes live at its start, and its result."""

    bytes: int
    result: Any


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()


def _device_of(fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict) -> torch.device:
    for t in _tensors((fn, args, kwargs)):
        if t.device.type == "cuda":
            return t.device
    return torch.device("cpu")


#: what the profiler's C++ side prints around a CPU-only measurement, and nothing else: the
#: only lines ``_profiler_chatter_dropped`` drops. Kineto's USDT probes on every start and
#: stop (torch 2.13 and 2.14), and, with a CUDA build of torch on a machine without a CUDA
#: driver (torch 2.14.1 here), kineto's one-time device query as it stops (code 35: no
#: driver), which says nothing about a measurement of CPU allocations.
_PROFILER_CHATTER = re.compile(
    r"^(USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"
    r"|ERROR:.*DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code \d+)\s*$")


@contextlib.contextmanager
def _profiler_chatter_dropped() -> Iterator[None]:
    """Inside the block, what is written to file descriptor 2 is kept back and written to
    ``sys.stderr`` afterwards, less the profiler's start/stop lines. Wraps the profiler's
    own start and stop only, never the measured call: anything else is written out."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (an embedding host)
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if not _PROFILER_CHATTER.match(line.rstrip("\n"))]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def allocation_trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Tuple[List[int], Any]:
    """Signed allocation sizes (bytes, + alloc / - free) on CPU during ``fn``, in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _profiler_chatter_dropped():
        prof.__enter__()
    try:
        result = fn(*args, **kwargs)
    finally:
        with _profiler_chatter_dropped():
            prof.__exit__(None, None, None)
    events: List[Tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    events.sort(key=lambda e: e[0])  # stable: equal timestamps keep tree order
    return [size for _, size in events], result


def _peak_of(sizes: List[int]) -> int:
    live = peak = 0
    for size in sizes:
        live += size
        peak = max(peak, live)
    return peak


def measure_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Peak:
    """Run ``fn(*args, **kwargs)`` once; return its peak allocated bytes and its result.

    The peak is relative to the bytes live when the call starts, so the same number means
    the same thing for an eager module, a compiled one and a packer-based one.
    """
    if not callable(fn):
        raise TypeError(f"measure_peak needs a callable, got {type(fn).__name__}")
    device = _device_of(fn, args, kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return Peak(torch.cuda.max_memory_allocated(device) - start, result)
    sizes, result = allocation_trace(fn, *args, **kwargs)
    return Peak(_peak_of(sizes), result)
