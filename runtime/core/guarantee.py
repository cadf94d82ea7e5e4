"""When a reduced-precision backend may answer by default: its measured guarantee against fp32.

OpenVINO's CPU plugin computes the fp32 graph in bfloat16 where the CPU has it natively (AMX, or AVX512-BF16): 1.6-1.8x
its f32 on a 2-core AVX512-BF16 EPYC, 2.2x on an AMX Xeon, with answers moved (benchmarks/results/bf16_guarantee.md).
How far they move depends on the task, so it is measured on the user's own requests (``onepass guarantee``, which
records the result in the engine's manifest under ``guarantees``) and the default backend (``auto``) takes bf16
only where every measured data set keeps ``BOUNDS`` and the measurement was made on a CPU of this one's kind (the
bf16 kernels of AMX and AVX512-BF16 round differently), on this engine as it is now (its graph, weights, prompt,
scoring and calibration: a guarantee measured before `onepass calibrate` no longer holds after it). Without a
guarantee, or where one misses a bound or cannot be read, the default stays fp32, and the log says why.

What is compared: each question's argmax and its answer probabilities (a score's expected value moves by at most
``max |dp|`` times its number of levels less one; an abstention is a threshold on those probabilities).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .manifest import graph_files

BF16 = "openvino-cpu-bf16"  # the reduced-precision CPU backend a guarantee unlocks
REFERENCE = "openvino-cpu"  # what it is measured against: the same graph at fp32
# a data set keeps the decisions when at least this share of its questions keep their argmax, and no answer
# probability moves by more than this
BOUNDS = {"argmax_agreement": 0.99, "max_abs_dp": 0.05}
MIN_QUESTIONS = 100  # fewer questions cannot show 99% agreement (one flip is already 1%)


def _cpuinfo_field(name: str, cpuinfo: str | None = None) -> str | None:
    """The first ``name: value`` of /proc/cpuinfo (or of ``cpuinfo``); None where it cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    return next((line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith(name)), None)


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), what a measurement was made on."""
    return _cpuinfo_field("model name")


def cpu_bf16_kind(cpuinfo: str | None = None) -> str | None:
    """This CPU's native bf16: ``amx`` (AMX tiles), ``avx512_bf16``, or None (OpenVINO's bf16 hint falls back to
    f32 there). Read from /proc/cpuinfo's flags (Linux); None where they cannot be read."""
    flags = set((_cpuinfo_field("flags", cpuinfo) or "").split())
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else None


def fingerprint(manifest) -> str:
    """What a guarantee was measured on: the graph and its weights (their sha256s), the prompt, the scoring and the
    calibration. Any of them changed, the answers move differently and the guarantee no longer holds."""
    files = graph_files(manifest)
    calibration = manifest.calibration.to_dict() if manifest.calibration else None
    parts = [files, repr(manifest.prompt), repr(manifest.scoring), calibration]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def misses(guarantee, cpu: str | None, engine: str | None = None) -> str | None:
    """Why ``guarantee`` does not let its backend answer by default on a CPU of kind ``cpu`` for an engine of
    :func:`fingerprint` ``engine`` (None: it does). A guarantee that cannot be read is a miss, never an error."""
    if not guarantee:
        return "no guarantee measured (onepass guarantee --engine DIR --requests FILE --write)"
    try:
        return _misses(guarantee, cpu, engine)
    except (AttributeError, TypeError, ValueError) as err:
        return f"the recorded guarantee cannot be read ({type(err).__name__}: {err}); measure it again"


def _misses(guarantee: dict, cpu: str | None, engine: str | None) -> str | None:
    if cpu is None:
        return "this CPU has no native bf16"
    if guarantee.get("cpu") != cpu:
        return f"the guarantee was measured on a {guarantee.get('cpu')} CPU and this one is {cpu}"
    if guarantee.get("computed_in") != "bf16":
        return f"the measured backend computed in {guarantee.get('computed_in')}, not bf16"
    if engine is not None and guarantee.get("engine") != engine:
        return ("the engine changed since the guarantee was measured (graph, weights, prompt, scoring or "
                "calibration): measure it again")
    datasets = guarantee.get("datasets") or {}
    if not datasets:
        return "the guarantee holds no data set"
    return "; ".join(p for name, m in sorted(datasets.items()) for p in dataset_misses(name, m)) or None


def dataset_misses(name: str, measured: dict) -> list[str]:
    """Why one data set's measurement (questions, argmax_agreement, max_abs_dp) misses the bounds ([]: it keeps
    them)."""
    questions, agreement = int(measured["questions"]), float(measured["argmax_agreement"])
    dp = float(measured["max_abs_dp"])
    problems = []
    if questions < MIN_QUESTIONS:
        problems.append(f"{name}: {questions} questions (at least {MIN_QUESTIONS})")
    if not agreement >= BOUNDS["argmax_agreement"]:
        problems.append(f"{name}: argmax agreement {agreement:.6g} < {BOUNDS['argmax_agreement']}")
    if not dp <= BOUNDS["max_abs_dp"]:
        problems.append(f"{name}: max |dp| {dp:.6g} > {BOUNDS['max_abs_dp']}")
    return problems
