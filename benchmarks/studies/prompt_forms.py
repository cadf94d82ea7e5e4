"""Prompt forms side by side (issue 46): packed tokens, GFLOP and time of the README ticket's pass, and accuracy
on rows neither engine's adapter was trained on and on the data sets the adapters may be trained on.

``--chat`` is an engine whose adapter was trained in the ``chat`` form (each question closes the user's turn and
opens the assistant's, under a hint such as "Answer yes or no."; `--adapter default-chat`, the default engine until
2026-12-06); ``--compact`` one whose adapter was trained in the ``compact`` form (``prompt.FORMS``: the question
stays in the user's turn and ends "Answer:", no hint that only repeats the options; the default engine since).
Each engine answers in the form its adapter was trained in, so the comparison is of the whole product: form and
adapter. ``--also NAME=DIR`` adds more engines in the compact form (an adapter trained in the chat form and asked in
the compact one, a retrained one).

* Work: the 13 questions over a 511-token state, one pass: packed tokens (per question), read-outs, GFLOP by part
  (``roofline.pass_flops``).
* Time: the 13 questions on the README ticket, warm (the state cached) and cold (no cache), both engines on the
  default backend, interleaved round by round after a warm-up round; medians.
* Accuracy: ``--heldout`` rows (``python -m onepass.calibration.data.mixture --heldout``: Rotten Tomatoes as sentiment
  and as plot vs review, the generated ``compare`` family: held out of the mixture, never trained on by either
  adapter) and the test rows of ``--datasets`` (``tune_eval.user_rows``: the data sets a user's task is measured on;
  BBC, tweets and speeches are sources of the mixture, so their test states are checked against ``--mixture``).
  Per data set, each engine through its own read-out and calibration: accuracy, balanced accuracy (the mean of the
  per-class recalls: a constant answer scores 1/K however skewed the labels), ROC AUC of two-option margins, NLL;
  then accuracy and NLL after a calibration cross-fitted on these rows (5 folds: what a user's ``onepass calibrate``
  gives, and blind to a constant shift of one answer); and how often each engine's answer is the chat engine's.
  Over all rows, the paired difference of each engine's correct answers against the chat engine's, with its
  standard error.

Writes benchmarks/studies/results/prompt_forms.{json,md}.

    python benchmarks/studies/prompt_forms.py --chat engines/smollm2-chat --compact engines/smollm2 \
        --heldout build/heldout.jsonl --mixture build/mixture.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from latency import QUESTIONS, TICKET, interleaved, state_of_tokens  # noqa: E402
from roofline import gemm_shapes, pass_flops  # noqa: E402
from tune_eval import _auc, user_rows  # noqa: E402

import numpy as np  # noqa: E402

from onepass.calibration.tune.candidates import clustered_mean  # noqa: E402
from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.measure.calibrate import cross_fitted_probabilities, load_rows, probabilities, score_rows  # noqa: E402
from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.guarantee import cpu_model  # noqa: E402
from onepass.runtime.core.prompt import FORMS  # noqa: E402

RESULTS = Path(__file__).parent / "results"
THREADS = 2
DATASETS = ("bbc", "rotten", "tweets_choice", "tweets_score", "speeches")
KEPT_Z = 2  # accuracy is kept when neither paired difference is below zero by more than this many standard errors


def work(engine: Engine) -> dict:
    """Packed tokens, read-outs and GFLOP of the 13 questions over a 511-token state in one pass."""
    state = engine.state(state_of_tokens(engine, 512))
    batch = engine.pack(state, engine.encode_questions(QUESTIONS))
    n, readouts = batch.num_tokens, batch.readout_index.shape[0]
    flops = pass_flops(engine, gemm_shapes(engine), n, state.num_tokens, readouts)
    return {"state_tokens": state.num_tokens, "packed_tokens": n, "per_question": round(n / len(QUESTIONS), 1),
            "readouts": readouts, "gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
            "gflop_total": round(sum(flops.values()) / 1e9, 1)}


def training(m) -> dict:
    """How the engine's adapter was trained, from its manifest: rows, steps, the held-out split's best (the mixture's
    own held-out states: each adapter's split, not comparable across mixtures)."""
    t = m.tuning
    if t is None:
        return {}
    best = (t.metrics or {}).get("heldout_best") or {}
    return {"data": [f"{d.get('path')} ({d.get('rows')} rows)" for d in t.data or []], "rows": t.rows,
            "steps": t.steps, "best_step": best.get("step"), "heldout_accuracy": best.get("accuracy"),
            "heldout_nll": best.get("nll"), "heldout_rows": t.holdout_rows}


def speed(dirs: dict, rounds: int) -> dict:
    """Warm and cold seconds of the README ticket's 13 questions, the engines interleaved round by round."""
    warm = {name: Engine.load(d, threads=THREADS) for name, d in dirs.items()}
    cold = {name: Engine.load(d, threads=THREADS, cache_bytes=0) for name, d in dirs.items()}
    times = interleaved({f"{name} {kind}": lambda e=engines[name]: e.ask(TICKET, QUESTIONS)  # round 0 fills the caches
                         for name in dirs for kind, engines in (("warm", warm), ("cold", cold))}, rounds)
    backends = {name: f"{warm[name].backend.name} / {cold[name].backend.name}" for name in dirs}
    for engine in [*warm.values(), *cold.values()]:
        engine.close()
    return {"backend": "; ".join(f"{n}: {b}" for n, b in backends.items()),
            **{k: {"p50_s": round(statistics.median(v), 3), "min_s": round(min(v), 3)} for k, v in times.items()}}


def test_rows(heldout: str, datasets, seed: int, mixture: str | None) -> tuple[list[dict], dict]:
    """The held-out rows and each data set's test rows, and per data set how many of its rows ask about a state of
    the mixture."""
    rows = [json.loads(line) for line in Path(heldout).read_text().splitlines() if line.strip()]
    for name in datasets:
        rows += user_rows(name, 0, seed)[1]
    trained = ({json.loads(line)["state"] for line in Path(mixture).read_text().splitlines() if line.strip()}
               if mixture else set())
    in_mixture = {name: sum(r["state"] in trained for r in rows if r["dataset"] == name)
                  for name in dict.fromkeys(r["dataset"] for r in rows)} if mixture else {}
    return rows, in_mixture


def answers(engine_dir: str, path: Path) -> dict:
    """Each row's probabilities as the engine serves them and cross-fitted on these rows, with labels and data sets."""
    with Engine.load(engine_dir, threads=THREADS) as engine:
        scored = score_rows(engine, load_rows(path))
        cal = engine.manifest.calibration
        cal = cal if cal is not None and cal.readout == engine.manifest.scoring.readout else None
    probs, _, counts = probabilities(scored, cal)
    served = [p[:k] for p, k in zip(probs, counts)]
    return {"served": served, "calibrated": cross_fitted_probabilities(scored),
            "labels": [r["label"] for r in scored], "datasets": [r["dataset"] for r in scored]}


def metrics_of(probs: list, labels: np.ndarray) -> dict:
    """Accuracy, balanced accuracy, NLL and (two options) AUC of rows' probabilities."""
    guess = np.array([int(np.argmax(p)) for p in probs])
    recalls = [float((guess[labels == c] == c).mean()) for c in np.unique(labels)]
    out = {"accuracy": round(float((guess == labels).mean()), 3), "balanced": round(float(np.mean(recalls)), 3),
           "nll": round(float(-np.mean([np.log(max(p[y], 1e-12)) for p, y in zip(probs, labels)])), 3)}
    if all(len(p) == 2 for p in probs):
        out["auc"] = _auc(np.array([p[0] - p[1] for p in probs]), labels == 0)
        out["auc"] = None if out["auc"] is None else round(out["auc"], 3)
    return out


def accuracy(dirs: dict, rows: list[dict]) -> dict:
    """Per engine and data set: served and cross-fitted metrics, agreement with the first engine; over all rows, the
    paired difference of correct answers against the first engine (mean and standard error, the rows about one state
    taken together: several data sets ask about the same reviews and tweets)."""
    states = [r["state"] for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        write_jsonl(rows, path)
        got = {name: answers(d, path) for name, d in dirs.items()}
    first = next(iter(got))
    labels, sets = np.array(got[first]["labels"]), np.array(got[first]["datasets"])
    guess = {name: {kind: np.array([int(np.argmax(p)) for p in g[kind]]) for kind in ("served", "calibrated")}
             for name, g in got.items()}
    out = {}
    for name, g in got.items():
        per_set = {}
        for d in dict.fromkeys(sets.tolist()):
            sel = np.flatnonzero(sets == d)
            per_set[d] = {"rows": len(sel), "majority": round(float(np.bincount(labels[sel]).max() / len(sel)), 3),
                          "served": metrics_of([g["served"][i] for i in sel], labels[sel]),
                          "calibrated": metrics_of([g["calibrated"][i] for i in sel], labels[sel]),
                          "agrees": round(float((guess[name]["served"][sel] == guess[first]["served"][sel]).mean()),
                                          3)}
        paired = {}
        for kind in ("served", "calibrated"):
            right = {n: (guess[n][kind] == labels).astype(float) for n in (name, first)}
            mean, se = clustered_mean(right[name] - right[first], states)
            paired[kind] = {"difference": round(mean, 4), "se": round(se, 4)}
        out[name] = {"datasets": per_set, "paired": paired, "rows": len(labels)}
    return out


def _trained(name: str, t: dict) -> str:
    return (f"{name}: {t['rows']} rows from {', '.join(t['data'])}, {t['steps']} steps, best at step {t['best_step']} "
            f"(held-out accuracy {t['heldout_accuracy']:.3f}, NLL {t['heldout_nll']:.3f} on {t['heldout_rows']} rows)")


def markdown(res: dict) -> str:
    names = list(res["engines"])
    lines = [f"# Prompt forms side by side ({res['cpu']}, {THREADS} threads, {res['when']})", "",
             "Engines (chat in the chat form, the others in the compact form): " + "; ".join(
                 f"**{n}** `{res['engines'][n]['dir']}` ({res['engines'][n]['adapter']})" for n in names) + ".", "",
             "Training (each adapter's own held-out split of its own mixture, so not comparable across them): "
             + "; ".join(_trained(n, res["engines"][n]["training"]) for n in names if res["engines"][n]["training"])
             + ".", "",
             "## Work of one pass: the README's 13 questions over a 511-token state", "",
             "| form | packed tokens | per question | read-outs | GFLOP | block GEMMs | attention | read-out |",
             "|---|---|---|---|---|---|---|---|"]
    for n in names:
        w = res["engines"][n]["work"]
        g = w["gflop"]
        lines.append(f"| {n} | {w['packed_tokens']} | {w['per_question']} | {w['readouts']} | {w['gflop_total']} | "
                     f"{g['block GEMMs']} | {g['attention']} | {g['read-out']} |")
    s = res["speed"]
    lines += ["", f"## Time: the README ticket's 13 questions ({s['backend']}, medians of {res['rounds']} interleaved "
              "rounds after a warm-up; min in brackets)", "", "| form | warm s | cold s |", "|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {s[n + ' warm']['p50_s']} ({s[n + ' warm']['min_s']}) | "
                     f"{s[n + ' cold']['p50_s']} ({s[n + ' cold']['min_s']}) |")
    base = names[0]
    for n in names[1:]:
        lines.append(f"\n{n} against {base}: warm {s[base + ' warm']['p50_s'] / s[n + ' warm']['p50_s']:.2f}x, "
                     f"cold {s[base + ' cold']['p50_s'] / s[n + ' cold']['p50_s']:.2f}x faster.")
    lines += accuracy_markdown(res)
    lines += ["", "    " + res["command"]]
    return "\n".join(lines) + "\n"


def _cell(m: dict) -> str:
    auc = f", AUC {m['auc']:.3f}" if m.get("auc") is not None else ""
    return f"{m['accuracy']:.3f} ({m['balanced']:.3f}{auc})"


def accuracy_markdown(res: dict) -> list[str]:
    names = list(res["engines"])
    acc = {n: res["engines"][n]["accuracy"] for n in names}
    first = names[0]
    sets = list(acc[first]["datasets"])
    held = res.get("in_mixture", {})
    lines = ["", f"## Accuracy: `{res['heldout']}` (never trained on) and the test rows of "
             f"{', '.join(res['datasets'])}", "",
             "As served: accuracy (balanced accuracy, AUC of two-option margins). Majority: always the most frequent "
             "label. In mixture: rows whose state is a state of `--mixture` (the compact adapter's training mixture).",
             "",
             "| data set | rows | in mixture | majority | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for d in sets:
        a = acc[first]["datasets"][d]
        lines.append(f"| {d} | {a['rows']} | {held.get(d, '–')} | {a['majority']:.3f} | "
                     + " | ".join(_cell(acc[n]["datasets"][d]["served"]) for n in names) + " |")
    lines += ["", "Calibrated on these rows (5-fold cross-fitted): accuracy / NLL; and how often the answer as served "
              f"is the {first} engine's.", "",
              "| data set | " + " | ".join(f"{n} calibrated | {n} agrees" for n in names) + " |",
              "|---|" + "---|---|" * len(names)]
    for d in sets:
        cells = " | ".join(f"{acc[n]['datasets'][d]['calibrated']['accuracy']:.3f} / "
                           f"{acc[n]['datasets'][d]['calibrated']['nll']:.3f} | {acc[n]['datasets'][d]['agrees']:.3f}"
                           for n in names)
        lines.append(f"| {d} | {cells} |")
    lines += ["", f"Against {first}, over all {acc[first]['rows']} rows (paired: the share of rows answered correctly "
              f"minus the {first} engine's; one standard error, the rows about one state taken together):", ""]
    for n in names[1:]:
        p = acc[n]["paired"]
        kept = {k: p[k]["difference"] >= -KEPT_Z * p[k]["se"] for k in ("served", "calibrated")}
        verdict = ("accuracy kept" if all(kept.values()) else "accuracy not kept as served" if kept["calibrated"]
                   else "accuracy not kept")
        lines.append(f"- **{n}**: as served {p['served']['difference']:+.3f} ({p['served']['se']:.3f}), calibrated "
                     f"{p['calibrated']['difference']:+.3f} ({p['calibrated']['se']:.3f}): **{verdict}**")
    lines += ["", f"Kept: neither difference below zero by more than {KEPT_Z} standard errors."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chat", required=True, help="the engine whose adapter was trained in the chat form")
    ap.add_argument("--compact", required=True, help="the engine whose adapter was trained in the compact form")
    ap.add_argument("--also", nargs="*", default=[], metavar="NAME=DIR", help="more engines asking in the compact form")
    ap.add_argument("--heldout", required=True, help="JSONL rows neither adapter was trained on")
    ap.add_argument("--datasets", nargs="*", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--seed", type=int, default=0, help="of the data sets' test rows (tune_eval's)")
    ap.add_argument("--mixture", help="the training mixture's JSONL: its states are counted among the test rows")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "prompt_forms"))
    args = ap.parse_args(argv)
    dirs = {"chat": args.chat, "compact": args.compact, **dict(a.split("=", 1) for a in args.also)}
    res = {"cpu": cpu_model() or platform.machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "rounds": args.rounds, "heldout": args.heldout, "datasets": args.datasets, "engines": {},
           "command": "python benchmarks/studies/prompt_forms.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for name, d in dirs.items():
        with Engine.load(d, threads=THREADS) as engine:
            m = engine.manifest
            form = "chat" if name == "chat" else "compact"
            if m.prompt != FORMS[form]:
                raise SystemExit(f"{name} {d}: its prompt is not the {form} form ({m.prompt.question!r})")
            adapters = (m.source or {}).get("adapters") or []
            res["engines"][name] = {"dir": d, "work": work(engine), "training": training(m),
                                    "adapter": f"{len(adapters)} adapter(s), readout {m.scoring.readout}"}
    res["speed"] = speed(dirs, args.rounds)
    rows, res["in_mixture"] = test_rows(args.heldout, args.datasets, args.seed, args.mixture)
    for name, got in accuracy(dirs, rows).items():
        res["engines"][name]["accuracy"] = got
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
