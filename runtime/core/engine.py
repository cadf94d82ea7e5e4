"""The decision engine: prefill a state once, answer any number of typed questions in one pass."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from . import manifest as manifest_mod
from . import task_store
from .depths import Depths, open_cut
from .tasks import feed_tasks, no_tasks_on
from ..backends.base import Backend
from .readout_calibration import question_key
from .errors import InvalidRequest, LimitExceeded, OnepassError
from .planner import Planner, Prepared
from .prompt import OLD_OPTION_LINE, PromptEncoder
from .question_set import QuestionSet
from .questions import Answer, Question
from .runner import Result, Runner
from .state_cache import DEFAULT_CACHE_MIB, StateCache
from .states import State, States
from .tree import QuestionTokens
from ..backends.batch import PackedBatch
from .wire import parse_request, response_body

DEFAULT_CACHE_BYTES = DEFAULT_CACHE_MIB << 20
log = logging.getLogger("onepass.engine")
_WARNED: set = set()  # engine directories already warned about


class Engine:
    """An engine directory loaded for serving. Thread-safe for concurrent ``ask`` calls."""

    def __init__(self, root: Path, manifest, backend: Backend, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 cache: StateCache | None = None, tasks: task_store.Tasks | None = None,
                 depths: Depths | None = None):
        self.root = root
        self.manifest = manifest
        self.backend = backend
        self.tasks = tasks  # the tuned tasks stored beside the engine (their slot graph is what the backend runs)
        if tasks is not None:
            feed_tasks(backend, tasks)
        self.encoder = PromptEncoder(str(root / manifest.tokenizer), manifest.prompt)
        self.planner = Planner(self.encoder, manifest.limits, manifest.model.max_position,
                               lambda: backend.block_tokens, tasks.names if tasks else (), manifest.model.hidden_size)
        if manifest.prompt.option_line == OLD_OPTION_LINE and str(root) not in _WARNED:  # once, not per with_limits
            _WARNED.add(str(root))
            log.warning("%s renders a described choice option as %r, which works against it (a choice with only some "
                        "options described can answer an undescribed one); export the engine again for the new "
                        "rendering (its answers change only for described options)", root,
                        OLD_OPTION_LINE.strip())
        # the backend's own device K/V (TensorRT's graph slots, the PyTorch backend's workspace) counts in the budget
        reserved = getattr(backend, "reserved_bytes", 0)
        if reserved and reserved >= cache_bytes:
            log.warning("the backend's graph slots or workspace take %d MiB of the %d MiB state-cache budget: no state will be "
                        "cached; give a larger cache (onepass serve --cache-mib, Engine.load(cache_bytes=...))",
                        reserved >> 20, cache_bytes >> 20)
        self.cache = cache if cache is not None else StateCache(max(0, cache_bytes - reserved))
        # the slot graph cut at the head tasks' depths: passes and prefills that stop where their questions read
        self.depths = depths if depths is not None else Depths.none(manifest.model.num_layers)
        self.states = States(backend, self.planner, self.cache, manifest.limits.prefill_chunk, self.depths)
        # the engine thread's stage: it owns the passes and the read-out, and never calls back into the engine
        self.runner = Runner(backend, self.planner, self.states, manifest, self.encoder, self.depths,
                             tasks.calibrations if tasks else (),
                             tuple(None if h is None else h.beta for h in tasks.heads) if tasks and tasks.heads else ())
        self.answering = self.runner.answering
        self.question_sets = self.planner.sets  # compiled question sets by content (hits and size in /metrics)

    @classmethod
    def load(cls, path: str | os.PathLike, *, verify: bool = True, threads: int | None = None,
             cache_bytes: int = DEFAULT_CACHE_BYTES, backend=None, cut_graphs: bool = True) -> "Engine":
        """Open an engine directory: read and (by default) hash-verify the manifest's files.

        ``backend``: None (or "auto") for the default CPU backend (OpenVINO at f32 where it is installed and
        reproduces the engine's golden file here, else ONNX Runtime: ``onepass.runtime.core.backend_choice.default``), a
        backend's name (``onepass.runtime.backends.BACKENDS``: "onnxruntime", "openvino-cpu", "tensorrt",
        "torch-cpu", "torch-cuda", ...), or a factory ``(root, manifest, threads) -> Backend`` (e.g.
        ``onepass.runtime.backends.factory("torch-cuda", buckets=True)``). ``cut_graphs``: open the slot graph cut
        at the head tasks' depths (``depths.Depths``; False: every pass runs every block, the same answers).
        """
        from .. import backends
        from . import backend_choice

        root = Path(path)
        manifest = manifest_mod.load(root, verify=verify)
        served, tasks = task_store.served(root, manifest, verify)  # with tasks, their slot graph answers
        named = backend is None or isinstance(backend, str)  # a custom factory's options: no cut graph opened
        if backend in (None, backends.AUTO):
            backend = backend_choice.default
        elif isinstance(backend, str):
            if tasks is not None and not backends.backend_class(backend).runs_tasks:
                raise no_tasks_on(backend)
            backend = backends.factory(backend)
        full = backend(root, served, threads)
        depths = None
        try:
            depths = open_cut(root, served, tasks, full, threads) if cut_graphs and named else None
            return cls(root, manifest, full, cache_bytes, tasks=tasks, depths=depths)
        except BaseException:
            full.close()
            if depths is not None:
                depths.close()
            raise

    def close(self) -> None:
        """Drop the cached states and release the backend (device memory, graphs). Engines made by
        :meth:`with_limits` share the backend: close the last one used."""
        self.cache.clear()
        self.question_sets.clear()
        try:
            with self.backend.serial():
                self.backend.close()
        finally:
            self.depths.close()

    def release_memory(self) -> bool:
        """Give back the backend's working memory grown by past large passes (a long state, hundreds of options);
        cached states stay. Answers are unchanged; True if anything was released (OpenVINO, which rebuilds its
        compiled model in about a second; a no-op elsewhere). ``onepass serve`` calls it when idle above 1.2x its
        warm size."""
        released = False
        for backend in (self.backend, *self.depths.backends.values()):  # the cut graphs' backends grow too
            with backend.serial():
                released = backend.release_memory() or released
        return released

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def with_limits(self, **lower) -> "Engine":
        """This engine (same session and cache) with some limits lowered; raising one past the manifest is refused."""
        lower = {k: v for k, v in lower.items() if v is not None}
        if not lower:
            return self
        current = self.manifest.limits
        for key, value in lower.items():
            if value > getattr(current, key):
                raise LimitExceeded(f"{key}={value} is above this engine's {getattr(current, key)}; "
                                    "export an engine with a larger limit instead", key)
        manifest = dataclasses.replace(self.manifest, limits=dataclasses.replace(current, **lower))
        budget = self.cache.max_bytes + getattr(self.backend, "reserved_bytes", 0)  # as this engine was given
        return Engine(self.root, manifest, self.backend, budget, cache=self.cache, tasks=self.tasks,
                      depths=self.depths)

    @property
    def name(self) -> str:
        """The engine's name from its manifest."""
        return self.manifest.name

    # -- states -------------------------------------------------------------------------------

    def state(self, state) -> State:
        """Prefill a state (a string, bytes in UTF-8, or a JSON value) or take it from the cache."""
        return self._state(state)[0]

    def _state(self, state, clock: dict | None = None) -> tuple[State, bool]:
        """(the state, whether it came from the cache); ``clock`` gets the tokenize and prefill milliseconds."""
        return self.states.get(state, clock)

    # -- questions ------------------------------------------------------------------------------

    def prepare(self, state, questions, known: dict | None = None) -> Prepared:
        """A request checked against every limit, its questions compiled (or found compiled), placed after its state
        and sized exactly, without the model: what :meth:`run_group` answers
        (:class:`onepass.runtime.core.planner.Prepared`). Run it off the engine thread. ``known``: {state text: ids}
        shared by the requests of one batch, so a state they share is tokenised once."""
        return self.planner.prepare(state, questions, known)

    def compile(self, questions: Mapping[str, Question]) -> QuestionSet:
        """The questions checked, tokenised, packed and laid out once for any state: ``ask(state, compiled)`` then
        only places them after the state. Asking with the same questions finds the same set without this call (by
        content, in a bounded cache); holding it skips even that lookup. It keeps a copy of the questions: what the
        caller's objects become later changes none of its answers."""
        return self.planner.hold(questions)

    def check_wire(self, body) -> None:
        """The limits a request body meets or not before any of it is validated or tokenised (counts, lengths):
        LimitExceeded, cheaply, for a body that will be refused (:meth:`Planner.check_wire`)."""
        self.planner.check_wire(body)

    def check_counts(self, questions: Mapping[str, Question]) -> None:
        """The limits that need no tokenizer: questions per request, options per question."""
        self.planner.check_counts(questions)

    def question_key(self, question: Question) -> str:
        """The key a calibration group and a gate threshold are stored under: the question's type, instructions and
        options as this engine renders them."""
        return question_key(question.type, self.encoder.instructions(question), self.encoder.options(question))

    def encode_questions(self, questions: Mapping[str, Question]) -> list[QuestionTokens]:
        """Validate a request's questions against the limits and turn them into token ids."""
        return self.planner.encode_questions(questions)

    def pack(self, state: State, encoded: list[QuestionTokens]) -> PackedBatch:
        """The questions packed into ONE pass over a state (at most max_packed_tokens)."""
        return self.planner.pack(state.num_tokens, encoded)

    @property
    def block_tokens(self) -> int:
        """Packed tokens per pass when a request is split into blocks of whole questions (:class:`Planner`)."""
        return self.planner.block_tokens

    def passes(self, state: State, encoded: list[QuestionTokens],
               deadline: float | None = None) -> list[tuple[tuple, PackedBatch, State]]:
        """The packed passes that answer ``encoded`` over ``state`` (:meth:`Planner.passes`), as (((question index,
        option indices), ...), batch, the state the batch continues): a long question's trunk is prefilled onto the
        state (and cached), once every limit passed, and stopped between its chunks past ``deadline``."""
        return self.runner.placed(state, self.planner.layout(encoded), deadline)

    def option_logprobs(self, state, encoded: list[QuestionTokens]) -> list[np.ndarray]:
        """Summed log-likelihood of every option of every question (one packed pass, or blocks of whole
        questions past the backend's block size: see :meth:`passes`)."""
        return self.runner.logprobs(self.state(state), encoded)[0]

    def option_values(self, state, encoded: list[QuestionTokens]) -> tuple[list, list | None]:
        """(summed log-likelihoods, decision-head scores or None) of every option, from ONE packed pass."""
        return self.runner.logprobs(self.state(state), encoded)

    def prior_logprobs(self, encoded: list[QuestionTokens]) -> list[np.ndarray]:
        """Content-free log-likelihoods (state = the template's null state), cached per question."""
        return self.answering.prior_logprobs(encoded)

    def run(self, state, questions, readout: str | None = None) -> Result:
        """Answer questions (id -> question, or a set from :meth:`compile`) about a state in one packed forward
        pass."""
        (result,) = self.run_group([self.prepare(state, questions)], readout)
        if isinstance(result, BaseException):
            raise result
        return result

    def run_many(self, requests: list, readout: str | None = None, deadline: float | None = None) -> list:
        """Answer several ``(state, questions)`` requests; those about the same state share ONE pass.

        Each request is prepared (:meth:`prepare`; a state text they share tokenised once), then grouped by its state's
        token ids and each group answered by
        :meth:`run_group`. Returns, per request, a Result or the exception it raised (OnepassError for bad input): a
        bad or failing request never fails the others. ``deadline``: as :meth:`run_group`'s."""
        out: list = [None] * len(requests)
        groups: dict = {}
        known: dict = {}  # a state the requests share is tokenised once
        for i, (state, questions) in enumerate(requests):
            try:
                prepared = self.prepare(state, questions, known)
            except OnepassError as err:  # a request's failure is its own answer
                out[i] = err
                continue
            groups.setdefault(prepared.key, []).append((i, prepared))
        for members in groups.values():
            results = self.run_group([p for _, p in members], readout, deadline=deadline)
            for (i, _), result in zip(members, results):
                out[i] = result
        return out

    def run_group(self, prepared: list[Prepared], readout: str | None = None, deadline: float | None = None) -> list:
        """Answer prepared requests about ONE state (equal ``key``) in one merged pass (or the blocks it splits
        into), each as if alone (:meth:`onepass.runtime.core.runner.Runner.run_group`): per request, a Result or the
        exception it raised. ``deadline``: past it, no further pass starts (``DeadlineExceeded``)."""
        return self.runner.run_group(prepared, readout, deadline)

    def option_scores(self, questions, encoded, logprobs, readout=None, calibrated: bool = True,
                      heads=None) -> list:
        """Per question, the [K] scores that are soft-maxed: the read-out, then the manifest's calibration
        (:class:`onepass.runtime.core.answering.Answering`)."""
        return self.answering.option_scores(questions, encoded, logprobs, readout, calibrated, heads)

    def ask(self, state, questions, readout: str | None = None,
            min_confidence: float | None = None) -> dict[str, Answer]:
        """Typed answers by question id. ``state`` is a State from :meth:`state` or raw text/JSON; ``questions`` maps
        ids to questions, or is a set from :meth:`compile` (the questions compiled once, for any state).

        With ``min_confidence``, answers whose confidence ((K p_max - 1)/(K - 1); for noul
        |2p - 1|) is below it keep their value and are marked ``abstained``.
        """
        answers = self.run(state, questions, readout).answers
        if min_confidence is None:
            return answers
        if not 0.0 <= min_confidence <= 1.0:
            raise InvalidRequest(f"min_confidence must be within 0..1, got {min_confidence}", "min_confidence")
        return {qid: dataclasses.replace(a, abstained=a.certainty < min_confidence) for qid, a in answers.items()}

    def decide(self, state, model, min_confidence: float | None = None):
        """A pydantic model's fields answered about ``state`` in one packed pass (:mod:`onepass.runtime.core.decide`):
        a ``Decision`` with the validated instance, every field's answer and the fields that abstained."""
        from .decide import decide

        return decide(self, state, model, min_confidence)

    def request(self, body: Mapping) -> dict:
        """Answer a TypeSafe System One request body; returns the response body."""
        state, questions = parse_request(body)
        return response_body(body, self.name, self.run(state, questions))
