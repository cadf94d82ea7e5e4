"""The engine thread's stage: prepared requests about one state in, each request's answers out.

The runner owns what the engine thread touches: the states (prefills and the state cache), the backend's passes and
the read-out. It is handed :class:`~onepass.runtime.core.planner.Prepared` requests and nothing else, and never calls
back into ``Engine``. For a group of requests about one state it looks the state up or prefills it once, runs the
passes the requests carry (requests with the same compiled question set share them; different sets' passes over the
state are joined side by side up to a block, without packing again: each keeps its own tree, so every answer is the
one it gets alone), and reads each request's answers out of its options' values. It never tokenises, plans or packs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import Backend
from ..backends.batch import concat, with_mask
from .answering import Answering
from .depths import Depths
from .errors import DeadlineExceeded
from .planner import Planner, Prepared
from .question_set import QuestionSet
from .states import State, States


@dataclass(frozen=True)
class Result:
    """Answers of one request plus what was spent: tokens, the state tokens served from the cache, and the
    milliseconds of each stage (tokenize, prefill — 0 when cached —, pack — compiling the questions, placing them
    after the state and joining the group's passes; a long question's trunk prefill included —, score — the backend's
    passes; a merged pass is counted for each request it answered —, readout)."""

    answers: dict
    input_tokens: int
    packed_tokens: int
    cached_tokens: int = 0
    timings: dict = field(default_factory=dict)


Job = tuple  # (QuestionSet, its passes placed after the state: a PackedBatch per pass)


class Runner:
    """The engine-thread stage of one engine: ``run_group`` answers prepared requests about one state; ``logprobs``
    scores token ids of questions over a state (calibration's and the content-free priors' way in)."""

    def __init__(self, backend: Backend, planner: Planner, states: States, manifest, encoder, depths: Depths,
                 task_calibrations: tuple = (), task_heads: tuple = ()):
        self.backend, self.planner, self.states, self.depths = backend, planner, states, depths
        self.answering = Answering(manifest, encoder, self.null_logprobs, task_calibrations, task_heads)
        self._null_text, self._null = manifest.prompt.null_state, None

    def run_group(self, prepared: list[Prepared], readout: str | None = None, deadline: float | None = None) -> list:
        """Answer prepared requests about ONE state (equal ``key``): the state looked up or prefilled once, their
        passes run (merged), each request's answers as if it were asked alone. Returns, per request, a Result or the
        exception it raised: a failing request never fails the others (when a merged pass fails, each question set
        is scored again alone). ``deadline`` (monotonic seconds, the latest of the waiters'): past it, no further pass
        or prefill chunk starts, and the requests get ``DeadlineExceeded``."""
        clocks = [dict(p.timings) for p in prepared]
        try:
            state, hit = self._state(prepared[0], clocks[0], deadline, [p.question_set for p in prepared])
        except Exception as err:  # noqa: BLE001 - the requests share the state, and its failure
            return [err] * len(prepared)
        # each later request looks the state up in the cache as it would alone (the cache's counts and each answer's
        # cached tokens say so), but is never prefilled again
        hits = [hit] + [p.state is not None or self.states.cache.get(state.ids) is not None for p in prepared[1:]]
        # one job per distinct question set, first come first: requests that ask the same questions (whatever their
        # ids, compiled once or twice) share its passes and their values
        keys, jobs = [p.question_set.digest for p in prepared], {}
        for key, p in zip(keys, prepared):
            jobs.setdefault(key, p)
        shared: dict = {}  # the merged passes' pack and score time, the same for every member
        try:
            values = dict(zip(jobs, self.score(state, [(p.question_set, p.plan) for p in jobs.values()], shared,
                                               deadline)))
        except DeadlineExceeded as err:
            return [err] * len(prepared)
        except Exception as err:  # noqa: BLE001 - a fault: each set alone, so that it can only fail its own requests
            if len(jobs) == 1:
                return [err] * len(prepared)
            values = {k: self._alone(state, p, shared, deadline) for k, p in jobs.items()}
        return [self._result(p, state, clock, cached, values[key], shared, readout)
                for p, key, clock, cached in zip(prepared, keys, clocks, hits)]

    def _state(self, prepared: Prepared, clock: dict, deadline: float | None, sets: list) -> tuple[State, bool]:
        """(the group's state, whether it was cached): the caller's prefilled state, or from the cache or prefilled
        to the depth the group's question ``sets`` need."""
        if prepared.state is not None:
            clock["prefill"] = 0.0
            return prepared.state, True
        return self.states.of_ids(prepared.ids, clock, deadline, self.depths.of_sets(sets))

    def _result(self, p: Prepared, state: State, clock: dict, cached: bool, mine, shared: dict, readout):
        """One request's Result from its set's option values, or the exception it met."""
        if isinstance(mine, BaseException):
            return mine
        try:
            t0 = time.perf_counter()
            answers = self.answering.read(p.questions, p.question_set, mine[0], mine[1], readout)
            stages = {"tokenize": clock.get("tokenize", 0.0), "prefill": clock.get("prefill", 0.0),
                      "pack": clock.get("pack", 0.0) + shared.get("pack", 0.0), "score": shared.get("score", 0.0),
                      "readout": (time.perf_counter() - t0) * 1000}
            return Result(answers, state.num_tokens + p.packed_tokens, p.packed_tokens,
                          state.num_tokens if cached else 0, stages)
        except Exception as err:  # noqa: BLE001 - its failure is its own answer
            return err

    def _alone(self, state: State, p: Prepared, clock: dict, deadline: float | None):
        """(values, heads) of one request's set scored alone, or the exception its passes raised."""
        try:
            return self.score(state, [(p.question_set, p.plan)], clock, deadline)[0]
        except Exception as err:  # noqa: BLE001 - its failure is its own answer
            return err

    def score(self, state: State, jobs: list[Job], clock: dict | None = None,
              deadline: float | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per job (a compiled set and its passes placed after ``state``): its options' summed log-likelihoods [O]
        float64 and decision-head scores [O] (None for a graph without a head), numbered as the set numbers them.

        ``clock`` gets ``pack`` (joining the passes, building the tree masks a large set does not keep; a long
        question's trunk prefill included) and ``score`` (the backend's passes) in milliseconds. Past ``deadline`` no
        further pass starts (``DeadlineExceeded``)."""
        t0 = time.perf_counter()
        runs = self._runs(state, jobs, deadline)
        t1 = time.perf_counter()
        values = [np.zeros(len(qs.lengths)) for qs, _ in jobs]
        heads: list = [None] * len(jobs)
        packed, masking = 0, 0.0
        for batch, over, parts in runs:
            if deadline is not None and time.monotonic() > deadline:  # nobody waits for the rest: stop here
                raise DeadlineExceeded(f"every waiter's deadline passed after {packed} packed tokens of this request's "
                                       "passes; the rest were not run")
            if self.backend.reads_tree_mask and batch.tree_mask is None:  # built one pass at a time, counted as pack
                t = time.perf_counter()
                batch = with_mask(batch)
                masking += time.perf_counter() - t
            backend, kv = self.depths.run_on(self.backend, self.depths.of_batch(batch), over.kv)
            with backend.serial():
                logprob, head = backend.score_all(kv, batch)
            packed += batch.num_tokens
            for k, cp, offset in parts:
                values[k][cp.options] = cp.values(logprob, offset)
                if head is not None:
                    heads[k] = heads[k] if heads[k] is not None else np.zeros(len(jobs[k][0].lengths))
                    heads[k][cp.options] = head[cp.last + offset]
        if clock is not None:
            clock["pack"] = (t1 - t0 + masking) * 1000
            clock["score"] = (time.perf_counter() - t1 - masking) * 1000
        return list(zip(values, heads))

    def _runs(self, state: State, jobs: list[Job], deadline: float | None) -> list[tuple]:
        """The passes to run, as (batch, the state it continues, ((job, CompiledPass, read-out offset), ...)): the
        jobs' passes over the state joined up to a block (:meth:`_joined`), then each long question's passes over its
        trunk prefilled onto the state (once per question, and cached)."""
        over_state, longer, runs = [], {}, []
        masks = self.backend.reads_tree_mask
        for k, (qs, plan) in enumerate(jobs):
            for cp, batch in zip(qs.passes, plan):
                batch = batch if masks or batch.tree_mask is None else dataclasses.replace(batch, tree_mask=None)
                if cp.over is None:
                    over_state.append((k, cp, batch))
                else:
                    runs.append((batch, self._longer(state, qs, cp.over, longer, deadline), ((k, cp, 0),)))
        return self._joined(over_state, state) + runs

    def _longer(self, state: State, qs: QuestionSet, over: int, done: dict, deadline: float | None) -> State:
        """``state`` followed by the trunk of ``qs``'s long question ``over`` (prefilled once per run, and cached)."""
        trunk = qs.encoded[over].trunk
        if trunk not in done:
            done[trunk] = self.states.extended(state, qs.encoded[over], deadline)
        return done[trunk]

    def _joined(self, passes: list, state: State) -> list[tuple]:
        """Passes over ``state`` joined side by side (``batch.concat``) while they fit one block of the planner's,
        in order: one job's passes stay as they were planned (already blocks)."""
        block, groups = self.planner.block_tokens, []
        for item in passes:
            n = item[2].num_tokens
            if groups and groups[-1][0] + n <= block and groups[-1][1][-1][0] != item[0]:
                groups[-1][0] += n
                groups[-1][1].append(item)
            else:
                groups.append([n, [item]])
        runs = []
        for _, members in groups:
            if len(members) == 1:
                k, cp, batch = members[0]
                runs.append((batch, state, ((k, cp, 0),)))
                continue
            offsets = np.cumsum([0] + [b.readout_index.shape[0] for _, _, b in members])
            runs.append((concat([b for _, _, b in members]), state,
                         tuple((k, cp, int(off)) for (k, cp, _), off in zip(members, offsets))))
        return runs

    def placed(self, state: State, qs: QuestionSet, deadline: float | None = None) -> list[tuple]:
        """``qs``'s passes after ``state`` as (parts, batch with its mask, the state the batch continues): what
        ``Engine.passes`` shows (a long question's trunk prefilled onto the state, and cached)."""
        longer: dict = {}
        return [(cp.parts, with_mask(batch),
                 state if cp.over is None else self._longer(state, qs, cp.over, longer, deadline))
                for cp, batch in zip(qs.passes, self.planner.place(qs, state.num_tokens))]

    def logprobs(self, state: State, encoded, deadline: float | None = None) -> tuple[list, list | None]:
        """(per question, its options' summed log-likelihoods; per question, head scores or None) of token ids of
        questions (``QuestionTokens``) over ``state``: laid out and placed here (nothing is cached by content)."""
        qs = self.planner.layout(encoded)
        values, heads = self.score(state, [(qs, self.planner.place(qs, state.num_tokens))], deadline=deadline)[0]
        return qs.split(values), (qs.split(heads) if heads is not None else None)

    def null_logprobs(self, encoded) -> list:
        """Questions' option log-likelihoods over the template's content-free state (the ``prior`` read-out's)."""
        if self._null is None:
            self._null = self.states.get(self._null_text)[0]
        return self.logprobs(self._null, encoded)[0]
