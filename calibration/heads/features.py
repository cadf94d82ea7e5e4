"""What a decision head sees: the decoder's hidden state after each option, from the exported decoder in PyTorch.

For one (state, question) the state and the question's trunk form one causal trunk and
the options hang below it (the same packed tree the engine runs, with the state inside
the tree instead of in the past: identical attention, so identical values up to float
rounding). Per option we keep the final-normed hidden state at its last read-out row
(the row that predicts the option's end token) and its summed log-likelihood.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from ...runtime.core.tree import QuestionTokens, pack


@dataclass
class OptionFeatures:
    """Options of many questions, flattened; ``offsets[i]:offsets[i+1]`` are question i's options."""

    hidden: np.ndarray  # [O, d] float32
    logprob: np.ndarray  # [O] float64, summed over the option's tokens
    length: np.ndarray  # [O] tokens per option (end token included)
    offsets: np.ndarray  # [Q+1]
    label: np.ndarray  # [Q] index of the correct option
    task: np.ndarray  # [Q] task names
    soft: np.ndarray | None = None  # [O] a teacher's probability of each option (None: the labels are the targets)

    @property
    def num_questions(self) -> int:
        return int(self.label.shape[0])

    def mean_logprob(self) -> np.ndarray:
        """The zero-shot read-out (per-token mean log-likelihood), [O]."""
        return self.logprob / self.length

    def zero_shot_probabilities(self) -> list[np.ndarray]:
        """Per question, the softmax of the zero-shot read-out over its options."""
        from ...runtime.core.readout import softmax

        z = self.mean_logprob()
        return [softmax(z[self.offsets[i]:self.offsets[i + 1]]) for i in range(self.num_questions)]

    def select(self, mask: np.ndarray) -> "OptionFeatures":
        """The questions where ``mask`` [Q] is True."""
        keep = np.flatnonzero(mask)
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in keep]) if len(keep) else []
        sizes = np.diff(self.offsets)[keep]
        return OptionFeatures(self.hidden[rows], self.logprob[rows], self.length[rows],
                              np.concatenate([[0], np.cumsum(sizes)]), self.label[keep], self.task[keep],
                              None if self.soft is None else self.soft[rows])

    def save(self, path) -> None:
        np.savez_compressed(path, hidden=self.hidden, logprob=self.logprob, length=self.length,
                            offsets=self.offsets, label=self.label, task=self.task,
                            **({} if self.soft is None else {"soft": self.soft}))

    @classmethod
    def load(cls, path) -> "OptionFeatures":
        z = np.load(path, allow_pickle=False)
        return cls(z["hidden"], z["logprob"], z["length"], z["offsets"], z["label"], z["task"],
                   z["soft"] if "soft" in z else None)


def distribution(target, k: int) -> np.ndarray:
    """A target as a [k] distribution: a teacher's as it is, a label index one-hot."""
    if np.ndim(target):
        if len(target) != k:
            raise ValueError(f"a teacher's distribution over {len(target)} options for a question of {k}")
        return np.asarray(target, dtype=np.float64)
    out = np.zeros(k)
    out[int(target)] = 1.0
    return out


def last_readouts(batch, question: int = 0) -> list[int]:
    """Per option of ``question``, the read-out row of its last token."""
    return [int(r[-1]) for r in batch.option_readouts[question]]


def option_rows(batch, h, target) -> tuple[np.ndarray, list[float]]:
    """Of a pass over one question (``example_pass``): per option the hidden state at its last read-out row [K, d] and
    its summed log-likelihood (``target``: the read-out rows' target log-probs)."""
    t = target.double().numpy()
    return h[last_readouts(batch)].numpy(), [t[r].sum() for r in batch.option_readouts[0]]


def example_pass(decoder, encoder, example, empty_past: list):
    """One example through ``decoder``: (packed batch, option token ids, hidden [R, d], target log-probs [R])."""
    qt = encoder.question(example.question)
    batch = pack([QuestionTokens(tuple(encoder.state(example.state)) + qt.trunk, qt.options)], 0)
    t = torch.from_numpy
    h, target, _ = decoder.readout(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *empty_past,
                                   t(batch.readout_index), t(batch.readout_target))
    return batch, qt.options, h, target


@torch.inference_mode()
def extract(decoder, encoder, examples, progress: bool = True, trunks: list | None = None) -> OptionFeatures:
    """Run every example through ``decoder`` (a PackedDecoder) and keep the option features; ``trunks``: a list that
    gets each example's hidden state at its question's last token (where the first option token is read)."""
    dims = decoder.dims
    empty = [torch.zeros(dims.num_kv_heads, 0, dims.head_dim) for _ in range(2 * dims.num_layers)]
    hidden, logprob, length, sizes, label, task, soft = [], [], [], [], [], [], []
    t0 = time.perf_counter()
    for i, ex in enumerate(examples):
        batch, options, h, target = example_pass(decoder, encoder, ex, empty)
        rows_h, rows_logprob = option_rows(batch, h, target)
        if trunks is not None:
            trunks.append(h[int(batch.option_readouts[0][0][0])].numpy())
        hidden.append(rows_h)
        logprob.append(rows_logprob)
        length.append([len(o) for o in options])
        sizes.append(len(options))
        label.append(ex.label)
        task.append(ex.task)
        soft.append(distribution(getattr(ex, "target", ex.label), len(options)))  # tune rows may carry a teacher's
        if progress and (i + 1) % 100 == 0:
            rate = (i + 1) / (time.perf_counter() - t0)
            print(f"  features {i + 1}/{len(examples)} ({rate:.1f}/s)", file=sys.stderr, flush=True)
    return OptionFeatures(np.concatenate(hidden).astype(np.float32), np.concatenate(logprob).astype(np.float64),
                          np.concatenate(length).astype(np.float64), np.concatenate([[0], np.cumsum(sizes)]),
                          np.array(label, dtype=np.int64), np.array(task, dtype=str),
                          np.concatenate(soft) if any(np.ndim(getattr(ex, "target", 0)) for ex in examples) else None)
