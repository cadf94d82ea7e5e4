"""Question encoding (validation, limits and tokenising, before any pass): `Engine.encode_questions` with the prompt
encoder's memo of template and short caller texts, against the same encoder tokenising every piece afresh, in one
run, interleaved. Both give the same token ids (checked here, and in tests/test_prompt.py).

    python benchmarks/studies/encode.py --engine engines/smollm2 --questions 13 500 5000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

from onepass import Choice, Engine, Noul, Score
from onepass.runtime.core.prompt import PromptEncoder

RESULTS = Path(__file__).parent / "results"


def questions(n: int) -> dict:
    """``n`` questions, a third of each type, the choices over a few recurring team names as real requests have."""
    teams = {"billing": "payments and refunds", "technical": None, "shipping": None, "sales": None}
    kinds = (lambda i: Noul(f"Does note {i} mention a refund?"),
             lambda i: Choice(f"Which team handles note {i}?", teams),
             lambda i: Score(f"How urgent is note {i}?", ["Low", "Medium", "High"]))
    return {f"q{i}": kinds[i % 3](i) for i in range(n)}


def _fresh(memo: dict, tok, text: str) -> tuple:
    """The encoder's path before the memo: every piece tokenised afresh."""
    return tuple(tok.encode(text, add_special_tokens=False).ids)


def _time(engine: Engine, qs: dict) -> float:
    t0 = time.perf_counter()
    engine.encode_questions(qs)
    return (time.perf_counter() - t0) * 1000


def measure(engine: Engine, n: int, rounds: int) -> dict:
    """Median ms of encoding ``n`` questions with the memo (warm) and afresh, interleaved after a warm-up."""
    qs = questions(n)
    memo_path = PromptEncoder.__dict__["_memo"]  # the staticmethod itself, to put back
    with_memo, afresh = [], []
    want = engine.encode_questions(qs)
    for r in range(rounds + 1):
        PromptEncoder._memo = staticmethod(_fresh)
        fresh_ms, fresh_ids = _time(engine, qs), engine.encode_questions(qs)
        PromptEncoder._memo = memo_path
        memo_ms = _time(engine, qs)
        assert fresh_ids == want, "the memo changed token ids"
        if r:  # round 0 is the warm-up
            with_memo.append(memo_ms), afresh.append(fresh_ms)
    return {"questions": n, "memo_ms_p50": statistics.median(with_memo), "afresh_ms_p50": statistics.median(afresh),
            "speedup": statistics.median(afresh) / statistics.median(with_memo), "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--questions", type=int, nargs="+", default=[13, 500, 5000])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "encode"))
    args = ap.parse_args()
    engine = Engine.load(args.engine, backend="onnxruntime")
    rows = [measure(engine, n, args.rounds) for n in args.questions]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    record = {"machine": {"cpu": model, "python": platform.python_version()}, "engine": engine.name, "rows": rows}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    lines = [f"# Question encoding: memo vs afresh ({model}, {engine.name})", "",
             "Median of interleaved rounds after a warm-up; the same token ids both ways.", "",
             "| questions | with the memo, ms | every piece afresh, ms | speed-up |", "|---|---|---|---|"]
    lines += [f"| {r['questions']} | {r['memo_ms_p50']:.1f} | {r['afresh_ms_p50']:.1f} | {r['speedup']:.1f}x |"
              for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
