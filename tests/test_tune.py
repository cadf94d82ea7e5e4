"""`onepass tune`: rows and their errors, the split by whole states, RLCD with teacher targets, the training
loop's checkpoint/resume determinism, and (slow) a real tune of the default engine that exports and self-checks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onepass import Choice, Noul, Score  # noqa: E402
from onepass.calibration.scoring import rlcd  # noqa: E402
from onepass.calibration.tune.config import TuneConfig, resolved  # noqa: E402
from onepass.calibration.tune import trainer as tn  # noqa: E402
from onepass.calibration.data.rows import group_by_state, load_rows, split_states  # noqa: E402
from onepass.runtime.core.errors import InvalidRequest, OnepassError  # noqa: E402
from onepass.runtime.core.questions import to_wire  # noqa: E402

NOUL = to_wire(Noul("Is it raining?"))
TEAM = to_wire(Choice("Which team?", {"red": None, "blue": "the blue team"}))
LEVEL = to_wire(Score("How loud?", ["Quiet", "Loud", "Very loud"]))


def _write(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_rows_parse_labels_and_teacher_distributions(tmp_path):
    path = _write(tmp_path, [{"state": "wet", "question": NOUL, "label": "yes"},
                             {"state": "wet", "question": TEAM, "probabilities": {"red": 0.25, "blue": 0.75}},
                             {"state": "dry", "question": NOUL, "probabilities": 0.1},
                             {"state": "dry", "question": LEVEL, "label": 2, "probabilities": {"0": 0.5, "2": 0.5}}])
    rows, files = load_rows([path])
    assert [r.target for r in rows] == [0, (0.25, 0.75), (0.1, 0.9), (0.5, 0.0, 0.5)]
    assert [r.label for r in rows] == [0, 1, 1, 0]
    assert files[0]["rows"] == 4 and len(files[0]["sha256"]) == 64
    assert [len(g) for g in group_by_state(rows)] == [2, 2]


@pytest.mark.parametrize("row, message", [
    ('{"state": "x", "question": ', "rows.jsonl:1: not valid JSON"),
    ({"question": NOUL, "label": "yes"}, "rows.jsonl:1: state: missing"),
    ({"state": "x", "question": NOUL}, "rows.jsonl:1: label: a row needs a label or probabilities"),
    ({"state": "x", "question": NOUL, "label": "maybe"}, "a noul label must be yes/no"),
    ({"state": "x", "question": TEAM, "label": "green"}, "label 'green' is not one of the options"),
    ({"state": "x", "question": LEVEL, "label": 3}, "score label 3 is outside 0..2"),
    ({"state": "x", "question": TEAM, "probabilities": {"red": 0.5, "green": 0.5}}, r"unknown option\(s\) \['green'\]"),
    ({"state": "x", "question": TEAM, "probabilities": {"red": 0.5, "blue": 0.6}}, "sum to 1.1000"),
    ({"state": "x", "question": TEAM, "probabilities": {"red": -0.5, "blue": 1.5}}, "finite number >= 0"),
    ({"state": "", "question": NOUL, "label": "yes"}, "the state must not be empty"),
    ({"state": "x", "question": {"type": "poll"}, "label": "yes"}, "rows.jsonl:1: question"),
])
def test_bad_rows_are_one_line_errors_naming_the_row_and_field(tmp_path, row, message):
    with pytest.raises(InvalidRequest, match=message) as err:
        load_rows([_write(tmp_path, [row])])
    assert "\n" not in str(err.value)


def test_empty_data_and_too_few_states_are_refused(tmp_path):
    with pytest.raises(InvalidRequest, match="no rows"):
        load_rows([_write(tmp_path, ["", "  "])])
    rows, _ = load_rows([_write(tmp_path, [{"state": s, "question": NOUL, "label": "no"} for s in "abc"])])
    with pytest.raises(InvalidRequest, match="3 distinct states are too few"):
        split_states(group_by_state(rows), 0.3, 0)


def test_split_keeps_every_state_on_one_side_and_is_seeded(tmp_path):
    rows, _ = load_rows([_write(tmp_path, [{"state": f"s{i % 10}", "question": NOUL, "label": "yes"}
                                           for i in range(40)])])
    train, held = split_states(group_by_state(rows), 0.3, seed=3)
    states = lambda groups: {r.state for g in groups for r in g}  # noqa: E731
    assert not states(train) & states(held) and len(states(train) | states(held)) == 10
    assert sum(len(g) for g in train + held) == 40 and len(held) == 3
    assert split_states(group_by_state(rows), 0.3, seed=3) == (train, held)


def test_validation_files_replace_the_split_and_a_shared_state_is_refused(tmp_path):
    from onepass.calibration.data.rows import group_by_state
    from onepass.calibration.tune.engine import _held_out

    rows, _ = load_rows([_write(tmp_path, [{"state": f"s{i % 10}", "question": NOUL, "label": "yes"}
                                           for i in range(40)])])
    rows = group_by_state(rows)  # what tune hands _held_out: the rows grouped by state once
    val = _write(tmp_path, [{"state": f"v{i}", "question": TEAM, "label": "red"} for i in range(3)], "val.jsonl")
    train, held, files = _held_out(rows, [val], TuneConfig(holdout=0.3))
    assert sum(len(g) for g in train) == 40  # every data row is trained on: nothing split off
    assert [g[0].state for g in held] == ["v0", "v1", "v2"] and files[0]["rows"] == 3
    assert _held_out(rows, None, TuneConfig(holdout=0.3))[2] == []  # control: without files, the split
    leak = _write(tmp_path, [{"state": "s4", "question": TEAM, "label": "red"}], "leak.jsonl")
    with pytest.raises(OnepassError, match="1 state.*both in --data and in --validation.*'s4'"):
        _held_out(rows, [val, leak], TuneConfig())


def test_rlcd_teacher_reward_is_the_expectation_of_label_rewards():
    p = torch.softmax(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), -1)
    onehot = torch.tensor([0.0, 1.0, 0.0])
    assert torch.allclose(rlcd.expected_reward(p, onehot, True), rlcd.rlcd_reward(p, torch.full((5,), 1), True))
    teacher = torch.tensor([0.2, 0.5, 0.3])
    mixed = sum(w * rlcd.rlcd_reward(p, torch.full((5,), j), False) for j, w in enumerate(teacher.tolist()))
    assert torch.allclose(rlcd.expected_reward(p, teacher, False), mixed)


class _Interrupt(Exception):
    pass


class _ToyScorer:
    """Stands in for the packed decoder: option scores are a linear map of a per-state feature."""

    def __init__(self, interrupt_after=None):
        self.weight = torch.nn.Parameter(torch.zeros(3, 4))
        self.calls, self.interrupt_after = 0, interrupt_after

    def scores(self, chunk):
        self.calls += 1
        if self.interrupt_after is not None and self.calls > self.interrupt_after:
            raise KeyboardInterrupt
        x = torch.tensor(chunk.state_ids, dtype=torch.float32)
        return [self.weight @ x for _ in chunk.rows]


def _toy_chunks(n, seed):
    from onepass.calibration.data.rows import TuneRow

    g = torch.Generator().manual_seed(seed)
    q = Choice("pick", {"a": None, "b": None, "c": None})
    chunks = []
    for i in range(n):
        x = torch.randn(4, generator=g)
        label = int(torch.argmax(x[:3]))
        chunks.append(tn.Chunk(x.tolist(), [None], [TuneRow(f"s{i}", q, label)]))
    return chunks


def _trainer(tmp_path, scorer, config):
    return tn.Trainer(scorer, [scorer.weight], config, _toy_chunks(24, 0), _toy_chunks(8, 1),
                      tmp_path / "checkpoint.pt", {"data": ["toy"]}, log=lambda *_: None)


def test_training_lowers_heldout_nll_and_resume_after_interrupt_reproduces_the_uninterrupted_run(tmp_path):
    config = TuneConfig(epochs=4, batch_questions=4, lr=0.05, patience=10, rlcd_weight=0.5)
    full = _trainer(tmp_path / "a", _ToyScorer(), config)
    (tmp_path / "a").mkdir()
    progress = full.run()
    assert progress.history[-1]["nll"] < progress.history[0]["nll"] - 0.1  # the loss falls on held-out states
    (tmp_path / "b").mkdir()
    broken = _trainer(tmp_path / "b", _ToyScorer(interrupt_after=8 + 2 * (24 + 8) + 5), config)  # dies in epoch 3
    with pytest.raises(OnepassError, match="--resume"):
        broken.run()
    resumed = _trainer(tmp_path / "b", _ToyScorer(), config)
    resumed.resume()
    assert resumed.progress.epoch == 2
    resumed.run()
    assert torch.equal(resumed.scorer.weight, full.scorer.weight)
    other = _trainer(tmp_path / "b", _ToyScorer(), dataclasses.replace(config, lr=0.01))
    with pytest.raises(OnepassError, match="another configuration"):
        other.resume()


def test_config_is_validated():
    with pytest.raises(ValueError, match="method must be one of"):
        TuneConfig(method="qlora")
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        TuneConfig(rank=0)
    with pytest.raises(ValueError, match="not both 0"):
        TuneConfig(ce_weight=0, rlcd_weight=0)


@pytest.mark.slow
def test_default_engine_records_its_adapters_and_tuning(engine):
    """The default engine (issue 46) merges the chat-form adapter, then the compact-form one trained on top of it, and
    answers as the upper one was trained: its read-out and its (compact) prompt form."""
    from onepass.export.adapter import COMPACT_ADAPTER, CHAT_ADAPTER, WEIGHTS, card, prompt_of
    from onepass.runtime.core.manifest import sha256_file
    from onepass.runtime.core.prompt import FORMS

    tuning, adapters = engine.manifest.tuning, engine.manifest.source["adapters"]
    assert tuning is not None and tuning.method == "lora" and tuning.steps > 0 and tuning.rows > 0
    assert [a["sha256"] for a in adapters] == [sha256_file(CHAT_ADAPTER / WEIGHTS),
                                               sha256_file(COMPACT_ADAPTER / WEIGHTS)]
    # the engine answers with the read-out its adapters were trained through, not the export's fallback
    assert engine.manifest.scoring.readout == card(COMPACT_ADAPTER)["readout"] == card(CHAT_ADAPTER)["readout"]
    # ... and asks in the prompt form the upper one was trained in
    assert engine.manifest.prompt == prompt_of(COMPACT_ADAPTER) == FORMS["compact"]


def test_an_adapter_is_merged_only_on_top_of_the_adapters_it_was_trained_on(tmp_path):
    """An adapter tuned from an engine that already carried adapters (the default engine carries the shipped one) is
    a correction of those weights: its card names them by sha256, `onepass export --adapter` merges them first, and
    a stack of other adapters is refused."""
    from onepass.export.adapter import CARD, CONFIG, CHAT_ADAPTER, WEIGHTS, card, check_stack, resolve
    from onepass.runtime.core.errors import ModelSourceError
    from onepass.runtime.core.manifest import sha256_file

    def adapter(name: str, weights: bytes, on=(), recorded_path=None):
        folder = tmp_path / name
        folder.mkdir()
        (folder / WEIGHTS).write_bytes(weights)
        (folder / CONFIG).write_text("{}")
        tuning = {"adapters": [{"path": recorded_path or str(a), "sha256": sha256_file(a / WEIGHTS)} for a in on]}
        (folder / CARD).write_text(json.dumps({"tuning": tuning}))
        return folder

    first, other = adapter("first", b"first"), adapter("other", b"other")
    second = adapter("second", b"second", on=[first])
    assert resolve(str(second), None) == [first, second] and resolve(str(first), None) == [first]
    check_stack(first, [])
    check_stack(second, [first])
    for below in ([], [other], [first, other], [other, first]):
        with pytest.raises(ModelSourceError, match="was trained on top of"):
            check_stack(second, below)
    with pytest.raises(ModelSourceError, match="no adapter"):
        check_stack(first, [other])
    # tuned from the default engine elsewhere: the shipped adapter is found where this installation keeps it
    tuned = adapter("tuned", b"tuned", on=[CHAT_ADAPTER], recorded_path="/elsewhere/adapters/smollm2")
    assert resolve(str(tuned), None) == [CHAT_ADAPTER, tuned]
    (first / WEIGHTS).write_bytes(b"changed")  # the adapter below is not the one trained on any more
    with pytest.raises(ModelSourceError, match="not there or has changed"):
        resolve(str(second), None)
    # the default stack (issue 46): the compact-form adapter on top of the chat-form one, asking in the compact form
    # and reading out as the chat one does; the chat one alone is 'default-chat'; for another model, refused
    from onepass.export.adapter import COMPACT_ADAPTER, prompt_of
    from onepass.runtime.core.prompt import FORMS

    stack = resolve("default", None)
    assert stack == resolve(None, None) == [CHAT_ADAPTER, COMPACT_ADAPTER]
    assert resolve("default-chat", None) == [CHAT_ADAPTER] and resolve("default", "some-model.gguf") == []
    for i, shipped in enumerate(stack):
        check_stack(shipped, stack[:i])
    assert prompt_of(COMPACT_ADAPTER) == FORMS["compact"] and prompt_of(CHAT_ADAPTER) == FORMS["chat"]
    assert card(COMPACT_ADAPTER)["readout"] == card(CHAT_ADAPTER)["readout"]
    with pytest.raises(ModelSourceError, match="was trained on top of"):
        check_stack(COMPACT_ADAPTER, [])
    with pytest.raises(ModelSourceError, match="default model only"):
        resolve("default-chat", "some-model.gguf")
    with pytest.raises(ModelSourceError, match="default-compact is no longer a name"):  # a retired opt-in
        resolve("default-compact", None)
    # tuned from a compact engine on another installation: both shipped adapters are found here, in order
    on_compact = adapter("on-compact", b"on compact", on=stack, recorded_path="/elsewhere/adapters/x")
    assert resolve(str(on_compact), None) == [CHAT_ADAPTER, COMPACT_ADAPTER, on_compact]


def test_a_relative_adapter_folder_is_recorded_where_it_is(tmp_path, monkeypatch):
    """`--adapter ./mine` is resolved before it is recorded: an adapter tuned on top of it finds it from any
    directory."""
    from onepass.export.adapter import CARD, CONFIG, WEIGHTS, provenance, resolve

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / WEIGHTS).write_bytes(b"mine")
    (mine / CONFIG).write_text("{}")
    monkeypatch.chdir(tmp_path)
    [found] = resolve("mine", None)
    assert found == mine and found.is_absolute()
    on_mine = tmp_path / "sub" / "on-mine"
    on_mine.mkdir(parents=True)
    (on_mine / WEIGHTS).write_bytes(b"on mine")
    (on_mine / CONFIG).write_text("{}")
    (on_mine / CARD).write_text(json.dumps({"tuning": {"adapters": [
        {k: provenance(found)[k] for k in ("path", "sha256")}]}}))
    monkeypatch.chdir(tmp_path / "sub")
    assert resolve("on-mine", None) == [mine, on_mine]


def test_load_model_refuses_an_adapter_without_the_adapters_it_was_trained_on(tiny_llama_dir, tmp_path):
    """The guard sits where adapters are merged, for every caller (export, tune, re-export), not only the CLI's."""
    from onepass.export.adapter import CARD, WEIGHTS
    from onepass.export.model_source import load_model
    from onepass.runtime.core.errors import ModelSourceError
    from onepass.runtime.core.manifest import sha256_file

    below, top = tmp_path / "below", tmp_path / "top"
    for folder in (below, top):
        folder.mkdir()
        (folder / WEIGHTS).write_bytes(folder.name.encode())
    (top / CARD).write_text(json.dumps({"tuning": {"adapters": [{"path": str(below),
                                                                  "sha256": sha256_file(below / WEIGHTS)}]}}))
    with pytest.raises(ModelSourceError, match="was trained on top of"):
        load_model(tiny_llama_dir, [top])


def _fact_rows(tmp_path, notes: int = 16, numbered: bool = False):
    """Two yes/no facts whose answers never change, asked about unrelated notes: what a random tiny model can
    learn in a few steps and carry over to notes it was not trained on. ``numbered``: each question names its note,
    so that no question repeats and calibrating the base (half the answers yes) cannot learn the facts."""
    facts = [("Is the sky blue on a clear day?", "yes"), ("Do fish climb trees?", "no")]
    return _write(tmp_path, [{"state": f"Note {i}: the meeting moved to room {i + 3}.", "label": label,
                              "question": to_wire(Noul(f"About note {i}: {q}" if numbered else q))}
                             for i in range(notes) for q, label in facts], "facts.jsonl")


@pytest.mark.slow
def test_tune_smoke_trains_exports_and_self_checks(tiny_engine_dir, tmp_path):
    """The whole path on the tiny Llama (SmolLM2's architecture and tokenizer): tune through the packed tree,
    merge, export, self-check. The shipped adapter shows the same path on SmolLM2 itself (the test above)."""
    from onepass import Engine
    from onepass.calibration.tune.engine import tune
    from onepass.runtime.core.selfcheck import check_golden

    data = _fact_rows(tmp_path, notes=52, numbered=True)  # 104 rows: one held-out split (fewer: a cross-validated choice, below)
    out = tmp_path / "tuned"
    config = TuneConfig(rank=2, train_blocks=1, epochs=3, batch_questions=4, lr=1e-2, holdout=0.25, patience=3,
                           head_candidate=False)  # the LoRA path (the head candidate's: below)
    engine_dir = tiny_engine_dir
    summary = tune(engine_dir, [data], out, config, report_dir=tmp_path / "report", log=lambda *_: None)
    metrics = summary["tuning"]["metrics"]
    assert metrics["heldout_best"]["nll"] < metrics["heldout_before"]["nll"]  # the loss falls on held-out states
    tuned = Engine.load(out)
    check_golden(tuned)  # raises unless the ONNX graph reproduces the merged PyTorch decoder (golden file)
    m = tuned.manifest
    assert m.tuning.data[0]["sha256"] == summary["tuning"]["data"][0]["sha256"] and m.tuning.rank == 2
    assert m.tuning.steps == summary["tuning"]["steps"] > 0 and "adapter_model.safetensors" in m.files
    assert m.name == f"{Engine.load(engine_dir).name}-tuned"  # not the name of a file copied into the engine
    from onepass.export.adapter import card

    assert card(out)["readout"] == m.scoring.readout == Engine.load(engine_dir).manifest.scoring.readout
    assert card(out)["prompt"] == dataclasses.asdict(m.prompt)  # what a re-export of the adapter writes (prompt_of)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    chosen = {c["name"]: c["heldout_nll"] for c in summary["choice"]["candidates"]}[summary["choice"]["chosen"]]
    assert report["after"]["all"]["nll"] == pytest.approx(chosen, abs=1e-3)  # served (ONNX) == chosen (PyTorch)
    assert not (tmp_path / "tuned.tune").exists()
    from onepass.export.model_source import engine_source

    assert engine_source(m)[1][-1] == out.resolve()  # re-exportable: its own adapter files are in the engine


@pytest.mark.slow
def test_few_rows_choose_by_cross_validation_then_train_on_every_row(tiny_engine_dir, tmp_path):
    """32 rows: a 20% split would judge the candidates on 6 questions, so tune cross-validates the choice over 3 folds
    of whole notes (each fold answered by a run that never saw it), then trains the chosen candidate on all 32 rows;
    nothing is held out of the engine's training and the report records the choice."""
    from onepass import Engine
    from onepass.calibration.tune.engine import tune

    out, report = tmp_path / "tuned", tmp_path / "report"
    config = TuneConfig(rank=2, train_blocks=1, epochs=3, batch_questions=4, lr=1e-2, head_candidate=False)
    lines = []
    summary = tune(tiny_engine_dir, [_fact_rows(tmp_path, numbered=True)], out, config, report_dir=report,
                   log=lines.append)
    choice = summary["choice"]
    assert choice["judged"] == "cross-validated (3 folds)" and choice["chosen"].startswith("tuned"), choice
    assert sum("cross-validation run" in line for line in lines) == 3
    by_name = {c["name"]: c["heldout_nll"] for c in choice["candidates"]}
    assert by_name["tuned"] < by_name["base"] - 0.05  # each run answers notes it never saw better than the base
    m = Engine.load(out).manifest
    assert m.tuning.rows == 32 and m.tuning.holdout_rows == 0 and m.tuning.steps > 0
    assert json.loads((report / "report.json").read_text())["choice"]["chosen"] == choice["chosen"]
    assert not (tmp_path / "tuned.tune").exists()
    with pytest.raises(OnepassError, match="--method head needs at least 100 rows"):
        tune(tiny_engine_dir, [_fact_rows(tmp_path)], tmp_path / "head", TuneConfig(method="head"),
             log=lambda *_: None)
    with pytest.raises(OnepassError, match="5 distinct states are too few to cross-validate"):
        tune(tiny_engine_dir, [_fact_rows(tmp_path, notes=5)], tmp_path / "few", config, log=lambda *_: None)
    assert not (tmp_path / "few").exists() and not (tmp_path / "few.tune").exists()


@pytest.mark.slow
def test_tune_method_head_exports_an_engine_that_answers_with_its_head(tiny_engine_dir, tmp_path):
    from onepass import Engine
    from onepass.calibration.tune.engine import tune

    out = tmp_path / "head"
    summary = tune(tiny_engine_dir, [_fact_rows(tmp_path, notes=52)], out, TuneConfig(method="head", holdout=0.25),
                   log=lambda *_: None)
    engine = Engine.load(out)  # hash-verified; export already checked the graph against its golden file
    assert engine.manifest.scoring.readout == "head" and engine.manifest.head.training["rows"] == 78  # 39 of 52 notes
    assert summary["head"]["heldout_nll_after"] <= summary["head"]["heldout_nll_before"]
    answer = engine.ask("The kite is green.", {"c": Choice("Which colour is mentioned?", {"red": None, "green": None})})
    assert set(answer["c"].probabilities) == {"red", "green"}


@pytest.mark.slow
@pytest.mark.parametrize("notes", [52, 16])  # 104 rows: one held-out split; 32: a cross-validated choice
def test_a_chosen_head_candidate_is_written_and_answers_as_it_was_judged(tiny_engine_dir, tmp_path, notes):
    """Facts a tiny LoRA run cannot learn in one step (lr 1e-6) but a head over the untuned hidden states can, asked
    of numbered notes: tune chooses the decision head, and the engine it writes
    (the base weights, the head in its graph, read-out ``head``) answers the held-out rows as the candidate was
    judged in PyTorch (NLL to 1e-3). Control: the same rows with the head left out (--no-head) write another candidate,
    worse on the same rows."""
    from onepass import Engine
    from onepass.calibration.tune.engine import tune

    data = _fact_rows(tmp_path, notes=notes, numbered=True)
    # LoRA from 100 rows (the default is 300): 104 rows train a run and are judged on one held-out split
    # the full-depth head only (a head read after fewer blocks: tests/test_depth.py)
    config = TuneConfig(rank=2, train_blocks=1, epochs=1, max_steps=1, batch_questions=4, lr=1e-6, holdout=0.25,
                           lora_min_rows=100, head_depths=())
    out, report, lines = tmp_path / "tuned", tmp_path / "report", []
    summary = tune(tiny_engine_dir, [data], out, config, report_dir=report, log=lines.append)
    choice = summary["choice"]
    by_name = {c["name"]: c["heldout_nll"] for c in choice["candidates"]}
    chosen = choice["chosen"]
    assert chosen == "head" and by_name[chosen] < by_name["base"] - 0.05, choice
    # fewer rows than --lora-min-rows (100): the head is the only learner, no LoRA run is trained
    lora_ran = any("cross-validation run" in line for line in lines) or summary["tuning"]["steps"] > 0
    assert lora_ran == (notes == 52) and ("tuned" in by_name) == (notes == 52), (lines, by_name)
    engine = Engine.load(out)
    assert engine.manifest.scoring.readout == "head" and engine.manifest.head.training["choice"]["chosen"] == chosen
    cal = engine.manifest.calibration  # the bias of the prior the head corrects (head_candidate.served), exact below
    assert cal.readout == "head" and cal.groups and all(g.temperature == 1.0 for g in cal.groups.values()), cal
    assert engine.manifest.head.training["rows"] == (78 if notes == 52 else 32)
    from onepass.calibration.tune.engine import summary_lines

    assert summary_lines(summary, out, report)[-1].startswith("the base engine with a decision head")  # as printed
    from onepass.calibration.teach.distill import _tuned  # distill --resume knows a head student finished on these rows

    assert _tuned(out, data)["choice"]["chosen"] == "head"
    (tmp_path / "other.jsonl").write_text(data.read_text() + "\n")
    assert _tuned(out, tmp_path / "other.jsonl") is None  # control: other rows, tuned again
    if notes == 52:  # a held-out split: the report scores the written engine (ONNX Runtime) on the held-out rows
        served = json.loads((report / "report.json").read_text())["after"]["all"]["nll"]
        assert served == pytest.approx(by_name[chosen], abs=1e-3)
    # control: without the head the best of the others is written, and it is worse on the same rows
    other = tune(tiny_engine_dir, [data], tmp_path / "no-head", dataclasses.replace(config, head_candidate=False,
                                                                                    keep_base=True),
                 log=lambda *_: None)["choice"]
    nll = {c["name"]: c["heldout_nll"] for c in other["candidates"]}
    assert "head" not in nll and nll[other["chosen"]] > by_name[chosen] + 0.05
    assert Engine.load(tmp_path / "no-head").manifest.scoring.readout != "head"
    assert "tuned" in nll  # without the head LoRA runs whatever the row count
    # --lora-min-rows moves the line: 0 trains the LoRA runs beside the head on 32 rows, 1000 none on 104 (and the
    # choice among the others is then cross-validated over every row, whatever their number)
    moved = tune(tiny_engine_dir, [data], tmp_path / "moved",
                 dataclasses.replace(config, lora_min_rows=0 if notes == 16 else 1000), log=lambda *_: None)["choice"]
    names = {c["name"] for c in moved["candidates"]}
    assert ("tuned" in names) == (notes == 16) and "head" in names and moved["chosen"] == "head", moved
    assert moved["judged"].startswith("cross-validated"), moved


def test_tune_cli_errors_are_one_line_and_write_nothing(tmp_path):
    data = _write(tmp_path, [{"state": "x", "question": NOUL, "label": "maybe"}])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "onepass", "tune", "--engine", str(tmp_path), "--data", str(data),
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "rows.jsonl:1" in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_tune_that_never_beats_step_0_writes_nothing_and_exits_2_unless_keep_base(tiny_engine_dir, tmp_path):
    """A learning rate too small to move the held-out NLL: `onepass tune` says tuning never improved on the base,
    writes no engine and exits 2 (it used to export the base weights as the "tuned" engine without a word); with
    --keep-base it writes the engine and warns. The progress bar's total is the --max-steps budget."""
    data = _fact_rows(tmp_path, notes=12)  # 24 rows: the 16 each fold trains on are too few to calibrate
    out = tmp_path / "tuned"
    args = [sys.executable, "-m", "onepass", "tune", "--engine", str(tiny_engine_dir), "--data", str(data), "--out",
            str(out), "--lr", "1e-12", "--max-steps", "2", "--rank", "2", "--holdout", "0.25", "--no-head"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "never improved on the base engine" in error[0] and "--keep-base" in error[0]
    assert not out.exists() and not (tmp_path / "tuned.tune").exists()
    assert "/2 [" in proc.stderr  # the bar counts to the 2-step budget, not to the epochs' steps
    kept = subprocess.run(args + ["--keep-base"], capture_output=True, text=True, timeout=600)
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert "warning: tuning never improved" in kept.stderr + kept.stdout and (out / "manifest.json").exists()


def _lora_scorers(tiny_llama_dir, frozen: int):
    """(scorer caching the lower ``frozen`` blocks, scorer running every block, trainable parameters, chunks) over one
    LoRA model of the tiny Llama whose adapter (top block only) is non-zero, so that it changes the scores."""
    import transformers
    from peft import get_peft_model

    from onepass.calibration.data.rows import TuneRow
    from onepass.export.adapter import lora_config
    from onepass.runtime.backends.torch_decoder import PackedDecoder
    from onepass.runtime.core.prompt import PromptEncoder, PromptTemplate

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    layers = hf.config.num_hidden_layers
    model = get_peft_model(hf, lora_config(4, None, list(range(frozen, layers))))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    params = [p for p in model.parameters() if p.requires_grad]
    decoder = PackedDecoder(model.base_model.model, share=True)
    encoder = PromptEncoder(str(tiny_llama_dir / "tokenizer.json"), PromptTemplate())
    questions = [Noul("Is it raining?"), Choice("Which team?", {"red": None, "blue": "the blue team"}),
                 Score("How loud?", ["Quiet", "Loud", "Very loud"])]
    chunks = [tn.Chunk(encoder.state(text), [encoder.question(q) for q in questions],
                       [TuneRow(text, q, 0) for q in questions])
              for text in ("The storm hit the red team's stadium.", "A quiet afternoon in the blue office, nothing more.")]
    cached = tn.PackedScorer(decoder, "mean", torch.device("cpu"), False, frozen)
    cached.peft_model = model  # for the tests that switch the adapter off
    return cached, tn.PackedScorer(decoder, "mean", torch.device("cpu"), False, 0), params, chunks


def _scores_and_grads(scorer, params, chunks):
    for p in params:
        p.grad = None
    scores = [s for c in chunks for s in scorer.scores(c)]
    torch.stack([s.logsumexp(-1) - s[0] for s in scores]).sum().backward()
    return torch.cat([s.detach() for s in scores]), torch.cat([p.grad.flatten() for p in params])


def test_cached_frozen_blocks_give_the_scores_and_gradients_of_the_whole_pass(tiny_llama_dir):
    """Tuning only the top blocks computes the lower blocks once per chunk (their outputs cached) instead of at every
    step: the option scores and the adapter's gradients equal those of running every block (float32, tolerance
    1e-5, twice: the second pass reads the cache). Negative control: a lower block changed after the cache was made
    (a stale cache) moves the cached scores away from the whole pass's."""
    cached, whole, params, chunks = _lora_scorers(tiny_llama_dir, frozen=1)
    reference, ref_grads = _scores_and_grads(whole, params, chunks)
    for _ in range(2):
        scores, grads = _scores_and_grads(cached, params, chunks)
        assert torch.allclose(scores, reference, atol=1e-5) and torch.allclose(grads, ref_grads, atol=1e-5, rtol=1e-4)
    assert len(cached.trunks) == len(chunks) and not whole.trunks
    over_budget = tn.PackedScorer(cached.decoder, "mean", torch.device("cpu"), False, 1, cache_budget=0)
    scores, _ = _scores_and_grads(over_budget, params, chunks)  # past the budget: computed again, nothing kept
    assert torch.allclose(scores, reference, atol=1e-5) and not over_budget.trunks
    assert (reference.abs() > 1e-3).all() and ref_grads.abs().max() > 1e-3  # real scores and gradients compared
    with torch.no_grad():
        cached.decoder.blocks[0].up.weight.mul_(1.5)  # what a trainable lower block would do between steps
    stale, _ = _scores_and_grads(cached, params, chunks)
    fresh, _ = _scores_and_grads(whole, params, chunks)
    assert torch.allclose(stale, reference, atol=1e-5) and not torch.allclose(fresh, reference, atol=1e-3)


def _question_side_reference(scorer, chunk):
    """Option scores of ``chunk`` as an engine sharing its state cache across tasks would answer: the state prefilled
    by the decoder's forward with the adapter off (the base engine), then the packed pass with it on, over that past."""
    from onepass.runtime.backends.batch import causal
    from onepass.runtime.core.tree import pack

    decoder, model = scorer.decoder, scorer.peft_model
    state, batch = causal(chunk.state_ids, 0), pack(chunk.encoded, len(chunk.state_ids))
    t = torch.from_numpy
    with torch.no_grad(), model.disable_adapter():
        prefill = decoder(t(state.input_ids), t(state.position_ids), t(state.tree_mask),
                          *[torch.zeros(decoder.dims.num_kv_heads, 0, decoder.dims.head_dim)] * (2 * decoder.dims.num_layers),
                          t(state.readout_index), t(state.readout_target), torch.tensor(0))
    target = decoder(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *prefill[1:],
                     t(batch.readout_index), t(batch.readout_target), torch.tensor(len(chunk.state_ids)))[0]
    return [torch.stack([target[t(r)].sum() for r in readouts]) / torch.tensor([float(len(o)) for o in q.options])
            for q, readouts in zip(chunk.encoded, batch.option_readouts)]


@pytest.mark.parametrize("frozen", [0, 1])
def test_state_from_the_base_weights_gives_the_scores_and_gradients_of_a_shared_state_cache(tiny_llama_dir, frozen):
    """``state_weights`` (issue 45): the state's K/V come from the base weights, the adapter acts on the question and
    option tokens only. Scores and gradients equal the contract forward's (the state prefilled with the adapter off,
    then the packed pass over that past; float32, 1e-5), with or without cached lower blocks, twice (the second
    from the cache). Negative control: the ordinary scorer, whose state passes through the adapter, differs."""
    cached, whole, params, chunks = _lora_scorers(tiny_llama_dir, frozen=1)
    shared = tn.PackedScorer(cached.decoder, "mean", torch.device("cpu"), False, frozen,
                             state_weights=cached.peft_model.disable_adapter)
    for p in params:
        p.grad = None
    reference = [s for c in chunks for s in _question_side_reference(cached, c)]
    torch.stack([s.logsumexp(-1) - s[0] for s in reference]).sum().backward()
    ref_scores, ref_grads = torch.cat([s.detach() for s in reference]), torch.cat([p.grad.flatten() for p in params])
    for _ in range(2):
        scores, grads = _scores_and_grads(shared, params, chunks)
        assert torch.allclose(scores, ref_scores, atol=1e-5) and torch.allclose(grads, ref_grads, atol=1e-5, rtol=1e-4)
    assert len(shared.trunks) == len(chunks)
    assert (ref_scores.abs() > 1e-3).all() and ref_grads.abs().max() > 1e-3
    through_adapter, _ = _scores_and_grads(whole, params, chunks)  # the control: the adapter also on the state
    assert not torch.allclose(through_adapter, ref_scores, atol=1e-3)


def test_a_cache_over_trainable_blocks_is_refused(tiny_llama_dir):
    cached, _, _, _ = _lora_scorers(tiny_llama_dir, frozen=1)
    cached.decoder.blocks[0].up.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="lower 1 blocks .* trainable"):
        tn.PackedScorer(cached.decoder, "mean", torch.device("cpu"), False, 1)
    with pytest.raises(ValueError, match="frozen must be in 0..1"):
        tn.PackedScorer(cached.decoder, "mean", torch.device("cpu"), False, 2)


def _scored(scores, labels, qtype="noul"):
    names = ["yes", "no"] if qtype == "noul" else ["a", "b", "c"]
    return [{"type": qtype, "scores": list(map(float, s)), "label": int(y), "target": int(y), "names": names,
             "dataset": "d", "qkey": "question/x"} for s, y in zip(scores, labels)]


def test_tune_keeps_the_candidate_with_the_lowest_heldout_nll_and_ties_go_to_the_cheaper():
    """The four candidates judged on the same held-out rows: a base engine whose scores lean the wrong way is fixed
    by calibration (base+calibrate beats a tuned engine that learned nothing); a tuned engine that separates the
    classes wins; equal candidates choose the cheaper. Control: the base alone is chosen when nothing beats it."""
    from onepass.calibration.tune.candidates import candidates, choose

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 80)
    signal = np.where(labels == 0, 1.0, -1.0)[:, None] * np.array([0.6, -0.6])  # a weak correct margin
    leaning = signal + np.array([-2.0, 2.0]) + rng.normal(0, 0.3, (80, 2))  # ... hidden under a bias towards "no"
    noise = rng.normal(0, 1.0, (80, 2))
    sharp = signal * 6 + rng.normal(0, 0.3, (80, 2))
    tr, he = slice(0, 60), slice(60, 80)
    rows = lambda s: (_scored(s[tr], labels[tr]), _scored(s[he], labels[he]))  # noqa: E731
    found = candidates([(*rows(leaning), *rows(noise))], "mean")
    assert [c.name for c in found] == ["base", "base+calibrate", "tuned", "tuned+calibrate"]
    assert choose(found).name == "base+calibrate" and found[1].nll < found[0].nll - 0.3
    assert choose(candidates([(*rows(leaning), *rows(sharp))], "mean")).name == "tuned"  # needs no calibration
    assert choose(candidates([(*rows(leaning), *rows(leaning))], "mean")).name == "base+calibrate"  # a tie: cheaper
    labels[:] = np.arange(80) % 2  # half yes, half no on both sides: no bias to learn
    flat = np.zeros((80, 2))  # nothing to learn or calibrate, a tuned engine that guesses: the base stays best
    assert choose(candidates([(*rows(flat), *rows(rng.normal(0, 2.0, (80, 2))))], "mean")).name == "base"
    assert choose(found, "tuned").name == "tuned"  # --write tuned (make train-default): the tuned weights regardless
    assert all(len(c.losses) == 20 and np.isclose(np.mean(c.losses), c.nll) for c in found)  # per held-out row


def test_the_head_is_kept_unless_an_untuned_candidate_is_clearly_better_on_the_same_rows():
    """The head replaces base + calibrate when their held-out NLLs differ by less than the noise of the difference
    (``HEAD_Z`` standard errors of the per-row difference, paired), even where base + calibrate's is a little lower.
    Controls: the same mean difference measured without noise (every row a little worse) is clear, and base +
    calibrate stays; so does the zero-shot base where it is the clearly better one; a tuned candidate must still beat
    every earlier one (base + calibrate too, not only the head) by ``TIE``; rows of one state count as one sample."""
    from onepass.calibration.tune.candidates import HEAD_Z, TIE, Candidate, choose, clearly_better, kept_within_noise

    rng = np.random.default_rng(0)
    cal = rng.exponential(0.7, 50)

    def pair(head_losses, base=None, states=()):
        head_losses = np.asarray(head_losses)
        d = head_losses - cal
        base = np.full(50, 1.0) if base is None else base
        return ([Candidate("base", None, base.mean(), 0.5, tuple(base), states),
                 Candidate("base+calibrate", None, cal.mean(), 0.5, tuple(cal), states),
                 Candidate("head", None, head_losses.mean(), 0.6, tuple(head_losses), states)],
                d.mean() / (d.std(ddof=1) / np.sqrt(len(d))))

    noisy, z = pair(cal + 0.03 + rng.normal(0, 0.3, 50))
    assert noisy[2].nll > noisy[1].nll + TIE and 0 < z < HEAD_Z, z  # base + calibrate lower, within the noise
    assert choose(noisy).name == "head" and not clearly_better(noisy[1], noisy[2])
    assert f"base+calibrate's NLL is lower by {noisy[2].nll - noisy[1].nll:.4f}, {z:.2f} standard errors" in \
        kept_within_noise(noisy, noisy[2])  # what tune's log and report say
    steady, z = pair(cal + noisy[2].nll - noisy[1].nll + rng.normal(0, 0.005, 50))  # the same mean, every row
    assert z > HEAD_Z and choose(steady).name == "base+calibrate", z
    assert kept_within_noise(steady, steady[1]) == ""
    exact, _ = pair(cal + 0.01)  # no spread at all: any difference beyond the tie is clear
    assert choose(exact).name == "base+calibrate"
    tiny, _ = pair(cal + TIE / 2 + rng.normal(0, 1e-5, 50))  # many standard errors, but within the tie
    assert choose(tiny).name == "head" and "within the tie" in kept_within_noise(tiny, tiny[2])
    zero_shot, _ = pair(cal + 0.03 + rng.normal(0, 0.3, 50), base=cal - 0.2)  # the base clearly better than both
    assert choose(zero_shot).name == "base"
    # a tuned candidate must beat base + calibrate by TIE, not only the head kept above it
    assert choose(noisy + [Candidate("tuned", None, noisy[1].nll - 2 * TIE, 0.6)]).name == "tuned"
    assert choose(noisy + [Candidate("tuned", None, noisy[2].nll - 2 * TIE, 0.6)]).name == "head"
    # ten states of five rows each, the difference shared within a state: ten samples, not fifty
    shared = np.repeat(rng.normal(0, 0.3, 10), 5)
    rows, z_rows = pair(cal + 0.1 + shared)
    grouped, _ = pair(cal + 0.1 + shared, states=tuple(np.repeat(np.arange(10), 5)))
    assert z_rows > HEAD_Z and choose(rows).name == "base+calibrate", z_rows  # counted as 50 rows: "clear"
    assert choose(grouped).name == "head"  # as 10 states: within the noise


def test_the_candidates_per_row_losses_line_up_across_folds():
    """Cross-validated candidates carry one loss per held-out row in the same order for every candidate (the fold
    order), so a paired difference compares a row with itself. The head's rows here lose exactly a known amount
    per row against the base's."""
    from onepass.calibration.tune.candidates import candidates

    rng = np.random.default_rng(1)
    folds, heads, expected = [], [], []
    for f in range(3):
        labels = rng.integers(0, 2, 12)
        train, held = (_scored(rng.normal(0, 1, (12, 2)), labels) for _ in range(2))
        held = [{**r, "state": (f, i)} for i, r in enumerate(held)]
        shift = rng.uniform(0, 2, 12)
        worse = [{**r, "scores": [v - shift[i] if k == r["label"] else v for k, v in enumerate(r["scores"])]}
                 for i, r in enumerate(held)]  # the label's logit lowered
        folds.append((train, held, None, None))
        heads.append({"head": (train, worse)})
        expected += [(r, w) for r, w in zip(held, worse)]
    by = {c.name: c for c in candidates(folds, "mean", heads)}
    from onepass.calibration.tune.candidates import row_losses

    base_losses = [row_losses([r], None)[0][0] for r, _ in expected]
    head_losses = [row_losses([w], None)[0][0] for _, w in expected]
    assert np.allclose(by["base"].losses, base_losses) and np.allclose(by["head"].losses, head_losses)
    assert np.all(np.asarray(by["head"].losses) > np.asarray(by["base"].losses))  # row by row
    assert by["head"].states == by["base"].states == tuple((f, i) for f in range(3) for i in range(12))


def test_cross_validation_folds_keep_each_state_whole_and_none_is_empty():
    from types import SimpleNamespace

    from onepass.calibration.tune.choice import state_folds

    chunks = [SimpleNamespace(state_ids=(i // 2,), size=1) for i in range(14)]  # 7 states, two chunks each
    folds = state_folds(chunks, 3, seed=0)
    assert all(folds[i] == folds[i + 1] for i in range(0, 14, 2))  # a state's chunks share their fold
    assert sorted(set(folds)) == [0, 1, 2] and folds == state_folds(chunks, 3, seed=0)
    assert folds != state_folds(chunks, 3, seed=1) or folds != state_folds(chunks, 3, seed=2)  # seeded, not fixed


@pytest.mark.parametrize("judged", ["cross-validated", "held-out"])
def test_an_untuned_candidate_is_written_with_the_untuned_weights(monkeypatch, tmp_path, judged):
    """When base (or base+calibrate) or the decision head wins, the weights left in the model are the initial ones,
    not the last training run's (the weights `--keep-base` exports, and a head engine's), and only a chosen head
    comes back with the outcome. Control: when tuned wins they are the trained ones."""
    from types import SimpleNamespace

    from onepass.calibration.tune import choice as tc
    from onepass.calibration.tune.candidates import Candidate

    weight = torch.nn.Parameter(torch.zeros(3))

    class Moves:  # a training run that moves the weights
        def __init__(self, *args):
            pass

        def run(self):
            with torch.no_grad():
                weight.add_(1.0)
            return tn.Progress()

    monkeypatch.setattr(tc, "Trainer", Moves)
    monkeypatch.setattr(tc, "head_candidate", SimpleNamespace(fit=lambda rows, seed, depth=None: "fitted head",
                                                              head_rows=lambda model, rows: rows))
    chunks = [SimpleNamespace(state_ids=(i,), size=1) for i in range(6)]
    for winner, moved in (("base", False), ("head", False), ("tuned", True)):
        nll = {name: 0.5 if name == winner else 0.9 for name in ("base", "head", "tuned")}
        monkeypatch.setattr(tc, "candidates", lambda folds, readout, heads: [Candidate(n, None, v, 0.5)  # noqa: B023
                                                                             for n, v in nll.items()])
        with torch.no_grad():
            weight.zero_()
        runs = tc.Runs(None, [weight], TuneConfig(), tmp_path, {}, None, lambda *_: None)
        runs.scored = lambda chunks, features=False: [{} for _ in chunks]
        if judged == "cross-validated":
            outcome = tc.cross_validated_choice(runs, chunks, [{}] * 6, False, "mean", 0)
        else:
            outcome = tc.held_out_choice(runs, chunks[:4], chunks[4:], ([{}] * 4, [{}] * 2), False, "mean")
        assert outcome.chosen.name == winner
        assert bool(weight.abs().sum() > 0) == moved, (winner, weight)
        assert outcome.head == ("fitted head" if winner == "head" else None)


def test_write_tuned_scores_only_the_held_out_rows(monkeypatch, tmp_path):
    """``--write tuned`` writes the tuned weights uncalibrated, so the training rows (what the calibrated candidates
    and the head are fitted on) are never scored: base and tuned are judged on the held-out rows, and no calibrated
    candidate is offered. Control: ``write="best"`` scores the training rows too, before and after the run."""
    from types import SimpleNamespace

    from onepass.calibration.tune import choice as tc

    class Run:  # a training run that leaves the weights alone
        def __init__(self, *args):
            pass

        def run(self):
            return tn.Progress()
    monkeypatch.setattr(tc, "Trainer", Run)
    train, held = ([SimpleNamespace(state_ids=(i,), size=1) for i in range(k)] for k in (30, 10))
    rng = np.random.default_rng(0)
    for write, wanted in (("tuned", [10, 10]), ("best", [30, 10, 30, 10])):
        calls = []
        runs = tc.Runs(None, [torch.nn.Parameter(torch.zeros(1))], TuneConfig(write=write), tmp_path, {}, None,
                       lambda *_: None)

        def scored(chunks, features=False, calls=calls):
            calls.append(len(chunks))
            labels = np.arange(len(chunks)) % 2
            return _scored(rng.normal(0, 1, (len(chunks), 2)), labels)
        runs.scored = scored
        outcome = tc.train_and_choose(runs, train, held, False, False, "mean", 0, heads=False)
        assert calls == wanted, (write, calls)
        names = [c.name for c in outcome.found]
        assert names == (["base", "tuned"] if write == "tuned" else
                         ["base", "base+calibrate", "tuned", "tuned+calibrate"]), names


def _with_features(rows, signal: float, rng):
    """``rows`` carrying a head's features: 16-d hidden states in which the labelled option's carry ``signal`` on
    one axis (0: nothing to learn), and the rows' own scores as the options' mean log-likelihoods."""
    out = []
    for i, r in enumerate(rows):
        hidden = rng.normal(0, 1, (len(r["scores"]), 16)).astype(np.float32)
        hidden[r["label"], 0] += signal
        out.append({**r, "features": (hidden, np.asarray(r["scores"], dtype=np.float64)), "state": i // 2})
    return out


def test_the_head_candidate_learns_what_the_hidden_states_carry_and_is_judged_beside_the_others():
    """A head fitted on rows whose hidden states carry the label (and whose zero-shot scores do not) answers other
    rows far better than the base; the five candidates come in order (the head without a calibrated twin: its temperature
    is its calibration). Control: hidden states that carry nothing give a head no better than the base."""
    from onepass.calibration.heads import candidate as head_candidate
    from onepass.calibration.tune.candidates import candidates, choose

    rng = np.random.default_rng(0)
    labels = np.arange(120) % 2
    train, held = (_with_features(_scored(rng.normal(0, 0.1, (60, 2)), labels[:60]), 3.0, rng) for _ in range(2))
    model = head_candidate.fit(train)
    head_train, head_held = head_candidate.head_rows(model, train), head_candidate.head_rows(model, held)
    found = candidates([(train, held, train, held)], "mean", [{"head": (head_train, head_held)}])
    assert [c.name for c in found] == ["base", "base+calibrate", "head", "tuned", "tuned+calibrate"]
    by_name = {c.name: c for c in found}
    assert by_name["head"].accuracy > 0.8 and by_name["head"].nll < by_name["base"].nll - 0.1, found
    assert choose(found).name == "head"
    noise = [_with_features(_scored(rng.normal(0, 0.1, (60, 2)), labels[:60]), 0.0, rng) for _ in range(2)]
    blind = head_candidate.fit(noise[0])
    found = candidates([(*noise, *noise)], "mean", [{"head": tuple(head_candidate.head_rows(blind, n) for n in noise)}])
    by_name = {c.name: c for c in found}
    assert by_name["head"].accuracy < 0.7 and by_name["head"].nll > by_name["base"].nll - 0.05
    # the temperature comes from scores of rows each inner head did not see: noise asks for softening (over the raw
    # read-out, which no calibrated prior has softened already), and it is folded into the head exactly (beta and its
    # output layer)
    import unittest.mock

    with unittest.mock.patch.object(head_candidate, "fit_prior", lambda rows: head_candidate.Prior()):
        assert head_candidate.temperature(noise[0]) > 1.5
    assert head_candidate.temperature(noise[0]) > 1.0
    import copy

    raw = head_candidate._train(head_candidate.option_features(noise[0]), head_candidate.CONFIG, 0)
    halved = head_candidate.tempered(copy.deepcopy(raw), 2.0)
    np.testing.assert_allclose([r["scores"] for r in head_candidate.head_rows(halved, noise[1])],
                               [np.asarray(r["scores"]) / 2 for r in head_candidate.head_rows(raw, noise[1])],
                               rtol=1e-6, atol=1e-7)
    # the heads of several seeds are merged into one that scores their mean exactly (what the engine computes)
    members = [head_candidate._train(head_candidate.option_features(train), head_candidate.CONFIG, s) for s in range(3)]
    mean = np.mean([[r["scores"] for r in head_candidate.head_rows(m, held)] for m in members], axis=0)
    one = head_candidate.merged(members)
    assert one.head.width == 3 * members[0].head.width
    np.testing.assert_allclose([r["scores"] for r in head_candidate.head_rows(one, held)], mean, rtol=1e-5, atol=1e-6)
    # control: one seed's head alone is not their mean
    assert np.abs(np.asarray([r["scores"] for r in head_candidate.head_rows(members[0], held)]) - mean).max() > 1e-3


def test_a_heads_temperature_matches_a_teachers_confidence_not_its_argmax():
    """Rows of `onepass distill` carry the teacher's distribution: the head's temperature is chosen by the
    cross-entropy against it (what tune judges candidates by), so with heads fitted to the same argmax labels, an
    unsure teacher (0.6 / 0.4) asks for a much softer head than sure labels do (the heads are fitted to the
    distributions too, which the next test proves; here they are fitted to the labels, to isolate the temperature).
    Control: one-hot distributions choose exactly what their label indices choose."""
    import unittest.mock

    from onepass.calibration.heads import candidate as head_candidate

    rng = np.random.default_rng(4)
    labels = np.arange(60) % 2
    rows = _with_features(_scored(rng.normal(0, 0.1, (60, 2)), labels), 3.0, rng)
    one_hot = [{**r, "target": (1.0, 0.0) if r["label"] == 0 else (0.0, 1.0)} for r in rows]
    unsure = [{**r, "target": (0.6, 0.4) if r["label"] == 0 else (0.4, 0.6)} for r in rows]
    with unittest.mock.patch.object(head_candidate, "_distributions", lambda rows: False):  # fitted to the labels
        sure = head_candidate.temperature(rows)
        assert head_candidate.temperature(one_hot) == sure
        assert head_candidate.temperature(unsure) > 2 * sure, (head_candidate.temperature(unsure), sure)


def test_a_student_head_learns_the_teachers_distribution_not_only_its_most_probable_option():
    """`onepass distill`'s rows carry the teacher's distribution: a head fitted on it (240 rows, 3 options, a teacher
    whose scores are a function of the options' hidden states) matches the teacher on 400 other rows better than the
    head fitted on its most probable options for as many epochs: lower cross-entropy against its distribution, more
    argmaxes agreed. Control: one-hot distributions fit the same head as the label indices they spell (the soft loss
    is the labels' cross-entropy where the teacher is sure)."""
    import unittest.mock

    from onepass.calibration.heads import candidate as hc
    from onepass.calibration.scoring.metrics import target_nll

    rng = np.random.default_rng(1)

    def rows(n):
        out = []
        for i in range(n):
            hidden = rng.normal(0, 1, (3, 16)).astype(np.float32)
            logits = 2.0 * hidden[:, 0] + 1.0 * hidden[:, 1]
            p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            out.append({**_scored([rng.normal(0, 0.1, 3)], [int(np.argmax(p))], "choice")[0], "target": tuple(p),
                        "features": (hidden, rng.normal(0, 0.1, 3)), "state": i})
        return out

    def against_teacher(model, rows):
        scored = hc.head_rows(model, rows)
        agree = np.mean([np.argmax(r["scores"]) == np.argmax(r["target"]) for r in scored])
        return agree, np.mean([target_nll(hc._log_softmax(np.asarray(r["scores"])), r["target"]) for r in scored])

    train, test = rows(240), rows(400)
    argmax_rows = [{**r, "target": r["label"]} for r in train]
    one_hot = [{**r, "target": tuple(float(k == r["label"]) for k in range(3))} for r in train]
    with unittest.mock.patch.object(hc, "DISTRIBUTION_EPOCHS", hc.CONFIG.epochs):  # the loss is all that differs
        soft, hard, spelt = (hc.fit(r, seeds=1) for r in (train, argmax_rows, one_hot))
    assert (soft.targets, hard.targets, spelt.targets) == ("the teacher's distributions", "labels",
                                                           "the teacher's distributions")
    (soft_agree, soft_ce), (hard_agree, hard_ce) = against_teacher(soft, test), against_teacher(hard, test)
    assert soft_ce < hard_ce - 0.05 and soft_agree > hard_agree, (soft_agree, soft_ce, hard_agree, hard_ce)
    np.testing.assert_allclose([r["scores"] for r in hc.head_rows(spelt, test)],
                               [r["scores"] for r in hc.head_rows(hard, test)], rtol=1e-4, atol=1e-4)


def test_the_head_corrects_the_calibrated_read_out_and_the_engine_computes_it_exactly():
    """Zero-shot scores biased against the label prior (the labelled option is usually scored lower) and hidden states
    that carry a weak signal: the head fitted over the calibrated prior beats the head over the raw read-out on other
    rows. What the engine computes from the served head and its calibration (beta * mean + head(h), then the
    calibration of the ``head`` read-out) equals what the candidate was judged with, to float rounding. Control: the
    served head without that calibration does not."""
    import unittest.mock

    import torch

    from onepass.calibration.heads import candidate as hc
    from onepass.runtime.core.readout_calibration import Calibration

    rng = np.random.default_rng(3)

    def rows(n):
        labels = (rng.random(n) < 0.8).astype(int)  # option 1 is the usual answer ...
        scores = rng.normal(0, 0.3, (n, 2))
        scores[:, 1] -= 1.0  # ... and the zero-shot read-out prefers option 0
        return _with_features(_scored(scores, labels), 0.7, rng)
    train, held = rows(60), rows(400)
    model = hc.fit(train)
    assert model.prior.calibration is not None and "noul" in model.prior.calibration.groups
    with unittest.mock.patch.object(hc, "fit_prior", lambda rows: hc.Prior()):  # the same fit over the raw read-out
        raw = hc.fit(train)
    found = candidates_of(held, {"prior": hc.head_rows(model, held), "raw": hc.head_rows(raw, held)})
    assert found["prior"] < found["raw"] - 0.02, found
    head, calibration = hc.served(model)
    assert isinstance(calibration, Calibration) and calibration.readout == "head"

    def engine_scores(r, cal):
        hidden, mean = r["features"]
        with torch.no_grad():
            s = float(head.beta) * np.asarray(mean) + head.head(torch.from_numpy(hidden).float()).double().numpy()
        return cal.apply(r["type"], s, r["names"], r["qkey"]) if cal is not None else s
    judged = np.array([r["scores"] for r in hc.head_rows(model, held)])
    np.testing.assert_allclose([engine_scores(r, calibration) for r in held], judged, atol=1e-5)
    gap = np.abs(np.array([engine_scores(r, None) for r in held]) - judged).max()
    assert gap > 0.1, gap  # control: the prior's bias is in the calibration, not in the head
    # the served head carries no prior of its own (its beta is divided by the prior's scale already)
    np.testing.assert_allclose([r["scores"] for r in hc.head_rows(head, held)], [engine_scores(r, None) for r in held],
                               atol=1e-5)

    # every kind of group at once, each with its own temperature: a yes/no question (bias on yes), a 3-option choice
    # asked in several option orders (a bias per option name), a 3-level score (a bias per level), and held-out rows
    # of a question never trained on (its type group applies)
    def asked(qtype, qkey, n, names=("a", "b", "c"), shift=1.0, spread=0.3):
        out = []
        for i in range(n):
            k = 2 if qtype == "noul" else 3
            order = list(rng.permutation(k)) if qtype == "choice" else list(range(k))
            label = int(rng.random() < 0.7)  # the usual answer: the second option
            scores = rng.normal(0, spread, k)
            scores[1] -= shift
            row = {"type": qtype, "scores": [float(scores[j]) for j in order], "label": order.index(label),
                   "target": order.index(label), "names": [(["yes", "no"] if k == 2 else list(names))[j] for j in order],
                   "dataset": "d", "qkey": qkey}
            out.append(_with_features([row], 0.7, rng)[0] | {"state": f"{qkey}{i}"})
        return out
    mixed = asked("noul", "question/n", 60, shift=1.0) + asked("choice", "question/c", 60, shift=2.0, spread=1.0) \
        + asked("score", "question/s", 60, shift=0.5, spread=0.1)
    held = asked("noul", "question/n", 40) + asked("choice", "question/c", 40) + asked("score", "question/s", 40) \
        + asked("noul", "question/unseen", 40)
    model = hc.fit(mixed)
    groups = model.prior.calibration.groups
    assert {"noul", "question/n", "question/c", "question/s"} <= set(groups), set(groups)
    assert len({round(g.temperature, 3) for g in groups.values()}) > 1  # temperatures differ: scale is not each T
    assert groups["question/c"].option_bias and groups["question/s"].bias and groups["noul"].bias
    head, calibration = hc.served(model)
    judged = np.array([s for r in hc.head_rows(model, held) for s in r["scores"]])
    np.testing.assert_allclose([s for r in held for s in engine_scores(r, calibration)], judged, atol=1e-5)


def candidates_of(held: list[dict], scored: dict) -> dict:
    """Mean held-out NLL of each of ``scored`` (name -> the held rows as a fit scores them)."""
    from onepass.calibration.tune.candidates import heldout_metrics

    return {name: heldout_metrics(rows, None)[0] / len(rows) for name, rows in scored.items()}


def test_a_calibration_needs_its_rows_so_few_rows_offer_no_calibrated_candidate():
    from onepass.calibration.tune.candidates import candidates

    few = _scored(np.zeros((10, 2)), np.zeros(10))
    assert [c.name for c in candidates([(few, few, few, few)], "mean")] == ["base", "tuned"]
    enough = _scored(np.zeros((30, 2)), np.arange(30) % 2)
    both = [(enough, few, enough, few), (enough, few, enough, few)]
    assert [c.name for c in candidates(both, "mean")] == ["base", "base+calibrate", "tuned", "tuned+calibrate"]
    one_short = [(enough, few, enough, few), (few, few, few, few)]  # a fold that cannot calibrate: no candidate
    assert [c.name for c in candidates(one_short, "mean")] == ["base", "tuned"]


@pytest.mark.slow
def test_when_calibrating_the_base_wins_tune_writes_the_calibrated_base(tiny_engine_dir, tmp_path):
    """Every note's answer is yes, which a calibration of the untuned engine learns from the training rows; a
    learning rate too small to move the weights leaves the tuned candidates no better (and the head is left out:
    it would learn the same). `onepass tune` then writes the base engine (the same graph and weights) with that calibration, says so, and the engine answers yes more
    surely than its base."""
    from onepass import Engine

    question = Noul("Is this a note?")
    data = _write(tmp_path, [{"state": f"Note {i}: the meeting moved to room {i + 3}.", "question": to_wire(question),
                              "label": "yes"} for i in range(40)], "notes.jsonl")
    out = tmp_path / "tuned"
    proc = subprocess.run([sys.executable, "-m", "onepass", "tune", "--engine", str(tiny_engine_dir), "--data",
                           str(data), "--out", str(out), "--lr", "1e-12", "--max-steps", "2", "--rank", "2",
                           "--holdout", "0.25", "--no-head"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "written: base+calibrate" in proc.stdout, proc.stdout[-2000:]
    base, tuned = Engine.load(tiny_engine_dir), Engine.load(out)
    assert tuned.manifest.files[base.manifest.graph] == base.manifest.files[base.manifest.graph]  # the base's graph
    assert tuned.manifest.calibration.source["tune"]["chosen"] == "base+calibrate"
    from onepass.calibration.teach.distill import _tuned  # distill --resume knows a calibrated student finished on these rows

    assert _tuned(out, data)["choice"]["chosen"] == "base+calibrate" and _tuned(out, out / "manifest.json") is None
    state = "Note 99: the meeting moved to room 7."
    assert tuned.ask(state, {"q": question})["q"].noul > base.ask(state, {"q": question})["q"].noul + 0.05
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl", "tuned", "tuned-report"]  # no work folder
    forced = subprocess.run([sys.executable, "-m", "onepass", "tune", "--engine", str(tiny_engine_dir), "--data",
                             str(data), "--out", str(tmp_path / "forced"), "--lr", "1e-12", "--max-steps", "2",
                             "--rank", "2", "--holdout", "0.25", "--write", "tuned"], capture_output=True, text=True,
                            timeout=600)
    assert forced.returncode == 2 and "not beaten by tuning it (--write tuned)" in forced.stderr, forced.stderr[-2000:]
    assert not (tmp_path / "forced").exists()  # --write tuned writes no tuning that learned nothing


def test_open_settings_are_chosen_from_the_row_count_and_given_ones_are_kept():
    few, many = resolved(TuneConfig(), 40, 30, held=10), resolved(TuneConfig(), 400, 30, held=100)
    assert (few.train_blocks, few.lr, few.epochs) == (4, 1e-3, 6)  # 5 steps an epoch: 6 epochs reach 30 steps
    assert (many.train_blocks, many.lr, many.epochs) == (0, 3e-4, 3)  # from 80 training rows: every block
    assert resolved(TuneConfig(), 4, 30).epochs == 12  # capped
    given = resolved(TuneConfig(train_blocks=0, lr=3e-4, epochs=2), 40, 30)
    assert (given.train_blocks, given.lr, given.epochs) == (0, 3e-4, 2)  # 0: every block, as asked
    assert resolved(TuneConfig(train_blocks=0), 40, 30).lr == 3e-4  # every block: the gentler rate
    assert resolved(TuneConfig(), 79, 30).train_blocks == 4 and resolved(TuneConfig(), 80, 30).train_blocks == 0
    full = resolved(TuneConfig(method="full"), 40, 30)
    assert (full.train_blocks, full.lr, full.epochs) == (0, 2e-5, 3)
    assert resolved(TuneConfig(), 40, 2).train_blocks == 2  # a model with fewer blocks: all of them
    assert resolved(TuneConfig(), 240, 30, held=60).patience == 2
    assert resolved(TuneConfig(), 40, 30, held=10).patience > 100  # 10 questions: no early stopping
    assert resolved(TuneConfig(patience=1), 40, 30, held=10).patience == 1
    with pytest.raises(ValueError, match="train_blocks must be >= 0"):
        TuneConfig(train_blocks=-1)


def test_train_blocks_flag_takes_a_count_or_all():
    import argparse

    from onepass.flags import _blocks

    assert _blocks("all") == 0 and _blocks("4") == 4
    for bad in ("0", "-2", "some"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of blocks or 'all'"):
            _blocks(bad)


def test_teacher_targets_blend_the_engines_answer_asked_alone_with_the_label(tiny_engine_dir, tmp_path):
    """`python -m onepass.calibration.teach.targets`: each row's target is weight x the teacher's served answer
    (the questions about one state are asked in one pass; the reference asks each row alone) + (1 - weight) x the
    label's one-hot; crossed rows ask each state a question of another data set, with the teacher's answer alone.
    Negative control: the same question about another state gets another answer, which the comparison would catch."""
    from onepass import Engine
    from onepass.calibration.data.rows import label_index
    from onepass.calibration.teach.targets import crossed_rows, teach
    from onepass.calibration.data.rows import load_rows as load_tune_rows
    from onepass.runtime.core.questions import from_wire
    from onepass.runtime.teacher.client import answer_distribution, option_keys

    rows = [{"dataset": "rain", "state": f"Note {i}: it rained {i} times.", "question": NOUL, "label": "yes"}
            for i in range(3)]
    rows += [{"dataset": "team", "state": "Note 0: it rained 0 times.", "question": TEAM, "label": "blue"},
             {"dataset": "loud", "state": "The band played.", "question": LEVEL, "label": 2}]
    crossed = crossed_rows(rows, 1, seed=0)
    assert crossed == crossed_rows(rows, 1, seed=0)  # seeded
    assert len(crossed) == 4 and all("label" not in r for r in crossed)  # 4 states, each lacking a data set
    for r in crossed:
        own = {x["dataset"] for x in rows if x["state"] == r["state"]}
        assert r["dataset"].endswith("@crossed") and r["dataset"].split("@")[0] not in own
    engine = Engine.load(tiny_engine_dir)
    taught = teach(engine, rows + crossed, 0.25, log=lambda *_: None)

    def alone(r):
        q = from_wire("question", r["question"])
        return q, answer_distribution(q, engine.ask(r["state"], {"q": q})["q"])

    for r, t in zip(rows + crossed, taught):
        q, p = alone(r)
        got = np.array([t["probabilities"][k] for k in option_keys(q)])
        want = p if "label" not in r else 0.25 * p + 0.75 * np.eye(len(p))[label_index(q, r["label"])]
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert {k: v for k, v in t.items() if k != "probabilities"} == r  # the row itself unchanged
    other = alone({"state": "A long note about the weather in spring.", "question": NOUL})[1]
    assert np.abs(other - alone(rows[0])[1]).max() > 1e-3  # the control: another state's answer differs
    path = _write(tmp_path, taught, "taught.jsonl")
    parsed, _ = load_tune_rows([path])  # what tune trains on: the blended distribution
    assert parsed[0].target == pytest.approx(tuple(taught[0]["probabilities"][k] for k in ("yes", "no")))
    with pytest.raises(InvalidRequest, match="weight"):
        teach(engine, rows, 1.5)
    with pytest.raises(InvalidRequest, match="crossed"):
        crossed_rows(rows, -1)


def test_teacher_targets_cli_writes_taught_rows_and_its_errors_are_one_line_and_write_nothing(tiny_engine_dir, tmp_path):
    """The command `make train-default-compact` runs (--crossed 1), then each way it can fail: a bad row, a row without
    a label, bad JSON, a teacher folder that is no engine, a weight out of range, an output folder that does not
    exist. Each is one line on stderr, exit 2, and no file (nor a partial one) is left."""
    good = _write(tmp_path, [{"dataset": "rain", "state": "Note 1.", "question": NOUL, "label": "yes"},
                             {"dataset": "team", "state": "Note 2.", "question": TEAM, "label": "red"}], "good.jsonl")

    def run(rows, teacher, out, *extra):
        return subprocess.run([sys.executable, "-m", "onepass.calibration.teach.targets", "--rows", str(rows),
                               "--teacher", str(teacher), "--out", str(out), *extra], capture_output=True, text=True)

    out = tmp_path / "taught.jsonl"
    proc = run(good, tiny_engine_dir, out, "--crossed", "1")
    assert proc.returncode == 0, proc.stderr
    taught = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("label") for r in taught] == ["yes", "red", None, None] and all("probabilities" in r for r in taught)
    assert [r["dataset"] for r in taught[2:]] == ["team@crossed", "rain@crossed"]
    out.unlink()
    for rows, teacher, extra, message in (
            ([{"state": "x", "question": NOUL, "label": "maybe"}], tiny_engine_dir, (), "rows.jsonl:1"),
            ([{"state": "x", "question": NOUL, "probabilities": {"yes": 1.0}}], tiny_engine_dir, (), "needs a label"),
            (["{not json"], tiny_engine_dir, (), "not valid JSON"),
            (None, tmp_path, (), "manifest"),
            (None, tiny_engine_dir, ("--weight", "1.5"), "weight"),
            (None, tiny_engine_dir, ("--out", str(tmp_path / "missing" / "taught.jsonl")), "missing")):
        data = good if rows is None else _write(tmp_path, rows)
        proc = run(data, teacher, out, *extra)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert not out.exists() and not (tmp_path / "missing").exists()
        assert not [p for p in tmp_path.rglob("*.partial")]
