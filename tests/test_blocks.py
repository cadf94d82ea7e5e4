"""Segment-blocked scoring: a request larger than the backend's block is answered in blocks of whole questions,
each one pass over the same state K/V, and every answer equals the question asked alone.

The scale claims (5000 questions, a 1000-option choice on one state) run on the tiny Llama (SmolLM2's
architecture and tokenizer, 2 blocks of width 64): the blocking is the same code whatever the model, and the
default model would take minutes per request on this CPU (benchmarks/results/blocks.md has its timings)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from onepass import Choice, Engine, Noul, Score
from onepass.runtime.core.errors import LimitExceeded
from onepass.runtime.core.tree import QuestionTokens, blocks, pack, packed_size

TOL = 2e-5  # blocked == alone: float rounding of other GEMM shapes (measured <= 4e-6 at 13, 64 and 500 questions)
STATE = "Order 4521: the parcel arrived damaged, the charger does not work and the card was billed twice."


def _random_question(rng: random.Random) -> QuestionTokens:
    trunk = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 6)))
    options = {tuple(rng.choice([4, 5, 6, 7]) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))}
    return QuestionTokens(trunk, tuple(sorted(options)))


def test_packed_size_is_the_tokens_a_question_packs_into_alone():
    rng = random.Random(0)
    for _ in range(300):
        q = _random_question(rng)
        assert packed_size(q) == pack([q], past_len=5).num_tokens


@pytest.mark.parametrize("budget", [1, 7, 20, 60])
def test_blocks_cover_every_question_once_within_the_budget(budget):
    rng = random.Random(budget)
    questions = [_random_question(rng) for _ in range(200)]
    groups = blocks(questions, budget)
    assert sorted(i for g in groups for i in g) == list(range(200))
    for g in groups:
        size = pack([questions[i] for i in g], past_len=0).num_tokens
        assert size <= budget or len(g) == 1, (size, budget)  # only a question larger than the budget stands alone
    # control: a budget that holds everything is one block
    assert len(blocks(questions, sum(map(packed_size, questions)))) == 1


def _questions(n: int, seed: int = 0) -> dict:
    """``n`` distinct questions of every type, sharing trunk prefixes the way real requests do."""
    rng = random.Random(seed)
    things = ["refund", "parcel", "charger", "card", "invoice", "courier", "warranty", "screen"]
    out = {}
    for i in range(n):
        kind, thing = i % 3, things[i % len(things)]
        if kind == 0:
            out[f"q{i}"] = Noul(f"Is the {thing} mentioned in note {i}?")
        elif kind == 1:
            names = rng.sample(["billing", "technical", "shipping", "sales", "returns", "legal"], rng.randint(2, 5))
            out[f"q{i}"] = Choice(f"Which team handles the {thing} ({i})?", {n_: None for n_ in names})
        else:
            out[f"q{i}"] = Score(f"How urgent is the {thing} ({i})?", ["Low", "Medium", "High"])
    return out


def _alone(engine, state, encoded, indices) -> dict:
    return {i: engine.option_logprobs(state, [encoded[i]])[0] for i in indices}


def _max_diff(blocked, alone) -> float:
    return max(float(np.abs(blocked[i] - want).max()) for i, want in alone.items())


@pytest.mark.parametrize("n", [1, 13, 64, 500])
def test_blocked_equals_alone_at_1_13_64_500_questions(tiny_engine_dir, monkeypatch, n):
    engine = Engine.load(tiny_engine_dir)
    monkeypatch.setattr(engine.backend, "block_tokens", 256, raising=False)
    questions = _questions(n)
    encoded = engine.encode_questions(questions)
    state = engine.state(STATE)
    passes = engine.passes(state, encoded)
    assert all(b.num_tokens <= 256 for _, b, _ in passes)
    assert (len(passes) > 1) == (n > 1)  # one question is one pass; every larger request here is really split
    blocked = engine.option_logprobs(state, encoded)
    sample = sorted(random.Random(n).sample(range(n), min(n, 40)))
    assert _max_diff(blocked, _alone(engine, state, encoded, sample)) <= TOL


def test_a_block_with_wrong_positions_is_caught(tiny_engine_dir, monkeypatch):
    """Negative control: the same comparison fails when a block's questions sit one position too far."""
    import dataclasses

    engine = Engine.load(tiny_engine_dir)
    monkeypatch.setattr(engine.backend, "block_tokens", 256, raising=False)
    encoded = engine.encode_questions(_questions(64))
    state = engine.state(STATE)
    alone = _alone(engine, state, encoded, range(64))
    real = engine.planner.place
    monkeypatch.setattr(engine.planner, "place", lambda qs, past: tuple(
        dataclasses.replace(b, position_ids=b.position_ids + (1 if k == 1 else 0)) for k, b in enumerate(real(qs, past))))
    assert _max_diff(engine.option_logprobs(state, encoded), alone) > 100 * TOL


@pytest.mark.slow
def test_5000_questions_on_one_state_equal_each_asked_alone(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir)
    assert engine.manifest.limits.max_questions == 5000
    questions = _questions(5000, seed=1)
    result = engine.run(STATE, questions)
    assert len(result.answers) == 5000 and result.packed_tokens > engine.manifest.limits.max_packed_tokens
    encoded = engine.encode_questions(questions)
    state = engine.state(STATE)
    blocked = engine.option_logprobs(state, encoded)
    sample = sorted(random.Random(5).sample(range(5000), 40))
    assert _max_diff(blocked, _alone(engine, state, encoded, sample)) <= TOL
    with pytest.raises(LimitExceeded, match="5001 questions; this engine allows at most 5000"):
        engine.encode_questions(_questions(5001))


@pytest.mark.slow
def test_a_1000_option_choice_equals_transformers_option_by_option(tiny_engine_dir, tiny_llama_dir):
    """One choice of 1000 multi-token options, their trie shared in one pass, against a plain HF forward per
    option (the independent reference of tests/reference.py) on a sample of options."""
    from onepass.export.model_source import load_model
    from reference import option_logprobs_alone

    engine = Engine.load(tiny_engine_dir)
    names = [f"option {i}" for i in range(1000)]
    question = Choice("Which option is meant?", {n: None for n in names})
    encoded = engine.encode_questions({"q": question})
    state = engine.state(STATE)
    got = engine.option_logprobs(state, encoded)[0]
    assert got.shape == (1000,)
    pick = sorted(random.Random(0).sample(range(1000), 4))  # each a plain forward over ~7000 tokens
    sub = QuestionTokens(encoded[0].trunk, tuple(encoded[0].options[i] for i in pick))
    model = load_model(tiny_llama_dir).model
    model.set_attn_implementation("sdpa")  # plain causal attention over ~7000 tokens: eager's L x L scores take 15 s
    want = option_logprobs_alone(model, state.ids, sub)
    np.testing.assert_allclose(got[pick], want, rtol=0, atol=5e-4)
    with pytest.raises(LimitExceeded, match="1001 options; this engine allows at most 1000"):
        engine.encode_questions({"q": Choice("Which?", {f"o{i}": None for i in range(1001)})})


def test_over_the_request_token_limit_is_refused_before_any_pass(tiny_engine_dir, monkeypatch):
    engine = Engine.load(tiny_engine_dir).with_limits(max_request_tokens=800)
    calls = []
    monkeypatch.setattr(engine.backend, "score_all", lambda *a: calls.append(a))
    with pytest.raises(LimitExceeded, match=r"questions pack into \d+ tokens; .* at most 800 per request"):
        engine.run(STATE, _questions(64))  # ~1700 packed tokens, ~2900 before sharing
    assert not calls
