"""bf16 by default only where a measured guarantee holds: `onepass guarantee` measures OpenVINO's bf16 against its
f32 on the user's requests per data set and records it; the default backend (`auto`) answers in bf16 only where every
data set keeps the bounds (>= 99% argmaxes, max |dp| <= 0.05, >= 100 questions) and the CPU is of the kind measured.
On the tiny Llama's engine. Negative controls: each bound missed, another CPU kind, a variant whose answers were
moved on purpose."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("openvino", reason="OpenVINO is not installed (pip install 'onepass[openvino]')")

from onepass import Engine  # noqa: E402
from onepass.cli import main  # noqa: E402
from onepass.runtime.core import backend_choice, guarantee  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.errors import EngineFileError, InvalidRequest  # noqa: E402
from onepass.runtime.core.questions import NoulAnswer  # noqa: E402
from onepass.runtime.tools import guarantee as tool  # noqa: E402

DATA = Path(__file__).parent / "data"
STATE = (DATA / "ticket.txt").read_text()
QUESTIONS = json.loads((DATA / "questions.json").read_text())
HOLDS = {"reference": "openvino-cpu", "cpu": "avx512_bf16", "computed_in": "bf16",
         "datasets": {"a": {"questions": 120, "argmax_agreement": 1.0, "max_abs_dp": 0.02},
                      "b": {"questions": 100, "argmax_agreement": 0.99, "max_abs_dp": 0.05}}}


def _with(dataset: str, **change) -> dict:
    return {**HOLDS, "datasets": {**HOLDS["datasets"], dataset: {**HOLDS["datasets"][dataset], **change}}}


def test_the_bounds_and_each_way_to_miss_them():
    assert guarantee.misses(HOLDS, "avx512_bf16") is None
    assert "argmax agreement 0.98" in guarantee.misses(_with("b", argmax_agreement=0.98), "avx512_bf16")
    assert "max |dp| 0.06" in guarantee.misses(_with("a", max_abs_dp=0.06), "avx512_bf16")
    assert "max |dp| 0.05004" in guarantee.misses(_with("a", max_abs_dp=0.05004), "avx512_bf16")  # never rounded
    assert "argmax agreement 0.98996" in guarantee.misses(_with("b", argmax_agreement=0.98996), "avx512_bf16")
    assert "computed in f32" in guarantee.misses({**HOLDS, "computed_in": "f32"}, "avx512_bf16")
    assert "engine changed" in guarantee.misses({**HOLDS, "engine": "old"}, "avx512_bf16", "new")
    assert guarantee.misses({**HOLDS, "engine": "new"}, "avx512_bf16", "new") is None
    for unreadable in ("fast", {**HOLDS, "datasets": ["a"]}, _with("a", questions="many"), _with("a", max_abs_dp=None)):
        assert "cannot be read" in guarantee.misses(unreadable, "avx512_bf16")
    assert "99 questions" in guarantee.misses(_with("b", questions=99), "avx512_bf16")
    assert "measured on a avx512_bf16 CPU and this one is amx" in guarantee.misses(HOLDS, "amx")
    assert "no native bf16" in guarantee.misses(HOLDS, None)
    assert "no guarantee" in guarantee.misses(None, "amx")
    assert "no data set" in guarantee.misses({**HOLDS, "datasets": {}}, "avx512_bf16")


def test_the_cpu_kind_is_read_from_its_flags():
    assert guarantee.cpu_bf16_kind("flags\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n") == "amx"
    assert guarantee.cpu_bf16_kind("flags\t: fpu avx512f avx512_bf16\n") == "avx512_bf16"
    assert guarantee.cpu_bf16_kind("flags\t: fpu avx2 avx512f\n") is None


@pytest.fixture()
def copy(tiny_engine_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(backend_choice, "_verdicts", {})
    monkeypatch.setattr(backend_choice, "cpu_bf16_kind", lambda: "avx512_bf16")
    return mf.copy_engine(tiny_engine_dir, tmp_path / "engine")


def test_the_default_answers_in_bf16_only_where_the_recorded_guarantee_holds(copy, caplog):
    assert Engine.load(copy).backend.name == "openvino-cpu"  # no guarantee: fp32
    holds = {**HOLDS, "engine": guarantee.fingerprint(mf.load(copy))}
    tool.record(copy, guarantee.BF16, holds)
    assert mf.load(copy).guarantees[guarantee.BF16] == holds  # recorded, and the engine's files still verify
    with caplog.at_level(logging.INFO, logger="onepass.backends"):
        assert Engine.load(copy).backend.name == "openvino-cpu-bf16"
    assert "its measured guarantee holds" in caplog.text
    tool.record(copy, guarantee.BF16, {**_with("a", max_abs_dp=0.2), "engine": holds["engine"]})  # one over: fp32
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="onepass.backends"):
        assert Engine.load(copy).backend.name == "openvino-cpu"
    assert "max |dp| 0.2 > 0.05" in caplog.text
    tool.record(copy, guarantee.BF16, {**holds, "cpu": "amx"})  # measured on another kind of CPU: fp32
    assert Engine.load(copy).backend.name == "openvino-cpu"
    tool.record(copy, guarantee.BF16, holds)
    assert Engine.load(copy, backend="openvino-cpu").backend.name == "openvino-cpu"  # asked by name: as asked
    calibrated = mf.load(copy)  # the engine changed after the measurement (here its read-out): fp32 again
    mf.write(copy, dataclasses.replace(calibrated, scoring=dataclasses.replace(calibrated.scoring, readout="sum")))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="onepass.backends"):
        assert Engine.load(copy).backend.name == "openvino-cpu"
    assert "the engine changed since the guarantee was measured" in caplog.text


def test_an_unreadable_guarantee_is_refused_on_load_or_passed_over(copy):
    """A guarantees field of the wrong shape is an invalid manifest (a typed error naming it); a guarantee whose
    numbers cannot be read leaves the default at fp32 instead of failing Engine.load."""
    raw = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**raw, "guarantees": {guarantee.BF16: "fast"}}))
    with pytest.raises(EngineFileError, match="guarantees"):
        Engine.load(copy)
    (copy / "manifest.json").write_text(json.dumps({**raw, "guarantees": {guarantee.BF16: {**HOLDS, "datasets": [1]}}}))
    assert Engine.load(copy).backend.name == "openvino-cpu"


def test_measure_compares_two_backends_per_data_set(tiny_engine_dir, monkeypatch):
    """OpenVINO f32 against ONNX Runtime keeps every answer (within float reordering), and the verdict says the
    variant did not compute in bf16; the same measure on a variant whose yes/no answers were turned over on purpose
    (p -> 1 - p: negative control) sees the move and the flips, and the aggregates are those of the answers."""
    body = {"state": STATE, "questions": QUESTIONS}
    requests = [("x", tool.parse_request(body)), ("y", tool.parse_request(body))]
    same = tool.measure(tiny_engine_dir, requests, variant="openvino-cpu", reference="onnxruntime")
    data = same["guarantee"]["datasets"]
    assert set(data) == {"x", "y"} and data["x"]["questions"] == len(QUESTIONS)
    assert data["x"]["argmax_agreement"] == 1.0 and data["x"]["max_abs_dp"] <= 1e-3
    assert same["guarantee"]["computed_in"] == "f32" and same["misses"] is not None

    ask = Engine.ask

    def moved(self, state, questions, *args, **kw):
        answers = ask(self, state, questions, *args, **kw)
        if self.backend.name == "openvino-cpu":
            return {k: NoulAnswer(noul=1.0 - a.noul) if isinstance(a, NoulAnswer) else a for k, a in answers.items()}
        return answers

    monkeypatch.setattr(Engine, "ask", moved)
    changed = tool.measure(tiny_engine_dir, requests[:1], variant="openvino-cpu", reference="onnxruntime")
    m = changed["guarantee"]["datasets"]["x"]
    reference = Engine.load(tiny_engine_dir, backend="onnxruntime").ask(STATE, tool.parse_request(body)[1])
    moves = {k: abs(2 * a.noul - 1) for k, a in reference.items() if isinstance(a, NoulAnswer)}
    assert moves and m["max_abs_dp"] == pytest.approx(max(moves.values()), abs=1e-3)  # |p - (1 - p)| = |2p - 1|
    flips = sum(move > 1e-3 for move in moves.values())
    assert m["argmax_agreement"] == pytest.approx(1 - flips / len(QUESTIONS))  # only the yes/no answers flipped


def test_bad_request_files_are_one_line_errors_and_write_nothing(copy, tmp_path, capsys):
    before = (copy / "manifest.json").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"state": STATE, "questions": QUESTIONS}) + "\n{not json\n")
    with pytest.raises(InvalidRequest, match="line 2"):
        tool.read_requests(bad)
    bad.write_text(json.dumps({"state": STATE, "questions": {}, "dataset": "x"}) + "\n")
    assert main(["guarantee", "--engine", str(copy), "--requests", str(bad), "--write"]) != 0
    err = capsys.readouterr().err.strip()
    assert "line 1" in err and "questions" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert (copy / "manifest.json").read_bytes() == before


def test_the_command_reports_per_data_set_and_records_with_write(copy, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"state": STATE, "questions": QUESTIONS, "dataset": name}) + "\n"
                            for name in ("tickets", "tickets", "other")))
    assert main(["guarantee", "--engine", str(copy), "--requests", str(good), "--write"]) == 0
    out = capsys.readouterr().out
    assert "tickets" in out and "other" in out and "missed, the default stays fp32" in out  # 13-26 questions < 100
    recorded = mf.load(copy).guarantees[guarantee.BF16]
    assert recorded["datasets"]["tickets"]["questions"] == 2 * len(QUESTIONS)
    assert Engine.load(copy).backend.name == "openvino-cpu"  # recorded, and too small to unlock bf16


def test_closeness_takes_the_largest_change_of_a_questions_options_not_their_average():
    """A question of four options where one probability moves by 0.3 and the others by 0.1 each: its |dp| is 0.3
    (the bound is on any answer probability), and the data set's max is the largest over questions. Controls: the
    mean over the options (0.15) or the first option alone (0.1) would both pass a 0.2 bound that this misses."""
    import numpy as np

    from onepass.runtime.tools.guarantee import Closeness

    closeness = Closeness()
    p = np.array([0.4, 0.3, 0.2, 0.1])
    q = np.array([0.3, 0.6, 0.1, 0.0])
    closeness.add("d", p, q)
    closeness.add("d", np.array([0.6, 0.4]), np.array([0.55, 0.45]))
    got = closeness.datasets()["d"]
    assert got["max_abs_dp"] == pytest.approx(0.3) and got["mean_abs_dp"] == pytest.approx((0.3 + 0.05) / 2)
    assert got["argmax_agreement"] == pytest.approx(0.5)  # the first question's answer moved to option 2
    assert np.abs(p - q).mean() < 0.2 and abs(p[0] - q[0]) < 0.2  # the controls: what an average would have said
