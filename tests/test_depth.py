"""A decision head read after k of the model's blocks, and an engine that runs only those k blocks.

* What tune's scorer reads at a depth (``PackedScorer.scores_and_features(depths=...)``, one pass for every depth) is
  the residual stream after k blocks, final-normed: checked against transformers' own ``output_hidden_states`` of each
  option asked alone as plain causal text (an independent reference), and against the decoder cut at k.
* An engine exported at a depth (``export_engine(depth=k)``, a head with ``HeadInfo.depth``) holds k blocks: its graph
  has k blocks' past inputs, its prefill and pass stop there, its packed answers equal each question asked alone
  (<= 1e-4) and the head's scores from the scorer's features at k (<= 1e-4). Negative controls: the same head read at
  the full depth, or the scorer's depth-k features compared with the full depth's, differ by far more.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from onepass.runtime.core.questions import Choice, Noul, Score  # noqa: E402

STATE = "Note 3: the meeting moved to room 7 on Tuesday; bring the draft budget and the two reports."
QUESTIONS = {"moved": Noul("Did the meeting move?"),
             "room": Choice("Which room?", criteria={"a": "room 3", "b": "room 7", "c": "the hall"}),
             "sure": Score("How clear is the note?", criteria=("vague", "plain", "exact"))}
TOL = 1e-4


def _loaded(tiny_llama_dir):
    from onepass.export.model_source import load_model

    return load_model(str(tiny_llama_dir), [])


def _scorer(model, readout: str = "mean"):
    from onepass.calibration.tune.trainer import PackedScorer
    from onepass.runtime.backends.torch_decoder import PackedDecoder

    return PackedScorer(PackedDecoder(model).eval(), readout, torch.device("cpu"), False, 0)


def _chunk(engine_dir, questions=QUESTIONS):
    from onepass.calibration.tune.trainer import Chunk
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.prompt import PromptEncoder

    m = mf.load(engine_dir, verify=False)
    encoder = PromptEncoder(str(engine_dir / m.tokenizer), m.prompt)
    return encoder, Chunk(encoder.state(STATE), [encoder.question(q) for q in questions.values()],
                          list(questions.values()))


def test_features_at_a_depth_are_the_residual_stream_there_final_normed(tiny_llama_dir, tiny_engine_dir):
    from onepass.export.model_source import cut

    model = _loaded(tiny_llama_dir).model.eval()
    encoder, chunk = _chunk(tiny_engine_dir)
    with torch.no_grad():
        read = _scorer(model).scores_and_features(chunk, depths=(1,))
        cut_read = _scorer(cut(copy.deepcopy(model), 1)).scores_and_features(chunk)
    for (_, full, at), (_, cut_full) in zip(read, cut_read):
        np.testing.assert_allclose(at[1][0], cut_full[0], atol=TOL)  # the decoder cut at 1 block reads the same
        np.testing.assert_allclose(at[1][1], cut_full[1], atol=TOL)  # mean log-likelihoods: the head of block 1's norm
        assert np.abs(at[1][0] - full[0]).max() > 1e-2  # control: the full depth reads something else
    # independent reference: transformers on each option asked alone as causal text, hidden_states[1] final-normed
    with torch.no_grad():
        for (_, _, at), tokens in zip(read, chunk.encoded):
            for j, option in enumerate(tokens.options):
                ids = torch.tensor([list(chunk.state_ids) + list(tokens.trunk) + list(option)[:-1]])
                out = model(input_ids=ids, output_hidden_states=True)
                ref = model.model.norm(out.hidden_states[1][0, -1]).numpy()
                np.testing.assert_allclose(at[1][0][j], ref, atol=TOL)
                assert np.abs(model.model.norm(out.hidden_states[2][0, -1]).numpy() - ref).max() > 1e-2  # control


def test_depths_outside_the_decoder_are_refused(tiny_llama_dir, tiny_engine_dir):
    from onepass.export.model_source import cut

    scorer = _scorer(_loaded(tiny_llama_dir).model.eval())
    _, chunk = _chunk(tiny_engine_dir)
    for bad in ((0,), (2,), (5,)):
        with pytest.raises(ValueError, match="depths must be in 1..1"):
            scorer.scores_and_features(chunk, depths=bad)
    with pytest.raises(ValueError, match="depth must be a block count in 1..2"):
        cut(_loaded(tiny_llama_dir).model, 3)


@pytest.fixture(scope="module")
def cut_engine(tiny_llama_dir, tiny_engine_dir, tmp_path_factory):
    """The tiny engine cut at 1 of its 2 blocks, with a random decision head (beta 0.7) read there; and the head."""
    from onepass.export.build import export_engine
    from onepass.runtime.backends.torch_decoder import DecisionHead
    from onepass.runtime.core import manifest as mf

    torch.manual_seed(0)
    head = DecisionHead(64, 8, shift=torch.zeros(64), scale=torch.ones(64)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("depth") / "cut"
    base = mf.load(tiny_engine_dir, verify=False)
    export_engine(out, str(tiny_llama_dir), adapters=[], prompt=base.prompt, head=head,
                  head_info=mf.HeadInfo(beta=0.7, width=8, depth=1), depth=1)
    return out, head


def _engine_scores(engine, questions):
    encoded = engine.encode_questions(questions)
    logprobs, heads = engine.option_values(STATE, encoded)
    return [np.asarray(s) for s in engine.option_scores(questions, encoded, logprobs, calibrated=False, heads=heads)]


def test_an_engine_cut_at_a_depth_runs_only_its_blocks_and_answers_as_its_head_read_there(
        cut_engine, tiny_llama_dir, tiny_engine_dir):
    from onepass import Engine

    out, head = cut_engine
    engine = Engine.load(out, backend="onnxruntime")
    m = engine.manifest
    assert m.model.num_layers == 1 and m.head.depth == 1 and m.scoring.readout == "head"
    base = Engine.load(tiny_engine_dir, backend="onnxruntime")
    assert (out / m.graph).stat().st_size < (tiny_engine_dir / base.manifest.graph).stat().st_size
    packed = _engine_scores(engine, QUESTIONS)
    for (key, q), together in zip(QUESTIONS.items(), packed):  # packed == each question alone
        np.testing.assert_allclose(together, _engine_scores(engine, {key: q})[0], atol=TOL)
    # the head's scores from the scorer's features read after 1 block of the whole model: what tune judged
    _, chunk = _chunk(tiny_engine_dir)
    with torch.no_grad():
        read = _scorer(_loaded(tiny_llama_dir).model.eval()).scores_and_features(chunk, depths=(1,))

    def judged(features):
        hidden, mean = features
        with torch.no_grad():
            return 0.7 * mean + head(torch.from_numpy(hidden)).double().numpy()
    wrong = 0.0
    for served, (_, full, at) in zip(packed, read):
        np.testing.assert_allclose(served, judged(at[1]), atol=TOL)
        wrong = max(wrong, np.abs(served - judged(full)).max())
    assert wrong > 1e-2, wrong  # control: the head read at the wrong (full) depth is another answer


def test_a_depth_needs_its_head(tiny_llama_dir, tmp_path):
    from onepass.export.build import export_engine
    from onepass.runtime.core import manifest as mf

    with pytest.raises(ValueError, match="needs a decision head fitted there"):
        export_engine(tmp_path / "x", str(tiny_llama_dir), adapters=[], depth=1)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="head.depth must be a positive block count"):
        mf.HeadInfo(beta=1.0, width=4, depth=0)


def test_a_tasks_scorer_reads_a_depth_inside_its_frozen_blocks_as_the_plain_scorer_does(tiny_llama_dir,
                                                                                       tiny_engine_dir):
    """`tune --task` with LoRA on the top block freezes the lower one, yet tries a head after it: a task's scorer
    keeps the state's K/V of every block, so it runs the question tokens from the embedding for a depth inside the
    frozen blocks; its features there and at the full depth equal the plain scorer's (1e-5). A whole-engine scorer
    with the same frozen block refuses that depth (it keeps no K/V below it)."""
    import contextlib

    from onepass.calibration.tune.trainer import PackedScorer
    from onepass.runtime.backends.torch_decoder import PackedDecoder

    model = _loaded(tiny_llama_dir).model.eval()
    _, chunk = _chunk(tiny_engine_dir)
    task = PackedScorer(PackedDecoder(model).eval(), "mean", torch.device("cpu"), False, 1,
                        state_weights=contextlib.nullcontext)
    with torch.no_grad():
        got, want = task.scores_and_features(chunk, depths=(1,)), _scorer(model).scores_and_features(chunk, depths=(1,))
    for (_, g_full, g_at), (_, w_full, w_at) in zip(got, want):
        for g, w in ((g_at[1], w_at[1]), (g_full, w_full)):
            np.testing.assert_allclose(g[0], w[0], atol=1e-5)
            np.testing.assert_allclose(g[1], w[1], atol=1e-5)
        assert np.abs(g_at[1][0] - g_full[0]).max() > 1e-2  # control: the two depths read different states
    frozen = PackedScorer(PackedDecoder(model).eval(), "mean", torch.device("cpu"), False, 1)
    with pytest.raises(ValueError, match="depths must be in 2..1"):
        frozen.scores_and_features(chunk, depths=(1,))
