"""docs/vllm-upstream.patch, the proposal that would retire the vLLM plugin's patches: it
applies to the installed vLLM 0.34.0 (``patch -p1 --dry-run`` on a copy of the files it
touches; ``make vllm``), and the module it adds does what the hunks rely on (any torch)."""

import importlib.util
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

PATCH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "vllm-upstream.patch"


def _new_module(tmp_path):
    """vllm/compilation/aux_hidden_states.py as the patch creates it, imported."""
    text = PATCH.read_text()
    start = text.index("+++ b/vllm/compilation/aux_hidden_states.py\n")
    body = text[text.index("\n", text.index("@@ -0,0", start)) + 1:text.index("\n--- a/", start)]
    source = tmp_path / "aux_hidden_states.py"
    source.write_text("\n".join(line[1:] for line in body.split("\n")) + "\n")
    spec = importlib.util.spec_from_file_location("upstream_aux_hidden_states", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_added_module_packs_views_and_passes_a_projection_on(tmp_path):
    m = _new_module(tmp_path)
    buf = torch.randn(5, 3 * 4)
    slices = [buf[:, i * 4:(i + 1) * 4] for i in range(3)]
    assert m.pack_aux_hidden_states(slices).data_ptr() == buf.data_ptr()  # hunk 2: a view
    assert torch.equal(m.pack_aux_hidden_states([s.clone() for s in slices]), buf)  # else a cat
    views = m.packed_static_buffers(slices, 9)  # hunk 3: K column views of one buffer
    assert [v.shape for v in views] == [(9, 4)] * 3 and len({v.untyped_storage().data_ptr() for v in views}) == 1

    # hunk 6: a projection and its zero-width stand-ins
    projected = torch.randn(5, 6)
    stand_ins = [projected.new_empty(5, 0)] * 2
    assert m.pack_aux_hidden_states([projected, *stand_ins]) is projected
    assert [b.shape for b in m.packed_static_buffers([projected, *stand_ins], 9)] == [(9, 6), (9, 0), (9, 0)]
    fc = type("FC", (), {"output_size": 6, "input_size": 12})()
    assert m.is_projected_input(projected, fc) and not m.is_projected_input(torch.randn(5, 12), fc)
    assert not m.draft_loaded(torch.nn.Linear(2, 2))
    m.DRAFT_LOADED_HOOKS.append(lambda model: isinstance(model, torch.nn.Linear))
    assert m.draft_loaded(torch.nn.Linear(2, 2)) and not m.draft_loaded(torch.nn.ReLU())


def test_the_patch_applies_to_the_installed_vllm(tmp_path):
    vllm = pytest.importorskip("vllm")
    if not str(getattr(vllm, "__version__", "")).startswith("0.34."):
        pytest.skip(f"the patch is written against vLLM 0.34.0, this is {vllm.__version__}")
    if shutil.which("patch") is None:
        pytest.skip("no patch(1) on this machine")
    root = pathlib.Path(vllm.__file__).resolve().parents[1]
    for rel in sorted(set(re.findall(r"^--- a/(\S+)$", PATCH.read_text(), re.M))):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, tmp_path / rel)
    r = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(PATCH)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr
