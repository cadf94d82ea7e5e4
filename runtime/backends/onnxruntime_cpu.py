"""ONNX Runtime backend (CPU execution provider): the test baseline, runs everywhere.

State K/V stay in ``OrtValue``s bound with IOBinding, so a score pass reads the
state in place: no per-call copy of the cache.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from .. import contract
from ..manifest import ModelInfo
from ..tree import PackedBatch
from .base import Backend, StateKV


class OrtCpuBackend(Backend):
    """The decoder graph in an ``onnxruntime.InferenceSession`` on CPU."""

    concurrent = True  # InferenceSession.run is thread-safe and every pass has its own arrays
    block_tokens = 256  # packed tokens per pass of a split request: fastest here (benchmarks/results/blocks.md)

    def __init__(self, graph_path: str, model: ModelInfo, threads: int | None = None):
        super().__init__(model)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # No CPU arena: ORT's arena keeps its largest footprint for the life of the process, so one request at
        # the limits held ~4.2 GB for good (shrinking it after large passes did not help: live outputs pin its
        # regions). Without it RSS comes back after the pass; small passes cost ~2-3% more, a pass at the
        # limits ~50% (benchmarks/results/memory_peak.md).
        opts.enable_cpu_mem_arena = False
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(graph_path, opts, providers=["CPUExecutionProvider"])
        dims = (model.num_layers, model.num_kv_heads, model.head_dim)
        self.past_names = [s.name for s in contract.input_specs(*dims) if s.name.startswith("past_")]
        graph_outputs = {o.name for o in self.session.get_outputs()}
        self.has_head = "head_score" in graph_outputs
        self.output_names = [s.name for s in contract.output_specs(*dims, head=self.has_head)]
        zeros = np.zeros((model.num_kv_heads, 0, model.head_dim), dtype=np.float32)  # [Hkv, 0, D]
        self._empty = ort.OrtValue.ortvalue_from_numpy(zeros)

    def empty(self) -> StateKV:
        """A K/V of length 0 (one shared empty value for every layer)."""
        return StateKV(tuple((self._empty, self._empty) for _ in range(self.model.num_layers)), 0, 0)

    def _run(self, batch: PackedBatch, kv: StateKV):
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", batch.input_ids)
        binding.bind_cpu_input("position_ids", batch.position_ids)
        binding.bind_cpu_input("tree_mask", batch.tree_mask)
        binding.bind_cpu_input("readout_index", batch.readout_index)
        binding.bind_cpu_input("readout_target", batch.readout_target)
        flat = [value for pair in kv.layers for value in pair]
        for name, value in zip(self.past_names, flat):
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        layers = 2 * self.model.num_layers
        head = outputs[1 + layers].numpy() if self.has_head else None
        return outputs[0].numpy(), outputs[1:1 + layers], head

    def _append(self, kv: StateKV, new) -> StateKV:
        n = new[0].shape()[1]
        if kv.length == 0:
            layers = tuple((new[2 * i], new[2 * i + 1]) for i in range(self.model.num_layers))
        else:  # a later prefill chunk: one concatenation per layer, at prefill time only
            layers = tuple(
                tuple(ort.OrtValue.ortvalue_from_numpy(np.concatenate([old.numpy(), add.numpy()], axis=1))
                      for old, add in zip(kv.layers[i], (new[2 * i], new[2 * i + 1])))
                for i in range(self.model.num_layers)
            )
        length = kv.length + n
        return StateKV(layers, length, length * self.model.kv_bytes_per_token())


def factory():
    """The Engine.load factory of this backend (threads from Engine.load)."""
    def make(root, manifest, threads=None):
        return OrtCpuBackend(str(root / manifest.graph), manifest.model, threads=threads)
    return make
