"""The house's rooms depend one way, each allowed arrow written once (``ALLOWED``):

    runtime.backends  <-  runtime.core  <-  runtime.teacher, runtime.tools (and the backends), runtime.server
    runtime.server -> runtime.teacher;  export -> runtime.core, runtime.backends
    calibration's rooms: data, scoring  <-  measure, heads  <-  tune  <-  teach;
    each of them -> export or the runtime rooms it needs, never the server

The backends own the batch they run, the graph's I/O contract and the errors they raise; the core owns the manifest,
the engine and the request's path; the teacher client, the tools (bench, plans, guarantee) and the HTTP server stand
on the core; export compiles a model into an engine with the runtime's own pieces; calibration (tune, distill, eval)
fits what export writes. ``onepass.runtime`` itself (the public API, lazily), ``cli.py`` and ``flags.py`` import every
room and are not rooms. Imports are read from the source (``import``, ``from ... import``, relative or absolute, at any
depth, and ``importlib.import_module`` of a constant name, and any non-docstring string that names a module), so a
lazy import inside a function counts too. Negative controls: a back import, written each of those ways, fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import onepass

ROOT = Path(onepass.__file__).parent
RUNTIME = ROOT / "runtime"
# a room -> the other rooms it may import (itself always)
ALLOWED = {"runtime.backends": (),
           "runtime.core": ("runtime.backends",),
           "runtime.teacher": ("runtime.core",),
           "runtime.tools": ("runtime.core", "runtime.backends"),
           "runtime.server": ("runtime.core", "runtime.teacher"),
           "export": ("runtime.core", "runtime.backends"),
           "calibration.data": ("runtime.core", "runtime.tools", "runtime.teacher"),
           "calibration.scoring": ("runtime.core",),
           "calibration.measure": ("calibration.data", "calibration.scoring", "runtime.core"),
           "calibration.heads": ("calibration.scoring", "export", "runtime.core", "runtime.backends"),
           "calibration.tune": ("calibration.data", "calibration.scoring", "calibration.measure", "calibration.heads",
                                "export", "runtime.core", "runtime.backends"),
           "calibration.teach": ("calibration.data", "calibration.scoring", "calibration.tune", "runtime.core",
                                 "runtime.tools", "runtime.teacher")}
MODULE_NAME = re.compile(r"\bonepass\.(?:runtime|export|calibration|cli|flags)\b(?:\.\w+)*")


def room_of(module: str) -> str | None:
    """The room of a module name of the package (None: the package's roots, cli, flags, or onepass.runtime itself)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in ("runtime", "calibration") and f"{parts[1]}.{parts[2]}" in ALLOWED:
        return f"{parts[1]}.{parts[2]}"
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    return None


def _module_of(path: Path) -> str:
    parts = ["onepass", *path.relative_to(ROOT).with_suffix("").parts]  # whatever the checkout's name
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
    room = room_of(module)
    if room is None:
        return []
    allowed = (room, *ALLOWED[room])
    found = []
    for line, name in _imports(source, module, path.name == "__init__.py"):
        if not (name == "onepass" or name.startswith("onepass.")):
            continue
        if room_of(name) not in allowed:
            found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


def _product_files() -> list[Path]:
    return sorted(p for d in ("runtime", "export", "calibration") for p in (ROOT / d).rglob("*.py"))


def test_every_room_depends_one_way():
    files = _product_files()
    rooms = {room_of(_module_of(p)) for p in files}
    assert rooms >= set(ALLOWED), set(ALLOWED) - rooms  # every room has files, and is checked
    roomless = [str(p.relative_to(ROOT)) for p in files if room_of(_module_of(p)) is None and p.name != "__init__.py"]
    assert roomless == [], roomless  # a module outside every room would go unchecked
    found = [hit for path in files for hit in _back_imports(path.read_text(), path)]
    assert found == [], found


def test_the_allowed_arrows_are_used_and_point_one_way():
    """The table holds no circle (a room that may import another may not be imported by it), and each arrow of it is
    one the code really takes: a stale arrow would let a back import in unnoticed."""
    for room, others in ALLOWED.items():
        for other in others:
            assert room not in ALLOWED[other], (room, other)
    taken = {(room_of(_module_of(p)), room_of(name)) for p in _product_files()
             for _, name in _imports(p.read_text(), _module_of(p), p.name == "__init__.py")
             if name.startswith("onepass.")}
    unused = {(room, other) for room, others in ALLOWED.items() for other in others} - taken
    assert unused == set(), unused


def test_the_core_does_import_the_backends():
    """The check reads real imports: the core's engine imports the backends' base (the direction that is allowed)."""
    path = RUNTIME / "core" / "engine.py"
    names = {name for _, name in _imports(path.read_text(), _module_of(path), False)}
    assert "onepass.runtime.backends.base.Backend" in names and "onepass.runtime.backends.batch.PackedBatch" in names


def test_one_back_import_fails_it():
    """Negative controls: a back import in a backend module, written many ways; from core to server, tools or the
    teacher; from export to calibration; from the teacher to the server; from the server to the tools."""
    backend = RUNTIME / "backends" / "ort.py"
    for source in ["from ..core.tree import pack\n", "from ..core import manifest\n", "from .. import core\n",
                   "import onepass.runtime.core.errors\n",
                   "def lazy():\n    import importlib\n    importlib.import_module('onepass.runtime.core.selfcheck')\n",
                   "def lazy():\n    from ...runtime.server import errors\n",
                   "import importlib\nimportlib.import_module('..core.tree', __package__)\n",
                   "__import__('onepass.runtime.core.errors')\n", "from ... import runtime\n",
                   "import onepass.cli\n", "TABLE = {'x': ('onepass.runtime.server.app', 'App')}\n"]:
        assert _back_imports(source, backend), source
    engine = RUNTIME / "core" / "engine.py"
    for source in ["from ..server.errors import http_error\n", "from ..tools.bench import run\n",
                   "from ..teacher.client import connect\n"]:
        assert _back_imports(source, engine), source
    assert _back_imports("from ..calibration.heads.head import load\n", ROOT / "export" / "build.py")
    assert _back_imports("from ..server.app import App\n", RUNTIME / "teacher" / "client.py")
    assert _back_imports("from ..tools.bench import run\n", RUNTIME / "server" / "app.py")
    assert _back_imports("from ..calibration import tune\n", RUNTIME / "server" / "app.py")
    assert _back_imports("from . import contract\n", backend) == []  # a sibling is fine
    assert _back_imports('"""See onepass.runtime.core.engine."""\n', backend) == []  # a docstring names, not imports
    assert _back_imports("from ..backends.base import Backend\n", engine) == []
    assert _back_imports("from ...export.build import export_engine\n", ROOT / "calibration" / "tune" / "engine.py") == []
    heads = ROOT / "calibration" / "heads" / "head.py"
    for source in ["from ..tune.candidates import choose\n", "from ..measure.calibrate import score_rows\n",
                   "from ...runtime.server.app import App\n"]:
        assert _back_imports(source, heads), source  # inside calibration too: a lower room never climbs back
    assert _back_imports("from ..scoring.metrics import target_nll\n", heads) == []
