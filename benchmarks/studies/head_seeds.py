"""One head or the average of several seeds' heads: the evidence behind the head candidate's ``SEEDS``.

For each data set (``tune_eval.user_rows``: the 50 training rows and 300 test rows of other states that
`benchmarks/tune_eval.py user` uses), the base engine's decoder (PyTorch, fp32) runs every row once and keeps, per
option, the final-normed hidden state after it and its mean log-likelihood (``head_candidate.features``; cached in
``--cache``). Then, fitted on the training rows only:

* ``base+calibrate``: the temperature/bias calibration tune fits;
* ``head``: one head as ``calibration/heads/candidate.py`` fits it with one seed (tempered on its own out-of-fold
  scores);
* ``5 seeds``: the merged average of five such heads (seeds 0..4), what the head candidate fits now.

Each is judged on the test rows (accuracy, mean NLL) and by a 3-fold cross-validation over the training rows (what
tune's choice sees: every row answered by a fit that did not see it). Writes benchmarks/studies/results/head_seeds.{json,md}.

    python benchmarks/studies/head_seeds.py --base engines/smollm2-base [--cache /tmp/head-features]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
import head_candidate as bench  # noqa: E402
import tune_eval as te  # noqa: E402

import numpy as np  # noqa: E402

from onepass.calibration.heads import candidate as hc  # noqa: E402
from onepass.calibration.tune.candidates import calibrated, heldout_metrics  # noqa: E402
from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.data.rows import load_rows  # noqa: E402
from onepass.export.model_source import engine_source, load_model  # noqa: E402
from onepass.runtime.backends.torch_decoder import PackedDecoder  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.prompt import PromptEncoder  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DATASETS = ("rotten", "tweets_choice", "tweets_score", "speeches", "bbc")


def _features(base: str, name: str, n: int, cache: Path) -> dict:
    """The training and test rows' features of one data set (computed once, then read from ``cache``)."""
    path = cache / f"{name}_{n}.npz"
    if not path.exists():
        m = mf.load(base, verify=False)
        encoder = PromptEncoder(str(Path(base) / m.tokenizer), m.prompt)
        decoder = PackedDecoder(load_model(*engine_source(m)).model).eval()
        train, test = te.user_rows(name, n, 0)
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for tag, rows in (("tr", train), ("ts", test)):
                write_jsonl(rows, Path(tmp) / f"{tag}.jsonl")
                parsed, _ = load_rows([Path(tmp) / f"{tag}.jsonl"])
                feats, _ = bench.features(decoder, encoder, parsed)
                out.update({f"{tag}_h": feats.hidden, f"{tag}_lp": feats.logprob, f"{tag}_len": feats.length,
                            f"{tag}_off": feats.offsets, f"{tag}_y": feats.label,
                            f"{tag}_type": np.array([r.question.type for r in parsed])})
        cache.mkdir(parents=True, exist_ok=True)
        np.savez(path, **out)
    return dict(np.load(path))


def _rows(d: dict, tag: str, name: str) -> list[dict]:
    """Scored rows as tune's candidates read them (one state per row, as in tune_eval's user rows)."""
    off, mean = d[f"{tag}_off"], d[f"{tag}_lp"] / d[f"{tag}_len"]
    return [{"type": str(d[f"{tag}_type"][i]), "features": (d[f"{tag}_h"][a:b], mean[a:b]), "scores": list(mean[a:b]),
             "label": int(d[f"{tag}_y"][i]), "target": int(d[f"{tag}_y"][i]), "names": [str(k) for k in range(b - a)],
             "qkey": name, "state": f"{tag}{i}", "dataset": name}
            for i, (a, b) in enumerate(zip(off[:-1], off[1:]))]


def _calibrate(train: list[dict], test: list[dict]) -> list[dict]:
    c = calibrated(train, "mean")
    return [{**r, "scores": list(c.apply(r["type"], np.asarray(r["scores"]), r["names"], r["qkey"]))} for r in test] \
        if c else test


def _seeds(k: int):
    return lambda train, test: hc.head_rows(hc.fit(train, 0, seeds=k), test)


FITS = {"base+calibrate": _calibrate, "head": _seeds(1), "5 seeds": _seeds(5)}


def _judged(rows: list[dict]) -> dict:
    nll, hits = heldout_metrics(rows, None)
    return {"nll": nll / len(rows), "accuracy": hits / len(rows)}


def _cross_validated(rows: list[dict], fit, folds: int = 3) -> dict:
    order = np.random.default_rng(0).permutation(len(rows))
    judged = []
    for f in range(folds):
        out = set(order[f::folds].tolist())
        judged += fit([r for i, r in enumerate(rows) if i not in out], [r for i, r in enumerate(rows) if i in out])
    return _judged(judged)


def write_md(results: dict) -> None:
    lines = [f"# One head or the average of five seeds' heads, 50 rows ({results['machine']['when']})", "",
             "The base engine's hidden states (`benchmarks/studies/head_seeds.py`): fitted on the 50 training rows of "
             "`tune_eval.py user`, judged on its 300 test rows (other states) and by 3-fold cross-validation over the "
             "50 training rows (what tune's choice sees). head: one seed, tempered on its own out-of-fold scores; "
             "5 seeds: five such heads averaged (merged into one head of width 80), what tune's head candidate fits.",
             "", "| data set | fit | test accuracy | test NLL | cross-validated accuracy | cross-validated NLL | fit s |",
             "|---|---|---|---|---|---|---|"]
    for key, r in results["runs"].items():
        name, fit = key.split("/")
        lines.append(f"| {name} | {fit} | {r['test']['accuracy']:.3f} | {r['test']['nll']:.3f} | "
                     f"{r['cv']['accuracy']:.3f} | {r['cv']['nll']:.3f} | {r['seconds']:.1f} |")
    lines += ["", "    python benchmarks/studies/head_seeds.py --base engines/smollm2-base", ""]
    (RESULTS / "head_seeds.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="engines/smollm2-base")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "onepass-head-features")
    args = ap.parse_args(argv)
    results = {"machine": te._machine(), "runs": {}}
    for name in args.datasets:
        d = _features(args.base, name, 50, args.cache)
        train, test = _rows(d, "tr", name), _rows(d, "ts", name)
        for fit_name, fit in FITS.items():
            started = time.perf_counter()
            results["runs"][f"{name}/{fit_name}"] = {"test": _judged(fit(train, test)),
                                                     "cv": _cross_validated(train, fit),
                                                     "seconds": time.perf_counter() - started}
            print(name, fit_name, results["runs"][f"{name}/{fit_name}"], flush=True)
    (RESULTS / "head_seeds.json").write_text(json.dumps(results, indent=2) + "\n")
    write_md(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
