"""The one-shot device check, rehearsed on a CPU inside the lent H200 machine's exact package set.

That machine fetches nothing: an import the check needs and the image lacks ends the run before it measures
anything (it once died on ``hdrh`` after a 64 s export). Here the whole flow of ``benchmarks/gpu_check.sh`` —
the engine made in memory from the model's shape with random weights drawn on the device (no export), every torch
variant's parity against the reference decoder on those weights, the timed workloads, the targets, the report —
runs with ``DEVICE=cpu`` in a Python that can import only ``benchmarks/h200_image.txt``'s distributions and what
they require (``tests/image_env.py``), on the tiny Llama (SmolLM2's architecture and tokenizer at 2 blocks); then
``gpu_check.py`` on an exported engine with real weights, as the two-call run's second step does.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from image_env import image_env, read_image

ROOT = Path(__file__).resolve().parents[1]
IMAGE = read_image(ROOT / "benchmarks" / "h200_image.txt")

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return image_env(IMAGE, tmp_path_factory.mktemp("h200-image"))


def _python(env, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([env["PYTHON"], "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.install
def test_the_rehearsal_python_has_the_images_packages_and_nothing_else(env):
    """Negative control of the rehearsal itself: what the image lacks is neither importable nor visible to an
    availability check, and what it has imports."""
    for absent in ("hdrh", "fastapi", "pydantic", "openvino", "gguf", "zstandard", "uvicorn"):
        run = _python(env, f"import importlib.util, importlib.metadata as m\n"
                           f"assert importlib.util.find_spec({absent!r}) is None\nimport {absent}")
        assert run.returncode != 0 and f"No module named '{absent}'" in run.stderr, (absent, run.stderr[-300:])
    run = _python(env, "import torch, numpy, onnx, onnxruntime, transformers, tokenizers, peft, filelock; print('ok')")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


@pytest.mark.install
def test_the_device_check_runs_in_the_h200_images_package_set(env, tiny_llama_dir, tiny_engine_dir, tmp_path):
    """gpu_check.sh as the machine will run it (SHAPE: the model's config and tokenizer, the engine made there in
    memory with random weights, every torch variant against the reference decoder on them), then gpu_check.py on an
    engine with real (here: the tiny Llama's) weights, which adds the golden file and the Hugging Face baselines.
    Both end with a full report, no failed measurement and every target with a measured value."""
    shape = tmp_path / "shape"
    shape.mkdir()
    for f in tiny_llama_dir.iterdir():  # config and tokenizer only, as gpu_shape.py pack gives
        if f.suffix not in (".safetensors", ".bin"):
            shutil.copy(f, shape / f.name)
    out = tmp_path / "out"
    run_env = dict(env, SHAPE=str(shape), ENGINE=str(tmp_path / "none"), DEVICE="cpu", ITERS="3", BUDGET_S="150",
                   ALL_VARIANTS="1")
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], env=run_env,
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    shaped = _check_report(out, random_weights=True)
    assert "made in memory (no export)" in shaped["environment"]["engine"]
    assert shaped["parity"]["torch-cpu"]["golden"] == {}  # no golden file: the reference decoder instead
    variants = {"torch-cpu-fp16", "torch-cpu-bf16", "torch-cpu-fp16-eager", "torch-cpu-reference-fp16"}
    for name in variants:
        assert shaped["parity"][name]["vs_reference"]["within"], (name, shaped["parity"][name])
    measured = {(t["backend"], t["target"]) for t in shaped["targets"] if t["measured"] is not None}
    assert {("torch-cpu-fp16", "13 questions wall p50 (ms)"), ("torch-cpu-fp16", "13 questions wall p99 (ms)"),
            ("torch-cpu-bf16", "prefill of 512 tokens wall p50 (ms)")} <= measured, shaped["targets"]
    assert "## Targets" in (out / "gpu_check.md").read_text()

    out2 = tmp_path / "out2"
    link = tmp_path / "pkg"
    link.mkdir()
    (link / "onepass").symlink_to(ROOT)
    run = subprocess.run([env["PYTHON"], str(ROOT / "benchmarks" / "gpu_check.py"), "--engine", str(tiny_engine_dir),
                          "--device", "cpu", "--iters", "3", "--budget-s", "150", "--out", str(out2), "--all-variants"],
                         env=dict(env, PYTHONPATH=str(link)), capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = _check_report(out2, random_weights=False)
    hf = report["latency"]["torch-cpu"]
    assert hf["hf_eager_score_options"]["n"] == 3 and hf["hf_eager_generate_json"]["new_tokens"] > 5
    variants = {"torch-cpu-fp16", "torch-cpu-bf16", "torch-cpu-fp16-eager", "torch-cpu-reference-fp16"}
    assert variants <= set(report["latency"]), sorted(report["latency"])  # every variant the GPU run times, run
    for name in variants:
        parity = report["parity"][name]
        assert parity["vs_reference"]["within"] and parity["golden"], (name, parity)
        timed = report["latency"][name]["warm_13_questions_512_state"]
        assert "error" not in timed and timed["n"] >= 3, (name, timed)
    assert report["kernels"]["torch-cpu-fp16"]["attention"] == "F.scaled_dot_product_attention"


def _check_report(out: Path, random_weights: bool) -> dict:
    report = json.loads((out / "gpu_check.json").read_text())
    env = report["environment"]
    assert env["hdrh"].startswith("missing") and env["weights"].startswith("RANDOM") == random_weights
    assert report["errors"] == {}, report["errors"]
    parity = report["parity"]["torch-cpu"]
    assert all(v["within"] for v in parity["golden"].values()), parity
    assert parity["vs_reference"]["within"], parity
    latency = report["latency"]["torch-cpu"]
    timed = [latency["warm_13_questions_512_state"], latency["service_new_state_each_call_13_questions"],
             *latency["questions"].values(), *latency["prefill"].values()]
    assert len(timed) == 9 and all("error" not in r and r["n"] >= 3 and not r["failures"] for r in timed), timed
    assert "## Timing" in (out / "gpu_check.md").read_text()
    return report


def test_kernel_time_sums_each_calls_device_events_once():
    """gpu_check's kernel time: per profiled call, the device events (kernels, copies) that start inside its CPU
    range, each once: not the GPU-side annotation spanning the call (idle gaps included), not an operator's own
    device time (its kernels again)."""
    import sys
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    def event(name, device, start, end, annotation=False):
        span = NS(start=start, end=end, elapsed_us=lambda: end - start)
        return NS(name=name, device_type=device, time_range=span, is_user_annotation=annotation)

    events = [event("onepass_call_0", DeviceType.CPU, 0, 1000, True),
              event("onepass_call_0", DeviceType.CUDA, 10, 990, True),  # the GPU-side annotation: not counted
              event("aten::mm", DeviceType.CPU, 5, 50), event("gemm", DeviceType.CUDA, 100, 400),
              event("memcpy", DeviceType.CUDA, 500, 600),
              event("onepass_call_1", DeviceType.CPU, 2000, 3000, True), event("graph kernel", DeviceType.CUDA, 2100, 2150)]
    assert gpu_check.call_device_ms(events) == [0.4, 0.05]
