"""Shared fixtures: one real engine (the default SmolLM2 model) exported once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
if os.environ.get("PYTEST_XDIST_WORKER"):  # make test: two workers on two cores
    # torch's OpenMP threads spin while they wait; two workers with two threads each fight over two cores (the head
    # training test: 2.9 s with one thread, 14 s with two, in `make test-fast`). Set before any test imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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
    from filelock import FileLock

    from onepass import Engine
    from onepass.export.build import export_engine
    from onepass.runtime.errors import OnepassError
    from onepass.runtime.paths import cache_root

    cached = cache_root() / "test-engines" / f"smollm2-{export_fingerprint()}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{cached}.lock"):  # pytest-xdist workers: one exports, the others wait and load it
        if (cached / "manifest.json").is_file():
            try:
                Engine.load(cached)  # every file's hash verified: a damaged cache is exported again
                return cached
            except OnepassError:
                pass
        return export_engine(cached)


@pytest.fixture(scope="session")
def engine(engine_dir):
    """The engine loaded once; tests must not change its manifest. On ONNX Runtime, the reference backend (the
    default's fallback everywhere), or on the backend that $ONEPASS_TEST_BACKEND names (``auto``, ``openvino-cpu``,
    ...): every test of the ``engine`` fixture — parity with transformers, packed equals alone, the server and SDK
    tests — then runs on that backend."""
    from onepass import Engine

    return Engine.load(engine_dir, backend=os.environ.get("ONEPASS_TEST_BACKEND") or "onnxruntime")


@pytest.fixture(scope="session")
def hf_model():
    """The same weights in transformers (float32, eager), the default adapter merged by peft: the independent
    reference."""
    from onepass.export.adapter import resolve
    from onepass.export.model_source import load_model

    return load_model(None, resolve(None, None)).model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (SmolLM2's architecture and tokenizer, 2 blocks of width 64) as a Hugging Face folder:
    what structure tests (tuning, heads, precisions) run on, in seconds instead of a SmolLM2 export each. Its norms
    are random too: all-ones norms would be merged into one initializer by the ONNX optimizer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from onepass.export.model_source import default_tokenizer

    folder = tmp_path_factory.mktemp("llama-tiny")
    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.2,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama exported once per session (a normal engine: golden file, self-check, manifest)."""
    from onepass.export.build import export_engine

    return export_engine(tmp_path_factory.mktemp("tiny-engine") / "llama-tiny", str(tiny_llama_dir))


ENGINE_FIXTURES = {"engine_dir", "hf_model"}  # what exports or loads the default model
# The slowest files, slowest first (seconds on 2 cores, tests/ timed with --durations=0 on 2026-12-02). `make test`
# runs two pytest-xdist workers that take whole files in this order (--dist loadfile --no-loadscope-reorder):
# longest-processing-time-first keeps the two busy to the end, and the leading files need no SmolLM2, so one
# worker runs them while the other exports it. Files not listed follow in their usual order.
SLOWEST_FIRST = ("test_cluster.py",  # 74 s, the tiny Llama only
                 "test_quantize.py",  # 55 s
                 "test_hf_dir.py",  # 17 s, tiny Qwen3 exports only
                 "test_calibration.py", "test_server.py", "test_hardening.py",  # 37-44 s
                 "test_torch_backend.py",  # 37 s before its logic tests moved to the tiny Llama
                 "test_precision.py", "test_blocks.py", "test_bench.py", "test_tune.py", "test_engine.py",  # 16-27 s
                 "test_tensorrt_backend.py")  # 14 s, the tiny Llama only


def pytest_collection_modifyitems(config, items):
    """A test that needs the default model, through any chain of fixtures, is ``slow``: the marker follows the
    fixtures, so ``-m "not slow"`` (``make test-fast``) never exports or loads the model."""
    asked_for_archs = "archs" in (config.getoption("-m") or "")
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if "archs" in item.keywords and not asked_for_archs:
            item.add_marker(pytest.mark.skip(reason="every TensorRT architecture: run with -m archs"))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
