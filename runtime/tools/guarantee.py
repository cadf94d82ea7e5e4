"""`onepass guarantee`: a reduced-precision backend's answers measured against fp32 on the user's own requests, per
data set, and (``--write``) recorded in the engine's manifest, where the default backend reads it
(``core.guarantee``: bf16 by default only where every data set keeps the bounds, on a CPU of the kind measured).

The requests are a JSONL file of TypeSafe System One request bodies (what the service is asked), each with an
optional ``dataset`` name (default ``requests``): a guarantee is per data set, so a task that bf16 moves shows up as
its own line. Both backends answer every question; a question keeps its argmax when both pick the same option, and
its ``|dp|`` is the largest change of any of its answer probabilities. Nothing is written unless asked, and the
manifest is replaced atomically.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import numpy as np

from ..core import manifest as mf
from ..core.engine import Engine
from ..core.errors import InvalidRequest
from ..core.guarantee import (BF16, BOUNDS, MIN_QUESTIONS, REFERENCE, cpu_bf16_kind, cpu_model, fingerprint,
                              misses)
from ..core.questions import NoulAnswer
from ..core.wire import parse_request


def read_requests(path) -> list[tuple[str, tuple]]:
    """(data set, (state, questions)) of every line of a JSONL file of System One bodies; InvalidRequest names the
    line of the first that is not one."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"cannot read {path}: {err}", "requests") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            if not isinstance(body, dict):
                raise InvalidRequest("the line is not a JSON object")
            dataset = body.get("dataset", "requests")
            if not isinstance(dataset, str) or not dataset:
                raise InvalidRequest("dataset must be a non-empty string", "dataset")
            out.append((dataset, parse_request(body)))
        except (json.JSONDecodeError, InvalidRequest) as err:
            raise InvalidRequest(f"{path} line {number}: {err} (each line: a System One request body with an "
                                 "optional \"dataset\" name)", "requests") from None
    if not out:
        raise InvalidRequest(f"{path} holds no request", "requests")
    return out


def probabilities(answer) -> np.ndarray:
    """An answer's probabilities as a vector (yes, no for a noul)."""
    if isinstance(answer, NoulAnswer):
        return np.array([answer.noul, 1.0 - answer.noul])
    return np.array(list(answer.probabilities.values()), dtype=np.float64)


class Closeness:
    """Per data set, how close a variant's answers are to the reference's: questions, argmax agreement, max and mean
    ``|dp|`` (the largest change of any of a question's answer probabilities)."""

    def __init__(self):
        self.seen: dict = {}

    def add(self, dataset: str, p: np.ndarray, q: np.ndarray) -> None:
        """One question: ``p`` the reference's probabilities, ``q`` the variant's."""
        acc = self.seen.setdefault(dataset, {"questions": 0, "agree": 0, "max": 0.0, "sum": 0.0})
        dp = float(np.abs(p - q).max())
        acc["questions"] += 1
        acc["agree"] += int(np.argmax(p) == np.argmax(q))
        acc["max"], acc["sum"] = max(acc["max"], dp), acc["sum"] + dp

    def datasets(self) -> dict:
        """{data set: questions, argmax_agreement, max_abs_dp, mean_abs_dp}, raw (judged as measured)."""
        return {name: {"questions": a["questions"], "argmax_agreement": a["agree"] / a["questions"],
                       "max_abs_dp": a["max"], "mean_abs_dp": a["sum"] / a["questions"]}
                for name, a in sorted(self.seen.items())}


def answered(engines: list, requests: list, progress=None):
    """Per question of ``requests`` (:func:`read_requests`): (data set, the first engine's answer, the second's),
    both engines asked each request; InvalidRequest names the request that fails."""
    for i, (dataset, (state, questions)) in enumerate(requests):
        try:
            ref, var = (engine.ask(state, questions) for engine in engines)
        except InvalidRequest as err:
            raise InvalidRequest(f"request {i + 1} ({dataset}): {err}", "requests") from None
        for qid in questions:
            yield dataset, ref[qid], var[qid]
        if progress is not None:
            progress(i + 1, len(requests))


def measure(engine_dir, requests: list, variant: str = BF16, reference: str = REFERENCE,
            threads: int | None = None, progress=None) -> dict:
    """The guarantee of ``variant`` against ``reference`` on ``requests`` (:func:`read_requests`), per data set:
    questions, argmax agreement, max and mean |dp|, and the bounds' verdict on this CPU."""
    engines = [Engine.load(engine_dir, backend=name, threads=threads, cache_bytes=0) for name in (reference, variant)]
    computed_in = getattr(engines[1].backend, "precision", None)  # OpenVINO's precision in force (f32 where no bf16)
    measured_on = fingerprint(engines[0].manifest)
    close = Closeness()
    try:
        for dataset, ref, var in answered(engines, requests, progress):
            close.add(dataset, probabilities(ref), probabilities(var))
    finally:
        for engine in engines:
            engine.close()
    datasets = close.datasets()
    cpu = cpu_bf16_kind()
    guarantee = {"reference": reference, "cpu": cpu, "cpu_model": cpu_model(), "computed_in": computed_in,
                 "runtime": _runtime_version(), "engine": measured_on, "bounds": dict(BOUNDS),
                 "min_questions": MIN_QUESTIONS,
                 "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "datasets": datasets}
    return {"variant": variant, "guarantee": guarantee, "misses": misses(guarantee, cpu, measured_on)}


def _runtime_version() -> str | None:
    try:
        import openvino

        return f"openvino {openvino.__version__}"
    except ImportError:
        return None


def record(engine_dir, variant: str, guarantee: dict) -> Path:
    """Put ``guarantee`` into the engine's manifest under ``variant`` (replacing an earlier one), atomically."""
    manifest = mf.load(engine_dir)
    return mf.write(engine_dir, dataclasses.replace(manifest, guarantees={**manifest.guarantees,
                                                                           variant: guarantee}))


def report_lines(result: dict) -> list[str]:
    """What `onepass guarantee` prints: one line per data set, then the verdict."""
    g = result["guarantee"]
    lines = [f"{result['variant']} (computed in {g['computed_in']}) against {g['reference']} on this "
             f"{g['cpu'] or 'non-bf16'} CPU ({g['cpu_model']}):"]
    for name, m in g["datasets"].items():
        lines.append(f"  {name:24s} {m['questions']:5d} questions  argmax kept {m['argmax_agreement']:.3f}  "
                     f"max |dp| {m['max_abs_dp']:.3f}  mean |dp| {m['mean_abs_dp']:.4f}")
    bounds = f"argmax >= {BOUNDS['argmax_agreement']}, max |dp| <= {BOUNDS['max_abs_dp']}, >= {MIN_QUESTIONS} questions"
    lines.append(f"bounds ({bounds}): " + ("hold: the default backend answers in bf16 here" if result["misses"] is None
                                           else f"missed, the default stays fp32 ({result['misses']})"))
    return lines
