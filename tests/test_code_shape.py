"""The runtime stays readable: no function in runtime/ is over 60 lines (argparse tables live in flags.py, outside
it), and the engine's front door stays a front door (engine.py at most 300 lines; its jobs live in planner.py,
states.py, grouping.py and answering.py). A negative control: the same measure finds a long function in a source
written for it."""

from __future__ import annotations

import ast
from pathlib import Path

import onepass

RUNTIME = Path(onepass.__file__).parent / "runtime"
MAX_LINES = 60


def _long_functions(source: str, name: str) -> list[str]:
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]


def test_no_function_in_the_runtime_is_over_60_lines():
    found = [hit for path in sorted(RUNTIME.rglob("*.py"))
             for hit in _long_functions(path.read_text(), str(path.relative_to(RUNTIME)))]
    assert not found, found


def test_the_measure_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert _long_functions(f"def long():\n{body}\n", "sample") == ["sample:1 long (61 lines)"]
    assert not _long_functions("def short():\n    return 1\n", "sample")


def test_the_engine_module_stays_a_front_door():
    lines = len((RUNTIME / "core" / "engine.py").read_text().splitlines())
    assert lines <= 300, f"runtime/core/engine.py is {lines} lines: move a job into a module of its own"
