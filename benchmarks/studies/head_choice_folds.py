"""How tune should choose between base + calibrate and the decision head from 50 rows: the rule and its folds.

Under ``lora_min_rows`` no LoRA run is trained and tune chooses among base, base + calibrate and the head by their
cross-validated NLL over whole states (``tune.choice.cross_validated_choice``). This benchmark measures, for 3, 5 and
10 folds and for two rules, what the choice picks and what the picked fit scores on states it never saw:

* ``lowest NLL``: the rule before (a dearer candidate must win by more than ``TIE``);
* ``now``: ``candidates.choose`` (the head is kept unless an untuned candidate is lower by more than ``HEAD_Z``
  standard errors of the per-row difference).

Per data set (``tune_eval.user_rows(name, POOL, 0)``: a pool of training rows and the 300 test rows of other states),
the base engine's features are computed once (``head_seeds._features``, cached). Then ``--draws`` samples of 50 rows
are drawn from the pool; on each, every fold count runs tune's own choice (``candidates.candidates``,
``candidates.choose``, ``head_candidate.fit`` per fold, ``tune.choice.state_folds``), and the three fits, each fitted on
the 50 rows, are judged on the test rows. Writes benchmarks/studies/results/head_choice_folds.{json,md}.

    python benchmarks/studies/head_choice_folds.py --base engines/smollm2-base [--draws 6] [--cache /tmp/head-features]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
import head_seeds as hs  # noqa: E402
import tune_eval as te  # noqa: E402

import numpy as np  # noqa: E402

from onepass.calibration.heads import candidate as hc  # noqa: E402
from onepass.calibration.tune.candidates import HEAD_Z, RULE, TIE, candidates, choose, paired_difference  # noqa: E402

RESULTS = Path(__file__).parent / "results"
POOL = 250  # training rows the draws are sampled from
ROWS = 50
FOLDS = (3, 5, 10)
RULES = ("lowest NLL", "now")


class _Chunk:
    """What ``state_folds`` reads of a chunk: its state's ids (one row per state here)."""

    def __init__(self, state: str):
        self.state_ids = (state,)


def lowest_nll(found: list) -> str:
    """The rule before: the lowest NLL, a dearer candidate winning by more than ``TIE``."""
    best = found[0]
    for c in found[1:]:
        if c.nll < best.nll - TIE:
            best = c
    return best.name


def _choice(train: list[dict], folds: int, seed: int, head_rows=lambda inside: inside) -> tuple[dict, dict]:
    """tune's cross-validated choice over ``folds`` folds of whole states: (the candidate each rule chooses, every
    candidate's cross-validated NLL and accuracy, and the paired standard error of head - base+calibrate); each
    fold's head is fitted on ``head_rows`` of its training rows (``head_augment``: with their other option orders)."""
    from onepass.calibration.tune.choice import state_folds

    fold_of = state_folds([_Chunk(r["state"]) for r in train], folds, seed)
    sets, heads = [], []
    for f in range(folds):
        inside = [r for r, k in zip(train, fold_of) if k != f]
        outside = [r for r, k in zip(train, fold_of) if k == f]
        sets.append((inside, outside, None, None))
        model = hc.fit(head_rows(inside), seed)
        heads.append((hc.head_rows(model, inside), hc.head_rows(model, outside)))
    found = candidates(sets, "mean", heads)
    by = {c.name: c for c in found}
    mean, se = (paired_difference(by["head"], by["base+calibrate"]) if "base+calibrate" in by
                else (float("nan"), float("nan")))
    return ({"lowest NLL": lowest_nll(found), "now": choose(found).name},
            {**{c.name: {"nll": c.nll, "accuracy": c.accuracy} for c in found},
             "difference": {"mean": -mean, "se": se}})  # head - (base + calibrate)


def _test(train: list[dict], test: list[dict], seed: int) -> dict:
    """Each candidate fitted on all of ``train``, judged on ``test``."""
    fits = {"base": test, "base+calibrate": hs._calibrate(train, test),
            "head": hc.head_rows(hc.fit(train, seed), test)}
    return {name: hs._judged(rows) for name, rows in fits.items()}


def _summary(draws: list[dict]) -> dict:
    """Per fold count and rule, over the draws: the chosen fits' mean test accuracy and NLL, how often the head was
    chosen and the chosen fit tested below base + calibrate; and the two fits' own test means."""
    out = {}
    for k in FOLDS:
        for rule in RULES:
            chosen = [d["test"][d["choice"][str(k)]["chosen"][rule]] for d in draws]
            cal = [d["test"]["base+calibrate"] for d in draws]
            out[f"{k}/{rule}"] = {
                "accuracy": float(np.mean([c["accuracy"] for c in chosen])),
                "nll": float(np.mean([c["nll"] for c in chosen])),
                "head_chosen": sum(d["choice"][str(k)]["chosen"][rule] == "head" for d in draws),
                "below_calibrate": sum(c["accuracy"] < b["accuracy"] - 1e-9 for c, b in zip(chosen, cal)),
                "seconds": float(np.mean([d["choice"][str(k)]["seconds"] for d in draws]))}
    for name in ("base+calibrate", "head"):
        out[name] = {"accuracy": float(np.mean([d["test"][name]["accuracy"] for d in draws])),
                     "nll": float(np.mean([d["test"][name]["nll"] for d in draws]))}
    return out


def write_md(results: dict) -> None:
    """benchmarks/studies/results/head_choice_folds.md from ``results``."""
    lines = [f"# How many folds the head-or-calibrate choice cross-validates over, {ROWS} rows "
             f"({results['machine']['when']})", "",
             f"`benchmarks/studies/head_choice_folds.py`: per data set, {results['draws']} draws of {ROWS} training rows "
             f"(from a pool of {POOL}, seeds 0..{results['draws'] - 1}), each judged on the same 300 test rows of "
             "other states. For each fold count, tune's own cross-validated choice among base, base + calibrate and "
             "the decision head, by each rule (lowest NLL: a dearer candidate must win by more than 1e-3, the rule "
             f"before; now: the head kept unless an untuned candidate is lower by more than {HEAD_Z:g} standard errors "
             "of the per-row difference), then the chosen fit, fitted on the 50 rows, on the test rows. Mean over "
             f"the draws; head chosen and below calibrate: draws of {results['draws']}; choice s: the choice's head "
             "fits per draw.", "",
             "| data set | majority | base + calibrate | head | folds | rule | head chosen | chosen below calibrate | "
             "chosen: test accuracy | chosen: test NLL | choice s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["datasets"].items():
        s = r["summary"]
        for k in FOLDS:
            for rule in RULES:
                c = s[f"{k}/{rule}"]
                lines.append(f"| {name} | {r['majority']:.3f} | {s['base+calibrate']['accuracy']:.3f} | "
                             f"{s['head']['accuracy']:.3f} | {k} | {rule} | {c['head_chosen']} | "
                             f"{c['below_calibrate']} | {c['accuracy']:.3f} | {c['nll']:.3f} | {c['seconds']:.0f} |")
    lines += ["", "Per draw: test accuracy of base + calibrate and of the head; per fold count the cross-validated NLL "
              "difference head - (base + calibrate) in standard errors of it (negative: the head lower), and the fit "
              "each rule chose (lowest NLL / now):", "",
              "| data set | draw | base + calibrate | head | " + " | ".join(f"{k} folds" for k in FOLDS) + " |",
              "|---|---|---|---|" + "---|" * len(FOLDS)]
    for name, r in results["datasets"].items():
        for i, d in enumerate(r["draws"]):
            cells = []
            for k in FOLDS:
                c = d["choice"][str(k)]
                diff = c["candidates"]["difference"]
                z = diff["mean"] / diff["se"] if diff["se"] > 0 else float("nan")
                cells.append(f"{z:+.1f} SE: " + " / ".join(c["chosen"][rule] for rule in RULES))
            lines.append(f"| {name} | {i} | {d['test']['base+calibrate']['accuracy']:.3f} | "
                         f"{d['test']['head']['accuracy']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "    python benchmarks/studies/head_choice_folds.py --base engines/smollm2-base --draws "
              f"{results['draws']}", ""]
    (RESULTS / "head_choice_folds.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="engines/smollm2-base")
    ap.add_argument("--datasets", nargs="+", default=list(hs.DATASETS), choices=hs.DATASETS)
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "onepass-head-features")
    args = ap.parse_args(argv)
    results = {"machine": te._machine(), "draws": args.draws, "rule": RULE, "datasets": {}}
    for name in args.datasets:
        d = hs._features(args.base, name, POOL, args.cache)
        pool, test = hs._rows(d, "tr", name), hs._rows(d, "ts", name)
        labels = [r["label"] for r in test]
        majority = max(labels.count(v) for v in set(labels)) / len(labels)
        draws = []
        for seed in range(args.draws):
            picked = np.random.default_rng([seed, 50]).choice(len(pool), ROWS, replace=False)
            train = [pool[i] for i in sorted(picked)]
            draw = {"rows": [int(i) for i in sorted(picked)], "test": _test(train, test, seed), "choice": {}}
            for k in FOLDS:
                started = time.perf_counter()
                chosen, found = _choice(train, k, seed)
                draw["choice"][str(k)] = {"chosen": chosen, "candidates": found,
                                          "seconds": time.perf_counter() - started}
            draws.append(draw)
            print(name, seed, {k: tuple(v["chosen"].values()) for k, v in draw["choice"].items()},
                  {k: round(v["accuracy"], 3) for k, v in draw["test"].items()}, flush=True)
        results["datasets"][name] = {"majority": majority, "draws": draws, "summary": _summary(draws)}
        (RESULTS / "head_choice_folds.json").write_text(json.dumps(results, indent=2) + "\n")
        write_md(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
