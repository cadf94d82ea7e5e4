"""The decision head as one of `onepass tune`'s candidates: the cheapest fit that learns from the hidden states.

The untuned engine already computes, for every option, the final-normed hidden state after reading it; with a few
dozen labelled rows a small head over those states (:class:`onepass.calibration.head.HeadModel`: ``beta * zero_shot +
head(h)``) separates what the zero-shot read-out does not (50 Rotten Tomatoes rows: 0.64 on 300 unseen states, where
calibrating the untuned engine gives 0.51 and tuning LoRA 0.56; ``benchmarks/results/head_candidate.md``). Its
features come from the same pass that scores the untuned candidates, so it costs tune a few seconds of fitting per run,
and it is judged as the others are: on rows it was not fitted on (cross-validated over whole states with few rows).
Its scores are divided by a temperature chosen on its own out-of-fold scores (:func:`temperature`), so that a head
that separates the classes is not judged out of the choice for the overconfidence of a fit to a few dozen rows. A
chosen head is exported into the graph (the engine's read-out becomes ``head``), as ``tune --method head`` does.
What is fitted is the average of ``SEEDS`` heads (seeds ``--seed`` and the next four), merged into one wider head
(:func:`merged`), tempered as one.
"""

from __future__ import annotations

import numpy as np
import torch

from . import head as hd
from .head_features import OptionFeatures

# Measured on 50 and 200 rows of BBC, Rotten Tomatoes, tweets and speeches (benchmarks/results/head_candidate.md):
# cross-entropy only, a narrow MLP, strong weight decay and a fixed number of epochs (no rows to stop early on).
CONFIG = hd.HeadConfig(width=16, rlcd_weight=0.0, lr=1e-3, weight_decay=0.1, epochs=60, batch=64, seed=0)


def option_features(rows: list[dict]) -> OptionFeatures:
    """The head's training view of scored rows that carry their ``features`` (:func:`candidates.scored_rows`)."""
    hidden = np.concatenate([r["features"][0] for r in rows]).astype(np.float32)
    mean = np.concatenate([r["features"][1] for r in rows]).astype(np.float64)
    sizes = [len(r["features"][1]) for r in rows]
    return OptionFeatures(hidden, mean, np.ones_like(mean), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                          np.array([r["label"] for r in rows], dtype=np.int64), np.array(["tune"] * len(rows)))


INNER_FOLDS = 3  # folds of whole states over a head's own training rows, for its temperature
TEMPERATURES = np.exp(np.linspace(np.log(0.25), np.log(20.0), 61))  # the grid a temperature is chosen from


# Heads of SEEDS seeds averaged (merged into one head: :func:`merged`), one temperature chosen for the average.
# Measured at 50 rows of five data sets (benchmarks/results/head_seeds.md, 300 unseen states each, and the
# cross-validated NLL tune chooses by): see there; the fits take ~5x as long (seconds).
SEEDS = 5


def fit(rows: list[dict], seed: int = 0, seeds: int = SEEDS) -> hd.HeadModel:
    """The average of the heads of seeds ``seed`` .. ``seed + seeds - 1`` fitted on ``rows`` (their labels: a
    teacher's distribution counts as its most probable option), merged into one head, its scores divided by the
    temperature the average's out-of-fold scores on ``rows`` ask for (:func:`temperature`): what the engine computes
    is what was judged."""
    return tempered(_averaged(rows, seed, seeds), temperature(rows, seed, seeds))


def merged(heads: list[hd.HeadModel]) -> hd.HeadModel:
    """One head whose scores are the mean of ``heads``' (same standardisation, widths side by side): its MLP stacks
    their hidden units and averages their output layers, its beta is their mean. Exact: the mean of ``beta_i * z +
    out_i(silu(inner_i(x)))`` is ``mean(beta) * z + (out / n)(silu(stacked inner(x)))``."""
    if len(heads) == 1:
        return heads[0]
    first, n = heads[0].head, len(heads)
    if any(h.head.inner is None or not torch.equal(h.head.shift, first.shift)
           or not torch.equal(h.head.scale, first.scale) for h in heads):
        raise ValueError("only MLP heads of one standardisation can be merged")
    model = hd.HeadModel(first.hidden_size, first.width * n, first.shift.numpy(), first.scale.numpy())
    with torch.no_grad():
        model.head.inner.weight.copy_(torch.cat([h.head.inner.weight for h in heads]))
        model.head.inner.bias.copy_(torch.cat([h.head.inner.bias for h in heads]))
        model.head.out.weight.copy_(torch.cat([h.head.out.weight for h in heads], dim=1) / n)
        model.head.out.bias.copy_(torch.stack([h.head.out.bias for h in heads]).mean(0))
        model.beta.copy_(torch.stack([h.beta for h in heads]).mean())
    return model.eval()


def _averaged(rows: list[dict], seed: int, seeds: int) -> hd.HeadModel:
    """The heads of seeds ``seed`` .. ``seed + seeds - 1`` fitted on ``rows``, merged (untempered)."""
    return merged([_train(rows, seed + k) for k in range(seeds)])


def _train(rows: list[dict], seed: int) -> hd.HeadModel:
    model, _ = hd.train(option_features(rows), None, hd.HeadConfig(**{**CONFIG.__dict__, "seed": seed}))
    return model.eval()


def temperature(rows: list[dict], seed: int = 0, seeds: int = 1) -> float:
    """The temperature of lowest NLL for scores of rows the head was not fitted on. A head fitted to a few dozen rows
    separates them far more surely than it separates others (its scores on its own rows would call for sharpening, on
    others for softening: 50 rows of speeches, NLL 0.92 with accuracy 0.58 where the calibrated base has 0.74 with
    0.54); so ``INNER_FOLDS`` heads (each the average of ``seeds`` seeds' heads, as :func:`fit` fits it), each fitted
    on the other folds of whole states, score the rest, and the temperature is chosen on those scores (1 where the
    rows are too few to fold)."""
    states = sorted({r["state"] for r in rows})
    if len(states) < 2 * INNER_FOLDS:
        return 1.0
    order = np.random.default_rng([seed, 45]).permutation(len(states))
    fold_of = {states[i]: k % INNER_FOLDS for k, i in enumerate(order)}
    scored = []
    for f in range(INNER_FOLDS):
        inside = [r for r in rows if fold_of[r["state"]] != f]
        scored += head_rows(_averaged(inside, seed, seeds), [r for r in rows if fold_of[r["state"]] == f])
    nll = [sum(-_log_softmax(np.asarray(r["scores"]) / t)[r["label"]] for r in scored) for t in TEMPERATURES]
    return float(TEMPERATURES[int(np.argmin(nll))])


def tempered(model: hd.HeadModel, t: float) -> hd.HeadModel:
    """``model`` with its scores divided by ``t`` (beta and the head's output layer scaled), in place."""
    with torch.no_grad():
        model.beta.div_(t)
        model.head.out.weight.div_(t)
        model.head.out.bias.div_(t)
    model.temperature = t
    return model


def _log_softmax(s: np.ndarray) -> np.ndarray:
    s = s - s.max()
    return s - np.log(np.exp(s).sum())


def head_rows(model: hd.HeadModel, rows: list[dict]) -> list[dict]:
    """``rows`` as the head engine scores them: each row's scores replaced by ``beta * mean + head(h)``."""
    with torch.no_grad():
        out = []
        for r in rows:
            hidden, mean = (torch.from_numpy(np.asarray(a)) for a in r["features"])
            scores = model(hidden.float(), mean.float()).double().tolist()
            out.append({**r, "scores": scores})
    return out
