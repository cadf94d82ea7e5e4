"""PyTorch backend: the engine's own graph weights in the exported decoder module, on CPU or CUDA.

For machines with PyTorch but no TensorRT, and the reference for GPU latency. The weights
come from the engine directory's ONNX initializers (their names are the module's state-dict
names), so nothing but the engine directory is needed; the manifest's ``source.dims`` gives
the architecture. Same packed tree, same contract, same answers as the ONNX Runtime engine
(tests/test_torch_backend.py). A state's K/V is prefilled into buffers allocated once at
its full length (chunks are written in place); a score pass reads them without copying
them to the host.

Lives beside the exporter (it is the exporter's module) so that the runtime never imports
torch; ``onepass serve --backend torch-cpu`` (or ``torch-cuda``) loads it lazily.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..runtime.backends.base import Backend, StateKV
from ..runtime.errors import EngineFileError
from ..runtime.tree import PackedBatch, bucket, causal, pad_batch
from .decoder import PRECISIONS, DecoderDims, PackedDecoder, lower_precision


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


MAX_GRAPHS = 32


class TorchBackend(Backend):
    """The decoder module on ``device`` ("cpu", "cuda", "cuda:1", ..., or "meta": shapes and devices
    propagate, no data — the tests' CPU check of device placement) at ``precision`` (fp32, fp16, bf16).

    ``buckets`` pads every score pass to bucketed packed/read-out sizes (default: on CUDA),
    so a few shapes repeat; with ``cuda_graphs`` (default: on CUDA) the score pass of each
    (state, bucket) is captured once as a CUDA graph and replayed (at most MAX_GRAPHS kept).
    """

    def __init__(self, root: Path, manifest, device: str = "cpu", threads: int | None = None,
                 precision: str | None = None, buckets: bool | None = None, cuda_graphs: bool | None = None):
        super().__init__(manifest.model)
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
        if self.cuda_graphs and not on_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.buckets = (on_cuda if buckets is None else buckets) or self.cuda_graphs
        self._graphs: OrderedDict = OrderedDict()
        # One memory pool for every captured graph: a graph's temporaries live only during its replay and
        # replays never overlap (one stream, serialised calls), so graphs may reuse each other's temporaries;
        # a pool per graph would hold MAX_GRAPHS copies of the activations.
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    def device_timer(self):
        """CUDA events on the current stream around a call (None on CPU): `onepass bench`'s device stage."""
        return CudaEvents() if self.device.type == "cuda" else None

    def score_all(self, kv: StateKV, batch: PackedBatch):
        """Score pass, padded to a bucket (and replayed from a CUDA graph) when configured."""
        if not self.buckets:
            return super().score_all(kv, batch)
        self.check(batch)
        n, r = batch.num_tokens, batch.readout_index.shape[0]
        padded = pad_batch(batch, bucket(n), bucket(r))
        if self.cuda_graphs:
            logprob, head = self._replay(kv, padded)
        else:
            logprob, _, head = self._run(padded, kv)
        return logprob[:r], (head[:r] if head is not None else None)

    @torch.inference_mode()
    def _replay(self, kv: StateKV, batch: PackedBatch):
        """Run ``batch`` through the CUDA graph of (this state's buffers, this shape), capturing it once."""
        key = (kv.layers[0][0].data_ptr(), kv.length, batch.num_tokens, batch.readout_index.shape[0])
        entry = self._graphs.get(key)
        arrays = (batch.input_ids, batch.position_ids, batch.tree_mask, batch.readout_index, batch.readout_target)
        if entry is None:
            static = [torch.from_numpy(a).to(self.device) for a in arrays]
            past = [value for pair in kv.layers for value in pair]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (allocator, kernels)
                    self.decoder(*static[:3], *past, *static[3:])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.decoder(*static[:3], *past, *static[3:])
            entry = (graph, static, out, kv)  # kv: keeps the state's buffers alive while the graph exists
            self._graphs[key] = entry
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph, static, out, _ = entry
        for dst, src in zip(static, arrays):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
        graph.replay()
        logprob, _, head = self._outputs(out)
        return logprob, head

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
        buffers = [torch.empty(m.num_kv_heads, len(ids), m.head_dim, device=self.device) for _ in range(2 * m.num_layers)]
        for start in range(0, len(ids), chunk):
            past = [b[:, :start] for b in buffers]
            kv = StateKV(tuple((past[2 * i], past[2 * i + 1]) for i in range(m.num_layers)), start, 0)
            _, new, _ = self._run(causal(ids[start:start + chunk], start), kv)
            for b, n in zip(buffers, new):
                b[:, start:start + n.shape[1]].copy_(n)
        layers = tuple((buffers[2 * i], buffers[2 * i + 1]) for i in range(m.num_layers))
        return StateKV(layers, len(ids), len(ids) * m.kv_bytes_per_token())

    @torch.inference_mode()
    def _run(self, batch: PackedBatch, kv: StateKV):
        def t(a):
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        past = [value for pair in kv.layers for value in pair]
        return self._outputs(self.decoder(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *past,
                                          t(batch.readout_index), t(batch.readout_target)))

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


def factory(device: str = "cpu", precision: str | None = None, **options):
    """An Engine.load backend factory for this backend on ``device`` at ``precision`` (default: the engine's);
    ``options``: ``buckets``, ``cuda_graphs``."""
    def make(root, manifest, threads=None):
        return TorchBackend(root, manifest, device=device, threads=threads, precision=precision, **options)
    return make
