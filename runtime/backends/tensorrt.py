"""TensorRT backend: the engine's plan on one GPU, with the state's K/V resident on the device.

No torch: device memory, the stream and CUDA graphs go through ``cuda.bindings``
(``cuda_device.CudaDevice``); TensorRT is either standard ``tensorrt`` (NGC, JetPack) or
``tensorrt_rtx``. The plan comes from the manifest's ``plans`` and must have been built for
this device's compute capability with this TensorRT; any other plan is refused with the
command that builds the right one.

Memory:

* **State K/V** live in device blocks from a ``StatePool``: one block per state holds its
  2L tensors, each [Hkv, S, D] contiguous. A prefill chunk writes its K/V into a fresh
  block; a single-chunk state *is* that block (no copy), later chunks are appended by a
  strided device-to-device copy. Score passes bind the state's tensors as ``past_*``
  inputs by address: read in place, never copied, never on the host. Blocks of evicted
  states go back to the pool and serve later states of the same size class.
* **Score passes** are padded to bucketed (packed, read-out) shapes, capped at the engine's
  ``max_packed_tokens`` (``graphs.bucketed``; padding changes no real output). Each bucket has
  its own input/output buffers; the present K/V a score pass must write go to one scratch block.
* **Graph slots**: with ``cuda_graphs`` a score pass reads its state from one of ``slots``
  fixed device slots (``graphs.SlotTable``; a state is copied in, one device-to-device copy,
  unless it is still there from its last pass), and the pass of each (slot, state length,
  bucket) is captured once it has been seen ``capture_after`` times (default 2: a one-off
  state length runs uncaptured instead of paying a capture) and replayed after: only the
  inputs are uploaded and the two [R] outputs read back. The graph shape includes the state's
  exact length (the ONNX contract has no mask over the past, so it cannot be padded), so the
  captures are bounded by slots x lengths seen twice x buckets and by ``MAX_GRAPHS`` (least
  recently used evicted) — never by which state is asked about, and no graph holds a state's
  memory. The slots' bytes are ``reserved_bytes``, taken out of the engine's state-cache budget.

One stream per backend; calls are serialised by the engine. Execution contexts: one per
optimisation profile of the plan (``prefill`` and ``score``, see ``tensorrt_build.role_profiles``)
for plain passes, plus **one per captured CUDA graph**: TensorRT keeps shape-dependent state in
its context, so a graph is only replayed on the context it was captured on, which never sees
another shape (NVIDIA's CUDA-graph guidance). All contexts are created ``USER_MANAGED`` and run
in **one** activation buffer of the plan's device-memory size: passes never overlap (one stream,
serialised calls), so memory does not grow with the number of contexts.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from . import contract
from .errors import EngineFileError, OnepassError
from .model import EngineDescription
from .batch import PackedBatch, bucket, pad_batch
from .base import Backend, StateKV
from .graphs import MAX_GRAPHS, SLOT_TOKENS, SLOTS, CaptureFailed, GraphCache, SlotTable, bucketed, padded
from .tensorrt_build import import_tensorrt

log = logging.getLogger("onepass.tensorrt")

FLOAT = 4  # bytes of a float32 K/V element (fp16 engines keep K/V in float32 too)
ALIGN = 256  # bytes: TensorRT refuses a tensor address that is not a multiple


def tensorrt_version(trt) -> str:
    """How a plan records the TensorRT that built it, e.g. ``tensorrt 10.13.3.9``."""
    return f"{trt.__name__} {trt.__version__}"


def select_plan(manifest: EngineDescription, tensorrt: str, compute_capability: str) -> dict:
    """The manifest's plan for this device and TensorRT, or a clear refusal saying how to build one."""
    build = "onepass build-trt --engine DIR --arch native (on this device)"
    for_device = [p for p in manifest.plans if p.get("compute_capability") == compute_capability]
    if not for_device:
        have = ", ".join(sorted(f"{p.get('compute_capability')} ({p.get('tensorrt')})" for p in manifest.plans))
        raise EngineFileError(f"this engine has no TensorRT plan for {compute_capability}"
                              f"{'; it has ' + have if have else ''}: run {build}")
    for plan in for_device:
        if plan.get("tensorrt") == tensorrt:
            return plan
    raise EngineFileError(f"the {compute_capability} plan was built with {for_device[0].get('tensorrt')}, "
                          f"this machine runs {tensorrt}; plans do not move between TensorRT versions: run {build}")


class Block:
    """One device allocation lent by a ``StatePool``; it goes back to the pool when no longer referenced."""

    def __init__(self, pool: "StatePool", ptr: int, size: int):
        self.ptr, self.size = ptr, size
        self._finalizer = weakref.finalize(self, pool._give_back, ptr, size)
        self._finalizer.atexit = False


def _activation_bytes(engine) -> int:
    """The device memory a context of the plan needs for any profile (TensorRT >= 10.1: ``_v2``)."""
    size = getattr(engine, "device_memory_size_v2", None)
    return int(size if size is not None else engine.device_memory_size)


class StatePool:
    """Device blocks for state K/V, rounded up to ``granule`` bytes and reused by size.

    Freed blocks are kept (up to ``keep_bytes`` in all) for the next state of the same
    size class; beyond that they are freed.
    """

    def __init__(self, device, granule: int, keep_bytes: int):
        self.device, self.granule, self.keep_bytes = device, max(int(granule), 1), keep_bytes
        self._free: dict[int, list[int]] = {}
        self._release: list[int] = []  # blocks to free at the next take (never from a finalizer: it may run
        self.kept_bytes = 0            # in the middle of a stream capture, where freeing is not allowed)
        self.allocations = 0

    def take(self, nbytes: int) -> Block:
        """A block of at least ``nbytes``: a kept one of its size class, else a new allocation; when the device
        is out of memory, the kept blocks of other sizes are freed and the allocation is tried once more."""
        self.drain()
        size = -(-max(int(nbytes), 1) // self.granule) * self.granule
        free = self._free.get(size)
        if free:
            self.kept_bytes -= size
            return Block(self, free.pop(), size)
        try:
            ptr = self.device.alloc(size)
        except OnepassError:
            if not self.kept_bytes:
                raise
            self.clear()
            ptr = self.device.alloc(size)
        self.allocations += 1
        return Block(self, ptr, size)

    def _give_back(self, ptr: int, size: int) -> None:
        if self.kept_bytes + size <= self.keep_bytes:
            self._free.setdefault(size, []).append(ptr)
            self.kept_bytes += size
        else:
            self._release.append(ptr)

    def drain(self) -> None:
        """Free the blocks released beyond what the pool keeps."""
        while self._release:
            self.device.free(self._release.pop())

    def clear(self) -> None:
        """Free every kept block."""
        self.drain()
        for ptrs in self._free.values():
            for ptr in ptrs:
                self.device.free(ptr)
        self._free.clear()
        self.kept_bytes = 0


@dataclass(frozen=True)
class DeviceTensor:
    """A float32 tensor in device memory: ``ptr`` into ``block`` (which it keeps alive)."""

    ptr: int
    shape: tuple
    block: object = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * FLOAT


class TensorRTBackend(Backend):
    """The manifest's TensorRT plan for this device. ``device``/``tensorrt`` default to the real ones."""

    def __init__(self, root: Path, manifest: EngineDescription, threads: int | None = None, *, name: str | None = None,
                 device=None, tensorrt=None, ordinal: int = 0, cuda_graphs: bool = True, pool_bytes: int = 1 << 30,
                 slots: int = SLOTS, capture_after: int = 2, slot_tokens: int = SLOT_TOKENS,
                 max_graphs: int = MAX_GRAPHS):
        super().__init__(manifest.model, name)  # threads: CPU threads, which a TensorRT plan does not use
        trt = tensorrt or import_tensorrt()
        if device is None:
            from .cuda_device import CudaDevice

            device = CudaDevice(ordinal)
        self.device = device
        self.plan = select_plan(manifest, tensorrt_version(trt), device.compute_capability)
        data = (Path(root) / self.plan["file"]).read_bytes()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise EngineFileError(f"TensorRT could not load {self.plan['file']} (see its log above)")
        self.stream = device.stream()
        self._handle = device.handle(self.stream)
        self._user_managed = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        self.activation_bytes = _activation_bytes(self.engine)
        self._activation = device.alloc(self.activation_bytes)  # shared by every context (passes never overlap)
        roles = list(self.plan.get("profiles", {"prefill": None}))  # older plans: one profile for both roles
        self._profile = {role: index for index, role in enumerate(roles)}
        self.contexts = {role: self._new_context(role) for role in roles}
        self._prefill = self.contexts["prefill"]
        self._score = self.contexts.get("score", self._prefill)
        self._score_role = "score" if "score" in self.contexts else "prefill"
        device.synchronize(self.stream)
        m = manifest.model
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        self.has_head = contract.HEAD_SCORE in names
        # plans of graphs with past_length pad a state to its length bucket (graphs keyed by the bucket); older ones
        # key graphs on the state's exact length
        self.has_past_length = contract.PAST_LENGTH in names
        self.inputs = contract.BATCH_INPUTS + ((contract.PAST_LENGTH,) if self.has_past_length else ())
        dims = (m.num_layers, m.num_kv_heads, m.head_dim)
        self.past_names = [s.name for s in contract.input_specs(*dims) if contract.PAST in s.shape]
        self.present_names = [s.name for s in contract.output_specs(*dims) if s.name.startswith(contract.PRESENT)]
        self.cuda_graphs = cuda_graphs
        self._row = m.head_dim * FLOAT  # bytes of one token's K or V in one KV head
        self.pool = StatePool(device, granule=64 * m.kv_bytes_per_token(), keep_bytes=pool_bytes)
        self._nothing = device.alloc(256)  # the address of every zero-length tensor
        self._io: dict = {}  # (packed, readout) -> (device pointers, host output arrays)
        self._scratch: tuple[int, int] | None = None  # (ptr, bytes): present K/V a score pass writes
        self._presents: dict[int, list] = {}  # packed bucket -> its 2L present tensors in the scratch
        self.max_packed = manifest.limits.max_packed_tokens
        self.slot_tokens = min(slot_tokens, manifest.limits.max_state_tokens)  # longer states run without a graph
        self.slots = SlotTable(slots)
        self._slot_ptrs: list[int] = []  # allocated at the first graph pass, fixed for the backend's life
        self.reserved_bytes = slots * self._kv_bytes(self.slot_tokens) if cuda_graphs else 0
        self.graphs = GraphCache(max_graphs, release=lambda entry: self.device.release_graph(entry[0]),
                                 capture_after=capture_after)

    def _new_context(self, role: str):
        """An execution context on ``role``'s profile that runs in the shared activation buffer."""
        context = self.engine.create_execution_context(self._user_managed)
        if context is None:
            raise EngineFileError(f"TensorRT could not create an execution context for {self.plan['file']}")
        if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1
            context.set_device_memory(self._activation, self.activation_bytes)
        else:
            context.device_memory = self._activation
        index = self._profile[role]
        if index and not context.set_optimization_profile_async(index, self._handle):
            raise EngineFileError(f"TensorRT could not select profile {index} ({role}) of {self.plan['file']}")
        return context

    # -- state K/V ---------------------------------------------------------------------------------

    def _step(self, length: int) -> int:
        """Bytes from one layer's K (or V) tensor [Hkv, length, D] to the next: its size rounded up to
        TensorRT's 256-byte address alignment. SmolLM2's rows (3 heads x 64 x 4 bytes) always align; a model
        whose Hkv x D is not a multiple of 64 would otherwise put every other tensor of an odd-length chunk
        at an address TensorRT refuses."""
        size = self.model.num_kv_heads * length * self._row
        return -(-size // ALIGN) * ALIGN

    def _kv_bytes(self, length: int) -> int:
        """Bytes of the 2L aligned K/V tensors of ``length`` tokens."""
        return 2 * self.model.num_layers * self._step(length)

    def _tensors(self, block: Block, base: int, length: int) -> list[DeviceTensor]:
        """The 2L tensors [Hkv, length, D] laid out one after another from ``base``, each at a 256-byte
        aligned address."""
        m = self.model
        shape = (m.num_kv_heads, length, m.head_dim)
        step = self._step(length)
        return [DeviceTensor(base + i * step, shape, block) for i in range(2 * m.num_layers)]

    def _state(self, tensors: Sequence[DeviceTensor], length: int) -> StateKV:
        layers = tuple((tensors[2 * i], tensors[2 * i + 1]) for i in range(self.model.num_layers))
        return StateKV(layers, length, length * self.model.kv_bytes_per_token())

    def prefill(self, ids: Sequence[int], chunk: int, between=None) -> StateKV:
        self.device.activate()  # every entry point: the calling thread may not be the one that made the backend
        return super().prefill(ids, chunk, between)

    def extend(self, kv: StateKV, ids: Sequence[int], chunk: int, between=None) -> StateKV:
        self.device.activate()
        return super().extend(kv, ids, chunk, between)

    def to_host(self, value: DeviceTensor) -> np.ndarray:
        self.device.activate()
        out = np.empty(value.shape, np.float32)
        if out.size:
            self.device.download(out, value.ptr, self.stream)
            self.device.synchronize(self.stream)
        return out

    def device_timer(self):
        """CUDA events on the backend's stream around a call: `onepass bench`'s device stage. With concurrent
        callers a call's span includes the passes queued on the stream ahead of it (they run one at a time)."""
        self.device.activate()
        return self.device.event_timer(self.stream)

    def empty(self) -> StateKV:
        return self._state([DeviceTensor(self._nothing, (self.model.num_kv_heads, 0, self.model.head_dim))]
                           * (2 * self.model.num_layers), 0)

    def _append(self, kv: StateKV, new) -> StateKV:
        """``kv`` followed by the chunk ``new`` (its own block): the first chunk is kept as it is,
        later ones are copied with the old K/V into one block of the joint length (device to device)."""
        n = new[0].shape[1]
        if kv.length == 0:
            return self._state(new, n)
        m, total = self.model, kv.length + n
        block = self.pool.take(self._kv_bytes(total))
        out = self._tensors(block, block.ptr, total)
        old = [value for pair in kv.layers for value in pair]
        for dst, a, b in zip(out, old, new):  # per KV head: [old rows | new rows]
            self.device.copy_rows(dst.ptr, total * self._row, a.ptr, kv.length * self._row,
                                  kv.length * self._row, m.num_kv_heads, self.stream)
            self.device.copy_rows(dst.ptr + kv.length * self._row, total * self._row, b.ptr, n * self._row,
                                  n * self._row, m.num_kv_heads, self.stream)
        self.device.synchronize(self.stream)
        return self._state(out, total)

    # -- passes ------------------------------------------------------------------------------------

    def _buffers(self, packed: int, readout: int):
        """Device input/output buffers for passes of up to (packed, read-out) bucket sizes, allocated once."""
        packed, readout = padded(packed, self.max_packed), padded(readout, self.max_packed)
        key = (packed, readout)
        if key not in self._io:
            sizes = {contract.INPUT_IDS: packed * 8, contract.POSITION_IDS: packed * 8,
                     contract.TREE_MASK: packed * packed, contract.READOUT_INDEX: readout * 8,
                     contract.READOUT_TARGET: readout * 8, contract.PAST_LENGTH: 8,
                     contract.TARGET_LOGPROB: readout * FLOAT, contract.HEAD_SCORE: readout * FLOAT}
            ptrs = {name: self.device.alloc(size) for name, size in sizes.items()}
            host = {name: np.empty(readout, np.float32) for name in (contract.TARGET_LOGPROB, contract.HEAD_SCORE)}
            self._io[key] = (ptrs, host)
        return self._io[key]

    def _scratch_presents(self, packed: int) -> list[DeviceTensor]:
        """Where a score pass writes the K/V of its packed tokens (never read); grows on demand."""
        if packed in self._presents:  # the hot path: a replayed bucket
            return self._presents[packed]
        # with graphs, sized once for the largest pass: graphs keep its address, so growing it would drop them all
        need = self._kv_bytes(self.max_packed if self.cuda_graphs else packed)
        if self._scratch is None or self._scratch[1] < need:
            self.graphs.clear()  # captured graphs hold the old scratch address
            self._presents.clear()
            if self._scratch is not None:
                self.device.free(self._scratch[0])
            self._scratch = (self.device.alloc(need), need)
        self._presents[packed] = self._tensors(None, self._scratch[0], packed)
        return self._presents[packed]

    def _upload(self, batch: PackedBatch, ptrs: dict, past_length: int) -> dict:
        """Copy the batch's input arrays (and the state's length, where the plan takes it) into their device
        buffers; returns their shapes. The arrays stay referenced until the stream is synchronised (``_read``)."""
        shapes = {}
        self._uploaded = []
        for name in self.inputs:
            value = past_length if name == contract.PAST_LENGTH else getattr(batch, name)
            dtype = np.bool_ if name == contract.TREE_MASK else np.int64
            array = np.array(value, dtype=dtype, order="C")  # 0-d stays 0-d
            self.device.upload(ptrs[name], array, self.stream)
            self._uploaded.append(array)
            shapes[name] = array.shape
        return shapes

    def _point(self, context, shapes: dict, kv: StateKV, ptrs: dict, presents: Sequence[DeviceTensor]) -> None:
        """Give ``context`` every input shape and every tensor address: inputs, state (in place), outputs."""
        n, r = shapes[contract.INPUT_IDS][0], shapes[contract.READOUT_INDEX][0]

        def shape(name, dims):
            if not context.set_input_shape(name, tuple(dims)):
                raise EngineFileError(f"the TensorRT plan does not accept {name} of shape {tuple(dims)} (outside its "
                                      f"optimisation profiles {self.plan.get('profiles')}); rebuild it for these limits")

        def address(name, ptr):
            if not context.set_tensor_address(name, ptr):
                raise EngineFileError(f"TensorRT refused the address of {name} (see its log above)")

        for name in self.inputs:
            shape(name, shapes[name])
            address(name, ptrs[name])
        past = [value for pair in kv.layers for value in pair]
        for name, tensor in zip(self.past_names, past):
            shape(name, tensor.shape)
            address(name, tensor.ptr if kv.length else self._nothing)
        for name, tensor in zip(self.present_names, presents):
            address(name, tensor.ptr if n else self._nothing)
        for name in (contract.TARGET_LOGPROB, contract.HEAD_SCORE) if self.has_head else (contract.TARGET_LOGPROB,):
            address(name, ptrs[name] if r else self._nothing)

    def _enqueue(self, context) -> None:
        """One pass on the stream (timed as a device span when asked; see ``Backend.device_span``)."""
        with self.device_span():
            self._execute(context)

    def _execute(self, context) -> None:
        if not context.execute_async_v3(self._handle):
            raise EngineFileError("TensorRT could not enqueue the pass (see its log above)")

    def _read(self, ptrs: dict, host: dict, r: int):
        """Copy the [R] outputs back and wait for the stream."""
        logprob, score = host[contract.TARGET_LOGPROB], host[contract.HEAD_SCORE]
        if r:  # a prefill chunk (r == 0) has nothing to read back
            self.device.download(logprob, ptrs[contract.TARGET_LOGPROB], self.stream)
            if self.has_head:
                self.device.download(score, ptrs[contract.HEAD_SCORE], self.stream)
        self.device.synchronize(self.stream)
        return logprob[:r].copy(), (score[:r].copy() if self.has_head else None)

    def _run(self, batch: PackedBatch, kv: StateKV):
        """One unpadded pass whose new K/V land in a fresh pool block (prefill chunks). A pass with no
        read-out gets one unused read-out row: the plan's profile starts at one."""
        r = batch.readout_index.shape[0]
        if r == 0:
            batch = pad_batch(batch, batch.num_tokens, 1)
        n = batch.num_tokens
        ptrs, host = self._buffers(n, batch.readout_index.shape[0])
        block = self.pool.take(self._kv_bytes(n))
        presents = self._tensors(block, block.ptr, n)
        self._point(self._prefill, self._upload(batch, ptrs, kv.length), kv, ptrs, presents)
        self._enqueue(self._prefill)
        logprob, head = self._read(ptrs, host, r)  # the first r rows: none for a padded prefill chunk
        return logprob, presents, head

    def score_all(self, kv: StateKV, batch: PackedBatch):
        """Score pass padded to its bucket; with graphs, over the state's slot and replayed from the graph of
        (slot, state bucket, packed bucket, read-out bucket) once that key is due for capture (a plan without
        ``past_length``: the state's exact length in place of its bucket)."""
        self.check(batch)
        self.device.activate()
        r = batch.readout_index.shape[0]
        padded = bucketed(batch, self.max_packed)
        packed, readout = padded.num_tokens, padded.readout_index.shape[0]
        ptrs, host = self._buffers(packed, readout)
        presents = self._scratch_presents(packed)
        shapes = self._upload(padded, ptrs, kv.length)  # into the buffers a captured graph reads
        if not self.cuda_graphs or kv.length > self.slot_tokens or kv.length == 0:
            return self._plain(shapes, kv, ptrs, presents, host, r)
        index, slot = self._in_slot(kv)
        key = (index, slot.length, packed, readout)

        def capture():  # a context of its own: shapes and addresses are set once, then baked into the graph
            ctx = self._new_context(self._score_role)
            self._point(ctx, shapes, slot, ptrs, presents)
            self._enqueue(ctx)  # a first, uncaptured pass settles TensorRT's shape-dependent set-up
            self.device.synchronize(self.stream)
            try:
                if hasattr(ctx, "is_stream_capturable") and not ctx.is_stream_capturable(self._handle):
                    raise CaptureFailed("TensorRT says this context cannot be stream-captured")
                return self.device.capture(self.stream, lambda: self._execute(ctx)), ctx  # no events in a capture
            except OnepassError as err:  # e.g. an operation that cannot be captured
                raise CaptureFailed(str(err)) from err

        def replay(entry):
            with self.device_span():
                self.device.launch(entry[0], self.stream)
            return self._read(ptrs, host, r)

        return self.graphs.run(key, capture, replay, lambda: self._plain(shapes, slot, ptrs, presents, host, r))

    def _plain(self, shapes: dict, kv: StateKV, ptrs: dict, presents, host: dict, r: int):
        """The score pass enqueued on the shared score context, without a graph."""
        self._point(self._score, shapes, kv, ptrs, presents)
        self._enqueue(self._score)
        return self._read(ptrs, host, r)

    def _slot_rows(self, length: int) -> int:
        """Rows a state of ``length`` tokens takes in a slot: its bucket (padding rows masked by ``past_length``),
        or its exact length for a plan without that input."""
        return bucket(length, self.slot_tokens) if self.has_past_length else length

    def _in_slot(self, kv: StateKV) -> tuple[int, StateKV]:
        """(slot index, ``kv`` as read from its graph slot, laid out at its bucket's length): copied in (device to
        device) unless it is still there from its last pass. Slots are allocated at the first use and never move."""
        if not self._slot_ptrs:  # zeroed: a padding row is masked, yet multiplies its value (NaN x 0 is NaN)
            size = self._kv_bytes(self.slot_tokens)
            self._slot_ptrs = [self.device.alloc(size) for _ in range(self.slots.count)]
            for ptr in self._slot_ptrs:
                self.device.zero(ptr, size, self.stream)
        rows = self._slot_rows(kv.length)
        index = self.slots.fill(kv, lambda i: self._copy_in(self._tensors(None, self._slot_ptrs[i], rows), kv))
        return index, self._state(self._tensors(None, self._slot_ptrs[index], rows), rows)

    def _copy_in(self, slot: Sequence[DeviceTensor], kv: StateKV) -> None:
        """The state's 2L tensors into the slot's: one copy when both have the same layout and the state's tensors
        lie end to end in one block, as prefill lays them out; else tensor by tensor, each head's rows at the slot's
        row pitch (a state padded to its bucket: rows from its length on are padding, masked by ``past_length``)."""
        old = [value for pair in kv.layers for value in pair]
        step = self._step(kv.length)
        rows = slot[0].shape[1]
        if rows == kv.length and all(t.ptr == old[0].ptr + i * step for i, t in enumerate(old)):
            size = len(old) * step
            self.device.copy_rows(slot[0].ptr, size, old[0].ptr, size, size, 1, self.stream)
            return
        width = kv.length * self._row
        for dst, src in zip(slot, old):
            self.device.copy_rows(dst.ptr, rows * self._row, src.ptr, width, width, self.model.num_kv_heads,
                                  self.stream)

    def close(self) -> None:
        """Release the graphs and every device buffer this backend holds (states still referenced keep theirs)."""
        self.device.activate()
        self.graphs.clear()
        self.device.synchronize(self.stream)
        for ptrs, _ in self._io.values():
            for ptr in ptrs.values():
                self.device.free(ptr)
        self._io.clear()
        if self._scratch is not None:
            self.device.free(self._scratch[0])
            self._scratch = None
        self._presents.clear()
        for ptr in self._slot_ptrs:
            self.device.free(ptr)
        self._slot_ptrs = []
        self.slots.forget()
        self.pool.clear()
        self.contexts.clear()
        self._prefill = self._score = None
        if self._activation is not None:
            self.device.free(self._activation)
            self._activation = None
