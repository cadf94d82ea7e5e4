"""Labelled rows for `onepass tune`: parsing with one-line errors, grouping by state, a split by whole states.

A row is a `onepass calibrate` row — ``{"state", "question": {type, instructions, criteria},
"label"}`` — and may carry ``"probabilities"`` (a teacher distribution keyed like the answer:
``{"yes": p}`` or a number for noul, option names for choice, level indices "0".. for score)
instead of, or besides, the label; the training target is then that distribution.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ...runtime.core.errors import InvalidRequest, OnepassError
from ...runtime.core.prompt import state_text
from ...runtime.core.questions import Noul, Question, Score, as_text, from_wire
from ...runtime.teacher.client import distribution_problem, option_keys
from ...runtime.tools.request_files import json_lines


def label_index(question, label) -> int:
    """The option index of a label; InvalidRequest when it is not one of the question's options."""
    if isinstance(question, Noul):
        table = {"yes": 0, "true": 0, "1": 0, "no": 1, "false": 1, "0": 1}
        key = str(label).strip().lower()
        if key not in table:
            raise InvalidRequest(f"a noul label must be yes/no or true/false, got {label!r}", "label")
        return table[key]
    names = [as_text(o) for o in question.criteria]
    if isinstance(question, Score) and isinstance(label, int) and not isinstance(label, bool):
        if 0 <= label < len(names):
            return label
        raise InvalidRequest(f"score label {label} is outside 0..{len(names) - 1}", "label")
    if as_text(label) in names:
        return names.index(as_text(label))
    raise InvalidRequest(f"label {label!r} is not one of the options {names}", "label")


@dataclass(frozen=True)
class TuneRow:
    """One labelled question about a state; ``target`` is a label index or a [K] teacher distribution."""

    state: str
    question: Question
    target: int | tuple
    dataset: str = ""
    where: str = ""  # file:line, for error messages

    @property
    def task(self) -> str:
        """The data set name (what the decision head's features are grouped by)."""
        return self.dataset

    @property
    def label(self) -> int:
        """The label index (the teacher's most probable option for a distribution)."""
        if isinstance(self.target, int):
            return self.target
        return max(range(len(self.target)), key=self.target.__getitem__)


def teacher(question: Question, probs) -> tuple:
    """A [K] distribution from a row's ``probabilities``; InvalidRequest says what is allowed."""
    keys = option_keys(question)
    if isinstance(question, Noul) and isinstance(probs, (int, float)) and not isinstance(probs, bool):
        probs = {"yes": probs, "no": 1.0 - probs}
    if not isinstance(probs, dict) or not probs:
        raise InvalidRequest(f"must be an object keyed by {keys}", "probabilities")
    unknown = sorted(set(probs) - set(keys))
    if unknown:
        raise InvalidRequest(f"unknown option(s) {unknown}; allowed keys: {keys}", "probabilities")
    values = [probs.get(k, 0.0) for k in keys]
    problem = distribution_problem(values)
    if problem:
        raise InvalidRequest(problem, "probabilities")
    return tuple(float(v) / sum(values) for v in values)


def parse_row(row, where: str) -> TuneRow:
    """One parsed row; errors name ``where`` (file:line) and the field."""
    try:
        if not isinstance(row, dict):
            raise InvalidRequest("a row must be a JSON object with state, question and label (or probabilities)")
        for key in ("state", "question"):
            if key not in row:
                raise InvalidRequest("missing", key)
        if "label" not in row and "probabilities" not in row:
            raise InvalidRequest("a row needs a label or probabilities", "label")
        question = from_wire("question", row["question"])
        state = state_text(row["state"])
        target = (teacher(question, row["probabilities"]) if "probabilities" in row
                  else label_index(question, row["label"]))
        if "probabilities" in row and "label" in row:
            label_index(question, row["label"])  # must still be one of the options
        dataset = row.get("dataset", "")
        return TuneRow(state, question, target, dataset if isinstance(dataset, str) else str(dataset), where)
    except OnepassError as err:
        raise InvalidRequest(f"{where}: {err}") from None


def load_rows(paths: Sequence[str | Path]) -> tuple[list[TuneRow], list[dict]]:
    """(rows, per-file provenance {path, sha256, rows}) of JSONL files; empty data is an error."""
    rows, files = [], []
    for path in paths:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise InvalidRequest(f"cannot read {path}: {err.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidRequest(f"{path}: not UTF-8 (byte {err.start}); rows must be UTF-8 JSON lines") from None
        before = len(rows)
        for n, row in json_lines(text, str(path)):
            rows.append(parse_row(row, f"{path}:{n}"))
        files.append({"path": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "rows": len(rows) - before})
    if not rows:
        raise InvalidRequest(f"no rows in {', '.join(str(p) for p in paths)}; give JSONL rows with state, question "
                             "and label")
    return rows, files


def group_by_state(rows: Sequence[TuneRow]) -> list[list[TuneRow]]:
    """Rows grouped by their state text, in first-seen order (one prefill per group)."""
    groups: dict[str, list[TuneRow]] = {}
    for row in rows:
        groups.setdefault(row.state, []).append(row)
    return list(groups.values())


def split_states(groups: list[list[TuneRow]], holdout: float, seed: int) -> tuple[list, list]:
    """(train groups, held-out groups): a seeded split of whole states, so no state is on both sides."""
    if not 0.0 < holdout < 1.0:
        raise InvalidRequest(f"holdout must be between 0 and 1, got {holdout}", "holdout")
    order = list(range(len(groups)))
    random.Random(seed).shuffle(order)
    cut = int(round(len(groups) * (1 - holdout)))
    if len(groups) < 4 or cut < 2 or len(groups) - cut < 2:
        raise InvalidRequest(f"{len(groups)} distinct states are too few for a held-out split of {holdout:.0%}: "
                             "give at least 4 states (2 to train on, 2 to hold out), or another --holdout")
    return [groups[i] for i in sorted(order[:cut])], [groups[i] for i in sorted(order[cut:])]
