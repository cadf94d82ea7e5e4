"""Device memory, streams and CUDA graphs through ``cuda.bindings`` (cuda-python): no torch.

``CudaDevice`` is the only place the TensorRT backend touches CUDA. It offers the few
operations that backend needs: allocate/free, host<->device copies, a strided
device-to-device copy (rows of a [H, S, D] cache), one stream, and stream capture into a
CUDA graph that is replayed later. Every driver call is checked; a failure raises
``BackendUnavailable`` (no device, no driver) or ``DeviceError`` with the driver's message.
"""

from __future__ import annotations

import numpy as np

from .errors import BackendUnavailable, OnepassError


class DeviceError(OnepassError):
    """A CUDA driver call failed."""


def bindings_version() -> str:
    """The installed cuda-bindings version ("13.0.3")."""
    from cuda import bindings

    return str(getattr(bindings, "__version__", "0"))


def check_driver_supports_bindings(driver_version: int, bindings: str) -> None:
    """cuda-bindings N.x calls the CUDA N driver API: a driver older than CUDA N (``driver_version`` as
    cuDriverGetVersion gives it, 12060 = 12.6) fails later in obscure ways, so it is refused here by name."""
    major = int(bindings.split(".", 1)[0])
    if driver_version // 1000 < major:
        have = f"{driver_version // 1000}.{driver_version % 1000 // 10}"
        fits = f"cuda-bindings>={have},<{driver_version // 1000 + 1}"
        raise BackendUnavailable(f"cuda-bindings {bindings} needs a CUDA {major} driver; this machine's driver "
                                 f"supports CUDA {have}: pip install '{fits}' (JetPack 6 and R570 hosts are CUDA 12)")


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailable("the TensorRT backend needs cuda-python: pip install 'onepass[trt]' "
                                 "(on JetPack: cuda-bindings matching its CUDA 12)") from exc
    return driver


class CudaDevice:
    """One CUDA device (``ordinal``) with its primary context current on this thread."""

    def __init__(self, ordinal: int = 0):
        cu = self.cu = _driver()
        try:
            self._check(cu.cuInit(0), "cuInit")
        except RuntimeError as exc:  # libcuda.so.1 missing: no driver on this machine
            raise BackendUnavailable(f"no CUDA driver on this machine ({exc})") from exc
        check_driver_supports_bindings(int(self._check(cu.cuDriverGetVersion(), "cuDriverGetVersion")),
                                       bindings_version())
        count = self._check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            raise BackendUnavailable(f"CUDA device {ordinal} asked for, this machine has {count}")
        self.device = self._check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = self._check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        attr = cu.CUdevice_attribute
        major = self._check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device), "")
        minor = self._check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device), "")
        self.compute_capability = f"sm{major}{minor}"
        name = self._check(cu.cuDeviceGetName(128, self.device), "cuDeviceGetName")
        self.name = bytes(name).split(b"\0", 1)[0].decode()

    def activate(self) -> None:
        """Make this device's context current on the calling thread (a CUDA context is current per thread:
        a server's worker thread is not the thread that created the backend)."""
        self._check(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _check(self, result, what: str):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            _, msg = self.cu.cuGetErrorString(err)
            text = msg.decode() if isinstance(msg, bytes) else str(err)
            if err == self.cu.CUresult.CUDA_ERROR_NO_DEVICE:
                raise BackendUnavailable(f"no CUDA device: {text}")
            raise DeviceError(f"{what} failed: {text}")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    def alloc(self, nbytes: int) -> int:
        return int(self._check(self.cu.cuMemAlloc(max(int(nbytes), 1)), "cuMemAlloc"))

    def free(self, ptr: int) -> None:
        self._check(self.cu.cuMemFree(ptr), "cuMemFree")

    def stream(self):
        return self._check(self.cu.cuStreamCreate(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    @staticmethod
    def handle(stream) -> int:
        """The stream as the integer TensorRT's ``execute_async_v3`` takes."""
        return int(stream)

    def upload(self, ptr: int, array: np.ndarray, stream) -> None:
        """Host -> device (``array`` must stay alive until the stream is synchronised)."""
        self._check(self.cu.cuMemcpyHtoDAsync(ptr, array.ctypes.data, array.nbytes, stream), "cuMemcpyHtoDAsync")

    def download(self, array: np.ndarray, ptr: int, stream) -> None:
        """Device -> host into ``array`` (complete after ``synchronize``)."""
        self._check(self.cu.cuMemcpyDtoHAsync(array.ctypes.data, ptr, array.nbytes, stream), "cuMemcpyDtoHAsync")

    def zero(self, ptr: int, nbytes: int, stream) -> None:
        """``nbytes`` zero bytes from ``ptr`` (fresh device memory holds anything, NaN bit patterns included)."""
        self._check(self.cu.cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream) -> None:
        """``rows`` rows of ``width`` bytes, device to device, each side with its own row pitch."""
        if rows == 0 or width == 0:
            return
        p = self.cu.CUDA_MEMCPY2D()
        p.srcMemoryType = p.dstMemoryType = self.cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.srcDevice, p.srcPitch = src, src_pitch
        p.dstDevice, p.dstPitch = dst, dst_pitch
        p.WidthInBytes, p.Height = width, rows
        self._check(self.cu.cuMemcpy2DAsync(p, stream), "cuMemcpy2DAsync")

    def synchronize(self, stream) -> None:
        self._check(self.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def event_timer(self, stream) -> "EventTimer":
        """A timer of the work put on ``stream`` between its start() and stop() (two CUDA events)."""
        return EventTimer(self, stream)

    def capture(self, stream, enqueue) -> object:
        """Record what ``enqueue()`` puts on ``stream`` as an executable CUDA graph (nothing runs now)."""
        cu = self.cu
        self._check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                    "cuStreamBeginCapture")
        try:
            enqueue()
        except BaseException:
            # The capture must end (or the stream stays unusable) and its partial graph be freed; the error
            # that matters is the enqueue's, so the end-capture's own error (capture invalidated) is dropped.
            err, graph = cu.cuStreamEndCapture(stream)
            if err == cu.CUresult.CUDA_SUCCESS and graph is not None:
                cu.cuGraphDestroy(graph)
            raise
        graph = self._check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        try:
            return self._check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            self._check(cu.cuGraphDestroy(graph), "cuGraphDestroy")

    def launch(self, graph, stream) -> None:
        self._check(self.cu.cuGraphLaunch(graph, stream), "cuGraphLaunch")

    def release_graph(self, graph) -> None:
        self._check(self.cu.cuGraphExecDestroy(graph), "cuGraphExecDestroy")


class EventTimer:
    """start() / stop() -> milliseconds between two CUDA events recorded on a stream (stop synchronises on the
    second); the events are destroyed at stop."""

    def __init__(self, device: CudaDevice, stream):
        self.device, self.stream, cu = device, stream, device.cu
        self.begin = device._check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        self.end = device._check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def start(self) -> None:
        self.device._check(self.device.cu.cuEventRecord(self.begin, self.stream), "cuEventRecord")

    def stop(self) -> float:
        cu, check = self.device.cu, self.device._check
        try:
            check(cu.cuEventRecord(self.end, self.stream), "cuEventRecord")
            check(cu.cuEventSynchronize(self.end), "cuEventSynchronize")
            return float(check(cu.cuEventElapsedTime(self.begin, self.end), "cuEventElapsedTime"))
        finally:
            check(cu.cuEventDestroy(self.begin), "cuEventDestroy")
            check(cu.cuEventDestroy(self.end), "cuEventDestroy")
