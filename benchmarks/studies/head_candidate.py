"""Fits over the untuned engine's hidden states at 50 and 200 rows: the evidence behind tune's head candidate.

For each data set and row count (``tune_eval.user_rows``: the same training rows and 300 test rows of other states
as `benchmarks/tune_eval.py user`), the base engine's decoder (PyTorch, fp32) runs every row once and keeps, per
option, the final-normed hidden state after it and its mean log-likelihood, and at the trunk's end (the "Answer:"
token) one hidden state per question. Fitted on the training rows only, judged by accuracy on the test rows:

* ``head w16 wd...``: the decision head of ``calibration/heads/head.py`` (``beta * mean + MLP(h)``, width 16, cross-entropy
  only, a fixed number of epochs); ``wd0.1 ep60`` is what ``calibration/heads/candidate.py`` fits;
* ``probe trunk``: a multinomial logistic regression on the trunk-end state (one weight vector per option position),
  L2 chosen by 5-fold cross-validation on the training rows, with (prior=True) or without the zero-shot scores as
  an offset.

Writes benchmarks/studies/results/head_candidate.{json,md}.

    python benchmarks/studies/head_candidate.py --base engines/smollm2-base
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
import tune_eval as te  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from onepass.calibration.heads import head as hd  # noqa: E402
from onepass.calibration.heads.features import OptionFeatures, extract  # noqa: E402
from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.data.rows import load_rows  # noqa: E402
from onepass.export.model_source import engine_source, load_model  # noqa: E402
from onepass.runtime.backends.torch_decoder import PackedDecoder  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.prompt import PromptEncoder  # noqa: E402

RESULTS = Path(__file__).parent / "results"
HEADS = [(16, 1e-2, 30), (16, 1e-1, 60)]  # (width, weight decay, epochs)
LAMBDAS = [1e-3, 1e-2, 1e-1, 1.0, 10.0]


def features(decoder, encoder, rows) -> tuple[OptionFeatures, np.ndarray]:
    """Per option the hidden state after it and its summed log-likelihood (tune's own extraction); per question the
    trunk-end state."""
    trunk = []
    feats = extract(decoder, encoder, rows, progress=False, trunks=trunk)
    return feats, np.stack(trunk).astype(np.float32)


def probe_fit(x, z, y, k: int, lam: float, prior: bool):
    """Multinomial logistic regression on standardised ``x`` (L2 ``lam``), the zero-shot log-probabilities ``z`` an
    offset weighted by a fitted beta where ``prior``; returns a function (x, z) -> probabilities."""
    mu, sd = x.mean(0), x.std(0) + 1e-3
    xs, zt, yt = torch.from_numpy((x - mu) / sd).double(), torch.from_numpy(z).double(), torch.from_numpy(y)
    w = torch.zeros(x.shape[1], k, dtype=torch.double, requires_grad=True)
    b = torch.zeros(k, dtype=torch.double, requires_grad=True)
    beta = torch.tensor(1.0 if prior else 0.0, dtype=torch.double, requires_grad=prior)
    opt = torch.optim.LBFGS([w, b] + ([beta] if prior else []), max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(beta * zt + xs @ w + b, yt) + lam * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lambda x2, z2: torch.softmax(beta * torch.from_numpy(z2).double()
                                        + torch.from_numpy((x2 - mu) / sd).double() @ w + b, 1).detach().numpy()


def probe_lambda(x, z, y, k: int, prior: bool, folds: int = 5) -> float:
    """The L2 weight of lowest 5-fold cross-validated NLL on the training rows."""
    order = np.random.default_rng(0).permutation(len(y))
    best = None
    for lam in LAMBDAS:
        nll = 0.0
        for f in range(folds):
            out = order[f::folds]
            inside = np.setdiff1d(order, out)
            p = probe_fit(x[inside], z[inside], y[inside], k, lam, prior)(x[out], z[out])
            nll -= np.log(p[np.arange(len(out)), y[out]] + 1e-12).sum()
        if best is None or nll < best[0]:
            best = (nll, lam)
    return best[1]


def run(decoder, encoder, name: str, n: int) -> dict:
    train, test = te.user_rows(name, n, 0)
    with tempfile.TemporaryDirectory() as tmp:
        write_jsonl(train, Path(tmp) / "train.jsonl")
        write_jsonl(test, Path(tmp) / "test.jsonl")
        tr, _ = load_rows([Path(tmp) / "train.jsonl"])
        ts, _ = load_rows([Path(tmp) / "test.jsonl"])
    started = time.perf_counter()
    ftr, xtr = features(decoder, encoder, tr)
    fts, xts = features(decoder, encoder, ts)
    res = {"feature_s_per_row": (time.perf_counter() - started) / (len(tr) + len(ts))}
    k = int(ftr.offsets[1] - ftr.offsets[0])
    ztr, zts = (np.log(np.stack(f.zero_shot_probabilities())) for f in (ftr, fts))
    accuracy = lambda p, labels: float(np.mean(np.argmax(p, 1) == labels))  # noqa: E731
    res["zero"] = accuracy(zts, fts.label)
    res["majority"] = float(np.bincount(fts.label).max() / len(fts.label))
    for width, wd, epochs in HEADS:
        model, _ = hd.train(ftr, None, hd.HeadConfig(width=width, rlcd_weight=0.0, lr=1e-3, weight_decay=wd,
                                                      epochs=epochs))
        res[f"head w{width} wd{wd} ep{epochs}"] = accuracy(np.stack(hd.probabilities(model, fts)), fts.label)
    for prior in (True, False):
        started = time.perf_counter()
        lam = probe_lambda(xtr, ztr, ftr.label, k, prior)
        res[f"probe trunk prior={prior}"] = accuracy(probe_fit(xtr, ztr, ftr.label, k, lam, prior)(xts, zts), fts.label)
        res[f"probe trunk prior={prior} lam"] = lam
        res[f"probe trunk prior={prior} fit_s"] = time.perf_counter() - started
    return res


def write_md(results: dict) -> None:
    methods = ["zero"] + [f"head w{w} wd{wd} ep{e}" for w, wd, e in HEADS] + [f"probe trunk prior={p}"
                                                                             for p in (True, False)]
    lines = [f"# Fits over the untuned engine's hidden states ({results['when']}, {results['cpu']})", "",
             "Base engine (no adapter), PyTorch fp32; per data set and row count the training rows of "
             "`tune_eval.py user` (seed 0) and 300 test rows of other states (speeches: other speakers). Accuracy on "
             "the test rows. head: `beta * mean + MLP(h)` over the hidden state after each option (cross-entropy "
             "only; `wd0.1 ep60` is tune's head candidate); probe trunk: logistic regression on the trunk-end state, "
             "L2 by 5-fold CV on the training rows, with or without the zero-shot scores as an offset.", "",
             "| data set | rows | majority | " + " | ".join(methods) + " |", "|---" * (len(methods) + 3) + "|"]
    for key, r in results["runs"].items():
        name, n = key.split("/")
        lines.append(f"| {name} | {n} | {te._fmt(r.get('majority'))} | "
                     + " | ".join(f"{r[m]:.3f}" for m in methods) + " |")
    lines += ["", "    python benchmarks/studies/head_candidate.py --base engines/smollm2-base"]
    (RESULTS / "head_candidate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="engine exported with --adapter none")
    ap.add_argument("--datasets", nargs="+", default=["rotten", "tweets_choice", "tweets_score", "speeches", "bbc"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[50, 200])
    ap.add_argument("--from-json", help="only write the markdown from this results file")
    args = ap.parse_args(argv)
    if args.from_json:
        write_md(json.loads(Path(args.from_json).read_text()))
        return 0
    torch.set_num_threads(2)
    base_dir = Path(args.base)
    base = mf.load(base_dir, verify=False)
    encoder = PromptEncoder(str(base_dir / base.tokenizer), base.prompt)
    decoder = PackedDecoder(load_model(*engine_source(base)).model).eval()
    results = {**te._machine(), "runs": {}}
    results["when"] = results.pop("when")
    for name in args.datasets:
        for n in args.sizes:
            results["runs"][f"{name}/{n}"] = run(decoder, encoder, name, n)
            (RESULTS / "head_candidate.json").write_text(json.dumps(results, indent=1) + "\n")
    write_md(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
