"""What one run of the capture pass did to one graph: ``PassResult``.

The pass (``capture_pass.run_capture_pass``) fills one per graph; the backend keeps them
(``AuxCaptureBackend.results``), the diff tool and ``TORCH_TRACE`` artifacts print them, the
engine plugins count from them. Its ``groups`` are the ``CaptureGroup``s found, each with the
decision and the reason it was reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.fx as fx

from compile_pass.groups import CaptureGroup, Decision
from compile_pass.lift import LiftedBuffers
from compile_pass.liveness import MemoryTimeline

__all__ = ["PassResult", "CODE_NOT_KEPT"]


#: ``PassResult.code_before`` / ``code_after`` of a graph whose code was not kept
CODE_NOT_KEPT = ("# the graph's code was not kept: the pass changed it, or left it unchanged for a "
                 "compiler that edits it next (keep_code_before=True, estimate=True as the diff "
                 "tool runs it, or TORCH_TRACE keep it)\n")


@dataclass
class PassResult:
    """What one run of the pass did to one graph.

    ``code_before`` / ``code_after`` are the graph's code before and after the pass. The
    text costs about as much as the pass itself on a 7000-node graph, so it is generated
    only when needed: before the pass's first change, on first read from an unchanged graph
    that nothing edits later (a graph that runs as is, or the backend's working copy), and
    with ``estimate=True`` (the diff tool). Otherwise, for a graph the pass leaves unchanged
    and a compiler edits next (Inductor's post-grad graph), it is not kept: both read
    ``CODE_NOT_KEPT``.
    """

    target: str
    groups: List[CaptureGroup]
    _code_before: Optional[str]
    _code_after: Optional[str]
    timeline_before: Optional[MemoryTimeline] = None
    timeline_after: Optional[MemoryTimeline] = None
    seconds: float = 0.0  # the pass's own time: find, plan, price, rewrite, lift
    #: regenerating a changed module's Python code after the pass (``gm.recompile()``), which
    #: running or compiling the rewritten module needs in any case
    codegen_seconds: float = 0.0
    codegen_cpu_seconds: float = 0.0  # the same in CPU time of the process
    error: Optional[str] = None
    counts: Dict[str, int] = field(default_factory=dict)
    #: packed buffers made graph inputs (``Target.lift``): the compiled graph's caller allocates them
    lifted: Optional[LiftedBuffers] = None
    lift_note: str = ""  # why packed buffers stayed in the graph, if they did
    #: ``write_slice_`` calls of capture-only arithmetic made ``binary_into_slice_`` (lift targets)
    writes_computed_into: int = 0
    _unchanged_graph: Optional[fx.Graph] = field(default=None, repr=False, compare=False)
    #: generate the code before ahead of the graph's first change (else it is not kept then)
    _keep_code: bool = field(default=True, repr=False, compare=False)

    @property
    def code_before(self) -> str:
        if self._code_before is None:
            if self._unchanged_graph is None:
                return CODE_NOT_KEPT
            self._code_before = self._unchanged_graph.python_code("self").src
            self._unchanged_graph = None
        return self._code_before

    def keep_code_before(self, graph: fx.Graph) -> None:
        """``graph`` is about to change: generate the code before now (unless an unchanged
        graph is kept to read it from, or the result keeps no code: then it is dropped)."""
        if self._code_before is None and self._unchanged_graph in (None, graph):
            if self._keep_code:
                self._code_before = graph.python_code("self").src
            self._unchanged_graph = None

    @code_before.setter
    def code_before(self, code: str) -> None:
        self._code_before = code

    @property
    def code_after(self) -> str:
        return self.code_before if self._code_after is None else self._code_after

    @code_after.setter
    def code_after(self, code: str) -> None:
        self._code_after = code

    @property
    def changed(self) -> bool:
        return any(g.decision is Decision.REWRITE for g in self.groups)
