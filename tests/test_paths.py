"""Every repository path a document, a docstring or a comment names exists: a file moved or renamed without its
references fails here (two such dead references were found by a review: cli.py named benchmarks/readout_eval.md,
which lives under benchmarks/results/, and cluster.py named deploy/serve.yaml, which is docker/ray-serve.yaml)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "export", "calibration", "tests", "benchmarks", "docs", "docker", "constraints")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(FOLDERS) + r")/[\w./-]*)(.?)")
GENERATED = {"constraints/ci.txt.new"}
EXTENSIONS = {"md", "py", "json", "jsonl", "txt", "yaml", "sh", "toml", "npz", "png", "csv", "onnx", "pt", "gguf"}  # make lock's temporary file


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "cli.py", ROOT / "Makefile", ROOT / "pyproject.toml"]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docker").iterdir())
    for folder in ("runtime", "export", "calibration", "benchmarks", "tests"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md") and
                        "results" not in p.parts and "__pycache__" not in p.parts)
    return [f for f in files if f.is_file() and f.name != "test_paths.py"]  # its own examples are dead on purpose


def dead_references(files: list[Path]) -> list[str]:
    dead = []
    for file in files:
        for match in PATH.finditer(file.read_text(encoding="utf-8", errors="replace")):
            path, after = match.group(1).rstrip("."), match.group(2)
            if after in ("{", "<", "*") or path in GENERATED:  # a pattern (results/x.{json,md}), not one path
                continue
            if (ROOT / path).exists():
                continue
            module, _, attribute = path.rpartition(".")  # runtime/tools/loadgen.ExactHistogram: a name in a module
            if module and attribute not in EXTENSIONS and (ROOT / f"{module}.py").exists():
                continue
            target = ROOT / path.rstrip("_")  # an output prefix (--out results/blocks_openvino: .json and .md)
            if target.parent.is_dir() and any(target.parent.glob(target.name + "[._]*")):
                continue
            dead.append(f"{file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}: {path}")
    return dead


def test_every_path_named_in_docs_docstrings_and_comments_exists():
    assert dead_references(_sources()) == []


def test_negative_control_a_dead_reference_is_found(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See benchmarks/readout_eval.md and deploy/serve.yaml, runtime/core/engine.py, "
                   "benchmarks/results/latency.{json,md} and docker/ray-serve.yaml.")
    assert [d.split(": ")[1] for d in dead_references([doc])] == ["benchmarks/readout_eval.md"]


def test_the_design_code_map_matches_the_tree():
    """docs/design.md's code map names files that exist in the folder they are listed under (folders nest by
    indentation: ``runtime/`` then ``  core/``), and every module of the package's folders is named under its own
    folder. Negative control: the map read with one module moved to another folder fails."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"```\n(export/.*?)```", text, flags=re.S).group(1)
    assert _map_problems(block) == ([], [])
    moved = block.replace("    wire.py ", "    xwire.py ").replace("    bench.py ", "    wire.py ")
    assert _map_problems(moved) != ([], [])


def _map_problems(block: str) -> tuple[list, list]:
    """(files the map names that are not in their folder, package modules the map does not name in their folder)."""
    stack: list = []  # (indentation, folder)
    named, missing = set(), []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        folder = re.match(r"^\s*(\w+)/\s", line)
        while stack and stack[-1][0] >= indent and (folder or stack[-1][0] == indent):
            stack.pop()
        if folder:
            stack.append((indent, folder.group(1)))
        where = Path(*(f for _, f in stack)) if stack else Path()
        for name in re.findall(r"\b([a-z_0-9]+\.py)\b", line):
            if (ROOT / where / name).exists() or (not stack and (ROOT / name).exists()):
                named.add((where / name).as_posix() if stack else name)
            else:
                missing.append((where / name).as_posix())
    rooms = ("runtime", "runtime/core", "runtime/server", "runtime/backends", "runtime/tools", "runtime/teacher",
             "export", "calibration", *(f"calibration/{r.name}" for r in (ROOT / "calibration").iterdir()
                                        if (r / "__init__.py").is_file()))
    modules = [p for d in rooms for p in (ROOT / d).glob("*.py") if p.stem != "__init__"]
    modules.append(ROOT / "runtime" / "__init__.py")
    unnamed = sorted(str(p.relative_to(ROOT)) for p in modules if str(p.relative_to(ROOT)) not in named)
    return missing, unnamed
