"""Question sets compiled once (``Engine.compile``, ``Planner.compile``) and replayed after any state.

* The backend gets exactly what packing the questions afresh after that state gives (``tree.pack``: the uncompiled
  path, an independent construction of the same pass), array for array, for two states of different lengths; the
  negative control: a set placed one position off is caught by the same comparison.
* Answers from a compiled set equal answers from the questions, and each question asked alone (1e-4 on
  log-likelihoods); several requests about one state with different sets, joined side by side into one pass, equal
  each alone, and requests with the same set run it once.
* The cache: found again by content (the same object, a hit counted), a changed id, option or description is another
  set; bounded by bytes; a set from another engine or from token ids alone is refused with a typed error.
* A large set keeps no [N, N] mask: it is built when the pass runs, with the same answers.
* The engine thread's stage calls nothing of the Engine: with every Engine method broken, the runner still answers.
"""

from __future__ import annotations

import numpy as np
import pytest

from onepass import Choice, Engine, Noul, Score
from onepass.runtime.core import question_set
from onepass.runtime.core.errors import InvalidRequest
from onepass.runtime.core.tree import pack

SHORT = "The parcel arrived late."
LONG = ("Order 4521: the parcel arrived late, the box was damaged and the charger does not work. The customer was "
        "billed twice and wants the duplicate charge reversed before Friday.")
QUESTIONS = {
    "late": Noul("Did the parcel arrive late?"),
    "team": Choice("Which team should handle this?", {"billing": "payments", "shipping": None, "sales": None}),
    "mood": Score("How upset is the customer?", ["Calm", "Annoyed", "Very angry"]),
}
TOL = 1e-4  # log-likelihoods, packed vs alone (measured ~5e-6)
FIELDS = ("input_ids", "position_ids", "tree_mask", "readout_index", "readout_target", "tree_order")


@pytest.fixture
def tiny(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    yield engine
    engine.close()


def _recorded(engine, monkeypatch) -> list:
    """The batches the backend's score pass is given, from now on."""
    seen, real = [], engine.backend.score_all

    def score_all(kv, batch):
        seen.append(batch)
        return real(kv, batch)
    monkeypatch.setattr(engine.backend, "score_all", score_all)
    return seen


def _same_inputs(got, want) -> bool:
    return all(np.array_equal(getattr(got, f), getattr(want, f)) for f in FIELDS)


def test_a_compiled_set_feeds_the_backend_what_packing_it_afresh_gives(tiny, monkeypatch):
    compiled = tiny.compile(QUESTIONS)
    seen = _recorded(tiny, monkeypatch)
    for text in (SHORT, LONG):
        state = tiny.state(text)
        tiny.ask(state, compiled)
        fresh = pack(tiny.encode_questions(QUESTIONS), state.num_tokens)  # the uncompiled path, built afresh
        assert len(seen) == 1 and _same_inputs(seen.pop(), fresh), text
    assert tiny.state(SHORT).num_tokens != tiny.state(LONG).num_tokens


def test_a_set_placed_one_position_off_is_caught(tiny, monkeypatch):
    """Negative control of the comparison above: the same check fails on a placement shifted by one."""
    seen = _recorded(tiny, monkeypatch)
    real = tiny.planner.place
    monkeypatch.setattr(tiny.planner, "place", lambda qs, past: real(qs, past + 1))
    state = tiny.state(SHORT)
    tiny.ask(state, QUESTIONS)
    assert not _same_inputs(seen.pop(), pack(tiny.encode_questions(QUESTIONS), state.num_tokens))


def _logprobs(answers) -> dict:
    return {qid: np.log(list(a.probabilities.values())) if hasattr(a, "probabilities") else
            np.log([a.noul, 1 - a.noul]) for qid, a in answers.items()}


def _close(a: dict, b: dict, tol: float = TOL) -> float:
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in b)
    assert diff <= tol, diff
    return diff


def test_compiled_answers_equal_the_questions_asked_and_each_alone(tiny):
    state = tiny.state(LONG)
    compiled = _logprobs(tiny.ask(state, tiny.compile(QUESTIONS)))
    _close(compiled, _logprobs(tiny.ask(state, dict(QUESTIONS))), 0.0)  # the same set: the very same pass
    alone = {}
    for qid, q in QUESTIONS.items():
        alone.update(_logprobs(tiny.ask(state, {qid: q})))
    _close(compiled, alone)


def test_different_sets_about_one_state_join_one_pass_and_the_same_set_runs_once(tiny, monkeypatch):
    state = tiny.state(LONG)
    singles = [{qid: q} for qid, q in QUESTIONS.items()]
    alone = [_logprobs(tiny.ask(state, q)) for q in singles]
    seen = _recorded(tiny, monkeypatch)
    results = tiny.run_group([tiny.prepare(state, q) for q in singles])
    assert len(seen) == 1 and seen[0].num_tokens == sum(tiny.compile(q).packed_tokens for q in singles)
    for got, want in zip(results, alone):
        _close(_logprobs(got.answers), want)
    seen.clear()
    results = tiny.run_group([tiny.prepare(state, QUESTIONS) for _ in range(3)])
    assert len(seen) == 1 and seen[0].num_tokens == tiny.compile(QUESTIONS).packed_tokens
    assert results[0].answers == results[1].answers == results[2].answers
    seen.clear()  # the same questions under other ids, compiled apart: still one run, the very answers of alone
    renamed = {f"{qid}-2": q for qid, q in QUESTIONS.items()}
    assert tiny.compile(renamed) is not tiny.compile(QUESTIONS)
    first, second = tiny.run_group([tiny.prepare(state, QUESTIONS), tiny.prepare(state, renamed)])
    assert len(seen) == 1 and list(first.answers.values()) == list(second.answers.values())


def test_a_set_is_kept_the_second_time_and_found_again_by_its_content_only(tiny):
    """A set compiled once is not cached (a one-off set never pushes a repeated one out); compiled a second time it
    is, and the same content finds that very set (a hit counted), whatever objects carry it."""
    sets, compile_ = tiny.question_sets, tiny.planner.compile
    once = compile_(QUESTIONS)
    assert len(sets) == 0 and compile_(QUESTIONS) is not once
    first = compile_(QUESTIONS)
    hits = sets.hits
    assert compile_({k: v for k, v in QUESTIONS.items()}) is first and sets.hits == hits + 1
    renamed = {("late2" if k == "late" else k): v for k, v in QUESTIONS.items()}
    described = {**QUESTIONS, "team": Choice("Which team should handle this?",
                                             {"billing": "payments and refunds", "shipping": None, "sales": None})}
    reordered = dict(reversed(list(QUESTIONS.items())))
    others = [compile_(q) for q in (renamed, described, reordered) for _ in range(2)][1::2]
    assert all(o is not first for o in others) and len({id(o) for o in others}) == 3 and len(sets) == 4
    held = tiny.compile(QUESTIONS)  # a caller's: its own copy of the questions, the cached set's passes
    assert held is not first and held.passes is first.passes and held.questions == QUESTIONS
    assert question_set.content_key({"a": "not a question"}) is None
    with pytest.raises(InvalidRequest, match="expected a Noul, Choice or Score question"):
        tiny.compile({"a": "not a question"})


def test_a_held_set_answers_as_compiled_whatever_the_callers_objects_become(tiny):
    """A held set keeps a copy of its questions: an option removed later from the caller's Choice changes nothing of
    its answers. Control: the caller's changed question, asked as a dict, is answered as it now is."""
    team = Choice("Which team should handle this?", {"billing": None, "shipping": None, "zzz other": None})
    held = tiny.compile({"team": team})
    want = tiny.ask(LONG, held)["team"].probabilities
    team.criteria.pop("billing")
    assert tiny.ask(LONG, held)["team"].probabilities == want and set(want) == {"billing", "shipping", "zzz other"}
    assert set(tiny.ask(LONG, {"team": team})["team"].probabilities) == {"shipping", "zzz other"}


def test_the_cache_is_bounded_by_bytes(tiny):
    sets, compile_ = tiny.question_sets, tiny.planner.compile
    one = [compile_({"q0": Noul("Question number 0?")}) for _ in range(2)][-1]
    sets.max_bytes = 3 * one.nbytes
    for i in range(1, 10):
        for _ in range(2):
            compile_({f"q{i}": Noul(f"Question number {i}?")})
    assert len(sets) <= 3 and sets.bytes <= sets.max_bytes
    assert compile_({"q0": Noul("Question number 0?")}) is not one  # evicted, compiled again


def test_a_set_of_another_engine_or_of_token_ids_alone_is_refused(tiny, tiny_engine_dir):
    other = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    try:
        with pytest.raises(InvalidRequest, match="compiled by another engine"):
            tiny.ask(SHORT, other.compile(QUESTIONS))
        tokens_only = tiny.planner.layout(tiny.encode_questions(QUESTIONS))
        with pytest.raises(InvalidRequest, match="compile the questions with the engine that answers them"):
            tiny.ask(SHORT, tokens_only)
    finally:
        other.close()


def test_a_large_set_keeps_no_mask_and_answers_the_same(tiny, monkeypatch):
    state = tiny.state(LONG)
    kept = tiny.compile(QUESTIONS)
    assert all(p.batch.tree_mask is not None for p in kept.passes)
    want = _logprobs(tiny.ask(state, kept))
    monkeypatch.setattr(question_set, "KEEP_MASK_BYTES", 0)
    monkeypatch.setattr("onepass.runtime.core.planner.KEEP_MASK_BYTES", 0)
    tiny.question_sets.clear()
    light = tiny.compile(QUESTIONS)  # compiled again: its masks were not kept
    assert all(p.batch.tree_mask is None for p in light.passes)
    result = tiny.run(state, light)
    _close(_logprobs(result.answers), want, 0.0)
    assert result.timings["pack"] > 0


def test_the_runner_answers_with_every_engine_method_broken(tiny, monkeypatch):
    """The engine thread's stage is handed Prepared requests and nothing calls back into the Engine: with each of the
    Engine's methods replaced by one that fails, a prepared group is still answered."""
    state = tiny.state(SHORT)
    prepared = [tiny.prepare(state, QUESTIONS), tiny.prepare(SHORT, {"other": Noul("Is it about a parcel?")})]
    want = [r.answers for r in tiny.run_group(prepared)]
    runner = tiny.runner

    def broken(*args, **kwargs):
        raise AssertionError("the runner called back into the Engine")
    for name in dir(Engine):
        if callable(getattr(Engine, name)) and not name.startswith("__"):
            monkeypatch.setattr(tiny, name, broken, raising=False)
    got = runner.run_group(prepared)
    assert [r.answers for r in got] == want
    with pytest.raises(AssertionError, match="called back"):  # the control: the patch does break the engine
        tiny.run_group(prepared)


def test_a_backend_that_reads_the_tree_in_2n_numbers_is_handed_no_mask(tiny, monkeypatch):
    """The fused GPU pass reads ``tree_order`` only: the runner hands such a backend its passes, joined ones too,
    without an [N, N] mask (none built or joined for it), and the answers are the same. Control: a backend that
    reads the mask gets it."""
    from onepass.runtime.backends.batch import with_mask

    state = tiny.state(LONG)
    singles = [{qid: q} for qid, q in QUESTIONS.items()]
    want = [r.answers for r in tiny.run_group([tiny.prepare(state, q) for q in singles])]
    real = tiny.backend.score_all
    seen = _recorded(tiny, monkeypatch)
    tiny.run_group([tiny.prepare(state, q) for q in singles])
    assert len(seen) == 1 and seen.pop().tree_mask is not None  # the control: ONNX Runtime reads the mask
    monkeypatch.setattr(type(tiny.backend), "reads_tree_mask", False, raising=False)
    monkeypatch.setattr(tiny.backend, "score_all", lambda kv, batch: seen.append(batch) or real(kv, with_mask(batch)))
    got = [r.answers for r in tiny.run_group([tiny.prepare(state, q) for q in singles])]
    assert len(seen) == 1 and seen[0].tree_mask is None and seen[0].tree_order is not None
    assert got == want
