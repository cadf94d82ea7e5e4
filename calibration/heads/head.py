"""Train a decision head with cross-entropy plus the RLCD recipe (torch at fit time only).

An option's score is ``beta * zero_shot + head(h)``: the zero-shot read-out (per-token
mean log-likelihood) plus a small MLP over the hidden state after the option (see
:class:`onepass.runtime.backends.torch_decoder.DecisionHead`). ``beta`` lives in the manifest; the MLP is
exported into the score graph, so answering stays one pass.

The loss is cross-entropy plus RLCD (:mod:`onepass.calibration.scoring.rlcd`, the same term
``onepass tune`` trains the decoder with).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from ...export import head_file
from ...runtime.backends.torch_decoder import DecisionHead
from ..scoring.metrics import target_nll
from ..scoring.rlcd import cross_entropy, rlcd_loss
from .features import OptionFeatures


@dataclass(frozen=True)
class HeadConfig:
    """Hyper-parameters of one training run."""

    width: int = 32
    rlcd_weight: float = 1.0  # 0 = cross-entropy only
    group: int = 16  # perturbed samples per question
    sigma: float = 0.5  # perturbation scale of the scores
    lr: float = 1e-2
    weight_decay: float = 1e-2
    epochs: int = 60
    batch: int = 64
    patience: int = 8
    seed: int = 0


class HeadModel(torch.nn.Module):
    """beta * zero_shot + head(standardised hidden): the trainable form of the exported head."""

    def __init__(self, hidden_size: int, width: int, shift: np.ndarray, scale: np.ndarray):
        super().__init__()
        self.head = DecisionHead(hidden_size, width, shift=shift, scale=scale)
        self.beta = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, hidden: torch.Tensor, zero_shot: torch.Tensor) -> torch.Tensor:
        return self.beta * zero_shot + self.head(hidden)


def _question_scores(model, feats: OptionFeatures, hidden, zero_shot, questions=None) -> list[torch.Tensor]:
    """Per question (all, or those listed), the model's [K] option scores; only their rows are computed."""
    questions = range(feats.num_questions) if questions is None else questions
    spans = [(int(feats.offsets[i]), int(feats.offsets[i + 1])) for i in questions]
    rows = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in spans]))
    s = model(hidden[rows], zero_shot[rows])
    return list(torch.split(s, [b - a for a, b in spans]))


def probabilities(model, feats: OptionFeatures) -> list[np.ndarray]:
    """Per question, the softmax of the model's option scores."""
    with torch.no_grad():
        scores = _question_scores(model, feats, torch.from_numpy(feats.hidden),
                                  torch.from_numpy(feats.mean_logprob()).float())
    return [torch.softmax(s.double(), 0).numpy() for s in scores]


def question_target(feats: OptionFeatures, i: int) -> torch.Tensor:
    """Question ``i``'s target: its label (0-d), or where the features carry a teacher's distributions, question i's
    (all the teacher said, not only its most probable option)."""
    if feats.soft is None:
        return torch.tensor(int(feats.label[i]))
    return torch.from_numpy(feats.soft[int(feats.offsets[i]):int(feats.offsets[i + 1])]).float()


def targets_of(feats: OptionFeatures) -> str:
    """What a head fitted on ``feats`` learns from, in words (the manifest's ``head.training.targets``)."""
    return "labels" if feats.soft is None else "the teacher's distributions"


def heldout_nll(probs: list[np.ndarray], feats: OptionFeatures) -> float:
    """Mean NLL of the labels, or cross-entropy against the teacher's distributions where ``feats`` carry them."""
    return float(np.mean([target_nll(np.log(np.clip(p, 1e-12, None)), question_target(feats, i).numpy())
                          for i, p in enumerate(probs)]))


def train(train: OptionFeatures, val: OptionFeatures | None, config: HeadConfig = HeadConfig(), log=None,
          on_epoch=None) -> tuple:
    """Fit a HeadModel on the labels, or on the teacher's distributions where ``train`` carries them (``soft``);
    early stopping on validation NLL (``val=None``: exactly ``config.epochs``).

    Returns (model, history of validation NLL per epoch).
    """
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    shift = train.hidden.mean(0)
    scale = train.hidden.std(0) + 1e-3
    model = HeadModel(train.hidden.shape[1], config.width, shift, scale)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    hidden, zero_shot = torch.from_numpy(train.hidden), torch.from_numpy(train.mean_logprob()).float()
    targets = [question_target(train, i) for i in range(train.num_questions)]
    best, best_state, bad, history = float("inf"), None, 0, []
    order = np.arange(train.num_questions)
    rng = np.random.default_rng(config.seed)
    for epoch in range(config.epochs):
        rng.shuffle(order)
        model.train()
        for start in range(0, len(order), config.batch):
            idx = order[start:start + config.batch]
            scores = _question_scores(model, train, hidden, zero_shot, idx)  # this minibatch's questions only
            ce = torch.stack([cross_entropy(s, targets[i]) for s, i in zip(scores, idx)]).mean()
            loss = ce
            if config.rlcd_weight:
                rl = torch.stack([rlcd_loss(s, targets[i], config.group, config.sigma, generator=gen)
                                  for s, i in zip(scores, idx)]).mean()
                loss = ce + config.rlcd_weight * rl
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        if on_epoch is not None:
            on_epoch(model)
        if val is None:
            continue
        v = heldout_nll(probabilities(model, val), val)
        history.append({"epoch": epoch, "val_nll": v})
        if log:
            log(f"  epoch {epoch:2d} val NLL {v:.4f}")
        if v < best - 1e-4:
            best, bad = v, 0
            best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        else:
            bad += 1
            if bad >= config.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    return model, history


def cross_validate(feats: OptionFeatures, config: HeadConfig, folds: int = 5, seed: int = 0) -> dict:
    """Leave-tasks-out cross-validation: mean held-out NLL per epoch over ``folds`` task folds.

    Returns {"nll": best mean NLL, "epochs": the epoch count that reaches it, "accuracy": at that epoch}.
    """
    tasks = sorted(set(feats.task.tolist()))
    np.random.default_rng(seed).shuffle(tasks)
    curves, accs = [], []
    for k in range(folds):
        held = tasks[k::folds]
        inside = ~np.isin(feats.task, held)
        fold_cfg = replace(config, patience=config.epochs)  # full curve, no early stop
        tr, va = feats.select(inside), feats.select(~inside)
        curve, acc = [], []
        model = None

        def record(m, va=va, curve=curve, acc=acc):
            probs = probabilities(m, va)
            curve.append(heldout_nll(probs, va))
            acc.append(float(np.mean([p.argmax() == y for p, y in zip(probs, va.label)])))
        model, _ = train(tr, None, fold_cfg, on_epoch=record)
        curves.append(curve)
        accs.append(acc)
    mean = np.mean(curves, axis=0)
    best = int(np.argmin(mean))
    return {"nll": float(mean[best]), "epochs": best + 1, "accuracy": float(np.mean(accs, axis=0)[best]),
            "curve": [float(x) for x in mean]}


def save(model: HeadModel, config: HeadConfig, path, info: dict) -> None:
    """The trained head (state dict, config, provenance) as one torch file (:mod:`onepass.export.head_file`)."""
    head_file.save(model.state_dict(), asdict(config), model.head.hidden_size, path, info)


def load(path) -> tuple[HeadModel, dict]:
    """A saved head and its provenance."""
    blob = head_file.read(path)
    cfg = HeadConfig(**blob["config"])
    hidden = blob["hidden_size"]
    model = HeadModel(hidden, cfg.width, np.zeros(hidden, np.float32), np.ones(hidden, np.float32))
    model.load_state_dict(blob["state_dict"])
    return model, blob["info"]
