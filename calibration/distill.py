"""`onepass distill`: learn a task from a teacher model's answers on unlabelled states.

    onepass distill --engine DIR --teacher URL --states states.jsonl --questions q.json --out DIR

1. **Label**: every state is asked every question of ``q.json`` by the teacher (:mod:`onepass.runtime.teacher`,
   a System One server or an OpenAI-compatible one), ``concurrency`` states at a time, with a progress bar.
   Each state's rows are appended to ``<out>.distill/labels.jsonl`` in one write once all its answers are in,
   so an interrupted run resumes where it stopped (the states already labelled are skipped; a last line cut
   short by the interruption is dropped) and no teacher call is paid for twice.
2. **Tune**: a split by whole states (``holdout``, seeded): `onepass tune` on the teacher's probabilities of
   the training states, the held-out states for early stopping.
3. **Gate**: on the held-out states, per question, the lowest confidence at which the student's answers
   agree with the teacher's (argmax) on at least ``target_agreement`` of the questions it would answer
   (:func:`onepass.calibration.metrics.coverage_at`); 1.0 where no share reaches it. The thresholds go into
   the student's manifest (``gate``): `onepass serve --engine OUT --teacher URL` answers locally above them
   and forwards the rest to the teacher.

The report (``<out>-report/distill.json``, and the lines printed) gives the student's agreement with the
teacher on the held-out states, the share answered locally at the target and the agreement there, and the
teacher calls saved. These states chose the early stopping and the gate: measure on other states for a
claim (``benchmarks/distill.py`` does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from ..runtime import manifest as mf
from ..runtime.errors import InvalidRequest, OnepassError
from ..runtime.prompt import state_text
from ..runtime.questions import from_wire, to_wire
from ..runtime.readout_calibration import question_key
from ..runtime.request_files import json_lines, read_text
from ..runtime.teacher import TeacherError, TeacherRefused, answer_distribution, dumps, option_keys, wire_probabilities
from . import metrics
from .tune import TuneConfig

MAX_FAILED_SHARE = 0.1  # more of the states failing than this stops the labelling (the rest would likely fail too)


def read_states(path: str) -> list:
    """The states of a JSONL file (each line a JSON string, or an object with a ``state``), duplicates dropped."""
    out, seen = [], set()
    for n, value in json_lines(read_text(path, "states file"), path):
        state = value.get("state") if isinstance(value, dict) else value
        if state is None or isinstance(state, (bool, int, float)):
            raise InvalidRequest(f"{path}:{n}: each line must be a JSON string (the state) or an object with a "
                                 "\"state\"")
        try:
            key = state_text(state)
        except OnepassError as err:
            raise InvalidRequest(f"{path}:{n}: {err}") from None
        if key not in seen:
            seen.add(key)
            out.append(state)
    if not out:
        raise InvalidRequest(f"{path} holds no state; give one JSON string or {{\"state\": ...}} per line")
    return out


def read_questions(path: str) -> dict:
    """{id: Question} of a JSON file holding {id: question} or a whole request."""
    try:
        data = json.loads(read_text(path, "questions file"))
    except (json.JSONDecodeError, RecursionError) as err:
        raise InvalidRequest(f"questions file {path} is not valid JSON: {err}") from None
    data = data.get("questions", data) if isinstance(data, dict) and "questions" in data else data
    if not isinstance(data, dict) or not data:
        raise InvalidRequest(f"questions file {path} must hold an object of questions by id")
    try:
        return {str(qid): from_wire(str(qid), q) for qid, q in data.items()}
    except OnepassError as err:
        raise InvalidRequest(f"questions file {path}: {err}") from None


def _state_id(state) -> str:
    return hashlib.sha256(state_text(state).encode("utf-8")).hexdigest()[:24]


def _read_labels(path: Path) -> dict:
    """{state id: [rows]} already labelled; a last line cut short by an interruption is cut off the file."""
    if not path.exists():
        return {}
    raw = path.read_bytes()
    whole = raw[:raw.rfind(b"\n") + 1]
    if len(whole) != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(len(whole))
    done: dict = {}
    for n, line in enumerate(whole.decode("utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            done.setdefault(row["state_id"], []).append(row)
        except (ValueError, KeyError, TypeError):
            raise OnepassError(f"{path}:{n} is not a label row of this command; move the file away to label "
                               "again") from None
    return done


def _missing(rows: list, questions: dict) -> dict:
    """The questions a state's label rows do not answer yet (a row answers a question with the same id and form)."""
    have = {r["qid"] for r in rows if r.get("question") == to_wire(questions.get(r["qid"], _NONE))}
    return {q: v for q, v in questions.items() if q not in have}


_NONE = object()


def label(teacher, states: list, questions: dict, path: Path, concurrency: int = 4, log=print) -> dict:
    """Ask ``teacher`` the questions ``path`` does not yet hold an answer to about each state; {state id: [the
    current questions' rows]} of every labelled state."""
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_labels(path)
    todo = [(s, _missing(done.get(_state_id(s), []), questions)) for s in states]
    todo = [(s, qs) for s, qs in todo if qs]
    if done:
        log(f"{len(states) - len(todo)} of {len(states)} states already labelled in {path}; asking the rest")
    failed, first_error = 0, None

    def one(state, asked):
        probs = teacher.probabilities(state, asked)
        sid = _state_id(state)
        return sid, [{"state_id": sid, "qid": qid, "state": state, "question": to_wire(asked[qid]),
                      "probabilities": wire_probabilities(asked[qid], p), "teacher": teacher.name}
                     for qid, p in probs.items()]

    with open(path, "ab") as fh, ThreadPoolExecutor(concurrency) as pool, \
            tqdm(total=len(todo), unit="state", desc="teacher", dynamic_ncols=True) as bar:
        futures = [pool.submit(one, s, qs) for s, qs in todo]
        try:
            for future in as_completed(futures):
                try:
                    sid, rows = future.result()
                except TeacherError as err:
                    failed += 1
                    first_error = first_error or err
                    if isinstance(err, TeacherRefused) or failed > max(2, MAX_FAILED_SHARE * len(todo)):
                        raise
                    continue
                finally:
                    bar.update(1)
                fh.write(b"".join(dumps(r) for r in rows))  # one write per state: whole states only
                fh.flush()
                done.setdefault(sid, []).extend(rows)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    if todo and failed == len(todo):
        raise first_error
    if failed:
        log(f"warning: the teacher gave no answer for {failed} of {len(todo)} states (first: {first_error}); "
            "they are left out (run again to retry them)")
    current, wanted = {}, {_state_id(s) for s in states}
    for sid, rows in done.items():  # the latest row of each current question, for the states fully labelled
        if sid not in wanted:
            continue
        latest = {r["qid"]: r for r in rows if r["qid"] in questions and r["question"] == to_wire(questions[r["qid"]])}
        if len(latest) == len(questions):
            current[sid] = [latest[q] for q in questions]
    return current


def _tune_rows(rows: list) -> list:
    return [{"state": r["state"], "question": r["question"], "probabilities": r["probabilities"],
             "dataset": "distill"} for r in rows]


def _write_jsonl(rows: list, path: Path) -> Path:
    path.write_bytes(b"".join(dumps(r) for r in rows))
    return path


def fit_gate(engine, questions: dict, held: dict, target: float) -> dict:
    """Per question, the gate reaching ``target`` agreement with the teacher on the held-out states ``held``
    ({state id: rows}); with the measured agreement and coverage."""
    per_question, per_key = {}, {}
    covered = agreed_covered = agreed_all = total = 0
    by_qid: dict = {qid: ([], []) for qid in questions}
    for rows in held.values():
        state = rows[0]["state"]
        answers = engine.ask(state, {r["qid"]: questions[r["qid"]] for r in rows if r["qid"] in questions})
        for r in rows:
            if r["qid"] not in answers:
                continue
            q = questions[r["qid"]]
            teacher = np.array([r["probabilities"][k] for k in option_keys(q)])
            by_qid[r["qid"]][0].append(answer_distribution(q, answers[r["qid"]]))
            by_qid[r["qid"]][1].append(int(np.argmax(teacher)))
    for qid, (probs, labels) in by_qid.items():
        if not probs:
            continue
        probs, labels = np.array(probs), np.array(labels)
        found = metrics.coverage_at(probs, labels, target)
        threshold = 1.0 if found["min_confidence"] is None else float(found["min_confidence"])
        conf = metrics.confidence(probs)
        answered = conf >= threshold
        hits = probs.argmax(1) == labels
        q = questions[qid]
        key = question_key(q.type, engine.encoder.instructions(q), engine.encoder.options(q))
        per_key[key] = threshold
        per_question[qid] = {"key": key, "threshold": threshold, "questions": int(len(labels)),
                             "agreement": float(hits.mean()), "coverage": float(answered.mean()),
                             "agreement_covered": float(hits[answered].mean()) if answered.any() else None}
        total += len(labels)
        agreed_all += int(hits.sum())
        covered += int(answered.sum())
        agreed_covered += int(hits[answered].sum())
    if not total:
        raise OnepassError("no held-out question to fit the gate on")
    return {"per_key": per_key, "default": 1.0, "target_agreement": target,
            "measured": {"held_out_questions": total, "agreement": agreed_all / total, "coverage": covered / total,
                         "agreement_covered": agreed_covered / covered if covered else None,
                         "per_question": per_question}}


def distill(engine_dir: str | Path, teacher, states_path: str, questions_path: str, out: str | Path,
            target_agreement: float = 0.95, holdout: float = 0.2, config: TuneConfig = TuneConfig(),
            concurrency: int = 4, resume: bool = False, name: str | None = None, log=print) -> dict:
    """Label ``states`` with ``teacher``, tune ``engine_dir`` on its answers, fit the gate; the report."""
    from ..runtime.engine import Engine
    from .tune_engine import tune

    if not 0.5 <= target_agreement < 1.0:
        raise InvalidRequest(f"--target-agreement must be within [0.5, 1), got {target_agreement}")
    if not 0.0 < holdout < 1.0:
        raise InvalidRequest(f"--holdout must be between 0 and 1, got {holdout}")
    out = Path(out)
    if (out / mf.MANIFEST).exists():
        raise OnepassError(f"{out} already holds an engine; give another --out")
    states, questions = read_states(states_path), read_questions(questions_path)
    base = Engine.load(engine_dir)
    base.check_counts(questions)
    work = out.with_name(out.name + ".distill")
    labels_path = work / "labels.jsonl"
    labelled = label(teacher, states, questions, labels_path, concurrency, log)
    ids = sorted(labelled)
    order = list(ids)
    random.Random(config.seed).shuffle(order)
    cut = int(round(len(order) * (1 - holdout)))
    if len(order) < 4 or cut < 2 or len(order) - cut < 2:
        raise InvalidRequest(f"{len(order)} labelled states are too few to train on and hold out {holdout:.0%}: "
                             "give at least 4 states")
    train_ids, held_ids = set(order[:cut]), set(order[cut:])
    pick = lambda chosen: [r for sid in ids if sid in chosen for r in labelled[sid]]  # noqa: E731
    train = _write_jsonl(_tune_rows(pick(train_ids)), work / "train.jsonl")
    held = _write_jsonl(_tune_rows(pick(held_ids)), work / "held.jsonl")
    log(f"tuning on the teacher's answers for {len(train_ids)} states; {len(held_ids)} held out")
    summary = tune(engine_dir, [train], out, dataclasses.replace(config, holdout=holdout), resume=resume,
                   name=name or f"{base.name}-distilled", log=log, validation=[held])
    student = Engine.load(out)
    gate = fit_gate(student, questions, {sid: labelled[sid] for sid in held_ids}, target_agreement)
    gate["teacher"] = teacher.name
    manifest = mf.load(out, verify=False)
    mf.write(out, dataclasses.replace(manifest, gate=gate))
    measured = gate["measured"]
    report = {"teacher": teacher.name, "states": len(states), "labelled_states": len(ids),
              "teacher_calls": len(ids), "train_states": len(train_ids), "held_out_states": len(held_ids),
              "target_agreement": target_agreement, "agreement": measured["agreement"],
              "coverage_at_target": measured["coverage"], "agreement_covered": measured["agreement_covered"],
              "teacher_calls_saved": measured["coverage"], "per_question": measured["per_question"],
              "labels": str(labels_path), "tuning": summary.get("tuning", {}).get("metrics", {})}
    report_dir = out.with_name(out.name + "-report")
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "distill.json").write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")
    report["report"] = str(report_dir / "distill.json")
    return report


def summary_lines(report: dict, out) -> list[str]:
    """What `onepass distill` prints."""
    covered = report["agreement_covered"]
    return [f"distilled {out} from {report['teacher']}: {report['labelled_states']} states labelled "
            f"({report['train_states']} trained on, {report['held_out_states']} held out)",
            f"held-out agreement with the teacher: {report['agreement']:.3f}",
            f"at the gate (target {report['target_agreement']:.2f}): {report['coverage_at_target']:.1%} of questions "
            f"answered locally" + (f", agreement {covered:.3f} there" if covered is not None else ""),
            f"teacher calls saved when served with --teacher: {report['teacher_calls_saved']:.1%} of questions",
            f"report: {report['report']}; the teacher's labels stay in {report['labels']} (tune rows)"]

