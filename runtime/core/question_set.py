"""Question sets compiled once and replayed after any state. Pure numpy.

In a service the question set is fixed and the state changes: a router asks the same questions of every ticket.
Everything about a set that does not depend on the state is worked out once (``Planner.compile``): each question's
token ids, the passes that answer it with their tree masks and trees in 2N numbers, read-out indices and targets,
positions counted from the end of the state, and the map from read-out rows back to options. Per ask the host only
places the set after a state (:meth:`CompiledPass.at`: the state's length added to the positions) and, once a pass
has run, sums each option's log-likelihood with one ``bincount`` (:meth:`CompiledPass.values`).

A set is found again by its content (:func:`content_key`): every question id, type, instruction, option and task as
given, in order. Ids never reach the model, but they are part of the key, so a set found again was checked whole
when it was compiled. Sets are kept in a bounded LRU (``state_cache.ByteLru``) by the bytes their arrays hold.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..backends.batch import PackedBatch
from .questions import as_text

# a set's [N, N] tree masks are built when it is compiled and kept up to this many bytes (a set of up to 1,024 packed
# tokens in one pass, or four passes of 512); a larger set keeps its trees in 2N numbers and builds each pass's mask
# only when that pass runs, so a queue of large requests holds little quadratic memory (64 queued: 64 MiB at most)
KEEP_MASK_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)
class CompiledPass:
    """One pass of a compiled set, laid out after an empty state: ``at(past)`` places it after a state of ``past``
    tokens. ``over``: the long question whose trunk (all but its last token, ``lead`` tokens) is prefilled onto the
    state before this pass runs on the longer state; None for a pass over the state itself."""

    batch: PackedBatch  # positions from 0 at the end of the state (and of ``lead``)
    parts: tuple  # ((question index, option indices), ...): what the pass answers, by question
    over: int | None
    lead: int
    options: np.ndarray  # [O_p] int64: the set's flat option numbers this pass answers
    rows: np.ndarray  # [E] int64: the read-out rows of every option's path, option after option
    segment: np.ndarray  # [E] int64: which of ``options`` each of ``rows`` belongs to
    last: np.ndarray  # [O_p] int64: each option's last read-out row (where a decision head's score is read)

    def at(self, past: int) -> PackedBatch:
        """The pass after a state of ``past`` tokens: its positions moved on, everything else as compiled."""
        b = self.batch
        return PackedBatch(b.input_ids, b.position_ids + (past + self.lead), b.tree_mask, b.readout_index,
                           b.readout_target, b.option_readouts, b.tree_order, b.token_task)

    def values(self, logprob: np.ndarray, offset: int = 0) -> np.ndarray:
        """[O_p] float64: each option's summed log-likelihood (the chain rule over its path) from the pass's target
        log-probs ``logprob`` (this pass's read-outs starting at ``offset`` in a merged pass)."""
        return np.bincount(self.segment, weights=logprob[self.rows + offset], minlength=self.options.shape[0])

    @property
    def top(self) -> int:
        """The last position the pass reaches past the end of the state (its trunk's included)."""
        return self.lead + int(self.batch.position_ids.max())


@dataclass(frozen=True, eq=False)
class QuestionSet:
    """Questions compiled for one engine: their tokens and the passes that answer them, for any state.

    Options are numbered flat, question after question in the set's order: question ``i``'s options are
    ``starts[i]:starts[i] + counts[i]``. ``Engine.compile`` returns one; ``Engine.ask`` takes it in place of the
    questions (only on the engine that compiled it)."""

    encoded: tuple  # QuestionTokens per question
    passes: tuple  # CompiledPass
    starts: np.ndarray  # [Q] int64
    counts: np.ndarray  # [Q] int64
    lengths: np.ndarray  # [O] float64: each option's tokens
    questions: Mapping | None = None  # a caller's copy of the questions, in a set it holds (``Planner.hold``)
    key: tuple | None = None  # its block size and content (content_key), where it is cached
    stamp: object = None  # the compiling planner's: a set is asked only of the engine that compiled it
    memo: dict = field(default_factory=dict, repr=False)  # per read-out: priors, calibrations (answering's)

    @cached_property
    def packed_tokens(self) -> int:
        """Packed tokens over all its passes."""
        return sum(p.batch.num_tokens for p in self.passes)

    @cached_property
    def attention(self) -> tuple[int, int]:
        """(packed tokens, their attention entries past the state's) over all passes: a pass of N tokens after P
        state tokens computes N (P + lead + N) query-key entries, so the set's total is ``past * tokens + entries``."""
        return self.packed_tokens, sum(p.batch.num_tokens * (p.lead + p.batch.num_tokens) for p in self.passes)

    @cached_property
    def longs(self) -> tuple:
        """The questions whose trunk is prefilled onto the state (too long for a pass), in order."""
        return tuple(sorted({p.over for p in self.passes if p.over is not None}))

    @cached_property
    def reach(self) -> int:
        """The last position any pass reaches past the end of the state."""
        return max((p.top for p in self.passes), default=0)

    @cached_property
    def nbytes(self) -> int:
        """Bytes its arrays hold (what the set cache counts)."""
        arrays = [a for p in self.passes for a in (*vars(p.batch).values(), p.options, p.rows, p.segment, p.last)
                  if isinstance(a, np.ndarray)]
        tokens = sum(len(q.trunk) + sum(map(len, q.options)) for q in self.encoded)
        return sum(a.nbytes for a in arrays) + 36 * tokens  # a token id in a tuple: its pointer and int object

    @cached_property
    def digest(self) -> str:
        """A hex digest of what the model is asked (every question's token ids and task, in order): requests with
        equal digests ask the very same questions (their passes are run once for all of them)."""
        h = hashlib.blake2b(digest_size=16)
        for q in self.encoded:
            h.update(repr((q.trunk, q.options, q.task)).encode())
        return h.hexdigest()

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Per question, its options' slice of a flat [O] array."""
        return [flat[a:a + k] for a, k in zip(self.starts.tolist(), self.counts.tolist())]

    def __repr__(self) -> str:
        return (f"QuestionSet({len(self.encoded)} questions, {len(self.lengths)} options, {self.packed_tokens} packed "
                f"tokens in {len(self.passes)} pass{'es' if len(self.passes) != 1 else ''}, {self.digest[:16]})")


def option_map(parts: tuple, encoded: tuple, starts: np.ndarray, batch: PackedBatch) -> tuple:
    """(options, rows, segment, last) of a pass (``CompiledPass``'s read-out map) from its ``parts`` and the batch's
    ``option_readouts`` (per question of the pass, per option, its read-out rows)."""
    options, paths = [], []
    for (i, group), readouts in zip(parts, batch.option_readouts):
        options += [int(starts[i]) + k for k in group]
        paths += readouts
    segment = np.repeat(np.arange(len(paths), dtype=np.int64), [len(p) for p in paths])
    rows = np.concatenate(paths) if paths else np.zeros(0, np.int64)
    last = np.array([p[-1] for p in paths], dtype=np.int64)
    return np.array(options, dtype=np.int64), rows, segment, last


def layout_of(encoded: tuple) -> tuple:
    """(starts, counts, lengths) of the flat option numbering of ``encoded``."""
    counts = np.array([len(q.options) for q in encoded], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    lengths = np.array([len(o) for q in encoded for o in q.options], dtype=np.float64)
    return starts, counts, lengths


def _text(value):
    """A caller value as the model reads it: strings and None as they are, JSON values as their canonical text."""
    return value if value is None or isinstance(value, str) else as_text(value)


def content_key(questions) -> tuple | None:
    """A question set's identity in the cache: each id, question class, instruction, option (with its description)
    and task, in the order given, as the model reads them; None when ``questions`` is not a mapping of questions
    (compiling it then says what is wrong)."""
    if not isinstance(questions, Mapping):
        return None
    key = []
    try:
        for qid, q in questions.items():
            crit = q.criteria
            if isinstance(crit, Mapping):
                crit = tuple((k, _text(v)) for k, v in crit.items())
            elif crit is not None:
                crit = tuple(map(_text, crit))
            key.append((qid, type(q), _text(q.instructions), crit, q.task))
    except (AttributeError, TypeError, ValueError):
        return None
    return tuple(key)
