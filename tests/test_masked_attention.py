"""The exact masked-attention forms that ``benchmarks/masked_attention.py`` times (issue 46): on the tiny Llama, over
packed batches of several shapes, both forms equal the dense pass, and hiding part of each token's tree (the
negative controls) does not."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import masked_attention as ma  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends import contract  # noqa: E402
from onepass.runtime.backends.batch import pad_batch  # noqa: E402
from onepass.runtime.backends.torch_backend import decoder_from_engine  # noqa: E402
from onepass.runtime.core.tree import QuestionTokens, pack  # noqa: E402

PAST = 9


def _q(trunk, options=((21, 22), (21, 23), (24,))) -> QuestionTokens:
    return QuestionTokens(trunk=tuple(trunk), options=tuple(options))


def _private(rng, n: int) -> tuple:
    return tuple(int(t) for t in rng.integers(100, 900, n))


def _batch(shape: str):
    """(packed batch, past_length) of one shape of question set."""
    rng = np.random.default_rng(3)
    if shape == "one shared prefix, one long question":
        return pack([_q((11, 12, 13, *_private(rng, 4 + (30 if i == 3 else i)))) for i in range(7)], PAST), PAST
    if shape == "prefixes shared by some":
        trunks = [(11, 12, 13, *_private(rng, 3)) for _ in range(3)] + [(31, 32, *_private(rng, 5)) for _ in range(2)]
        return pack([_q(t) for t in trunks + [_private(rng, 6)]], PAST), PAST
    if shape == "nothing shared, past partly padding":
        return pack([_q((40 + i, *_private(rng, 2 + i))) for i in range(4)], PAST), PAST - 3
    if shape == "one-token, identical trunks, an empty private part":
        questions = [_q((5,)), _q((11, 12, 50)), _q((11, 12, 50), ((21, 26), (27,))),  # the same trunk: 21 shared
                     _q((11, 12), ((24,), (25,))), _q((11, 12, 60, 61))]  # the 4th: every token shared
        return pack(questions, PAST), PAST
    if shape == "tasks":  # the same trunk under different tasks: not shared across them
        questions = [_q((11, 12, *_private(rng, 3))) for _ in range(5)]
        return pack(questions, PAST, tasks=[-1, 0, 0, 1, 1]), PAST
    raise ValueError(shape)


SHAPES = ("one shared prefix, one long question", "prefixes shared by some", "nothing shared, past partly padding",
          "one-token, identical trunks, an empty private part", "tasks")


@pytest.fixture(scope="module")
def decoder(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir, backend="onnxruntime")
    return decoder_from_engine(engine.root, engine.manifest)


def _kv(decoder) -> dict:
    """A random state of ``PAST`` rows: the past K/V by the contract's input names."""
    d, rng = decoder.dims, np.random.default_rng(5)
    return {name: rng.standard_normal((d.num_kv_heads, PAST, d.head_dim)).astype(np.float32)
            for name in contract.io_names(d, ())[0]}


@pytest.mark.parametrize("shape", SHAPES)
def test_both_forms_equal_the_dense_pass(decoder, shape):
    batch, past_length = _batch(shape)
    lay = ma.layout(batch)
    dense, skipping = ma.feeds(batch, _kv(decoder), past_length, lay)
    modules = {form: ma.SkippingDecoder(decoder, form).eval() for form in ma.FORMS}
    diff, reference = ma.parity_torch(decoder, modules, dense, skipping)
    assert np.isfinite(reference).all()
    for form in ma.FORMS:
        assert diff[form] <= ma.TOLERANCE, (form, diff)
    if len(lay["global_index"]):  # the benchmark's control: the shared tokens hidden
        assert diff["negative control (shared tokens hidden)"] > 100 * ma.TOLERANCE
    head = ["input_ids", "position_ids", *ma.LAYOUT]
    with torch.no_grad():  # a second control for every shape: each token's block hidden
        blind = {**skipping, "block_mask": np.zeros_like(skipping["block_mask"])}
        for module in modules.values():
            assert np.abs(module(*ma.ordered(blind, head))[0].numpy() - reference).max() > 100 * ma.TOLERANCE


def test_the_layout_shares_what_several_questions_see(decoder):
    batch, _ = _batch("prefixes shared by some")
    lay = ma.layout(batch)
    assert sorted(batch.input_ids[lay["global_index"]]) == [11, 12, 13, 31, 32]
    batch, _ = _batch("one shared prefix, one long question")
    lay = ma.layout(batch)
    blocks, size = lay["block_index"].shape
    assert size >= 34 and size % 8 == 0 and blocks < len(batch.option_readouts)  # short questions share a block
    assert sorted(lay["token_slot"]) == sorted(set(lay["token_slot"]))  # one slot per token


def test_the_layout_refuses_tokens_of_no_question():
    batch, _ = _batch("prefixes shared by some")
    with pytest.raises(ValueError, match="belong to no question"):
        ma.layout(dataclasses.replace(batch, option_readouts=batch.option_readouts[:-1]))
    with pytest.raises(ValueError, match="belong to no question"):  # padding tokens (a bucketed pass)
        ma.layout(pad_batch(batch, batch.num_tokens + 3, batch.readout_index.shape[0]))
