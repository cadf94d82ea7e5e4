"""The exported graph builds into TensorRT plans ahead of time (TensorRT for RTX; no GPU needed)."""

import shutil

import pytest

from onepass.runtime.core import manifest as mf

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("archs", [pytest.param(["sm89"], id="sm89"),
                                   pytest.param(["sm80", "sm86", "sm89"], id="ampere-and-ada",
                                                marks=pytest.mark.archs)])
def test_build_plans(tiny_engine_dir, tmp_path, monkeypatch, archs):
    """One architecture by default; every one behind the ``archs`` marker (``pytest -m archs``). On the tiny Llama
    (SmolLM2's architecture at 2 blocks of width 64: the same graph, built in a second instead of 16 s)."""
    ARCHS = archs
    pytest.importorskip("tensorrt_rtx", reason="TensorRT for RTX is not installed (pip install tensorrt-rtx-cu13)")
    from test_engine import _copy_engine

    from onepass.cli import main

    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "cache"))
    copy = _copy_engine(tiny_engine_dir, tmp_path / "engine")
    weights = sum(f.stat().st_size for f in copy.glob("decoder.onnx*"))
    try:
        assert main(["build-trt", "--engine", str(copy), "--arch", *ARCHS, "--flavour", "tensorrt_rtx",
                     "--device", "h200"]) == 0
        manifest = mf.load(copy)  # every plan is hashed and verified like the other files
        assert [p["compute_capability"] for p in manifest.plans] == ARCHS
        for record in manifest.plans:
            plan = copy / record["file"]
            assert plan.stat().st_size == record["bytes"] > weights  # the graph's fp32 weights are inside
            assert record["tensorrt"].startswith("tensorrt_rtx ") and record["precision"] == "fp32"
            assert manifest.files[record["file"]] == record["sha256"]
            profiles = record["profiles"]  # one per role of the graph, each spanning the engine's limits
            assert list(profiles) == ["prefill", "score"]
            assert profiles["prefill"]["past"][1] == 0 and profiles["score"]["past"][1] == 512
            assert all(p["packed"][2] == manifest.limits.max_packed_tokens for p in profiles.values())
            assert record["timing_cache"] is None  # TensorRT for RTX: timing caches are no-ops, none is kept
            assert record["tf32"] is False  # fp32 plans keep fp32 GEMM inputs (TF32 is on by default)
            assert record["workspace_bytes"] == 8192 << 20  # the H200 profile's builder workspace (devices.DEVICES)
            assert record["user_allocation"] is True  # TensorRT for RTX: stream capture needs the backend's memory
        assert not (tmp_path / "cache" / "tensorrt").exists()
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_an_fp32_plan_may_use_tf32_when_asked(tiny_engine_dir, tmp_path, monkeypatch):
    """--tf32 lets an fp32 plan round its GEMM inputs to TF32 (recorded); without it, TF32 stays off (above)."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT for RTX is not installed (pip install tensorrt-rtx-cu13)")
    from test_engine import _copy_engine

    from onepass.cli import main

    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "cache"))
    copy = _copy_engine(tiny_engine_dir, tmp_path / "engine")
    try:
        assert main(["build-trt", "--engine", str(copy), "--arch", "sm89", "--flavour", "tensorrt_rtx", "--tf32"]) == 0
        assert mf.load(copy).plans[0]["tf32"] is True
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_precision_other_than_the_graphs_is_refused(engine_dir, capsys):
    from onepass.cli import main

    assert main(["build-trt", "--engine", str(engine_dir), "--precision", "fp16"]) == 2
    assert "plans are built at the graph's precision" in capsys.readouterr().err


def test_a_plan_that_needs_more_workspace_than_the_device_allows_is_a_clear_error(engine_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    """At the default limits (4,096 state + 4,096 packed tokens) one attention layer needs ~0.8 GB of workspace:
    more than the Orin Nano's 256 MiB. The build says so and what to do, and records nothing."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT for RTX is not installed (pip install tensorrt-rtx-cu13)")
    from test_engine import _copy_engine

    from onepass.cli import main

    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "cache"))
    copy = _copy_engine(engine_dir, tmp_path / "engine")
    try:
        assert main(["build-trt", "--engine", str(copy), "--arch", "sm86", "--flavour", "tensorrt_rtx",
                     "--device", "orin-nano-8gb"]) == 2
        err = capsys.readouterr().err
        assert "256 MiB" in err and "--max-packed-tokens" in err
        assert mf.load(copy).plans == []
    finally:
        shutil.rmtree(copy, ignore_errors=True)
