"""OpenVINO backend (CPU plugin): the same ONNX graph, compiled by OpenVINO at a chosen inference precision.

OpenVINO reads the engine's ``decoder.onnx`` (external weights included) as it is: no build step, no
file of its own. ``precision="f32"`` keeps every GEMM in float32 (answers as ONNX Runtime's, within
float reordering); ``"bf16"`` lets the CPU plugin run in bfloat16 where the CPU has it natively (AMX
or AVX512-BF16), keeping what OpenVINO keeps in f32. Measured side by side on a 2-core AMX Xeon
(``benchmarks/results/precision_eval.md``, 13 questions on a cached 511-token state): f32 487 ms p50
against ONNX Runtime's 645 ms with the same answers (log-likelihoods within 1e-4), bf16 219 ms with
answer probabilities within 0.14 of fp32 (77 of 78 argmaxes kept). On a CPU without native bf16 the
hint falls back to f32.

State K/V are float32 numpy arrays. One infer request per thread, so passes may run concurrently.

The CPU plugin sizes its working memory to the largest pass it has run (past length times packed tokens) and
keeps it in the compiled model, not only in the infer request: after a 1000-option choice or a long state the
process stays a gigabyte above its warm size. :meth:`release_memory` compiles the model again (1.3 s on two
cores) and lets the old one go, which returns RSS to its warm size (``benchmarks/studies/results/memory_options.md``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import openvino as ov

from . import contract
from .errors import BackendUnavailable
from .model import EngineDescription
from .batch import PackedBatch
from .base import Backend, StateKV

PRECISIONS = ("f32", "bf16")  # OpenVINO's own names of its inference precisions


class OpenVinoCpuBackend(Backend):
    """The decoder graph compiled by OpenVINO's CPU plugin at ``precision`` (``f32`` or ``bf16``)."""

    runs_tasks = True  # it feeds a task-slot graph's task inputs (contract.TaskFeeds)
    concurrent = True  # one infer request per thread; every pass has its own arrays
    # packed tokens per pass of a split request: 512 measured fastest here, by 1-10% over 256 and 10-15% over 1024
    # on 13-500 questions and a 255-option choice (benchmarks/results/blocks_openvino.md; ONNX Runtime's is 256)
    block_tokens = 512

    precisions = ("fp32",)  # an fp32 graph; ``precision`` chooses the precision OpenVINO computes it in
    instead = ("use onnxruntime (fp16 engines), torch-cpu or tensorrt (fp16 and bf16), or an fp32 engine, which "
               "openvino-cpu-bf16 computes in bf16")

    def __init__(self, root: Path, manifest: EngineDescription, threads: int | None = None, *, name: str | None = None,
                 precision: str = "f32"):
        model, graph_path = manifest.model, str(Path(root) / manifest.graph)
        super().__init__(model, name)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.graph_path = graph_path
        self.config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
        if threads:
            self.config["INFERENCE_NUM_THREADS"] = int(threads)
        self.compiled = self._compile()
        self.precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string()  # f32 or bf16 in force
        outputs = [o.get_any_name() for o in self.compiled.outputs]
        self.past_names, want, self.has_head = contract.io_names(model, outputs)
        self.has_past_length = contract.PAST_LENGTH in {i.get_any_name() for i in self.compiled.inputs}
        shapes = {i.get_any_name(): [d.get_length() if d.is_static else 0 for d in i.get_partial_shape()]
                  for i in self.compiled.inputs}
        if contract.TASK_MASK in shapes:
            self.tasks = contract.TaskFeeds.none(shapes, model.num_layers)
        missing = [n for n in want if n not in outputs]
        if missing:
            raise BackendUnavailable(f"{graph_path}: OpenVINO sees no output {missing[0]}; re-export the engine")
        self.output_index = [outputs.index(n) for n in want]
        self._requests = threading.local()
        self._empty = np.zeros((model.num_kv_heads, 0, model.head_dim), dtype=np.float32)

    def _compile(self):
        core = ov.Core()
        return core.compile_model(core.read_model(self.graph_path), "CPU", self.config)

    def _request(self):
        """This thread's infer request of the current compiled model (made again after :meth:`release_memory`)."""
        compiled = self.compiled
        made = getattr(self._requests, "value", None)
        if made is None or made[0] is not compiled:
            made = self._requests.value = (compiled, compiled.create_infer_request())
        return made[1]

    def release_memory(self) -> bool:
        """Compile the model again and drop the old one with its working memory: each thread's infer request is
        made again on its next pass; a pass running meanwhile finishes on the old model, which it holds."""
        self.compiled = self._compile()
        self._requests = threading.local()  # every thread's old request goes with it (one still running finishes)
        return True

    def empty(self) -> StateKV:
        """A K/V of length 0 (one shared empty array for every layer)."""
        return StateKV(tuple((self._empty, self._empty) for _ in range(self.model.num_layers)), 0, 0)

    def _run(self, batch: PackedBatch, kv: StateKV):
        inputs = contract.batch_inputs(batch, self.tasks)
        inputs.update(zip(self.past_names, (value for pair in kv.layers for value in pair)))
        if self.has_past_length:  # the state is every past row here
            inputs[contract.PAST_LENGTH] = np.asarray(kv.length, dtype=np.int64)
        result = self._request().infer(inputs)
        values = [result[i] for i in self.output_index]  # copies: the request's buffers are reused next pass
        layers = 2 * self.model.num_layers
        head = np.array(values[1 + layers]) if self.has_head else None
        return np.array(values[0]), [np.array(v) for v in values[1:1 + layers]], head

    def _append(self, kv: StateKV, new) -> StateKV:
        return self._joined(kv, new, new[0].shape[1], lambda old, add: np.concatenate([old, add], axis=1))

    def to_host(self, value) -> np.ndarray:
        """One K/V tensor as float32 numpy (it already is one)."""
        return np.asarray(value, dtype=np.float32)
