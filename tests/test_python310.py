"""The runtime and the server must run on Python 3.10 (JetPack 6 / Ubuntu 22.04): checked statically here.

Syntax is parsed with Python 3.10's grammar; standard-library names added in 3.11 and regular-expression
features of 3.11 (possessive quantifiers, atomic groups) are refused. (The whole server suite was also run
on a real Python 3.10 with the 3.10 pins; see docs/gpu.md, "GPU and edge".)
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
RUNTIME = sorted((ROOT / "runtime").rglob("*.py")) + [ROOT / "__init__.py", ROOT / "__main__.py"]
NEW_IN_311 = {"tomllib", "ExceptionGroup", "TaskGroup", "Self", "LiteralString", "Never", "assert_never",
              "reveal_type", "StrEnum", "UTC", "add_note", "exception_group", "TypeVarTuple", "Unpack",
              "Required", "NotRequired", "dataclass_transform", "override"}
REGEX_311 = re.compile(r"[*+?}]\+|\(\?>")  # possessive quantifiers, atomic groups


def _problems(path: Path) -> list:
    source = path.read_text()
    tree = ast.parse(source, filename=str(path), feature_version=(3, 10))
    found = []
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n and n.split(".")[0] in NEW_IN_311]
        elif name in NEW_IN_311:
            found.append(f"{path.name}:{node.lineno} {name}")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("compile", "match", "search", "sub",
                                                                               "fullmatch", "findall", "finditer"):
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, (str, bytes)):
                    pattern = arg.value.decode("latin-1") if isinstance(arg.value, bytes) else arg.value
                    if REGEX_311.search(pattern.replace("\\\\", "").replace("\\+", "").replace("\\*", "")):
                        found.append(f"{path.name}:{node.lineno} regex {pattern!r} needs Python 3.11")
    return found


def test_runtime_and_server_are_python_310_code():
    assert [p for path in RUNTIME for p in _problems(path)] == []


def test_the_310_check_catches_what_broke_once(tmp_path):
    """Negative control: the possessive-quantifier regex that failed on 3.10, and a 3.11-only import."""
    bad = tmp_path / "bad.py"
    bad.write_text("import re\nimport tomllib\nS = re.compile(rb'\"(?:[^\"\\\\\\\\]++|\\\\\\\\.)*+\"')\n")
    assert len(_problems(bad)) == 2, _problems(bad)
