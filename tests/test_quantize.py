"""INT8 engines must keep their answers: refusal below the thresholds, a recorded measurement above."""

import json

import pytest

from onepass import Engine, Noul

pytestmark = pytest.mark.slow  # the quantizer and ONNX Runtime's INT8 kernels take seconds even on the tiny model


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    texts = ["I was charged twice, refund me now!", "The app crashes on start.", "Thanks, all good.",
             "Please cancel my plan.", "Where is my parcel?", "Love the new update!"]
    q = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "technical": None,
                                                                      "shipping": None}}
    path.write_text("\n".join(json.dumps({"state": t, "question": q, "label": "billing"}) for t in texts))
    return path


def test_int8_that_changes_answers_is_refused(tiny_engine_dir, rows, tmp_path):
    """The refusal path on the tiny Llama (every block quantized, any error refused); that SmolLM2's INT8 graph
    misses the default thresholds is the measurement of the next test."""
    from onepass.calibration.quantize import QuantizationRefused, quantize_engine

    with pytest.raises(QuantizationRefused, match=r"max log-prob error .* \(allowed 0.0\); no engine written"):
        quantize_engine(tiny_engine_dir, tmp_path / "int8", rows, keep_blocks=(), max_error=0.0)
    assert not (tmp_path / "int8").exists() and not (tmp_path / "int8.partial").exists()


def test_int8_within_loose_thresholds_is_written_with_its_measurement(engine_dir, rows, tmp_path):
    from onepass.calibration.quantize import quantize_engine

    record = quantize_engine(engine_dir, tmp_path / "int8", rows, min_agreement=0.0, max_error=1e9)
    engine = Engine.load(tmp_path / "int8")  # hashes of the INT8 graph verify
    assert engine.manifest.quantization == record and record["rows"] == 6
    assert 0.0 <= record["agreement"] <= 1.0 and record["speedup"] > 0
    assert record["max_logprob_error"] > 0.1  # so the default thresholds (0.99 agreement, 0.1 error) refuse it
    answer = engine.ask("I was charged twice.", {"q": Noul("Is it about money?")})["q"]
    assert 0.0 <= answer.noul <= 1.0
    # the graph really is INT8 where it claims to be: int8 weights for the middle blocks' seven projections,
    # float weights for the kept blocks (first two, last two) and for the read-out
    import onnx

    from onepass.calibration.quantize import KEEP_BLOCKS

    graph = onnx.load(str(tmp_path / "int8" / engine.manifest.graph), load_external_data=False).graph
    int8 = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT8}
    floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    layers = engine.manifest.model.num_layers
    for b in range(layers):
        quantized = {n for n in int8 if n.startswith(f"blocks.{b}.") and n.endswith("_quantized")}
        if b in KEEP_BLOCKS:
            assert not quantized and any(n.startswith(f"blocks.{b}.q.weight") for n in floats), b
        else:
            assert len(quantized) == 7, (b, sorted(quantized))  # q k v o gate up down
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= {n.op_type for n in graph.node}
    assert set(KEEP_BLOCKS) == {0, 1, layers - 2, layers - 1} and record["fp32_blocks"] == list(KEEP_BLOCKS)
