"""When a reduced-precision backend may answer by default: its measured guarantee against fp32.

OpenVINO's CPU plugin computes the fp32 graph in bfloat16 where the CPU has it natively (AMX, or AVX512-BF16): 1.7x
faster on a 2-core AVX512-BF16 EPYC, 2.9x on an AMX Xeon, with answers moved (benchmarks/results/bf16_guarantee.md).
How far they move depends on the task, so it is measured on the user's own requests (``onepass guarantee``, which
records the result in the engine's manifest under ``guarantees``) and the default backend (``auto``) takes bf16
only where every measured data set keeps ``BOUNDS`` and the measurement was made on a CPU of this one's kind (the
bf16 kernels of AMX and AVX512-BF16 round differently). Without a guarantee, or where one misses a bound, the
default stays fp32, and the log says why.
"""

from __future__ import annotations

from pathlib import Path

BF16 = "openvino-cpu-bf16"  # the reduced-precision CPU backend a guarantee unlocks
REFERENCE = "openvino-cpu"  # what it is measured against: the same graph at fp32
# a data set keeps the decisions when at least this share of its questions keep their argmax, and no answer
# probability moves by more than this
BOUNDS = {"argmax_agreement": 0.99, "max_abs_dp": 0.05}
MIN_QUESTIONS = 100  # fewer questions cannot show 99% agreement (one flip is already 1%)


def cpu_bf16_kind(cpuinfo: str | None = None) -> str | None:
    """This CPU's native bf16: ``amx`` (AMX tiles), ``avx512_bf16``, or None (OpenVINO's bf16 hint falls back to
    f32 there). Read from /proc/cpuinfo's flags (Linux); None where they cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else None


def misses(guarantee: dict | None, cpu: str | None) -> str | None:
    """Why ``guarantee`` does not let its backend answer by default on a CPU of kind ``cpu`` (None: it does)."""
    if not guarantee:
        return "no guarantee measured (onepass guarantee --engine DIR --requests FILE --write)"
    if cpu is None:
        return "this CPU has no native bf16"
    if guarantee.get("cpu") != cpu:
        return f"the guarantee was measured on a {guarantee.get('cpu')} CPU and this one is {cpu}"
    datasets = guarantee.get("datasets") or {}
    if not datasets:
        return "the guarantee holds no data set"
    problems = []
    for name, m in sorted(datasets.items()):
        if m.get("questions", 0) < MIN_QUESTIONS:
            problems.append(f"{name}: {m.get('questions', 0)} questions (at least {MIN_QUESTIONS})")
        if not m.get("argmax_agreement", 0) >= BOUNDS["argmax_agreement"]:
            problems.append(f"{name}: argmax agreement {m.get('argmax_agreement')} < {BOUNDS['argmax_agreement']}")
        if not m.get("max_abs_dp", 1) <= BOUNDS["max_abs_dp"]:
            problems.append(f"{name}: max |dp| {m.get('max_abs_dp')} > {BOUNDS['max_abs_dp']}")
    return "; ".join(problems) or None
