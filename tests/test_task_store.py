"""Tuned tasks stored beside an engine and served by it (issue 45): ``Engine.load`` of an engine with tasks runs its
slot graph, each question of a task answers as transformers + peft asking it alone of that task (the state from the
engine's own weights), untasked questions answer as the engine without tasks, and the store refuses what it should.
"""

import copy
import hashlib
import json
import os
import shutil
from contextlib import nullcontext
from typing import Literal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core import task_store  # noqa: E402
from onepass.runtime.core.engine import Engine  # noqa: E402
from onepass.runtime.core.errors import EngineFileError, InvalidRequest  # noqa: E402
from onepass.runtime.core.questions import Choice, Noul  # noqa: E402
from onepass.runtime.core.tasks import TaskAdapter  # noqa: E402

TASKS = ("fraud", "urgency")
TOL = 1e-4  # float32, summed over an option's tokens (as test_tasks)
STATE = "Ticket: my card was charged twice for the same order and nobody answers the phone."
QUESTIONS = {"fraud": Noul("Is this fraud?"), "team": Choice("Which team?", {"billing": None, "shipping": None})}


@pytest.fixture(scope="module")
def tasked(tiny_engine_dir, tiny_llama_dir, tmp_path_factory):
    """(engine copy with the two tasks stored, the peft model holding them over the tiny Llama's weights)."""
    import transformers
    from peft import get_peft_model, get_peft_model_state_dict

    from onepass.calibration.tune.task import ensure_slots
    from onepass.export.adapter import lora_config

    engine = tmp_path_factory.mktemp("tasked") / "engine"
    mf.copy_engine(tiny_engine_dir, engine)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")  # noqa: E731
    peft = get_peft_model(load().eval(), lora_config(4, None, [1]), adapter_name=TASKS[0])  # scale 2: exact in fp16
    peft.add_adapter(TASKS[1], lora_config(2, None, [0, 1]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p).mul_(0.3 if "lora_B" in name else 1.0).half().float())  # stored as fp16
    peft.eval()
    manifest = mf.load(engine)
    for name in TASKS:
        state = {k: v.numpy() for k, v in get_peft_model_state_dict(peft, adapter_name=name).items()}
        cfg = peft.peft_config[name]
        adapter = TaskAdapter.from_peft(name, state, cfg.lora_alpha / cfg.r)
        ensure_slots(engine, manifest, load, {b for b, _ in adapter.factors}, log=lambda *a: None)
        task_store.write_task(engine, manifest, adapter, {"questions": [], "calibration": None})
    return engine, peft


def _alone(peft, state_ids, tokens, task: str | None) -> np.ndarray:
    """[K] option log-likelihoods of a question asked alone of ``task`` (None: the base) over the base's cache."""
    with torch.no_grad():
        with peft.disable_adapter():
            past = peft(torch.tensor([list(state_ids)]), use_cache=True).past_key_values
        if task is not None:
            peft.set_adapter(task)
        out = []
        for option in tokens.options:
            seq = list(tokens.trunk) + list(option)
            with peft.disable_adapter() if task is None else nullcontext():
                logits = peft(torch.tensor([seq]), past_key_values=copy.deepcopy(past), use_cache=True).logits[0]
            lp = torch.log_softmax(logits[len(tokens.trunk) - 1:-1].double(), -1)
            out.append(sum(float(lp[k, t]) for k, t in enumerate(option)))
    return np.array(out)


def _asked():
    """Both questions of each task and of none, in one request."""
    return {f"{qid}.{task or 'base'}": type(q)(q.instructions, q.criteria, task)
            for task in (*TASKS, None) for qid, q in QUESTIONS.items()}


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino-cpu", "torch-cpu"])
def test_an_engine_with_tasks_answers_each_question_as_its_task_alone(tasked, tiny_engine_dir, backend):
    """One request, questions of two tasks and of none, one pass over one prefill: each equals transformers + peft
    asking it alone of its task (1e-4); untasked ones equal the engine without tasks (1e-5). Negative control: the
    two tasks' names swapped moves the answers far past the tolerance."""
    if backend == "openvino-cpu":
        pytest.importorskip("openvino")
    engine_dir, peft = tasked
    asked = _asked()
    with Engine.load(engine_dir, backend=backend) as engine, Engine.load(tiny_engine_dir, backend=backend) as plain:
        assert engine.tasks.names == TASKS and engine.backend.tasks.count == 2  # the backend feeds the slot graph
        assert engine.manifest == plain.manifest  # the engine's own manifest, as on disk
        encoded = engine.encode_questions(asked)
        state_ids = engine.planner.state_ids(STATE)
        got = engine.option_logprobs(STATE, encoded)
        want = [_alone(peft, state_ids, tokens, q.task) for tokens, q in zip(encoded, asked.values())]
        for qid, g, w in zip(asked, got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=TOL, err_msg=qid)
        base = plain.option_logprobs(STATE, plain.encode_questions({k: v for k, v in asked.items() if v.task is None}))
        np.testing.assert_allclose(np.concatenate(got[-2:]), np.concatenate(base), rtol=0, atol=1e-5)
        swapped = {k: type(q)(q.instructions, q.criteria, {"fraud": "urgency", "urgency": "fraud"}.get(q.task))
                   for k, q in asked.items()}
        moved = engine.option_logprobs(STATE, engine.encode_questions(swapped))
        assert max(np.abs(m - w).max() for m, w in zip(moved[:4], want[:4])) > 100 * TOL
        answers = engine.ask(STATE, asked)
        assert set(answers) == set(asked)


def test_the_wire_names_a_task_and_an_unknown_one_is_refused_with_the_engines_tasks(tasked, tiny_engine_dir):
    engine_dir, _ = tasked
    body = {"state": STATE, "questions": {"f": {"type": "noul", "instructions": "Is this fraud?", "task": "fraud"},
                                          "b": {"type": "noul", "instructions": "Is this fraud?"}}}
    with Engine.load(engine_dir, backend="onnxruntime") as engine:
        out = engine.request(body)["answers"]
        assert out["f"]["noul"] != pytest.approx(out["b"]["noul"], abs=1e-6)  # the task answers, not the base
        wrong = json.loads(json.dumps(body))
        wrong["questions"]["f"]["task"] = "spam"
        with pytest.raises(InvalidRequest, match="no tuned task 'spam'; its tasks are fraud, urgency") as err:
            engine.request(wrong)
        assert err.value.field == "questions.f.task"
        wrong["questions"]["f"]["task"] = 3
        with pytest.raises(InvalidRequest, match="task must be the name"):
            engine.request(wrong)
    with Engine.load(tiny_engine_dir, backend="onnxruntime") as plain:
        with pytest.raises(InvalidRequest, match="no tuned task 'fraud'; it has none"):
            plain.request(body)


def test_decide_asks_a_fields_task_as_named_on_the_field_or_on_its_nested_model(tasked):
    """``json_schema_extra={"task": ...}`` on a field asks its question of that task (on a nested model's field, every
    question inside); each answer equals the same question asked with its task in Python, the untasked field the base's.
    Control: the tasked answers differ from the untasked ones. A task that is not a name is refused naming the field."""
    from pydantic import BaseModel, Field

    from onepass.runtime.core.errors import InvalidRequest as Invalid

    class Inner(BaseModel):
        team: Literal["billing", "shipping"] = Field(description="Which team?")

    class Ticket(BaseModel):
        fraud: bool = Field(description="Is this fraud?", json_schema_extra={"task": "fraud"})
        plain: bool = Field(description="Is this fraud?")
        routed: Inner = Field(json_schema_extra={"task": "urgency"})

    engine_dir, _ = tasked
    with Engine.load(engine_dir, backend="onnxruntime") as engine:
        decision = engine.decide(STATE, Ticket)
        want = engine.ask(STATE, {"fraud": Noul("Is this fraud?", task="fraud"), "plain": Noul("Is this fraud?"),
                                  "team": Choice("Which team?", {"billing": None, "shipping": None}, task="urgency")})
        assert decision.answers["fraud"].noul == pytest.approx(want["fraud"].noul, abs=1e-9)
        assert decision.answers["plain"].noul == pytest.approx(want["plain"].noul, abs=1e-9)
        assert decision.answers["routed.team"].probabilities == pytest.approx(want["team"].probabilities, abs=1e-9)
        assert abs(decision.answers["fraud"].noul - decision.answers["plain"].noul) > 1e-4

        class Bad(BaseModel):
            fraud: bool = Field(json_schema_extra={"task": 3})

        with pytest.raises(Invalid, match="^fraud: task must be the name") as err:
            engine.decide(STATE, Bad)
        assert err.value.field == "fraud"


def _disk(directory) -> int:
    """Bytes a directory holds on disk, a file hard-linked twice counted once."""
    seen = {}
    for p in directory.rglob("*"):
        if p.is_file():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_the_slot_graph_reads_the_engines_weights_file_not_a_copy(tasked, tiny_engine_dir):
    """The slot graph's decoder weights are the engine's own file, hard-linked beside it (ONNX Runtime and OpenVINO
    read weights only from the graph's directory): an engine with two tasks holds the base's bytes once, plus the
    slot graph's proto and the tasks' factors."""
    engine = tasked[0]
    manifest = mf.load(engine)
    slots = engine / "tasks" / "slots"
    weights = f"{manifest.graph}.data"
    assert os.path.samefile(slots / weights, engine / weights)
    own = slots / "graph.onnx.data"
    assert not own.exists() or own.stat().st_size < 0.01 * (engine / weights).stat().st_size
    ratio = _disk(engine) / _disk(tiny_engine_dir)
    assert ratio <= 1.3, ratio
    tasks = task_store.load(engine, manifest)
    named = dict(mf.graph_files(tasks))  # what the default backend's check and a guarantee are keyed on
    assert f"tasks/slots/{weights}" in named and tasks.graph in named
    assert named[f"tasks/slots/{weights}"] == manifest.files[weights]  # the engine's own bytes, verified as its own


def test_a_backend_without_task_slots_is_refused_by_name(tasked, monkeypatch):
    """A backend class that runs no task slots (TensorRT's, which this machine cannot import: here the base class
    under a name of its own) is refused by name before it is built."""
    from onepass.runtime import backends
    from onepass.runtime.backends.errors import BackendUnavailable

    monkeypatch.setitem(backends.TABLE, "no-slots", ("onepass.runtime.backends.base", "Backend", {}))
    with pytest.raises(BackendUnavailable, match="the no-slots backend does not run tuned tasks"):
        Engine.load(tasked[0], backend="no-slots")


def test_the_pytorch_backend_runs_tasks_on_its_reference_decoder_and_refuses_an_unmapped_slot_graph(tasked, tmp_path):
    """torch-cpu serves an engine with tasks through TaskDecoder, the module its slot graph was exported from (the
    fused pass has no task slots), its weights read through the map the slot card records; answers checked against
    transformers + peft in test_an_engine_with_tasks_answers_each_question_as_its_task_alone. A slot graph whose card
    has no map (written before it did) is refused with what to do; buckets or CUDA graphs asked for are refused."""
    from onepass.runtime.backends import factory
    from onepass.runtime.backends.torch_decoder import TaskDecoder

    with Engine.load(tasked[0], backend="torch-cpu") as engine:
        assert isinstance(engine.backend.decoder, TaskDecoder) and not engine.backend.fused
        assert engine.backend.tasks.count == len(TASKS)
    with pytest.raises(ValueError, match="runs on the reference decoder: no buckets or CUDA graphs"):
        Engine.load(tasked[0], backend=factory("torch-cpu", buckets=True))
    engine = tmp_path / "engine"
    shutil.copytree(tasked[0], engine)
    card = engine / "tasks" / "slots" / "slots.json"
    slots = json.loads(card.read_text())
    card.write_text(json.dumps({**slots, "weights": ["embed"]}))
    with pytest.raises(EngineFileError, match="slots.json: its weights must map weight names to initializer names"):
        Engine.load(engine, backend="onnxruntime")
    card.write_text(json.dumps({k: v for k, v in slots.items() if k != "weights"}))
    with pytest.raises(EngineFileError, match="exported before the task store mapped its weights.*tune a task again"):
        Engine.load(engine, backend="torch-cpu")
    with Engine.load(engine, backend="onnxruntime") as onnx_runtime:  # the ONNX backends need no map
        assert onnx_runtime.tasks.names == TASKS


def test_tasks_are_listed_removed_and_verified_and_the_engines_files_never_change(tasked, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(tasked[0], engine)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine.iterdir() if p.is_file()}
    assert task_store.names(engine) == list(TASKS)
    factors = engine / "tasks" / "fraud" / "factors.npz"
    good = factors.read_bytes()
    middle = len(good) // 2  # inside a stored array (the last bytes are the zip's comment length, which it tolerates)
    factors.write_bytes(good[:middle] + bytes([good[middle] ^ 1]) + good[middle + 1:])
    with pytest.raises(EngineFileError, match="does not match its recorded sha256"):
        Engine.load(engine, backend="onnxruntime")
    with pytest.raises(EngineFileError, match="cannot be read"):  # unverified, the damage is still named
        Engine.load(engine, backend="onnxruntime", verify=False)
    factors.write_bytes(good)
    card = engine / "tasks" / "fraud" / "task.json"
    text = card.read_text()
    card.write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "rank"}))
    with pytest.raises(EngineFileError, match="task.json cannot be read \\(it lacks rank\\)"):
        Engine.load(engine, backend="onnxruntime")
    card.write_text(text)
    with pytest.raises(ValueError, match="has no task 'spam'; its tasks: fraud, urgency"):
        task_store.remove(engine, "spam")
    for bad in ("Fraud", "slots", "a/b", "", "x" * 65):
        with pytest.raises(ValueError, match="is not allowed"):
            task_store.check_name(bad)
    task_store.remove(engine, "fraud")
    with Engine.load(engine, backend="onnxruntime") as one:
        assert one.tasks.names == ("urgency",)
    task_store.remove(engine, "urgency")
    assert not (engine / "tasks").exists()
    with Engine.load(engine, backend="onnxruntime") as none:
        assert none.tasks is None and none.backend.tasks is None
    assert before == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine.iterdir() if p.is_file()}


def test_a_task_tuned_on_other_weights_is_refused(tasked, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(tasked[0], engine)
    card = engine / "tasks" / "urgency" / "task.json"
    data = json.loads(card.read_text())
    card.write_text(json.dumps({**data, "engine_weights": "0" * 64}))
    with pytest.raises(EngineFileError, match="task 'urgency' was tuned on other weights"):
        Engine.load(engine, backend="onnxruntime")


def test_onepass_serve_answers_tasks_over_http_lists_them_and_counts_answers_per_task(tasked, tmp_path):
    """A real server over loopback: a request naming a task is answered as the engine answers it in process; an
    unknown task is a 422 naming the engine's tasks; /v1/models lists them; /metrics counts answers per task."""
    import socket
    import urllib.error
    import urllib.request

    from conftest import serve_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, proc = serve_process(tasked[0], port, tmp_path / "serve.log", "--backend", "onnxruntime")

    def post(body):
        req = urllib.request.Request(url + "/v1/systemone", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    try:
        body = {"state": STATE, "questions": {"f": {"type": "noul", "instructions": "Is this fraud?", "task": "fraud"},
                                              "b": {"type": "noul", "instructions": "Is this fraud?"}}}
        status, out = post(body)
        with Engine.load(tasked[0], backend="onnxruntime") as engine:
            want = engine.request(body)["answers"]
        assert status == 200 and out["answers"]["f"]["noul"] == pytest.approx(want["f"]["noul"], abs=1e-6)
        assert out["answers"]["b"]["noul"] == pytest.approx(want["b"]["noul"], abs=1e-6)
        body["questions"]["f"]["task"] = "spam"
        status, out = post(body)
        assert status == 422 and "its tasks are fraud, urgency" in json.dumps(out), out
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            assert json.loads(r.read())["models"][0]["tasks"] == list(TASKS)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'onepass_task_answers_total{task="fraud"} 1.0' in text and \
            'onepass_task_answers_total{task="-"} 1.0' in text, [ln for ln in text.splitlines() if "task" in ln]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_onepass_tune_task_stores_a_task_that_serves_what_was_chosen(tiny_engine_dir, tmp_path, capsys):
    """`onepass tune --task` on the tiny Llama (104 rows: one held-out split): the task is stored beside a copy of the
    engine, whose own files do not change; served by the engine (ONNX Runtime, the task's calibration), its held-out
    NLL is the chosen candidate's as tune judged it in PyTorch (1e-3); `onepass tasks list|remove`."""
    from onepass.calibration.data.rows import group_by_state, load_rows, split_states
    from onepass.cli import main
    from test_tune import _fact_rows

    engine = tmp_path / "engine"
    mf.copy_engine(tiny_engine_dir, engine)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine.iterdir() if p.is_file()}
    data = _fact_rows(tmp_path, notes=52, numbered=True)
    assert main(["tune", "--engine", str(engine), "--data", str(data), "--task", "facts", "--rank", "2", "--no-head",
                 "--train-blocks", "1", "--epochs", "3", "--batch-questions", "4", "--lr", "1e-2", "--holdout",
                 "0.25", "--patience", "3"]) == 0
    card = task_store.read_card(engine, "facts")
    choice = card["metrics"]["choice"]
    assert choice["chosen"].startswith("tuned") and card["rank"] == 2 and card["blocks"] == [1], choice
    assert card["data"][0]["sha256"] and card["questions"] and not list(engine.glob("tasks/.*"))
    rows, _ = load_rows([data])
    _, held = split_states(group_by_state(rows), 0.25, 0)
    with Engine.load(engine, backend="onnxruntime") as served:
        nll = []
        for row in (r for g in held for r in g):
            q = row.question
            a = served.ask(row.state, {"q": type(q)(q.instructions, q.criteria, "facts")})["q"]
            nll.append(-np.log(a.noul if row.label == 0 else 1 - a.noul))  # label 0: "yes", the first option
    chosen = {c["name"]: c["heldout_nll"] for c in choice["candidates"]}[choice["chosen"]]
    assert np.mean(nll) == pytest.approx(chosen, abs=1e-3)
    assert {c["name"]: c["heldout_nll"] for c in choice["candidates"]}["base"] > chosen + 0.05
    capsys.readouterr()
    assert main(["tasks", "list", str(engine)]) == 0
    assert capsys.readouterr().out.startswith("facts\t" + choice["chosen"])
    assert main(["tasks", "remove", str(engine), "facts"]) == 0 and task_store.names(engine) == []
    assert before == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine.iterdir() if p.is_file()}
    assert main(["tune", "--engine", str(engine), "--data", str(data), "--task", "Bad Name"]) != 0


def test_each_tasks_calibration_applies_to_its_questions_only_and_limits_and_merges_keep_tasks(tasked, tmp_path):
    """A calibration in urgency's card moves its questions' scores by its bias, not fraud's nor the engine's own
    (negative control: the raw scores); an engine with lowered limits keeps its tasks; two requests merged into one
    pass (run_many) each get their own task's answers."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(tasked[0], engine_dir)
    card = engine_dir / "tasks" / "urgency" / "task.json"
    readout = mf.load(engine_dir).scoring.readout
    data = json.loads(card.read_text())
    card.write_text(json.dumps({**data, "calibration": {"groups": {"noul": {"temperature": 1.0, "bias": [3.0, 0.0]}},
                                                          "readout": readout}}))
    asked = {f"q.{t}": Noul("Is this fraud?", task=t) for t in ("urgency", "fraud", None)}
    with Engine.load(engine_dir, backend="onnxruntime") as engine:
        encoded = engine.encode_questions(asked)
        lp = engine.option_logprobs(STATE, encoded)
        raw = engine.option_scores(asked, encoded, lp, calibrated=False)
        cal = engine.option_scores(asked, encoded, lp)
        np.testing.assert_allclose(cal[0] - raw[0], [3.0, 0.0], atol=1e-12)
        for c, r in zip(cal[1:], raw[1:]):
            np.testing.assert_array_equal(c, r)
        lower = engine.with_limits(max_questions=5)
        noul = lambda answers: {k: a.noul for k, a in answers.items()}  # noqa: E731
        assert lower.tasks is engine.tasks
        assert noul(lower.ask(STATE, asked)) == pytest.approx(noul(engine.ask(STATE, asked)), abs=1e-6)
        one, two = ({k: v for k, v in asked.items() if v.task == t} for t in ("urgency", "fraud"))
        merged = engine.run_many([(STATE, one), (STATE, two)])
        for result, alone in zip(merged, (one, two)):  # each as if asked alone (float reordering only)
            assert noul(result.answers) == pytest.approx(noul(engine.ask(STATE, alone)), abs=1e-5)
        assert abs(merged[0].answers["q.urgency"].noul - merged[1].answers["q.fraud"].noul) > 1e-3


def test_a_tasked_question_longer_than_one_pass_is_refused_and_the_same_untasked_is_answered(tasked):
    """A question past the backend's block has its trunk prefilled onto the state, by the engine's weights: a task's
    cannot be (its trunk is the task's), so it is refused, saying so; the same question untasked is answered (control)."""
    from onepass.runtime.core.errors import LimitExceeded

    big = Choice("Which code?", {f"code {i:03d}": None for i in range(120)}, task="fraud")
    with Engine.load(tasked[0], backend="onnxruntime") as engine:
        with pytest.raises(LimitExceeded, match="tuned task 'fraud' packs into .* must fit one pass of 256"):
            engine.ask(STATE, {"q": big})
        assert engine.ask(STATE, {"q": Choice(big.instructions, big.criteria)})["q"].choice in big.criteria


def test_the_mcp_tools_name_a_task_and_an_unknown_one_is_an_error_naming_the_tasks(tasked):
    """`onepass mcp` over stdio: a tool call naming a task answers as the engine does in process; an unknown task is the
    tool's error listing the engine's tasks (not a crash of the session)."""
    import asyncio
    import sys

    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=["-m", "onepass", "mcp", "--engine", str(tasked[0]),
                                                                 "--backend", "onnxruntime"])

    async def session():
        async with Client(params) as client:
            asked = {"state": STATE, "instructions": "Is this fraud?"}
            good = await client.call_tool("noul", {**asked, "task": "fraud"})
            bad = await client.call_tool("noul", {**asked, "task": "spam"})
            return good.structured_content, bad.structured_content

    good, bad = asyncio.run(asyncio.wait_for(session(), timeout=240))
    with Engine.load(tasked[0], backend="onnxruntime") as engine:
        want = engine.ask(STATE, {"q": Noul("Is this fraud?", task="fraud")})["q"].noul
    assert good["noul"] == pytest.approx(want, abs=1e-6)
    assert "its tasks are fraud, urgency" in bad["error"]


def test_a_tuned_candidate_whose_adapter_changes_nothing_is_never_written_as_tuned():
    """Training that kept its untrained weights (every LoRA B factor 0: --max-steps 12 did) answers exactly as the
    engine: it is named base (or base + calibrate, its calibration kept) and stored with no adapter. Control: one
    non-zero factor is a tuned adapter, named and kept as such."""
    from onepass.calibration.tune.candidates import Candidate
    from onepass.calibration.tune.task import named_as_it_answers, no_op
    from onepass.runtime.core.tasks import TaskAdapter

    zero = TaskAdapter("t", 2, {(1, "q"): (np.ones((2, 8), np.float32), np.zeros((8, 2), np.float32))})
    moved = TaskAdapter("t", 2, {(1, "q"): (np.ones((2, 8), np.float32), np.eye(8, 2, dtype=np.float32) * 1e-6)})
    assert no_op(zero) and not no_op(moved)
    said = []
    for name, want in (("tuned", "base"), ("tuned+calibrate", "base+calibrate")):
        chosen = Candidate(name, None, 0.5, 0.7)
        got, adapter = named_as_it_answers(chosen, zero, said.append)
        assert got.name == want and adapter.rank == 0 and not adapter.factors and got.nll == chosen.nll
    assert len(said) == 2 and "every LoRA B factor is still 0" in said[0]
    kept, adapter = named_as_it_answers(Candidate("tuned", None, 0.5, 0.7), moved, said.append)
    assert kept.name == "tuned" and adapter is moved and len(said) == 2
