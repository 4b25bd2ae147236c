"""Static peak-memory estimate of an FX graph: liveness of storages at the example sizes.

The model is the one an FX graph that runs as is follows: each node allocates the storages
of its output tensors that no earlier node owns (views allocate nothing), and a storage is
freed after the last node that reads any value aliasing it; graph outputs live to the end.
Graph inputs and parameters were live before the call and count as 0, the same baseline
as ``compile_pass.memory.measure_peak``. Symbolic sizes are evaluated at their hints.

``computed_into`` models a compiler that computes a value straight into another value's
storage (Inductor's concat lowering writes pointwise and mm producers into the concat's
output): such a node allocates nothing of its own and the target's storage is allocated at
the earliest such node instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterator, List, Mapping, Optional

import torch
import torch.fx as fx

from compile_pass.dataflow import hint, storage_key

__all__ = ["MemoryTimeline", "estimate_memory"]


@dataclass
class MemoryTimeline:
    """Estimated live bytes after each node of a graph, and their maximum."""

    node_names: List[str]
    live_bytes: List[int]
    peak_bytes: int
    peak_node: Optional[str]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "node_names": self.node_names,
            "live_bytes": self.live_bytes,
        }


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _value(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return hint(t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        n = 1
        for s in t.shape:
            n *= hint(s)
        return n * t.element_size()


def estimate_memory(
    graph: fx.Graph, computed_into: Optional[Mapping[fx.Node, fx.Node]] = None
) -> MemoryTimeline:
    """Liveness-based live bytes per node (see the module docstring for the model)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    computed_into = dict(computed_into or {})

    key_of_node: Dict[fx.Node, List[Hashable]] = {}
    size: Dict[Hashable, int] = {}
    born: Dict[Hashable, int] = {}
    preexisting = set()
    for node in nodes:
        keys: List[Hashable] = []
        target = computed_into.get(node)
        tensors = list(_tensors(_value(target if target is not None else node)))
        for t in tensors:
            key = storage_key(t) or ("object", id(t))
            keys.append(key)
            if key in preexisting:
                continue
            if key in born:
                born[key] = min(born[key], position[node])
                continue
            if node.op in ("placeholder", "get_attr"):
                preexisting.add(key)
                continue
            born[key] = position[node]
            size[key] = _storage_bytes(t)
        key_of_node[node] = keys

    last_use: Dict[Hashable, int] = {}
    for node in nodes:
        last = position[node]
        for user in node.users:
            last = max(last, end if user.op == "output" else position[user])
        for key in key_of_node[node]:
            last_use[key] = max(last_use.get(key, 0), last)

    delta = [0] * (end + 2)
    for key, start in born.items():
        delta[start] += size[key]
        delta[min(last_use.get(key, start), end) + 1] -= size[key]
    live, timeline = 0, []
    for i in range(end):
        live += delta[i]
        timeline.append(live)
    peak = max(timeline) if timeline else 0
    peak_node = nodes[timeline.index(peak)].name if timeline and peak > 0 else None
    return MemoryTimeline([n.name for n in nodes], timeline, peak, peak_node)
