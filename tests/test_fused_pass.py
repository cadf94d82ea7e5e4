"""The GPU pass (runtime/backends/fused_decoder.py) on a CPU: its answers against ONNX Runtime, its kernel launches
counted on the meta device, its one upload per pass; each with a negative control."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onepass import Choice, Engine, Noul, Score  # noqa: E402

QUESTIONS = {"refund": Noul("Does the customer ask for a refund?"),
             "team": Choice("Which team?", {"billing": None, "technical": None, "fraud review": None}),
             "anger": Score("How angry is the customer?", ["calm", "annoyed", "furious"]),
             "lang": Choice("Which language is the ticket in?", {"English": None, "German": None, "French": None})}
STATE = ("I was charged twice for one order and support never answered. Refund the second payment now. "
         "Order 4411, card ending 0042. This is the third time I write.")


def _worst(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _fused(root, **options):
    from onepass.runtime.backends import factory

    return Engine.load(root, backend=factory("torch-cpu", **options), verify=False)


def test_the_gpu_pass_equals_onnxruntime_at_fp32_with_a_negative_control(engine_dir, engine, monkeypatch):
    """SmolLM2, bucketed as on a GPU: every option log-likelihood within 1e-4 of ONNX Runtime fp32 (measured 2e-5;
    78 questions: 4.6e-5, benchmarks/results/gpu/fused_precision.md). Negative control: a tree bias under which
    packed tokens see every other packed token is off by far more."""
    fused = _fused(engine_dir, buckets=True)
    encoded = engine.encode_questions(QUESTIONS)
    want = engine.option_logprobs(STATE, encoded)
    assert _worst(fused.option_logprobs(STATE, encoded), want) <= 1e-4
    tree_bias = fused.backend.decoder._tree_bias

    def seen_by_all(order, past_length, rows):
        broken = order.clone()
        broken[:, 0], broken[:, 1] = 0, order.shape[0]
        return tree_bias(broken, past_length, rows)
    monkeypatch.setattr(fused.backend.decoder, "_tree_bias", seen_by_all)
    assert _worst(fused.option_logprobs(STATE, encoded), want) > 1e-2


def test_a_shifted_position_is_caught(tiny_engine_dir, monkeypatch):
    """Negative control of the rotary tables (value heads take cos 1, sin 0; q and k their position's)."""
    reference = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    fused = _fused(tiny_engine_dir, buckets=True)
    encoded = reference.encode_questions(QUESTIONS)
    want = reference.option_logprobs(STATE, encoded)
    assert _worst(fused.option_logprobs(STATE, encoded), want) <= 1e-4
    decoder = fused.backend.decoder
    monkeypatch.setattr(decoder, "cos", torch.roll(decoder.cos, 1, dims=0))
    assert _worst(fused.option_logprobs(STATE, encoded), want) > 1e-3


def _meta_engine(root, precision: str, fused: bool = True):
    from onepass.runtime.backends import factory

    options = {"buckets": True} if fused else {}
    return Engine.load(root, backend=factory("torch-cpu", device="meta", precision=precision, fused=fused, **options),
                       verify=False)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_block_of_the_gpu_pass_launches_12_kernels(tiny_engine_dir, precision):
    """Counted on the meta device with the operations picked on CUDA: rms_norm, the one qkv GEMM, two rotary
    kernels, one attention kernel, one layout copy, o GEMM into the residual, rms_norm, gate/up GEMM, silu, mul,
    down GEMM into the residual. A pass adds a fixed few (embedding, rotary tables, the tree bias, the read-out)."""
    from onepass.runtime.backends.launches import count

    eng = _meta_engine(tiny_engine_dir, precision)
    layers = eng.manifest.model.num_layers
    state = eng.state(STATE)
    batch = eng.pack(state, eng.encode_questions(QUESTIONS))
    eng.backend.score_all(state.kv, batch)  # first use allocates the workspace
    decoder = eng.backend.decoder
    blocks = []
    real = decoder._block
    decoder._block = lambda *a: blocks.append(count(lambda: out.append(real(*a)))) or out[-1]
    out = []
    whole = count(lambda: eng.backend.score_all(state.kv, batch))
    assert [b.total for b in blocks] == [12] * layers, [dict(b.ops) for b in blocks]
    assert set(blocks[0].ops) == {"_fused_rms_norm", "mm", "mul", "addcmul_", "_scaled_dot_product_efficient_attention",
                                  "reshape", "addmm_", "silu", "mul_"}
    per_pass = whole.total - 12 * layers
    assert per_pass <= 24, dict(whole.ops)  # SmolLM2's 30 layers: <= 12.8 launches per layer
    assert whole.ops["copy_"] == 1  # one upload of every input of the pass (the state is already in place)
    assert "to" not in whole.ops and "_to_copy" not in whole.ops  # no casts
    eng.backend.slots.forget()  # control: over a state the workspace does not hold, the counter sees its copy in
    assert count(lambda: eng.backend.score_all(state.kv, batch)).ops["copy_"] == 2


def test_negative_control_the_reference_decoder_launches_over_40_per_block(tiny_engine_dir):
    """The counter sees what the fused pass saves: the export's reference decoder (fp16 GEMMs, fp32 elsewhere)."""
    from onepass.runtime.backends.launches import count

    eng = _meta_engine(tiny_engine_dir, "fp16", fused=False)
    state = eng.state(STATE)
    batch = eng.pack(state, eng.encode_questions(QUESTIONS))
    whole = count(lambda: eng.backend.score_all(state.kv, batch))
    assert whole.total > 40 * eng.manifest.model.num_layers and whole.ops["to"] > 0


def test_the_launch_counter_counts_copies_not_views():
    from onepass.runtime.backends.launches import count

    x = torch.zeros(4, 6, 8, device="meta")
    assert count(lambda: (x.permute(1, 0, 2), x.reshape(24, 8), x[:, 1:], torch.empty(3))).total == 0
    counted = count(lambda: (x.permute(1, 0, 2).reshape(24, 8), x.add_(1), x * 2))
    assert counted.total == 3 and counted.ops["add_"] == counted.ops["mul"] == 1  # and the reshape's copy (a clone
    assert counted.ops["reshape"] + counted.ops["clone"] == 1  # outside inference mode, where reshape decomposes)


def test_the_gpu_kernels_benchmark_reports_its_keys(tiny_engine_dir, tmp_path):
    """benchmarks/gpu_kernels.py on the tiny Llama: its JSON keys (launches per layer of the pass and of a prefill
    chunk, the worst padding), the fused pass far below the reference, padding within 1.25x."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_kernels

    out = tmp_path / "kernels.json"
    assert gpu_kernels.main(["--engine", str(tiny_engine_dir), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["padding"] <= 1.25
    counts = report["counts"]
    assert counts["fused fp16"]["pass"] < counts["reference fp16"]["pass"] / 2
    assert report["launches_per_layer"] == counts["fused fp16"]["pass_per_layer"]
    assert report["prefill_launches_per_layer"] == counts["fused fp16"]["prefill_per_layer"]
    assert out.with_suffix(".md").exists()
