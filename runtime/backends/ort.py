"""ONNX Runtime backends: the CPU execution provider (the test baseline, runs everywhere) and, with the
``onnxruntime-gpu`` package, the CUDA execution provider (no engine build: the first GPU path to try).

State K/V stay in ``OrtValue``s on the backend's device, bound with IOBinding, so a score pass reads
the state in place: no per-call copy of the cache and, on CUDA, no host round-trip. The packed
batch's small arrays are bound from the host; the new tokens' K/V are bound to the device and the
read-outs to the host. Only a state prefilled in several chunks is joined through the host, once,
at prefill time. The device is a parameter, so the same placement code runs on CPU in the tests.
On CUDA with cuda-bindings, ONNX Runtime runs on a stream the backend owns, which `onepass bench` times with
CUDA events (``device_timer``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import contract
from .errors import BackendUnavailable
from .model import EngineDescription
from .batch import PackedBatch
from .base import Backend, StateKV

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


class OrtBackend(Backend):
    """The decoder graph in an ``onnxruntime.InferenceSession`` on ``device`` (``cpu`` or ``cuda``)."""

    runs_tasks = True  # it feeds a task-slot graph's task inputs (contract.TaskFeeds)
    concurrent = True  # InferenceSession.run is thread-safe and every pass has its own bound values
    block_tokens = 256  # packed tokens per pass of a split request: fastest on CPU (benchmarks/results/blocks.md)
    instead = ("ONNX Runtime's CPU provider has no bf16 GEMMs: use the TensorRT backend (onepass build-trt "
               "--precision bf16, then --backend tensorrt) or the PyTorch backend (--backend torch-cpu / torch-cuda)")

    @classmethod
    def runs(cls, device: str = "cpu", **options) -> tuple:
        """fp32 and fp16 engines; bf16 ones on CUDA only (the CPU provider has no bf16 GEMMs)."""
        return cls.precisions if device == "cuda" else ("fp32", "fp16")

    def __init__(self, root: Path, manifest: EngineDescription, threads: int | None = None, *, name: str | None = None,
                 device: str = "cpu", device_id: int = 0):
        model = manifest.model
        graph_path = str(Path(root) / manifest.graph)
        super().__init__(model, name)
        if device not in PROVIDERS:
            raise ValueError(f"device must be one of {sorted(PROVIDERS)}, got {device!r}")
        missing = [p for p in PROVIDERS[device] if p not in ort.get_available_providers()]
        if missing:
            raise BackendUnavailable(
                f"ONNX Runtime here has no {missing[0]} (it has {', '.join(ort.get_available_providers())}): the "
                "onnxruntime-gpu backend needs the onnxruntime-gpu package in place of onnxruntime, in its own "
                "environment (pip uninstall -y onnxruntime && pip install onnxruntime-gpu==1.31.1; docs/gpu.md), "
                "and a CUDA device")
        self.device, self.device_id = device, device_id
        self._cuda = self._stream = None
        if device == "cuda":
            self.block_tokens = None  # as few passes as the engine's limits allow: GPU passes are latency-bound
            self._cuda, self._stream = _own_stream(device_id)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # No CPU arena: ORT's arena keeps its largest footprint for the life of the process, so one request at
        # the limits held ~4.2 GB for good (shrinking it after large passes did not help: live outputs pin its
        # regions). Without it RSS comes back after the pass; small passes cost ~2-3% more, a pass at the
        # limits ~50% (benchmarks/results/memory_peak.md).
        opts.enable_cpu_mem_arena = False
        if threads:
            opts.intra_op_num_threads = threads
        cuda_options = {"device_id": device_id}
        if self._stream is not None:  # ONNX Runtime runs on this stream, so CUDA events on it time its passes
            cuda_options["user_compute_stream"] = str(self._cuda.handle(self._stream))
        providers = [(p, cuda_options) if p == "CUDAExecutionProvider" else p for p in PROVIDERS[device]]
        self.session = ort.InferenceSession(graph_path, opts, providers=providers)
        self.past_names, self.output_names, self.has_head = contract.io_names(
            model, (o.name for o in self.session.get_outputs()))
        self.has_past_length = contract.PAST_LENGTH in {i.name for i in self.session.get_inputs()}
        if contract.TASK_MASK in {i.name for i in self.session.get_inputs()}:
            self.tasks = contract.TaskFeeds.none({i.name: i.shape for i in self.session.get_inputs()},
                                                 model.num_layers)
        zeros = np.zeros((model.num_kv_heads, 0, model.head_dim), dtype=np.float32)  # [Hkv, 0, D]
        self._empty = self._on_device(zeros)

    def device_timer(self):
        """CUDA events on the session's compute stream (`onepass bench`'s device stage); None on CPU, or on CUDA
        without cuda-bindings (the stream is then ONNX Runtime's own, which Python cannot reach)."""
        if self._cuda is None:
            return None
        self._cuda.activate()  # the caller's thread (a bench or server worker) needs the device's context
        return self._cuda.event_timer(self._stream)

    def _on_device(self, array: np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(array, self.device, self.device_id)

    def empty(self) -> StateKV:
        """A K/V of length 0 (one shared empty value for every layer)."""
        return StateKV(tuple((self._empty, self._empty) for _ in range(self.model.num_layers)), 0, 0)

    def _run(self, batch: PackedBatch, kv: StateKV):
        binding = self.session.io_binding()
        for name, value in contract.batch_inputs(batch, self.tasks).items():
            binding.bind_cpu_input(name, value)
        if self.has_past_length:  # the state is every past row here
            binding.bind_cpu_input(contract.PAST_LENGTH, np.asarray(kv.length, dtype=np.int64))
        flat = [value for pair in kv.layers for value in pair]
        for name, value in zip(self.past_names, flat):
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:  # read-outs to the host, the new K/V stay on the device
            kv_output = name.startswith(contract.PRESENT)
            binding.bind_output(name, self.device if kv_output else "cpu", self.device_id if kv_output else 0)
        with self.device_span():
            self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        layers = 2 * self.model.num_layers
        head = outputs[1 + layers].numpy() if self.has_head else None
        return outputs[0].numpy(), outputs[1:1 + layers], head

    def _append(self, kv: StateKV, new) -> StateKV:
        # a later prefill chunk: one concatenation per layer, through the host, at prefill time only
        return self._joined(kv, new, new[0].shape()[1],
                            lambda old, add: self._on_device(np.concatenate([old.numpy(), add.numpy()], axis=1)))


def _own_stream(device_id: int):
    """(CudaDevice, a stream of its primary context) for the CUDA provider, or (None, None) where cuda-bindings is
    not installed: the onnxruntime-gpu environment needs only onnxruntime-gpu, and the stream only serves timing."""
    from .cuda_device import CudaDevice

    try:
        device = CudaDevice(device_id)
    except BackendUnavailable:
        return None, None
    return device, device.stream()
