"""Shared fixtures: one real engine (the default SmolLM2 model) exported once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    """An engine directory of the default model. ONEPASS_TEST_ENGINE reuses a prebuilt one (local runs)."""
    prebuilt = os.environ.get("ONEPASS_TEST_ENGINE")
    if prebuilt:
        return Path(prebuilt)
    from onepass.export.build import export_engine

    return export_engine(tmp_path_factory.mktemp("engine") / "smollm2")


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
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
