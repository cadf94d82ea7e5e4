"""A host-memory stand-in for the GPU and TensorRT, to test the TensorRT backend's own logic on CPU.

What is real in these tests: every address, size, offset, pitch, shape binding, pool and
graph-cache decision the backend makes. What is replaced: ``HostDevice`` keeps "device"
memory in numpy blocks (an access outside an allocation raises), and ``FakeTensorRT``'s
execution context runs the engine's ONNX graph with ONNX Runtime on the tensors found at
the bound addresses, writing the outputs back to the bound addresses. Like TensorRT, it
refuses (returns False) an input shape outside the plan's optimisation profile and an
address that is not 256-byte aligned. Stream capture
records each enqueued pass with the shapes and addresses bound *at capture time*, as a
CUDA graph does, so a replay that relies on addresses set later reads the wrong data.

Also modelled, because a real GPU punishes them silently or late:

* **per-context state**: an enqueue sets up the context for its shapes (as TensorRT's
  shape-dependent internal state); replaying a graph on a context that has since been set up
  for other shapes raises;
* **activation memory**: a context needs ``device_memory_size_v2`` bytes; the default (STATIC)
  strategy allocates them per context, ``USER_MANAGED`` needs ``set_device_memory`` first;
* **finite memory**: ``HostDevice(capacity=)`` refuses an allocation past it, as cuMemAlloc does;
* **capture failure**: ``HostDevice(uncapturable=True)``.
"""

from __future__ import annotations

import bisect
import functools
import json
import threading
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort

PLAN_FORMAT = "onepass-test-double-plan"


def _needs_context(method):
    """Like every CUDA call: only on a thread where this device's context was made current."""
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if not getattr(self._thread, "active", False):
            raise AssertionError(f"{method.__name__} on a thread with no current CUDA context")
        return method(self, *args, **kwargs)
    return checked


class HostDevice:
    """Device memory as numpy blocks at fake addresses; its context is current only where activated."""

    def __init__(self, compute_capability: str = "sm90", pitch_bug: bool = False, uncapturable: bool = False,
                 capacity: int | None = None, says_capturable: bool = True):
        self._thread = threading.local()
        self.activate()  # as CudaDevice makes its context current on the creating thread
        self.compute_capability = compute_capability
        self.name = "host double"
        self._bases: list[int] = []
        self._blocks: dict[int, np.ndarray] = {}
        self._next = 1 << 20
        self.capturing: list | None = None
        self.allocations = self.frees = self.captures = self.launches = 0
        self.pitch_bug = pitch_bug  # negative control: copy_rows ignores the destination pitch
        self.uncapturable = uncapturable  # the graph holds an operation stream capture refuses
        self.capacity = capacity  # bytes of device memory (None: unlimited)
        self.says_capturable = says_capturable  # what a context's is_stream_capturable answers (TensorRT-RTX)

    def activate(self) -> None:
        self._thread.active = True

    @_needs_context
    def alloc(self, nbytes: int) -> int:
        if self.capacity is not None and self.live_bytes + max(int(nbytes), 1) > self.capacity:
            from onepass.runtime.backends.cuda_device import DeviceError

            raise DeviceError("cuMemAlloc failed: out of memory")
        ptr = self._next
        self._next += (int(nbytes) + 4095) // 4096 * 4096 + 4096  # a guard gap after every block
        bisect.insort(self._bases, ptr)
        self._blocks[ptr] = np.full(max(int(nbytes), 1), 0xFF, np.uint8)  # garbage, as cudaMalloc gives: NaN floats
        self.allocations += 1
        return ptr

    @_needs_context
    def free(self, ptr: int) -> None:
        if ptr not in self._blocks:
            raise AssertionError(f"free of {ptr:#x}, which is not an allocation")
        del self._blocks[ptr]
        self._bases.remove(ptr)
        self.frees += 1

    @property
    def live_bytes(self) -> int:
        return sum(b.size for b in self._blocks.values())

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes [ptr, ptr + nbytes) inside one live allocation (else AssertionError)."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            raise AssertionError(f"address {ptr:#x} is below every allocation")
        base = self._bases[i]
        block = self._blocks[base]
        if ptr + nbytes > base + block.size:
            raise AssertionError(f"access [{ptr:#x}, +{nbytes}) runs past its allocation of {block.size} bytes")
        return block[ptr - base:ptr - base + nbytes]

    @_needs_context
    def stream(self):
        return "stream"

    @staticmethod
    def handle(stream) -> int:
        return 7

    @_needs_context
    def event_timer(self, stream):
        """Host time between start() and stop(), as CudaDevice's CUDA events give on the stream (host and stream
        are one here: every call completes before it returns)."""
        import time

        clock = {}
        return types.SimpleNamespace(start=lambda: clock.__setitem__("t", time.perf_counter()),
                                     stop=lambda: (time.perf_counter() - clock["t"]) * 1000)

    @_needs_context
    def upload(self, ptr: int, array: np.ndarray, stream) -> None:
        self.view(ptr, array.nbytes)[:] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)

    @_needs_context
    def download(self, array: np.ndarray, ptr: int, stream) -> None:
        array.view(np.uint8).reshape(-1)[:] = self.view(ptr, array.nbytes)

    @_needs_context
    def zero(self, ptr: int, nbytes: int, stream) -> None:
        self.view(ptr, nbytes)[:] = 0

    @_needs_context
    def copy_rows(self, dst, dst_pitch, src, src_pitch, width, rows, stream) -> None:
        if self.pitch_bug:
            dst_pitch = width
        for row in range(rows):
            self.view(dst + row * dst_pitch, width)[:] = self.view(src + row * src_pitch, width)

    @_needs_context
    def synchronize(self, stream) -> None:
        pass

    @_needs_context
    def capture(self, stream, enqueue):
        self.capturing = []
        try:
            enqueue()
        finally:
            graph, self.capturing = self.capturing, None
        self.captures += 1
        if self.uncapturable:  # as cuStreamEndCapture reports a capture an operation invalidated
            graph.clear()
            from onepass.runtime.backends.cuda_device import DeviceError

            raise DeviceError("cuStreamEndCapture failed: operation not permitted when stream is capturing")
        return graph

    @_needs_context
    def launch(self, graph, stream) -> None:
        self.launches += 1
        for step in graph:
            step()

    def release_graph(self, graph) -> None:
        graph.clear()


def write_plan(manifest, graph: str = "decoder.onnx") -> tuple[bytes, dict]:
    """The double's "plan" (which ONNX graph its contexts run, under which profiles) and its profiles,
    the same ones ``onepass build-trt`` gives a real plan."""
    from onepass.runtime.backends.tensorrt_build import role_profiles

    profiles = {name: p.as_dict() for name, p in role_profiles(manifest).items()}
    return json.dumps({"format": PLAN_FORMAT, "graph": graph, "profiles": profiles}).encode(), profiles


ACTIVATION_BYTES = 3 << 20  # what the double's "plan" says a context needs for its activations


class _Context:
    def __init__(self, session: ort.InferenceSession, device: HostDevice, profiles: list, user_managed: bool):
        self.session, self.device, self.profiles = session, device, profiles
        self.profile = profiles[0]
        self.shapes: dict = {}
        self.addresses: dict = {}
        self.set_up_for: dict | None = None  # the shapes of the last enqueue: TensorRT's shape-dependent state
        self.memory = None if user_managed else device.alloc(ACTIVATION_BYTES)  # STATIC: its own, for life
        self.inputs = {i.name: i for i in session.get_inputs()}
        self.outputs = [o.name for o in session.get_outputs()]

    def set_input_shape(self, name, shape) -> bool:
        if name not in self.inputs:
            raise AssertionError(f"{name} is not an input of the plan")
        dims = self.inputs[name].shape  # ints, or the names of the dynamic axes
        if len(dims) != len(shape):
            return False
        for want, got in zip(dims, shape):
            lo, _, hi = self.profile[want] if isinstance(want, str) else (want, want, want)
            if not lo <= int(got) <= hi:
                return False
        self.shapes[name] = tuple(int(d) for d in shape)
        return True

    def set_optimization_profile_async(self, index: int, stream_handle) -> bool:
        if not 0 <= index < len(self.profiles):
            return False
        self.profile = self.profiles[index]
        self.shapes.clear()
        return True

    def is_stream_capturable(self, stream_handle) -> bool:
        return self.device.says_capturable

    def set_device_memory(self, ptr: int, size: int) -> None:
        if int(ptr) % 256 or size < ACTIVATION_BYTES:
            raise AssertionError(f"activation memory {ptr:#x} (+{size}) is misaligned or under {ACTIVATION_BYTES}")
        self.device.view(ptr, ACTIVATION_BYTES)  # inside one live allocation
        self.memory = int(ptr)

    def set_tensor_address(self, name, ptr) -> bool:
        if name not in self.inputs and name not in self.outputs:
            raise AssertionError(f"{name} is not a tensor of the plan")
        if int(ptr) % 256:
            return False
        self.addresses[name] = int(ptr)
        return True

    @property
    def _thread(self):
        return self.device._thread

    @_needs_context
    def execute_async_v3(self, stream_handle) -> bool:
        shapes, addresses = dict(self.shapes), dict(self.addresses)  # baked in, as in a captured graph
        missing = [n for n in list(self.inputs) + self.outputs if n not in addresses] + \
                  [n for n in self.inputs if n not in shapes]
        if missing:
            raise AssertionError(f"enqueued with unbound tensors: {missing[:3]}")
        if self.memory is None:
            raise AssertionError("enqueued on a USER_MANAGED context that has no device memory")
        self.set_up_for = shapes

        def run():
            if self.set_up_for != shapes:  # only a replay can see this: an enqueue has just set it
                raise AssertionError("a graph replayed on an execution context since set up for other shapes "
                                     "(TensorRT's per-context state no longer matches the capture)")
            self.device.view(self.memory, ACTIVATION_BYTES)[:64] = 0xCD  # scratch use of the activations
            feeds = {}
            for name, info in self.inputs.items():
                dtype = {"tensor(int64)": np.int64, "tensor(bool)": np.bool_, "tensor(float)": np.float32}[info.type]
                shape = shapes[name]
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                feeds[name] = self.device.view(addresses[name], nbytes).view(dtype).reshape(shape).copy()
            for name, value in zip(self.outputs, self.session.run(self.outputs, feeds)):
                if value.size:
                    self.device.upload(addresses[name], np.ascontiguousarray(value, np.float32), None)

        if self.device.capturing is not None:
            self.device.capturing.append(run)
        else:
            run()
        return True


class _Engine:
    device_memory_size_v2 = ACTIVATION_BYTES

    def __init__(self, session, device, profiles):
        self.session, self.device, self.profiles = session, device, profiles
        self._names = [i.name for i in session.get_inputs()] + [o.name for o in session.get_outputs()]
        self.num_io_tensors = len(self._names)
        self.contexts_created = self.static_contexts = 0

    def get_tensor_name(self, i: int) -> str:
        return self._names[i]

    def create_execution_context(self, strategy=0):
        self.contexts_created += 1
        self.static_contexts += strategy != USER_MANAGED
        return _Context(self.session, self.device, self.profiles, user_managed=strategy == USER_MANAGED)


USER_MANAGED = 2  # the value of ExecutionContextAllocationStrategy.USER_MANAGED in TensorRT


@functools.lru_cache(maxsize=2)
def _session(graph: str) -> ort.InferenceSession:
    """One ONNX Runtime session per graph file for the whole test session (loading the 540 MB graph takes
    seconds; a session is stateless between runs, so every stand-in engine may share it)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])


def fake_tensorrt(root: Path, device: HostDevice, version: str = "0.1"):
    """A module-like object with the slice of the TensorRT API the backend uses."""

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data: bytes):
            spec = json.loads(data)
            if spec.get("format") != PLAN_FORMAT:
                return None
            return _Engine(_session(str(Path(root) / spec["graph"])), device, list(spec["profiles"].values()))

    strategy = types.SimpleNamespace(STATIC=0, ON_PROFILE_CHANGE=1, USER_MANAGED=USER_MANAGED)
    module = types.SimpleNamespace(Logger=Logger, Runtime=Runtime, ExecutionContextAllocationStrategy=strategy,
                                   __version__=version)
    module.__name__ = "tensorrt_double"
    return module
