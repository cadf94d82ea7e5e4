"""The runtime's layers depend one way: server and tools -> core -> backends. No module in runtime/backends imports
runtime/core (nor server or tools), and no module in runtime/core imports server or tools: the backends own the batch
they run, the graph's I/O contract and the errors they raise; the core owns the manifest, the golden-file choice of a
default backend and the TensorRT plans recorded in an engine. Imports are read from the source (``import``,
``from ... import``, relative or absolute, at any depth, and ``importlib.import_module`` of a constant name), so a
lazy import inside a function counts too. Negative controls: one back import, written each of those ways, fails."""

from __future__ import annotations

import ast
from pathlib import Path

import onepass

RUNTIME = Path(onepass.__file__).parent / "runtime"
# a layer -> the layers above it, which it must never import
FORBIDDEN = {"backends": ("core", "server", "tools"), "core": ("server", "tools")}


def _module_of(path: Path) -> str:
    parts = ["onepass", *path.relative_to(RUNTIME.parent).with_suffix("").parts]  # whatever the checkout's name
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the source of ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            name = node.module or ""
            if node.level:
                name = f"{base}.{name}" if name else base
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]  # ``from .. import core``
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _back_imports(source: str, path: Path) -> list[str]:
    module = _module_of(path)
    layer = module.split(".")[2] if module.count(".") >= 2 else None
    above = tuple(f"onepass.runtime.{name}" for name in FORBIDDEN.get(layer, ()))
    return [f"{path.relative_to(RUNTIME)}:{line} imports {name}"
            for line, name in _imports(source, module, path.name == "__init__.py")
            if any(name == a or name.startswith(a + ".") for a in above)]


def test_the_runtime_layers_depend_one_way():
    files = sorted(RUNTIME.glob("backends/*.py")) + sorted(RUNTIME.glob("core/*.py"))
    assert len(files) > 30
    found = [hit for path in files for hit in _back_imports(path.read_text(), path)]
    assert found == [], found


def test_the_core_does_import_the_backends():
    """The check reads real imports: the core's engine imports the backends' base (the direction that is allowed)."""
    path = RUNTIME / "core" / "engine.py"
    names = {name for _, name in _imports(path.read_text(), _module_of(path), False)}
    assert "onepass.runtime.backends.base" in names and "onepass.runtime.backends.batch.PackedBatch" in names


def test_one_back_import_fails_it():
    """Negative controls: a back import in a backend module, written five ways, and one from core to server."""
    backend = RUNTIME / "backends" / "ort.py"
    for source in ["from ..core.tree import pack\n", "from ..core import manifest\n", "from .. import core\n",
                   "import onepass.runtime.core.errors\n",
                   "def lazy():\n    import importlib\n    importlib.import_module('onepass.runtime.core.selfcheck')\n",
                   "def lazy():\n    from ...runtime.server import errors\n"]:
        assert _back_imports(source, backend), source
    assert _back_imports("from ..server.errors import http_error\n", RUNTIME / "core" / "engine.py")
    assert _back_imports("from . import contract\n", backend) == []  # a sibling is fine
    assert _back_imports("from ..backends.base import Backend\n", RUNTIME / "core" / "engine.py") == []
