"""``compile_pass/integrations/frames.py`` on every Python found here (3.11, 3.12, 3.13):
the frame semantics list adoption relies on, checked in a fresh interpreter that imports
only that file (no torch): the caller's own list is found as the same object, the function
keeps running on its variables, and nothing the read made keeps a local alive afterwards
(3.11/3.12 keep an ``f_locals`` snapshot on the frame; 3.13's proxy holds none)."""

import glob
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

FRAMES = pathlib.Path(__file__).resolve().parents[1] / "compile_pass" / "integrations" / "frames.py"

CHECK = r'''
import gc, importlib.util, sys, weakref
spec = importlib.util.spec_from_file_location("frames", sys.argv[1])
frames = importlib.util.module_from_spec(spec); spec.loader.exec_module(frames)

class Capture:
    pass

def hook():
    """Stands for a layer's pre-hook: find the loop's list in its caller's frame."""
    frame = frames.caller_frame(1, (), 0)
    try:
        return frames.lists_in_frame(frame, lambda v: all(isinstance(t, Capture) for t in v))
    finally:
        del frame

def loop():
    aux_hidden_states = [Capture(), Capture()]
    temporary = Capture()
    gone = weakref.ref(temporary)
    found = hook()
    assert len(found) == 1 and found[0] is aux_hidden_states, found
    found[0].append(Capture())  # the model's own list object: the loop sees the change
    assert len(aux_hidden_states) == 3
    del temporary  # the snapshot the read made must not keep it alive
    gc.collect()
    assert gone() is None, "a frame-locals snapshot kept a local alive"
    aux_hidden_states.append(Capture())  # the function keeps running on its own variables
    return aux_hidden_states

assert len(loop()) == 4
print("ok", sys.version_info[:2])
'''


def _interpreters():
    """This test's Python, and the 3.11-3.13 interpreters found on this machine."""
    found = {sys.executable: f"{sys.version_info[0]}.{sys.version_info[1]}"}
    for minor in ("3.11", "3.12", "3.13"):
        candidates = [shutil.which(f"python{minor}")]
        candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python{minor}")))
        for path in candidates:
            if path and os.path.exists(path) and minor not in found.values():
                probe = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"],
                                       capture_output=True, text=True)
                if probe.returncode == 0:
                    found[path] = minor
    return sorted(found.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("python,minor", _interpreters(), ids=[m for _, m in _interpreters()])
def test_frame_reads_leave_the_model_as_it_was(python, minor):
    r = subprocess.run([python, "-c", CHECK, str(FRAMES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok")
