"""Tasks that are decision heads read at a depth, served in one pass with LoRA tasks and untasked questions.

A head task's option score is ``beta * mean log-likelihood + head(h)``, both read after the task's own number of
blocks: the log-likelihoods through the final norm and the vocabulary from that block's residual stream, the head
over the final-normed state of the option's last read-out row. The reference is transformers asking each question
alone (``output_hidden_states`` over the base's cache, one option at a time) with the head as the PyTorch module it
was trained as (standardisation unfolded): independent of the slot graph's exits and of the folded weights it is fed.
"""

import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from onepass.runtime.backends.torch_decoder import DecisionHead  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core import task_store  # noqa: E402
from onepass.runtime.core.engine import Engine  # noqa: E402
from onepass.runtime.core.errors import EngineFileError  # noqa: E402
from onepass.runtime.core.questions import Choice, Noul  # noqa: E402
from onepass.runtime.core.tasks import TaskAdapter  # noqa: E402
from test_task_store import STATE, _alone, tasked  # noqa: E402,F401 - tasked: the fixture

TOL = 1e-4  # float32, summed over an option's tokens (as test_tasks); a score adds a head of a few units
HEADS = {"shallow": (1, 0.7), "deep": (2, 1.3)}  # name -> (depth of the tiny Llama's 2 blocks, beta)


def _head(seed: int, hidden: int) -> DecisionHead:
    torch.manual_seed(seed)
    head = DecisionHead(hidden, 8, shift=torch.randn(hidden) * 0.1, scale=torch.rand(hidden) + 0.5)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    return head.eval()


@pytest.fixture(scope="module")
def head_tasked(tasked, tiny_llama_dir, tmp_path_factory):
    """(the tasked engine copied with the head tasks ``HEADS`` added and its slot graph cut at 1 block, the peft
    model, the heads by name)."""
    import transformers

    from onepass.calibration.tune.task import ensure_slots

    engine = tmp_path_factory.mktemp("head-tasked") / "engine"
    shutil.copytree(tasked[0], engine)
    manifest = mf.load(engine)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")  # noqa: E731
    card = engine / "tasks" / "slots" / "slots.json"
    before = json.loads(card.read_text())["files"]
    ensure_slots(engine, manifest, load, set(), log=lambda *a: None, depths=(1,))
    after = json.loads(card.read_text())["files"]
    assert task_store.slot_card(engine)["depths"] == [1] and "graph.d1.onnx" in after
    assert {k: v for k, v in after.items() if k in before} == before  # the cut added alone, the rest kept as it was
    heads = {}
    for seed, (name, (depth, beta)) in enumerate(HEADS.items()):
        heads[name] = _head(seed, manifest.model.hidden_size)
        state = {k: v.numpy() for k, v in heads[name].state_dict().items()}
        task_store.write_task(engine, manifest, TaskAdapter(name, 0, {}), {"questions": [], "calibration": None},
                              head=(state, depth, beta))
    return engine, tasked[1], heads


def _alone_at(peft, state_ids, tokens, depth: int, head: DecisionHead, beta: float) -> tuple:
    """(summed log-likelihoods [K], scores [K]) of a question asked alone, read after ``depth`` blocks."""
    with torch.no_grad(), peft.disable_adapter():
        base = peft.get_base_model()
        past = base(torch.tensor([list(state_ids)]), use_cache=True).past_key_values
        layers = base.config.num_hidden_layers
        values, scores = [], []
        for option in tokens.options:
            seq = list(tokens.trunk) + list(option)
            out = base.model(torch.tensor([seq]), past_key_values=copy.deepcopy(past), use_cache=True,
                             output_hidden_states=True)
            h = out.last_hidden_state[0] if depth == layers else base.model.norm(out.hidden_states[depth][0])
            lp = torch.log_softmax((h @ base.lm_head.weight.T)[len(tokens.trunk) - 1:-1].double(), -1)
            values.append(sum(float(lp[k, t]) for k, t in enumerate(option)))
            scores.append(beta * values[-1] / len(option) + float(head(h[len(seq) - 2][None])[0]))
    return np.array(values), np.array(scores)


def _asked():
    """One question of each head task, of a LoRA task and of none, in one request."""
    q = Choice("Which team?", {"billing": None, "shipping": None, "fraud desk": None})
    return {f"q.{t or 'base'}": type(q)(q.instructions, q.criteria, t) for t in (*HEADS, "fraud", None)}


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino-cpu", "torch-cpu"])
def test_head_tasks_at_several_depths_share_one_pass_and_each_equals_its_question_asked_alone(head_tasked, backend):
    """Head tasks read after 1 and 2 blocks, a LoRA task and an untasked question in one request, one pass: each
    head task's log-likelihoods and scores equal transformers reading the question alone at the task's depth (1e-4),
    the LoRA task's equal peft's, the untasked one's the base's. Negative control: the head tasks' depths swapped in
    what the backend is fed moves their scores far past the tolerance."""
    if backend == "openvino-cpu":
        pytest.importorskip("openvino")
    engine_dir, peft, heads = head_tasked
    asked = _asked()
    with Engine.load(engine_dir, backend=backend) as engine:
        assert engine.tasks.names == ("deep", "fraud", "shallow", "urgency")
        encoded = engine.encode_questions(asked)
        state_ids = engine.planner.state_ids(STATE)
        values, head_scores = engine.option_values(STATE, encoded)
        scores = engine.option_scores(asked, encoded, values, calibrated=False, heads=head_scores)
        for (qid, q), tokens, v, s in zip(asked.items(), encoded, values, scores):
            if q.task in HEADS:
                want_v, want_s = _alone_at(peft, state_ids, tokens, *HEADS[q.task][:1], heads[q.task], HEADS[q.task][1])
                np.testing.assert_allclose(v, want_v, rtol=0, atol=TOL, err_msg=qid)
                np.testing.assert_allclose(s, want_s, rtol=0, atol=TOL, err_msg=qid)
            else:
                np.testing.assert_allclose(v, _alone(peft, state_ids, tokens, q.task), rtol=0, atol=TOL, err_msg=qid)
        shallow_at_full = _alone_at(peft, state_ids, encoded[0], 2, heads["shallow"], 0.7)[0]
        assert np.abs(shallow_at_full - values[0]).max() > 100 * TOL  # the depth matters on this model
        feeds = engine.backend.tasks
        engine.backend.tasks = dataclasses.replace(feeds, exits=np.where(feeds.exits == 1, 2, np.where(
            feeds.exits == 2, 1, feeds.exits)))  # read each head at the other's depth
        wrong_v, wrong_h = engine.option_values(STATE, encoded)
        wrong = engine.option_scores(asked, encoded, wrong_v, calibrated=False, heads=wrong_h)
        assert min(np.abs(wrong[i] - scores[i]).max() for i in (0, 1)) > 100 * TOL
        engine.backend.tasks = feeds
        answers = engine.ask(STATE, asked)  # the typed answers come from the same scores
        calibrated = engine.option_scores(asked, encoded, values, heads=head_scores)
        for i, qid in enumerate(asked):
            want = np.exp(calibrated[i] - calibrated[i].max())
            assert answers[qid].probabilities["billing"] == pytest.approx(want[0] / want.sum(), abs=1e-6)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino-cpu", "torch-cpu"])
def test_a_pass_of_shallow_head_tasks_runs_the_graph_cut_there_and_its_state_is_deepened_when_asked(
        head_tasked, tiny_engine_dir, backend):
    """Only questions of the head task read after 1 block: the pass and the state's prefill run the slot graph cut at
    1 block (ONNX Runtime, OpenVINO; the PyTorch backend runs every block), the state is cached with 1 block's K/V,
    and the answers equal transformers reading the question alone there (1e-4). An untasked question about the same
    state then prefills it again with every block (the engine's own answer, 1e-5); the shallow questions asked again
    read the deeper state's first block: the same answers (1e-5). Control: read at the full depth, they differ."""
    if backend == "openvino-cpu":
        pytest.importorskip("openvino")
    engine_dir, peft, heads = head_tasked
    shallow = {"a": Choice("Which team?", {"billing": None, "shipping": None}, "shallow"),
               "b": Noul("Is this fraud?", task="shallow")}
    untasked = {"q": Noul("Is this fraud?")}
    with Engine.load(engine_dir, backend=backend) as engine, Engine.load(tiny_engine_dir, backend=backend) as plain:
        cut = backend != "torch-cpu"
        assert list(engine.depths.backends) == ([1] if cut else [])
        runs = []  # the K/V blocks each pass on a cut graph was given
        for b in engine.depths.backends.values():
            real = b.score_all
            b.score_all = lambda kv, batch, real=real: runs.append(len(kv.layers)) or real(kv, batch)
        state_ids = tuple(engine.planner.state_ids(STATE))
        first = engine.ask(STATE, shallow)
        assert runs == ([1] if cut else []) and len(engine.cache.get(state_ids).kv.layers) == (1 if cut else 2)
        for (qid, q), tokens in zip(shallow.items(), engine.encode_questions(shallow)):
            want = _alone_at(peft, state_ids, tokens, 1, heads["shallow"], 0.7)[1]
            np.testing.assert_allclose(_probs(first[qid]), np.exp(want) / np.exp(want).sum(), rtol=0, atol=TOL,
                                       err_msg=qid)
            at_full = _alone_at(peft, state_ids, tokens, 2, heads["shallow"], 0.7)[1]
            assert np.abs(at_full - want).max() > 100 * TOL  # the control: the head read at another depth
        base = engine.ask(STATE, untasked)["q"].noul
        assert len(engine.cache.get(state_ids).kv.layers) == 2  # deepened: prefilled again with every block
        assert base == pytest.approx(plain.ask(STATE, untasked)["q"].noul, abs=1e-5)
        again = engine.ask(STATE, shallow)
        assert runs == ([1, 1] if cut else [])  # the cut graph again, over the deeper state's first block
        for qid in shallow:
            np.testing.assert_allclose(_probs(again[qid]), _probs(first[qid]), rtol=0, atol=1e-5)


def test_the_default_backend_serves_an_engine_with_task_heads_as_it_serves_the_engine(head_tasked, tiny_engine_dir):
    """The default backend's golden check runs on the slot graph, whose task heads' scores (no task fed: 0) are no
    decision head of the engine's: the tasked engine gets the backend the engine itself gets (OpenVINO where it is
    installed), and its cut graph on it."""
    with Engine.load(tiny_engine_dir) as plain, Engine.load(head_tasked[0]) as tasked:
        assert tasked.backend.name == plain.backend.name
        assert list(tasked.depths.backends) == ([1] if plain.backend.name in ("onnxruntime", "openvino-cpu") else [])


def _probs(answer) -> np.ndarray:
    """An answer's probabilities in its options' order (a yes/no: yes, no)."""
    if not hasattr(answer, "probabilities"):
        return np.array([answer.noul, 1 - answer.noul])
    return np.array(list(answer.probabilities.values()))


def test_a_head_tasks_calibration_is_fitted_on_the_head_read_out_and_applies_to_its_questions(head_tasked, tmp_path):
    """A head task's card calibration (fitted on the ``head`` read-out) moves its question's scores by its bias, and
    a calibration on another read-out is not applied (control)."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(head_tasked[0], engine_dir)
    card = engine_dir / "tasks" / "shallow" / "task.json"
    data = json.loads(card.read_text())
    asked = {"q": Noul("Is this fraud?", task="shallow")}
    for readout, moved in (("head", [2.0, 0.0]), ("mean", [0.0, 0.0])):
        card.write_text(json.dumps({**data, "calibration": {"groups": {"noul": {"temperature": 1.0,
                                                                              "bias": [2.0, 0.0]}},
                                                            "readout": readout}}))
        with Engine.load(engine_dir, backend="onnxruntime") as engine:
            encoded = engine.encode_questions(asked)
            values, heads = engine.option_values(STATE, encoded)
            raw = engine.option_scores(asked, encoded, values, calibrated=False, heads=heads)
            cal = engine.option_scores(asked, encoded, values, heads=heads)
            np.testing.assert_allclose(cal[0] - raw[0], moved, atol=1e-12)


def test_head_tasks_are_refused_where_they_cannot_run(head_tasked, tmp_path):
    """A head deeper than the engine, a damaged head file, a slot graph exported before task heads, and a head of no
    hidden layer are refused with what to do; nothing is written for the refused head."""
    engine_dir = tmp_path / "engine"
    shutil.copytree(head_tasked[0], engine_dir)
    card_path = engine_dir / "tasks" / "deep" / "task.json"
    card = json.loads(card_path.read_text())
    card_path.write_text(json.dumps({**card, "head": {**card["head"], "depth": 3}}))
    with pytest.raises(EngineFileError, match="after 3 blocks; the engine has 2"):
        Engine.load(engine_dir, backend="onnxruntime")
    card_path.write_text(json.dumps(card))
    (engine_dir / "tasks" / "deep" / "head.npz").write_bytes(b"not a head")
    with pytest.raises(EngineFileError, match="head.npz is missing or does not match its recorded sha256"):
        Engine.load(engine_dir, backend="onnxruntime")
    with pytest.raises(EngineFileError, match="head.npz cannot be read .* tune task 'deep' again"):
        Engine.load(engine_dir, backend="onnxruntime", verify=False)  # parsed unverified: still a typed error
    shutil.copy(head_tasked[0] / "tasks" / "deep" / "head.npz", engine_dir / "tasks" / "deep" / "head.npz")
    slots = engine_dir / "tasks" / "slots" / "slots.json"
    slots.write_text(json.dumps({**json.loads(slots.read_text()), "heads": False}))
    with pytest.raises(EngineFileError, match="takes none of .* tune a task again"):
        Engine.load(engine_dir, backend="onnxruntime")
    manifest = mf.load(engine_dir)
    linear = {k: v.numpy() for k, v in DecisionHead(manifest.model.hidden_size, 0).state_dict().items()}
    with pytest.raises(ValueError, match="needs a hidden layer"):
        task_store.write_task(engine_dir, manifest, TaskAdapter("linear", 0, {}), {}, head=(linear, 1, 1.0))
    assert not (engine_dir / "tasks" / "linear").exists() and "linear" not in task_store.names(engine_dir)


def test_tune_task_chooses_a_head_at_a_depth_as_a_whole_engine_tune_does_and_serves_it_as_that_engine(
        tiny_engine_dir, tmp_path):
    """`onepass tune --task` on 24 rows (no LoRA run under --lora-min-rows: base, base + calibrate and the heads
    read after 1 and 2 blocks, cross-validated over whole states) chooses what `onepass tune --out` chooses on the
    same rows, and the stored head task answers every row as that tuned engine (cut at its head's depth when it is
    one) does, to 1e-4: an independent export of the same head. Negative control: the untasked question differs."""
    from onepass.cli import main
    from onepass.calibration.data.rows import load_rows
    from test_tune import _fact_rows

    engine = tmp_path / "engine"
    mf.copy_engine(tiny_engine_dir, engine)
    data = _fact_rows(tmp_path, notes=12, numbered=True)
    flags = ["--data", str(data), "--head-depths", "1", "--seed", "0"]
    assert main(["tune", "--engine", str(engine), "--task", "facts", *flags]) == 0
    assert main(["tune", "--engine", str(tiny_engine_dir), "--out", str(tmp_path / "whole"), *flags]) == 0
    card = task_store.read_card(engine, "facts")
    whole = mf.load(tmp_path / "whole")
    chosen = card["metrics"]["choice"]["chosen"]
    assert chosen == whole.head.training["choice"]["chosen"]
    assert chosen.startswith("head"), card["metrics"]["choice"]  # else this test would compare no head
    assert card["head"]["depth"] == (whole.head.depth or 2) and card["rank"] == 0
    rows, _ = load_rows([data])
    with Engine.load(engine, backend="onnxruntime") as tasked, Engine.load(tmp_path / "whole",
                                                                          backend="onnxruntime") as tuned:
        def scores(engine, row, task):
            asked = {"q": type(row.question)(row.question.instructions, row.question.criteria, task)}
            encoded = engine.encode_questions(asked)
            values, heads = engine.option_values(row.state, encoded)
            return engine.option_scores(asked, encoded, values, heads=heads)[0]  # calibrated: what is soft-maxed

        for row in rows[:12]:
            np.testing.assert_allclose(scores(tasked, row, "facts"), scores(tuned, row, None), rtol=0, atol=1e-4)
            asked = type(row.question)(row.question.instructions, row.question.criteria, "facts")
            assert tasked.ask(row.state, {"q": asked})["q"].noul == pytest.approx(
                tuned.ask(row.state, {"q": row.question})["q"].noul, abs=1e-6)
        assert max(np.abs(scores(tasked, r, None) - scores(tuned, r, None)).max() for r in rows[:12]) > 1e-2


def test_a_slot_graph_exported_before_task_heads_still_serves_its_lora_tasks(tasked, tiny_llama_dir, tmp_path):
    """A slot graph as exported before task heads (no head inputs or output; its card without ``heads`` and
    ``depths``) still serves its LoRA tasks and untasked questions as the current slot graph does (1e-5), with no cut
    graph opened. Control: the old graph takes none of the head inputs."""
    import onnx
    import transformers

    from onepass.export.onnx_graph import export_task_decoder
    from onepass.export.shared_weights import share
    from onepass.runtime.backends.torch_decoder import PackedDecoder, TaskDecoder
    from onepass.runtime.core.tasks import projection_shapes
    from test_task_store import _asked

    engine = tmp_path / "engine"
    shutil.copytree(tasked[0], engine)
    manifest = mf.load(engine)
    blocks = task_store.slot_card(engine)["blocks"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    graph = TaskDecoder(PackedDecoder(model), blocks)  # heads=False: the graph as it was
    d = graph.dims
    shapes = projection_shapes(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size)

    def export(path):
        export_task_decoder(graph, shapes, path)
        share(path, engine / manifest.graph)

    with torch.no_grad():
        task_store.write_slots(engine, manifest, blocks, export)
    card_path = engine / "tasks" / "slots" / "slots.json"
    card = json.loads(card_path.read_text())
    card_path.write_text(json.dumps({k: v for k, v in card.items() if k not in ("heads", "depths")}))
    proto = onnx.load(str(engine / "tasks" / "slots" / "graph.onnx"), load_external_data=False)
    inputs = {i.name for i in proto.graph.input}
    assert "readout_exit" not in inputs and "task_mask" in inputs
    asked = _asked()
    with Engine.load(engine, backend="onnxruntime") as old, Engine.load(tasked[0], backend="onnxruntime") as new:
        assert old.backend.tasks.heads is None and not old.depths
        for o, n in zip(old.option_logprobs(STATE, old.encode_questions(asked)),
                        new.option_logprobs(STATE, new.encode_questions(asked))):
            np.testing.assert_allclose(o, n, rtol=0, atol=1e-5)
