"""The ONNX Runtime backends' device placement: one class for the CPU and the CUDA execution provider
(onnxruntime-gpu). The placement code runs here on CPU; the CUDA run belongs to benchmarks/gpu_check.py."""

import numpy as np
import pytest

from onepass import Engine, Noul
from onepass.runtime.backends.ort import OrtBackend
from onepass.runtime.core.errors import BackendUnavailable


def test_onnxruntime_gpu_without_the_cuda_provider_is_a_typed_error_naming_the_package(tiny_engine_dir):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has the CUDA provider")
    with pytest.raises(BackendUnavailable, match="no CUDAExecutionProvider.*onnxruntime-gpu==1.31.1"):
        Engine.load(tiny_engine_dir, backend="onnxruntime-gpu", verify=False)


class _SpyBinding:
    """Records where each output is bound, and binds it on the CPU (the device this test has)."""

    def __init__(self, binding, calls):
        self.binding, self.calls = binding, calls

    def bind_output(self, name, device_type="cpu", device_id=0):
        self.calls.append((name, device_type, device_id))
        self.binding.bind_output(name, "cpu", 0)

    def __getattr__(self, name):
        return getattr(self.binding, name)


def test_state_kv_is_bound_to_the_backend_device_and_read_outs_to_the_host(tiny_engine_dir, monkeypatch):
    """What a CUDA backend asks IOBinding for: the new tokens' K/V on its device (so the state stays there and a
    score pass reads it in place), the read-outs on the host. Asked of a CPU session with the device renamed, the
    answers are unchanged (control: the same pass on the plain CPU backend)."""
    engine = Engine.load(tiny_engine_dir, verify=False, backend="onnxruntime")
    backend = engine.backend
    assert isinstance(backend, OrtBackend) and backend.device == "cpu"
    state, questions = "I was charged twice and want a refund.", {"r": Noul("Is a refund requested?")}
    want = engine.option_logprobs(state, engine.encode_questions(questions))
    calls: list = []
    session = backend.session
    real_binding, real_run = session.io_binding, session.run_with_iobinding
    monkeypatch.setattr(session, "io_binding", lambda: _SpyBinding(real_binding(), calls))
    monkeypatch.setattr(session, "run_with_iobinding", lambda spy: real_run(spy.binding))
    monkeypatch.setattr(backend, "device", "cuda")
    monkeypatch.setattr(backend, "device_id", 1)
    engine.cache.clear()
    got = engine.option_logprobs(state, engine.encode_questions(questions))
    placed = {name: (device, index) for name, device, index in calls}
    layers = engine.manifest.model.num_layers
    assert {placed[f"present_key.{i}"] for i in range(layers)} == {("cuda", 1)}
    assert {placed[f"present_value.{i}"] for i in range(layers)} == {("cuda", 1)}
    assert placed["target_logprob"] == ("cpu", 0)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)



def test_the_cuda_provider_runs_on_the_backends_own_stream_which_bench_times(tiny_engine_dir, monkeypatch):
    """onnxruntime-gpu's device stage: the CUDA provider is given the backend's own stream (``user_compute_stream``,
    the stream's handle as a string), and device_timer() is the device's CUDA-event timer on that stream, made
    current on the calling thread first (a thread that never activated the device would fail). Without cuda-bindings
    the provider gets only its device id and there is no device timer; on CPU there is none either. Run here with
    the providers recorded and the session made on the CPU provider, and the GPU stand-in as the device."""
    import threading
    import time

    import onnxruntime as ort
    from trt_double import HostDevice

    from onepass.runtime.core import manifest as mf
    from onepass.runtime.backends import cuda_device
    from onepass.runtime.backends import ort as ort_backend

    manifest = mf.load(tiny_engine_dir, verify=False)
    made = []
    real_session = ort.InferenceSession
    monkeypatch.setattr(ort_backend.ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort_backend.ort, "InferenceSession", lambda path, opts, providers: made.append(providers)
                        or real_session(path, opts, providers=["CPUExecutionProvider"]))
    monkeypatch.setattr(OrtBackend, "_on_device", lambda self, array: ort.OrtValue.ortvalue_from_numpy(array))
    devices = []
    monkeypatch.setattr(cuda_device, "CudaDevice", lambda ordinal: devices.append(HostDevice()) or devices[-1])

    backend = OrtBackend(tiny_engine_dir, manifest, device="cuda", device_id=0)
    assert made[-1][0] == ("CUDAExecutionProvider", {"device_id": 0, "user_compute_stream": "7"})
    timings = []

    def timed():  # from another thread, as a bench or server worker calls it
        timer = backend.device_timer()
        timer.start()
        time.sleep(0.01)
        timings.append(timer.stop())

    worker = threading.Thread(target=timed)
    worker.start()
    worker.join()
    assert len(timings) == 1 and timings[0] >= 10
    refused = []

    def unactivated():
        try:
            devices[-1].event_timer("stream")
        except AssertionError as err:
            refused.append(err)

    fresh = threading.Thread(target=unactivated)
    fresh.start()
    fresh.join()
    assert refused, "control: the stand-in refuses a thread that never activated the device"

    def no_bindings(ordinal):
        raise BackendUnavailable("the TensorRT backend needs cuda-python")

    monkeypatch.setattr(cuda_device, "CudaDevice", no_bindings)
    plain = OrtBackend(tiny_engine_dir, manifest, device="cuda", device_id=1)
    assert made[-1][0] == ("CUDAExecutionProvider", {"device_id": 1}) and plain.device_timer() is None
    assert OrtBackend(tiny_engine_dir, manifest).device_timer() is None


def test_the_graphs_past_length_masks_a_padded_past(tiny_engine_dir):
    """The contract's past_length (what lets TensorRT pad a state to its bucket): the exported graph run on a past
    padded with junk rows and told the state's length gives the unpadded pass's outputs; told the padded length
    (the negative control), it does not."""
    import onnxruntime as ort

    from onepass.runtime.core.manifest import load

    engine = Engine.load(tiny_engine_dir, verify=False, backend="onnxruntime")
    state = engine.state("I was charged twice for one order. Refund it.")
    batch = engine.pack(state, engine.encode_questions({"refund": Noul("Refund?")}))
    manifest = load(tiny_engine_dir, verify=False)
    session = ort.InferenceSession(str(tiny_engine_dir / manifest.graph))
    past = [v.numpy() for pair in state.kv.layers for v in pair]
    junk = [np.concatenate([v, np.random.default_rng(0).normal(size=(v.shape[0], 9, v.shape[2])).astype(np.float32)],
                           axis=1) for v in past]

    def run(values, length):
        feeds = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "tree_mask": batch.tree_mask,
                 "readout_index": batch.readout_index, "readout_target": batch.readout_target,
                 "past_length": np.asarray(length, dtype=np.int64)}
        feeds.update(zip(engine.backend.past_names, values))
        return session.run(["target_logprob"], feeds)[0]
    want = run(past, state.num_tokens)
    np.testing.assert_allclose(run(junk, state.num_tokens), want, rtol=0, atol=1e-5)
    assert np.abs(run(junk, state.num_tokens + 9) - want).max() > 1e-3
