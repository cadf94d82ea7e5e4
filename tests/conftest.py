"""Shared fixtures: one real engine (the default SmolLM2 model) exported once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent


def fuzz_cases(default: int) -> int:
    """A fuzz test's number of cases: ``default`` (what CI runs) times $ONEPASS_FUZZ (default 1; 0.1 for a quick
    local run, 10 for a long one), at least 50."""
    return max(50, int(default * float(os.environ.get("ONEPASS_FUZZ", "1"))))


def export_fingerprint() -> str:
    """What the default engine is made from: the export and runtime code, the shipped adapter and the model's
    GGUF (path, size, mtime). Any change there gives a new fingerprint, hence a fresh export."""
    import hashlib

    from onepass.export.model_source import default_gguf

    digest = hashlib.sha256()
    for folder in ("export", "runtime"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    gguf = default_gguf()
    digest.update(f"{gguf}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    """An engine directory of the default model, exported once and cached across test sessions under
    $ONEPASS_CACHE/test-engines/<fingerprint> (a clean clone exports once). ONEPASS_TEST_ENGINE names a
    prebuilt one instead (local runs)."""
    prebuilt = os.environ.get("ONEPASS_TEST_ENGINE")
    if prebuilt:
        return Path(prebuilt)
    from onepass import Engine
    from onepass.export.build import export_engine
    from onepass.runtime.errors import OnepassError
    from onepass.runtime.paths import cache_root

    cached = cache_root() / "test-engines" / f"smollm2-{export_fingerprint()}"
    if (cached / "manifest.json").is_file():
        try:
            Engine.load(cached)  # every file's hash verified: a damaged cache is exported again
            return cached
        except OnepassError:
            pass
    cached.parent.mkdir(parents=True, exist_ok=True)
    return export_engine(cached)


@pytest.fixture(scope="session")
def engine(engine_dir):
    """The engine loaded once; tests must not change its manifest."""
    from onepass import Engine

    return Engine.load(engine_dir)


@pytest.fixture(scope="session")
def hf_model():
    """The same weights in transformers (float32, eager), the default adapter merged by peft: the independent
    reference."""
    from onepass.export.adapter import resolve
    from onepass.export.model_source import load_model

    return load_model(None, resolve(None, None)).model


ENGINE_FIXTURES = {"engine_dir", "hf_model"}  # what exports or loads the default model


def pytest_collection_modifyitems(config, items):
    """A test that needs the default model, through any chain of fixtures, is ``slow``: the marker follows the
    fixtures, so ``-m "not slow"`` (``make test-fast``) never exports or loads the model."""
    asked_for_archs = "archs" in (config.getoption("-m") or "")
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if "archs" in item.keywords and not asked_for_archs:
            item.add_marker(pytest.mark.skip(reason="every TensorRT architecture: run with -m archs"))
