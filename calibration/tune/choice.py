"""Train and choose: the tuning runs whose held-out answers decide which candidate `onepass tune` writes.

With enough rows (``CV_BELOW_ROWS`` or more, or ``--validation`` files) one run trains on the training states and
the candidates are judged on the held-out states (:func:`held_out_choice`). With fewer, one 20% split holds out a
handful of questions, and a choice made on them is noise (50 Rotten Tomatoes rows: the held-out NLL of 10 questions
chose a tuned engine 2.7 points below calibrating the base on 300 test rows). So the choice is cross-validated
over whole states (:func:`cross_validated_choice`): ``CV_FOLDS`` runs each train on the other folds and answer their
own, every row is judged once by a run that never saw it, and only then is the chosen candidate fitted on all the
rows (the tuned ones by a last run on every row). The frozen blocks' cache is shared by every run.

Beside the untuned and tuned weights, a decision head over the untuned engine's hidden states is a candidate
(:mod:`..heads.candidate`): it is fitted on the same training rows (per fold) from the features of the pass that scores
the untuned candidates, and judged on the same rows as they are. With fewer rows than ``TuneConfig.lora_min_rows``
the head is the only learner (``lora=False``): no LoRA run is trained, and the choice among base, base+calibrate and
the head takes seconds (50 rows: the LoRA runs took 45-180 s and never beat the head on unseen states); it is then
cross-validated whatever the row count (the head's fits are cheap, and the head written is fitted on every row).
The head is a candidate at several depths (``Runs.depths``, read from the same pass): one fit per depth and fold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ...runtime.core.errors import OnepassError
from ..heads import candidate as head_candidate
from .candidates import Candidate, calibrated, candidates, choose, head_depth, head_name, is_head, kept_within_noise, \
    scored_rows
from .trainer import Progress, Trainer

CV_BELOW_ROWS = 100  # fewer rows than this: a cross-validated choice instead of one held-out split
CV_FOLDS = 3  # each fold's run costs a training run: 3 keeps 50 rows to ~4 runs


@dataclass
class Outcome:
    """What training and choosing left: the progress of the run whose weights are in the model, the candidates
    and the chosen one (its calibration fitted on the rows it is written with), and the seconds spent training."""

    progress: Progress
    found: list[Candidate]
    chosen: Candidate
    seconds: float
    folds: int  # 0: one held-out split
    rows_trained: int  # question rows of every optimiser step of every run (the folds' and the last)
    head: object = None  # the decision head fitted on every training row, where a head candidate was chosen

    @property
    def judged(self) -> str:
        """How the candidates were judged, as the reports say it."""
        return f"cross-validated ({self.folds} folds)" if self.folds else "held-out"

    @property
    def why(self) -> str:
        """Why a head was chosen over an untuned candidate of lower NLL ("" where it was not)."""
        return kept_within_noise(self.found, self.chosen)

    def candidates_line(self) -> str:
        """The candidates' NLL and accuracy and the one chosen, in one line (what tune logs)."""
        return (f"{self.judged} candidates: " + "; ".join(f"{c.name} NLL {c.nll:.4f} accuracy {c.accuracy:.3f}"
                                                           for c in self.found) + f" -> {self.chosen.name}"
                + (f" ({self.why})" if self.why else ""))


def check_cv_states(groups: list, instead: str = "") -> None:
    """OnepassError where ``groups`` (one per state) are too few for a cross-validated choice; ``instead``: what else
    the caller could give."""
    if len(groups) < 2 * CV_FOLDS:
        raise OnepassError(f"{len(groups)} distinct states are too few to cross-validate the choice over {CV_FOLDS} "
                           f"folds of whole states: give at least {2 * CV_FOLDS} states{instead}")


def state_folds(chunks: list, folds: int, seed: int) -> list[int]:
    """A fold number per chunk; the chunks of one state (same state ids) always share a fold."""
    states = sorted({tuple(c.state_ids) for c in chunks})
    order = np.random.default_rng([seed, 44]).permutation(len(states))
    fold_of = {states[i]: k % folds for k, i in enumerate(order)}
    return [fold_of[tuple(c.state_ids)] for c in chunks]


class Runs:
    """Trainers over one scorer and one set of parameters, each starting from the same initial weights."""

    def __init__(self, scorer, params: list, config, work, fingerprint: dict, encoder, log, depths=()):
        self.scorer, self.params, self.config, self.work = scorer, params, config, work
        self.fingerprint, self.encoder, self.log = fingerprint, encoder, log
        self.depths = tuple(depths)  # the block counts a decision head is also tried at
        self.initial = [p.detach().clone() for p in params]

    def restore_initial(self) -> None:
        """The initial (untuned) weights back in place: what an untuned candidate is written with."""
        import torch

        with torch.no_grad():
            for p, v in zip(self.params, self.initial):
                p.copy_(v)

    def trainer(self, train: list, held: list, checkpoint: str) -> Trainer:
        """A trainer from the initial weights (restored in place)."""
        self.restore_initial()
        return Trainer(self.scorer, self.params, self.config, train, held, self.work / checkpoint, self.fingerprint,
                       self.log)

    def scored(self, chunks: list, features: bool = False) -> list[dict]:
        """Rows of ``chunks`` scored by the weights in place now (with a decision head's ``features``, at the full
        depth and at each of ``depths``)."""
        return scored_rows(self.scorer, chunks, self.encoder, features, self.depths if features else ())


def train_and_choose(runs: Runs, train: list, held: list, cv: bool, resume: bool, readout: str, seed: int,
                     heads: bool = True, lora: bool = True) -> Outcome:
    """The chunks scored by the initial weights (before any step, and any resume), then the runs and the choice:
    cross-validated over whole states where ``cv``, else judged on ``held``; ``heads``: a decision head is a
    candidate too; ``lora``: the tuned candidates are trained (False: no run, the untuned weights stay in place)."""
    base_train, base_held = _training_rows(runs, train, heads), runs.scored(held, heads)
    if cv:
        return cross_validated_choice(runs, train, base_train, resume, readout, seed, heads, lora)
    return held_out_choice(runs, train, held, (base_train, base_held), resume, readout, heads, lora)


def _training_rows(runs: Runs, train: list, features: bool = False) -> list[dict]:
    """The training chunks scored by the weights in place, for the candidates fitted on them (the calibrations, the
    head); none with ``--write tuned``, which writes the tuned weights uncalibrated and judges only the held-out rows
    (the default adapter's 2,767 training rows took ~25 of its ~77 minutes to score twice for nothing)."""
    return [] if runs.config.write == "tuned" else runs.scored(train, features)


def _head_fold(train: list[dict], held: list[dict], seed: int, depths=()) -> dict:
    """Heads fitted on ``train`` (rows with features), one per depth of ``depths`` and one at the full depth:
    candidate name -> (the head, ``train`` and ``held`` as it scores them)."""
    out = {}
    for depth in (*depths, None):
        model = head_candidate.fit(train, seed, depth=depth)
        out[head_name(depth)] = model, head_candidate.head_rows(model, train), head_candidate.head_rows(model, held)
    return out


def _judged(fold: dict) -> dict:
    """A fold's heads as :func:`candidates` reads them: name -> (train rows, held-out rows)."""
    return {name: scored[1:] for name, scored in fold.items()}


def _finish(runs: Runs, chosen: Candidate, head) -> object:
    """The head a chosen head candidate is written with (``head()``: the head judged after one held-out split, fitted
    on every training row after a cross-validated choice), the initial weights back in place; None for the others."""
    if not is_head(chosen.name):
        return None
    runs.restore_initial()  # the tuned weights are no part of a head engine
    return head()


def held_out_choice(runs: Runs, train: list, held: list, base: tuple, resume: bool, readout: str,
                    heads: bool = True, lora: bool = True) -> Outcome:
    """One run on ``train`` (none where not ``lora``), early stopping and the choice on ``held``; ``base``: (train,
    held) rows scored before any step. The tuned weights are the snapshot early stopping kept on ``held``, so the
    tuned candidates' held-out NLL is the lowest of a few evaluations on those rows (slightly optimistic); with
    ``CV_BELOW_ROWS`` rows or more the held-out split has the 20 questions or more that keep that small, and a base
    candidate is preferred on a tie."""
    started = time.perf_counter()
    progress, tuned = Progress(), (None, None)
    if lora:
        trainer = runs.trainer(train, held, "checkpoint.pt")
        if resume:
            trainer.resume()
        progress, tuned = trainer.run(), (_training_rows(runs, train), runs.scored(held))
    fold = _head_fold(*base, runs.config.seed, runs.depths) if heads else None
    found = candidates([(*base, *tuned)], readout, [_judged(fold)] if heads else None)
    chosen = choose(found, runs.config.write)
    if chosen.name.startswith("base"):
        runs.restore_initial()
    head = _finish(runs, chosen, lambda: fold[chosen.name][0])
    return Outcome(progress, found, chosen, time.perf_counter() - started, 0, progress.rows_seen, head)


def _tuned_fold(runs: Runs, chunks: list, fold_of: list[int], f: int, resume: bool) -> tuple:
    """Fold ``f``'s run, trained on the other folds: (its rows of them, its rows of fold ``f``, rows trained)."""
    inside = [c for c, k in zip(chunks, fold_of) if k != f]
    outside = [c for c, k in zip(chunks, fold_of) if k == f]
    runs.log(f"cross-validation run {f + 1} of {CV_FOLDS}: {len(inside)} chunks trained on, {len(outside)} judged")
    trainer = runs.trainer(inside, [], f"fold{f}.pt")
    if resume and (runs.work / f"fold{f}.pt").is_file():  # a finished run's checkpoint gives its weights back
        trainer.resume()
    trained = trainer.run().rows_seen
    return runs.scored(inside), runs.scored(outside), trained


def cross_validated_choice(runs: Runs, chunks: list, base: list[dict], resume: bool, readout: str,
                           seed: int, heads: bool = True, lora: bool = True) -> Outcome:
    """``CV_FOLDS`` runs judged on the folds they did not see, then the chosen candidate fitted on every chunk;
    ``base``: the chunks' rows scored before any step, in chunk order; ``lora`` False: the folds only split the rows
    (no run)."""
    started = time.perf_counter()
    fold_of = state_folds(chunks, CV_FOLDS, seed)
    rows_of = np.cumsum([0] + [c.size for c in chunks])
    pick = lambda rows, f, inside: [r for i, c in enumerate(chunks) if (fold_of[i] == f) != inside  # noqa: E731
                                    for r in rows[rows_of[i]:rows_of[i + 1]]]
    folds, head_sets, trained = [], [], 0
    for f in range(CV_FOLDS):
        tuned_train, tuned_held, rows = _tuned_fold(runs, chunks, fold_of, f, resume) if lora else (None, None, 0)
        trained += rows
        folds.append((pick(base, f, True), pick(base, f, False), tuned_train, tuned_held))
        if heads:
            head_sets.append(_judged(_head_fold(folds[-1][0], folds[-1][1], seed, runs.depths)))
    found = candidates(folds, readout, head_sets if heads else None)
    chosen = choose(found, runs.config.write)
    progress = Progress()
    runs.restore_initial()  # the last fold's weights are no candidate's
    head = _finish(runs, chosen, lambda: head_candidate.fit(base, runs.config.seed, depth=head_depth(chosen.name)))
    if chosen.name.startswith("tuned"):
        runs.log(f"{chosen.name} chosen: the last run trains on all {len(chunks)} chunks")
        trainer = runs.trainer(chunks, [], "checkpoint.pt")
        if resume and (runs.work / "checkpoint.pt").is_file():  # interrupted in the last run: continue it
            trainer.resume()
        progress = trainer.run()
    if chosen.name.endswith("+calibrate"):
        rows = runs.scored(chunks) if chosen.name.startswith("tuned") else base
        chosen = replace(chosen, calibration=calibrated(rows, readout))
    return Outcome(progress, found, chosen, time.perf_counter() - started, CV_FOLDS, trained + progress.rows_seen,
                   head)
