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


def runtime_modules():
    names = ["onepass", "onepass.runtime"]
    for info in pkgutil.walk_packages(onepass.runtime.__path__, "onepass.runtime."):
        names.append(info.name)
    return names


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
