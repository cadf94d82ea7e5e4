"""The runtime imports and answers without torch, transformers or optimum."""

import pkgutil
import subprocess
import sys

import onepass.runtime

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'optimum', 'onnx', 'onnxscript'}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


TORCH_BACKEND = {"onepass.runtime.backends.torch_backend", "onepass.runtime.backends.torch_decoder"}  # torch by design


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
    import re
    from pathlib import Path

    root = Path(onepass.runtime.__file__).parent
    found = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py") for n, line in
             enumerate(p.read_text().splitlines(), 1)
             if re.search(r"from \.\.+export\b|import onepass\.export|onepass\.export\.|from \.\.\.export", line)]
    assert found == []
