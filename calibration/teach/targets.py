"""Training rows whose targets carry another engine's answers: one engine taught to answer like another.

    python -m onepass.calibration.teach.targets --rows train.jsonl --teacher engines/smollm2 --out taught.jsonl \
        [--weight 0.5] [--crossed 1] [--seed 0]

Every labelled row gains ``probabilities`` (the target `onepass tune` trains on, :mod:`..data.rows`; a row's own are
replaced): ``weight`` x the teacher engine's served distribution + (1 - weight) x the label's one-hot. ``--crossed
N`` adds, per state, N questions of *other* data sets of the rows (seeded), unlabelled, whose target is the
teacher's answer alone: the student learns how the teacher answers questions that do not fit the text, not only the
trained tasks, where labels and a teacher fitted to them agree.

Used by `make train-default-compact`: continued on labels alone in the compact prompt form, the chat-form
adapter kept the chat form's separation but not its lean on tasks it was never trained on
(benchmarks/studies/results/prompt_forms_continued.md); the chat engine's own answers carry that lean. The questions about
one state are asked in one request (each answer equals asking it alone; the engine's limits apply to it, so an
over-long state stops the run with the limit's error, and nothing is written).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from ...runtime.core.engine import Engine
from ...runtime.core.errors import InvalidRequest, OnepassError
from ...runtime.core.prompt import state_text
from ...runtime.core.questions import from_wire
from ...runtime.teacher.client import answer_distribution, wire_probabilities
from ...runtime.tools.request_files import json_lines
from ..data.mixture import write_jsonl
from ..data.rows import label_index
from ..data.rows import parse_row


def crossed_rows(rows: list[dict], per_state: int, seed: int = 0) -> list[dict]:
    """Per state, ``per_state`` unlabelled rows asking a question of another data set (distinct questions, drawn
    seeded from the rows' own); none for a state whose rows cover every data set."""
    if per_state < 0:
        raise InvalidRequest(f"must be >= 0, got {per_state}", "crossed")
    by_dataset: dict = defaultdict(dict)
    for r in rows:
        by_dataset[r.get("dataset", "")].setdefault(json.dumps(r["question"], sort_keys=True), r["question"])
    states: dict = {}
    for r in rows:
        states.setdefault(state_text(r["state"]), (r["state"], set()))[1].add(r.get("dataset", ""))
    rng = random.Random(seed)
    out = []
    for state, own in states.values():
        others = sorted(set(by_dataset) - own)
        for dataset in (rng.sample(others, min(per_state, len(others))) if others else []):
            questions = list(by_dataset[dataset].values())
            out.append({"dataset": f"{dataset}@crossed", "state": state, "question": rng.choice(questions)})
    return out


def check_weight(weight: float) -> None:
    """InvalidRequest unless the teacher's share of a labelled row's target is within 0..1."""
    if not 0.0 <= weight <= 1.0:
        raise InvalidRequest(f"must be within 0..1, got {weight}", "weight")


def teach(engine: Engine, rows: list[dict], weight: float, log=print) -> list[dict]:
    """``rows`` with ``probabilities``: ``weight`` x the engine's served answer + (1 - weight) x the label's one-hot;
    a row without a label gets the engine's answer alone."""
    check_weight(weight)
    from tqdm import tqdm

    by_state: dict = defaultdict(list)
    for i, r in enumerate(rows):
        by_state[state_text(r["state"])].append(i)
    out: list = [None] * len(rows)
    for idxs in tqdm(by_state.values(), unit="state", desc="teacher", dynamic_ncols=True, file=sys.stderr):
        questions = {f"q{j}": from_wire("question", rows[i]["question"]) for j, i in enumerate(idxs)}
        answers = engine.ask(rows[idxs[0]]["state"], questions)
        for j, i in enumerate(idxs):
            question = questions[f"q{j}"]
            target = answer_distribution(question, answers[f"q{j}"])
            if "label" in rows[i]:
                onehot = np.eye(len(target))[label_index(question, rows[i]["label"])]
                target = weight * target + (1.0 - weight) * onehot
            out[i] = {**rows[i], "probabilities": wire_probabilities(question, target)}
    log(f"taught {len(rows)} rows about {len(by_state)} states by {engine.name}")
    return out


def load(path: Path) -> list[dict]:
    """The labelled rows of a JSONL file as written; InvalidRequest names the line and the field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"cannot read {path}: {err}") from None
    rows = []
    for n, row in json_lines(text, str(path)):
        parse_row(row, f"{path}:{n}")  # a state, a question and a label (or probabilities) it allows
        if "label" not in row:
            raise InvalidRequest(f"{path}:{n}: label: a row needs a label (the teacher gives the probabilities)")
        rows.append(row)
    if not rows:
        raise InvalidRequest(f"{path} has no rows")
    return rows


def main(argv=None) -> int:
    """Write the rows with the teacher engine's targets as JSONL."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, type=Path, help="labelled JSONL rows (state, question, label)")
    ap.add_argument("--teacher", required=True, help="the engine folder whose answers are learned")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--weight", type=float, default=0.5, help="the teacher's share of a labelled row's target")
    ap.add_argument("--crossed", type=int, default=0, help="unlabelled questions of other data sets per state")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        check_weight(args.weight)  # before the rows are read and the teacher is loaded
        if not args.out.parent.is_dir():  # before the teacher's work, not after it
            raise InvalidRequest(f"the folder {args.out.parent} does not exist", "out")
        rows = load(args.rows)
        rows += crossed_rows(rows, args.crossed, args.seed)
        taught = teach(Engine.load(args.teacher), rows, args.weight, log=lambda m: print(m, file=sys.stderr))
        write_jsonl(taught, args.out)
    except (OnepassError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
