"""Print the requirements of an installed distribution, for installing it ``--no-deps``.

``python -m tools.requirements_of vllm --override flashinfer-python==0.7.4`` prints one
requirement per line (environment markers kept, optional extras dropped), with each
``--override`` replacing the requirement of the same project name. It exists for engine
releases that pin a package the registry does not serve (vllm 0.34.0 pins
``flashinfer-python==0.7.3``; the registry serves 0.7.2.post1 and 0.7.4): install the engine
``--no-deps``, then ``pip install -r`` what this prints (the Makefile's ``vllm_venv``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from typing import List, Optional, Sequence

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical_name(requirement: str) -> str:
    """The project name of a requirement line, normalized as PEP 503 says."""
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _wheel_requires(wheel: str) -> List[str]:
    """The ``Requires-Dist`` lines of a wheel file's METADATA."""
    import email
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name)).get_all("Requires-Dist") or []


def requirements(distribution: str, overrides: Sequence[str] = (),
                 wheel: Optional[str] = None) -> List[str]:
    """``distribution``'s requirements without optional extras, ``overrides`` applied; read
    from the installed distribution, or from ``wheel`` (a wheel file of it) if given."""
    by_name = {canonical_name(o): o for o in overrides}
    used = set()
    out: List[str] = []
    for line in (_wheel_requires(wheel) if wheel else importlib.metadata.requires(distribution)) or []:
        if re.search(r"\bextra\s*==", line):
            continue
        name = canonical_name(line)
        if name in by_name:
            if name not in used:
                out.append(by_name[name])
            used.add(name)
        else:
            out.append(line)
    unused = sorted(set(by_name) - used)
    if unused:
        raise SystemExit(f"--override names no requirement of {distribution}: {', '.join(unused)}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("distribution")
    parser.add_argument("--override", action="append", default=[],
                        help="a requirement replacing the one of the same name")
    parser.add_argument("--wheel", help="read the requirements from this wheel file instead")
    parser.add_argument("--only", help="print only the requirement of this project name")
    args = parser.parse_args(argv)
    found = requirements(args.distribution, args.override, args.wheel)
    if args.only:
        found = [r for r in found if canonical_name(r) == canonical_name(args.only)]
    print("\n".join(found))


if __name__ == "__main__":
    main()
