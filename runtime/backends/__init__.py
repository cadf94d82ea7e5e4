"""Inference backends: one table from a backend's name to its class and fixed options, each module imported only
when asked for.

``factory(name, **options)`` gives the ``Engine.load(backend=...)`` factory ``(root, manifest, threads) ->
Backend``: the class's ``open`` with the backend's name and options (every backend has that one shape:
``base.Backend``); ``Engine.load(backend="torch-cuda")`` takes the name directly. Every backend module is imported
on first use only: the PyTorch backend (``torch_backend``, with its packed decoder ``torch_decoder``, which export
also builds its graphs from) imports torch, which the rest of the runtime never does.

``default`` (the name ``auto``, what ``Engine.load`` uses when given no backend) picks the fastest CPU path that
keeps the answers: OpenVINO's CPU plugin at f32 (1.32x ONNX Runtime on a 511-token state, log-likelihoods within
1e-4: benchmarks/results/precision_eval.md) where it is installed, the engine is a plain fp32 graph and OpenVINO
reproduces the engine's golden file at the fp32 tolerances on this machine (checked once per graph and
process); otherwise ONNX Runtime on CPU, the reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import threading

from ..core.errors import BackendUnavailable

log = logging.getLogger("onepass.backends")

# name -> (module, class, fixed options)
TABLE = {
    "onnxruntime": ("onepass.runtime.backends.ort", "OrtBackend", {"device": "cpu"}),
    "onnxruntime-gpu": ("onepass.runtime.backends.ort", "OrtBackend", {"device": "cuda"}),
    "tensorrt": ("onepass.runtime.backends.tensorrt", "TensorRTBackend", {}),
    "torch-cpu": ("onepass.runtime.backends.torch_backend", "TorchBackend", {"device": "cpu"}),
    "torch-cuda": ("onepass.runtime.backends.torch_backend", "TorchBackend", {"device": "cuda"}),
    "openvino-cpu": ("onepass.runtime.backends.openvino_cpu", "OpenVinoCpuBackend", {"precision": "f32"}),
    "openvino-cpu-bf16": ("onepass.runtime.backends.openvino_cpu", "OpenVinoCpuBackend", {"precision": "bf16"}),
}
BACKENDS = tuple(TABLE)
AUTO = "auto"  # the default: see ``default``
FASTEST_EXACT_CPU = "openvino-cpu"


def backend_class(name: str):
    """The class of the backend called ``name`` (see ``BACKENDS``), its module imported now."""
    if name not in TABLE:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    module, cls, _ = TABLE[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        extra = "openvino" if "openvino" in module else "trt"
        need = "PyTorch and onnx: pip install torch==2.13.0 'onepass[export]'" if module.endswith(
            "torch_backend") else f"its extra: pip install 'onepass[{extra}]'"
        raise BackendUnavailable(f"the {name} backend needs {need} ({err.name} is missing)") from None


def factory(name: str, **options):
    """The Engine.load factory ``(root, manifest, threads=None) -> Backend`` of the backend called ``name`` (see
    ``BACKENDS``), with ``options`` for its constructor over the table's fixed ones (``factory("torch-cpu",
    precision="fp16")``, ``factory("tensorrt", cuda_graphs=False)``)."""
    cls = backend_class(name)
    return functools.partial(cls.open, name=name, **{**TABLE[name][2], **options})


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
    from ..core.selfcheck import TOLERANCES, over_tolerance, run_golden_on

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
                    bad = over_tolerance(run_golden_on(backend, root, manifest), TOLERANCES)
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
