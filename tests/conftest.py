"""Shared fixtures: one real engine (the default SmolLM2 model) exported once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:  # a worker crash under `make test` (pytest-xdist --dist loadfile) costs one test, not a hung run
    from xdist_recovery import (  # noqa: F401
        pytest_configure,
        pytest_handlecrashitem,
        pytest_runtest_setup,
        pytest_xdist_make_scheduler,
    )
except ImportError:  # pytest without pytest-xdist
    pass


ROOT = Path(__file__).resolve().parent.parent
if os.environ.get("PYTEST_XDIST_WORKER"):  # make test: two workers on two cores
    # torch's OpenMP threads spin while they wait; two workers with two threads each fight over two cores (the head
    # training test: 2.9 s with one thread, 14 s with two, in `make test-fast`). Set before any test imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def serve_process(engine: Path, port: int, log: Path, *args: str, seconds: float = 180, **popen):
    """``onepass serve`` of ``engine`` on ``port`` in a process of its own (output to ``log``), once ``/readyz``
    says ready; returns (url, process). Fails with the log's tail when it dies or is not ready in ``seconds``."""
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "onepass", "serve", "--engine", str(engine), "--port", str(port),
                                 *args], stdout=fh, stderr=fh, **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return url, proc
        except (urllib.error.URLError, OSError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


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
    from onepass.export.build import export_engine
    from onepass.runtime.core.paths import cache_root

    cached = cache_root() / "test-engines" / f"smollm2-{export_fingerprint()}"
    _cached(cached, cached, lambda: export_engine(cached))
    return cached


def _cached(folder: Path, engine: Path, build, also: tuple = ()) -> None:
    """Keep ``folder`` if the engine at ``engine`` is whole (its manifest present, every file's hash verified) and
    the ``also`` paths exist, else ``build()`` it; under a file lock, so that of several pytest-xdist workers one
    builds and the others wait and find it done."""
    from filelock import FileLock

    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.errors import OnepassError

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if (engine / "manifest.json").is_file() and all(p.exists() for p in also):
            try:
                mf.load(engine, verify=True)  # a damaged cache is made again
                return
            except OnepassError:
                pass
        build()


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


TINY_RECIPE = "llama-tiny-v1"  # bump when the recipe below changes: the cached tiny models are made again


def _tiny_fingerprint() -> str:
    """What the tiny Llama and its engine are made from: the recipe, the export code and SmolLM2's tokenizer (as in
    export_fingerprint), and the torch and transformers versions that draw the random weights."""
    import hashlib

    import torch
    import transformers

    return hashlib.sha256(f"{TINY_RECIPE}:{export_fingerprint()}:{torch.__version__}:{transformers.__version__}"
                          .encode()).hexdigest()[:16]


def _build_tiny_llama(folder: Path) -> None:
    """A tiny random Llama (SmolLM2's architecture and tokenizer, 2 blocks of width 64) saved as a Hugging Face
    folder. Its norms are random too: all-ones norms would be merged into one initializer by the ONNX optimizer."""
    import torch
    import transformers

    from onepass.export.model_source import default_tokenizer

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


@pytest.fixture(scope="session")
def tiny_models() -> tuple[Path, Path]:
    """(Hugging Face folder, engine directory) of the tiny Llama: what structure tests (tuning, heads, precisions,
    the cluster, the TensorRT stand-in) run on, in seconds instead of a SmolLM2 export each. Made once and cached
    across test sessions and pytest-xdist workers under $ONEPASS_CACHE/test-engines/llama-tiny-<fingerprint>
    (the engine's manifest is written last and its hashes are verified on each use: a half-made or damaged cache is
    made again)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import shutil

    from onepass.export.build import export_engine
    from onepass.runtime.core.paths import cache_root

    cached = cache_root() / "test-engines" / f"llama-tiny-{_tiny_fingerprint()}"
    model, engine = cached / "model", cached / "engine"

    def build():
        shutil.rmtree(cached, ignore_errors=True)  # made in place: the engine records its model's path
        _build_tiny_llama(model)
        export_engine(engine, str(model))  # the engine's manifest comes last: present means the whole is there

    _cached(cached, engine, build, also=(model / "config.json",))
    return model, engine


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models) -> Path:
    """The tiny Llama as a Hugging Face folder (see ``tiny_models``); tests must not write into it."""
    return tiny_models[0]


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_models) -> Path:
    """The tiny Llama's engine (a normal engine: golden file, self-check, manifest); tests copy it to change it."""
    return tiny_models[1]


ENGINE_FIXTURES = {"engine_dir", "hf_model"}  # what exports or loads the default model
# The slowest files, slowest first (seconds on 2 cores under two workers, from a fresh cache, tests/ timed with
# --durations=0 on 2026-12-02). `make test` runs two pytest-xdist workers that take whole files in this order (--dist
# loadfile --no-loadscope-reorder): longest-processing-time-first keeps the two busy to the end. The first file needs
# only the tiny Llama and the second starts the SmolLM2 export at once, so one worker exports while the other runs
# the cluster. Files not listed follow in their usual order.
SLOWEST_FIRST = ("test_cluster.py",  # 88 s, a real Ray Serve cluster of the tiny Llama
                 "test_calibration.py",  # 78 s, 65 s of it the SmolLM2 export its first test waits for
                 "test_teacher.py",  # ~110 s, the tiny Llama: a tuned teacher and a dozen `onepass serve` processes
                 "test_task_heads.py",  # ~100 s, the tiny Llama: tasks exported and tuned
                 "test_hardening.py", "test_server.py",  # 53-57 s
                 "test_precision.py", "test_torch_backend.py", "test_engine.py", "test_blocks.py",  # 22-30 s
                 "test_tune.py", "test_hf_dir.py", "test_bench.py", "test_openvino_backend.py",  # 16-19 s
                 "test_tensorrt_backend.py", "test_quantize.py")  # 11-13 s, the tiny Llama only


def pytest_collection_modifyitems(config, items):
    """A test that needs the default model, through any chain of fixtures, is ``slow``: the marker follows the
    fixtures, so ``-m "not slow"`` (``make test-fast`` adds ``and not install``) never exports or loads the model."""
    asked_for_archs = "archs" in (config.getoption("-m") or "")
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if "archs" in item.keywords and not asked_for_archs:
            item.add_marker(pytest.mark.skip(reason="every TensorRT architecture: run with -m archs"))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
