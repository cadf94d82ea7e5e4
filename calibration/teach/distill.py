"""`onepass distill`: learn a task from a teacher model's answers on unlabelled states.

    onepass distill --engine DIR --teacher URL --states states.jsonl --questions q.json --out DIR

1. **Label**: every state is asked every question of ``q.json`` by the teacher (:mod:`onepass.runtime.teacher.client`,
   a System One server or an OpenAI-compatible one), ``concurrency`` states at a time, with a progress bar.
   Each state's rows are appended to ``<out>.distill/labels.jsonl`` in one write once all its answers are in,
   so an interrupted run resumes where it stopped (the states already labelled are skipped; a last line cut
   short by the interruption is dropped) and no teacher call is paid for twice. A call is bounded as a whole
   (``--teacher-timeout`` per attempt, three attempts, whatever the teacher sends); once more than
   ``max(2, 10%)`` of the states have failed, or ``max(3, concurrency)`` in a row with none answered between,
   labelling stops and the calls under way are ended, so against a teacher that never answers (or trickles its
   answer) the command ends after one wave of calls, within one call's bound, saying why.
2. **Tune**: a split by whole states (``holdout``, seeded): `onepass tune` on the teacher's probabilities of
   the training states, the held-out states for early stopping.
3. **Gate**: on the held-out states, per question, the lowest confidence at which the student's answers
   agree with the teacher's (argmax) on at least ``target_agreement`` of the questions it would answer
   (:func:`onepass.calibration.scoring.metrics.coverage_at`); 1.0 where no share reaches it. The thresholds go into
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
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from ...runtime.core import manifest as mf
from ...runtime.core.errors import InvalidRequest, LimitExceeded, OnepassError
from ...runtime.core.prompt import state_text
from ...runtime.core.questions import from_wire, to_wire
from ...runtime.teacher.client import (TeacherError, TeacherRefused, answer_distribution, dumps, option_keys,
                                     wire_probabilities)
from ...runtime.tools.request_files import json_lines, read_text
from ..scoring import metrics
from ..tune.config import TuneConfig

LABEL_KEYS = {"state_id", "qid", "state", "question", "probabilities"}
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
            if not (isinstance(row, dict) and LABEL_KEYS <= set(row) and isinstance(row["qid"], str)
                    and isinstance(row["probabilities"], dict) and isinstance(row["question"], dict)):
                raise ValueError
            done.setdefault(row["state_id"], []).append(row)
        except (ValueError, TypeError):
            raise OnepassError(f"{path}:{n} is not a label row of this command; move the file away to label "
                               "again") from None
    return done


def _current(row: dict, questions: dict) -> bool:
    """Whether a label row answers one of ``questions`` as it is now (the same id and form)."""
    return row["qid"] in questions and row["question"] == to_wire(questions[row["qid"]])


def _missing(rows: list, questions: dict) -> dict:
    """The questions a state's label rows do not answer yet."""
    have = {r["qid"] for r in rows if _current(r, questions)}
    return {q: v for q, v in questions.items() if q not in have}


def label(teacher, states: list, questions: dict, path: Path, concurrency: int = 4, log=print,
          stats: dict | None = None) -> dict:
    """Ask ``teacher`` the questions ``path`` does not yet hold an answer to about each state; {state id: [the
    current questions' rows]} of every labelled state. ``stats`` gets the requests made and the states failed."""
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_labels(path)
    todo = [(s, _missing(done.get(_state_id(s), []), questions)) for s in states]
    todo = [(s, qs) for s, qs in todo if qs]
    if done:
        log(f"{len(states) - len(todo)} of {len(states)} states already labelled in {path}; asking the rest")
    failed, streak, first_error = 0, 0, None
    give_up = max(3, concurrency)  # this many states failing in a row, none answered between: the teacher is down

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
                    failed, streak = failed + 1, streak + 1
                    first_error = first_error or err
                    if isinstance(err, TeacherRefused) or failed > max(2, MAX_FAILED_SHARE * len(todo)):
                        raise
                    if streak >= give_up:
                        raise type(err)(f"{streak} states in a row got no answer from the teacher, none answered "
                                        f"between; labelling stopped (the last: {err})") from None
                    continue
                finally:
                    bar.update(1)
                streak = 0
                fh.write(b"".join(dumps(r) for r in rows))  # one write per state: whole states only
                fh.flush()
                done.setdefault(sid, []).extend(rows)
        except BaseException:
            for f in futures:
                f.cancel()
            if hasattr(teacher, "cancel"):  # the calls under way end now, not at their deadlines
                teacher.cancel()
            raise
    if stats is not None:
        stats.update(requests=len(todo), failed=failed)
    if todo and failed == len(todo):
        raise first_error
    if failed:
        log(f"warning: the teacher gave no answer for {failed} of {len(todo)} states (first: {first_error}); "
            "they are left out (run again to retry them)")
    current, wanted = {}, {_state_id(s) for s in states}
    for sid, rows in done.items():  # the latest row of each current question, for the states fully labelled
        if sid not in wanted:
            continue
        latest = {r["qid"]: r for r in rows if _current(r, questions)}
        if len(latest) == len(questions):
            current[sid] = [latest[q] for q in questions]
    return current


def _tune_rows(rows: list) -> list:
    return [{"state": r["state"], "question": r["question"], "probabilities": r["probabilities"],
             "dataset": "distill"} for r in rows]


def _write_jsonl(rows: list, path: Path) -> Path:
    path.write_bytes(b"".join(dumps(r) for r in rows))
    return path


def threshold_for(conf: np.ndarray, hits: np.ndarray, target: float) -> float:
    """The lowest confidence t such that the answers with confidence >= t (ties all in) agree with the teacher
    on at least ``target`` of them; 1.0 where none does."""
    order = np.argsort(-conf, kind="stable")
    c, h = conf[order], hits[order]
    share = np.cumsum(h) / np.arange(1, len(h) + 1)
    ends = np.nonzero(np.append(c[:-1] > c[1:], True))[0]  # last index of each run of equal confidences
    ok = ends[share[ends] >= target - 1e-12]
    return float(c[ok.max()]) if len(ok) else 1.0


def fit_gate(engine, questions: dict, held: dict, target: float) -> dict:
    """Per question, the gate reaching ``target`` agreement with the teacher on the held-out states ``held``
    ({state id: rows}); with the measured agreement and coverage."""
    per_question, per_key = {}, {}
    covered = agreed_covered = agreed_all = total = 0
    by_qid: dict = {qid: ([], []) for qid in questions}
    answered_by_state = []  # per held-out state, its questions' (confidence, qid)
    for rows in held.values():
        state = rows[0]["state"]
        answers = engine.ask(state, {r["qid"]: questions[r["qid"]] for r in rows if r["qid"] in questions})
        answered_by_state.append([(answers[q].certainty, q) for q in answers])
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
        conf = metrics.confidence(probs)
        hits = probs.argmax(1) == labels
        threshold = threshold_for(conf, hits, target)
        answered = conf >= threshold
        key = engine.question_key(questions[qid])
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
    thresholds = {qid: per_question[qid]["threshold"] for qid in per_question}
    all_local = sum(all(c >= thresholds[q] for c, q in pairs) for pairs in answered_by_state)
    return {"per_key": per_key, "default": 1.0, "target_agreement": target,
            "measured": {"held_out_questions": total, "agreement": agreed_all / total, "coverage": covered / total,
                         "agreement_covered": agreed_covered / covered if covered else None,
                         "states_all_local": all_local / len(answered_by_state),
                         "per_question": per_question}}


def distill(engine_dir: str | Path, teacher, states_path: str, questions_path: str, out: str | Path | None,
            target_agreement: float = 0.95, holdout: float = 0.2, config: TuneConfig = TuneConfig(),
            concurrency: int = 4, resume: bool = False, name: str | None = None, log=print,
            task: str | None = None) -> dict:
    """Label ``states`` with ``teacher``, tune ``engine_dir`` on its answers, fit the gate; the report. ``task``: the
    student is that tuned task, added beside ``engine_dir`` (``out`` None: the labels and report go beside the engine,
    in ``<engine>.<task>.distill``); its gate is measured and recorded in its card (a distilled engine's gate is what
    ``serve --teacher`` reads)."""
    from ...runtime.core.engine import Engine
    from ..tune.engine import adapter_at, tune

    if not 0.5 <= target_agreement < 1.0:
        raise InvalidRequest(f"--target-agreement must be within [0.5, 1), got {target_agreement}")
    if not 0.0 < holdout < 1.0:
        raise InvalidRequest(f"--holdout must be between 0 and 1, got {holdout}")
    if task is not None:
        out = Path(engine_dir).with_name(f"{Path(engine_dir).name}.{task}")
    out = Path(out)
    if task is None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OnepassError(f"{out} exists and is not an empty folder; give another --out")
    states, questions = read_states(states_path), read_questions(questions_path)
    base = Engine.load(engine_dir)
    base.check_counts(questions)
    _check_inputs(base, states, questions, config)  # before the teacher is paid for any of them
    work = out.with_name(out.name + ".distill")
    labels_path = work / "labels.jsonl"
    stats: dict = {}
    labelled = label(teacher, states, questions, labels_path, concurrency, log, stats)
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
    if task is not None:
        return _distill_task(engine_dir, task, teacher, train, {sid: labelled[sid] for sid in held_ids}, questions,
                             target_agreement, config, log) | {
            "states": len(states), "labelled_states": len(ids), "teacher_requests": stats.get("requests", 0),
            "failed_states": stats.get("failed", 0), "train_states": len(train_ids), "held_out_states": len(held_ids),
            "labels": str(labels_path)}
    student_dir = work / "engine"  # tuned and gated here, then moved to `out` whole
    summary = _tuned(student_dir, train)
    if summary is None:
        shutil.rmtree(student_dir, ignore_errors=True)
        log(f"tuning on the teacher's answers for {len(train_ids)} states; {len(held_ids)} held out")
        summary = tune(engine_dir, [train], student_dir, dataclasses.replace(config, holdout=holdout),
                       resume=resume, name=name or f"{base.name}-distilled", log=log, validation=[held])
        summary = summary.get("tuning", {}).get("metrics", {})
    student = Engine.load(student_dir)
    gate = fit_gate(student, questions, {sid: labelled[sid] for sid in held_ids}, target_agreement)
    gate["teacher"] = teacher.name
    manifest = mf.load(student_dir, verify=False)
    mf.write(student_dir, dataclasses.replace(adapter_at(manifest, out), gate=gate))  # its adapter files, at `out`
    os.replace(student_dir, out)
    measured = gate["measured"]
    report = {"teacher": teacher.name, "states": len(states), "labelled_states": len(ids),
              "teacher_requests": stats.get("requests", 0), "failed_states": stats.get("failed", 0),
              "train_states": len(train_ids), "held_out_states": len(held_ids),
              "target_agreement": target_agreement, "agreement": measured["agreement"],
              "coverage_at_target": measured["coverage"], "agreement_covered": measured["agreement_covered"],
              "requests_saved": measured["states_all_local"], "per_question": measured["per_question"],
              "labels": str(labels_path), "tuning": summary}
    report_dir = out.with_name(out.name + "-report")
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "distill.json").write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")
    report["report"] = str(report_dir / "distill.json")
    return report


def _distill_task(engine_dir, task: str, teacher, train: Path, held: dict, questions: dict, target: float,
                  config: TuneConfig, log) -> dict:
    """The student as a tuned task of ``engine_dir``: tuned on ``train`` (tune --task), its agreement with the teacher
    and gate measured on the ``held`` states and recorded in its card."""
    from ...runtime.core import task_store
    from ...runtime.core.engine import Engine
    from ...runtime.core.questions import with_task
    from ..tune.task import tune_task

    log(f"tuning the task {task!r} on the teacher's answers; {len(held)} states held out for the gate")
    tune_task(engine_dir, [train], task, config, log=log)
    with Engine.load(engine_dir) as student:
        gate = fit_gate(student, {qid: with_task(q, task) for qid, q in questions.items()}, held, target)
    gate["teacher"] = teacher.name
    task_store.update_card(engine_dir, task, {"distill": gate})
    measured = gate["measured"]
    return {"teacher": teacher.name, "task": task, "target_agreement": target, "agreement": measured["agreement"],
            "coverage_at_target": measured["coverage"], "agreement_covered": measured["agreement_covered"],
            "requests_saved": measured["states_all_local"], "per_question": measured["per_question"],
            "report": str(task_store.root_of(Path(engine_dir)) / task / task_store.CARD)}


def _check_inputs(engine, states: list, questions: dict, config: TuneConfig) -> None:
    """States tune would refuse, and questions that are one question twice, refused before any teacher call."""
    limit = min(config.max_state_tokens, engine.manifest.limits.max_state_tokens)
    for i, state in enumerate(states, 1):
        n = len(engine.encoder.state(state_text(state)))
        if n > limit:
            raise LimitExceeded(f"state {i} of --states ({state_text(state)[:40]!r}...) is {n} tokens; tuning "
                                f"takes at most {limit} (--max-state-tokens and the engine's limit): shorten it "
                                "or leave it out", "state")
    keys: dict = {}
    for qid, q in questions.items():
        key = engine.question_key(q)
        if key in keys:
            raise InvalidRequest(f"questions {keys[key]!r} and {qid!r} are the same question (type, instructions "
                                 "and options): ask it once", "questions")
        keys[key] = qid


def _tuned(student_dir: Path, train: Path) -> dict | None:
    """The tuning metrics of an engine an interrupted run tuned on this very training file, or None: whichever
    candidate tune wrote (tuned weights, a decision head, a calibrated base engine) records the data it chose on."""
    try:
        m = mf.load(student_dir, verify=True)
    except OnepassError:
        return None
    written = []  # (the data files a record names, what it measured)
    if m.tuning is not None:
        written.append((m.tuning.data, m.tuning.metrics))
    if m.head is not None:
        written.append((m.head.training.get("data", []), {"choice": m.head.training.get("choice")}))
    if m.calibration is not None and "tune" in m.calibration.source:
        choice = m.calibration.source["tune"]
        written.append((choice.get("data", []), {"choice": choice}))
    want = [mf.sha256_file(train)]
    return next((dict(metrics) for data, metrics in written if [f["sha256"] for f in data] == want), None)


def summary_lines(report: dict, out) -> list[str]:
    """What `onepass distill` prints."""
    covered = report["agreement_covered"]
    return [f"distilled {out} from {report['teacher']}: {report['labelled_states']} states labelled "
            f"({report['train_states']} trained on, {report['held_out_states']} held out)",
            f"held-out agreement with the teacher: {report['agreement']:.3f}",
            f"at the gate (target {report['target_agreement']:.2f}): {report['coverage_at_target']:.1%} of questions "
            f"answered locally" + (f", agreement {covered:.3f} there" if covered is not None else ""),
            (f"the gate is recorded in the task's card ({report['requests_saved']:.1%} of held-out states above it); "
             "serve --teacher gates the engine's own questions, not a task's" if report.get("task") else
             f"served with --teacher: {report['coverage_at_target']:.1%} of questions answered locally; "
             f"{report['requests_saved']:.1%} of requests need no teacher call (every question above the gate)"),
            f"report: {report['report']}; the teacher's labels stay in {report['labels']} (tune rows)"]

