"""``python -m compile_pass diff MODEL``: what the capture pass does to a model's graphs.

    python -m compile_pass diff models.dflash:capture_dominated --tokens 2048 --out out/
    python -m compile_pass diff path/to/my_model.py:build --inner aot_eager --measure

MODEL is ``module:factory`` or ``path/to/file.py:factory``; the factory returns
``(model, example_inputs)`` (an ``nn.Module`` or callable and a tuple of inputs) and gets
``tokens=N`` when ``--tokens N`` is given. Prints the capture groups, a unified diff of each
graph's code before vs after the pass, and the estimated (``--measure``: also measured) peaks.
``--out DIR`` writes ``graph_<i>_before.py`` / ``graph_<i>_after.py``, ``report.json`` and
``timeline.png`` (with matplotlib). Errors in the input exit with status 2 and one line
on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, NoReturn, Optional, Sequence, Tuple

PROG = "compile-pass"
_INNERS = ("eager", "aot_eager", "inductor")


class CliError(Exception):
    """A problem with the input: reported as one line, exit status 2."""


def _a(type_name: str) -> str:
    return f"{'an' if type_name[:1].lower() in 'aeiou' else 'a'} {type_name}"


def _one_line(e: BaseException) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (status 2, like every input error here)."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Debugging tools of the aux-hidden-state capture pass.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    diff = sub.add_parser(
        "diff", help="show what the pass does to a model's graphs",
        description="Compile MODEL with the aux_capture backend, run it once and show the "
                    "capture groups, a diff of each graph before vs after the pass and the "
                    "estimated memory peaks.")
    diff.add_argument("model", metavar="MODEL",
                      help="module:factory (e.g. models.llama:tiny) or path/to/file.py:factory; "
                           "the factory returns (model, example_inputs)")
    diff.add_argument("--inner", choices=_INNERS, default="eager",
                      help="inner compiler behind the pass (default: eager)")
    diff.add_argument("--split-ops", metavar="A,B", default=None,
                      help="split the Dynamo graph at these ops (piecewise graphs, as the engines compile)")
    diff.add_argument("--pack-outputs", action="store_true",
                      help="pack captures returned as graph outputs into one buffer")
    diff.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True,
                      help="compile with dynamic shapes (default: --dynamic)")
    diff.add_argument("--tokens", type=_positive_int, metavar="N", default=None,
                      help="call the factory with tokens=N")
    diff.add_argument("--out", metavar="DIR", type=Path, default=None,
                      help="write graph_<i>_before.py / _after.py, report.json, timeline.png")
    diff.add_argument("--depyf", action="store_true",
                      help="also dump depyf's view of the compile into DIR/depyf (needs --out "
                           "and depyf)")
    diff.add_argument("--measure", action="store_true",
                      help="also measure the peak with the pass off vs on (measure_peak)")
    diff.add_argument("--no-color", action="store_true", help="no ANSI colors")
    diff.add_argument("--fuse-projection", action="store_true",
                      help="project captures read only by the draft's fc into its accumulator "
                           "(opt-in: changes rounding; docs/projection.md)")
    diff.add_argument("--no-cost-model", action="store_true",
                      help="rewrite every valid group, even where the estimate does not drop")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# --------------------------------------------------------------------------- MODEL


def _load_file(path_text: str) -> Any:
    path = Path(path_text)
    if not path.is_file():
        raise CliError(f"model file not found: {path_text}")
    name = f"_compile_pass_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load {path_text} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)  # the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        raise CliError(f"importing {path_text} failed: {_one_line(e)}") from e
    return module


def _ensure_cwd_importable(module_name: str) -> None:
    """``python -m`` puts the cwd on sys.path; the console script does not."""
    top = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    cwd = os.getcwd()
    if not found and cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _load_module(module_name: str) -> Any:
    _ensure_cwd_importable(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise CliError(f"cannot import module {module_name!r}: no module named {e.name!r}") \
                from e
        raise CliError(f"importing {module_name!r} failed: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001
        raise CliError(f"importing {module_name!r} failed: {_one_line(e)}") from e


def load_factory(spec: str) -> Callable[..., Any]:
    """The factory named by ``module:factory`` or ``path/to/file.py:factory``."""
    target, sep, factory_name = spec.rpartition(":")
    if not sep or not target or not factory_name:
        raise CliError(f"MODEL must be module:factory or path/to/file.py:factory, got {spec!r}")
    is_file = target.endswith(".py") or os.sep in target or "/" in target
    module = _load_file(target) if is_file else _load_module(target)
    factory = getattr(module, factory_name, None)
    if factory is None:
        names = getattr(module, "FACTORY_NAMES", None)
        hint = f" (its factories: {', '.join(names)})" if names else ""
        raise CliError(f"{target} has no factory {factory_name!r}{hint}")
    if not callable(factory):
        raise CliError(f"{target}:{factory_name} is not callable "
                       f"({_a(type(factory).__name__)})")
    return factory


def build_model(spec: str, tokens: Optional[int]) -> Tuple[Any, Tuple[Any, ...]]:
    """Call the factory; check it returned ``(model, example_inputs)``."""
    import torch

    factory = load_factory(spec)
    kwargs = {"tokens": tokens} if tokens is not None else {}
    try:
        made = factory(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise CliError(f"factory {spec} failed: {_one_line(e)}") from e
    expected = ("must return (model, example_inputs): an nn.Module or callable and a tuple "
                "of inputs")
    if not isinstance(made, tuple) or len(made) != 2:
        got = (f"a tuple of {len(made)}" if isinstance(made, tuple) else
               _a(type(made).__name__))
        raise CliError(f"factory {spec} {expected}, got {got}")
    model, inputs = made
    if not (isinstance(model, torch.nn.Module) or callable(model)):
        raise CliError(f"factory {spec} {expected}, got {_a(type(model).__name__)} as the model")
    if not isinstance(inputs, tuple):
        raise CliError(f"factory {spec} {expected}, got {_a(type(inputs).__name__)} as the inputs")
    return model, inputs


# --------------------------------------------------------------------------- diff


def _write_outputs(report: Any, out: Path, also: Sequence[Path] = ()) -> List[str]:
    """Per graph code before/after, report.json, timeline.png; returns notes for the user."""
    notes = []
    out.mkdir(parents=True, exist_ok=True)
    for directory in (out, *also):
        directory.mkdir(parents=True, exist_ok=True)
        for g in report.graphs:
            (directory / f"graph_{g.index}_before.py").write_text(g.result.code_before)
            (directory / f"graph_{g.index}_after.py").write_text(g.result.code_after)
    (out / "report.json").write_text(report.to_json())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        notes.append("timeline.png not written: matplotlib is not installed "
                     "(pip install matplotlib)")
    else:
        try:
            report.plot(out / "timeline.png")
        except ValueError as e:
            notes.append(f"timeline.png not written: {e}")
    return notes


def _diff(args: argparse.Namespace) -> int:
    if args.depyf:
        if args.out is None:
            raise CliError("--depyf needs --out DIR (depyf's files go to DIR/depyf)")
        if importlib.util.find_spec("depyf") is None:
            raise CliError("--depyf needs depyf, which is not installed "
                           "(pip install depyf, or pip install 'compile-pass[debug]')")
    split_ops = [op for op in args.split_ops.split(",") if op] if args.split_ops else None
    if args.split_ops is not None and not split_ops:
        raise CliError(f"--split-ops expects comma-separated op names, got {args.split_ops!r}")

    _ensure_cwd_importable("models")  # the reference models, for a factory file too
    model, inputs = build_model(args.model, args.tokens)

    from compile_pass.explainer import ModelRunError, explain

    kwargs = dict(inner=args.inner, split_ops=split_ops, pack_outputs=args.pack_outputs,
                  dynamic=args.dynamic, measure=args.measure, cost_model=not args.no_cost_model,
                  fuse_projection=args.fuse_projection, name=args.model)
    try:
        if args.depyf:
            import depyf

            depyf_dir = args.out / "depyf"
            depyf_dir.mkdir(parents=True, exist_ok=True)
            with depyf.prepare_debug(str(depyf_dir)):
                report = explain(model, *inputs, **kwargs)
        else:
            report = explain(model, *inputs, **kwargs)
    except (ValueError, TypeError, ModelRunError) as e:
        raise CliError(str(e)) from e

    color = (not args.no_color and "NO_COLOR" not in os.environ
             and hasattr(sys.stdout, "isatty") and sys.stdout.isatty())
    sys.stdout.write(report.to_text(color=color))
    if args.out is not None:
        also = [args.out / "depyf"] if args.depyf else []
        for note in _write_outputs(report, args.out, also):
            print(f"{PROG}: {note}", file=sys.stderr)
        print(f"wrote {args.out}/ (graph_<i>_before.py, graph_<i>_after.py, report.json"
              f"{', timeline.png' if (args.out / 'timeline.png').exists() else ''})")
    sys.stdout.flush()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)  # argparse reports its own errors (status 2)
    try:
        if args.command == "diff":
            return _diff(args)
    except CliError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail("interrupted")
    except Exception as e:  # noqa: BLE001 - an internal error, still one line
        if os.environ.get("COMPILE_PASS_TRACEBACK"):
            raise
        return _fail(f"internal error: {_one_line(e)} "
                     f"(set COMPILE_PASS_TRACEBACK=1 for the traceback)")
    return _fail(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
