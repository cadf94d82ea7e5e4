"""The exported graph: its I/O contract, and the golden file written beside it."""

import numpy as np
import onnx
import pytest

from onepass.runtime.backends import contract
from onepass.runtime.core.selfcheck import TOLERANCES, check_golden, run_golden
from onepass.runtime.backends.batch import causal

pytestmark = pytest.mark.slow

ONNX_TYPES = {"int64": onnx.TensorProto.INT64, "bool": onnx.TensorProto.BOOL, "float32": onnx.TensorProto.FLOAT}


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


def test_golden_file(engine):
    diffs = run_golden(engine)
    for name, diff in diffs.items():
        assert diff <= TOLERANCES[name], f"{name}: max |diff| {diff} > {TOLERANCES[name]}"
    assert check_golden(engine) == diffs


def test_golden_negative_control(engine):
    """Shifting every position by one must break the golden comparison."""
    assert run_golden(engine, position_shift=1)["target_logprob"] > 100 * TOLERANCES["target_logprob"]


def test_chunked_prefill_equals_one_shot(engine, monkeypatch):
    ids = engine.encoder.state("word " * 300)
    one = engine.backend.prefill(ids, chunk=len(ids))
    passes = []
    real = engine.backend._run
    monkeypatch.setattr(engine.backend, "_run", lambda batch, kv: passes.append(batch.num_tokens) or real(batch, kv))
    chunked = engine.backend.prefill(ids, chunk=128)
    assert passes == [min(128, len(ids) - s) for s in range(0, len(ids), 128)] and len(passes) >= 3  # in chunks
    assert chunked.length == one.length == len(ids)
    host = engine.backend.to_host
    for (k1, v1), (k2, v2) in zip(one.layers, chunked.layers):
        np.testing.assert_allclose(host(k2), host(k1), rtol=0, atol=1e-4)
        np.testing.assert_allclose(host(v2), host(v1), rtol=0, atol=1e-4)
    probe = causal(engine.encoder.encode([("Question: ok?", True)]), len(ids))
    np.testing.assert_allclose(engine.backend.score(chunked, probe), engine.backend.score(one, probe), atol=1e-4)
