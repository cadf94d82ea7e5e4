"""What a distilled student's decision head is fitted to: the teacher's most probable option or its distribution.

On the work directory of ``benchmarks/distill.py`` (its teachers and the labels `onepass distill` got from them), per
task: the student's training rows (``student.distill/train.jsonl``: the teacher's distributions for 240 unlabelled
states) and the task's 300 test states, answered by the teacher engine in-process, are run once through the base
engine's decoder as tune scores them (``PackedScorer``, PyTorch fp32), keeping what a head reads (cached in
``<work>/<task>/heads-features.pkl``). Then the head candidate (``calibration/heads/candidate.py``: five seeds, the
calibrated prior, a temperature from out-of-fold scores) is fitted on the training rows three ways:

* ``argmax, 60 epochs``: the teacher's most probable option as a label (what `distill` fitted until 2026-12-05; its
  temperature, as in all three, chosen by the cross-entropy against the teacher's distributions);
* ``distribution, 60 epochs``: the cross-entropy against the teacher's distribution;
* ``distribution, 200 epochs``: the same for ``head_candidate.DISTRIBUTION_EPOCHS`` (what it fits now).

Each is measured on the test states against the teacher: agreement (the argmaxes) and cross-entropy against its
distribution. Writes benchmarks/studies/results/distill_heads.{json,md}.

    python benchmarks/studies/distill_heads.py --engine engines/smollm2-base --work /tmp/distill-bench
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import unittest.mock
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
import distill as bench  # noqa: E402

import numpy as np  # noqa: E402

from onepass.calibration.heads import candidate as hc  # noqa: E402
from onepass.calibration.scoring.metrics import target_nll  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# (name, fitted to the distributions, epochs); the temperature is chosen against the distributions in all three
VARIANTS = (("argmax, 60 epochs", False, hc.CONFIG.epochs), ("distribution, 60 epochs", True, hc.CONFIG.epochs),
            ("distribution, 200 epochs", True, hc.DISTRIBUTION_EPOCHS))


def _teacher_rows(root: Path, task: str) -> Path:
    """The task's test states with the teacher engine's distributions, as tune rows (written once)."""
    from onepass import Engine
    from onepass.runtime.core.questions import from_wire
    from onepass.runtime.teacher.client import answer_distribution, dumps, row

    path = root / "test-teacher.jsonl"
    if not path.exists():
        teacher = Engine.load(root / "teacher")
        lines = []
        for r in bench.split(task)[2]:
            q = from_wire("q", r["question"])
            lines.append(dumps(row(r["state"], q, answer_distribution(q, teacher.ask(r["state"], {"q": q})["q"]),
                                   "teacher")))
        path.write_bytes(b"".join(lines))
    return path


def features(engine: Path, root: Path, task: str) -> dict:
    """{"train", "test"}: scored rows carrying a head's features and the teacher's distribution (cached)."""
    cache = root / "heads-features.pkl"
    if cache.exists():
        return pickle.loads(cache.read_bytes())
    import torch

    from onepass.calibration.tune.candidates import scored_rows
    from onepass.calibration.tune.config import TuneConfig, resolved
    from onepass.calibration.tune.trainer import PackedScorer, encode_groups
    from onepass.calibration.data.rows import group_by_state, load_rows
    from onepass.export.model_source import engine_source, load_model
    from onepass.runtime.backends.torch_decoder import PackedDecoder
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.prompt import PromptEncoder

    base = mf.load(engine, verify=False)
    encoder = PromptEncoder(str(engine / base.tokenizer), base.prompt)
    model = load_model(*engine_source(base)).model
    scorer = PackedScorer(PackedDecoder(model, share=True), base.scoring.readout, torch.device("cpu"), False, 0)
    out = {}
    for name, path in (("train", root / "student.distill" / "train.jsonl"), ("test", _teacher_rows(root, task))):
        rows, _ = load_rows([path])
        config = resolved(TuneConfig(), len(rows), base.model.num_layers, 0)
        out[name] = scored_rows(scorer, encode_groups(group_by_state(rows), encoder, config, base.limits), encoder,
                                features=True)
    cache.write_bytes(pickle.dumps(out))
    return out


def against_teacher(model, rows: list[dict]) -> dict:
    """The head's agreement with the teacher (argmaxes) and mean cross-entropy against its distributions."""
    scored = hc.head_rows(model, rows)
    return {"agreement": float(np.mean([np.argmax(r["scores"]) == np.argmax(r["target"]) for r in scored])),
            "cross_entropy": float(np.mean([target_nll(hc._log_softmax(np.asarray(r["scores"])), r["target"])
                                            for r in scored]))}


def run_task(engine: Path, root: Path, task: str) -> dict:
    rows = features(engine, root, task)
    out = {"task": task, "train_states": len(rows["train"]), "test_states": len(rows["test"]), "variants": []}
    for name, distributions, epochs in VARIANTS:
        start = time.perf_counter()
        with unittest.mock.patch.object(hc, "DISTRIBUTION_EPOCHS", epochs), \
                unittest.mock.patch.object(hc, "_distributions", lambda rows, d=distributions: d):
            model = hc.fit(rows["train"])
        seconds = time.perf_counter() - start
        out["variants"].append({"name": name, "epochs": model.config.epochs, "temperature": model.temperature,
                                "fit_seconds": seconds, **against_teacher(model, rows["test"])})
        print(task, out["variants"][-1], flush=True)
    return out


def write_md(results: dict) -> None:
    m = results["machine"]
    lines = [f"# A student's decision head: fitted to the teacher's argmax or to its distribution ({m['when']}, "
             f"{m['cpu']})", "",
             "Per task, the teachers and the labels of `benchmarks/distill.py`'s work directory: the head candidate "
             "fitted on the student's 240 training states (the teacher's answers for them) and measured on 300 other "
             "states against the teacher engine's answers. Agreement: the head's argmax is the teacher's. "
             "Cross-entropy: against the teacher's distribution (what tune's choice judges a student by). Fit "
             "seconds: the five seeds and the temperature's inner folds, on 2 shared cores.", "",
             "| task | head fitted to | epochs | temperature | agreement | cross-entropy | fit s |",
             "|---|---|---|---|---|---|---|"]
    for t in results["tasks"]:
        for v in t["variants"]:
            lines.append(f"| {t['task']} | {v['name'].split(',')[0]} | {v['epochs']} | {v['temperature']:.2f} | "
                         f"{v['agreement']:.3f} | {v['cross_entropy']:.3f} | {v['fit_seconds']:.0f} |")
    lines += ["", "    python benchmarks/studies/distill_heads.py --engine ENGINE --work WORK "
                  "(after benchmarks/distill.py teachers and students)"]
    (RESULTS / "distill_heads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-base", help="the engine the students start from")
    p.add_argument("--work", default="/work/distill-bench", help="benchmarks/distill.py's work directory")
    p.add_argument("--tasks", nargs="+", default=list(bench.TASKS), choices=bench.TASKS)
    args = p.parse_args(argv)
    results = {"machine": bench._machine(), "engine": args.engine,
               "tasks": [run_task(Path(args.engine), Path(args.work) / t, t) for t in args.tasks]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_heads.json").write_text(json.dumps(results, indent=2))
    write_md(results)


if __name__ == "__main__":
    main()
