"""The built wheel as users install it, not the checkout: built with pip from pyproject.toml, installed into a clean
virtual environment with the runtime's dependencies only, and run on the tiny Llama's engine:

* its contents: the package, ``py.typed``, the shipped adapter; no tests, no benchmarks (and nothing in it imports
  them);
* with the lock's versions (constraints/ci.txt): ``onepass --version``, ``onepass check``, ``onepass ask`` and
  ``from onepass import Engine`` without torch, transformers or the server's packages installed;
* beside the lowest versions pyproject.toml allows for the runtime (numpy, tokenizers, onnxruntime, tqdm),
  installed first: the wheel installs without changing any of them and answers as the lock's environment does.

Needs the package index (CI's registries), as ``make`` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
RUNTIME = ("numpy", "tokenizers", "onnxruntime", "tqdm")
pytestmark = pytest.mark.install  # `make test` runs it; `make test-fast` leaves it out
NOT_RUNTIME = ("torch", "transformers", "fastapi", "uvicorn", "openvino", "ray", "peft", "onnx")


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the source tree (setuptools builds in place: build/ and *.egg-info would
    land in the checkout)."""
    import shutil

    source, out = tmp_path_factory.mktemp("source") / "onepass", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "engines", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, source)
    (built,) = out.glob("onepass-*.whl")
    return built


def _venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", path)
    return path / "bin"


def _lowest() -> dict[str, str]:
    """The runtime's declared lower bounds (>=), from pyproject.toml."""
    out = {}
    for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate():
            (low,) = [s.version for s in req.specifier if s.operator == ">="]
            out[req.name] = low
    return out


def _installed(bin_dir: Path) -> dict[str, str]:
    listed = json.loads(_run(bin_dir / "python", "-m", "pip", "list", "--format", "json").stdout)
    return {p["name"].lower(): p["version"] for p in listed}


def _smoke(bin_dir: Path, engine_dir: Path) -> dict:
    """The commands a user runs first; returns the answers of `onepass ask`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    version = _run(bin_dir / "onepass", "--version", env=env, cwd="/").stdout.strip()
    assert version == f"onepass {tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']}"
    checked = _run(bin_dir / "onepass", "check", "--engine", engine_dir, env=env, cwd="/")
    assert checked.stdout.strip().endswith("verified on onnxruntime")
    asked = _run(bin_dir / "onepass", "ask", "--engine", engine_dir, "--state", DATA / "ticket.txt", "--questions",
                 DATA / "questions.json", env=env, cwd="/")
    assert "answered on onnxruntime" in asked.stderr
    code = ("import sys, onepass; from onepass import Engine, Noul; "
            f"e = Engine.load({str(engine_dir)!r}); a = e.ask('I was charged twice.', {{'q': Noul('Billing?')}}); "
            "assert 0 <= a['q'].noul <= 1; "
            "assert not {'torch', 'transformers', 'fastapi'} & set(sys.modules), sorted(sys.modules); "
            "print(onepass.__file__)")
    where = _run(bin_dir / "python", "-c", code, env=env, cwd="/").stdout.strip()
    assert "site-packages" in where and str(ROOT) not in where  # the installed wheel, not the checkout
    return json.loads(asked.stdout)["answers"]


def test_the_wheel_holds_the_package_and_its_type_marker_and_no_tests_or_benchmarks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "onepass/py.typed" in names and "onepass/cli.py" in names and "onepass/runtime/core/engine.py" in names
    packages = sorted(str(p.parent.relative_to(ROOT)) for d in ("runtime", "export", "calibration")
                      for p in (ROOT / d).rglob("__init__.py"))
    missing = [d for d in packages if f"onepass/{d}/__init__.py" not in names]
    assert len(packages) >= 8 and missing == [], missing  # every room of the checkout is in the wheel
    for adapter in ("smollm2-135m-instruct", "smollm2-135m-instruct-compact"):  # the default engine merges both
        for file in ("adapter_model.safetensors", "adapter_config.json", "onepass_adapter.json"):
            assert f"onepass/export/adapters/{adapter}/{file}" in names, (adapter, file)
    assert not [n for n in names if n.startswith(("onepass/tests/", "onepass/benchmarks/", "tests/", "benchmarks/"))]
    sources = [zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".py")]
    assert not [s for s in sources if re.search(r"^\s*(import|from)\s+(onepass\.)?(benchmarks|tests)\b", s, re.M)]


@pytest.fixture(scope="module")
def locked(wheel, tiny_engine_dir, tmp_path_factory) -> tuple[dict, dict]:
    """(installed packages, answers of `onepass ask`) of the wheel installed with the lock's versions."""
    bin_dir = _venv(tmp_path_factory.mktemp("locked") / "venv")
    _run(bin_dir / "python", "-m", "pip", "install", "-q", "-c", ROOT / "constraints" / "ci.txt", wheel)
    return _installed(bin_dir), _smoke(bin_dir, tiny_engine_dir)


def test_the_wheel_with_the_locks_versions_runs_without_torch(locked):
    installed, answers = locked
    assert not [n for n in NOT_RUNTIME if n in installed], installed  # the runtime's dependencies only
    assert set(answers) == {"refund", "team", "frustration"}


def test_the_wheel_installs_beside_the_lowest_allowed_runtime_versions_without_changing_them(
        wheel, tiny_engine_dir, tmp_path, locked):
    """A user's service already on the lowest versions pyproject allows: pip installs the wheel without upgrading
    or downgrading any of them, and the engine answers as with the lock's (newest) versions, within float
    reordering (1e-4)."""
    lowest = _lowest()
    assert set(lowest) == set(RUNTIME)
    bin_dir = _venv(tmp_path / "low")
    _run(bin_dir / "python", "-m", "pip", "install", "-q", *(f"{n}=={v}" for n, v in lowest.items()))
    before = _installed(bin_dir)
    _run(bin_dir / "python", "-m", "pip", "install", "-q", wheel)
    after = _installed(bin_dir)
    assert {n: after[n] for n in lowest} == {n: before[n] for n in lowest} == lowest
    low, new = _smoke(bin_dir, tiny_engine_dir), locked[1]
    assert low.keys() == new.keys()
    for qid, answer in new.items():
        for key in ("noul", "score"):
            if key in answer:
                assert abs(answer[key] - low[qid][key]) <= 1e-4, (qid, answer, low[qid])
        for option, p in answer.get("probabilities", {}).items():
            assert abs(p - low[qid]["probabilities"][option]) <= 1e-4, (qid, answer, low[qid])
