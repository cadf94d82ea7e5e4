"""What the base model's features hold about the speeches task from 50 rows (issue 44's one missed target).

The speeches task (which party's 2012 convention a 500-character passage is from) is the one data set where a tuned
engine stays below majority + 10 points at 50 rows (tune_user.md: 0.583-0.593 against 0.623). This asks whether
any feature of the base engine would carry more than the one the decision head reads:

- ``option read-out``: the final-normed hidden state at each option's last read-out row (democrat minus
  republican), what ``--method head`` fits on;
- ``state mean, after block L``: the RMS-normalised residual stream after block L (0-indexed), averaged over
  the state's tokens (a bag-of-meaning of the passage, which the engine's graph does not output today).

Only the speakers of tune_user's *training* split (its seed-0 speaker shuffle; its test speakers are never read
here) are used: 700 passages, and 20 draws of 50 training passages from half of the speakers, tested on the
passages of the other half (speakers disjoint). A ridge classifier per feature, its penalty chosen by 5-fold
cross-validation over the training passages' speakers. Writes benchmarks/studies/results/speech_features.{json,md}.

    python benchmarks/studies/speech_features.py --engine engines/smollm2-base   # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from tune_eval import speech_passages  # noqa: E402

from onepass.calibration.heads.features import example_pass, last_readouts  # noqa: E402
from onepass.runtime.backends.torch_backend import decoder_from_engine  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.prompt import PromptEncoder  # noqa: E402
from onepass.runtime.core.questions import Choice  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LAYERS = (4, 8, 12, 16, 20, 24)
PENALTIES = (1.0, 10.0, 100.0, 1000.0, 10000.0)
QUESTION = Choice("At which party's convention was this speech given?", {"democrat": "the Democratic Party",
                                                                          "republican": "the Republican Party"})


@torch.inference_mode()
def features(engine: Path, passages: list[tuple]) -> dict:
    """Per passage: the option read-out difference and the state means after LAYERS."""
    manifest = mf.load(engine, verify=False)
    encoder = PromptEncoder(str(engine / manifest.tokenizer), manifest.prompt)
    decoder = decoder_from_engine(engine, manifest)
    captured = {}
    hooks = [decoder.blocks[layer].register_forward_hook(
        lambda mod, inp, out, layer=layer: captured.__setitem__(layer, out[0])) for layer in LAYERS]
    d = decoder.dims
    empty = [torch.zeros(d.num_kv_heads, 0, d.head_dim) for _ in range(2 * d.num_layers)]
    out = {"option read-out": [], **{f"state mean, after block {layer}": [] for layer in LAYERS}}

    class Example:
        def __init__(self, state):
            self.state, self.question = state, QUESTION

    for i, (text, _, _) in enumerate(passages):
        batch, _, hidden, _ = example_pass(decoder, encoder, Example(text), empty)
        rows = last_readouts(batch)
        out["option read-out"].append((hidden[rows[0]] - hidden[rows[1]]).numpy())
        n = len(encoder.state(text))
        for layer in LAYERS:
            x = captured[layer][:n]
            out[f"state mean, after block {layer}"].append((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
                                                           .mean(0).numpy())
        print(f"\r{i + 1}/{len(passages)}", end="", file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    print(file=sys.stderr)
    return {k: np.stack(v) for k, v in out.items()}


def ridge(x: np.ndarray, y: np.ndarray, penalty: float):
    """A ridge classifier on standardised features (the dual solve: rows << features); returns predict(x) -> 0/1."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    t = 2.0 * y - 1.0
    a = np.linalg.solve(((x - mu) / sd) @ ((x - mu) / sd).T + penalty * np.eye(len(x)), t - t.mean())
    w = ((x - mu) / sd).T @ a
    return lambda z: ((((z - mu) / sd) @ w + t.mean()) > 0).astype(int)


def chosen_penalty(x, y, groups) -> float:
    """The penalty with the best 5-fold accuracy over ``groups`` (speakers)."""
    names = np.unique(groups)
    np.random.default_rng(0).shuffle(names)
    scores = []
    for penalty in PENALTIES:
        acc = []
        for fold in np.array_split(names, 5):
            test = np.isin(groups, fold)
            if test.any() and len(set(y[~test])) == 2:
                acc.append(float((ridge(x[~test], y[~test], penalty)(x[test]) == y[test]).mean()))
        scores.append(np.mean(acc) if acc else 0.0)
    return PENALTIES[int(np.argmax(scores))]


def evaluate(feats: dict, y: np.ndarray, speakers: np.ndarray, rows: int, draws: int) -> dict:
    """Mean accuracy (and its standard error) of each feature over ``draws`` speaker-disjoint draws."""
    names = np.unique(speakers)
    acc = {"majority of the test passages (oracle)": [], "majority of the training rows": [],
           **{k: [] for k in feats}}
    for draw in range(draws):
        rng = random.Random(draw)
        order = list(names)
        rng.shuffle(order)
        trained = np.isin(speakers, order[:len(order) // 2])
        train = np.array(rng.sample(list(np.flatnonzero(trained)), rows))
        test = np.flatnonzero(~trained)
        acc["majority of the test passages (oracle)"].append(max(y[test].mean(), 1 - y[test].mean()))
        acc["majority of the training rows"].append(float((y[test] == int(y[train].mean() > 0.5)).mean()))
        for name, x in feats.items():
            penalty = chosen_penalty(x[train], y[train], speakers[train])
            acc[name].append(float((ridge(x[train], y[train], penalty)(x[test]) == y[test]).mean()))
    return {k: {"accuracy": float(np.mean(v)), "se": float(np.std(v) / np.sqrt(len(v)))} for k, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2-base")
    ap.add_argument("--passages", type=int, default=700)
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--draws", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    train, _ = speech_passages(random.Random(0))  # tune_user's seed-0 split: its test speakers are never read
    passages = random.Random(1).sample(train, args.passages)
    y = np.array([int(party == "democrat") for _, party, _ in passages])
    speakers = np.array([speaker for _, _, speaker in passages])
    result = {"engine": args.engine, "passages": args.passages, "speakers": len(set(speakers)), "rows": args.rows,
              "draws": args.draws, "accuracy": evaluate(features(Path(args.engine), passages), y, speakers,
                                                        args.rows, args.draws)}
    lines = [f"# Speeches from {args.rows} rows: what the base engine's features hold", "",
             f"{args.passages} passages of {result['speakers']} speakers of tune_user's training split (its test "
             f"speakers never read); {args.draws} draws of {args.rows} training passages from half the speakers, "
             "tested on the other half's passages; a ridge classifier per feature, penalty by 5-fold CV over the "
             "training speakers. Engine: " + args.engine + ".", "",
             "| feature | accuracy | SE |", "|---|---|---|"]
    lines += [f"| {k} | {v['accuracy']:.3f} | {v['se']:.3f} |" for k, v in result["accuracy"].items()]
    lines += ["", f"    python benchmarks/studies/speech_features.py --engine {args.engine}", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speech_features.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "speech_features.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
