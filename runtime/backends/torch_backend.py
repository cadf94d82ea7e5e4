"""PyTorch backend: the engine's own graph weights in the exported decoder module, on CPU or CUDA.

For machines with PyTorch but no TensorRT, and the reference for GPU latency. The weights
come from the engine directory's ONNX initializers (their names are the module's state-dict
names), so nothing but the engine directory is needed; the manifest's ``source.dims`` gives
the architecture. Same packed tree, same contract, same answers as the ONNX Runtime engine
(tests/test_torch_backend.py). A state's K/V is prefilled into buffers allocated once at
its full length (chunks are written in place); a score pass reads them without copying
them to the host.

The backend table imports it only when ``torch-cpu`` or ``torch-cuda`` is asked for, so the rest of the runtime
never imports torch; export builds its graphs from the same decoder module (torch_decoder.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .base import Backend, StateKV
from .graphs import MAX_GRAPHS, SLOT_TOKENS, SLOTS, CaptureFailed, GraphCache, SlotTable, bucketed
from ..core.errors import EngineFileError
from ..core.tree import PackedBatch, bucket, causal
from .torch_decoder import PRECISIONS, DecoderDims, PackedDecoder, lower_precision


def decoder_from_engine(root: Path, manifest) -> PackedDecoder:
    """Rebuild the exported decoder (and its decision head, if any) from an engine directory."""
    dims = manifest.source.get("dims")
    if not dims:
        raise EngineFileError(f"{root}: the manifest records no model dims (source.dims); re-export the engine")
    graph = onnx.load(str(root / manifest.graph), load_external_data=False)
    # a mixed-precision graph names its wrapped GEMM weights "<layer>.inner.weight" and stores them in fp16/bf16
    state = {(i.name.replace(".inner.", ".") if i.name.startswith("blocks.") else i.name):
             torch.from_numpy(_initializer(root, i).astype(np.float32))  # bf16 (ml_dtypes) upcasts exactly
             for i in graph.graph.initializer if i.name == "embed" or "." in i.name}
    missing = [f"blocks.{i}.{n}.weight" for i in range(dims["num_layers"]) for n in ("input_norm", "post_norm")
               if f"blocks.{i}.{n}.weight" not in state]
    if missing:  # the ONNX optimizer merges identical initializers (e.g. norms still all ones): names are lost
        raise EngineFileError(f"{root}: the graph has no initializer {missing[0]} (and {len(missing) - 1} more): "
                              "identical weights were merged at export, so the PyTorch backend cannot rebuild the "
                              "decoder from this engine; use ONNX Runtime or TensorRT with it")
    return PackedDecoder.from_state_dict(DecoderDims(**dims), state).eval()


def _initializer(root: Path, tensor) -> np.ndarray:
    """An initializer's values, read from its external-data file by offset and length when it has one.

    (onnx's own loader refuses external data with several hard links, which engine copies have.)
    """
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor).copy()
    info = {e.key: e.value for e in tensor.external_data}
    path = (root / info["location"]).resolve()
    if root.resolve() not in path.parents:
        raise EngineFileError(f"initializer {tensor.name} points outside the engine directory: {info['location']}")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
    with open(path, "rb") as fh:
        fh.seek(int(info.get("offset", 0)))
        data = fh.read(int(info.get("length", count * np.dtype(dtype).itemsize)))
    return np.frombuffer(data, dtype=dtype, count=count).reshape(tuple(tensor.dims)).copy()


class TorchBackend(Backend):
    """The decoder module on ``device`` ("cpu", "cuda", "cuda:1", ..., or "meta": shapes and devices
    propagate, no data — the tests' CPU check of device placement) at ``precision`` (fp32, fp16, bf16).

    ``buckets`` pads every score pass to bucketed packed/read-out sizes, capped at the engine's
    ``max_packed_tokens`` (default: on CUDA), so a few shapes repeat. With ``cuda_graphs`` (default: on
    CUDA) a score pass reads its state from one of ``slots`` fixed K/V slots of ``slot_tokens`` rows
    (``graphs.SlotTable``: one device copy when a state is new to its slot; a longer state runs without a graph),
    padded to a state-length
    bucket whose padding rows are masked (``past_length``), and the pass of each (slot, state bucket,
    packed bucket, read-out bucket) is captured once as a CUDA graph and replayed: the captures are
    bounded by slots x buckets whatever the number of distinct states, no graph holds a state's memory,
    and the slots' bytes (``reserved_bytes``) come out of the engine's state-cache budget.
    """

    graph_devices = ("cuda",)  # where ``_capture_graph`` works (a test stand-in adds "cpu")

    def __init__(self, root: Path, manifest, threads: int | None = None, *, name: str | None = None,
                 device: str = "cpu", precision: str | None = None, buckets: bool | None = None,
                 cuda_graphs: bool | None = None, slots: int = SLOTS, slot_tokens: int = SLOT_TOKENS,
                 max_graphs: int = MAX_GRAPHS):
        super().__init__(manifest.model, name)
        precision = precision or manifest.precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineFileError("the torch backend was asked for CUDA but torch.cuda.is_available() is False")
        if threads and self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.decoder = lower_precision(decoder_from_engine(Path(root), manifest), precision).to(self.device)
        m = manifest.model
        self._empty = torch.zeros(m.num_kv_heads, 0, m.head_dim, device=self.device)
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type not in self.graph_devices:
            raise ValueError("CUDA graphs need a CUDA device")
        self.buckets = (on_cuda if buckets is None else buckets) or self.cuda_graphs
        self.max_packed = manifest.limits.max_packed_tokens
        self.slot_tokens = min(slot_tokens, manifest.limits.max_state_tokens)
        self.slots = SlotTable(slots)
        self._slots: torch.Tensor | None = None  # [slots, 2L, Hkv, slot_tokens, D], allocated at first use
        self.reserved_bytes = slots * self.slot_tokens * m.kv_bytes_per_token() if self.cuda_graphs else 0
        self.graphs = GraphCache(max_graphs)
        # One memory pool for every captured graph: a graph's temporaries live only during its replay and
        # replays never overlap (one stream, serialised calls), so graphs may reuse each other's temporaries;
        # a pool per graph would hold every graph's activations.
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs and on_cuda else None

    def device_timer(self):
        """CUDA events on the current stream around a call (None on CPU): `onepass bench`'s device stage."""
        return CudaEvents() if self.device.type == "cuda" else None

    def score_all(self, kv: StateKV, batch: PackedBatch):
        """Score pass, padded to a bucket (and replayed from a CUDA graph over a slot) when configured."""
        if not self.buckets:
            return super().score_all(kv, batch)
        self.check(batch)
        r = batch.readout_index.shape[0]
        padded = bucketed(batch, self.max_packed)
        if self.cuda_graphs and 0 < kv.length <= self.slot_tokens:
            logprob, head = self._graph_pass(kv, padded)
        else:
            logprob, _, head = self._run(padded, kv)
        return logprob[:r], (head[:r] if head is not None else None)

    @torch.inference_mode()
    def _graph_pass(self, kv: StateKV, batch: PackedBatch):
        """``batch`` over ``kv`` copied into its slot, through the graph of (slot, state bucket, batch shape)."""
        slots = self._slot_storage()  # allocated before a slot is promised to the state
        index = self.slots.fill(kv, lambda i: self._copy_in(slots[i], kv))
        slot = slots[index]  # [2L, Hkv, slot_tokens, D]
        past = bucket(kv.length, self.slot_tokens)
        arrays = (batch.input_ids, batch.position_ids, batch.tree_mask, batch.readout_index, batch.readout_target,
                  np.asarray(kv.length, dtype=np.int64))
        key = (index, past, batch.num_tokens, batch.readout_index.shape[0])
        views = list(slot[:, :, :past].unbind(0))  # 2L views [Hkv, past, D] at addresses that never move

        def capture():
            static = [torch.from_numpy(a).to(self.device) for a in arrays]

            def run():  # only the read-outs leave the graph: its presents are temporaries of the shared pool
                out = self.decoder(*static[:3], *views, *static[3:5], past_length=static[5])
                return out[0], (out[-1] if self.decoder.head is not None else None)
            graph, out = self._capture_graph(run)
            return graph, static, out

        def replay(entry):
            graph, static, out = entry
            with self.device_span():
                for dst, src in zip(static, arrays):
                    dst.copy_(torch.from_numpy(src), non_blocking=True)
                graph.replay()
            logprob, head = out
            return self.to_host(logprob), (self.to_host(head) if head is not None else None)

        def plain():
            logprob, _, head = self._run(batch, kv)
            return logprob, head
        return self.graphs.run(key, capture, replay, plain)

    def _slot_storage(self) -> torch.Tensor:
        """Every slot, [slots, 2L, Hkv, slot_tokens, D]: zeros at first (padding rows must be finite: a masked row
        still multiplies its value)."""
        if self._slots is None:
            m = self.model
            self._slots = torch.zeros(self.slots.count, 2 * m.num_layers, m.num_kv_heads, self.slot_tokens,
                                      m.head_dim, device=self.device)
        return self._slots

    @staticmethod
    def _copy_in(slot: torch.Tensor, kv: StateKV) -> None:
        """The state's K/V into the first rows of ``slot``: one copy from prefill's single buffer, else per tensor."""
        if kv.storage is not None:
            slot[:, :, :kv.length].copy_(kv.storage)
            return
        for dst, src in zip(slot.unbind(0), (value for pair in kv.layers for value in pair)):
            dst[:, :kv.length].copy_(src)

    def _capture_graph(self, run):
        """(a CUDA graph of ``run()``, its output tensors), after two warm-up runs on a side stream (allocator,
        kernels). Any failure of the capture is ``CaptureFailed``: that key then runs without a graph."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = run()
        except torch.cuda.OutOfMemoryError:
            raise  # out of memory now is no reason never to capture this shape
        except RuntimeError as err:
            raise CaptureFailed(str(err)) from err
        return graph, out

    def close(self) -> None:
        """Drop the graphs and the slots (device memory goes back to torch's allocator)."""
        self.graphs.clear()
        self.slots.forget()
        self._slots = None

    def to_host(self, value) -> np.ndarray:
        """A device tensor as float32 numpy; on the ``meta`` device (shapes only) zeros of its shape."""
        if value.is_meta:
            return np.zeros(tuple(value.shape), dtype=np.float32)
        return value.float().cpu().numpy()

    def empty(self) -> StateKV:
        return StateKV(tuple((self._empty, self._empty) for _ in range(self.model.num_layers)), 0, 0)

    def prefill(self, ids: Sequence[int], chunk: int) -> StateKV:
        """K/V buffers allocated once at the state's length; each chunk is written into them in place."""
        if len(ids) == 0:
            raise ValueError("a state needs at least one token")
        m = self.model
        storage = torch.empty(2 * m.num_layers, m.num_kv_heads, len(ids), m.head_dim, device=self.device)
        buffers = list(storage.unbind(0))  # 2L views [Hkv, S, D]: one buffer, copied into a graph slot at once
        for start in range(0, len(ids), chunk):
            past = [b[:, :start] for b in buffers]
            kv = StateKV(tuple((past[2 * i], past[2 * i + 1]) for i in range(m.num_layers)), start, 0)
            _, new, _ = self._run(causal(ids[start:start + chunk], start), kv)
            for b, n in zip(buffers, new):
                b[:, start:start + n.shape[1]].copy_(n)
        layers = tuple((buffers[2 * i], buffers[2 * i + 1]) for i in range(m.num_layers))
        return StateKV(layers, len(ids), len(ids) * m.kv_bytes_per_token(), storage)

    @torch.inference_mode()
    def _run(self, batch: PackedBatch, kv: StateKV):
        def t(a):
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        past = [value for pair in kv.layers for value in pair]
        with self.device_span():
            out = self.decoder(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *past,
                               t(batch.readout_index), t(batch.readout_target))
        return self._outputs(out)

    def _outputs(self, out) -> tuple:
        """(target log-probs on the host, presents on the device, head scores on the host or None)."""
        layers = 2 * self.model.num_layers
        head = self.to_host(out[1 + layers]) if self.decoder.head is not None else None
        return self.to_host(out[0]), list(out[1:1 + layers]), head

    def _append(self, kv: StateKV, new) -> StateKV:
        """``kv`` followed by ``new`` (the base-class prefill path; this backend's prefill writes in place)."""
        return self._joined(kv, new, new[0].shape[1], lambda old, add: torch.cat([old, add], 1))


class CudaEvents:
    """start() / stop() -> milliseconds between two CUDA events on the current stream (synchronised on the
    second): the torch backend's device timer, and gpu_check's."""

    def __init__(self):
        self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.begin.record()

    def stop(self) -> float:
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end)
