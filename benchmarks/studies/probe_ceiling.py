"""How far above majority can SmolLM2-135M's features go on the held-out data sets, *with* their labels?

    python benchmarks/studies/probe_ceiling.py --engines engines/smollm2-base engines/smollm2

The target was the tuned default, zero-shot on held-out data sets, reaching majority + 15 points on
average. This measures the same held-out rows (``heldout_rows(150, 1)``, the rows of
``benchmarks/tune_eval.py default``) with an advantage zero-shot never has: a supervised linear read-out
fitted on labelled rows of each data set itself. Per data set, 5-fold cross-validation (each row is its own
state, so folds split whole states): an L2-regularised conditional-logit model over each option's final
hidden state (the row that predicts its end token, what the engine's head reads) plus its summed
log-likelihood, fitted by cross-entropy on 4 folds, scored on the fifth. The L2 strength is chosen by an
inner 4-fold split of the training folds only.

This is an evaluation of the model's capacity, not training: nothing fitted here is shipped, and no
held-out row reaches any training mixture. Writes benchmarks/studies/results/probe_ceiling.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from onepass.calibration.data.bigbench import Example
from onepass.calibration.heads.features import OptionFeatures, extract
from onepass.calibration.data.mixture import heldout_rows, write_jsonl
from onepass.calibration.measure.calibrate import load_rows
from onepass.runtime.backends.torch_backend import decoder_from_engine
from onepass.runtime.core import manifest as mf
from onepass.runtime.core.prompt import PromptEncoder

RESULTS = Path(__file__).parent / "results"
L2 = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def features(engine: Path, rows: list[dict]) -> OptionFeatures:
    manifest = mf.load(engine, verify=False)
    encoder = PromptEncoder(str(engine / manifest.tokenizer), manifest.prompt)
    exs = [Example(r["dataset"], r["dataset"], r["state"], r["question"], r["label"]) for r in rows]
    return extract(decoder_from_engine(engine, manifest), encoder, exs)


def design(f: OptionFeatures) -> np.ndarray:
    """Per option: its hidden state and summed log-likelihood, standardised, and its position among the options
    (one-hot, the eighth and later together)."""
    pos = np.concatenate([np.arange(f.offsets[i + 1] - f.offsets[i]) for i in range(f.num_questions)])
    values = np.concatenate([f.hidden, f.logprob[:, None]], 1)
    values = (values - values.mean(0)) / (values.std(0) + 1e-6)
    return np.concatenate([values, np.eye(8)[np.minimum(pos, 7)]], 1)


def padded(x: np.ndarray, f: OptionFeatures, qs: np.ndarray):
    """Options of the questions ``qs`` as [Q, Kmax, d] with a mask of real options, and the labels."""
    k = max(int(f.offsets[q + 1] - f.offsets[q]) for q in qs)
    out, mask = np.zeros((len(qs), k, x.shape[1])), np.zeros((len(qs), k), dtype=bool)
    for j, q in enumerate(qs):
        n = f.offsets[q + 1] - f.offsets[q]
        out[j, :n], mask[j, :n] = x[f.offsets[q]:f.offsets[q + 1]], True
    return torch.from_numpy(out), torch.from_numpy(mask), torch.from_numpy(f.label[qs])


def fit(x: np.ndarray, f: OptionFeatures, qs: np.ndarray, l2: float) -> np.ndarray:
    """Conditional-logit weights (w over the option's features) by L-BFGS on the questions ``qs``."""
    xt, mask, y = padded(x, f, qs)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        s = (xt @ w).masked_fill(~mask, float("-inf"))
        loss = torch.nn.functional.cross_entropy(s, y) + l2 * w.pow(2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return w.detach().numpy()


def accuracy(x, f, qs, w) -> float:
    s = x @ w
    return float(np.mean([s[f.offsets[q]:f.offsets[q + 1]].argmax() == f.label[q] for q in qs]))


def cv(x: np.ndarray, f: OptionFeatures, qs: np.ndarray, folds: int = 5, seed: int = 0) -> float:
    """Outer k-fold accuracy; the L2 strength chosen on an inner split of each training part."""
    qs = np.random.default_rng(seed).permutation(qs)
    accs = []
    for k in range(folds):
        test, train = qs[k::folds], np.concatenate([qs[j::folds] for j in range(folds) if j != k])
        inner = [np.mean([accuracy(x, f, train[j::4], fit(x, f, np.setdiff1d(train, train[j::4]), l2))
                          for j in range(4)]) for l2 in L2]
        accs.append(accuracy(x, f, test, fit(x, f, train, L2[int(np.argmax(inner))])))
    return float(np.mean(accs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", type=Path, default=[Path("engines/smollm2-base"), Path("engines/smollm2")])
    ap.add_argument("--rows", type=int, default=150)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "heldout.jsonl"
        write_jsonl(heldout_rows(args.rows, 1), path)
        rows = load_rows(path)
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": args.rows, "engines": {}}
    for engine in args.engines:
        print(f"features of {engine}", file=sys.stderr, flush=True)
        f = features(engine, rows)
        x = design(f)
        out = {}
        for name in sorted(set(f.task.tolist())):
            qs = np.flatnonzero(f.task == name)
            zero = float(np.mean([(f.logprob[f.offsets[q]:f.offsets[q + 1]]).argmax() == f.label[q] for q in qs]))
            out[name] = {"rows": int(len(qs)), "majority": float(np.bincount(f.label[qs]).max() / len(qs)),
                         "zero_shot_sum": zero, "probe_cv": cv(x, f, qs)}
            print(f"  {name}: {out[name]}", file=sys.stderr, flush=True)
        report["engines"][str(engine)] = out
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "probe_ceiling.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "probe_ceiling.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = [f"# Supervised read-out ceiling on the held-out data sets ({report['when']})", "",
             "Per data set, 5-fold cross-validated accuracy of a linear conditional-logit read-out fitted on the "
             "data set's own labelled rows (final hidden state + summed log-likelihood + option position), "
             "against zero-shot (`sum` read-out) and majority. Not shipped: a measure of what the features hold. "
             "`python benchmarks/studies/probe_ceiling.py`.", "",
             "Reading: a linear read-out fitted on ~120 labelled rows is a lower bound on what supervision can "
             "get out of the model (`onepass tune` on a data set's own rows does better: `tune_user.md`), not an "
             "upper bound on tuning. It bounds what the features give a read-out that sees each data set's labels; "
             "a zero-shot answer sees none.", "",
             "| engine | data set | rows | majority | zero-shot | supervised probe (CV) | probe - majority |",
             "|---|---|---|---|---|---|---|"]
    for engine, sets in report["engines"].items():
        for name, r in sets.items():
            lines.append(f"| {engine} | {name} | {r['rows']} | {r['majority']:.3f} | {r['zero_shot_sum']:.3f} | "
                         f"{r['probe_cv']:.3f} | {r['probe_cv'] - r['majority']:+.3f} |")
        gain = np.mean([r["probe_cv"] - r["majority"] for r in sets.values()])
        lines.append(f"| {engine} | **mean** | | | | | **{gain:+.3f}** |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
