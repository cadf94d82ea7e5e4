"""The default backend of an engine (the name ``auto``, what ``Engine.load`` uses when given no backend): the fastest
CPU path that keeps the answers. OpenVINO's CPU plugin at f32 (1.32x ONNX Runtime on a 511-token state,
log-likelihoods within 1e-4: benchmarks/results/precision_eval.md) where it is installed, the engine is a plain fp32
graph and OpenVINO reproduces the engine's golden file at the fp32 tolerances on this machine (checked once per graph
and process); otherwise ONNX Runtime on CPU, the reference. OpenVINO computes the graph in bf16 instead where the
engine carries a measured guarantee that holds on this CPU's kind (``core.guarantee``; ``onepass guarantee``).

The choice reads the engine's manifest and golden file, so it is the core's (core -> backends, never back)."""

from __future__ import annotations

import importlib.util
import logging
import threading

from ..backends import factory
from . import selfcheck
from .manifest import graph_files
from .guarantee import BF16, cpu_bf16_kind, fingerprint, misses

log = logging.getLogger("onepass.backends")

FASTEST_EXACT_CPU = "openvino-cpu"

_verdicts: dict = {}  # (backend, the sha256s of graph, weights and golden file) -> None (it passed) or why it did not
_verdicts_lock = threading.Lock()


def _openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def _reference(root, manifest, threads, why: str, quiet: bool = False):
    """ONNX Runtime on CPU, the default's fallback, with the reason OpenVINO was passed over in the log."""
    log.log(logging.DEBUG if quiet else logging.WARNING, "%s: backend onnxruntime, not %s (%s)", root,
            FASTEST_EXACT_CPU, why)
    return factory("onnxruntime")(root, manifest, threads)


def default(root, manifest, threads=None):
    """The default backend of an engine (the name ``auto``): OpenVINO when it is installed, the graph is a plain
    fp32 one and OpenVINO reproduces the golden file here; in bf16 where the engine's measured guarantee holds on
    this CPU's kind (``core.guarantee``), else at f32 (the fp32 tolerances); else ONNX Runtime on CPU. Why a faster
    path was passed over is logged (at debug level when OpenVINO is simply not installed, or no guarantee exists)."""
    if not _openvino_installed():  # an extra not installed: the reference, quietly
        return _reference(root, manifest, threads, "openvino is not installed: pip install 'onepass[openvino]'",
                          quiet=True)
    if manifest.precision != "fp32" or manifest.quantization is not None:
        return _reference(root, manifest, threads,
                          f"a {manifest.precision}{' INT8' if manifest.quantization else ''} engine")
    key = tuple(sorted([*graph_files(manifest),  # the graph, its weights and golden file: copies share the verdict
                        *((n, s) for n, s in manifest.files.items() if n == manifest.golden)]))
    faster = _bf16_if_guaranteed(root, manifest, threads, key)
    if faster is not None:
        return faster
    backend, verdict = _checked(FASTEST_EXACT_CPU, root, manifest, threads, key, selfcheck.TOLERANCES)
    if verdict is None:
        log.info("%s: backend %s (the golden file reproduced here)", root, FASTEST_EXACT_CPU)
        return backend
    return _reference(root, manifest, threads, verdict)


def _bf16_if_guaranteed(root, manifest, threads, key):
    """OpenVINO in bf16 where the engine's guarantee holds on this CPU (and it reproduces the golden file at the bf16
    tolerances), else None, with the reason logged."""
    guarantee, cpu = manifest.guarantees.get(BF16), cpu_bf16_kind()
    why = misses(guarantee, cpu, fingerprint(manifest))
    if why is None:
        backend, why = _checked(BF16, root, manifest, threads, key, selfcheck.BF16_TOLERANCES)
        if why is None:
            log.info("%s: backend %s (its measured guarantee holds on this %s CPU)", root, BF16, cpu)
            return backend
    log.log(logging.INFO if guarantee else logging.DEBUG, "%s: fp32, not %s (%s)", root, BF16, why)
    return None


def _checked(name, root, manifest, threads, key, tolerances):
    """(the backend called ``name``, None) when it reproduces the golden file within ``tolerances`` (checked once per
    graph and process), else (None, why not)."""
    backend = None
    with _verdicts_lock:
        verdict = _verdicts.get((name, key), "unchecked")
        if verdict == "unchecked" or verdict is None:  # a graph that failed before is not compiled again
            try:
                backend = factory(name)(root, manifest, threads)
                if verdict == "unchecked":
                    diffs = selfcheck.run_golden_on(backend, root, manifest)
                    bad = selfcheck.over_tolerance(diffs, tolerances)
                    verdict = f"it does not reproduce the golden file: {bad}" if bad else None
            except Exception as err:  # noqa: BLE001 - any failure of the optional fast path (a compile error):
                verdict = f"{type(err).__name__}: {err}"  # the reference backend serves instead
            _verdicts[(name, key)] = verdict
    if verdict is not None and backend is not None:
        backend.close()
        backend = None
    return backend, verdict
