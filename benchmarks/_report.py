"""What the benchmark scripts share: ``--out`` / ``--render`` arguments, the JSON they write
and read back, and markdown tables.

Each script saves ``{"torch": ..., "argv": ..., <its own fields>, "rows": [...]}`` with
``--out`` and prints an earlier JSON as markdown with ``--render``: first an HTML comment
with the command that made it (how docs/*.md cite their tables), then the script's tables.
The scripts run as ``python benchmarks/X.py`` (this folder is then on ``sys.path``) and import
this module as ``_report``; it needs nothing but torch (gpu_capture_memory.py runs it on a
machine with only torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

OUT_HELP = "write the rows as JSON here"
RENDER_HELP = "print an earlier run's JSON as a markdown table, run nothing"


def add_output_args(parser: argparse.ArgumentParser, out_help: str = OUT_HELP,
                    render_help: str = RENDER_HELP) -> None:
    """``--out FILE`` (write the JSON) and ``--render JSON`` (print a saved run, run nothing)."""
    parser.add_argument("--out", default=None, help=out_help)
    parser.add_argument("--render", default=None, metavar="JSON", help=render_help)


def write_json(path: str, fields: Dict[str, Any], argv: Optional[List[str]] = None,
               versions: Optional[Dict[str, str]] = None) -> None:
    """Write ``{"torch": ..., **versions, "argv": ..., **fields}`` to ``path`` (indent 1),
    creating its folder. ``argv``: the arguments to record (default ``sys.argv[1:]``);
    ``versions``: other libraries' versions, recorded next to torch's. Written to
    ``path + ".tmp"`` and renamed, so a reader (or a run cut short) never sees half a file.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    saved = {"torch": torch.__version__, **(versions or {}),
             "argv": sys.argv[1:] if argv is None else argv, **fields}
    with open(path + ".tmp", "w") as f:
        json.dump(saved, f, indent=1)
    os.replace(path + ".tmp", path)


def write_out(path: Optional[str], fields: Dict[str, Any], argv: Optional[List[str]] = None,
              versions: Optional[Dict[str, str]] = None) -> None:
    """``--out``: if ``path`` is set, ``write_json`` there and print that it did."""
    if path:
        write_json(path, fields, argv=argv, versions=versions)
        print(f"\nwrote {path}")


def provenance(saved: Dict[str, Any], command: str, *details: str) -> str:
    """The HTML comment above a rendered table: ``<!-- COMMAND ARGV (torch V, DETAILS) -->``."""
    about = ", ".join(["torch " + saved["torch"], *details])
    return f"<!-- {command} {' '.join(saved['argv'])} ({about}) -->"


def render(path: str, command: str, body: Callable[[Dict[str, Any]], str],
           details: Callable[[Dict[str, Any]], Sequence[str]] = lambda saved: ()) -> int:
    """``--render``: print the saved run at ``path`` as its provenance comment (``command``,
    plus ``details(saved)`` after the torch version) and ``body(saved)``. Returns 0, the
    script's exit status."""
    with open(path) as f:
        saved = json.load(f)
    print(provenance(saved, command, *details(saved)))
    print(body(saved))
    return 0


def markdown_table(columns: Optional[Sequence[str]], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table: the header row and its ``|---|`` line (none if ``columns`` is None,
    to continue a table already printed), then one line per row; cells are formatted with
    ``f"{cell}"``, so format numbers before."""
    lines = [] if columns is None else [_markdown_line(columns), "|" + "---|" * len(columns)]
    lines += [_markdown_line(row) for row in rows]
    return "\n".join(lines)


def _markdown_line(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(f"{cell}" for cell in cells) + " |"


def yes_no(value: Optional[bool]) -> str:
    """A bitwise-equality cell: "" (not compared), "yes" or "NO"."""
    return "" if value is None else ("yes" if value else "NO")
