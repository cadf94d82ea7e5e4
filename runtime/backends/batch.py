"""What a backend runs: one packed pass's graph inputs (``PackedBatch``), its tree mask in 2N numbers, a causal
trunk for prefill, and the buckets passes pad to. Pure numpy.

The backends own these types (the dependency runs one way, core -> backends): ``core.tree`` packs questions into a
``PackedBatch``; a backend feeds its arrays by the names of ``contract``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PackedBatch:
    """The graph inputs of one packed pass plus the map from read-outs to options."""

    input_ids: np.ndarray  # [N] int64
    position_ids: np.ndarray  # [N] int64
    tree_mask: np.ndarray | None  # [N, N] bool; None where only ``tree_order`` is kept (``with_mask`` builds it)
    readout_index: np.ndarray  # [R] int64
    readout_target: np.ndarray  # [R] int64
    option_readouts: list = field(default_factory=list)  # [question][option] -> int64 array of read-outs
    # [N, 2] int64: each token's preorder number in the tree and the last preorder number of its subtree, so that
    # tree_mask[i, j] == (order[j, 0] <= order[i, 0] <= order[j, 1]) (``intervals``): the mask in 2N numbers, what
    # the GPU pass uploads and expands on the device. None where a batch was built from a mask alone.
    tree_order: np.ndarray | None = None
    # [N] int64: each token's task number (-1: none), where the questions were packed with tasks; else None
    token_task: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """N, the number of packed input tokens."""
        return int(self.input_ids.shape[0])


def intervals(parent: Sequence[int]) -> np.ndarray:
    """[N, 2] int64 (preorder number, last preorder number of the subtree) of each token of a forest given by
    ``parent`` (-1 for a root; parents precede children). Token i sees token j (j is i or an ancestor of i) exactly
    when ``order[j, 0] <= order[i, 0] <= order[j, 1]``: :func:`ancestor_mask` in 2N numbers, whatever the order
    the tokens are packed in."""
    n = len(parent)
    size = [1] * n
    for i in range(n - 1, -1, -1):
        if parent[i] >= 0:
            size[parent[i]] += size[i]
    pre, free, roots = [0] * n, [0] * n, 0  # free[p]: the next preorder number a child of p takes
    for i, p in enumerate(parent):
        if p < 0:
            pre[i], roots = roots, roots + size[i]
        else:
            pre[i] = free[p]
            free[p] += size[i]
        free[i] = pre[i] + 1
    order = np.empty((n, 2), dtype=np.int64)
    order[:, 0] = pre
    order[:, 1] = order[:, 0] + np.asarray(size, dtype=np.int64) - 1
    return order


def interval_mask(order: np.ndarray) -> np.ndarray:
    """[N, N] bool from :func:`intervals`: row i True at every j whose subtree holds i (the device's formula)."""
    pre, last = order[:, 0], order[:, 1]
    return (pre[None, :] <= pre[:, None]) & (pre[:, None] <= last[None, :])


def intervals_of_mask(mask: np.ndarray) -> np.ndarray:
    """:func:`intervals` of a batch that carries only its mask (a golden file's): each token's parent is its nearest
    earlier visible token; ValueError when the mask is not the ancestor mask of a forest in packing order."""
    n = mask.shape[0]
    earlier = np.tril(mask, -1)
    parent = np.where(earlier.any(1), n - 1 - np.argmax(earlier[:, ::-1], axis=1), -1)
    order = intervals(parent.tolist())
    if not np.array_equal(interval_mask(order), mask):
        raise ValueError("the tree mask is not a forest's ancestor mask (each token, itself and its ancestors)")
    return order


def with_mask(batch: PackedBatch) -> PackedBatch:
    """``batch`` with its [N, N] tree mask, built from ``tree_order`` where it was left out (a large compiled question
    set keeps its tree in 2N numbers and builds each pass's mask only when that pass runs)."""
    if batch.tree_mask is not None:
        return batch
    return dataclasses.replace(batch, tree_mask=interval_mask(batch.tree_order))


def concat(batches: Sequence[PackedBatch]) -> PackedBatch:
    """Packed passes over one state joined into one: each batch's tokens see their own tree only (the forests sit
    side by side: the mask block-diagonal, the preorder numbers and read-out indices moved past the batches before),
    so every read-out is what it was in its own batch. Read-outs follow batch after batch; ``option_readouts`` too."""
    sizes = np.array([b.num_tokens for b in batches], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # [B]
    reads = np.cumsum([0] + [b.readout_index.shape[0] for b in batches])
    mask = None
    if all(b.tree_mask is not None for b in batches):
        mask = np.zeros((int(sizes.sum()),) * 2, dtype=bool)  # [N, N]
        for b, at in zip(batches, starts):
            mask[at:at + b.num_tokens, at:at + b.num_tokens] = b.tree_mask
    tasks = None
    if any(b.token_task is not None for b in batches):
        tasks = np.concatenate([b.token_task if b.token_task is not None else np.full(b.num_tokens, -1, np.int64)
                                for b in batches])
    return PackedBatch(
        input_ids=np.concatenate([b.input_ids for b in batches]),
        position_ids=np.concatenate([b.position_ids for b in batches]),
        tree_mask=mask,
        readout_index=np.concatenate([b.readout_index + at for b, at in zip(batches, starts)]),
        readout_target=np.concatenate([b.readout_target for b in batches]),
        option_readouts=[[r + int(at) for r in q] for b, at in zip(batches, reads) for q in b.option_readouts],
        tree_order=np.concatenate([b.tree_order + at for b, at in zip(batches, starts)]),
        token_task=tasks,
    )


def causal(ids: Sequence[int], start: int) -> PackedBatch:
    """A single causal trunk (the state, or a chunk of it) starting at position ``start``.

    It reads out the last token's next-token distribution for its first id (the
    graph needs at least one read-out); prefill ignores it.
    """
    n = len(ids)
    return PackedBatch(
        input_ids=np.asarray(ids, dtype=np.int64),
        position_ids=np.arange(start, start + n, dtype=np.int64),
        tree_mask=np.tril(np.ones((n, n), dtype=bool)),
        readout_index=np.array([n - 1], dtype=np.int64),
        readout_target=np.array([int(ids[0])], dtype=np.int64),
        tree_order=np.stack([np.arange(n, dtype=np.int64), np.full(n, n - 1, dtype=np.int64)], axis=1),
    )


MIN_STEP = 8  # the finest bucket step (and the alignment of every bucket: tensor-core GEMMs like multiples of 8)


def bucket(n: int, cap: int | None = None) -> int:
    """The size ``n`` tokens (or read-outs) pad to: ``n`` rounded up to a step of a quarter of the largest power of two
    not above it (at least ``MIN_STEP``): 16, 24, ..., 64, 80, ..., 128, 160, ..., 256, 320, ..., 512, 640, ...
    Padding is at most 1.25x from 32 on (a power of two plus one pads to 1.25 times that power), where powers of two
    padded up to 2x. Never above ``cap`` (a limit such as ``max_packed_tokens`` that need not be on the ladder: the
    TensorRT profiles end there) when ``n`` fits under it."""
    step = max(MIN_STEP, (1 << (max(n, 1).bit_length() - 1)) // 4)
    b = -(-max(n, 1) // step) * step
    return min(b, cap) if cap is not None and n <= cap else b


def pad_batch(batch: PackedBatch, packed: int, readout: int) -> PackedBatch:
    """``batch`` padded to ``packed`` tokens and ``readout`` read-outs without changing any real output.

    A padding token sees the state and itself only, and no real token sees it; padding
    read-outs read row 0. Real outputs are the first N / R entries. A batch without its [N, N] mask (a pass that
    reads only ``tree_order``) is padded without one.
    """
    n, r = batch.num_tokens, batch.readout_index.shape[0]
    if packed < n or readout < r:
        raise ValueError("padding must not shrink a batch")
    mask = None
    if batch.tree_mask is not None:
        mask = np.zeros((packed, packed), dtype=bool)
        mask[:n, :n] = batch.tree_mask
        mask[np.arange(n, packed), np.arange(n, packed)] = True
    last = int(batch.position_ids.max()) if n else 0
    order = None
    if batch.tree_order is not None:  # each padding token a root of its own, numbered after every real one
        own = np.arange(n, packed, dtype=np.int64)
        order = np.concatenate([batch.tree_order, np.stack([own, own], axis=1)])
    return PackedBatch(
        input_ids=np.concatenate([batch.input_ids, np.zeros(packed - n, np.int64)]),
        position_ids=np.concatenate([batch.position_ids, np.full(packed - n, last, np.int64)]),
        tree_mask=mask,
        readout_index=np.concatenate([batch.readout_index, np.zeros(readout - r, np.int64)]),
        readout_target=np.concatenate([batch.readout_target, np.zeros(readout - r, np.int64)]),
        option_readouts=batch.option_readouts,
        tree_order=order,
    )
