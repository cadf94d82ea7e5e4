"""The runtime's layers depend one way: server and tools -> core -> backends. No module in runtime/backends imports
runtime/core (nor server or tools), and no module in runtime/core imports server or tools: the backends own the batch
they run, the graph's I/O contract and the errors they raise; the core owns the manifest, the golden-file choice of a
default backend and the TensorRT plans recorded in an engine. Imports are read from the source (``import``,
``from ... import``, relative or absolute, at any depth, and ``importlib.import_module`` of a constant name), so a
lazy import inside a function counts too. Negative controls: one back import, written each of those ways, fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import onepass

RUNTIME = Path(onepass.__file__).parent / "runtime"
# a layer -> what of the package it may import: itself and the layers below it. Anything else of the package (a layer
# above, the package's roots, which import every layer, the command, export) is a back import
ALLOWED = {"backends": ("backends",), "core": ("core", "backends")}
MODULE_NAME = re.compile(r"\bonepass\.(?:runtime|export|calibration|cli|flags)\b(?:\.\w+)*")


def _module_of(path: Path) -> str:
    parts = ["onepass", *path.relative_to(RUNTIME.parent).with_suffix("").parts]  # whatever the checkout's name
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, level: int, package: str) -> str:
    base = package
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return (f"{base}.{name}" if name else base) if level else name


def _docstrings(tree) -> set:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the source of ``module``: import statements,
    ``importlib.import_module(name[, package])`` and ``__import__(name)`` of constant names, and any other string
    constant (not a docstring) that names a module of the package (a backend table's entry; a logger's name such
    as ``onepass.engine`` names no module)."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _resolve(node.module or "", node.level, package)  # ``from .. import core``: what is imported is
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]  # onepass.runtime.core
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            found.append((node.lineno, _resolve(name.lstrip("."), level, package) if level else name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [(node.lineno, m) for m in MODULE_NAME.findall(node.value)]
    return found


def _back_imports(source: str, path: Path) -> list[str]:
    module = _module_of(path)
    layer = module.split(".")[2] if module.count(".") >= 2 else None
    if layer not in ALLOWED:
        return []
    allowed = tuple(f"onepass.runtime.{name}" for name in ALLOWED[layer])
    return [f"{path.relative_to(RUNTIME)}:{line} imports {name}"
            for line, name in _imports(source, module, path.name == "__init__.py")
            if (name == "onepass" or name.startswith("onepass."))
            and not any(name == a or name.startswith(a + ".") for a in allowed)]


def test_the_runtime_layers_depend_one_way():
    files = sorted(RUNTIME.glob("backends/*.py")) + sorted(RUNTIME.glob("core/*.py"))
    assert len(files) > 30
    found = [hit for path in files for hit in _back_imports(path.read_text(), path)]
    assert found == [], found


def test_the_core_does_import_the_backends():
    """The check reads real imports: the core's engine imports the backends' base (the direction that is allowed)."""
    path = RUNTIME / "core" / "engine.py"
    names = {name for _, name in _imports(path.read_text(), _module_of(path), False)}
    assert "onepass.runtime.backends.base.Backend" in names and "onepass.runtime.backends.batch.PackedBatch" in names


def test_one_back_import_fails_it():
    """Negative controls: a back import in a backend module, written five ways, and one from core to server."""
    backend = RUNTIME / "backends" / "ort.py"
    for source in ["from ..core.tree import pack\n", "from ..core import manifest\n", "from .. import core\n",
                   "import onepass.runtime.core.errors\n",
                   "def lazy():\n    import importlib\n    importlib.import_module('onepass.runtime.core.selfcheck')\n",
                   "def lazy():\n    from ...runtime.server import errors\n",
                   "import importlib\nimportlib.import_module('..core.tree', __package__)\n",
                   "__import__('onepass.runtime.core.errors')\n", "from ... import runtime\n",
                   "import onepass.cli\n", "TABLE = {'x': ('onepass.runtime.server.app', 'App')}\n"]:
        assert _back_imports(source, backend), source
    assert _back_imports("from ..server.errors import http_error\n", RUNTIME / "core" / "engine.py")
    assert _back_imports("from . import contract\n", backend) == []  # a sibling is fine
    assert _back_imports('"""See onepass.runtime.core.engine."""\n', backend) == []  # a docstring names, not imports
    assert _back_imports("from ..backends.base import Backend\n", RUNTIME / "core" / "engine.py") == []
