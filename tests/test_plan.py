"""`onepass plan`: the arithmetic of the memory budget and the latency floor."""

import pytest

from onepass.runtime.tools.plan import BYTES, DEVICES, plan

pytestmark = pytest.mark.slow


def test_budget_arithmetic(engine_dir, engine):
    m = engine.manifest.model
    p16 = plan(engine_dir, "orin-nano-8gb", "fp16")
    p8 = plan(engine_dir, "orin-nano-8gb", "int8")
    params = (engine_dir / "decoder.onnx.data").stat().st_size / 4
    assert p16["memory"]["params"] == int(params) and 130e6 < params < 140e6  # SmolLM2-135M
    assert p16["memory"]["weights_gib"] == pytest.approx(params * BYTES["fp16"] / 2**30)
    assert p8["memory"]["weights_gib"] == pytest.approx(p16["memory"]["weights_gib"] / 2)
    assert p16["memory"]["kv_bytes_per_state_token"] == 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    assert p8["memory"]["state_cache_tokens"] > p16["memory"]["state_cache_tokens"] > 0
    floor = p16["latency_floor"]["prefill"]
    assert floor["floor_ms"] == max(floor["compute_ms"], floor["memory_ms"]) > 0


def test_faster_devices_have_lower_floors(engine_dir):
    floors = [plan(engine_dir, d, "fp16")["latency_floor"]["score"]["floor_ms"] for d in
              ("orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb", "h200")]
    assert floors == sorted(floors, reverse=True)
    assert set(DEVICES) == {"orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb", "h200"}


def test_fp32_runs_on_the_cuda_cores_not_a_quarter_of_the_tensor_cores(engine_dir):
    """An fp32 pass without TF32 gets the CUDA cores' FP32 (H200: 67 TFLOPS, not 989 / 4 = 247)."""
    fp16, fp32 = (plan(engine_dir, "h200", p)["latency_floor"]["prefill"] for p in ("fp16", "fp32"))
    assert fp32["compute_ms"] / fp16["compute_ms"] == pytest.approx(989 / 67)
    assert DEVICES["h200"].fp32_tflops == 67


def test_unknown_device_and_precision(engine_dir):
    with pytest.raises(ValueError, match="unknown device 'tx2'"):
        plan(engine_dir, "tx2")
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        plan(engine_dir, "h200", "int4")
