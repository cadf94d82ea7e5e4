"""fp16 and bf16 engines: low-precision block GEMMs, everything else float32. Close to fp32, measurably not fp32,
TensorRT-buildable."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from onepass import Engine
from onepass.runtime.core.questions import from_wire
from onepass.runtime.core.selfcheck import FP16_TOLERANCES, check_golden

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tiny_fp16_dir(tmp_path_factory, tiny_llama_dir):
    pytest.importorskip("torch")
    from onepass.export.build import export_engine

    return export_engine(tmp_path_factory.mktemp("fp16-tiny") / "llama-tiny-fp16", str(tiny_llama_dir), precision="fp16")


def _workload():
    state = (DATA / "ticket.txt").read_text()
    questions = {qid: from_wire(qid, q) for qid, q in json.loads((DATA / "questions.json").read_text()).items()}
    return state, questions


def _errors(reference, other) -> list:
    """Per question of the ticket workload, the largest option log-likelihood difference between two engines."""
    state, questions = _workload()
    encoded = reference.encode_questions(questions)
    return [np.abs(a - b).max() for a, b in zip(reference.option_logprobs(state, encoded),
                                                other.option_logprobs(state, encoded))]


def _torch_gemm_errors(engine, precision: str, fused: bool = False) -> list:
    """The fp32 engine against the PyTorch backend running it with ``precision`` block GEMMs (the export's arithmetic)
    or, ``fused``, as the GPU pass (everything in ``precision``)."""
    from onepass.runtime.backends import factory

    lowered = Engine.load(engine.root, verify=False, backend=factory("torch-cpu", precision=precision, fused=fused))
    assert lowered.backend.precision == precision
    return _errors(engine, lowered)


def _initializer_types(engine_dir: Path) -> dict:
    import onnx

    graph = onnx.load(str(engine_dir / "decoder.onnx"), load_external_data=False).graph
    return {i.name: i.data_type for i in graph.initializer}


def test_fp16_graph_holds_fp16_block_weights_and_reproduces_its_golden_file(tiny_fp16_dir, tiny_engine_dir):
    """The fp16 graph's structure, on the tiny Llama: every block GEMM weight is fp16, everything else float32; ONNX
    Runtime reproduces its (PyTorch fp16-GEMM) golden file at fp16 tolerances, and its answers differ measurably from
    the fp32 engine's (the control: the GEMMs really ran in fp16)."""
    import onnx

    fp16, fp32 = Engine.load(tiny_fp16_dir), Engine.load(tiny_engine_dir)
    assert fp16.manifest.precision == "fp16"
    diffs = check_golden(fp16)
    assert all(v <= FP16_TOLERANCES[k] for k, v in diffs.items())
    types = _initializer_types(tiny_fp16_dir)
    gemm = {n: t for n, t in types.items() if n.startswith("blocks.") and ".inner." in n}
    layers = fp16.manifest.model.num_layers
    assert len(gemm) == 7 * layers and set(gemm.values()) == {onnx.TensorProto.FLOAT16}, gemm
    assert {t for n, t in types.items() if n not in gemm and t in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)} \
        == {onnx.TensorProto.FLOAT}  # embedding, norms: float32
    errors = _errors(fp32, fp16)
    assert 1e-5 < max(errors) <= 0.05, errors


def test_torch_backend_runs_an_fp16_engine_at_its_precision(tiny_fp16_dir):
    """ONNX Runtime's fp16 graph and the PyTorch backend's fp16 GEMMs (rebuilt from the graph's weights) agree."""
    from onepass.runtime.backends import factory

    ort_engine = Engine.load(tiny_fp16_dir, verify=False)
    torch_engine = Engine.load(tiny_fp16_dir, verify=False, backend=factory("torch-cpu"))
    assert torch_engine.backend.precision == "fp16"
    state, questions = _workload()
    encoded = ort_engine.encode_questions(questions)
    for a, b in zip(ort_engine.option_logprobs(state, encoded), torch_engine.option_logprobs(state, encoded)):
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05)


def test_fp16_gemms_on_smollm2_stay_close_to_fp32(engine):
    """SmolLM2's fp16 closeness without an fp16 export: the PyTorch backend at fp16 over the fp32 engine runs the
    arithmetic of an fp16 engine (whose golden file is written by this same PyTorch fp16 decoder and which ONNX
    Runtime reproduces at fp16 tolerances: the two tests above). The README's bound: 0.021 on the 78-question
    benchmark, where ONNX Runtime's fp16 graph was measured directly (benchmarks/precision_eval.py)."""
    errors = _torch_gemm_errors(engine, "fp16")
    assert 1e-4 < max(errors) <= 0.05, errors  # above: fp16 GEMMs really ran; below: 2x the README's bound


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_gpu_pass_in_half_precision_stays_within_its_measured_bound(engine, precision):
    """The GPU pass keeps everything in one dtype (residual stream and K/V included): on SmolLM2's real weights its
    options stay within OPTION_TOLERANCES of fp32 (the 78-question workload: fp16 0.089, bf16 1.44; this 3-question
    one: 0.051 and 0.81); above the floor a pass that silently ran in fp32 would not reach."""
    from onepass.runtime.core.selfcheck import OPTION_TOLERANCES

    errors = _torch_gemm_errors(engine, precision, fused=True)
    assert {"fp16": 1e-3, "bf16": 1e-2}[precision] < max(errors) <= OPTION_TOLERANCES[precision], errors


@pytest.fixture(scope="module")
def tiny_bf16_dir(tmp_path_factory, tiny_llama_dir):
    pytest.importorskip("torch")
    from onepass.export.build import export_engine

    return export_engine(tmp_path_factory.mktemp("bf16-tiny") / "llama-tiny-bf16", str(tiny_llama_dir), precision="bf16")


def test_bf16_graph_is_checked_exactly_by_its_fp32_twin_with_a_negative_control(tiny_bf16_dir, tiny_llama_dir,
                                                                                tmp_path, monkeypatch):
    """The twin check's wiring, on the tiny Llama (a structure question; SmolLM2's bf16 closeness is the next test)."""
    import onepass.export.bf16_check as bf16
    from onepass.runtime.backends.torch_decoder import PackedDecoder
    from onepass.export.model_source import load_model
    from onepass.runtime.core.errors import EngineFileError
    from onepass.runtime.core.selfcheck import BF16_TOLERANCES, TOLERANCES

    bf16_dir, hf_model = tiny_bf16_dir, load_model(tiny_llama_dir).model
    diffs = bf16.check_bf16_engine(bf16_dir, PackedDecoder(hf_model).eval(), tmp_path / "twin")
    assert all(v <= TOLERANCES[k] for k, v in diffs["fp32_twin"].items())  # wiring and weights: fp32 tolerances
    assert all(v <= BF16_TOLERANCES[k] for k, v in diffs["torch_bf16"].items())
    monkeypatch.setattr(bf16, "bf16_weights_fp32_math", lambda decoder: decoder)  # reference weights left unrounded
    with pytest.raises(EngineFileError, match="does not reproduce its golden file"):
        bf16.check_bf16_engine(bf16_dir, PackedDecoder(hf_model).eval(), tmp_path / "twin")


def test_bf16_engine_runs_on_the_torch_backend_and_is_refused_by_onnxruntime(tiny_bf16_dir, capsys):
    """What a bf16 engine is refused and run by, on the tiny Llama's bf16 engine (a structure question)."""
    from onepass.cli import main
    from onepass.runtime.backends import factory
    from onepass.runtime.core.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="bf16.*ONNX Runtime.*--backend tensorrt"):
        Engine.load(tiny_bf16_dir, verify=False)
    assert main(["check", "--engine", str(tiny_bf16_dir)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["check", "--engine", str(tiny_bf16_dir), "--backend", "torch-cpu"]) == 0
    assert Engine.load(tiny_bf16_dir, verify=False, backend=factory("torch-cpu")).backend.precision == "bf16"


def test_bf16_gemms_on_smollm2_stay_close_to_fp32(engine):
    """SmolLM2's bf16 closeness without a bf16 export: the PyTorch backend at bf16 over the fp32 engine runs the
    same arithmetic as a bf16 engine on it (the bf16 engine's weights are these weights rounded to bf16, upcast
    exactly on load, then lowered to bf16 again: the rounding is idempotent)."""
    errors = _torch_gemm_errors(engine, "bf16")
    assert 1e-3 < max(errors) <= 1.0  # bf16 GEMMs really ran (0.90 on this workload with the current adapter)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_plan_builds_ahead_of_time(precision, request, tmp_path):
    """A TensorRT-for-RTX plan builds from the tiny Llama's fp16 and bf16 graphs and records its precision. (The plan
    network is strongly typed: its weights are the graph's, whose block GEMM weights the tests above show are fp16 /
    bf16. Plan sizes say nothing here: the tiny Llama's float32 embedding dominates them, and the fp32, fp16 and bf16
    plans differ by 81 KB against 295 KB of fp32 GEMM weights, kernels included.)"""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT for RTX is not installed (pip install tensorrt-rtx-cu13)")
    from onepass.cli import main
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.manifest import copy_engine

    copy = copy_engine(request.getfixturevalue(f"tiny_{precision}_dir"), tmp_path / "engine")
    try:
        assert main(["build-trt", "--engine", str(copy), "--arch", "sm89", "--precision", precision,
                     "--flavour", "tensorrt_rtx"]) == 0
        record = mf.load(copy).plans[0]
        assert record["precision"] == precision and record["compute_capability"] == "sm89"
    finally:
        shutil.rmtree(copy, ignore_errors=True)
