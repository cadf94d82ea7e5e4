"""The ONNX Runtime backends' device placement: one class for the CPU and the CUDA execution provider
(onnxruntime-gpu). The placement code runs here on CPU; the CUDA run belongs to benchmarks/gpu_check.py."""

import numpy as np
import pytest

from onepass import Engine, Noul
from onepass.runtime.backends.ort import OrtBackend
from onepass.runtime.errors import BackendUnavailable


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
    engine = Engine.load(tiny_engine_dir, verify=False)
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

