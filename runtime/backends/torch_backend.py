"""PyTorch backend: the engine's own graph weights as the fused decision pass (``fused_decoder.py``), on CPU or CUDA.

For machines with PyTorch but no TensorRT, and the GPU path where TensorRT has no target (an H200 with TensorRT
for RTX). The weights come from the engine directory's ONNX initializers (their names are the reference module's
state-dict names), so nothing but the engine directory is needed; the manifest's ``source.dims`` gives the
architecture. Same packed tree, same contract, same answers as the ONNX Runtime engine (tests/test_torch_backend.py,
tests/test_fused_pass.py).

One device **workspace** per backend (``FusedDecoder.workspace``: [L, H + 2 Hkv, rows, D] in the pass's dtype) is
where every pass runs: a prefill chunk writes its K/V into the state rows of the workspace, and the whole state is
copied once into the state's own buffer for the cache (one copy, not one per layer); a score pass over a state the
workspace does not hold copies the state's K/V in first (one copy), and a state asked about again, or just
prefilled, is still there (``slots``: a table of one slot). Nothing on the hot path depends on which state it is.

With ``buckets`` (default: on CUDA) passes are padded to ``batch.bucket`` sizes (steps of a quarter power of two:
at most 1.25x), the state to its bucket with its padding rows masked; with ``cuda_graphs`` (default: on CUDA) the
score pass of each (state bucket, packed bucket, read-out bucket) and the prefill chunk of each (past, chunk bucket)
is captured as a CUDA graph the *second* time it is seen (a one-off shape runs eagerly instead of paying a capture)
and replayed after. A replay uploads its inputs once: one pinned host buffer, one copy into the device buffer the
graphs read (ids, positions, the tree in 2N numbers, read-outs and the state length; the [N, N] mask is built on the
device). Passes larger than the workspace's ``workspace_tokens`` rows run eagerly in a workspace of their own.

``fused=False`` runs the reference decoder of ``torch_decoder.py`` instead, as the export does (fp32 residual
stream, fp16/bf16 block GEMMs, fp32 attention): eagerly, no buckets, no graphs. It is what an engine's golden file
was written with (the bf16 export check uses it) and the "before" of the GPU check.

An engine with tuned tasks is served by its slot graph, whose extra inputs are the tasks' factors and a
per-token task mask (``contract.TaskFeeds``). The fused pass has no task slots, so such an engine runs on the
reference decoder wrapped in ``TaskDecoder`` (the module the slot graph was exported from), on CPU or CUDA, with
the same feeds as ONNX Runtime and OpenVINO.

The backend table imports it only when ``torch-cpu`` or ``torch-cuda`` is asked for, so the rest of the runtime
never imports torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import contract, engine_weights
from .base import Backend, StateKV
from .fused_decoder import FusedDecoder
from .graphs import CaptureFailed, GraphCache, SlotTable, bucketed, padded
from .errors import EngineFileError
from .batch import PackedBatch, bucket, causal, intervals_of_mask
from .torch_decoder import PRECISIONS, DecoderDims, PackedDecoder, TaskDecoder, lower_precision

# rows of the persistent workspace (state bucket + packed bucket of a pass that can be captured): at most 4,096 (a
# 2,048-token state with 2,048 packed tokens, or a 512-token state with 64 questions) and at most WORKSPACE_BYTES:
# SmolLM2 gets 4,096 rows at fp16 and 2,048 at fp32, 236 MB either way (30 layers x 15 head rows x 64 x 2 or 4
# bytes a row). A larger pass runs eagerly in a workspace of its own.
WORKSPACE_TOKENS = 4096
WORKSPACE_BYTES = 256 << 20
TORCH_GRAPHS = 256  # graphs kept (least recently used evicted): each holds kernel nodes, no memory of its own


def decoder_from_engine(root: Path, manifest) -> PackedDecoder:
    """Rebuild the exported decoder (and its decision head, if any) from an engine directory: its weights through
    the manifest's map of reference names to initializers (``engine_weights``), or by initializer name for engines
    exported before that map."""
    dims = manifest.source.get("dims")
    if not dims:
        raise EngineFileError(f"{root}: the manifest records no model dims (source.dims); re-export the engine")
    mapping = manifest.source.get("weights")
    arrays = engine_weights.by_name(Path(root), manifest.graph, mapping,
                                    lambda name: name == "embed" or "." in name)
    if not mapping and "lm_head" not in arrays and engine_weights.vocabulary_matrices(
            Path(root), manifest.graph, dims["vocab_size"]) != ["embed"]:  # an untied head under another name
        raise EngineFileError(f"{root}: this engine's vocabulary head is stored under a name the exporter chose, and "
                              "its manifest maps no weights (it was exported before that map): re-export it to run it "
                              "on the PyTorch backend, or use ONNX Runtime or TensorRT with it")
    # a mixed-precision graph names its wrapped GEMM weights "<layer>.inner.weight" and stores them in fp16/bf16
    state = {(name.replace(".inner.", ".") if name.startswith("blocks.") else name):
             torch.from_numpy(array.astype(np.float32))  # bf16 (ml_dtypes) upcasts exactly
             for name, array in arrays.items()}
    missing = [f"blocks.{i}.{n}.weight" for i in range(dims["num_layers"]) for n in ("input_norm", "post_norm")
               if f"blocks.{i}.{n}.weight" not in state]
    if missing:  # the ONNX optimizer merges identical initializers (e.g. norms still all ones): names are lost
        raise EngineFileError(f"{root}: the graph has no initializer {missing[0]} (and {len(missing) - 1} more): "
                              "identical weights were merged at export and the manifest maps no weights to them, so "
                              "the PyTorch backend cannot rebuild the decoder from this engine; re-export it, or use "
                              "ONNX Runtime or TensorRT with it")
    return PackedDecoder.from_state_dict(DecoderDims(**dims), state).eval()


def task_inputs(root: Path, manifest) -> dict:
    """{name: shape} of the graph's task inputs (``contract.TaskFeeds``; a slot graph's), {} for a graph without."""
    import onnx

    graph = onnx.load(str(Path(root) / manifest.graph), load_external_data=False).graph
    return {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input
            if i.name in (contract.TASK_MASK, *contract.HEAD_INPUTS) or i.name.startswith(("task_a.", "task_b."))}


class Staging:
    """A pass's integer inputs uploaded in one copy: a (pinned, on CUDA) host buffer and the device buffer that the
    captured graphs read, both allocated once; ``views`` cuts the device buffer by the pass's shape, so a graph of a
    shape always reads the same addresses."""

    def __init__(self, capacity: int, device: torch.device):
        pinned = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=pinned)
        self.device = torch.empty(capacity, dtype=torch.int64, device=device)
        self.capacity = capacity
        # the last upload's copy: the host buffer is rewritten only once the device has read it (a prefill's next
        # chunk is staged while the previous chunk's copy may still wait behind its pass on the stream)
        self._copied = torch.cuda.Event() if pinned else None

    @staticmethod
    def layout(n: int, r: int) -> list[tuple[str, int]]:
        """(name, length) of each input in the buffer, in order, for n packed tokens and r read-outs."""
        return [("ids", n), ("positions", n), ("order", 2 * n), ("readout_index", r), ("readout_target", r),
                ("past_length", 1)]

    def upload(self, arrays: dict) -> dict:
        """Write ``arrays`` (by name, int64) into the host buffer, copy once to the device; the device views."""
        n, r = arrays["ids"].shape[0], arrays["readout_index"].shape[0]
        if self._copied is not None:
            self._copied.synchronize()
        host, at = self.host.numpy(), 0
        for name, size in self.layout(n, r):
            host[at:at + size] = np.asarray(arrays[name]).reshape(-1)
            at += size
        self.device[:at].copy_(self.host[:at], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views(n, r)

    def views(self, n: int, r: int) -> dict:
        """The device buffer cut for n packed tokens and r read-outs: {input name: view} (``order`` [N, 2],
        ``past_length`` 0-d)."""
        views, at = {}, 0
        for name, size in self.layout(n, r):
            views[name] = self.device[at:at + size]
            at += size
        views["order"] = views["order"].view(n, 2)
        views["past_length"] = views["past_length"].view(())
        return views

    @classmethod
    def needed(cls, n: int, r: int) -> int:
        """int64 entries a pass of n packed tokens and r read-outs stages (its layout's total)."""
        return sum(size for _, size in cls.layout(n, r))


class TorchBackend(Backend):
    """The fused pass (or, with ``fused=False``, the reference decoder) on ``device`` ("cpu", "cuda", "cuda:1", ...,
    or "meta": shapes and devices propagate, no data — the tests' CPU check of device placement) at ``precision``
    (fp32, fp16, bf16; default the engine's). See the module docstring for ``buckets``, ``cuda_graphs`` and
    ``workspace_tokens``; ``capture_after`` is the sighting of a shape at which it is captured. ``weights``: the
    decoder's state dict by reference name (``PackedDecoder.from_state_dict``, dims from the manifest's
    ``source.dims``) in place of the engine's ONNX initializers: a shape check builds them on the device
    (benchmarks/gpu_shape.py)."""

    graph_devices = ("cuda",)  # where ``_capture_graph`` works (a test stand-in adds "cpu")
    runs_tasks = True  # a slot graph runs on the reference decoder (TaskDecoder), fed contract.TaskFeeds

    def __init__(self, root: Path, manifest, threads: int | None = None, *, name: str | None = None,
                 device: str = "cpu", precision: str | None = None, fused: bool = True, buckets: bool | None = None,
                 cuda_graphs: bool | None = None, workspace_tokens: int | None = None,
                 max_graphs: int = TORCH_GRAPHS, capture_after: int = 2, weights: dict | None = None):
        super().__init__(manifest.model, name)
        precision = precision or manifest.precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        self.precision, self.fused = precision, fused
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineFileError("the torch backend was asked for CUDA but torch.cuda.is_available() is False")
        if threads and self.device.type == "cpu":
            torch.set_num_threads(threads)
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = fused and (on_cuda if cuda_graphs is None else cuda_graphs)
        if self.cuda_graphs and self.device.type not in self.graph_devices:
            raise ValueError("CUDA graphs need a CUDA device")
        if not fused and (buckets or cuda_graphs):
            raise ValueError("buckets and CUDA graphs are the fused pass's (fused=True)")
        self.buckets = fused and ((on_cuda if buckets is None else buckets) or self.cuda_graphs)
        self.max_packed = manifest.limits.max_packed_tokens
        slots = task_inputs(root, manifest) if weights is None else {}
        if slots and not manifest.source.get("weights"):
            raise EngineFileError(f"{root}: its task slot graph was exported before the task store mapped its weights, "
                                  "which the PyTorch backend rebuilds the decoder through: tune a task again to export "
                                  "it anew, or use openvino-cpu or onnxruntime")
        reference = (decoder_from_engine(Path(root), manifest) if weights is None else
                     PackedDecoder.from_state_dict(DecoderDims(**manifest.source["dims"]), weights))
        if slots:  # the fused pass has no task slots: the reference decoder with them, as the slot graph was made
            if buckets or cuda_graphs:
                raise ValueError("an engine with tuned tasks runs on the reference decoder: no buckets or CUDA graphs")
            self.fused = self.cuda_graphs = self.buckets = False
            self.tasks = contract.TaskFeeds.none(slots, self.model.num_layers)
            self._factors: tuple = (None, ())  # (the TaskFeeds whose factors are on the device, those tensors)
        if not self.fused:
            decoder = lower_precision(reference, precision)
            self.decoder = (TaskDecoder(decoder, self.tasks.blocks, self.tasks.heads is not None) if slots
                            else decoder).to(self.device)
            self._empty = torch.zeros(self.model.num_kv_heads, 0, self.model.head_dim, device=self.device)
            return
        self._open_fused(reference, workspace_tokens, GraphCache(max_graphs, capture_after=capture_after))

    @property
    def reads_tree_mask(self) -> bool:
        """The fused pass reads the tree in 2N numbers; the reference decoder reads the [N, N] mask."""
        return not self.fused

    def _open_fused(self, reference: PackedDecoder, workspace_tokens: int | None, graphs: GraphCache) -> None:
        """The fused pass's decoder, workspace bookkeeping, staging and graph cache."""
        self.dtype = PRECISIONS[self.precision]
        self.decoder = FusedDecoder(reference, self.dtype, self.device)
        self.workspace_tokens = workspace_tokens or self._default_rows()
        self.slots = SlotTable(1)  # which state's K/V the workspace holds
        self._ws: torch.Tensor | None = None  # [L, Z, rows, D], allocated at first use
        self._stage: Staging | None = None
        self.graphs = graphs
        self.reserved_bytes = self._ws_bytes(self.workspace_tokens) if self.cuda_graphs else 0
        # One memory pool for every captured graph: a graph's temporaries live only during its replay and replays
        # never overlap (one stream, serialised calls), so graphs may reuse each other's temporaries.
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs and self.device.type == "cuda" else None

    # -- sizes ------------------------------------------------------------------------------------------------

    def _ws_bytes(self, rows: int) -> int:
        """Device bytes of a workspace of ``rows`` rows."""
        return self.model.num_layers * self.decoder.heads * rows * self.model.head_dim * self.dtype.itemsize

    def _default_rows(self) -> int:
        """The persistent workspace's rows: WORKSPACE_TOKENS, or the largest bucket within WORKSPACE_BYTES."""
        limit = max(64, min(WORKSPACE_TOKENS, WORKSPACE_BYTES // self._ws_bytes(1)))
        return max(b for b in map(bucket, range(1, limit + 1)) if b <= limit)

    def _kv_bytes(self, length: int) -> int:
        """Device bytes of a state's K/V at this pass's dtype."""
        m = self.model
        itemsize = self.dtype.itemsize if self.fused else 4
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * length * itemsize

    def _pass_size(self, n: int) -> int:
        """The tokens a pass of ``n`` pads to: its bucket when bucketing, never above max_packed_tokens."""
        return padded(n, self.max_packed) if self.buckets and n else n

    def _state_rows(self, n: int) -> int:
        """The workspace rows a state of ``n`` tokens is read as: its bucket when bucketing (rows from ``n`` on are
        masked), whatever the pass limit."""
        return bucket(n) if self.buckets and n else n

    def _workspace(self, rows: int) -> tuple[torch.Tensor, bool]:
        """(a workspace of at least ``rows`` rows, whether it is the persistent one). With graphs the persistent
        workspace has a fixed size (graphs keep its address) and a larger pass gets a temporary one; without, it
        grows to the largest pass seen (``release_memory`` gives it back)."""
        if self._ws is not None and rows <= self._ws.shape[2]:
            return self._ws, True
        if self.cuda_graphs:
            if rows > self.workspace_tokens:
                return self.decoder.workspace(rows), False
            self._ws = self.decoder.workspace(self.workspace_tokens)
        else:
            self.slots.forget()
            self._ws = None
            self._ws = self.decoder.workspace(bucket(rows))
        return self._ws, True

    def _staging(self, n: int, r: int) -> tuple[Staging, bool]:
        """(the staging buffers a pass of n tokens and r read-outs uploads through, whether they are the shared
        ones that graphs read)."""
        need = Staging.needed(n, r)
        if self._stage is None:
            self._stage = Staging(Staging.needed(self.workspace_tokens, self.workspace_tokens), self.device)
        if need <= self._stage.capacity:
            return self._stage, True
        return Staging(need, self.device), False

    # -- the Backend interface --------------------------------------------------------------------------------

    def device_timer(self):
        """CUDA events on the current stream around a call (None on CPU): `onepass bench`'s device stage."""
        return CudaEvents() if self.device.type == "cuda" else None

    def empty(self) -> StateKV:
        if not self.fused:
            return StateKV(tuple((self._empty, self._empty) for _ in range(self.model.num_layers)), 0, 0)
        return self._state(self._new_storage(0), 0)

    def _new_storage(self, length: int) -> torch.Tensor:
        m = self.model
        return torch.empty(m.num_layers, 2 * m.num_kv_heads, length, m.head_dim, device=self.device,
                           dtype=self.dtype)  # [L, 2Hkv, S, D]

    def _state(self, storage: torch.Tensor, length: int) -> StateKV:
        hkv = self.model.num_kv_heads
        layers = tuple((layer[:hkv], layer[hkv:]) for layer in storage.unbind(0))  # [Hkv, S, D] views
        return StateKV(layers, length, self._kv_bytes(length), storage)

    def score_all(self, kv: StateKV, batch: PackedBatch):
        """One score pass: padded to its buckets, over the state placed in the workspace, replayed from a graph."""
        if not self.fused:
            return super().score_all(kv, batch)
        self.check(batch)
        r = batch.readout_index.shape[0]
        if batch.tree_order is None:  # a batch built from a mask alone (a golden file's)
            batch = PackedBatch(batch.input_ids, batch.position_ids, batch.tree_mask, batch.readout_index,
                                batch.readout_target, batch.option_readouts, intervals_of_mask(batch.tree_mask))
        if self.buckets:  # the fused pass reads the tree in 2N numbers: no [N, N] mask is padded for it
            batch = bucketed(dataclasses.replace(batch, tree_mask=None) if batch.tree_mask is not None else batch,
                             self.max_packed)
        logprob, head = self._score(kv, batch)
        return logprob[:r], (head[:r] if head is not None else None)

    @torch.inference_mode()
    def _score(self, kv: StateKV, batch: PackedBatch):
        n, r = batch.num_tokens, batch.readout_index.shape[0]
        past = self._state_rows(kv.length)
        ws, persistent = self._workspace(past + n)
        stage, shared = self._staging(n, r)
        arrays = {"ids": batch.input_ids, "positions": batch.position_ids, "order": batch.tree_order,
                  "readout_index": batch.readout_index, "readout_target": batch.readout_target,
                  "past_length": np.asarray([kv.length])}
        with self.device_span():
            self._place(kv, ws, persistent)
            inputs = stage.upload(arrays)

            def run():
                return self.decoder.score(ws, past, **inputs)
            out = self._pass(("score", past, n, r), run, graphable=persistent and shared)
        logprob, head = out
        return self.to_host(logprob), (self.to_host(head) if head is not None else None)

    def _place(self, kv: StateKV, ws: torch.Tensor, persistent: bool) -> None:
        """The state's K/V in the workspace's state rows: copied (one copy) unless the workspace holds it. An empty
        state's pass writes its packed rows from row 0, over whatever state the workspace held: it holds none after."""
        if not kv.length:
            if persistent:
                self.slots.forget()
            return
        rows = self.decoder.kv_rows(ws)[:, :, :kv.length]  # [L, 2Hkv, S, D]
        if not persistent:
            rows.copy_(kv.storage)
            return
        self.slots.fill(kv, lambda _: rows.copy_(kv.storage))

    def _pass(self, key, run, graphable: bool):
        """``run()`` replayed from the graph of ``key`` when graphs are on and the pass may be captured, else eager."""
        if not (self.cuda_graphs and graphable):
            return run()

        def replay(entry):
            graph, out = entry
            graph.replay()
            return out
        return self.graphs.run(key, lambda: self._capture_graph(run), replay, run)

    def extend(self, kv: StateKV, ids: Sequence[int], chunk: int, between=None) -> StateKV:
        """K/V of ``kv``'s tokens followed by ``ids``: causal chunks written into the workspace's state rows (each
        chunk padded to its bucket, its graph replayed), then the whole state copied once into its own buffer."""
        if not self.fused:
            return super().extend(kv, ids, chunk, between)
        total = kv.length + len(ids)
        starts = range(0, len(ids), chunk)
        rows = max(kv.length + s + self._pass_size(min(chunk, len(ids) - s)) for s in starts)  # the last chunk's pad
        if between is not None:  # already late: before the workspace is taken and its graph slot given up
            between()
        ws, persistent = self._workspace(rows)
        with torch.inference_mode():
            with self.device_span():
                self._place(kv, ws, persistent)
            if persistent:
                self.slots.forget()  # its state rows are being overwritten
            for start in starts:
                if between is not None and start:  # the caller's check (a deadline) before each later chunk
                    between()
                self._prefill_chunk(ws, persistent, kv.length + start, ids[start:start + chunk])
            storage = self._new_storage(total)
            with self.device_span():
                storage.copy_(self.decoder.kv_rows(ws)[:, :, :total])
        state = self._state(storage, total)
        if persistent:
            self.slots.hold(state)  # prefilled in place: the workspace holds it, no copy needed
        return state

    def prefill(self, ids: Sequence[int], chunk: int, between=None) -> StateKV:
        if len(ids) == 0:
            raise ValueError("a state needs at least one token")
        return self.extend(self.empty(), ids, chunk, between)

    def _prefill_chunk(self, ws, persistent: bool, past: int, ids: Sequence[int]) -> None:
        """One chunk after ``past`` rows: padded to its bucket (padding tokens repeat the last position and come
        after every real one, so no real token sees them), K/V into ws rows [past, past + padded)."""
        n = len(ids)
        size = self._pass_size(n)
        arrays = {"ids": np.concatenate([np.asarray(ids, np.int64), np.zeros(size - n, np.int64)]),
                  "positions": past + np.minimum(np.arange(size), n - 1),
                  "order": np.zeros((size, 2), np.int64), "readout_index": np.zeros(0, np.int64),
                  "readout_target": np.zeros(0, np.int64), "past_length": np.asarray([past])}
        stage, shared = self._staging(size, 0)
        with self.device_span():
            inputs = stage.upload(arrays)

            def run():
                self.decoder.prefill(ws, past, inputs["ids"], inputs["positions"])
                return ()
            self._pass(("prefill", past, size), run, graphable=persistent and shared)

    def _run(self, batch: PackedBatch, kv: StateKV):
        """The reference decoder's pass (``fused=False``): (target log-probs, the new tokens' K/V, head scores)."""
        if self.fused:
            raise NotImplementedError("the fused pass runs through score_all and extend")

        def t(a):
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        past = [value for pair in kv.layers for value in pair]
        with torch.inference_mode(), self.device_span():
            tasks = self._task_inputs(batch, kv, t) if self.tasks is not None else ()
            out = self.decoder(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *past,
                               t(batch.readout_index), t(batch.readout_target), *tasks)
        layers = 2 * self.model.num_layers
        has_head = getattr(self.decoder, "head", None) is not None or getattr(self.decoder, "heads", False)
        head = self.to_host(out[1 + layers]) if has_head else None
        return self.to_host(out[0]), list(out[1:1 + layers]), head

    def _task_inputs(self, batch: PackedBatch, kv: StateKV, t) -> list:
        """TaskDecoder's inputs after the contract's: past_length, the pass's task mask, then the tasks' factors in
        the slot graph's order (moved to the device once per set of tasks fed) and, with task heads, the pass's
        read-out rows' exits, head masks and biases, then the heads' weights (``contract.task_head_specs``)."""
        if self._factors[0] is not self.tasks:
            heads = contract.HEAD_WEIGHTS if self.tasks.heads is not None else ()
            self._factors = (self.tasks, tuple(t(np.ascontiguousarray(self.tasks.factors[name]))
                                               for name in contract.task_factor_names(self.tasks.blocks))
                             + tuple(t(np.ascontiguousarray(self.tasks.heads[name])) for name in heads))
        fed = self.tasks.inputs(batch.token_task, batch.num_tokens, batch.readout_index)
        past_length = torch.tensor(kv.length, dtype=torch.int64, device=self.device)
        factors = len(contract.task_factor_names(self.tasks.blocks))
        rows = [t(fed[name]) for name in contract.HEAD_ROWS] if self.tasks.heads is not None else []
        return [past_length, t(fed[contract.TASK_MASK]), *self._factors[1][:factors], *rows,
                *self._factors[1][factors:]]

    def _append(self, kv: StateKV, new) -> StateKV:
        """``kv`` followed by ``new`` (the reference decoder's prefill)."""
        return self._joined(kv, new, new[0].shape[1], lambda old, add: torch.cat([old, add], 1))

    # -- graphs and memory ------------------------------------------------------------------------------------

    def _capture_graph(self, run):
        """(a CUDA graph of ``run()``, its output tensors), after a warm-up run on a side stream (allocator,
        kernels). Any failure of the capture is ``CaptureFailed``: that key then runs without a graph."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
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

    def graph_stats(self) -> dict | None:
        stats = super().graph_stats()
        if stats is not None:
            stats["kernels"] = self.decoder.kernels.describe()
        return stats

    def release_memory(self) -> bool:
        """Without graphs: give back the workspace (it grew to the largest pass); with graphs it stays (they hold
        its address)."""
        if not self.fused or self.cuda_graphs or self._ws is None:
            return False
        self.slots.forget()
        self._ws = None
        return True

    def close(self) -> None:
        """Drop the graphs and the workspace (device memory goes back to torch's allocator); the tasks' factors."""
        if not self.fused:
            self._factors = (None, ())
            return
        self.graphs.clear()
        self.slots.forget()
        self._ws = None
        self._stage = None

    def to_host(self, value) -> np.ndarray:
        """A device tensor as float32 numpy; on the ``meta`` device (shapes only) zeros of its shape."""
        if value.is_meta:
            return np.zeros(tuple(value.shape), dtype=np.float32)
        return value.float().cpu().numpy()


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
