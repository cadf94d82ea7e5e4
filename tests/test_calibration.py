"""Calibration: fitting, metrics against hand computations, manifest round trip, runtime application."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("scipy")

from onepass import Choice, Engine, Noul, Score  # noqa: E402
from onepass.calibration.scoring import metrics  # noqa: E402
from onepass.calibration.scoring.fit import fit, fit_group  # noqa: E402
from onepass.runtime.core.readout_calibration import Calibration, GroupCalibration, group_key  # noqa: E402
from onepass.runtime.core.errors import InvalidRequest  # noqa: E402
from onepass.runtime.core.manifest import SCHEMA_VERSION, Manifest, ModelInfo  # noqa: E402
from onepass.runtime.core.readout import option_scores, softmax  # noqa: E402


def _sample(rng, scores, true_scores):
    p = np.exp(true_scores - true_scores.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return np.array([rng.choice(len(row), p=row) for row in p])


@pytest.mark.parametrize("t_true", [0.5, 2.5])
def test_fitting_recovers_a_known_temperature(t_true):
    rng = np.random.default_rng(0)
    scores = rng.normal(0, 3, size=(6000, 4))
    labels = _sample(rng, scores, scores / t_true)
    got = fit_group(scores, labels, with_bias=False)
    assert got.temperature == pytest.approx(t_true, rel=0.08)
    control = fit_group(scores, _sample(rng, scores, scores), with_bias=False)  # labels drawn at T = 1
    assert control.temperature == pytest.approx(1.0, rel=0.08)


def test_fitting_recovers_a_yes_bias():
    rng = np.random.default_rng(1)
    scores = rng.normal(0, 2, size=(6000, 2))
    labels = _sample(rng, scores, scores + np.array([1.5, 0.0]))
    got = fit_group(scores, labels, with_bias=True)
    assert got.temperature == pytest.approx(1.0, rel=0.1)
    assert got.bias[0] == pytest.approx(1.5, abs=0.15) and got.bias[1] == 0.0


def test_groups_and_minimum_rows():
    assert [group_key("noul", 2), group_key("choice", 2), group_key("choice", 4), group_key("choice", 7),
            group_key("choice", 12), group_key("score", 3)] == ["noul", "choice/2", "choice/3-4", "choice/5-8",
                                                                 "choice/9+", "score/3"]
    rows = [{"type": "choice", "scores": [0.0, 1.0, 2.0], "label": 2}] * 30 + [
        {"type": "score", "scores": [0.0, 1.0], "label": 0}] * 5
    cal = fit(rows, "mean")
    assert set(cal.groups) == {"choice/3-4"} and cal.groups["choice/3-4"].bias == ()


def test_a_question_group_biases_option_names_not_positions():
    rng = np.random.default_rng(2)
    names = ["negative", "neutral", "positive"]
    scores = rng.normal(0, 1, size=(300, 3)) + np.array([0.0, 0.0, 2.0])  # the model over-prefers "positive"
    labels = _sample(rng, scores, np.zeros_like(scores) + np.array([1.0, 0.5, 0.0]))  # truth prefers "negative"
    rows = [{"type": "choice", "scores": list(s), "label": int(y), "names": names, "qkey": "question/x"}
            for s, y in zip(scores, labels)]
    cal = fit(rows, "mean")
    group = cal.groups["question/x"]
    assert group.bias == () and group.option_bias["positive"] < group.option_bias["negative"]
    probe = np.array([0.1, 0.2, 0.3])
    shuffled = cal.apply("choice", probe[[2, 0, 1]], [names[i] for i in (2, 0, 1)], "question/x")
    np.testing.assert_allclose(shuffled, cal.apply("choice", probe, names, "question/x")[[2, 0, 1]])
    assert "choice/3-4" in cal.groups and cal.groups["choice/3-4"].option_bias == {}


def test_a_question_group_learns_a_confusion_matrix_when_it_wins_by_cross_validation():
    """The model swaps "sport" and "tech"; no temperature or bias can undo a swap, a matrix over names can."""
    rng = np.random.default_rng(3)
    names = ["business", "sport", "tech"]
    labels = rng.integers(0, 3, 400)
    swapped = np.array([0, 2, 1])[labels]
    scores = rng.normal(0, 0.5, size=(400, 3)) + 2.0 * np.eye(3)[swapped]
    rows = [{"type": "choice", "scores": list(s), "label": int(y), "names": names, "qkey": "question/x"}
            for s, y in zip(scores, labels)]
    cal = fit(rows, "mean")
    group = cal.groups["question/x"]
    assert group.matrix and group.matrix_names == tuple(names)
    probs = np.array([cal.apply("choice", s, names, "question/x") for s in scores])
    assert np.mean(probs.argmax(1) == labels) > 0.9 and np.mean(scores.argmax(1) == labels) < 0.4
    probe = np.array([0.3, 2.0, -0.5])  # order invariance: the matrix is indexed by name on both axes
    shuffled = cal.apply("choice", probe[[2, 0, 1]], [names[i] for i in (2, 0, 1)], "question/x")
    np.testing.assert_allclose(shuffled, cal.apply("choice", probe, names, "question/x")[[2, 0, 1]])
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_allclose(again.apply("choice", probe, names, "question/x"),
                               cal.apply("choice", probe, names, "question/x"))
    # control: without the swap, cross-validation keeps the simpler temperature + bias
    plain = [{**r, "scores": list(rng.normal(0, 0.5, 3) + 2.0 * np.eye(3)[r["label"]])} for r in rows]
    assert not fit(plain, "mean").groups["question/x"].matrix


def test_metrics_against_hand_computations():
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
    labels = np.array([0, 1, 1, 1])
    assert metrics.accuracy(probs, labels) == pytest.approx(0.75)
    assert metrics.brier(probs, labels) == pytest.approx((0.02 + 0.72 + 0.18 + 0.08) / 4)
    assert metrics.nll(probs, labels) == pytest.approx(-(np.log(0.9) + np.log(0.4) + np.log(0.7) + np.log(0.8)) / 4)
    # 15 bins: 0.9 -> bin 13 (hit), 0.6 -> bin 9 (miss), 0.7 -> bin 10 (hit), 0.8 -> bin 12 (hit)
    assert metrics.ece(probs, labels) == pytest.approx((0.1 + 0.6 + 0.3 + 0.2) / 4)
    curve = metrics.coverage_curve(probs, labels, steps=4)
    assert [c["accuracy"] for c in curve] == pytest.approx([1.0, 1.0, 1.0, 0.75])


def test_manifest_round_trip_with_calibration():
    cal = Calibration({"noul": GroupCalibration(1.7, (0.3, 0.0), rows=40), "choice/2": GroupCalibration(0.8, rows=25),
                       "question/0123456789abcdef": GroupCalibration(1.2, option_bias={"a": 0.5, "b": -0.5}, rows=30)},
                      "mean", {"rows": 95})
    m = Manifest(name="x", model=ModelInfo("llama", 1, 8, 2, 1, 4, 10, 64), tokenizer="t", graph="g", golden="h",
                 files={"t": "0", "g": "0", "h": "0"}, calibration=cal)
    again = Manifest.from_dict(json.loads(m.to_json()))
    assert again == m and again.schema_version == SCHEMA_VERSION == 6
    with pytest.raises(ValueError, match="temperature must be a positive"):
        GroupCalibration(temperature=0.0)


@pytest.mark.slow
def test_temperature_only_calibration_keeps_every_argmax(engine):
    groups = {k: GroupCalibration(t) for k, t in (("noul", 3.0), ("choice/3-4", 0.4), ("score/3", 5.0))}
    readout = engine.manifest.scoring.readout
    calibrated = Engine(engine.root, dataclasses.replace(engine.manifest, calibration=Calibration(groups, readout)),
                        engine.backend)
    questions = {"a": Noul("Is the customer angry?"),
                 "b": Choice("Which team?", {"billing": None, "technical": None, "sales": None}),
                 "c": Score("How urgent?", ["Low", "Medium", "High"])}
    text = "I was charged twice and nobody answers. Fix it today!"
    plain, cal = engine.ask(text, questions), calibrated.ask(text, questions)
    assert (plain["a"].noul > 0.5) == (cal["a"].noul > 0.5) and plain["a"].noul != pytest.approx(cal["a"].noul)
    assert plain["b"].choice == cal["b"].choice and plain["b"].probabilities != cal["b"].probabilities
    assert np.argmax(list(plain["c"].probabilities.values())) == np.argmax(list(cal["c"].probabilities.values()))


@pytest.mark.slow
def test_abstain_flags_low_confidence_answers(engine):
    q = {"b": Choice("Which team?", {"billing": None, "technical": None, "sales": None}), "a": Noul("Angry?")}
    everything = engine.ask("Charged twice.", q, min_confidence=1.0)
    nothing = engine.ask("Charged twice.", q, min_confidence=0.0)
    assert all(a.abstained for a in everything.values()) and not any(a.abstained for a in nothing.values())
    assert everything["b"].choice == nothing["b"].choice and everything["b"].to_wire()["abstained"] is True
    assert "abstained" not in nothing["b"].to_wire()
    with pytest.raises(InvalidRequest, match="within 0..1"):
        engine.ask("Charged twice.", q, min_confidence=2.0)


def _review_rows(n: int, good: str, bad: str, dataset: str) -> list[dict]:
    """``n`` labelled rows of "Is the review positive?", alternating a good and a bad review."""
    return [{"state": f"Review {i}: " + (good if i % 2 == 0 else bad),
             "question": {"type": "noul", "instructions": "Is the review positive?"},
             "label": "yes" if i % 2 == 0 else "no", "dataset": dataset} for i in range(n)]


def test_calibrate_command_writes_the_manifest_and_a_report(tiny_engine_dir, tmp_path):
    """On the tiny Llama: what is checked (the fit lands in the manifest under the keys the engine asks with, the
    report's files) does not depend on the weights."""
    from test_engine import _copy_engine

    from onepass.calibration.measure.calibrate import calibrate

    copy = _copy_engine(tiny_engine_dir, tmp_path / "engine")
    rows = _review_rows(40, "I loved it, wonderful and fun.", "Awful, boring, I hated it.", "toy")
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    report = calibrate(copy, data, holdout=0.25, seed=3, report_dir=tmp_path / "report")
    assert report["before"]["all"]["rows"] == report["after"]["all"]["rows"] == 10
    loaded = Engine.load(copy)  # hashes still verify; the manifest carries the fit
    groups = loaded.manifest.calibration.groups
    assert groups["noul"].rows == 30 and len(groups) == 2  # the type group and this one question's group
    (qkey,) = set(groups) - {"noul"}
    assert qkey.startswith("question/") and groups[qkey].rows == 30
    # ask the calibrated engine: the answer is the question's own group applied by hand (the keys built at fit
    # time and at ask time agree; if they drifted apart, the type group would answer: the control below)
    q = Noul("Is the review positive?")
    encoded = loaded.encode_questions({"q": q})
    text = "Review 99: wonderful, fun, I loved it."
    lengths = np.array([len(o) for o in encoded[0].options], float)
    raw = option_scores(loaded.option_logprobs(text, encoded)[0], lengths, None, loaded.manifest.scoring.readout)
    own, by_type = groups[qkey].apply(raw, ["yes", "no"]), groups["noul"].apply(raw)
    got = loaded.ask(text, {"q": q})["q"].noul
    assert got == pytest.approx(softmax(own)[0], abs=1e-9)
    # control: change only the question's own group; the engine's answer follows it, away from the type group's
    moved = GroupCalibration(groups[qkey].temperature, option_bias={"yes": -60.0, "no": 0.0})  # towards no
    cal = dataclasses.replace(loaded.manifest.calibration, groups={**groups, qkey: moved})
    shifted = Engine(loaded.root, dataclasses.replace(loaded.manifest, calibration=cal), loaded.backend)
    now = shifted.ask(text, {"q": q})["q"].noul
    assert now == pytest.approx(softmax(moved.apply(raw, ["yes", "no"]))[0], abs=1e-9)
    assert abs(now - softmax(by_type)[0]) > 1e-3 and abs(now - got) > 1e-3
    for name in ("report.json", "report.md", "reliability.png", "coverage.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"state": "x", "question": {"type": "noul", "instructions": "y"}, "label": "maybe"}))
    with pytest.raises(InvalidRequest, match="bad.jsonl:1: .*yes/no"):
        calibrate(copy, bad)


@pytest.mark.slow
def test_every_calibration_kind_applied_through_the_engine_gives_the_hand_computed_probabilities(engine):
    """Calibration round trip for each kind, through Engine.ask, against the documented formulas applied by hand
    to the uncalibrated mean read-out: noul T + yes bias, choice T, score T + per-level bias, a question group's
    option-name bias, a question group's matrix. Controls: other instructions fall back to the type group, and
    reordered options keep each name's probability."""
    from onepass.runtime.core.readout_calibration import question_key

    text = "I was charged twice for my order and want the second payment back today."
    qs = {"n": Noul("Does the customer want money back?"),
          "c": Choice("Which team?", {"billing": None, "technical": None, "sales": None}),
          "s": Score("How urgent?", ["Low", "Medium", "High"]),
          "g": Choice("Who handles it?", {"billing": None, "technical": None, "sales": None}),
          "m": Choice("Refund or replacement?", {"refund": None, "replacement": None})}

    def key(q):
        names = engine.encoder.options(q)
        return question_key(q.type, engine.encoder.instructions(q), names)

    groups = {"noul": GroupCalibration(2.0, (0.7, 0.0)), "choice/3-4": GroupCalibration(0.5),
              "score/3": GroupCalibration(1.5, (0.2, -0.1, 0.4)), "choice/2": GroupCalibration(3.0),
              key(qs["g"]): GroupCalibration(1.3, option_bias={"billing": 1.0, "technical": -0.5}),
              key(qs["m"]): GroupCalibration(option_bias={"refund": 0.25, "replacement": -0.25},
                                             matrix_names=("refund", "replacement"),
                                             matrix=((1.2, 0.3), (-0.2, 0.9)))}
    readout = engine.manifest.scoring.readout  # the engine's own (sum or mean): calibration is fitted on it
    calibrated = Engine(engine.root, dataclasses.replace(engine.manifest, calibration=Calibration(groups, readout)),
                        engine.backend)
    encoded = engine.encode_questions(qs)
    raw = {qid: option_scores(lp, np.array([len(o) for o in e.options], float), None, readout)
           for qid, lp, e in zip(qs, engine.option_logprobs(text, encoded), encoded)}
    want = {"n": softmax(raw["n"] / 2.0 + np.array([0.7, 0.0])),
            "c": softmax(raw["c"] / 0.5),
            "s": softmax(raw["s"] / 1.5 + np.array([0.2, -0.1, 0.4])),
            "g": softmax(raw["g"] / 1.3 + np.array([1.0, -0.5, 0.0])),
            "m": softmax(np.array([[1.2, 0.3], [-0.2, 0.9]]) @ raw["m"] + np.array([0.25, -0.25]))}
    got = calibrated.ask(text, qs)

    def probs(a):
        return np.array([a.noul, 1 - a.noul]) if hasattr(a, "noul") else np.array(list(a.probabilities.values()))

    for qid in qs:
        np.testing.assert_allclose(probs(got[qid]), want[qid], rtol=0, atol=1e-9, err_msg=qid)
        assert np.abs(probs(got[qid]) - softmax(raw[qid])).max() > 1e-3, qid  # calibration changed it
    # control: the question group is keyed by instructions; other instructions get the type group (T = 0.5)
    other = {"o": Choice("Who handles this one?", {"billing": None, "technical": None, "sales": None})}
    lp = engine.option_logprobs(text, engine.encode_questions(other))[0]
    lengths = np.array([len(o) for o in engine.encode_questions(other)[0].options], float)
    np.testing.assert_allclose(probs(calibrated.ask(text, other)["o"]),
                               softmax(option_scores(lp, lengths, None, readout) / 0.5), atol=1e-9)
    # control: option order does not matter for name-keyed groups (bias and matrix)
    for qid, names in (("g", {"sales": None, "billing": None, "technical": None}),
                       ("m", {"replacement": None, "refund": None})):
        swapped = Choice(qs[qid].instructions, names)
        again = calibrated.ask(text, {qid: swapped})[qid].probabilities
        for name, p in got[qid].probabilities.items():
            assert again[name] == pytest.approx(p, abs=1e-4), (qid, name)


def _eval_rows(path) -> list[dict]:
    """12 rows of two questions (a review's polarity, a 3-way tone), written to ``path``."""
    rows = []
    for i, review in enumerate(_review_rows(6, "Lovely film, I enjoyed it.", "Dreadful film, I hated it.", "reviews")):
        rows.append(review)
        rows.append({"state": review["state"], "question": {"type": "choice", "instructions": "What is the tone?",
                                                            "criteria": {"warm": None, "cold": None, "neutral": None}},
                     "label": "warm" if i % 2 == 0 else "cold", "dataset": "tone"})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return rows


def test_eval_command_reports_accuracy_majority_coverage_and_confusion(tiny_engine_dir, tmp_path, capsys):
    """`onepass eval` on 12 rows of two questions: the numbers agree with the engine's own answers (accuracy
    and confusion recomputed here from engine.ask), the majority baseline is right, the files are written. On the
    tiny Llama: the report's arithmetic does not depend on the weights."""
    engine_dir = tiny_engine_dir
    from onepass.cli import main

    data = tmp_path / "rows.jsonl"
    rows = _eval_rows(data)
    assert main(["eval", "--engine", str(engine_dir), "--data", str(data), "--min-confidence", "0.0",
                 "--target-accuracy", "0.5", "--report", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    engine = Engine.load(engine_dir)
    hits, tone = 0, np.zeros((3, 3), int)
    for r in rows:
        q = {"q": Noul(r["question"]["instructions"]) if r["question"]["type"] == "noul"
             else Choice(r["question"]["instructions"], r["question"]["criteria"])}
        a = engine.ask(r["state"], q)["q"]
        guess = ("yes" if a.noul >= 0.5 else "no") if hasattr(a, "noul") else a.choice
        hits += guess == r["label"]
        if not hasattr(a, "noul"):
            names = ["warm", "cold", "neutral"]
            tone[names.index(r["label"]), names.index(guess)] += 1
    assert report["rows"] == 12 and report["all"]["accuracy"] == pytest.approx(hits / 12)
    assert report["all"]["majority"] == pytest.approx(0.5) and report["datasets"]["tone"]["rows"] == 6
    (confusion,) = [q["confusion"] for q in report["questions"].values() if q["instructions"] == "What is the tone?"]
    assert confusion == tone.tolist()
    assert report["all"]["at_min_confidence"]["coverage"] == 1.0
    assert (tmp_path / "out" / "eval.md").read_text().count("|") > 20
    assert (tmp_path / "out" / "plots" / "reliability.png").stat().st_size > 0
    assert "rows (" in capsys.readouterr().out
    assert (tmp_path / "out" / "plots" / "confusion.png").stat().st_size > 0


def _recalibrated_copy(src, dst, name: str):
    """A copy of the engine at ``src`` under another name, with temperatures that change every probability: a
    second engine whose numbers differ from the first's."""
    from test_engine import _copy_engine

    from onepass.runtime.core import manifest as mf

    copy = _copy_engine(src, dst)
    manifest = Engine.load(copy, backend="onnxruntime").manifest
    groups = {"noul": GroupCalibration(4.0, (1.5, 0.0)), "choice/3-4": GroupCalibration(0.3)}
    mf.write(copy, dataclasses.replace(manifest, name=name,
                                       calibration=Calibration(groups, manifest.scoring.readout)))
    return copy


def test_eval_compare_puts_two_engines_side_by_side_and_its_thresholds_feed_a_gate(tiny_engine_dir, tmp_path, capsys):
    """`onepass eval --compare DIR2`: the second engine's report is the one `onepass eval` gives it alone, beside the
    first (a different engine: different numbers, the control); the table and plots show both. Gate.from_eval takes
    each question's threshold for the target accuracy from the report; a question the report lacks keeps the
    default; a report without thresholds is refused. On the tiny Llama and a recalibrated, renamed copy of it."""
    from onepass.calibration.measure.evaluate import evaluate_engine
    from onepass.cli import main
    from onepass.runtime.core.cascade import Gate

    engine_dir = tiny_engine_dir
    second = _recalibrated_copy(engine_dir, tmp_path / "second", "llama-tiny-recalibrated")

    data = tmp_path / "rows.jsonl"
    _eval_rows(data)
    assert main(["eval", "--engine", str(engine_dir), "--data", str(data), "--target-accuracy", "0.9",
                 "--compare", str(second), "--report", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    alone = evaluate_engine(second, data, None, 0.9)
    for key in ("accuracy", "nll", "brier", "ece"):
        assert report["compare"]["all"][key] == pytest.approx(alone["all"][key], abs=1e-9)
    assert report["compare"]["questions"].keys() == report["questions"].keys()
    assert report["all"]["nll"] != pytest.approx(report["compare"]["all"]["nll"], abs=1e-3)
    table = (tmp_path / "out" / "eval.md").read_text()
    names = (Engine.load(engine_dir).name, Engine.load(second).name)
    assert f"Each cell: {names[0]} / {names[1]}." in table and "coverage at accuracy 0.9" in table
    a, b = report["all"]["accuracy"], report["compare"]["all"]["accuracy"]
    assert f"| all | 12 | 0.500 | {a:.3f} / {b:.3f} |" in table
    assert capsys.readouterr().out.count(" rows (") == 2

    engine = Engine.load(engine_dir)
    tone = Choice("What is the tone?", {"warm": None, "cold": None, "neutral": None})
    gate = Gate.from_eval(tmp_path / "out" / "eval.json", engine,
                          {"tone": tone, "polar": Noul("Is the review positive?"), "new": Noul("Unseen?")}, 0.5)
    by_instructions = {q["instructions"]: q["for_target_accuracy"]["min_confidence"]
                       for q in report["questions"].values()}
    for qid, instructions in (("tone", "What is the tone?"), ("polar", "Is the review positive?")):
        want = by_instructions[instructions]
        assert gate.threshold(qid) == (1.0 if want is None else want)
    assert gate.threshold("new") == 0.5 and "new" not in gate.per_question
    without = evaluate_engine(engine_dir, data)  # no --target-accuracy: no thresholds to take
    with pytest.raises(InvalidRequest, match="--target-accuracy"):
        Gate.from_eval(without, engine, {"tone": tone}, 0.5)


def test_coverage_at_a_target_accuracy_matches_a_hand_count():
    # confidences 0.8, 0.6, 0.2, 0.1 (two options: 2p - 1); right, right, wrong, right
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.55, 0.45]])
    labels = np.array([0, 0, 1, 0])
    assert metrics.coverage_at(probs, labels, 0.9) == {"coverage": 0.5, "min_confidence": pytest.approx(0.6)}
    assert metrics.coverage_at(probs, labels, 0.7)["coverage"] == 1.0  # 3 of 4 right overall
    assert metrics.coverage_at(probs, labels, 0.76)["coverage"] == 0.5  # the 3-row prefix is 2/3, the 4-row 3/4
    # control: the wrong row made the most confident one: no prefix reaches 0.9
    worst = np.array([[0.99, 0.01], [0.8, 0.2], [0.6, 0.4], [0.55, 0.45]])
    assert metrics.coverage_at(worst, np.array([1, 0, 0, 0]), 0.9) == {"coverage": 0.0, "min_confidence": None}


def test_calibrate_with_too_few_rows_names_the_groups_writes_nothing_and_exits_2(tiny_engine_dir, tmp_path):
    """20 rows, 15 of them training: no group reaches MIN_ROWS. The command names each skipped group with its rows
    and the minimum, leaves the manifest as it was and exits 2 (it used to write "groups": {} and say "written")."""
    import subprocess
    import sys

    from test_engine import _copy_engine

    from onepass.calibration.scoring.fit import MIN_ROWS

    copy = _copy_engine(tiny_engine_dir, tmp_path / "engine")
    manifest = (copy / "manifest.json").read_bytes()
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _review_rows(20, "Wonderful.", "Awful.", "toy")))
    proc = subprocess.run([sys.executable, "-m", "onepass", "calibrate", "--engine", str(copy), "--data", str(data)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"no group has the {MIN_ROWS} training rows" in proc.stderr and "noul (" in proc.stderr
    assert (copy / "manifest.json").read_bytes() == manifest
