"""The decision head as one of `onepass tune`'s candidates: the cheapest fit that learns from the hidden states.

The untuned engine already computes, for every option, the final-normed hidden state after reading it; with a few
dozen labelled rows a small head over those states (:class:`onepass.calibration.heads.head.HeadModel`: ``beta * zero_shot +
head(h)``) separates what the zero-shot read-out does not (50 Rotten Tomatoes rows: 0.64 on 300 unseen states, where
calibrating the untuned engine gives 0.51 and tuning LoRA 0.56; ``benchmarks/studies/results/head_candidate.md``). Its
features come from the same pass that scores the untuned candidates, so it costs tune a few seconds of fitting per run,
and it is judged as the others are: on rows it was not fitted on (cross-validated over whole states with few rows).
Its scores are divided by a temperature chosen on its own out-of-fold scores (:func:`temperature`), so that a head
that separates the classes is not judged out of the choice for the overconfidence of a fit to a few dozen rows. A
chosen head is exported into the graph (the engine's read-out becomes ``head``), as ``tune --method head`` does.
What is fitted is the average of ``SEEDS`` heads (seeds ``--seed`` and the next four), merged into one wider head
(:func:`merged`), tempered as one.

The head learns a correction of the *calibrated* zero-shot read-out, not of the raw one (:class:`Prior`:
the untuned read-out as a prior the fit shrinks towards): the base's option scores with the bias that calibrating
them on the same rows finds (a temperature and a bias per question, per level or on yes) are the offset its MLP adds
to. The raw read-out of a base model is often far from the label prior (tweets, 3 options: 0.16 zero-shot, 0.53
calibrated), and a head of 50 rows spent its capacity undoing that. Measured at 50 rows on five data sets
(``benchmarks/studies/results/head_prior.md``). The prior's bias folds into the engine exactly: the written head engine
carries it as a calibration of its ``head`` read-out (:func:`served`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ...runtime.core.readout_calibration import Calibration, GroupCalibration
from ..scoring.fit import fit as fit_calibration
from ..scoring.metrics import target_nll
from . import head as hd
from .features import OptionFeatures, distribution

# Measured on 50 and 200 rows of BBC, Rotten Tomatoes, tweets and speeches (benchmarks/studies/results/head_candidate.md):
# cross-entropy only, a narrow MLP, strong weight decay and a fixed number of epochs (no rows to stop early on).
CONFIG = hd.HeadConfig(width=16, rlcd_weight=0.0, lr=1e-3, weight_decay=0.1, epochs=60, batch=64, seed=0)


@dataclass(frozen=True)
class Prior:
    """What a head adds its correction to: per question, ``(z + T_g b_g) / scale``, where z are the options' mean
    log-likelihoods and ``T_g``, ``b_g`` the temperature and bias of the question's group in ``calibration`` (fitted
    on the head's own rows, never a matrix: :func:`fit_prior`). ``scale`` is the geometric mean of the temperatures
    of the rows' groups, so with one group (one question: a user's task) the prior is its calibrated read-out
    exactly; one scale for every question is what lets the bias fold into a calibration of the engine's ``head``
    read-out (:func:`served`), whose ``beta`` is one number."""

    calibration: Calibration | None = None
    scale: float = 1.0

    def apply(self, row: dict, z: np.ndarray) -> np.ndarray:
        """The prior of one row's options (``z``: their mean log-likelihoods)."""
        z = np.asarray(z, dtype=np.float64)
        group = _group_of(self.calibration, row, z.shape[0]) if self.calibration is not None else None
        if group is None:
            return z / self.scale
        calibrated = self.calibration.apply(row["type"], z, row["names"], row.get("qkey"))  # z / T + b
        return calibrated * group.temperature / self.scale  # (z / T + b) T / scale = (z + T b) / scale


def _group_of(calibration: Calibration, row: dict, k: int):
    """The group of ``calibration`` that calibrates ``row``'s question of ``k`` options (None: none)."""
    return calibration.group_of(row["type"], k, row.get("qkey"))[0]


def fit_prior(rows: list[dict]) -> Prior:
    """The prior of rows that carry their ``features``: their mean log-likelihoods calibrated on their labels
    (temperature and bias per group, as tune's base+calibrate candidate, but never a matrix, which could not fold into
    a bias); no group fitted (fewer than 20 rows of any): the raw read-out."""
    zero_shot = [{**r, "scores": list(np.asarray(r["features"][1], dtype=np.float64))} for r in rows]
    calibration = fit_calibration(zero_shot, "mean", matrix=False)
    if not calibration.groups:
        return Prior()
    used = [g for g in (_group_of(calibration, r, len(r["scores"])) for r in zero_shot) if g is not None]
    scale = float(np.exp(np.mean([np.log(g.temperature) for g in used]))) if used else 1.0
    return Prior(calibration, scale)


def at_depth(rows: list[dict], depth: int | None) -> list[dict]:
    """``rows`` whose head features are those read after ``depth`` blocks (their ``features_at``; None: the full
    depth, ``rows`` as they are)."""
    return rows if depth is None else [{**r, "features": r["features_at"][depth]} for r in rows]


def with_prior(rows: list[dict], prior: Prior) -> list[dict]:
    """``rows`` whose features carry ``prior``'s scores in place of the raw mean log-likelihoods."""
    return [{**r, "features": (r["features"][0], prior.apply(r, r["features"][1]))} for r in rows]


def option_features(rows: list[dict]) -> OptionFeatures:
    """The head's training view of scored rows that carry their ``features`` (:func:`candidates.scored_rows`); where
    any row's ``target`` is a teacher's distribution, the targets are the distributions (a label: one-hot)."""
    hidden = np.concatenate([r["features"][0] for r in rows]).astype(np.float32)
    mean = np.concatenate([r["features"][1] for r in rows]).astype(np.float64)
    sizes = [len(r["features"][1]) for r in rows]
    soft = None
    if _distributions(rows):
        soft = np.concatenate([distribution(r.get("target", r["label"]), k) for r, k in zip(rows, sizes)])
    return OptionFeatures(hidden, mean, np.ones_like(mean), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                          np.array([r["label"] for r in rows], dtype=np.int64), np.array(["tune"] * len(rows)), soft)


# Fitted to a teacher's distributions (`onepass distill`), a head trains longer: the distribution is a target it
# cannot overfit as it does a few hundred labels, and 200 epochs agreed more with the teacher than 60 on 300 unseen
# states of each of the four distillation tasks (+1.0 to +2.0 points; benchmarks/studies/results/distill_heads.md).
DISTRIBUTION_EPOCHS = 200

INNER_FOLDS = 3  # folds of whole states over a head's own training rows, for its temperature
TEMPERATURES = np.exp(np.linspace(np.log(0.25), np.log(20.0), 61))  # the grid a temperature is chosen from


# Heads of SEEDS seeds averaged (merged into one head: :func:`merged`), one temperature chosen for the average.
# Measured at 50 rows of five data sets (benchmarks/studies/results/head_seeds.md, 300 unseen states each, and the
# cross-validated NLL tune chooses by): see there; the fits take ~5x as long (seconds).
SEEDS = 5


def fit(rows: list[dict], seed: int = 0, seeds: int = SEEDS, depth: int | None = None) -> hd.HeadModel:
    """The average of the heads of seeds ``seed`` .. ``seed + seeds - 1`` fitted on ``rows`` (their labels, or the
    teacher's distributions where the rows carry them: :func:`option_features`, :func:`config_for`) over the prior
    fitted on them (``model.prior``), merged into one head (``model.config``: what each was trained with), its scores
    divided by the temperature the average's out-of-fold scores on ``rows`` ask for (:func:`temperature`): what the
    engine computes (:func:`served`) is what was judged. ``depth``: fitted on the features read after that many blocks
    (:func:`at_depth`; ``model.depth`` records it, None: the full depth)."""
    rows = at_depth(rows, depth)
    model = tempered(_fitted(rows, seed, seeds), temperature(rows, seed, seeds))
    model.depth = depth
    return model


def _fitted(rows: list[dict], seed: int, seeds: int) -> hd.HeadModel:
    """The prior fitted on ``rows``, and the merged heads of ``seeds`` seeds fitted over it (untempered)."""
    prior = fit_prior(rows)
    features, config = option_features(with_prior(rows, prior)), config_for(rows)  # once for every seed
    model = merged([_train(features, config, seed + k) for k in range(seeds)])
    model.prior, model.config, model.targets = prior, config, hd.targets_of(features)
    return model


def served(model: hd.HeadModel) -> tuple[hd.HeadModel, Calibration | None]:
    """(the head the engine's graph and manifest hold, the calibration of its ``head`` read-out) that compute what
    :func:`head_rows` scores with ``model``: ``beta (z + T_g b_g) / s + head(h)`` is ``(beta / s) z + head(h)`` (the
    engine's read-out) plus ``beta T_g b_g / s`` (a calibration of temperature 1 and that bias, per group)."""
    prior = getattr(model, "prior", None) or Prior()
    out = copy.deepcopy(model)
    out.prior = None  # its beta is divided by the prior's scale already: the engine adds no prior
    out.temperature = getattr(model, "temperature", 1.0)
    with torch.no_grad():
        out.beta.div_(prior.scale)
    if prior.calibration is None:
        return out, None
    beta = float(model.beta.detach())
    groups = {}
    for key, g in prior.calibration.groups.items():
        f = beta * g.temperature / prior.scale
        groups[key] = GroupCalibration(1.0, tuple(f * b for b in g.bias),
                                       {n: f * b for n, b in g.option_bias.items()}, g.rows)
    source = {"fitted_on": "the decision head's training rows", "as": "the bias of the prior the head corrects",
              "scale": prior.scale}
    return out, Calibration(groups=groups, readout="head", source=source)


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


def _train(features: OptionFeatures, config: hd.HeadConfig, seed: int) -> hd.HeadModel:
    """One head fitted on ``features`` with ``config`` and ``seed`` (untempered)."""
    model, _ = hd.train(features, None, dataclasses.replace(config, seed=seed))
    return model.eval()


def config_for(rows: list[dict]) -> hd.HeadConfig:
    """What each head fitted on ``rows`` trains with: ``CONFIG``, for ``DISTRIBUTION_EPOCHS`` epochs where the rows
    carry a teacher's distributions."""
    return dataclasses.replace(CONFIG, epochs=DISTRIBUTION_EPOCHS) if _distributions(rows) else CONFIG


def _distributions(rows: list[dict]) -> bool:
    """Whether any of ``rows`` carries a teacher's distribution as its target (not a label index)."""
    return any(np.ndim(r.get("target", r["label"])) for r in rows)


def temperature(rows: list[dict], seed: int = 0, seeds: int = 1) -> float:
    """The temperature of lowest NLL (cross-entropy, for a teacher's distributions: ``scoring.metrics.target_nll``, what
    the candidates are judged by) for scores of rows the head was not fitted on. A head fitted to a few dozen rows
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
        scored += head_rows(_fitted(inside, seed, seeds), [r for r in rows if fold_of[r["state"]] == f])
    # judged against the teacher's distributions where the rows carry them (`onepass distill`), which the heads are
    # fitted to as well: the temperature must match the teacher's own confidence, not its argmax's
    nll = [sum(target_nll(_log_softmax(np.asarray(r["scores"]) / t), r.get("target", r["label"])) for r in scored)
           for t in TEMPERATURES]
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
    """``rows`` as the head engine scores them: each row's scores replaced by ``beta * prior + head(h)`` (the prior:
    ``model.prior``'s, else the raw mean log-likelihoods), read at the head's depth (``model.depth``)."""
    prior = getattr(model, "prior", None)
    rows = at_depth(rows, getattr(model, "depth", None))
    with torch.no_grad():
        out = []
        for r in rows:
            hidden, mean = r["features"]
            mean = prior.apply(r, mean) if prior is not None else np.asarray(mean)
            scores = model(torch.from_numpy(np.asarray(hidden)).float(), torch.from_numpy(mean).float()).double().tolist()
            out.append({**r, "scores": scores})
    return out
