"""The decision head over the raw zero-shot read-out or over the calibrated one: the evidence behind ``Prior``.

For each data set (``tune_eval.user_rows``: the 50 (``--rows``) training rows and 300 test rows of other states that
`benchmarks/tune_eval.py user` uses), the base engine's decoder runs every row once and keeps, per option, the
final-normed hidden state after it and its mean log-likelihood (``head_seeds._features``, cached in ``--cache``). Then,
fitted on the training rows only:

* ``base+calibrate``: the temperature/bias calibration tune fits;
* ``head, raw read-out``: the head candidate as it was before (five seeds, tempered), adding its MLP to ``beta * z``
  where z are the untuned mean log-likelihoods;
* ``head, calibrated prior``: the head candidate now (``calibration/heads/candidate.py``: ``Prior``), adding it to the
  read-out calibrated on the same rows.

Each is judged on the test rows and by a 3-fold cross-validation over the training rows (what tune's choice sees).
``chosen``: what tune's rule (lowest cross-validated NLL; a dearer candidate must win by more than 1e-3) picks among
base, base+calibrate and that head, with the chosen candidate's test accuracy. Writes
benchmarks/studies/results/head_prior.{json,md}.

    python benchmarks/studies/head_prior.py --base engines/smollm2-base [--cache /tmp/onepass-head-features]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
import head_seeds as hs  # noqa: E402
import tune_eval as te  # noqa: E402

from onepass.calibration.heads import candidate as hc  # noqa: E402
from onepass.calibration.tune.candidates import TIE  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DATASETS = hs.DATASETS


def _raw(train: list[dict], test: list[dict]) -> list[dict]:
    with mock.patch.object(hc, "fit_prior", lambda rows: hc.Prior()):
        return hc.head_rows(hc.fit(train, 0), test)


def _prior(train: list[dict], test: list[dict]) -> list[dict]:
    return hc.head_rows(hc.fit(train, 0), test)


FITS = {"base": lambda train, test: test, "base+calibrate": hs._calibrate, "head, raw read-out": _raw,
        "head, calibrated prior": _prior}


def _chosen(runs: dict, head: str) -> str:
    """Tune's rule over base, base+calibrate and ``head`` by their cross-validated NLL."""
    best = "base"
    for name in ("base+calibrate", head):
        if runs[name]["cv"]["nll"] < runs[best]["cv"]["nll"] - TIE:
            best = name
    return best


def write_md(results: dict, stem: str) -> None:
    n = results["rows"]
    lines = [f"# The decision head over the raw or the calibrated read-out, {n} rows ({results['machine']['when']})",
             "", f"`benchmarks/studies/head_prior.py --rows {n}`: the base engine's hidden states, each fit on the {n} training "
             "rows of "
             "`tune_eval.py user`, judged on its 300 test rows (other states) and by 3-fold cross-validation over the "
             "training rows (what tune's choice sees). Both heads are five seeds' heads averaged and tempered on their "
             "own out-of-fold scores; they differ only in the offset their MLP adds to: the raw mean log-likelihoods "
             "(before) or the same calibrated on the training rows (`head_candidate.Prior`, now). fit s: the fit on "
             "the training rows and, where cross-validated, the three folds' fits (the 50-row run shared the 2 cores "
             "with another for all but BBC).", "",
             "| data set | fit | test accuracy | test NLL | cross-validated accuracy | cross-validated NLL | fit s |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results["runs"].items():
        for fit, r in runs.items():
            cv = f"{r['cv']['accuracy']:.3f} | {r['cv']['nll']:.3f}" if r["cv"] else "– | –"
            lines.append(f"| {name} | {fit} | {r['test']['accuracy']:.3f} | {r['test']['nll']:.3f} | {cv} | "
                         f"{r['seconds']:.1f} |")
    if any(r["cv"] is None for runs in results["runs"].values() for r in runs.values()) or \
            any(len(runs) < len(FITS) for runs in results["runs"].values()):
        lines += ["", f"    python benchmarks/studies/head_prior.py --base engines/smollm2-base --rows {n} "
                  f"--fits {' '.join(repr(f) for f in next(iter(results['runs'].values())))} --no-cv", ""]
        (RESULTS / f"{stem}.md").write_text("\n".join(lines))
        return
    lines += ["", "What tune's rule chooses among base, base + calibrate and the head (by cross-validated NLL), and the "
              "chosen fit's test accuracy:", "", "| data set | majority | raw read-out: chosen | test accuracy | "
              "calibrated prior: chosen | test accuracy |", "|---|---|---|---|---|---|"]
    for name, runs in results["runs"].items():
        a, b = _chosen(runs, "head, raw read-out"), _chosen(runs, "head, calibrated prior")
        lines.append(f"| {name} | {results['majority'][name]:.3f} | {a} | {runs[a]['test']['accuracy']:.3f} | {b} | "
                     f"{runs[b]['test']['accuracy']:.3f} |")
    lines += ["", f"    python benchmarks/studies/head_prior.py --base engines/smollm2-base --rows {n}", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="engines/smollm2-base")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--rows", type=int, default=50, help="training rows per data set (50 or 200 recorded)")
    ap.add_argument("--fits", nargs="+", default=list(FITS), choices=list(FITS))
    ap.add_argument("--no-cv", action="store_true", help="judge on the test rows only (200 rows: tune judges on one "
                    "held-out split there, not by cross-validation)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "onepass-head-features")
    args = ap.parse_args(argv)
    results = {"machine": te._machine(), "rows": args.rows, "runs": {}, "majority": {}}
    for name in args.datasets:
        d = hs._features(args.base, name, args.rows, args.cache)
        train, test = hs._rows(d, "tr", name), hs._rows(d, "ts", name)
        results["majority"][name] = te._majority([{"label": r["label"]} for r in test])
        runs = results["runs"].setdefault(name, {})
        for fit_name in args.fits:
            fit, started = FITS[fit_name], time.perf_counter()
            runs[fit_name] = {"test": hs._judged(fit(train, test)),
                              "cv": None if args.no_cv else hs._cross_validated(train, fit),
                              "seconds": time.perf_counter() - started}
            print(name, fit_name, runs[fit_name], flush=True)
    stem = "head_prior" if args.rows == 50 else f"head_prior_{args.rows}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    write_md(results, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
