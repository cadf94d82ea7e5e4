"""The decision head fitted on its training rows with their options in other orders: an augmentation that keeps labels.

Issue 44 lists "augmentations that keep the label (option order permuted)" among the ways to learn more from 50 rows.
A choice question's options are listed in the prompt and branched in their order; the same question with the order
changed asks the same thing, with the same answer, and gives the head other hidden states of the same options. This
benchmark measures whether a head fitted on the 50 rows plus up to ``VARIANTS`` reorderings of each scores better on
unseen states (answered in the order the user wrote, as served) than the head fitted on the 50 rows alone.

Per choice data set, the pool of training rows and the 300 test rows of ``head_choice_folds`` (the same draws of 50
rows, ``tune_eval.user_rows(name, POOL, 0)``); the base engine's features of every pool row in each of its other
orders are computed once (cached beside ``head_seeds``'). An option keeps its name (its index in the user's order)
in every order, so the prior's per-option bias follows it. Each head is judged on the test rows and by tune's
cross-validated choice (folds of whole states, a state's reorderings in its fold, judged on the user's order only).
Writes benchmarks/studies/results/head_augment.{json,md}.

    python benchmarks/studies/head_augment.py --base engines/smollm2-base [--draws 6] [--cache /tmp/head-features]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
import head_candidate as bench  # noqa: E402
import head_choice_folds as hcf  # noqa: E402
import head_seeds as hs  # noqa: E402
import tune_eval as te  # noqa: E402

import numpy as np  # noqa: E402

from onepass.calibration.heads import candidate as hc  # noqa: E402
from onepass.calibration.tune.candidates import RULE  # noqa: E402
from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.data.rows import load_rows  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DATASETS = ("tweets_choice", "speeches", "bbc")  # choice questions: the ones whose options have an order to change
VARIANTS = 5  # other orders per row at most (all of them for 3 options or fewer, else this many drawn)


def _orders(k: int, rng) -> list[tuple]:
    """The other orders of ``k`` options a row is augmented with (each a tuple: new position -> user's index)."""
    if k < 2:
        return []
    others = [p for p in itertools.permutations(range(k)) if p != tuple(range(k))] if k <= 4 else []
    if others and len(others) <= VARIANTS:
        return others
    seen = set()
    while len(seen) < VARIANTS:
        p = tuple(int(i) for i in rng.permutation(k))
        if p != tuple(range(k)):
            seen.add(p)
    return sorted(seen)


def _variant_features(base: str, name: str, cache: Path) -> dict:
    """The pool rows' features in their other orders (computed once, then read from ``cache``)."""
    path = cache / f"{name}_{hcf.POOL}_orders.npz"
    if not path.exists():
        from onepass.export.model_source import engine_source, load_model
        from onepass.runtime.backends.torch_decoder import PackedDecoder
        from onepass.runtime.core import manifest as mf
        from onepass.runtime.core.prompt import PromptEncoder

        m = mf.load(base, verify=False)
        encoder = PromptEncoder(str(Path(base) / m.tokenizer), m.prompt)
        decoder = PackedDecoder(load_model(*engine_source(m)).model).eval()
        pool, _ = te.user_rows(name, hcf.POOL, 0)
        rng = np.random.default_rng([44, 7])
        rows, source, orders = [], [], []
        for i, r in enumerate(pool):
            criteria = list(r["question"]["criteria"].items())
            for p in _orders(len(criteria), rng):
                rows.append({**r, "question": {**r["question"], "criteria": dict(criteria[j] for j in p)}})
                source.append(i)
                orders.append(p)
        with tempfile.TemporaryDirectory() as tmp:
            write_jsonl(rows, Path(tmp) / "orders.jsonl")
            parsed, _ = load_rows([Path(tmp) / "orders.jsonl"])
            feats, _ = bench.features(decoder, encoder, parsed)
        cache.mkdir(parents=True, exist_ok=True)
        np.savez(path, h=feats.hidden, lp=feats.logprob, len=feats.length, off=feats.offsets, y=feats.label,
                 type=np.array([r.question.type for r in parsed]), source=np.array(source),
                 order=np.array([",".join(map(str, p)) for p in orders]))
    return dict(np.load(path))


def _variant_rows(v: dict, name: str) -> dict[int, list[dict]]:
    """Per pool row, its rows in the other orders; an option's name is its index in the user's order."""
    off, mean = v["off"], v["lp"] / v["len"]
    out: dict[int, list[dict]] = {}
    for i, (a, b) in enumerate(zip(off[:-1], off[1:])):
        order = [int(x) for x in str(v["order"][i]).split(",")]
        out.setdefault(int(v["source"][i]), []).append(
            {"type": str(v["type"][i]), "features": (v["h"][a:b], mean[a:b]), "scores": list(mean[a:b]),
             "label": int(v["y"][i]), "target": int(v["y"][i]), "names": [str(j) for j in order], "qkey": name,
             "state": f"tr{int(v['source'][i])}", "dataset": name})
    return out


def _augmented(rows: list[dict], variants: dict[int, list[dict]]) -> list[dict]:
    """``rows`` (pool rows) and each one's other orders."""
    return rows + [v for r in rows for v in variants[int(r["state"][2:])]]


def write_md(results: dict) -> None:
    """benchmarks/studies/results/head_augment.md from ``results``."""
    lines = [f"# The head fitted with its rows' options in other orders, 50 rows ({results['machine']['when']})", "",
             f"`benchmarks/studies/head_augment.py`: the draws of `head_choice_folds.py` ({results['draws']} draws of 50 "
             f"training rows per data set, 300 test rows of other states). head: fitted on the 50 rows (tune's head "
             f"candidate); head + orders: on the 50 rows and each in up to {VARIANTS} other option orders (every "
             "other order of 3 options or fewer). Test: the user's order. Choice: tune's cross-validated choice "
             f"({results['folds']} folds of whole states) among base, base + calibrate and the head, judged on the "
             "user's order; chosen below calibrate: draws whose chosen fit scored under base + calibrate on the test "
             "rows. Mean over the draws.", "",
             "| data set | base + calibrate | fit | test accuracy | test NLL | head chosen | chosen below calibrate | "
             "chosen: test accuracy | fit s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["datasets"].items():
        for fit, s in r["summary"].items():
            lines.append(f"| {name} | {r['calibrate']:.3f} | {fit} | {s['accuracy']:.3f} | {s['nll']:.3f} | "
                         f"{s['head_chosen']} | {s['below_calibrate']} | {s['chosen_accuracy']:.3f} | "
                         f"{s['seconds']:.1f} |")
    lines += ["", f"    python benchmarks/studies/head_augment.py --base engines/smollm2-base --draws {results['draws']}", ""]
    (RESULTS / "head_augment.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="engines/smollm2-base")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--folds", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "onepass-head-features")
    args = ap.parse_args(argv)
    results = {"machine": te._machine(), "draws": args.draws, "folds": args.folds, "rule": RULE, "datasets": {}}
    for name in args.datasets:
        d = hs._features(args.base, name, hcf.POOL, args.cache)
        pool, test = hs._rows(d, "tr", name), hs._rows(d, "ts", name)
        variants = _variant_rows(_variant_features(args.base, name, args.cache), name)
        draws = []
        for seed in range(args.draws):
            picked = np.random.default_rng([seed, 50]).choice(len(pool), hcf.ROWS, replace=False)
            train = [pool[i] for i in sorted(picked)]
            calibrate = hs._judged(hs._calibrate(train, test))
            draw = {"calibrate": calibrate, "fits": {}}
            for fit, rows in (("head", train), ("head + orders", _augmented(train, variants))):
                started = time.perf_counter()
                judged = hs._judged(hc.head_rows(hc.fit(rows, seed), test))
                seconds = time.perf_counter() - started
                chosen, found = hcf._choice(train, args.folds, seed, (lambda inside: inside) if fit == "head"
                                            else (lambda inside: _augmented(inside, variants)))
                chosen = chosen["now"]
                draw["fits"][fit] = {"test": judged, "seconds": seconds, "chosen": chosen, "candidates": found,
                                     "chosen_test": judged if chosen == "head" else
                                     (calibrate if chosen == "base+calibrate" else hs._judged(test))}
            draws.append(draw)
            print(name, seed, round(calibrate["accuracy"], 3),
                  {f: (round(v["test"]["accuracy"], 3), v["chosen"]) for f, v in draw["fits"].items()}, flush=True)
        summary = {}
        for fit in ("head", "head + orders"):
            runs = [dr["fits"][fit] for dr in draws]
            summary[fit] = {"accuracy": float(np.mean([x["test"]["accuracy"] for x in runs])),
                            "nll": float(np.mean([x["test"]["nll"] for x in runs])),
                            "head_chosen": sum(x["chosen"] == "head" for x in runs),
                            "below_calibrate": sum(x["chosen_test"]["accuracy"] < dr["calibrate"]["accuracy"] - 1e-9
                                                   for x, dr in zip(runs, draws)),
                            "chosen_accuracy": float(np.mean([x["chosen_test"]["accuracy"] for x in runs])),
                            "seconds": float(np.mean([x["seconds"] for x in runs]))}
        results["datasets"][name] = {"calibrate": float(np.mean([dr["calibrate"]["accuracy"] for dr in draws])),
                                     "draws": draws, "summary": summary}
        (RESULTS / "head_augment.json").write_text(json.dumps(results, indent=2) + "\n")
        write_md(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
