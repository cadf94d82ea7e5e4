"""Requirements for installing onepass on a base image that pins its own packages (NGC PyTorch images).

NGC PyTorch images set ``PIP_CONSTRAINT=/etc/pip/constraint.txt``, which pins every package the
image ships (numpy, onnx, ...). pip then refuses any other version of those, so installing the
project's lock over them fails to resolve. This prints the project's requirements (the
dependencies, the extras asked for, and any more requirements given) for this Python, with no version
for every package the constraint file already pins: those stay at the base image's versions (the
image's own torch was built and tested against them). Every other package gets the lock's exact version
(``--lock``, the one CI tested) where the lock has it, else the project's declared range.

    python docker/constrained_requirements.py pyproject.toml --extras serve --lock constraints/ci.txt \
        --also transformers accelerate ... > requirements.txt
    pip install -r requirements.txt          # PIP_CONSTRAINT stays in force

Standard library plus ``packaging`` (present in every pip-capable image).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def constrained_names(path: str | None) -> set[str]:
    """Canonical names of the packages a pip constraint file pins (none when there is no file)."""
    if not path or not Path(path).is_file():
        return set()
    names = set()
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(canonicalize_name(re.split(r"[\s=<>!~;\[@]", line, maxsplit=1)[0]))
    return names


def locked(path: str | None) -> dict[str, str]:
    """canonical name -> version of a lock of ``name==version`` lines (none without a file)."""
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines() if path else []:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version.strip()
    return out


def requirements(pyproject: Path, extras: list[str], also: list[str], pinned_by_base: set[str],
                 lock: dict[str, str] | None = None) -> list[str]:
    """The lines to install: markers evaluated for this Python, base-pinned packages left unpinned, the others at
    the lock's version (checked against the declared range) or, unlocked, at the declared range."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    specs = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in project.get("optional-dependencies", {}):
            raise SystemExit(f"pyproject has no extra {extra!r}")
        specs += project["optional-dependencies"][extra]
    out: dict[str, str] = {}
    for spec in specs + list(also):
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        extra = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        if name in pinned_by_base:
            out[name] = f"{req.name}{extra}"
        elif lock and name in lock:
            if not req.specifier.contains(lock[name], prereleases=True):
                raise SystemExit(f"the lock's {req.name}=={lock[name]} is outside the declared {req.specifier}")
            out[name] = f"{req.name}{extra}=={lock[name]}"
        else:
            out[name] = f"{req.name}{extra}{req.specifier}"
    return list(out.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pyproject", type=Path)
    ap.add_argument("--extras", default="", help="comma-separated extras of the project to include")
    ap.add_argument("--also", nargs="*", default=[], help="more requirements (names, or name + specifier)")
    ap.add_argument("--lock", default=None, help="exact versions for what the base does not pin (constraints/ci.txt)")
    ap.add_argument("--constraint", default=os.environ.get("PIP_CONSTRAINT"),
                    help="the base image's constraint file (default: $PIP_CONSTRAINT)")
    args = ap.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    base = constrained_names(args.constraint)
    lines = requirements(args.pyproject, extras, args.also, base, locked(args.lock))
    kept = sorted(canonicalize_name(Requirement(line).name) for line in lines
                  if canonicalize_name(Requirement(line).name) in base)
    print(f"# left at the base image's version (pinned by {args.constraint}): {', '.join(kept) or 'none'}",
          file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
