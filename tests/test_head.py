"""The decision head: RLCD scoring rules, training on synthetic features, the BIG-bench wall, and the
exported head against its PyTorch form (with a negative control)."""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onepass import Choice, Engine, Noul  # noqa: E402
from onepass.calibration.data import bigbench as bb  # noqa: E402
from onepass.calibration.heads import head as hd  # noqa: E402
from onepass.calibration.scoring import rlcd  # noqa: E402
from onepass.calibration.heads.features import OptionFeatures  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.errors import InvalidRequest  # noqa: E402


def test_spherical_and_ranked_probability_scores_match_hand_computations():
    p = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)
    y = torch.tensor([1])
    assert rlcd.spherical_score(p, y).item() == pytest.approx(0.3 / np.sqrt(0.36 + 0.09 + 0.01))
    # CDF p: .6 .9 1 ; CDF y: 0 1 1 -> (.36 + .01) / 2
    assert rlcd.ranked_probability_score(p, y).item() == pytest.approx(0.37 / 2)
    assert rlcd.rlcd_reward(p, y, ordinal=True).item() == pytest.approx(
        np.log(0.3) + 0.3 / np.sqrt(0.46) - 0.185)


def test_rlcd_policy_gradient_moves_scores_towards_the_label():
    gen = torch.Generator().manual_seed(0)
    scores = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([scores], lr=0.05)
    label = torch.tensor(2)
    for _ in range(200):
        opt.zero_grad()
        rlcd.rlcd_loss(scores, label, group=16, sigma=0.5, generator=gen).backward()
        opt.step()
    p = torch.softmax(scores.detach(), 0)
    assert p.argmax().item() == 2 and p[2] > 0.6
    # control: the same steps with the sign of the loss flipped push the label down
    scores2 = torch.zeros(4, requires_grad=True)
    opt2 = torch.optim.SGD([scores2], lr=0.05)
    for _ in range(200):
        opt2.zero_grad()
        (-rlcd.rlcd_loss(scores2, label, group=16, sigma=0.5, generator=gen)).backward()
        opt2.step()
    assert torch.softmax(scores2.detach(), 0)[2] < 0.25


def _synthetic(n: int, seed: int, d: int = 24) -> OptionFeatures:
    """Questions of 3 options where hidden dimension 0 marks the correct option; the zero-shot score is noise."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(3 * n, d)).astype(np.float32)
    label = rng.integers(0, 3, n)
    for i, y in enumerate(label):
        hidden[3 * i + y, 0] += 2.5
    return OptionFeatures(hidden, rng.normal(size=3 * n), np.ones(3 * n), np.arange(0, 3 * n + 1, 3), label,
                          np.array(["t"] * n))


def test_head_learns_a_signal_the_zero_shot_read_out_lacks():
    train, val, test = _synthetic(400, 0), _synthetic(100, 1), _synthetic(200, 2)
    model, history = hd.train(train, val, hd.HeadConfig(width=8, epochs=40, rlcd_weight=0.3))
    probs = hd.probabilities(model, test)
    acc = np.mean([p.argmax() == y for p, y in zip(probs, test.label)])
    zero = np.mean([test.mean_logprob()[3 * i:3 * i + 3].argmax() == y for i, y in enumerate(test.label)])
    assert acc > 0.85 and zero < 0.5 and history


def _fake_tasks(root):
    for name in ("alpha_task", "zeta_task"):
        (root / name).mkdir(parents=True)
        ex = [{"input": f"Is {i} even?", "target_scores": {"yes": int(i % 2 == 0), "no": int(i % 2 == 1)}}
              for i in range(12)]
        ex.append({"input": "tie", "target_scores": {"a": 1, "b": 1}})  # no single best option: skipped
        (root / name / "task.json").write_text(json.dumps({"examples": ex}))
    return root


def test_bigbench_tasks_after_g_are_refused_for_training(tmp_path):
    root = _fake_tasks(tmp_path)
    got = bb.load_tasks(root, ["alpha_task"], "train", per_task=100)
    assert len(got) == 12 and all(isinstance(e.question, Choice) for e in got)
    for e in got:
        even = int(e.state.split()[1].rstrip("?")) % 2 == 0
        assert list(e.question.criteria)[e.label] == ("yes" if even else "no")
    with pytest.raises(bb.ReservedTask, match="reserved for independent evaluation"):
        bb.load_tasks(root, ["alpha_task", "zeta_task"], "train", per_task=5)
    assert len(bb.load_tasks(root, ["zeta_task"], "evaluate", per_task=5)) == 5
    split = bb.split_tasks(["a1", "b2", "c3", "d4", "e5", "f6", "g7", "h8", "z9"], seed=3)
    used = [t for part in split.values() for t in part]
    assert sorted(used) == ["a1", "b2", "c3", "d4", "e5", "f6", "g7"] and len(set(used)) == len(used)


def test_manifest_round_trip_with_a_head_and_head_readout_needs_one(engine_dir):
    manifest = mf.load(engine_dir, verify=False)
    info = mf.HeadInfo(0.5, 16, {"tasks": ["a"]})
    text = dataclasses.replace(manifest, head=info, scoring=mf.Scoring("head")).to_json()
    with_head = mf.Manifest.from_dict(json.loads(text))
    assert with_head.head == info and with_head.scoring.readout == "head"
    assert json.loads(text)["schema_version"] == mf.SCHEMA_VERSION == 6
    with pytest.raises(ValueError, match="no decision head"):
        dataclasses.replace(manifest, scoring=mf.Scoring("head"))


def test_head_readout_on_an_engine_without_head_is_a_clear_error(engine):
    with pytest.raises(InvalidRequest, match="decision head"):
        engine.run("The parcel arrived broken.", {"q": Noul("Is the customer unhappy?")}, readout="head")


HIDDEN = 64  # the tiny Llama's width


@pytest.fixture(scope="module")
def head_engine(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama exported with a seeded random head (what `onepass export --head` does): the head's wiring
    into the graph is a structure question, answered without a SmolLM2 export."""
    from onepass.export.build import export_engine
    from onepass.export.head_file import load_head_info

    torch.manual_seed(7)
    model = hd.HeadModel(HIDDEN, 16, np.random.default_rng(0).normal(0, 0.1, HIDDEN).astype(np.float32),
                         np.full(HIDDEN, 2.0, np.float32))
    with torch.no_grad():
        model.beta.fill_(0.7)
        model.head.out.weight.mul_(20.0)  # head scores of a few units: they move the answers
    path = tmp_path_factory.mktemp("head") / "head.pt"
    hd.save(model, hd.HeadConfig(width=16), path, {"data": "test"})
    head, info = load_head_info(path)
    out = export_engine(tmp_path_factory.mktemp("eng") / "with-head", str(tiny_llama_dir), head=head, head_info=info)
    return Engine.load(out), model


@pytest.mark.slow
def test_exported_head_matches_its_pytorch_form(head_engine, tiny_llama_dir):
    from onepass.calibration.heads.features import extract
    from onepass.runtime.backends.torch_decoder import PackedDecoder
    from onepass.export.model_source import load_model

    engine, model = head_engine
    hf_model = load_model(tiny_llama_dir).model
    assert engine.manifest.scoring.readout == "head" and engine.manifest.head.beta == pytest.approx(0.7)
    examples = [bb.Example("t", "t", "Ticket: I was charged twice for one order, please refund.",
                           Choice("Which team?", ["billing", "technical support", "shipping"]), 0),
                bb.Example("t", "t", "The screen stays black after the update.",
                           Choice("Which answer is correct?", ["hardware", "software"]), 1)]
    trunks = []
    feats = extract(PackedDecoder(hf_model).eval(), engine.encoder, examples, progress=False, trunks=trunks)
    want = hd.probabilities(model, feats)
    # the trunk-end states it hands back (a study's input) are transformers' last hidden state of state + question
    with torch.no_grad():
        for ex, got in zip(examples, trunks):
            ids = list(engine.encoder.state(ex.state)) + list(engine.encoder.question(ex.question).trunk)
            out = hf_model(torch.tensor([ids]), output_hidden_states=True)
            ref = out.hidden_states[-1][0, -1]
            torch.testing.assert_close(hf_model.lm_head(ref), out.logits[0, -1], rtol=0, atol=1e-4)  # final-normed
            np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-4)
    assert np.abs(trunks[0] - trunks[1]).max() > 1e-2  # control: each example's own state
    # tune rows carrying a teacher's distribution (`onepass distill`, `tune --method head`) give the head that
    # distribution as its target; labelled examples give none (the labels are the targets)
    from onepass.calibration.data.rows import TuneRow

    taught = extract(PackedDecoder(hf_model).eval(), engine.encoder,
                     [TuneRow(ex.state, ex.question, tuple(map(float, p)), "t") for ex, p in zip(examples, want)],
                     progress=False)
    assert feats.soft is None and hd.targets_of(taught) == "the teacher's distributions"
    np.testing.assert_allclose(taught.soft, np.concatenate(want))
    assert list(taught.label) == [int(np.argmax(p)) for p in want]
    for ex, p in zip(examples, want):
        got = engine.ask(ex.state, {"q": ex.question})["q"]
        np.testing.assert_allclose([got.probabilities[n] for n in ex.question.criteria], p, atol=1e-4)
    # negative control: the same head with its output weights negated gives other answers than the graph's
    broken = hd.HeadModel(HIDDEN, 16, model.head.shift.numpy(), model.head.scale.numpy())
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.head.out.weight.mul_(-1.0)
    off = hd.probabilities(broken, feats)
    assert max(np.abs(a - b).max() for a, b in zip(off, want)) > 1e-2
    # the PyTorch backend rebuilds the head from the graph's initializers and answers the same
    from onepass.runtime.backends import factory

    rebuilt = Engine.load(engine.root, backend=factory("torch-cpu"), verify=False)
    ex = examples[0]
    a, b = rebuilt.ask(ex.state, {"q": ex.question})["q"], engine.ask(ex.state, {"q": ex.question})["q"]
    assert max(abs(a.probabilities[n] - b.probabilities[n]) for n in ex.question.criteria) < 1e-4
    # the golden file carries head scores and the check holds them to their tolerance
    from onepass.runtime.core.selfcheck import check_golden

    assert check_golden(engine)["head_score"] <= 1e-3


@pytest.mark.slow
def test_a_head_appended_to_the_base_graph_answers_as_the_head_exported_with_the_decoder(head_engine, tiny_engine_dir,
                                                                                          tmp_path):
    """`tune` writes a head engine by appending the head's nodes to its base engine's graph (``export.head_graph``:
    seconds, the weights file hard-linked) instead of exporting the decoder again. Reference: the same head exported
    with the decoder (``export_engine``, the fixture). Control: the appended graph with the head's output negated."""
    import os

    from onepass.export import head_graph
    from onepass.runtime.backends import factory
    from onepass.runtime.core.selfcheck import check_golden

    exported, model = head_engine
    base = Engine.load(tiny_engine_dir).manifest
    assert head_graph.can_append(tiny_engine_dir, base)
    for other in (dataclasses.replace(base, precision="fp16"), exported.manifest):  # left to the full export
        assert not head_graph.can_append(tiny_engine_dir if other is not exported.manifest else exported.root, other)
    info = exported.manifest.head

    def appended(head_model, name):
        return Engine.load(head_graph.append_head(tiny_engine_dir, base, tmp_path / name, name=name,
                                                  head=head_model.head, head_info=info))  # verified: hashes
    engine = appended(model, "appended")
    m = engine.manifest
    assert m.scoring.readout == "head" and m.head == info and m.calibration is None and m.name == "appended"
    weights = next(n for n in m.files if n.endswith(".data"))
    assert os.stat(engine.root / weights).st_ino == os.stat(tiny_engine_dir / weights).st_ino  # linked, not copied
    assert check_golden(engine)["head_score"] <= 1e-3
    questions = {"team": Choice("Which team?", ["billing", "technical support", "shipping"]),
                 "refund": Noul("Does the customer ask for a refund?")}
    state = "Ticket: I was charged twice for one order, please refund."

    def probs(e):
        got = e.ask(state, questions)
        return np.array([*got["team"].probabilities.values(), got["refund"].noul])
    want = probs(exported)
    np.testing.assert_allclose(probs(engine), want, atol=1e-5)
    torch_backend = Engine.load(engine.root, backend=factory("torch-cpu"), verify=False)  # rebuilt from its weights map
    np.testing.assert_allclose(probs(torch_backend), want, atol=1e-4)
    broken = hd.HeadModel(HIDDEN, 16, model.head.shift.numpy(), model.head.scale.numpy())
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.head.out.weight.mul_(-1.0)
    assert np.abs(probs(appended(broken, "broken")) - want).max() > 1e-2
    assert Engine.load(tiny_engine_dir).manifest == base  # the base engine is untouched (and verifies)


@pytest.mark.slow
def test_a_head_that_cannot_be_appended_is_exported_with_the_decoder(head_engine, tiny_engine_dir, tmp_path,
                                                                      monkeypatch):
    """Where appending fails on a graph this path did not foresee, tune's writer exports the decoder with the head
    instead (the engine still answers with it); nothing is left of the failed attempt."""
    from onepass.calibration.tune.engine import write_head_engine
    from onepass.export import head_graph
    from onepass.export.model_source import engine_source

    def fails(*args, **kwargs):
        raise RuntimeError("an unforeseen graph")

    monkeypatch.setattr(head_graph, "append_head", fails)
    exported, model = head_engine
    base = Engine.load(tiny_engine_dir).manifest
    out = tmp_path / "written"
    write_head_engine(tiny_engine_dir, base, *engine_source(base), out, "written", model.head, exported.manifest.head)
    engine = Engine.load(out)
    assert engine.manifest.scoring.readout == "head" and "head_appended_to" not in engine.manifest.source
    q = {"team": Choice("Which team?", ["billing", "technical support", "shipping"])}
    state = "Ticket: I was charged twice for one order, please refund."
    got, want = engine.ask(state, q)["team"], exported.ask(state, q)["team"]
    assert max(abs(got.probabilities[n] - want.probabilities[n]) for n in want.probabilities) < 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["written"]


def test_calibrating_a_tuned_head_engine_keeps_the_bias_its_head_was_fitted_around(head_engine, tiny_engine_dir,
                                                                                  tmp_path):
    """A head engine tune wrote carries the bias of the prior its head corrects as a calibration of its ``head``
    read-out (``head_candidate.served``). `onepass calibrate` on it refits the groups its rows have and keeps the
    others (a yes/no question it has no rows of keeps its bias on yes); its report's "before" is the engine as it
    answered, with that calibration. Control: a calibration of another read-out is replaced whole, as before."""
    from onepass.calibration.measure.calibrate import calibrate
    from onepass.export import head_graph
    from onepass.runtime.core.readout_calibration import Calibration, GroupCalibration

    exported, model = head_engine
    base = Engine.load(tiny_engine_dir).manifest
    prior = Calibration(groups={"noul": GroupCalibration(1.0, (2.5, 0.0), rows=40)}, readout="head")
    rng = np.random.default_rng(0)
    scored = [{"type": "choice", "scores": list(rng.normal(0, 1, 3)), "label": int(i % 3), "target": int(i % 3),
               "names": ["a", "b", "c"], "qkey": "question/abc", "dataset": "d"} for i in range(60)]
    for readout, kept in (("head", True), ("mean", False)):
        out = head_graph.append_head(tiny_engine_dir, base, tmp_path / readout, name=readout, head=model.head,
                                     head_info=exported.manifest.head,
                                     finish=lambda m, r=readout: dataclasses.replace(
                                         m, calibration=dataclasses.replace(prior, readout=r)))
        calibrate(out, tmp_path / "unused.jsonl", scored=scored)
        after = Engine.load(out).manifest.calibration
        assert "question/abc" in after.groups and "choice/3-4" in after.groups, after.groups
        assert ("noul" in after.groups) == kept, (readout, after.groups)
        if kept:
            assert after.groups["noul"].bias == (2.5, 0.0) and after.source["kept_from_tune"] == ["noul"]


def test_a_file_that_is_no_saved_head_is_a_clear_error(tmp_path):
    """The exporter's reader of saved heads (export/head_file.py) names the file and what is wrong; never a
    traceback from torch."""
    from onepass.export.head_file import load_head_info
    from onepass.runtime.core.errors import OnepassError

    for name, content in (("missing.pt", None), ("text.pt", b"not a torch file"), ("empty.pt", b"")):
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(OnepassError, match=f"{name} is not a decision head saved by onepass"):
            load_head_info(path)
    torch.save({"state_dict": {}, "config": {"width": 4}, "hidden_size": 8, "info": {}}, tmp_path / "partial.pt")
    with pytest.raises(OnepassError, match="partial.pt is not a decision head"):  # no head weights, no beta
        load_head_info(tmp_path / "partial.pt")
