"""Which block a tuned task's answer can be read at: tune's decision head fitted on block k's hidden states.

For each data set and row count (``tune_eval.user_rows``: the training rows of `benchmarks/tune_eval.py user` and 300
test rows of states never trained on; speeches: other speakers), the default engine's decoder (PyTorch fp32, the
scorer tune itself uses) runs every row once and keeps, after each block count k of ``DEPTHS``, what tune's head
candidate reads: per option the hidden state after it (the final norm applied to the residual stream at block k) and
its mean log-likelihood (the language-model head applied there: what an engine cut at block k computes). At each
depth, tune's head candidate (:func:`onepass.calibration.heads.candidate.fit`: the prior, five seeds merged, the
temperature from inner folds) is fitted on the training rows only and judged on the test rows: accuracy and NLL,
beside the full-depth head (k = the decoder's block count) and the zero-shot read-out of the full depth.

Writes benchmarks/results/depth_probe.{json,md}.

    python benchmarks/depth_probe.py --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tune_eval as te  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from onepass.calibration.heads import candidate as head_candidate  # noqa: E402
from onepass.calibration.tune.candidates import row_losses, scored_rows  # noqa: E402
from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.tune.config import TuneConfig  # noqa: E402
from onepass.calibration.tune.trainer import PackedScorer, encode_groups  # noqa: E402
from onepass.calibration.data.rows import group_by_state, load_rows  # noqa: E402
from onepass.export.model_source import engine_source, load_model  # noqa: E402
from onepass.runtime.backends.torch_decoder import PackedDecoder  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.prompt import PromptEncoder  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEPTHS = (6, 9, 12, 15, 18, 21, 24, 27)


def scored(scorer, encoder, rows: list[dict], limits) -> list[dict]:
    """``rows`` (tune_eval dicts) scored with features at every depth of ``DEPTHS``, as tune scores them."""
    with tempfile.TemporaryDirectory() as tmp:
        write_jsonl(rows, Path(tmp) / "rows.jsonl")
        loaded, _ = load_rows([Path(tmp) / "rows.jsonl"])
    chunks = encode_groups(group_by_state(loaded), encoder, TuneConfig(), limits)
    return scored_rows(scorer, chunks, encoder, features=True, depths=DEPTHS)


def judged(rows: list[dict]) -> dict:
    losses, hits = row_losses(rows, None)
    return {"accuracy": hits / len(rows), "nll": float(np.mean(losses))}


def run(scorer, encoder, limits, name: str, n: int, layers: int, log) -> dict:
    train_rows, test_rows = te.user_rows(name, n, 0)
    started = time.perf_counter()
    train, test = scored(scorer, encoder, train_rows, limits), scored(scorer, encoder, test_rows, limits)
    res = {"feature_s_per_row": (time.perf_counter() - started) / (len(train) + len(test)),
           "train_rows": len(train), "test_rows": len(test), "zero": judged(test),
           "majority": float(np.bincount([r["label"] for r in test]).max() / len(test)), "depths": {}}
    for depth in (*DEPTHS, None):
        started = time.perf_counter()
        model = head_candidate.fit(train, 0, depth=depth)  # read at its depth by head_rows too
        res["depths"][str(depth or layers)] = {**judged(head_candidate.head_rows(model, test)),
                                               "fit_s": time.perf_counter() - started}
        log(f"  {name}/{n} depth {depth or layers}: {res['depths'][str(depth or layers)]}")
    return res


def write_md(results: dict) -> None:
    layers = results["layers"]
    depths = [str(d) for d in (*DEPTHS, layers)]
    lines = [f"# Tune's decision head read at block k ({results['when']}, {results['cpu']})", "",
             f"Engine `{results['engine']}` ({layers} blocks), PyTorch fp32, tune's scorer. Per data set and row count: "
             "the training rows of `tune_eval.py user` (seed 0) and 300 test rows of other states (speeches: other "
             "speakers). At each depth k, tune's head candidate (`head_candidate.fit`: prior, 5 seeds, temperature from "
             "inner folds) fitted on the training rows over the hidden states and mean log-likelihoods read after k "
             f"blocks; k = {layers} is today's head. Accuracy (NLL) on the test rows; `zero`: the full-depth zero-shot "
             "read-out.", "",
             "| data set | rows | majority | zero | " + " | ".join(f"k={d}" for d in depths) + " |",
             "|---" * (len(depths) + 4) + "|"]
    for key, r in results["runs"].items():
        name, n = key.split("/")
        cells = [f"{r['depths'][d]['accuracy']:.3f} ({r['depths'][d]['nll']:.3f})" for d in depths]
        lines.append(f"| {name} | {n} | {r['majority']:.3f} | {r['zero']['accuracy']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Shallowest depth within one point of the full-depth head's accuracy, and within 0.01 of its NLL:",
              "", "| data set | rows | within 1 point | within 1 point and NLL +0.01 |", "|---|---|---|---|"]
    for key, r in results["runs"].items():
        name, n = key.split("/")
        full = r["depths"][str(layers)]
        acc = [int(d) for d in depths if r["depths"][d]["accuracy"] >= full["accuracy"] - 0.01]
        both = [int(d) for d in depths if r["depths"][d]["accuracy"] >= full["accuracy"] - 0.01
                and r["depths"][d]["nll"] <= full["nll"] + 0.01]
        lines.append(f"| {name} | {n} | {min(acc)} | {min(both)} |")
    lines += ["", f"    python benchmarks/depth_probe.py --engine {results['engine']}"]
    (RESULTS / "depth_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the engine tune would tune (the default: engines/smollm2)")
    ap.add_argument("--datasets", nargs="+", default=["rotten", "tweets_choice", "tweets_score", "speeches", "bbc"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[50, 200])
    ap.add_argument("--from-json", help="only write the markdown from this results file")
    args = ap.parse_args(argv)
    if args.from_json:
        write_md(json.loads(Path(args.from_json).read_text()))
        return 0
    torch.set_num_threads(2)
    engine_dir = Path(args.engine)
    base = mf.load(engine_dir, verify=False)
    encoder = PromptEncoder(str(engine_dir / base.tokenizer), base.prompt)
    decoder = PackedDecoder(load_model(*engine_source(base)).model).eval()
    scorer = PackedScorer(decoder, base.scoring.readout, torch.device("cpu"), False, 0)
    results = {**te._machine(), "engine": str(engine_dir), "layers": base.model.num_layers, "runs": {}}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for name in args.datasets:
        for n in args.sizes:
            results["runs"][f"{name}/{n}"] = run(scorer, encoder, base.limits, name, n, base.model.num_layers, log)
            (RESULTS / "depth_probe.json").write_text(json.dumps(results, indent=1) + "\n")
    write_md(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
