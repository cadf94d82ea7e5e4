"""Inference backends: one table from a backend's name to its factory, each module imported only when asked for.

``factory(name, **options)`` gives the ``Engine.load(backend=...)`` factory ``(root, manifest, threads) ->
Backend``; ``Engine.load(backend="torch-cuda")`` takes the name directly. The PyTorch backend lives in
``onepass.export`` (it needs torch, which the runtime never imports at import time): the table names it as
a module path, imported on first use.
"""

from __future__ import annotations

import importlib

from ..errors import BackendUnavailable

# name -> (module, factory attribute, fixed options)
TABLE = {
    "onnxruntime": ("onepass.runtime.backends.ort", "factory", {"device": "cpu"}),
    "onnxruntime-gpu": ("onepass.runtime.backends.ort", "factory", {"device": "cuda"}),
    "tensorrt": ("onepass.runtime.backends.tensorrt", "factory", {}),
    "torch-cpu": ("onepass.export.torch_backend", "factory", {"device": "cpu"}),
    "torch-cuda": ("onepass.export.torch_backend", "factory", {"device": "cuda"}),
    "openvino-cpu": ("onepass.runtime.backends.openvino_cpu", "factory", {"precision": "f32"}),
    "openvino-cpu-bf16": ("onepass.runtime.backends.openvino_cpu", "factory", {"precision": "bf16"}),
}
BACKENDS = tuple(TABLE)


def factory(name: str, **options):
    """The Engine.load factory of the backend called ``name`` (see ``BACKENDS``), with ``options``."""
    if name not in TABLE:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    module, attr, fixed = TABLE[name]
    try:
        make = getattr(importlib.import_module(module), attr)
    except ImportError as err:
        extra = "openvino" if "openvino" in module else "trt"
        need = "PyTorch and onnx: pip install torch==2.13.0 'onepass[export]'" if module.startswith(
            "onepass.export") else f"its extra: pip install 'onepass[{extra}]'"
        raise BackendUnavailable(f"the {name} backend needs {need} ({err.name} is missing)") from None
    return make(**fixed, **options)
