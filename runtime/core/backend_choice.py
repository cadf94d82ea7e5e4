"""The default backend of an engine (the name ``auto``, what ``Engine.load`` uses when given no backend): the fastest
CPU path that keeps the answers. OpenVINO's CPU plugin at f32 (1.32x ONNX Runtime on a 511-token state,
log-likelihoods within 1e-4: benchmarks/results/precision_eval.md) where it is installed, the engine is a plain fp32
graph and OpenVINO reproduces the engine's golden file at the fp32 tolerances on this machine (checked once per graph
and process); otherwise ONNX Runtime on CPU, the reference.

The choice reads the engine's manifest and golden file, so it is the core's (core -> backends, never back)."""

from __future__ import annotations

import importlib.util
import logging
import threading

from ..backends import factory
from . import selfcheck

log = logging.getLogger("onepass.backends")

FASTEST_EXACT_CPU = "openvino-cpu"

_verdicts: dict = {}  # the sha256s of graph, weights and golden file -> None (OpenVINO passed) or why it did not
_verdicts_lock = threading.Lock()


def _openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def _reference(root, manifest, threads, why: str, quiet: bool = False):
    """ONNX Runtime on CPU, the default's fallback, with the reason OpenVINO was passed over in the log."""
    log.log(logging.DEBUG if quiet else logging.WARNING, "%s: backend onnxruntime, not %s (%s)", root,
            FASTEST_EXACT_CPU, why)
    return factory("onnxruntime")(root, manifest, threads)


def default(root, manifest, threads=None):
    """The default backend of an engine (the name ``auto``): OpenVINO at f32 when it is installed, the graph is a
    plain fp32 one and OpenVINO reproduces the golden file here at the fp32 tolerances; else ONNX Runtime on CPU.
    Why OpenVINO was passed over is logged (at debug level when it is simply not installed)."""
    if not _openvino_installed():  # an extra not installed: the reference, quietly
        return _reference(root, manifest, threads, "openvino is not installed: pip install 'onepass[openvino]'",
                          quiet=True)
    if manifest.precision != "fp32" or manifest.quantization is not None:
        return _reference(root, manifest, threads,
                          f"a {manifest.precision}{' INT8' if manifest.quantization else ''} engine")
    backend = None
    key = tuple(sorted((name, sha) for name, sha in manifest.files.items()  # the graph, its weights and golden file:
                       if name.startswith(manifest.graph) or name == manifest.golden))  # copies share the verdict
    with _verdicts_lock:
        verdict = _verdicts.get(key, "unchecked")
        if verdict == "unchecked" or verdict is None:  # a graph that failed before is not compiled again
            try:
                backend = factory(FASTEST_EXACT_CPU)(root, manifest, threads)
                if verdict == "unchecked":
                    diffs = selfcheck.run_golden_on(backend, root, manifest)
                    bad = selfcheck.over_tolerance(diffs, selfcheck.TOLERANCES)
                    verdict = f"it does not reproduce the golden file: {bad}" if bad else None
            except Exception as err:  # noqa: BLE001 - any failure of the optional fast path (a compile error):
                verdict = f"{type(err).__name__}: {err}"  # the reference backend serves instead
            _verdicts[key] = verdict
    if verdict is None:
        log.info("%s: backend %s (the golden file reproduced here)", root, FASTEST_EXACT_CPU)
        return backend
    if backend is not None:
        backend.close()
    return _reference(root, manifest, threads, verdict)
