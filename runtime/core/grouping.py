"""Prepared requests about one state answered together: the state looked up or prefilled once, one merged pass (or
the blocks it splits into), each request's answers as if it were asked alone."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .errors import DeadlineExceeded
from .planner import Prepared


@dataclass(frozen=True)
class Result:
    """Answers of one request plus what was spent: tokens, the state tokens served from the cache, and the
    milliseconds of each stage (tokenize, prefill — 0 when cached —, pack — the packed tree, its mask and
    positions —, score — the backend's passes; a merged pass is counted for each request it answered —,
    readout)."""

    answers: dict
    input_tokens: int
    packed_tokens: int
    cached_tokens: int = 0
    timings: dict = field(default_factory=dict)


def answer_group(engine, prepared: list[Prepared], readout: str | None = None, deadline: float | None = None) -> list:
    """Answer prepared requests about ONE state (equal ``key``) in one merged pass (or the blocks it splits
    into): the state is looked up or prefilled once for the group, nothing is tokenised again.

    Each request's questions are separate subtrees of the packed tree, so every answer equals its request run
    alone. Returns, per request, a Result or the exception it raised: a failing request never fails the others —
    when a merged pass fails, its requests are scored again one by one. ``deadline`` (monotonic seconds, the
    latest of the waiters'): past it, no further pass starts, and the requests get ``DeadlineExceeded`` (a
    request split into blocks stops between blocks)."""
    clocks = [dict(p.timings) for p in prepared]
    try:
        if prepared[0].state is not None:
            state, hit = prepared[0].state, True
            clocks[0]["prefill"] = 0.0
        else:
            state, hit = engine.states.of_ids(prepared[0].ids, clocks[0], deadline)
    except Exception as err:  # noqa: BLE001 - the requests share the state, and its failure
        return [err] * len(prepared)
    # each later request looks the state up in the cache as it would alone (the cache's counts and each answer's
    # cached tokens say so), but is never prefilled again
    hits = [hit] + [p.state is not None or engine.cache.get(state.ids) is not None for p in prepared[1:]]
    shared: dict = {}  # the merged pass's pack and score, the same for every member
    try:
        _, merged, merged_heads = engine._score(state, [q for p in prepared for q in p.encoded], shared, deadline)
        scored = list(zip(*_split(merged, merged_heads, [len(p.encoded) for p in prepared])))
    except DeadlineExceeded as err:
        return [err] * len(prepared)
    except Exception as err:  # noqa: BLE001 - a fault: each request alone, so that it can only fail itself
        if len(prepared) == 1:
            return [err]
        scored = [_score_alone(engine, state, p.encoded, shared, deadline) for p in prepared]
    out: list = []
    for p, clock, cached, mine in zip(prepared, clocks, hits, scored):
        if isinstance(mine, BaseException):
            out.append(mine)
            continue
        try:
            t0 = time.perf_counter()
            answers = engine.answering.answers(p.questions, p.encoded, mine[0], readout, heads=mine[1])
            stages = {"tokenize": clock.get("tokenize", 0.0), "prefill": clock.get("prefill", 0.0),
                      "pack": clock.get("pack", 0.0) + shared.get("pack", 0.0), "score": shared.get("score", 0.0),
                      "readout": (time.perf_counter() - t0) * 1000}
            out.append(Result(answers, state.num_tokens + p.packed_tokens, p.packed_tokens,
                              state.num_tokens if cached else 0, stages))
        except Exception as err:  # noqa: BLE001 - its failure is its own answer
            out.append(err)
    return out


def _score_alone(engine, state, encoded, clock: dict, deadline: float | None):
    """(logprobs, heads) of one request's questions, or the exception its pass raised."""
    try:
        _, logprobs, heads = engine._score(state, list(encoded), clock, deadline)
    except Exception as err:  # noqa: BLE001 - its failure is its own answer
        return err
    return logprobs, heads


def _split(logprobs: list, heads: list | None, sizes: list[int]) -> tuple[list, list]:
    """A merged pass's per-question values cut back into the requests' (``sizes`` questions each)."""
    cuts = np.cumsum([0, *sizes])
    mine = [logprobs[a:b] for a, b in zip(cuts, cuts[1:])]
    return mine, [None if heads is None else heads[a:b] for a, b in zip(cuts, cuts[1:])]
