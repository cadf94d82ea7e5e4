"""The Jetson image's pins resolve for its Python: CPython 3.10 on aarch64 (JetPack 6, Ubuntu 22.04, glibc 2.35).

Every exact pin the image installs — its lock ``constraints/jetson.txt`` (within pyproject's ranges) and the pins
written in ``docker/Dockerfile.jetson`` — must have a wheel PyPI serves
for cp310 aarch64 whose Requires-Python admits 3.10 (the image has no compiler for an sdist). Read from PyPI's
JSON API; nothing is downloaded. ``filelock==4.3.1`` (Requires-Python >= 3.11) and ``hdrhistogram`` (no aarch64
wheel) once broke the build. Skipped only when PyPI cannot be reached.
"""

import json
import re
import tomllib
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
MARKERS = {"python_version": "3.10", "python_full_version": "3.10.12", "platform_machine": "aarch64",
           "sys_platform": "linux", "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}
PLATFORMS = [f"manylinux_2_{minor}_aarch64" for minor in range(35, 16, -1)] + ["manylinux2014_aarch64",
                                                                                "linux_aarch64"]
TAGS = set(cpython_tags((3, 10), platforms=PLATFORMS)) | set(compatible_tags((3, 10), "cp310", PLATFORMS))
NOT_ON_PYPI = {"torch"}  # the Jetson AI Lab index's CUDA build (Dockerfile's TORCH_INDEX): not on PyPI


def image_pins() -> list[Requirement]:
    """The exact pins the Jetson image installs: its lock (constraints/jetson.txt) and the pins written in the
    Dockerfile."""
    texts = [line.split("#", 1)[0].strip() for line in (ROOT / "constraints" / "jetson.txt").read_text().splitlines()]
    texts = [t for t in texts if t]
    docker = (ROOT / "docker" / "Dockerfile.jetson").read_text().replace("\\\n", " ")
    for line in docker.splitlines():
        if "pip install" in line:
            texts += [t.strip("'\"") for t in line.split() if re.fullmatch(r"['\"]?[A-Za-z0-9_.\-]+==[\w.]+['\"]?", t)]
    return [Requirement(t) for t in texts]


def declared() -> dict[str, list[Requirement]]:
    """pyproject's requirements of the runtime and every extra that apply on cp310 aarch64, by canonical name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, list[Requirement]] = {}
    for text in project["dependencies"] + [t for extra in project["optional-dependencies"].values() for t in extra]:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(MARKERS):
            out.setdefault(canonicalize_name(req.name), []).append(req)
    return out


@lru_cache(maxsize=None)
def release_files(name: str, version: str) -> list[dict]:
    try:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{canonicalize_name(name)}/json", timeout=60) as r:
            return json.load(r)["releases"].get(version, [])
    except urllib.error.URLError as err:
        pytest.skip(f"PyPI's JSON API cannot be reached here ({err})")


def installable(name: str, version: str) -> str | None:
    """None when a cp310 aarch64 wheel admitting Python 3.10 exists; else why not."""
    files = release_files(name, version)
    if not files:
        return f"{name}=={version} is not on PyPI"
    wheels = [f for f in files if f["filename"].endswith(".whl")
              and TAGS & set(parse_wheel_filename(f["filename"])[3])]
    if not wheels:
        return (f"{name}=={version} has no wheel for cp310 aarch64 (only {len(files)} other files; an sdist needs "
                "a compiler)")
    if not any(SpecifierSet(f.get("requires_python") or "").contains("3.10") for f in wheels):
        return f"{name}=={version} requires Python {wheels[0]['requires_python']}"
    return None


def test_the_image_pins_are_read_from_its_lock_and_the_dockerfile():
    names = {canonicalize_name(r.name) for r in image_pins()}
    assert {"numpy", "tokenizers", "onnxruntime", "fastapi", "transformers", "filelock", "cuda-bindings"} <= names


def test_the_jetson_lock_covers_what_the_image_installs_within_pyprojects_ranges():
    """Every requirement of the runtime and the serve extra that applies on cp310 aarch64 is pinned in the lock, and
    every pin lies within the declared range (but JetPack's own: cuda-bindings 12.x for its CUDA, not the [trt]
    extra's, and the Jetson AI Lab's torch build, not the [export] extra's)."""
    pins = {canonicalize_name(r.name): next(iter(r.specifier)).version for r in image_pins()}
    ranges = declared()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {canonicalize_name(Requirement(t).name) for t in project["dependencies"] + project["optional-dependencies"]["serve"]
              if Requirement(t).marker is None or Requirement(t).marker.evaluate(MARKERS)}
    assert needed <= set(pins), sorted(needed - set(pins))
    outside = [f"{n}=={v} not in {r.specifier}" for n, v in pins.items() if n in ranges and n not in {"cuda-bindings", *NOT_ON_PYPI}
               for r in ranges[n] if not r.specifier.contains(v)]
    assert not outside, outside


def test_every_jetson_pin_has_a_cp310_aarch64_wheel_that_admits_python_3_10():
    problems = []
    for req in image_pins():
        if canonicalize_name(req.name) in NOT_ON_PYPI:
            continue
        (spec,) = req.specifier
        assert spec.operator == "==", f"{req}: the image installs exact pins"
        why = installable(req.name, spec.version)
        if why:
            problems.append(why)
    assert not problems, problems


def test_negative_control_the_pins_that_broke_the_image_are_refused():
    assert "requires Python >=3.11" in installable("filelock", "4.3.1")
    assert "no wheel for cp310 aarch64" in installable("hdrhistogram", "0.10.8")
    assert installable("filelock", "4.1.0") is None
