"""Options that share their first token, multi-token and Chinese labels are scored by their full tokens."""

import numpy as np
import pytest

from onepass import Choice

pytestmark = pytest.mark.slow

FRAUD = Choice("Which label did the analyst give the case?", {"fraud": None, "fraud review": None})
ZH = Choice("这段评论的情感是什么?", {"积极": "positive", "消极": "negative"})


def test_fraud_and_fraud_review_share_a_first_token_but_not_a_score(engine):
    q = engine.encode_questions({"case": FRAUD})[0]
    fraud, review = q.options
    assert fraud[0] == review[0] and len(review) > len(fraud), "the labels should share their first token"
    lp = engine.option_logprobs("Case note: the analyst marked the case as fraud review.", [q])[0]
    assert abs(lp[0] - lp[1]) > 0.1, "a first-token read-out would tie them"
    said_review = engine.ask("Case note: this payment was flagged and the analyst marked the case as fraud review.",
                             {"q": FRAUD})["q"].probabilities["fraud review"]
    said_fraud = engine.ask("Case note: the card was stolen and used; the analyst marked the case as fraud.",
                            {"q": FRAUD})["q"].probabilities["fraud review"]
    assert said_review > said_fraud + 0.05, (said_review, said_fraud)


def test_chinese_labels_split_into_several_tokens_follow_the_text(engine):
    q = engine.encode_questions({"zh": ZH})[0]
    assert all(len(o) >= 3 for o in q.options), "each Chinese label is several byte-level tokens + end"
    pos = engine.ask("这部电影太棒了，我非常喜欢，演员的表演令人感动。", {"q": ZH})["q"].probabilities["积极"]
    neg = engine.ask("这部电影太糟糕了，浪费时间，我非常失望。", {"q": ZH})["q"].probabilities["积极"]
    assert pos > neg + 0.05, (pos, neg)
    assert not np.isclose(pos, 0.5, atol=0.02) or not np.isclose(neg, 0.5, atol=0.02)
