"""The engine plugins use the core's public API only: no plugin module imports a private name
of ``compile_pass`` (outside ``compile_pass.integrations``), or reads one off an imported
core module. The packing contract they rely on is public: ``compile_pass.packed_view``."""

import ast
import pathlib

import pytest

INTEGRATIONS = pathlib.Path(__file__).resolve().parents[1] / "compile_pass" / "integrations"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _core(module: str) -> bool:
    return module.split(".")[0] == "compile_pass" and not module.startswith("compile_pass.integrations")


def private_uses(path: pathlib.Path):
    """(line, what) for each private core name the file imports or reads off a core module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found, core_modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _core(node.module):
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                elif node.module == "compile_pass":
                    core_modules.add(alias.asname or alias.name)  # a module of the package, maybe
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _core(alias.name):
                    core_modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in core_modules:
                found.append((node.lineno, f"{ast.unparse(node)}"))
    return found


@pytest.mark.parametrize("path", sorted(INTEGRATIONS.glob("*.py")), ids=lambda p: p.name)
def test_no_private_core_names_in_plugins(path):
    assert private_uses(path) == []


def test_the_check_sees_a_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from compile_pass.packer import _adjacent_view\nimport compile_pass.packer as pk\n"
                   "pk._buffer_of(1)\nfrom compile_pass.integrations.seams import _MISSING\n")
    assert [what for _, what in private_uses(bad)] == ["from compile_pass.packer import _adjacent_view",
                                                       "pk._buffer_of"]
