"""Inference backends: one table from a backend's name to its class and fixed options, each module imported only
when asked for.

``factory(name, **options)`` gives the ``Engine.load(backend=...)`` factory ``(root, manifest, threads) ->
Backend``: the class's ``open`` with the backend's name and options (every backend has that one shape:
``base.Backend``); ``Engine.load(backend="torch-cuda")`` takes the name directly. Every backend module is imported
on first use only: the PyTorch backend (``torch_backend``, with its packed decoder ``torch_decoder``, which export
also builds its graphs from) imports torch, which the rest of the runtime never does.

The name ``auto`` (what ``Engine.load`` uses when given no backend) is the core's choice by the engine's golden file:
``onepass.runtime.core.backend_choice``. The backends never import the core (the dependency runs one way).
"""

from __future__ import annotations

import functools
import importlib

from .errors import BackendUnavailable

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
AUTO = "auto"  # the default: ``core.backend_choice.default``


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
