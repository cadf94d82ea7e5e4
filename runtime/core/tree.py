"""Packing questions and their options into one sequence with a tree mask. Pure numpy.

Each question is a *trunk* (its prompt tokens); its options hang off the trunk's
last token as a trie of token sequences, so options sharing a token prefix share
those tokens (and trunks sharing a token prefix share those). A packed token sees the whole state (always, outside this mask),
itself and its ancestors in the tree — nothing else. Positions continue from the
state as if the question and the option had been asked alone.

Every trie node is scored once: the logits are read at its parent (the trunk's
last token for a first option token) with the node's token as target. An option's
log-likelihood is the sum over the nodes of its path (the chain rule). A node is
packed as an input token only when a child needs it as context, so a leaf (the
last token of an option) is a target but never an input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..backends.batch import PackedBatch, interval_mask, intervals


@dataclass(frozen=True)
class QuestionTokens:
    """A question as token ids: the trunk and one token sequence per option."""

    trunk: tuple[int, ...]
    options: tuple[tuple[int, ...], ...]
    task: int = -1  # the tuned task whose weights answer it (its number in the engine's tasks); -1: the base engine

    def __post_init__(self):
        if not self.trunk:
            raise ValueError("a question's trunk must have at least one token")
        if not self.options or any(len(o) == 0 for o in self.options):
            raise ValueError("every option must have at least one token")
        if len(set(self.options)) != len(self.options):
            raise ValueError("two options have the same tokens")


class TooManyTokens(ValueError):
    """The questions pack into more tokens than allowed; raised before any [N, N] array exists."""

    def __init__(self, num_tokens: int, limit: int):
        super().__init__(f"the questions pack into {num_tokens} tokens; at most {limit} are allowed")
        self.num_tokens, self.limit = num_tokens, limit


@dataclass
class _Trie:
    tokens: list = field(default_factory=lambda: [-1])  # node -> token (root: -1)
    parent: list = field(default_factory=lambda: [-1])  # node -> parent node
    children: list = field(default_factory=lambda: [{}])  # node -> {token: node}
    depth: list = field(default_factory=lambda: [0])

    def virtual(self) -> int:
        """A new root (one task's questions go below it): a node below the root at depth 0, never packed."""
        self.tokens.append(-1)
        self.parent.append(0)
        self.children.append({})
        self.depth.append(0)
        return len(self.tokens) - 1

    def insert(self, seq: Sequence[int], below: int = 0) -> list[int]:
        """Add a token sequence below node ``below`` (the root); return the nodes of its path."""
        node, path = below, []
        for token in seq:
            nxt = self.children[node].get(token)
            if nxt is None:
                nxt = len(self.tokens)
                self.tokens.append(int(token))
                self.parent.append(node)
                self.children.append({})
                self.depth.append(self.depth[node] + 1)
                self.children[node][token] = nxt
            path.append(nxt)
            node = nxt
        return path


def ancestor_mask(parent: Sequence[int]) -> np.ndarray:
    """[N, N] bool: row i is True at i and at every ancestor of i. Parents precede children."""
    n = len(parent)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parent):
        if p >= 0:
            if p >= i:
                raise ValueError(f"token {i} has parent {p}; parents must come first")
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def _task_roots(trie: _Trie, tasks: Sequence[int] | None, count: int) -> dict[int, int]:
    """Task number -> the trie root of its questions: the root for -1 (no task), a virtual root for each task."""
    if tasks is not None and (len(tasks) != count or any(int(t) < -1 for t in tasks)):
        raise ValueError(f"tasks must give each of the {count} questions a task number >= -1 (-1: none); "
                         f"got {list(tasks)!r}")
    return {-1: 0, **{task: trie.virtual() for task in sorted(set(tasks or ())) if task != -1}}


def pack(questions: Sequence[QuestionTokens], past_len: int, max_tokens: int | None = None,
         mask: bool = True, tasks: Sequence[int] | None = None) -> PackedBatch:
    """Pack questions into one sequence that continues a state of ``past_len`` tokens.

    All questions go into one trie: questions whose trunks begin with the same tokens
    share those tokens (same positions, same context: exactly what each computes alone),
    and each question's options hang below its own trunk. Questions and options are
    inserted in a canonical (sorted) order, so the packed sequence does not depend on the
    order the caller gave them in: shuffling changes no bit of any answer.

    With ``max_tokens``, the packed size is counted on the trie (linear in the tokens) and
    :class:`TooManyTokens` is raised before the quadratic tree mask is built. ``mask=False`` leaves the [N, N] mask
    out (the tree stays in its 2N numbers, ``tree_order``: ``batch.with_mask`` builds it when the pass runs).

    ``tasks``: each question's task number (-1: none, the base engine's weights; by default each question's own
    ``task``). Questions share trunk tokens only
    within one task (a token computed with one task's weights is not another's), and ``token_task`` says each
    packed token's task, what the task slots' mask is built from (:mod:`onepass.runtime.core.tasks`).
    """
    if tasks is None and any(q.task != -1 for q in questions):
        tasks = [q.task for q in questions]
    trie = _Trie()
    roots = _task_roots(trie, tasks, len(questions))  # task -> its trie root
    task_of = list(tasks) if tasks is not None else [-1] * len(questions)
    scored: dict[int, None] = {}  # trie nodes that are option tokens, in creation order
    paths: list = [None] * len(questions)
    for i in sorted(range(len(questions)), key=lambda i: (task_of[i], questions[i].trunk, sorted(questions[i].options))):
        q = questions[i]
        trunk_end = trie.insert(q.trunk, below=roots[task_of[i]])[-1]
        path_of = {opt: trie.insert(opt, below=trunk_end) for opt in sorted(q.options)}  # in canonical order
        scored.update(dict.fromkeys(node for path in path_of.values() for node in path))
        paths[i] = [path_of[opt] for opt in q.options]
    task_root = {node: task for task, node in roots.items()}  # also: the nodes never packed
    if max_tokens is not None:
        size = sum(1 for node, children in enumerate(trie.children[1:], 1) if children and node not in task_root)
        if size > max_tokens:
            raise TooManyTokens(size, max_tokens)
    packed_of: dict[int, int] = {}
    ids, pos, parent, token_task = [], [], [], []
    node_task = [-1] * len(trie.tokens)
    for node in range(1, len(trie.tokens)):
        node_task[node] = task_root.get(node, node_task[trie.parent[node]])
        if trie.children[node] and node not in task_root:
            packed_of[node] = len(ids)
            ids.append(trie.tokens[node])
            pos.append(past_len + trie.depth[node] - 1)
            parent.append(packed_of.get(trie.parent[node], -1))
            token_task.append(node_task[node])
    readout_of = {node: r for r, node in enumerate(sorted(scored))}
    order = intervals(parent)  # [N, 2]: the tree in 2N numbers, what the mask is built from
    return PackedBatch(
        input_ids=np.array(ids, dtype=np.int64),
        position_ids=np.array(pos, dtype=np.int64),
        tree_mask=interval_mask(order) if mask else None,
        readout_index=np.array([packed_of[trie.parent[n]] for n in readout_of], dtype=np.int64),
        readout_target=np.array([trie.tokens[n] for n in readout_of], dtype=np.int64),
        option_readouts=[[np.array([readout_of[n] for n in path], dtype=np.int64) for path in q] for q in paths],
        tree_order=order,
        token_task=np.array(token_task, dtype=np.int64) if tasks is not None else None,
    )


def packed_size(question: QuestionTokens) -> int:
    """The tokens ``question`` packs into alone: its trunk plus every option prefix that has a next token (an
    option's last token is only read out, never input). Shared with other questions it can only be fewer."""
    inner = {opt[:k] for opt in question.options for k in range(1, len(opt))}
    return len(question.trunk) + len(inner)


def option_groups(question: QuestionTokens, max_tokens: int) -> list[list[int]]:
    """Indices of ``question``'s options in groups whose part (the trunk plus those options) packs into at most
    ``max_tokens``: one group of all options when the question fits. Options go in sorted order, so options that
    share their first tokens stay in one part and keep sharing them (a 1000-option choice stays a few parts)."""
    if packed_size(question) <= max_tokens:
        return [list(range(len(question.options)))]
    groups: list[list[int]] = []
    inner: set = set()
    for i in sorted(range(len(question.options)), key=lambda i: question.options[i]):
        opt = question.options[i]
        mine = {opt[:k] for k in range(1, len(opt))}
        if groups and len(question.trunk) + len(inner | mine) <= max_tokens:
            groups[-1].append(i)
            inner |= mine
        else:
            groups.append([i])
            inner = mine
    return groups


def blocks(questions: Sequence[QuestionTokens], max_tokens: int) -> list[list[int]]:
    """Indices of ``questions`` in blocks of whole questions, each packing into at most ``max_tokens``.

    A question's tokens attend to the state and to their own subtree only, so a block is one pass over
    the same state K/V and every answer equals the one-pass answer: splitting changes the work, not the
    result. Blocks follow :func:`pack`'s canonical order, so questions with a common trunk prefix stay
    together and keep sharing it. The budget is counted on each question alone (an upper bound); a
    question larger than ``max_tokens`` gets a block of its own.
    """
    order = sorted(range(len(questions)), key=lambda i: (questions[i].task, questions[i].trunk,
                                                         sorted(questions[i].options)))
    out: list[list[int]] = []
    used = 0
    for i in order:
        size = packed_size(questions[i])
        if out and used + size <= max_tokens:
            out[-1].append(i)
            used += size
        else:
            out.append([i])
            used = size
    return out


def option_logprobs(batch: PackedBatch, target_logprob: np.ndarray) -> list[np.ndarray]:
    """Per question, the summed log-likelihood of each option: [question] -> [K] float64."""
    lp = target_logprob.astype(np.float64)
    return [np.array([lp[r].sum() for r in q]) for q in batch.option_readouts]
