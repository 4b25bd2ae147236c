"""Run the differential fuzzer over a range of seeds in batches, in parallel, and write one file.

    python -m tools.fuzz_runs --seeds 0-300 --batch 50 --inners inductor --jobs 2 \\
        --out docs/results/fuzz_inductor_300.txt
    python -m tools.fuzz_runs --seeds 0-1000 --batch 100 --inners eager,aot_eager --jobs 2 \\
        --out docs/results/fuzz_eager_aot_eager_1000.txt
    python -m tools.fuzz_runs --fuzzer fuzz_combine --seeds 0-1000 --batch 100 --inners eager,aot_eager \\
        --out docs/results/fuzz_combine_eager_aot_eager_1000.txt

Each batch is ``python -m tools.fuzz --cases B --start-seed S --inners ...`` (or
``tools.fuzz_combine``, ``--fuzzer``) in a process of its own (``--jobs`` at a time); the file starts with the totals over every batch (the
counters of each inner's summary line summed, the cases per knob) and then holds each batch's
summary under its command, the commit and the time it started. Exit status 1 if any batch
reported a mismatch or a compile failure.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence, Tuple

_COUNTER = re.compile(r"(\w+)=(\d+)")
_INNER_LINE = re.compile(r"^\s+(eager|aot_eager|inductor)\s+runs=")
#: the Inductor oracle's sentence on each batch's second line -> counters (and largest differences)
_ORACLE = (
    ("twin_rounding", re.compile(r"list build rounds differently: (\d+) cases, largest difference ([-\d.e+]+)")),
    ("own_kernel_rounding", re.compile(r"computes them into it: (\d+) cases, largest difference ([-\d.e+]+)")),
    ("list_changes_model", re.compile(r"changes the model's own output: (\d+) cases")),
    ("model_as_list", re.compile(r"of which the pass keeps the list build's: (\d+)")),
    ("reference_wrong", re.compile(r"list build wrong vs eager, the pass right: (\d+)")),
)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run_batch(start: int, cases: int, inners: str, fuzzer: str = "fuzz") -> Tuple[str, str, float, int]:
    """(command, stdout, seconds, return code) of one batch of ``tools.<fuzzer>``."""
    cmd = [sys.executable, "-m", f"tools.{fuzzer}", "--cases", str(cases), "--start-seed", str(start),
           "--inners", inners]
    began = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    shown = f"python -m tools.{fuzzer} " + " ".join(cmd[3:])
    return shown, r.stdout + (r.stderr[-2000:] if r.returncode not in (0, 1) else ""), \
        time.time() - began, r.returncode


def oracle_totals(outputs: Sequence[str]) -> Tuple[Counter, Dict[str, float]]:
    """The Inductor oracle's counters summed over batches, and each kind's largest difference."""
    counts: Counter = Counter()
    largest: Dict[str, float] = {}
    for out in outputs:
        for name, pattern in _ORACLE:
            for match in pattern.finditer(out):
                counts[name] += int(match.group(1))
                if match.lastindex and match.lastindex >= 2:
                    largest[name] = max(largest.get(name, 0.0), float(match.group(2)))
    return counts, largest


def totals(outputs: Sequence[str]) -> Tuple[Dict[str, Counter], Counter]:
    """Counters of each inner's summary lines summed, and the cases per knob."""
    per_inner: Dict[str, Counter] = {}
    knobs: Counter = Counter()
    for out in outputs:
        for line in out.splitlines():
            match = _INNER_LINE.match(line)
            if match:
                main, _, rest = line.partition("(output groups:")
                outputs, _, tokens = rest.partition(")")
                counts = {k: int(v) for k, v in _COUNTER.findall(main)}
                counts.update({f"out_{k}": int(v) for k, v in _COUNTER.findall(outputs)})
                counts.update({("token_counts" if k == "run" else k): int(v)
                               for k, v in _COUNTER.findall(tokens)})
                per_inner.setdefault(match.group(1), Counter()).update(counts)
            elif line.strip().startswith("cases per knob:"):
                for part in line.split(":", 1)[1].split(","):
                    if ":" in part:
                        name, n = part.rsplit(":", 1)
                        knobs[name.strip()] += int(n)
    return per_inner, knobs


_COMBINE_INNER = re.compile(r"^\s+(eager|aot_eager|inductor)\s+runs=")
_COMBINE_INT = re.compile(r"(\w+)=(\d+)(?=\s|$)")
_COMBINE_MAX = re.compile(r"(max_rel_error_\w+)=([-\d.e+]+)")
_COMBINE_COVERAGE = re.compile(r"^    (\w+=.+): fused (\d+), refused (\d+)$")
_COMBINE_REFUSED = re.compile(r"^    refused \((\d+)\): (.+)$")


def combine_totals(outputs: Sequence[str]) -> List[str]:
    """``tools.fuzz_combine`` batches summed: per inner, the counters, the largest errors,
    the fused / refused count per spelling and the refusals by reason; and every FAIL line."""
    counts: Dict[str, Counter] = {}
    largest: Dict[str, Dict[str, float]] = {}
    coverage: Dict[str, Dict[str, Counter]] = {}
    refused: Dict[str, Counter] = {}
    fails: List[str] = []
    for out in outputs:
        inner = None
        for line in out.splitlines():
            match = _COMBINE_INNER.match(line)
            if match:
                inner = match.group(1)
                counts.setdefault(inner, Counter()).update({k: int(v) for k, v in _COMBINE_INT.findall(line)
                                                            if not k.startswith("max_")})
                for k, v in _COMBINE_MAX.findall(line):
                    largest.setdefault(inner, {})[k] = max(largest.get(inner, {}).get(k, 0.0), float(v))
            elif inner and (match := _COMBINE_COVERAGE.match(line)):
                coverage.setdefault(inner, {}).setdefault(match.group(1), Counter()).update(
                    fused=int(match.group(2)), refused=int(match.group(3)))
            elif inner and (match := _COMBINE_REFUSED.match(line)):
                refused.setdefault(inner, Counter())[match.group(2)] += int(match.group(1))
            elif line.strip().startswith("FAIL"):
                fails.append(f"{inner}: {line.strip()}")
    lines = []
    for inner, c in counts.items():
        lines.append(f"TOTAL {inner}: " + " ".join(f"{k}={v}" for k, v in c.items())
                     + "".join(f" {k}={v:.3g}" for k, v in largest.get(inner, {}).items()))
        for spelling, n in sorted(coverage.get(inner, {}).items()):
            lines.append(f"TOTAL {inner}   {spelling}: fused {n['fused']}, refused {n['refused']}")
        for reason, n in refused.get(inner, Counter()).most_common():
            lines.append(f"TOTAL {inner}   refused ({n}): {reason}")
    return lines + [f"TOTAL FAIL {f}" for f in fails]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", required=True, help="first-last (last excluded), e.g. 0-300")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--inners", default="eager,aot_eager")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fuzzer", default="fuzz", choices=("fuzz", "fuzz_combine"),
                    help="tools.fuzz (the capture pass) or tools.fuzz_combine (fuse_projection)")
    args = ap.parse_args(argv)
    first, last = (int(x) for x in args.seeds.split("-"))
    starts = list(range(first, last, args.batch))
    commit = _commit()
    stamps = {s: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") for s in starts}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda s: run_batch(s, min(args.batch, last - s), args.inners, args.fuzzer),
                                starts))
    outputs = [out for _, out, _, _ in results]
    seconds = sum(t for _, _, t, _ in results)
    lines: List[str] = [f"# {len(results)} runs, {last - first} cases in all, {seconds:.0f} s of run time "
                        f"({args.jobs} runs at a time); `python -m tools.fuzz_runs {' '.join(argv or sys.argv[1:])}`; "
                        f"the per-run summaries below, each headed by its command and commit", ""]
    if args.fuzzer == "fuzz_combine":
        lines += combine_totals(outputs) + [""]
        for start, (cmd, out, secs, _) in zip(starts, results):
            lines += [f"cmd: {cmd} (commit {commit}, {stamps[start]}, {secs:.0f} s)", out.rstrip(), ""]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(line for line in lines if line.startswith("TOTAL")))
        return 1 if any(rc != 0 for *_, rc in results) else 0
    per_inner, knobs = totals(outputs)
    for inner, counts in per_inner.items():
        lines.append(f"TOTAL {inner}: " + " ".join(f"{k}={v}" for k, v in counts.items()))
    oracle, largest = oracle_totals([out for _, out, _, _ in results])
    if oracle:
        lines.append("TOTAL " + " ".join(f"{k}={oracle[k]}" + (f" (largest {largest[k]:.3g})" if k in largest else "")
                                         for k, _ in _ORACLE))
    lines.append("TOTAL cases per knob: " + ", ".join(f"{k}: {v}" for k, v in knobs.items()))
    lines.append("")
    for start, (cmd, out, secs, _) in zip(starts, results):
        lines += [f"cmd: {cmd} (commit {commit}, {stamps[start]}, {secs:.0f} s)", out.rstrip(), ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    bad = sum(c.get("mismatches", 0) + c.get("compile_failures", 0) for c in per_inner.values())
    print("\n".join(line for line in lines if line.startswith("TOTAL")))
    return 1 if bad or any(rc not in (0, 1) for *_, rc in results) else 0


if __name__ == "__main__":
    sys.exit(main())
