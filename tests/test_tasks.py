"""Questions of separately tuned tasks in one pass over one shared state (issue 45).

Each answer must equal asking the question alone of its own task: the state prefilled by the base weights, the
question and its options through that task's adapter. The reference is transformers + peft (two named adapters on
a tiny random model), one option at a time over the base's cache: independent of the packed graph's code.
"""

import copy
from contextlib import nullcontext

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from onepass.runtime.backends.batch import causal  # noqa: E402
from onepass.runtime.backends.torch_decoder import PackedDecoder, TaskDecoder  # noqa: E402
from onepass.runtime.core.tasks import TaskAdapter, projection_shapes, stack  # noqa: E402
from onepass.runtime.core.tree import QuestionTokens, TooManyTokens, option_logprobs, pack  # noqa: E402
from test_decoder import QUESTIONS, STATE, TOL, tiny_model  # noqa: E402

TASKS = ("fraud", "urgency")
# the first question asked of both tasks and of none: one trunk, three computations that must not share tokens
ASKED = [(QUESTIONS[0], 0), (QUESTIONS[0], 1), (QUESTIONS[0], -1), (QUESTIONS[1], 1), (QUESTIONS[2], -1),
         (QuestionTokens(trunk=(17, 18), options=((60,), (61, 62))), 0)]


def _tasks_model(arch: str):
    """(peft model with the adapters ``TASKS``, the packed decoder of its base weights, the tasks as fed)."""
    from peft import get_peft_model, get_peft_model_state_dict

    from onepass.export.adapter import lora_config

    model = tiny_model(arch)
    decoder = PackedDecoder(model).eval()  # the base weights, copied before peft wraps the projections
    peft = get_peft_model(model, lora_config(4, None, [1]), adapter_name=TASKS[0])  # the top block only
    peft.add_adapter(TASKS[1], lora_config(2, 3.0, [0, 1]))  # another rank, scale and blocks
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft.eval()
    tasks = [TaskAdapter.from_peft(name, {k: v.numpy() for k, v in get_peft_model_state_dict(peft, adapter_name=name).items()},
                                   peft.peft_config[name].lora_alpha / peft.peft_config[name].r) for name in TASKS]
    return peft, decoder, tasks


def _alone(peft, question: QuestionTokens, task: int) -> np.ndarray:
    """[K] option log-likelihoods of ``question`` asked alone of ``task`` (-1: the base) over the base's cache."""
    with torch.no_grad():
        with peft.disable_adapter():
            past = peft(torch.tensor([STATE]), use_cache=True).past_key_values
        if task >= 0:
            peft.set_adapter(TASKS[task])
        out = []
        for option in question.options:
            seq = list(question.trunk) + list(option)
            with peft.disable_adapter() if task < 0 else nullcontext():
                logits = peft(torch.tensor([seq]), past_key_values=copy.deepcopy(past), use_cache=True).logits[0]
            lp = torch.log_softmax(logits[len(question.trunk) - 1:-1].double(), -1)
            out.append(sum(float(lp[k, t]) for k, t in enumerate(option)))
    return np.array(out)


def _packed(decoder, tasks, asked, swap: bool = False) -> list[np.ndarray]:
    """Every question of ``asked`` in one pass of the task-slot graph over the base decoder's prefill."""
    d = decoder.dims
    t = torch.from_numpy
    empty = [torch.zeros(d.num_kv_heads, 0, d.head_dim) for _ in range(2 * d.num_layers)]
    state = causal(STATE, 0)
    numbers = [task for _, task in asked]
    batch = pack([q for q, _ in asked], len(STATE), tasks=numbers)
    stacked = stack(tasks, range(d.num_layers), projection_shapes(d.hidden_size, d.num_heads, d.num_kv_heads,
                                                                   d.head_dim, d.intermediate_size))
    token_task = batch.token_task if not swap else np.where(batch.token_task >= 0, 1 - batch.token_task, -1)
    graph = TaskDecoder(decoder, range(d.num_layers))
    with torch.no_grad():
        past = list(decoder(t(state.input_ids), t(state.position_ids), t(state.tree_mask), *empty,
                            t(state.readout_index), t(state.readout_target))[1:])
        target = graph(t(batch.input_ids), t(batch.position_ids), t(batch.tree_mask), *past,
                       t(batch.readout_index), t(batch.readout_target), torch.tensor(len(STATE)),
                       t(stacked.mask(token_task)), *map(t, stacked.inputs))[0]
    return option_logprobs(batch, target.numpy())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_questions_of_several_tasks_in_one_pass_equal_each_asked_alone_of_its_task(arch):
    """Two tasks (different ranks, scales and blocks) and untuned questions, one trunk asked of all three, in one
    pass: each answer equals transformers + peft asking it alone (float32, 1e-4 summed over an option's tokens).
    Negative control: the two tasks' masks swapped moves the answers far past the tolerance."""
    peft, decoder, tasks = _tasks_model(arch)
    want = [_alone(peft, q, task) for q, task in ASKED]
    got = _packed(decoder, tasks, ASKED)
    for (q, task), g, w in zip(ASKED, got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOL, err_msg=f"{arch}, task {task}")
    assert max(np.abs(want[0] - want[2]).max(), np.abs(want[1] - want[2]).max()) > 100 * TOL  # the tasks matter
    swapped = _packed(decoder, tasks, ASKED, swap=True)
    assert max(np.abs(s - w).max() for s, w in zip(swapped, want)) > 100 * TOL


def test_one_trunk_under_two_tasks_is_packed_twice_and_untasked_packing_is_unchanged():
    asked = [(QUESTIONS[0], 0), (QUESTIONS[0], 1)]
    alone = pack([QUESTIONS[0]], 10)
    both = pack([q for q, _ in asked], 10, tasks=[t for _, t in asked])
    assert both.num_tokens == 2 * alone.num_tokens
    assert sorted(both.token_task.tolist()) == [0] * alone.num_tokens + [1] * alone.num_tokens
    plain, untasked = pack(QUESTIONS, 10), pack(QUESTIONS, 10, tasks=[-1] * len(QUESTIONS))
    assert np.array_equal(plain.input_ids, untasked.input_ids) and np.array_equal(plain.tree_mask, untasked.tree_mask)
    assert plain.token_task is None and (untasked.token_task == -1).all()
    assert pack([q for q, _ in asked], 10, max_tokens=both.num_tokens, tasks=[0, 1]).num_tokens == both.num_tokens
    with pytest.raises(TooManyTokens):  # the tasks' virtual roots are not counted, each task's tokens are
        pack([q for q, _ in asked], 10, max_tokens=both.num_tokens - 1, tasks=[0, 1])
    for wrong in ([0], [0, 1, 1], [0, -2]):
        with pytest.raises(ValueError, match="task number >= -1"):
            pack([q for q, _ in asked], 10, tasks=wrong)


def test_a_task_on_blocks_without_slots_is_refused():
    _, decoder, tasks = _tasks_model("llama")
    d = decoder.dims
    shapes = projection_shapes(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size)
    assert stack(tasks[:1], [1], shapes).width == 4  # the first task adapts block 1 only
    with pytest.raises(ValueError, match="adapts blocks \\[0\\]; this engine has task slots on blocks \\[1\\]"):
        stack(tasks, [1], shapes)
    wide = {**shapes, "q": (shapes["q"][0] + 1, shapes["q"][1])}
    with pytest.raises(ValueError, match="block 1 q has factors"):
        stack(tasks[:1], [1], wide)
    with pytest.raises(ValueError, match="token tasks must be in -1..0"):
        stack(tasks[:1], [1], shapes).mask([0, 1])


def test_the_task_slot_graph_exports_and_onnx_runtime_answers_as_the_torch_graph(tmp_path):
    """The exported task-slot graph, run by ONNX Runtime with 6 slots (traced with 3) and with none: the torch
    graph's target log-probs (1e-4); with no slot, the base engine's pass (the untasked questions' answers)."""
    import onnxruntime as ort

    from onepass.export.onnx_graph import export_task_decoder
    from onepass.runtime.backends import contract

    _, decoder, tasks = _tasks_model("llama")
    d = decoder.dims
    shapes = projection_shapes(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size)
    graph = TaskDecoder(decoder, range(d.num_layers))
    export_task_decoder(graph, shapes, tmp_path / "tasks.onnx")
    session = ort.InferenceSession(str(tmp_path / "tasks.onnx"), providers=["CPUExecutionProvider"])
    t = torch.from_numpy
    empty = [torch.zeros(d.num_kv_heads, 0, d.head_dim) for _ in range(2 * d.num_layers)]
    state = causal(STATE, 0)
    with torch.no_grad():
        past = [p.numpy() for p in decoder(t(state.input_ids), t(state.position_ids), t(state.tree_mask), *empty,
                                           t(state.readout_index), t(state.readout_target))[1:]]
    names = [s.name for s in contract.input_specs(d.num_layers, d.num_kv_heads, d.head_dim)]
    names += [s.name for s in contract.task_input_specs(graph.task_blocks, shapes)]
    for fed in (tasks, []):
        numbers = [task if fed else -1 for _, task in ASKED]
        batch = pack([q for q, _ in ASKED], len(STATE), tasks=numbers)
        stacked = stack(fed, graph.task_blocks, shapes)
        inputs = [batch.input_ids, batch.position_ids, batch.tree_mask, *past, batch.readout_index,
                  batch.readout_target, np.array(len(STATE), dtype=np.int64), stacked.mask(batch.token_task),
                  *stacked.inputs]
        got = session.run([contract.TARGET_LOGPROB], dict(zip(names, inputs)))[0]
        with torch.no_grad():
            want = graph(*(t(np.asarray(x)) for x in inputs))[0].numpy()
            base = decoder(*(t(np.asarray(x)) for x in inputs[:len(past) + 6]))[0].numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        assert stacked.width == (6 if fed else 0)
        assert (np.abs(want - base).max() > 1e-2) if fed else np.allclose(got, base, atol=1e-4)
