"""SpecForge 0.2.0's offline capture backend, read from the installed wheel (``make sglang``).

SpecForge 0.2.0 targets sglang 0.5.14; on the 0.5.23 of this venv its backend does not import,
so what is checked here is read from its source: the facts the SGLang plugin relies on.
"""

import ast
import importlib.util
import pathlib

import pytest

pytest.importorskip("sglang")
spec = importlib.util.find_spec("specforge")
if spec is None:
    pytest.skip("specforge is not installed", allow_module_level=True)

BACKEND = pathlib.Path(list(spec.submodule_search_locations)[0]) / "offline_capture" / "sglang_backend"


def _tree(name):
    return ast.parse((BACKEND / name).read_text())


def test_runner_is_sglangs_model_runner_without_its_own_forward():
    """SGLangRunner subclasses ModelRunner and keeps its forward: the plugin's around-hook
    on ModelRunner.forward (where K is read) applies to it when enabled in process."""
    cls = next(n for n in ast.walk(_tree("model_runner.py"))
               if isinstance(n, ast.ClassDef) and n.name == "SGLangRunner")
    assert [ast.unparse(b) for b in cls.bases] == ["ModelRunner"]
    assert "forward" not in {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_capture_calls_model_runner_forward_with_cuda_graphs_off():
    src = (BACKEND / "capture.py").read_text()
    assert "self.model_runner.forward(forward_batch)" in src
    assert "disable_cuda_graph=True" in src and "chunked_prefill_size=-1" in src


def test_backend_does_not_run_sglangs_plugin_loader():
    """So the plugin is switched on by ``compile_pass.integrations.sglang.enable()`` there."""
    for path in BACKEND.glob("*.py"):
        assert "load_plugins" not in path.read_text(), path


def test_specforge_backend_pins_an_older_sglang():
    """On sglang 0.5.23 its backend's import fails (it was written for 0.5.14; on 0.5.14,
    ``make specforge``, tests/test_specforge_pinned_sglang.py runs it)."""
    import sglang

    if sglang.__version__ == "0.5.14":
        pytest.skip("sglang 0.5.14: SpecForge's pin, its backend imports")
    with pytest.raises(ImportError):
        import specforge.offline_capture.sglang_backend.model_runner  # noqa: F401
