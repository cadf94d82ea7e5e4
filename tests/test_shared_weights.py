"""A graph reading another graph's weights file (``export.shared_weights.share``): every weight equal to one of the
base's is read from the base's file, hard-linked beside the graph, and the graph computes exactly what it computed
with its own copy. Negative controls: a weight that differs in one bit stays in the graph's own file (and its output
still differs from the base's); a weights file named like the base's is refused, nothing rewritten."""

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from onepass.export.shared_weights import share  # noqa: E402
from onepass.runtime.core.errors import EngineFileError  # noqa: E402

RNG = np.random.default_rng(0)
W1, W2 = RNG.standard_normal((8, 16)).astype(np.float32), RNG.standard_normal((16, 4)).astype(np.float32)


def _graph(path, weights: dict, data_name: str) -> None:
    """y = (x @ w1) @ w2 + bias, every weight external in ``data_name`` beside ``path``."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["z"]),
             helper.make_node("Add", ["z", "bias"], ["y"])]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name,
              size_threshold=0)


def _run(path) -> np.ndarray:
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_equal_weights_are_read_from_the_base_file_and_the_graph_computes_the_same(tmp_path):
    base_dir, graph_dir = tmp_path / "engine", tmp_path / "engine" / "tasks" / "slots"
    graph_dir.mkdir(parents=True)
    bias = np.arange(4, dtype=np.float32)
    _graph(base_dir / "decoder.onnx", {"w1": W1, "w2": W2, "bias": bias}, "decoder.onnx.data")
    other = bias.copy()
    other.view(np.uint32)[1] ^= 1 << 22  # one bit of one weight differs (1.0 -> 1.5): it must stay apart
    _graph(graph_dir / "graph.onnx", {"w1": W1, "w2": W2, "bias": other}, "graph.onnx.data")
    before = _run(graph_dir / "graph.onnx")
    found = share(graph_dir / "graph.onnx", base_dir / "decoder.onnx")
    assert found == {"shared_bytes": W1.nbytes + W2.nbytes, "own_bytes": other.nbytes}
    assert os.path.samefile(graph_dir / "decoder.onnx.data", base_dir / "decoder.onnx.data")  # a link, not a copy
    assert (graph_dir / "graph.onnx.data").stat().st_size == other.nbytes  # only the weight that differs
    after = _run(graph_dir / "graph.onnx")
    np.testing.assert_array_equal(after, before)  # bit for bit: the same bytes are read
    assert not np.array_equal(after, _run(base_dir / "decoder.onnx"))  # the differing bit still counts


def test_a_graph_whose_weights_all_match_keeps_no_weights_file(tmp_path):
    _graph(tmp_path / "decoder.onnx", {"w1": W1, "w2": W2, "bias": np.ones(4, np.float32)}, "decoder.onnx.data")
    slots = tmp_path / "slots"
    slots.mkdir()
    _graph(slots / "graph.onnx", {"w1": W1, "w2": W2, "bias": np.ones(4, np.float32)}, "graph.onnx.data")
    assert share(slots / "graph.onnx", tmp_path / "decoder.onnx")["own_bytes"] == 0
    assert sorted(p.name for p in slots.iterdir()) == ["decoder.onnx.data", "graph.onnx"]
    np.testing.assert_array_equal(_run(slots / "graph.onnx"), _run(tmp_path / "decoder.onnx"))


def test_a_weights_file_named_like_the_base_one_is_refused_and_nothing_is_rewritten(tmp_path):
    _graph(tmp_path / "decoder.onnx", {"w1": W1, "w2": W2, "bias": np.ones(4, np.float32)}, "decoder.onnx.data")
    slots = tmp_path / "slots"
    slots.mkdir()
    _graph(slots / "graph.onnx", {"w1": W1, "w2": W2, "bias": np.ones(4, np.float32)}, "decoder.onnx.data")
    listing = {p.name: p.read_bytes() for p in slots.iterdir()}
    with pytest.raises(EngineFileError, match="share the name 'decoder.onnx.data'"):
        share(slots / "graph.onnx", tmp_path / "decoder.onnx")
    assert {p.name: p.read_bytes() for p in slots.iterdir()} == listing
