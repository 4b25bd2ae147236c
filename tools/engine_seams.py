"""Probe the engine seams the plugins rely on, in the current environment, and print them.

    python -m tools.engine_seams            # every engine importable here
    python -m tools.engine_seams vllm       # one engine
    python -m tools.engine_seams --json out.json

For each engine: its version, whether the plugin would install (tested minor, every seam
fits), and the table of seams (``compile_pass.integrations.seams.report``); then one line
naming the seams that moved. Nothing is patched. ``make engines-latest`` runs it in venvs
of the newest vLLM and SGLang the registry serves: what a maintainer runs the day an engine
releases.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any, Dict, List, Sequence

ENGINES = ("vllm", "sglang")


def probe_engine(engine: str) -> Dict[str, Any]:
    """Version, tested or not, and the probes of ``engine``'s plugin."""
    if engine == "vllm":
        from compile_pass.integrations import vllm as plugin

        version = plugin.vllm_version()
        probes = plugin.probe_vllm()
        tested = version is not None and plugin.is_tested(version)
    elif engine == "sglang":
        from compile_pass.integrations import sglang_seams as plugin

        version = plugin.sglang_version()
        probes = plugin.probe_sglang()
        tested = version is not None and plugin.is_tested(version)
    else:
        raise SystemExit(f"unknown engine {engine!r}: expected one of {', '.join(ENGINES)}")
    return {"engine": engine, "version": version, "tested": tested, "probes": probes}


def summary(found: Dict[str, Any]) -> str:
    from compile_pass.integrations.seams import describe_problems

    probes = found["probes"]
    moved = describe_problems(probes)
    absent = [p.seam.name for p in probes if p.state == "absent" and p.seam.optional]
    line = f"{found['engine']} {found['version']}: "
    line += "tested minor" if found["tested"] else "NOT a tested minor"
    line += f"; {len(probes)} seams, " + (f"moved: {moved}" if moved else "none moved")
    if absent:
        line += f"; optional, absent here: {', '.join(absent)}"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="*", help=f"any of {', '.join(ENGINES)} (default: those installed)")
    parser.add_argument("--json", help="also write the probes as JSON to this file")
    args = parser.parse_args(argv)
    from compile_pass.integrations.seams import report

    engines = args.engines or [e for e in ENGINES if importlib.util.find_spec(e) is not None]
    if not engines:
        print("no engine installed here (vllm, sglang)")
        return 0
    out: List[Dict[str, Any]] = []
    for engine in engines:
        found = probe_engine(engine)
        print(f"== {engine} {found['version']}")
        print(report(found["probes"]))
        print(summary(found))
        out.append({"engine": engine, "version": found["version"], "tested": found["tested"],
                    "seams": [{"name": p.seam.name, "state": p.state, "detail": p.detail,
                               "route": p.seam.is_route, "optional": p.seam.optional}
                              for p in found["probes"]]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
