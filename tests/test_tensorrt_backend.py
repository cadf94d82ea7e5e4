"""The TensorRT backend's own logic, on CPU, with the GPU and TensorRT replaced by ``trt_double``.

Real here: plan selection and refusal, every device address, size, pitch and shape the
backend binds, the state pool, chunked prefill by strided device copies, bucket padding and
the CUDA-graph cache. Replaced: device memory (numpy blocks that reject out-of-bounds access)
and the plan (ONNX Runtime runs the engine's graph on the tensors at the bound addresses).
The real CUDA/TensorRT path is the ``gpu`` test at the end.

The stand-in runs the tiny random Llama (SmolLM2's architecture and tokenizer, 2 blocks): what these tests prove
(addresses, pitches, pools, graph replay, answers equal to ONNX Runtime's on the same graph) does not depend on the
weights, and each of them then costs milliseconds of ONNX Runtime instead of SmolLM2 passes. The ``gpu`` test runs
the real SmolLM2 engine.
"""

import dataclasses
import hashlib
import shutil

import numpy as np
import pytest
from trt_double import HostDevice, fake_tensorrt, write_plan

from onepass import Choice, Engine, Noul, Score
from onepass.runtime.core import manifest as mf
from onepass.runtime.backends import factory as open_backend
from onepass.runtime.backends.tensorrt import TensorRTBackend, select_plan
from onepass.runtime.core.errors import BackendUnavailable, EngineFileError
from onepass.runtime.core.selfcheck import check_golden

QUESTIONS = {"refund": Noul("Does the customer ask for a refund?"),
             "team": Choice("Which team?", {"billing": None, "technical": None, "fraud review": None}),
             "anger": Score("How angry is the customer?", ["calm", "annoyed", "furious"])}
OTHER = {"money": Noul("Does the writer want their money back?"),  # other questions, the same bucket
         "desk": Choice("Which desk should handle it?", {"billing": None, "technical": None, "fraud review": None}),
         "tone": Score("How upset is the writer?", ["calm", "annoyed", "furious"])}
STATE = "I was charged twice for one order and support never answered. Refund the second payment now."
VERSION = "tensorrt_double 0.1"


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    """The reference the stand-in is compared with: ONNX Runtime on the same tiny engine."""
    with Engine.load(tiny_engine_dir, backend="onnxruntime") as reference:
        yield reference


@pytest.fixture(scope="module")
def plan_dir(tiny_engine_dir, tmp_path_factory):
    """A copy of the tiny engine with a plan recorded for sm90 by the test double's TensorRT."""
    root = mf.copy_engine(tiny_engine_dir, tmp_path_factory.mktemp("trt") / "engine")
    manifest = mf.load(root)
    data, profile = write_plan(manifest)
    (root / "decoder.sm90.plan").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    record = {"file": "decoder.sm90.plan", "sha256": sha, "bytes": len(data), "tensorrt": VERSION,
              "compute_capability": "sm90", "precision": manifest.precision, "profiles": profile}
    mf.write(root, dataclasses.replace(manifest, plans=[record], files={**manifest.files, record["file"]: sha}))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def load(root, device=None, capture_after=1, **options) -> Engine:
    """The plan dir on the stand-in; graphs captured at a key's first pass (the default waits for its second)."""
    device = device or HostDevice()
    return Engine.load(root, backend=open_backend("tensorrt", device=device, tensorrt=fake_tensorrt(root, device),
                                             capture_after=capture_after, **options))


def test_tensorrt_backend_reproduces_the_golden_file(plan_dir):
    diffs = check_golden(load(plan_dir))
    assert diffs["target_logprob"] <= 2e-4


def test_every_kv_tensor_sits_at_a_256_byte_aligned_address_when_a_row_is_smaller(plan_dir):
    """The tiny Llama's K or V of one token in one layer (2 heads x 16 x 4 bytes = 128) is half TensorRT's 256-byte
    address alignment: laid end to end, an odd-length chunk would put every other layer's tensor at an address
    TensorRT refuses (the stand-in refuses it too). Each tensor starts at the next aligned address instead."""
    trt = load(plan_dir)
    m = trt.manifest.model
    assert (m.num_kv_heads * m.head_dim * 4) % 256  # the case this test is about
    ids = trt.encoder.state(STATE)
    ids = ids if len(ids) % 2 else ids[:-1]
    for chunk in (len(ids), 7):  # one chunk, and chunks of 7 appended into one block
        kv = trt.backend.prefill(ids, chunk)
        assert kv.length == len(ids) and kv.length % 2 == 1
        assert all(t.ptr % 256 == 0 for pair in kv.layers for t in pair)
    presents = trt.backend._scratch_presents(3)
    assert all(t.ptr % 256 == 0 for t in presents)


def test_answers_equal_onnxruntime_and_graphs_replay_with_new_inputs(plan_dir, engine):
    device = HostDevice()
    trt = load(plan_dir, device)
    for questions in (QUESTIONS, OTHER, QUESTIONS):  # OTHER falls in the same bucket: the graph is replayed
        encoded = engine.encode_questions(questions)
        want = engine.option_logprobs(STATE, encoded)
        got = trt.option_logprobs(STATE, encoded)
        for x, y in zip(got, want):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    batches = {trt.pack(trt.state(STATE), trt.encode_questions(q)).num_tokens for q in (QUESTIONS, OTHER)}
    assert len(batches) == 2  # two different packed lengths ...
    assert device.captures == 1 and device.launches == 3  # ... one bucket, one capture, three replays
    assert len(trt.backend.graphs) == 1


def test_chunked_prefill_appends_on_the_device_like_one_chunk(plan_dir, engine):
    device = HostDevice()
    trt = load(plan_dir, device)
    backend = trt.backend
    ids = trt.encoder.state(STATE)
    one, chunked = backend.prefill(ids, 4096), backend.prefill(ids, 7)
    assert chunked.length == one.length == len(ids)
    for a, b in zip([t for p in one.layers for t in p], [t for p in chunked.layers for t in p]):
        assert a.ptr != b.ptr and a.shape == b.shape
        x = device.view(a.ptr, a.nbytes).view(np.float32)
        y = device.view(b.ptr, b.nbytes).view(np.float32)
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    small = trt.with_limits(prefill_chunk=16)  # the engine's own path, state in 16-token chunks
    encoded = engine.encode_questions(QUESTIONS)
    for x, y in zip(small.option_logprobs(STATE + " (chunked)", encoded),
                    engine.option_logprobs(STATE + " (chunked)", encoded)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


def test_negative_control_a_pitch_bug_in_the_device_copy_is_caught(plan_dir, engine):
    broken = load(plan_dir, HostDevice(pitch_bug=True)).with_limits(prefill_chunk=16)
    encoded = engine.encode_questions(QUESTIONS)
    diff = max(np.abs(x - y).max() for x, y in zip(broken.option_logprobs(STATE, encoded),
                                                     engine.option_logprobs(STATE, encoded)))
    assert not diff <= 1e-2  # far off, or NaN (the rows the bug leaves unwritten hold fresh memory's NaNs)


def test_a_worker_thread_makes_the_context_current_before_any_device_call(plan_dir, engine):
    import threading

    trt = load(plan_dir)  # made on this thread, used from another (as the server's dispatch thread does)
    encoded = engine.encode_questions(QUESTIONS)
    out = {}
    worker = threading.Thread(target=lambda: out.update(got=trt.option_logprobs(STATE, encoded)))
    worker.start()
    worker.join()
    assert "got" in out, "the pass failed on the worker thread (see the thread's exception above)"
    for x, y in zip(out["got"], engine.option_logprobs(STATE, encoded)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


def test_without_graphs_the_same_answers_and_no_capture(plan_dir, engine):
    device = HostDevice()
    trt = load(plan_dir, device, cuda_graphs=False)
    encoded = engine.encode_questions(QUESTIONS)
    for x, y in zip(trt.option_logprobs(STATE, encoded), engine.option_logprobs(STATE, encoded)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    assert device.captures == 0 and len(trt.backend.graphs) == 0


def test_state_blocks_return_to_the_pool_and_are_reused(plan_dir):
    device = HostDevice()
    backend = load(plan_dir, device).backend
    ids = list(range(100, 400))
    kv = backend.prefill(ids, 128)  # three chunks: two appends, intermediate blocks go back to the pool
    taken = backend.pool.allocations
    del kv
    for _ in range(3):  # same size class: served from the pool, no new allocation
        kv = backend.prefill(ids, 128)
        del kv
    assert backend.pool.allocations == taken
    assert backend.pool.kept_bytes > 0
    backend.close()
    assert device.live_bytes <= 4096  # only the 256-byte address of empty tensors is left


def test_a_pool_that_keeps_nothing_frees_released_blocks(plan_dir):
    device = HostDevice()
    backend = load(plan_dir, device, pool_bytes=0).backend
    ids = list(range(100, 400))
    kv = backend.prefill(ids, 128)
    live = device.live_bytes
    del kv
    backend.prefill(ids, 128)  # frees what was released (outside any capture), then allocates anew
    assert backend.pool.kept_bytes == 0 and device.frees > 0
    assert device.live_bytes <= live


def test_the_scratch_is_sized_once_so_a_larger_pass_drops_no_graph(plan_dir, engine):
    """With graphs, the scratch the packed K/V go to is sized for max_packed_tokens at once (graphs keep its address:
    growing it would drop them all); without, it grows with the passes."""
    device = HostDevice()
    trt = load(plan_dir, device)
    trt.ask(STATE, {"refund": QUESTIONS["refund"]})  # small bucket
    assert len(trt.backend.graphs) == 1
    many = {f"q{i}": Choice(f"Question {i}: which team?", {"billing": None, "technical": None}) for i in range(12)}
    got = trt.ask(STATE, many)  # a larger bucket: a second graph, the first kept
    want = engine.ask(STATE, many)
    assert len(trt.backend.graphs) == 2
    assert trt.backend._scratch[1] == trt.backend._kv_bytes(trt.manifest.limits.max_packed_tokens)
    plain = load(plan_dir, HostDevice(), cuda_graphs=False)
    plain.ask(STATE, {"refund": QUESTIONS["refund"]})
    assert plain.backend._scratch[1] < trt.backend._scratch[1]
    for k in many:  # every option's probability by name (a swap of the two options would show here)
        assert got[k].choice == want[k].choice
        assert got[k].probabilities == pytest.approx(want[k].probabilities, abs=1e-4)


def test_plan_for_another_device_or_tensorrt_is_refused(plan_dir):
    manifest = mf.load(plan_dir)
    assert select_plan(manifest, VERSION, "sm90")["file"] == "decoder.sm90.plan"
    with pytest.raises(EngineFileError, match=r"no TensorRT plan for sm87; it has sm90 .*build-trt"):
        select_plan(manifest, VERSION, "sm87")
    with pytest.raises(EngineFileError, match="built with tensorrt_double 0.1, this machine runs tensorrt 10"):
        select_plan(manifest, "tensorrt 10.13.3.9", "sm90")
    device = HostDevice(compute_capability="sm89")
    with pytest.raises(EngineFileError, match="no TensorRT plan for sm89"):
        TensorRTBackend(plan_dir, manifest, device=device, tensorrt=fake_tensorrt(plan_dir, device))


def test_passes_use_their_roles_profile_and_a_shape_outside_it_is_a_clear_error(plan_dir):
    backend = load(plan_dir).backend
    assert list(backend.contexts) == ["prefill", "score"]
    assert backend._prefill.profile["past"][1] == 0 and backend._score.profile["past"][1] == 512
    assert not backend._prefill.set_input_shape("readout_index", (0,))  # profiles start at one read-out ...
    backend.prefill([1, 2, 3], 512)  # ... so a prefill chunk (no read-out of its own) gets a padding one
    limit = backend._prefill.profile["packed"][2]
    with pytest.raises(EngineFileError, match=r"does not accept input_ids of shape \(%d,\).*rebuild" % (limit + 1)):
        backend.prefill(list(range(1, limit + 2)), limit + 1)


def test_no_cuda_driver_is_a_clear_error():
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    from onepass.runtime.backends.cuda_device import CudaDevice

    try:
        device = CudaDevice()
    except BackendUnavailable as err:
        assert "CUDA" in str(err)
    else:
        pytest.skip(f"this machine has a GPU ({device.name}); the no-driver path cannot be shown here")


def test_cuda_bindings_newer_than_the_driver_is_a_clear_error(monkeypatch):
    """cuda-bindings 13 on a CUDA 12 driver (JetPack 6, R570) is refused at start, by name,
    with the pip line that fits; a matching driver passes the check."""
    import types

    from onepass.runtime.backends import cuda_device

    result = types.SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NO_DEVICE=100)
    fake = types.SimpleNamespace(CUresult=result, cuInit=lambda flags: (0,), cuDriverGetVersion=lambda: (0, 12060),
                                 cuDeviceGetCount=lambda: (0, 0))
    monkeypatch.setattr(cuda_device, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_device, "bindings_version", lambda: "13.0.3")
    with pytest.raises(BackendUnavailable, match=r"needs a CUDA 13 driver; .*CUDA 12\.6: pip install "
                                                 r"'cuda-bindings>=12\.6,<13'"):
        cuda_device.CudaDevice()
    monkeypatch.setattr(cuda_device, "bindings_version", lambda: "12.9.4")
    with pytest.raises(BackendUnavailable, match="this machine has 0"):  # past the version check: no device
        cuda_device.CudaDevice()


def test_event_timer_records_both_events_on_the_stream_and_frees_them(monkeypatch):
    """onepass bench's device stage on TensorRT: two CUDA events on the backend's stream, the elapsed time after
    synchronising on the second, both destroyed, through cuda-bindings' driver API (names checked against the
    installed module where it is there). The driver is a stand-in recording its calls (no GPU here)."""
    import types

    from onepass.runtime.backends import cuda_device

    calls = []
    fake = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0), CUevent_flags=types.SimpleNamespace(CU_EVENT_DEFAULT=0),
        cuEventCreate=lambda flags: calls.append(("create", flags)) or (0, f"event{len(calls)}"),
        cuEventRecord=lambda event, stream: calls.append(("record", event, stream)) or (0,),
        cuEventSynchronize=lambda event: calls.append(("sync", event)) or (0,),
        cuEventElapsedTime=lambda begin, end: calls.append(("elapsed", begin, end)) or (0, 4.5),
        cuEventDestroy=lambda event: calls.append(("destroy", event)) or (0,))
    device = object.__new__(cuda_device.CudaDevice)
    device.cu = fake
    timer = device.event_timer("stream7")
    timer.start()
    assert timer.stop() == 4.5
    assert calls == [("create", 0), ("create", 0), ("record", "event1", "stream7"), ("record", "event2", "stream7"),
                     ("sync", "event2"), ("elapsed", "event1", "event2"), ("destroy", "event1"), ("destroy", "event2")]
    try:
        from cuda.bindings import driver
    except ImportError:
        return
    assert all(hasattr(driver, name) for name in vars(fake) if name.startswith("cu"))
    assert hasattr(driver.CUevent_flags, "CU_EVENT_DEFAULT")


def test_the_tensorrt_backend_gives_bench_a_device_timer_on_its_stream(plan_dir):
    """The backend's device_timer is its device's event timer (the stand-in's times the host, where the stream
    runs): it spans a call made between start and stop."""
    import time

    engine = load(plan_dir)
    timer = engine.backend.device_timer()
    timer.start()
    engine.ask("I was charged twice.", {"r": Noul("Refund?")})
    time.sleep(0.01)
    assert timer.stop() >= 10


def test_serve_with_tensorrt_and_no_gpu_is_a_one_line_error(plan_dir, capsys):
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    pytest.importorskip("tensorrt_rtx", reason="TensorRT for RTX is not installed")
    from onepass.cli import main

    for argv in (["serve", "--engine", str(plan_dir), "--backend", "tensorrt"],
                 ["serve", "--engine", str(plan_dir), "--backend", "tensorrt", "--build-trt-if-missing"],
                 ["build-trt", "--engine", str(plan_dir), "--arch", "native"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "CUDA" in err, argv


@pytest.mark.gpu
@pytest.mark.slow  # the real SmolLM2 engine, asked for only where there is a GPU to run it on
def test_real_tensorrt_plan_on_this_gpu_reproduces_the_golden_file(request, tmp_path):
    pytest.importorskip("cuda.bindings")
    from onepass.cli import main
    from onepass.runtime.backends.cuda_device import CudaDevice
    from onepass.runtime.backends.tensorrt_build import import_tensorrt

    try:
        import_tensorrt(), CudaDevice()
    except BackendUnavailable as err:
        pytest.skip(f"no GPU with TensorRT here ({err}): run benchmarks/gpu_check.sh on a GPU machine")

    root = mf.copy_engine(request.getfixturevalue("engine_dir"), tmp_path / "engine")
    assert main(["build-trt", "--engine", str(root), "--arch", "native"]) == 0
    trt = Engine.load(root, backend=open_backend("tensorrt"))
    assert check_golden(trt)["target_logprob"] <= 1e-3


def test_a_failed_capture_falls_back_to_plain_enqueue_once(plan_dir, engine, caplog):
    """An engine whose pass cannot be captured (an injected non-capturable op) still answers,
    equal to ONNX Runtime; the capture is tried once per shape, never again, and says so in a log line."""
    device = HostDevice(uncapturable=True)
    trt = load(plan_dir, device)
    encoded = engine.encode_questions(QUESTIONS)
    with caplog.at_level("WARNING", logger="onepass.graphs"):
        for _ in range(3):
            for x, y in zip(trt.option_logprobs(STATE, encoded), engine.option_logprobs(STATE, encoded)):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    assert device.captures == 1 and device.launches == 0 and len(trt.backend.graphs) == 0
    assert trt.backend.graphs.stats.capture_failures == 1
    assert sum("capture failed" in r.message for r in caplog.records) == 1


STATE_2 = "My parcel arrived broken. I want a replacement, not a refund, and I want it this week please."


def _alternate(trt, engine, rounds: int = 2):
    """Two states (two past lengths: two graph keys) asked in turn; each answer checked against ONNX Runtime."""
    encoded = engine.encode_questions(QUESTIONS)
    for _ in range(rounds):
        for state in (STATE, STATE_2):
            for x, y in zip(trt.option_logprobs(state, encoded), engine.option_logprobs(state, encoded)):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


def test_each_graph_replays_on_its_own_context_in_one_shared_activation_buffer(plan_dir, engine):
    """Graphs of several keys, replayed in turn, give ONNX Runtime's answers; each has its own
    execution context, and every context runs in the backend's single activation buffer (no STATIC memory)."""
    device = HostDevice()
    trt = load(plan_dir, device)
    _alternate(trt, engine)
    backend = trt.backend
    assert device.captures == 2 and device.launches == 4 and len(backend.graphs) == 2
    contexts = [ctx for _, ctx in backend.graphs._graphs.values()] + list(backend.contexts.values())
    assert len({id(c) for c in contexts}) == len(contexts)  # one context per graph, none shared
    assert {c.memory for c in contexts} == {backend._activation}
    assert backend.engine.static_contexts == 0 and backend.activation_bytes == backend.engine.device_memory_size_v2


def test_negative_control_graphs_sharing_one_context_are_caught(plan_dir, engine, monkeypatch):
    """The stand-in models TensorRT's per-context state: the previous design (every graph captured on the one
    score context) fails when an older graph is replayed after another key was set up."""
    trt = load(plan_dir, HostDevice())
    backend = trt.backend
    monkeypatch.setattr(backend, "_new_context", lambda role: backend._score)
    with pytest.raises(AssertionError, match="since set up for other shapes"):
        _alternate(trt, engine)


def test_out_of_device_memory_frees_the_pools_kept_blocks_then_is_a_clear_error(plan_dir):
    """Finite device memory: a state that does not fit makes the pool free its kept blocks and retry; when it
    still does not fit, the error is a typed one that says so."""
    from onepass.runtime.backends.cuda_device import DeviceError

    device = HostDevice()
    backend = load(plan_dir, device).backend
    short, long = list(range(100, 400)), list(range(100, 1100))
    backend.prefill(long, 4096)  # the pass buffers of both sizes exist from here on (the state is dropped)
    backend.pool.clear()
    kv = backend.prefill(short, 4096)
    del kv  # its block is kept by the pool for the next state of its size class
    kept, granule = backend.pool.kept_bytes, backend.pool.granule
    assert kept > 0
    need = -(-len(long) * backend.model.kv_bytes_per_token() // granule) * granule
    device.capacity = device.live_bytes - kept + need  # the long state fits only once the kept block is freed
    kv = backend.prefill(long, 4096)
    assert kv.length == len(long) and backend.pool.kept_bytes == 0
    with pytest.raises(DeviceError, match="out of memory"):
        backend.prefill(list(range(100, 2100)), 4096)


def test_a_context_that_says_it_cannot_be_captured_runs_without_a_graph(plan_dir, engine):
    """TensorRT for RTX answers is_stream_capturable(stream): when it says no, no capture is tried and the pass
    runs by plain enqueue (equal to ONNX Runtime), counted once as a capture failure."""
    device = HostDevice(says_capturable=False)
    trt = load(plan_dir, device)
    encoded = engine.encode_questions(QUESTIONS)
    for _ in range(2):
        for x, y in zip(trt.option_logprobs(STATE, encoded), engine.option_logprobs(STATE, encoded)):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    assert device.captures == 0 and len(trt.backend.graphs) == 0 and trt.backend.graphs.stats.capture_failures == 1


def test_ask_from_8_threads_equals_single_threaded_on_the_tensorrt_stand_in(plan_dir):
    """The TensorRT backend shares its pass buffers, scratch, stream and graphs: the engine runs its passes one
    at a time (Backend.serial), so 8 threads asking at once get the single-threaded answers."""
    from test_engine import asked_from_threads_equals_asked_alone

    trt = load(plan_dir)
    assert not trt.backend.concurrent
    asked_from_threads_equals_asked_alone(trt)


def test_closing_the_engine_frees_every_device_buffer(plan_dir):
    """Engine.close() (or leaving ``with``) drops the cached states and closes the backend: graphs, pass
    buffers, scratch, state blocks and the activation buffer all go back; closing twice is harmless."""
    device = HostDevice()
    with load(plan_dir, device) as trt:
        trt.ask(STATE, QUESTIONS)
        trt.ask(STATE_2, QUESTIONS)
        assert len(trt.backend.graphs) == 2 and device.live_bytes > 1 << 20
    assert device.live_bytes <= 4096  # only the 256-byte address of empty tensors is left
    trt.close()


def _same_length_states(trt, n: int) -> list[str]:
    """``n`` different tickets of one token length (digits are single tokens)."""
    texts = [f"Ticket {i:03d}: I was charged twice for order {999 - i:03d}. Refund it." for i in range(n)]
    assert len({trt.state(t).num_tokens for t in texts[:5]}) == 1
    return texts


def test_200_distinct_states_capture_at_most_slots_x_buckets_graphs(plan_dir, engine):
    """A service's traffic: every request a new state. The graphs are keyed by (slot, state length, bucket), so
    200 states of one length capture one graph per slot, each replayed over whatever state was copied into its
    slot, with that state's answers; device memory stays within the state cache's budget plus the fixed slots."""
    device = HostDevice()
    slots = 2
    manifest = mf.load(plan_dir)
    backend = open_backend("tensorrt", device=device, tensorrt=fake_tensorrt(plan_dir, device), slots=slots,
                      pool_bytes=0)(plan_dir, manifest)
    cache = backend.reserved_bytes + (256 << 10)  # the slots, and room for a few of the 200 states
    trt = Engine(plan_dir, manifest, backend, cache)
    encoded = engine.encode_questions(QUESTIONS)
    texts = _same_length_states(trt, 200)
    worst, live = 0.0, []
    for text in texts:
        got = trt.option_logprobs(text, encoded)
        want = engine.option_logprobs(text, encoded)
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(got, want)))
        live.append(device.live_bytes)
    stats = backend.graph_stats()
    assert stats["captures"] == slots * 1 and device.captures == slots  # one bucket, one length
    assert stats["uncaptured"] == slots  # a key's first pass runs plain (capture_after=2)
    assert stats["slot_copies"] == 200 and device.launches == 200 - slots
    assert worst <= 1e-4, f"a replay over a reused slot differs from ONNX Runtime by {worst}"
    assert trt.cache.max_bytes + backend.reserved_bytes == cache
    per_state = -(-backend._kv_bytes(trt.state(texts[0]).num_tokens) // backend.pool.granule) * backend.pool.granule
    assert len(trt.cache) < 200  # the budget evicted states ...
    assert max(live) - live[0] <= trt.cache.max_bytes + per_state  # ... and what grows stays within it


def test_negative_control_graphs_keyed_by_the_state_capture_once_per_state(plan_dir, engine, monkeypatch):
    """The previous design (a graph per state address, captured at first sight): 20 new states, 20 captures."""
    device = HostDevice()
    trt = load(plan_dir, device)
    monkeypatch.setattr(trt.backend, "_in_slot", lambda kv: (kv.layers[0][0].ptr, kv))  # the state's own buffers
    encoded = engine.encode_questions(QUESTIONS)
    for text in _same_length_states(trt, 20):
        trt.option_logprobs(text, encoded)
    assert trt.backend.graph_stats()["captures"] == 20 > trt.backend.slots.count


def test_negative_control_a_slot_not_refilled_for_a_new_state_is_caught(plan_dir, engine, monkeypatch):
    """A replay over a slot that still holds another state's K/V answers for that other state: caught."""
    trt = load(plan_dir, HostDevice(), slots=1)
    encoded = engine.encode_questions(QUESTIONS)
    first, second = _same_length_states(trt, 2)
    trt.option_logprobs(first, encoded)
    place = trt.backend.slots.place
    monkeypatch.setattr(trt.backend.slots, "place", lambda owner: (place(owner)[0], False))
    got = trt.option_logprobs(second, encoded)
    want = engine.option_logprobs(second, encoded)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) > 1e-3


def _distinct_keys(trt, encoded, n: int) -> list[str]:
    """``n`` states whose (state bucket, packed bucket) differ from each other's."""
    from onepass.runtime.backends.batch import bucket

    seen, out = set(), []
    for i in range(200):
        text = STATE + " Again." * (3 * i)
        state = trt.state(text)
        key = (bucket(state.num_tokens), bucket(trt.pack(state, encoded).num_tokens))
        if key not in seen:
            seen.add(key)
            out.append(text)
        if len(out) == n:
            return out
    raise AssertionError("not enough distinct buckets")


def test_a_shape_seen_once_is_never_captured(plan_dir, engine):
    """By default a (slot, state bucket, pass bucket) key is captured at its second pass: a one-off shape costs no
    capture and no execution context."""
    device = HostDevice()
    trt = Engine.load(plan_dir, backend=open_backend("tensorrt", device=device, tensorrt=fake_tensorrt(plan_dir, device)))
    encoded = engine.encode_questions(QUESTIONS)
    contexts = trt.backend.engine.contexts_created
    texts = _distinct_keys(trt, encoded, 4)
    for text in texts:
        trt.option_logprobs(text, encoded)
    assert device.captures == 0 and trt.backend.engine.contexts_created == contexts
    trt.option_logprobs(texts[0], encoded)  # its second pass: now captured
    assert device.captures == 1


def _one_bucket_states(trt) -> list[str]:
    """Tickets of different token lengths that pad to one state bucket (and one pass bucket)."""
    from onepass.runtime.backends.batch import bucket

    texts = [STATE + " Please." * i for i in range(16)]
    groups: dict = {}
    for t in texts:
        groups.setdefault(bucket(trt.state(t).num_tokens), []).append(t)
    same = max(groups.values(), key=len)
    assert len({trt.state(t).num_tokens for t in same}) >= 3  # several lengths, one bucket
    return same


def test_states_of_different_lengths_share_their_buckets_graph_with_their_own_answers(plan_dir, engine):
    """The plan's past_length masks a state's padding rows, so states of several lengths padded to one bucket replay
    one graph per slot, each with its own answers."""
    device = HostDevice()
    trt = load(plan_dir, device, capture_after=2, slots=1)
    encoded = engine.encode_questions(QUESTIONS)
    texts = _one_bucket_states(trt)
    assert trt.backend.has_past_length
    for text in texts:
        for x, y in zip(trt.option_logprobs(text, encoded), engine.option_logprobs(text, encoded)):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    stats = trt.backend.graph_stats()
    assert stats["captures"] == 1 and stats["replays"] == len(texts) - 1, stats


def test_negative_control_a_state_length_not_fed_unmasks_the_padding_rows(plan_dir, engine, monkeypatch):
    """If the plan were told the padded length, tokens would see the padding rows (zeros, or another state's rows):
    caught by the same comparison."""
    trt = load(plan_dir, HostDevice(), capture_after=2, slots=1)
    encoded = engine.encode_questions(QUESTIONS)
    texts = _one_bucket_states(trt)
    upload = trt.backend._upload
    monkeypatch.setattr(trt.backend, "_upload", lambda batch, ptrs, past: upload(batch, ptrs, 10**6))
    worst = max(float(np.abs(x - y).max()) for text in texts for x, y in
                zip(trt.option_logprobs(text, encoded), engine.option_logprobs(text, encoded)))
    assert worst > 1e-3


def test_passes_pad_to_buckets_capped_at_max_packed_tokens(plan_dir, engine, tmp_path):
    """A limit that is not on the bucket ladder (the Orin advice: 1500) ends the buckets: a pass of 1,400 tokens pads
    to 1,500, which the plan's profile accepts, not to 1,536, which it refuses. Here: a plan built for 90 packed
    tokens and a pass of 84 (bucket 96 before the cap)."""
    from onepass.runtime.backends.batch import bucket

    assert bucket(1400) == 1536 and bucket(1400, 1500) == 1500 and bucket(1600, 1500) == 1792
    assert bucket(84) == 96 and bucket(84, 90) == 90
    root = mf.copy_engine(plan_dir, tmp_path / "engine")
    manifest = mf.load(root)
    manifest = dataclasses.replace(manifest, limits=dataclasses.replace(manifest.limits, max_packed_tokens=90,
                                                                          prefill_chunk=64))
    data, profile = write_plan(manifest)
    (root / "decoder.sm90.plan").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    record = dict(manifest.plans[0], sha256=sha, bytes=len(data), profiles=profile)
    mf.write(root, dataclasses.replace(manifest, plans=[record], files={**manifest.files, record["file"]: sha}))
    trt = load(root)
    encoded = trt.encode_questions(QUESTIONS)
    batch = trt.pack(trt.state(STATE), encoded)
    assert batch.num_tokens == 84
    for x, y in zip(trt.option_logprobs(STATE, encoded), engine.option_logprobs(STATE, encoded)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    assert (90, bucket(batch.readout_index.shape[0], 90)) in trt.backend._io  # the pass ran padded to the cap


def test_build_native_plan_if_missing_records_this_devices_plan_through_the_library(plan_dir, tmp_path, monkeypatch):
    """What the GPU images' entry point (`serve --build-trt-if-missing`) and gpu_check call: a library function, no
    command-line namespace (a forged one lacked ``device`` and crashed). On the stand-in device (sm87) with the
    stand-in builder: the plan is built once, recorded under the device's compute capability, and then loads."""
    from onepass.runtime.backends import cuda_device, tensorrt_build
    from onepass.runtime.core import plans

    root = mf.copy_engine(plan_dir, tmp_path / "engine")
    device = HostDevice(compute_capability="sm87")
    module = fake_tensorrt(root, device, version="0.1")
    built = []

    def build_plan(root_, manifest, out, **options):
        data, profiles = write_plan(manifest)
        out.write_bytes(data)
        built.append(options)
        return {"file": out.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "tensorrt": VERSION, "compute_capability": "current", "precision": manifest.precision,
                "profiles": profiles}

    monkeypatch.setattr(cuda_device, "CudaDevice", lambda ordinal=0: device)
    monkeypatch.setattr(tensorrt_build, "import_tensorrt", lambda flavour=None: module)
    monkeypatch.setattr(tensorrt_build, "build_plan", build_plan)
    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "cache"))
    record = plans.build_native_plan_if_missing(root)
    assert record["compute_capability"] == "sm87" and built[0]["compute_capability"] is None  # built on the device
    assert plans.build_native_plan_if_missing(root) is None and len(built) == 1  # present: not rebuilt
    recorded = {p["compute_capability"] for p in mf.load(root).plans}
    assert recorded == {"sm90", "sm87"}
    trt = Engine.load(root, backend=open_backend("tensorrt", device=device, tensorrt=module))
    assert trt.backend.plan["compute_capability"] == "sm87"


def test_device_spans_cover_the_passes_and_nothing_inside_a_capture(plan_dir, engine):
    """gpu_check and bench time the device work as the spans of each pass (Backend.device_span): the first pass
    of a key is one span for its warm-up enqueue and one for its first replay — no event is recorded while the
    stream is being captured — and a replay is one span. Spans are collected per thread."""
    import threading

    trt = load(plan_dir, HostDevice())
    encoded = engine.encode_questions(QUESTIONS)
    trt.state(STATE)  # prefilled before collecting
    trt.backend.spans = spans = []
    trt.option_logprobs(STATE, encoded)
    assert len(spans) == 2 and trt.backend.graph_stats()["captures"] == 1
    spans.clear()
    trt.option_logprobs(STATE, encoded)
    assert len(spans) == 1 and all(ms >= 0 for ms in spans)
    other = threading.Thread(target=lambda: trt.option_logprobs(STATE, encoded))
    other.start()
    other.join()
    assert len(spans) == 1  # another thread's pass is not this thread's span
    trt.backend.spans = None


def test_a_slot_whose_copy_fails_is_vacated_never_read_as_a_hit():
    """A copy into a slot that fails half-way (out of device memory, a CUDA error) must not leave the slot recorded
    as holding that state: its next pass would read the half-filled slot as a hit."""
    from onepass.runtime.backends.graphs import SlotTable

    class State:  # a StateKV stand-in (slots hold their owners by weak reference)
        pass

    table, owner = SlotTable(2), State()

    def broken(index):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        table.fill(owner, broken)
    copied = []
    index = table.fill(owner, copied.append)  # copied again, not taken as a hit
    assert copied == [index] and table.hits == 0
    assert table.fill(owner, copied.append) == index and copied == [index] and table.hits == 1
