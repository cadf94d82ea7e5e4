"""The exported graph: its I/O contract, and the golden file written beside it."""

import numpy as np
import onnx
import pytest

from onepass.runtime import contract
from onepass.runtime.tree import PackedBatch, causal

pytestmark = pytest.mark.slow

ONNX_TYPES = {"int64": onnx.TensorProto.INT64, "bool": onnx.TensorProto.BOOL, "float32": onnx.TensorProto.FLOAT}
# Golden tolerances: ONNX Runtime fp32 vs the PyTorch fp32 graph that was exported (measured ~1e-5).
LOGPROB_ATOL, KV_ATOL = 2e-4, 1e-4


def _shape(value):
    return tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim)


def test_graph_matches_the_io_contract(engine_dir, engine):
    m = engine.manifest.model
    dims = (m.num_layers, m.num_kv_heads, m.head_dim)
    graph = onnx.load(str(engine_dir / engine.manifest.graph), load_external_data=False).graph
    for values, specs in ((graph.input, contract.input_specs(*dims)), (graph.output, contract.output_specs(*dims))):
        assert [v.name for v in values] == [s.name for s in specs]
        for v, s in zip(values, specs):
            assert v.type.tensor_type.elem_type == ONNX_TYPES[s.dtype], s.name
            assert _shape(v) == s.shape, s.name


def _golden(engine_dir, engine):
    g = np.load(engine_dir / engine.manifest.golden)
    assert int(g["version"]) == 1
    return g


def _run_golden(engine, g, position_shift=0):
    kv = engine.backend.prefill(g["state_ids"].tolist(), engine.manifest.limits.prefill_chunk)
    batch = PackedBatch(g["input_ids"], g["position_ids"] + position_shift, g["tree_mask"],
                        g["readout_index"], g["readout_target"])
    return kv, engine.backend.score(kv, batch)


def test_golden_file(engine_dir, engine):
    g = _golden(engine_dir, engine)
    kv, logprob = _run_golden(engine, g)
    key0, value_last = kv.layers[0][0].numpy(), kv.layers[-1][1].numpy()
    for name, got, want, tol in (("prefill_key_first", key0, g["prefill_key_first"], KV_ATOL),
                                 ("prefill_value_last", value_last, g["prefill_value_last"], KV_ATOL),
                                 ("target_logprob", logprob, g["target_logprob"], LOGPROB_ATOL)):
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"{name}: max {np.abs(got - want).max()}")


def test_golden_negative_control(engine_dir, engine):
    """Shifting every position by one must break the golden comparison."""
    g = _golden(engine_dir, engine)
    _, logprob = _run_golden(engine, g, position_shift=1)
    assert np.abs(logprob - g["target_logprob"]).max() > 100 * LOGPROB_ATOL


def test_chunked_prefill_equals_one_shot(engine):
    ids = engine.encoder.state("word " * 300)
    one = engine.backend.prefill(ids, chunk=len(ids))
    chunked = engine.backend.prefill(ids, chunk=128)
    assert chunked.length == one.length == len(ids)
    for (k1, v1), (k2, v2) in zip(one.layers, chunked.layers):
        np.testing.assert_allclose(k2.numpy(), k1.numpy(), rtol=0, atol=1e-4)
        np.testing.assert_allclose(v2.numpy(), v1.numpy(), rtol=0, atol=1e-4)
    probe = causal(engine.encoder.encode([("Question: ok?", True)]), len(ids))
    np.testing.assert_allclose(engine.backend.score(chunked, probe), engine.backend.score(one, probe), atol=1e-4)
