"""Options that share their first token, multi-token and Chinese labels are scored by their full tokens.

The small default model is a weak zero-shot classifier, so these tests check the scoring, not
the model's judgement: every option's log-likelihood is its exact chain-rule value (against
transformers, one option at a time), options sharing a first token do not tie, and the answer
moves with the state.
"""

import numpy as np
import pytest

from onepass import Choice

pytestmark = pytest.mark.slow

FRAUD = Choice("Which label did the analyst give the case?", {"fraud": None, "fraud review": None})
ZH = Choice("这段评论的情感是什么?", {"积极": "positive", "消极": "negative"})
REVIEW_NOTE = "Case note: this payment was flagged and the analyst marked the case as fraud review."
FRAUD_NOTE = "Case note: the card was stolen and used; the analyst marked the case as fraud."
ZH_POS, ZH_NEG = "这部电影太棒了，我非常喜欢，演员的表演令人感动。", "这部电影太糟糕了，浪费时间，我非常失望。"


def _check_exact(engine, hf_model, text, question):
    from reference import option_logprobs_alone

    tokens = engine.encode_questions({"q": question})
    state = engine.state(text)
    got = engine.option_logprobs(state, tokens)[0]
    np.testing.assert_allclose(got, option_logprobs_alone(hf_model, state.ids, tokens[0]), rtol=0, atol=5e-4)
    return tokens[0], got


def test_fraud_and_fraud_review_share_a_first_token_but_not_a_score(engine, hf_model):
    q, lp = _check_exact(engine, hf_model, REVIEW_NOTE, FRAUD)
    fraud, review = q.options
    assert fraud[0] == review[0] and len(review) > len(fraud), "the labels should share their first token"
    # negative control: a read-out of the first option token alone would tie them
    first_only = engine.option_logprobs(REVIEW_NOTE, [type(q)(q.trunk, ((fraud[0],),))])[0][0]
    assert abs(lp[0] - lp[1]) > 0.1 and abs(lp[1] - first_only) > 0.1
    p_review = engine.ask(REVIEW_NOTE, {"q": FRAUD})["q"].probabilities["fraud review"]
    p_fraud = engine.ask(FRAUD_NOTE, {"q": FRAUD})["q"].probabilities["fraud review"]
    assert abs(p_review - 0.5) > 0.02 and abs(p_review - p_fraud) > 0.01, (p_review, p_fraud)


def test_chinese_labels_split_into_several_tokens(engine, hf_model):
    q, lp_pos = _check_exact(engine, hf_model, ZH_POS, ZH)
    _, lp_neg = _check_exact(engine, hf_model, ZH_NEG, ZH)
    assert all(len(o) >= 3 for o in q.options), "each Chinese label is several byte-level tokens + end"
    pos = engine.ask(ZH_POS, {"q": ZH})["q"].probabilities["积极"]
    assert abs(pos - 0.5) > 0.02, pos  # the multi-token labels do not tie
    # the state is read: both labels' exact log-likelihoods move with it (the tuned default judges Chinese
    # sentiment weakly, P(积极) 0.538 vs 0.539, so its probabilities are not what this checks)
    assert np.abs(lp_pos - lp_neg).min() > 0.05, (lp_pos, lp_neg)
