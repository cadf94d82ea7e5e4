"""INT8 engines must keep their answers: refusal below the thresholds, a recorded measurement above."""

import json

import pytest

from onepass import Engine, Noul


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
    from onepass.calibration.measure.quantize import QuantizationRefused, quantize_engine

    with pytest.raises(QuantizationRefused, match=r"max log-prob error .* \(allowed 0.0\); no engine written"):
        quantize_engine(tiny_engine_dir, tmp_path / "int8", rows, keep_blocks=(), max_error=0.0)
    assert not (tmp_path / "int8").exists() and not (tmp_path / "int8.partial").exists()
    with pytest.raises(QuantizationRefused, match=r"2 blocks would all stay fp32 .*nothing to quantize"):
        quantize_engine(tiny_engine_dir, tmp_path / "int8", rows)  # the default keeps both of its 2 blocks
    assert not (tmp_path / "int8").exists()


def test_the_default_fp32_blocks_are_the_first_and_last_two_of_the_engines_own_layers():
    from onepass.calibration.measure.quantize import default_keep_blocks

    assert default_keep_blocks(30) == (0, 1, 28, 29)  # SmolLM2
    assert default_keep_blocks(12) == (0, 1, 10, 11) and default_keep_blocks(5) == (0, 1, 3, 4)
    assert default_keep_blocks(4) == (0, 1, 2, 3)
    assert default_keep_blocks(3) == (0, 1, 2) and default_keep_blocks(1) == (0,)
    with pytest.raises(ValueError, match="num_layers"):
        default_keep_blocks(0)


def test_int8_within_loose_thresholds_is_written_with_its_measurement(tiny_engine_dir, rows, tmp_path):
    """Structure on the tiny Llama (2 blocks; block 0 kept, block 1 quantized). SmolLM2's INT8 error against the
    default thresholds is a measurement: benchmarks/results/int8_explore.md (`make int8-explore`)."""
    import onnx

    from onepass.calibration.measure.quantize import quantize_engine

    record = quantize_engine(tiny_engine_dir, tmp_path / "int8", rows, min_agreement=0.0, max_error=1e9,
                             keep_blocks=(0,))
    engine = Engine.load(tmp_path / "int8")  # hashes of the INT8 graph verify
    assert engine.manifest.quantization == record and record["rows"] == 6 and record["fp32_blocks"] == [0]
    assert 0.0 <= record["agreement"] <= 1.0 and record["speedup"] > 0 and record["max_logprob_error"] > 0
    answer = engine.ask("I was charged twice.", {"q": Noul("Is it about money?")})["q"]
    assert 0.0 <= answer.noul <= 1.0
    # the graph really is INT8 where it claims to be: int8 weights for the quantized block's seven projections,
    # float weights for the kept block and for the read-out
    graph = onnx.load(str(tmp_path / "int8" / engine.manifest.graph), load_external_data=False).graph
    int8 = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT8}
    floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    assert engine.manifest.model.num_layers == 2
    assert not {n for n in int8 if n.startswith("blocks.0.")} and any(n.startswith("blocks.0.q.weight") for n in floats)
    quantized = {n for n in int8 if n.startswith("blocks.1.") and n.endswith("_quantized")}
    assert len(quantized) == 7, sorted(quantized)  # q k v o gate up down
    projections = ("q", "k", "v", "o", "gate", "up", "down")
    assert not {f"blocks.1.{p}.weight" for p in projections} & floats  # replaced, not kept beside the int8 copy
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= {n.op_type for n in graph.node}
