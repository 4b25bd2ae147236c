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

Times are in half steps: node ``i`` runs at time ``2 * i``; a node inserted right after it
would run at ``2 * i + 1``. That lets the cost model (``cost.py``) price a planned rewrite
on the original graph's intervals without building the rewritten graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterable, List, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.fx as fx

from compile_pass.dataflow import NodeTable, hint, holders_of, nbytes

__all__ = ["Interval", "LivenessModel", "MemoryTimeline", "estimate_memory"]

#: time steps per block of precomputed maxima (``LivenessModel._range_max``)
_BLOCK = 128
#: nodes whose values were live before the graph runs
_INPUT_OPS = frozenset({"placeholder", "get_attr"})


@dataclass
class MemoryTimeline:
    """Estimated live bytes while each node of a graph runs, and their maximum."""

    node_names: List[str]
    live_bytes: List[int]
    peak_bytes: int
    peak_node: Optional[str]

    def plus(self, extra: int) -> "MemoryTimeline":
        """The same timeline with ``extra`` bytes live throughout (a buffer allocated
        before the graph runs)."""
        return MemoryTimeline(self.node_names, [b + extra for b in self.live_bytes],
                              self.peak_bytes + extra, self.peak_node)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "node_names": self.node_names,
            "live_bytes": self.live_bytes,
        }


class Interval(NamedTuple):
    """A storage of ``size`` bytes live from time ``born`` to time ``last`` (inclusive).
    (A named tuple: a graph has thousands, built in one sweep.)"""

    size: int
    born: int
    last: int


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return hint(t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # no storage (e.g. a sparse value)
        return nbytes(t)


def _storage_size(table: NodeTable, key: Hashable, tensor: torch.Tensor) -> int:
    """Bytes of storage ``key``, cached on ``table``: from the table's storage object, else
    from ``tensor`` (a value holding it)."""
    size = table.storage_bytes.get(key)
    if size is None:
        storage = table.storage.get(key)
        if storage is None:
            size = _storage_bytes(tensor)
        else:
            size = storage.nbytes()
            size = size if type(size) is int else hint(size)
        table.storage_bytes[key] = size
    return size


class LivenessModel:
    """Storage intervals of one graph (see the module docstring for the model).

    A model with ``computed_into`` is derived from the table's plain model (built once per
    ``NodeTable`` and kept on it): only the storages of the values computed into others and
    of their targets are recomputed, and the plain timeline is patched by their difference.
    Equal, interval for interval, to building it from scratch (``_from_scratch=True``,
    which the tests compare against).
    """

    def __init__(self, graph: fx.Graph,
                 computed_into: Optional[Mapping[fx.Node, fx.Node]] = None,
                 table: Optional[NodeTable] = None, *, _from_scratch: bool = False) -> None:
        table = NodeTable.of(graph, table)
        self.nodes = table.nodes
        self.position = table.position
        self.end = 2 * len(self.nodes)
        # the table's holders, not the table: the table keeps its plain model, and a model
        # that kept the table would make a cycle only the garbage collector frees
        self._holders: Dict[Hashable, List[fx.Node]] = table.holders
        self._nodes_of: Optional[Dict[Hashable, List[fx.Node]]] = None
        #: a derived model's holders of the storages it recomputed (``nodes_of`` merges them)
        self._holders_changed: Optional[Dict[Hashable, List[fx.Node]]] = None
        source_of: Dict[fx.Node, fx.Node] = dict(computed_into or {})
        #: value -> the value whose storage it holds (the ``computed_into`` given)
        self.computed_into: Mapping[fx.Node, fx.Node] = source_of
        # storages each node holds: its own, those of the value computed into, none for the
        # output node (its metadata may even describe values a rewrite replaced)
        self.keys_of: Dict[fx.Node, Sequence[Hashable]] = dict(table.storages)
        for node, target in source_of.items():
            self.keys_of[node] = table.storages[target]
        for node in reversed(self.nodes):
            if node.op == "output":
                self.keys_of[node] = []
                break
        if source_of and not _from_scratch:
            plain = table.plain_liveness
            if not isinstance(plain, LivenessModel):
                plain = LivenessModel(graph, table=table)
            self._derive(plain, table)
            return
        self.intervals: Dict[Hashable, Interval] = self._swept_intervals(source_of, table) \
            if source_of or _from_scratch else self._plain_intervals(table)
        self._sweep_timeline()
        if not source_of and table.plain_liveness is None:
            table.plain_liveness = self

    def _swept_intervals(self, source_of: Mapping[fx.Node, fx.Node],
                         table: NodeTable) -> Dict[Hashable, Interval]:
        """Every storage's interval, in one sweep over the nodes."""
        tensors, inputs_of = table.tensors, table.inputs
        born: Dict[Hashable, int] = {}
        size: Dict[Hashable, int] = {}
        last: Dict[Hashable, int] = {}  # = last_read(key), filled in the same sweep
        preexisting = set()
        keys_of = self.keys_of
        for i, node in enumerate(self.nodes):
            time = 2 * i
            if node.op == "output":  # what it returns is read at the end
                time = self.end
            for arg in inputs_of[node]:  # node is a user of arg: it reads arg's storages
                for key in keys_of[arg]:
                    last[key] = time
            keys = keys_of[node]
            if not keys:
                continue
            is_input = node.op in ("placeholder", "get_attr")
            for key, t in zip(keys, tensors[source_of.get(node, node)]):
                last[key] = time  # times only grow: the latest reader so far is this node
                if key in born or key in preexisting:
                    continue
                if is_input:
                    preexisting.add(key)
                else:
                    born[key] = time
                    size[key] = _storage_size(table, key, t)
        return {key: Interval(size[key], start, last[key]) for key, start in born.items()}

    def _plain_intervals(self, table: NodeTable) -> Dict[Hashable, Interval]:
        """Every storage's interval with nothing computed into anything, from the table's
        holders and last readers: what ``_swept_intervals`` gives, without its sweep over
        every input of every node."""
        position, end = self.position, self.end
        # when each node's value is last read: by its last reader (a read is always later
        # than the value's own step), else where it is produced
        read_at = {node: end if reader.op == "output" else 2 * position[reader]
                   for node, reader in table.last_reader.items()}
        sizes = table.storage_bytes
        intervals: Dict[Hashable, Interval] = {}
        for key, holders in table.holders.items():
            first = holders[0]
            if first.op in _INPUT_OPS:
                continue  # live before the graph runs
            born = 2 * position[first]
            if len(holders) == 1:
                last = read_at.get(first, born)
            else:  # a value's views and in-place writers' results
                last = max([read_at.get(node, 2 * position[node]) for node in holders])
            size = sizes.get(key)
            if size is None:
                size = _storage_size(table, key, table.tensors[first][table.storages[first].index(key)])
            intervals[key] = Interval(size, born, last)
        return intervals

    def _derive(self, plain: "LivenessModel", table: NodeTable) -> None:
        """This model's intervals and timeline from ``plain`` (same table, nothing computed
        into anything): the storages ``computed_into`` touches get the intervals their new
        holders give them, as the sweep would; every other interval is the plain one."""
        source_of = self.computed_into
        touched: Dict[Hashable, None] = {}
        for node, target in source_of.items():
            touched.update(dict.fromkeys(table.storages[node]))
            touched.update(dict.fromkeys(table.storages[target]))
        holders: Dict[Hashable, List[fx.Node]] = {
            key: [n for n in table.holders.get(key, ()) if n not in source_of] for key in touched}
        for node in source_of:
            if node.op != "output":
                for key in self.keys_of[node]:
                    holders[key].append(node)
        position, end = self.position, self.end
        changes: Dict[Hashable, Optional[Interval]] = {}
        for key in touched:
            nodes = sorted(holders[key], key=position.__getitem__)
            holders[key] = nodes
            interval = None
            if nodes and nodes[0].op not in _INPUT_OPS:
                last = 0
                for node in nodes:
                    last = max(last, 2 * position[node])
                    for user in node.users:
                        last = max(last, end if user.op == "output" else 2 * position[user])
                first = nodes[0]
                tensor = table.tensors[source_of.get(first, first)][self.keys_of[first].index(key)]
                interval = Interval(_storage_size(table, key, tensor), 2 * position[first], last)
            if interval != plain.intervals.get(key):
                changes[key] = interval
        self.intervals = dict(plain.intervals)
        for key, interval in changes.items():
            if interval is None:
                self.intervals.pop(key, None)
            else:
                self.intervals[key] = interval
        self._holders_changed = holders
        self._base = plain.live_bytes(changes) if changes else plain._base
        self._peak = max(self._base, default=0)
        self._block_max = [max(self._base[i:i + _BLOCK]) for i in range(0, len(self._base), _BLOCK)] \
            if changes else plain._block_max

    @property
    def nodes_of(self) -> Dict[Hashable, List[fx.Node]]:
        """Storage -> the nodes holding it, in graph order: the table's ``holders``
        unless values are computed into others' storages (then built on first use)."""
        if not self.computed_into:
            return self._holders
        if self._nodes_of is None:
            changed = self._holders_changed
            self._nodes_of = {**self._holders, **changed} if changed is not None \
                else holders_of(self.keys_of)
        return self._nodes_of

    def _sweep_timeline(self) -> None:
        """The unchanged timeline, swept once (pricing a change only adds its difference),
        its peak, and its maxima per block of ``_BLOCK`` steps."""
        self._base = self._sweep(self.intervals.values())
        self._peak = max(self._base, default=0)
        self._block_max = [max(self._base[i:i + _BLOCK]) for i in range(0, len(self._base), _BLOCK)]

    def last_read(self, key: Hashable, ignore: Optional[fx.Node] = None) -> int:
        """Time of the last read of storage ``key`` by any node except ``ignore``."""
        last = 0
        for node in self.nodes_of.get(key, ()):
            last = max(last, 2 * self.position[node])
            for user in node.users:
                if user is ignore:
                    continue
                last = max(last, self.end if user.op == "output" else 2 * self.position[user])
        return last

    def _sweep(self, intervals: Iterable[Interval]) -> List[int]:
        """Live bytes at every time step ``0 .. end`` of a set of intervals."""
        delta = [0] * (self.end + 2)
        for interval in intervals:
            delta[interval.born] += interval.size
            delta[min(interval.last, self.end) + 1] -= interval.size
        return list(itertools.accumulate(delta[:self.end + 1]))

    def _difference(self, changes: Mapping[Hashable, Optional[Interval]]) -> Dict[int, int]:
        """What ``changes`` add to the live bytes, as step changes: time -> bytes."""
        steps: Dict[int, int] = {}

        def add(interval: Interval, sign: int) -> None:
            for time, size in ((interval.born, interval.size),
                               (min(interval.last, self.end) + 1, -interval.size)):
                steps[time] = steps.get(time, 0) + sign * size

        for key, interval in changes.items():
            old = self.intervals.get(key)
            if old is not None:
                add(old, -1)
            if interval is not None:
                add(interval, +1)
        return steps

    def live_bytes(self, changes: Optional[Mapping[Hashable, Optional[Interval]]] = None) -> List[int]:
        """Live bytes at every time step, with some intervals replaced (None: removed)."""
        if not changes:
            return list(self._base)
        delta = [0] * (self.end + 2)
        for time, size in self._difference(changes).items():
            delta[time] += size
        return [b + d for b, d in zip(self._base, itertools.accumulate(delta))]

    def _range_max(self, lo: int, hi: int) -> int:
        """``max(live_bytes()[lo:hi])`` for ``lo < hi``, from the blocks' maxima: O(sqrt(n))."""
        first, last = -(-lo // _BLOCK), hi // _BLOCK  # the whole blocks inside [lo, hi)
        if first >= last:
            return max(self._base[lo:hi])
        best = max(self._block_max[first:last])
        if lo < first * _BLOCK:
            best = max(best, max(self._base[lo:first * _BLOCK]))
        if last * _BLOCK < hi:
            best = max(best, max(self._base[last * _BLOCK:hi]))
        return best

    def max_outside(self, first: int, last: int) -> int:
        """Maximum live bytes of the unchanged timeline at the times outside ``first ..
        last`` (inclusive); 0 if there are none."""
        best = self._range_max(0, first) if first > 0 else 0
        if last + 1 <= self.end:
            best = max(best, self._range_max(last + 1, self.end + 1))
        return best

    def peak(self, changes: Optional[Mapping[Hashable, Optional[Interval]]] = None) -> int:
        """Maximum of ``live_bytes(changes)``: the unchanged timeline's maxima between the
        changes' step points, each offset by what the changes add there (time proportional
        to the number of changes times sqrt of the graph's length)."""
        if not changes:
            return self._peak
        peak, offset, previous = 0, 0, 0
        for time, size in sorted(self._difference(changes).items()) + [(self.end + 1, 0)]:
            if time > previous:
                peak = max(peak, offset + self._range_max(previous, time))
            offset, previous = offset + size, max(previous, time)
        return peak

    def timeline(self) -> MemoryTimeline:
        """Live bytes while each node runs (even time steps)."""
        steps = self.live_bytes()
        per_node = [steps[2 * i] for i in range(len(self.nodes))]
        peak = max(per_node, default=0)
        peak_node = self.nodes[per_node.index(peak)].name if peak > 0 else None
        return MemoryTimeline([n.name for n in self.nodes], per_node, peak, peak_node)


def estimate_memory(graph: fx.Graph,
                    computed_into: Optional[Mapping[fx.Node, fx.Node]] = None) -> MemoryTimeline:
    """Liveness-based live bytes per node of ``graph``."""
    return LivenessModel(graph, computed_into).timeline()
