"""A Python environment with exactly a machine image's packages importable, made from this one by links.

The lent GPU machine has a fixed package set and fetches nothing (``benchmarks/h200_image.txt``). To rehearse a
device check on a CPU, ``image_site(names, dest)`` builds a folder holding links to the top-level modules and the
``.dist-info`` folders of those distributions and of everything they require (markers evaluated for this
interpreter, extras not followed), and ``image_python(site, dest)`` a ``python`` that starts without site-packages
(``-S``) and with that folder on its path: an import of anything else fails as it would there (``find_spec`` says
None, ``importlib.metadata`` knows nothing of it), unlike a meta-path hook that refuses imports but leaves the
packages visible to availability checks.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import stat
import sys
from pathlib import Path

from packaging.requirements import Requirement


def read_image(path: Path) -> list[str]:
    """The distribution names of an image list (one per line, ``#`` comments; ``!name``: known absent)."""
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def _key(name: str) -> str:
    return name.lower().replace("_", "-")


def closure(names: list[str]) -> dict[str, md.Distribution]:
    """Normalised name -> installed distribution, for ``names`` and their requirements (those installed here),
    leaving out the ``!name`` entries even where something requires them."""
    absent = {_key(n[1:]) for n in names if n.startswith("!")}
    found: dict[str, md.Distribution] = {}
    todo = [n for n in names if not n.startswith("!")]
    while todo:
        name = todo.pop()
        key = _key(name)
        if key in found or key in absent:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # in the image, not installed here (cupy, jax, triton on a CPU machine)
        found[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def _tops(dist: md.Distribution) -> set[str]:
    """The top-level files and folders a distribution installed (its modules, packages and .dist-info)."""
    tops = set()
    for f in dist.files or []:
        part = f.parts[0]
        if part in ("..", "__pycache__") or part.endswith(".data"):
            continue
        tops.add(part)
    return tops


def image_site(names: list[str], dest: Path) -> Path:
    """A folder of links to the modules of ``names`` and their requirements."""
    dest.mkdir(parents=True, exist_ok=True)
    for dist in closure(names).values():
        base = Path(dist.locate_file(""))
        for top in _tops(dist):
            src = base / top
            if src.exists() and not (dest / top).exists():
                (dest / top).symlink_to(src)
    return dest


def image_python(site: Path, dest: Path) -> Path:
    """An executable ``python`` that sees the standard library and ``site`` only."""
    exe = dest / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def image_env(names: list[str], dest: Path) -> dict:
    """The environment variables of a subprocess that runs in the image: PYTHON (the interpreter to use) and a
    PATH on which ``python3``/``python`` are that interpreter."""
    site = image_site(names, dest / "site")
    bin_dir = dest / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = image_python(site, bin_dir)
    for alias in ("python3",):
        (bin_dir / alias).symlink_to(exe)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(exe), PATH=f"{bin_dir}:{env.get('PATH', '')}")
    return env
