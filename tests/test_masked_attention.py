"""The exact masked-attention forms that ``benchmarks/masked_attention.py`` times (issue 46): on the tiny Llama, both
forms equal the dense pass, and hiding the shared tokens (the negative control) does not."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import masked_attention as ma  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends.torch_backend import decoder_from_engine  # noqa: E402
from onepass.runtime.core.tree import QuestionTokens, pack  # noqa: E402


def _questions(rng) -> list:
    """Questions whose trunks share a 3-token prefix (shared tokens), one much longer than the rest (a wide block),
    multi-token options sharing first tokens."""
    out = []
    for i in range(7):
        private = tuple(int(t) for t in rng.integers(100, 900, 4 + (30 if i == 3 else i)))
        out.append(QuestionTokens(trunk=(11, 12, 13, *private), options=((21, 22), (21, 23), (24,))))
    return out


@pytest.fixture(scope="module")
def case(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir, backend="onnxruntime")
    decoder = decoder_from_engine(engine.root, engine.manifest)
    d, past, rng = decoder.dims, 9, np.random.default_rng(3)
    kv = [rng.standard_normal((d.num_kv_heads, past, d.head_dim)).astype(np.float32) for _ in range(2 * d.num_layers)]
    batch = pack(_questions(rng), past_len=past)
    return decoder, batch, kv, past


def test_the_layout_covers_each_tokens_tree_once(case):
    _, batch, _, _ = case
    lay = ma.layout(batch)
    assert list(lay["global_index"]) == [0, 1, 2]  # the shared trunk prefix, packed first
    blocks, size = lay["block_index"].shape
    assert size >= 34 and size % 8 == 0 and blocks < len(batch.option_readouts)  # short questions share a block
    assert sorted(lay["token_slot"]) == sorted(set(lay["token_slot"]))  # one slot per token
    partial = dataclasses.replace(batch, option_readouts=batch.option_readouts[:-1])  # a question's tokens left out
    with pytest.raises(ValueError, match="exactly once"):
        ma.layout(partial)


def test_both_forms_equal_the_dense_pass(case):
    decoder, batch, kv, past = case
    lay = ma.layout(batch)
    dense, skipping = ma.feeds(batch, kv, past, lay)
    modules = {form: ma.SkippingDecoder(decoder, form).eval() for form in ma.FORMS}
    diff, reference = ma.parity_torch(decoder, modules, dense, skipping)
    assert np.isfinite(reference).all()
    for form in ma.FORMS:
        assert diff[form] <= ma.TOLERANCE, (form, diff)
    assert diff["negative control (shared tokens hidden)"] > 100 * ma.TOLERANCE
