"""Run an engine's golden file through its backend: the exported graph must reproduce PyTorch.

Used right after export (a graph that disagrees is never shipped), by ``onepass check`` and by
the tests. Tolerances are ONNX Runtime fp32 against the PyTorch fp32 graph that was exported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import EngineFileError
from ..backends.batch import PackedBatch

GOLDEN_VERSION = 1
TOLERANCES = {"prefill_key_first": 1e-4, "prefill_value_last": 1e-4, "target_logprob": 2e-4, "head_score": 1e-3}
# fp16: ONNX Runtime's fp16 graph and PyTorch accumulate in different orders (measured 0.004 / 0.015 / 0.018). On
# SmolLM2's real weights against the fp32 golden file: the export's fp16 GEMMs 0.004 / 0.028 / 0.016, the GPU pass
# (everything fp16, residual stream and K/V included) 0.006 / 0.057 / 0.022 (benchmarks/results/gpu/
# fused_precision.md). Random weights show a twentieth of that: only real ones set these.
FP16_TOLERANCES = {"prefill_key_first": 0.05, "prefill_value_last": 0.1, "target_logprob": 0.05, "head_score": 0.05}
# bf16 keeps 8 significant bits. Measured with SmolLM2's real weights against the fp32 golden file: the export's bf16
# GEMMs 0.040 / 0.186 / 0.222 (0.340 with an earlier adapter), the GPU pass in bf16 0.036 / 0.248 / 0.270 — over the
# 0.2 first set from fp16 scaled by the coarser mantissa, which only random weights (0.008) met.
BF16_TOLERANCES = {"prefill_key_first": 0.1, "prefill_value_last": 0.4, "target_logprob": 0.5,
                   "head_score": 0.5}
# An option's summed log-likelihood against ONNX Runtime fp32, worst of the 78-question workload on real weights
# (benchmarks/results/gpu/fused_precision.md): fp32 4.6e-5; the GPU pass at fp16 0.089 (the export's fp16 GEMMs
# 0.062), at bf16 1.44 (the export's 1.33), with the bound's margin.
OPTION_TOLERANCES = {"fp32": 2e-4, "fp16": 0.15, "bf16": 2.0}


TOLERANCES_BY_PRECISION = {"fp32": TOLERANCES, "fp16": FP16_TOLERANCES, "bf16": BF16_TOLERANCES}


def tolerances(engine) -> dict:
    """The golden tolerances for the engine's precision."""
    return TOLERANCES_BY_PRECISION[getattr(engine.manifest, "precision", "fp32")]


def run_golden(engine, position_shift: int = 0) -> dict:
    """Max |difference| per golden output. ``position_shift`` breaks the positions (a negative control)."""
    return run_golden_on(engine.backend, engine.root, engine.manifest, position_shift)


def over_tolerance(diffs: dict, tol: dict) -> dict:
    """The outputs whose difference is over their tolerance (NaN included)."""
    return {k: v for k, v in diffs.items() if not v <= tol[k]}


def run_golden_on(backend, root, manifest, position_shift: int = 0) -> dict:
    """:func:`run_golden` of a backend not yet in an engine (the default backend's choice runs it first)."""
    g = np.load(Path(root) / manifest.golden)
    if int(g["version"]) != GOLDEN_VERSION:
        raise EngineFileError(f"golden file version {int(g['version'])} is not {GOLDEN_VERSION}; re-export the engine")
    kv = backend.prefill(g["state_ids"].tolist(), manifest.limits.prefill_chunk)
    batch = PackedBatch(g["input_ids"], g["position_ids"] + position_shift, g["tree_mask"],
                        g["readout_index"], g["readout_target"])
    logprob, head = backend.score_all(kv, batch)
    if head is not None and "head_score" not in g and getattr(backend.tasks, "heads", None) is not None:
        head = None  # a slot graph's task heads (no task fed here, every score 0), not a decision head of the engine's
    host = backend.to_host
    got = {"prefill_key_first": host(kv.layers[0][0]), "prefill_value_last": host(kv.layers[-1][1]),
           "target_logprob": logprob}
    if ("head_score" in g) != (head is not None):
        raise EngineFileError("the graph and its golden file disagree on having a decision head; re-export the engine")
    if head is not None:
        got["head_score"] = head
    return {name: float(np.abs(value - g[name]).max()) for name, value in got.items()}


def check_golden(engine) -> dict:
    """Raise EngineFileError when an output is off by more than its tolerance; return the differences."""
    diffs = run_golden(engine)
    tol = tolerances(engine)
    bad = over_tolerance(diffs, tol)
    if bad:
        raise EngineFileError(f"the graph does not reproduce its golden file: {bad} (tolerances {tol})")
    return diffs


def report_lines(engine) -> list[str]:
    """What `onepass check` prints: each golden output's largest difference beside its tolerance (raises as
    :func:`check_golden` when one is over)."""
    diffs, tol = check_golden(engine), tolerances(engine)
    return [f"{name:20s} max |diff| {diff:.2e}  (tolerance {tol[name]:.0e})" for name, diff in diffs.items()]
