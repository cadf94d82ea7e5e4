"""The runtime imports and answers without torch, transformers or optimum."""

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import onepass.runtime

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'optimum', 'onnx', 'onnxscript'}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


# torch (or, for the weights it reads, onnx) by design: imported only when the PyTorch backend is asked for
TORCH_BACKEND = {"onepass.runtime.backends.torch_backend", "onepass.runtime.backends.torch_decoder",
                 "onepass.runtime.backends.fused_decoder", "onepass.runtime.backends.launches",
                 "onepass.runtime.backends.engine_weights"}


def runtime_modules():
    """Every runtime module but the PyTorch backend's (imported only when that backend is asked for)."""
    names = ["onepass", "onepass.runtime"]
    for info in pkgutil.walk_packages(onepass.runtime.__path__, "onepass.runtime."):
        names.append(info.name)
    return [n for n in names if n not in TORCH_BACKEND]


def test_every_runtime_module_imports_without_torch():
    modules = runtime_modules()
    assert "onepass.runtime.backends.ort" in modules and len(modules) >= 10
    code = BLOCK + "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules) + (
        "assert not any(m.split('.')[0] in {'torch', 'transformers'} for m in sys.modules)\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_blocker_really_blocks():
    """Negative control: the same blocker makes importing torch fail."""
    done = subprocess.run([sys.executable, "-c", BLOCK + "import torch"], capture_output=True, text=True)
    assert done.returncode != 0 and "blocked: torch" in done.stderr


def test_the_runtime_never_imports_export_not_even_by_name():
    """export and calibration may import the runtime, never the reverse: no import statement and no module path in
    a string (the backend table named the PyTorch backend as onepass.export.torch_backend once)."""

    root = Path(onepass.runtime.__file__).parent
    found = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py") for n, line in
             enumerate(p.read_text().splitlines(), 1)
             if re.search(r"from \.\.+export\b|import onepass\.export|onepass\.export\.|from \.\.\.export", line)]
    assert found == []


def test_the_public_api_is_onepass_runtime_and_its_extras_load_on_first_use():
    """``from onepass.runtime import ...`` gives the whole public API; Gate, Cascade, Levels and connect come from
    their rooms on first use, so importing onepass, or everything in its ``__all__``, loads neither pydantic nor
    httpx2 (a fresh process); an unknown name is an AttributeError."""
    code = ("import sys, onepass; from onepass.runtime import *; print(sorted(m for m in ('pydantic', 'httpx2') "
            "if m in sys.modules)); from onepass.runtime import Gate, Cascade, Levels, connect; "
            "print(Gate.__module__, Cascade.__module__, Levels.__module__, connect.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, modules = out.stdout.splitlines()
    assert before == "[]"
    assert modules == ("onepass.runtime.core.cascade onepass.runtime.core.cascade onepass.runtime.core.decide "
                       "onepass.runtime.teacher.client")
    assert {"Engine", "Noul", "Choice", "Score"} <= set(onepass.runtime.__all__)
    assert {"Gate", "Cascade", "Levels", "connect"} <= set(dir(onepass.runtime))
    try:
        onepass.runtime.Gatee
    except AttributeError as err:
        assert "Gatee" in str(err)
    else:
        raise AssertionError("an unknown name was found")
