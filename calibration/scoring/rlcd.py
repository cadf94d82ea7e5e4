"""RLCD (reward-learned calibrated decisions): the one implementation, used by the decision head and by tune.

Per question, ``G`` perturbed score vectors ``s + sigma * eps`` are sampled around the current
option scores; each sample's softmax earns the reward of proper scoring rules — log score plus
spherical score, minus the ranked probability score for ordinal (score) questions —, rewards are
normalised within the group (the advantage), and the scores move towards the samples with
positive advantage (the Gaussian policy gradient). Cross-entropy keeps the scores on the labels;
the RLCD term rewards well-shaped probability vectors rather than only the label's probability.

A target is a label index or, for distillation, a teacher distribution over the options: the
reward is then its expectation under the teacher.
"""

from __future__ import annotations

import torch


def spherical_score(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """p_y / ||p||_2 for [..., K] probabilities and [...] labels (higher is better)."""
    return p.gather(-1, y[..., None])[..., 0] / p.norm(dim=-1).clamp_min(1e-12)


def ranked_probability_score(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the cumulative distributions (ordinal; lower is better), [..., K] -> [...]."""
    k = p.shape[-1]
    onehot = torch.nn.functional.one_hot(y, k).to(p.dtype)
    return ((p.cumsum(-1) - onehot.cumsum(-1)) ** 2)[..., :-1].sum(-1) / max(k - 1, 1)


def cross_entropy(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The term beside RLCD: -log p of the label (``target`` a 0-d index) or the cross-entropy against a [K] teacher
    distribution, for one question's [K] scores."""
    logp = torch.log_softmax(scores, -1)
    return -logp[target] if target.dim() == 0 else -(target.to(logp.dtype) * logp).sum()


def rlcd_reward(p: torch.Tensor, y: torch.Tensor, ordinal: bool) -> torch.Tensor:
    """log p_y + spherical score (- RPS for ordinal questions)."""
    reward = torch.log(p.gather(-1, y[..., None])[..., 0].clamp_min(1e-12)) + spherical_score(p, y)
    if ordinal:
        reward = reward - ranked_probability_score(p, y)
    return reward


def expected_reward(p: torch.Tensor, target: torch.Tensor, ordinal: bool) -> torch.Tensor:
    """[G, K] probabilities -> [G] rewards: of the label (``target`` a 0-d index) or expected under a [K]
    teacher distribution."""
    group, k = p.shape
    if target.dim() == 0:
        return rlcd_reward(p, target.expand(group), ordinal)
    per_label = torch.stack([rlcd_reward(p, torch.full((group,), j), ordinal) for j in range(k)], -1)  # [G, K]
    return per_label @ target.to(p.dtype)


def rlcd_loss(scores: torch.Tensor, y: torch.Tensor, group: int, sigma: float, ordinal: bool = False,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Group-normalised Gaussian policy-gradient loss for one question's [K] scores.

    ``y``: the label (0-d long tensor) or a teacher distribution ([K] float). Samples
    ``scores.detach() + sigma * eps`` (G of them), rewards each sample's softmax, and returns
    ``-mean(A_g * log pi(sample_g))`` with ``log pi = -||sample - scores||^2 / (2 sigma^2)``, so the
    gradient moves the scores towards samples with above-average reward.
    """
    eps = torch.randn((group, scores.shape[-1]), generator=generator, dtype=torch.float32)
    samples = scores.detach().float() + sigma * eps
    with torch.no_grad():
        reward = expected_reward(torch.softmax(samples, -1), y, ordinal)
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
    log_pi = -((samples - scores.float()) ** 2).sum(-1) / (2 * sigma**2)
    return -(advantage * log_pi).mean()
