"""Teachers: the System One client against a real second `onepass serve` process (a tuned engine teaching the
base one), shadow and gate mode in a served engine, the records, `onepass distill`, and teachers that are down,
slow, refuse, answer garbage or no log-probabilities (typed errors, local answers unchanged, nothing recorded)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
httpx2 = pytest.importorskip("httpx2")

from conftest import serve_process  # noqa: E402
from hostile import Trickler  # noqa: E402

from onepass import Choice, Engine, Noul, Score  # noqa: E402
from onepass.calibration.tune.config import TuneConfig  # noqa: E402
from onepass.calibration.tune import trainer as tn  # noqa: E402
from onepass.calibration.data.rows import load_rows  # noqa: E402
from onepass.runtime.core.questions import to_wire  # noqa: E402
from onepass.runtime.server.records import Records  # noqa: E402
from onepass.runtime.teacher.client import (  # noqa: E402
    TeacherBadAnswer, TeacherLate, TeacherRefused, TeacherUnavailable, answer_distribution, connect,
    label_distribution, openai_prompt)

QUESTIONS = {"sky": Noul("Is the sky blue on a clear day?"), "fish": Noul("Do fish climb trees?"),
             "team": Choice("Which team is named?", {"red": None, "blue": "the blue team"}),
             "loud": Score("How loud is it?", ["Quiet", "Loud", "Very loud"])}
STATES = [f"Note {i}: the meeting moved to room {i + 3}." for i in range(16)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def teacher_dir(tiny_engine_dir, tmp_path_factory):
    """A tuned tiny engine: the teacher (its answers differ from the base engine's)."""
    from onepass.calibration.tune.engine import tune

    tmp = tmp_path_factory.mktemp("teacher")
    facts = [(QUESTIONS["sky"], "yes"), (QUESTIONS["fish"], "no")]
    data = tmp / "facts.jsonl"
    data.write_text("".join(json.dumps({"state": s, "question": to_wire(q), "label": label}) + "\n"
                            for s in STATES for q, label in facts))
    out = tmp / "teacher"
    tune(tiny_engine_dir, [data], out, TuneConfig(rank=2, train_blocks=1, epochs=3, batch_questions=4, lr=1e-2,
                                                     holdout=0.25, patience=3, lora_min_rows=0),  # a LoRA teacher
         name="teacher", log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def teacher_url(teacher_dir, tmp_path_factory):
    """The teacher served by a real `onepass serve` process on loopback."""
    url, proc = serve_process(teacher_dir, _port(), tmp_path_factory.mktemp("serve") / "teacher.log")
    yield url
    proc.terminate()
    proc.wait(30)


def _probs(engine, state, questions):
    answers = engine.ask(state, questions)
    return {q: answer_distribution(questions[q], answers[q]) for q in questions}


def test_systemone_teacher_gives_the_served_engines_distributions(teacher_url, teacher_dir, tiny_engine_dir):
    """Reference: the teacher engine in process. Negative control: the base engine's answers differ."""
    teacher, base = Engine.load(teacher_dir), Engine.load(tiny_engine_dir)
    with connect(teacher_url, "systemone") as client:
        got = client.probabilities(STATES[0], QUESTIONS)
        answers = client.ask(STATES[0], QUESTIONS)
    want, other = _probs(teacher, STATES[0], QUESTIONS), _probs(base, STATES[0], QUESTIONS)
    for q in QUESTIONS:
        np.testing.assert_allclose(got[q], want[q], atol=1e-6)
        np.testing.assert_allclose(answer_distribution(QUESTIONS[q], answers[q]), want[q], atol=1e-6)
    assert max(float(np.abs(want[q] - other[q]).max()) for q in QUESTIONS) > 1e-3  # the control differs


def test_a_teacher_that_is_down_is_unavailable_within_its_deadline():
    port = _port()  # nothing listens there
    with connect(f"http://127.0.0.1:{port}", timeout_s=1.0, retries=2, backoff_s=0.01) as client:
        with pytest.raises(TeacherUnavailable, match="3 attempts"):
            client.probabilities("A state.", {"q": QUESTIONS["sky"]})


def test_a_teacher_that_never_answers_is_unavailable_at_the_deadline():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections (the kernel's backlog) and never answers
    try:
        with connect(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=5.0, retries=3) as client:
            start = time.monotonic()
            with pytest.raises(TeacherUnavailable):
                client.probabilities("A state.", {"q": QUESTIONS["sky"]}, deadline=time.monotonic() + 0.5)
            assert time.monotonic() - start < 4.5  # the deadline ended it, not the 5 s attempt timeout (generous)
    finally:
        listener.close()


class _Scripted(BaseHTTPRequestHandler):
    """Answers POSTs from a script of (status, headers, body) and records what it was sent."""

    script: list = []
    seen: list = []

    def do_POST(self):  # noqa: N802 - the http.server API
        self.seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        status, headers, body = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    """A stand-in HTTP server that answers what each test scripts (failure injection the real ones cannot do)."""
    handler = type("Handler", (_Scripted,), {"script": [], "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


NOUL_OK = {"model": "m", "answers": {"q": {"type": "noul", "noul": 0.8}}, "usage": {}}


@pytest.mark.parametrize("status, body, error, message", [
    (200, b"<html>not json</html>", TeacherBadAnswer, "not JSON"),
    (200, {"answers": {"q": {"type": "choice", "choice": "red"}}}, TeacherBadAnswer, "no noul answer"),
    (200, {"answers": {"q": {"type": "noul", "noul": 1.5}}}, TeacherBadAnswer, "probability 0..1"),
    (200, {"model": "m"}, TeacherBadAnswer, "no 'answers'"),
    (401, {"error": {"message": "bad key"}}, TeacherRefused, "bad key"),
    (422, {"detail": "no"}, TeacherRefused, "HTTP 422"),
    (503, {"error": "busy"}, TeacherUnavailable, "HTTP 503"),
])
def test_teacher_failures_are_typed_errors(scripted, status, body, error, message):
    url, handler = scripted
    handler.script[:] = [(status, {"retry-after": "0"}, body)]
    with connect(url, retries=1, backoff_s=0.01) as client, pytest.raises(error, match=message):
        client.probabilities("A state.", {"q": QUESTIONS["sky"]})
    assert len(handler.seen) == (2 if error is TeacherUnavailable else 1)  # only what may pass is retried


def test_choice_probabilities_must_be_a_distribution_over_the_options(scripted):
    url, handler = scripted
    q = {"q": QUESTIONS["team"]}
    for probs, message in (({"red": 0.5}, "keyed by the options"), ({"red": 0.9, "blue": 0.9}, "sum to"),
                           ({"red": -0.1, "blue": 1.1}, "finite number")):
        handler.script[:] = [(200, {}, {"answers": {"q": {"type": "choice", "choice": "red", "probabilities": probs,
                                                          "confidence": 0.1}}})]
        with connect(url) as client, pytest.raises(TeacherBadAnswer, match=message):
            client.probabilities("A state.", q)


def test_retries_honour_retry_after_then_answer(scripted):
    url, handler = scripted
    handler.script[:] = [(429, {"retry-after": "0"}, {"error": "slow down"}), (200, {}, NOUL_OK)]
    with connect(url, retries=2, backoff_s=0.01, model="big", api_key="k") as client:
        got = client.probabilities("A state.", {"q": QUESTIONS["sky"]})
    np.testing.assert_allclose(got["q"], [0.8, 0.2])
    assert len(handler.seen) == 2 and handler.seen[0]["model"] == "big"


def test_a_retry_after_past_the_deadline_and_a_redirect_say_so(scripted):
    """After a 429 with Retry-After: 100000 the error said "within the deadline or 3 attempts" after one attempt; a
    redirect was "refused (HTTP 307: )" without its target."""
    url, handler = scripted
    handler.script[:] = [(429, {"retry-after": "100000"}, {"error": "slow down"})]
    with connect(url, retries=2, backoff_s=0.01) as client, \
            pytest.raises(TeacherUnavailable, match=r"1 of 3 attempts made.*asked to wait 100000 s.*pass the deadline"):
        client.probabilities("A state.", {"q": QUESTIONS["sky"]})
    assert len(handler.seen) == 1
    handler.script[:] = [(307, {"location": "http://elsewhere:9000/v1/systemone"}, b"")]
    with connect(url) as client, pytest.raises(TeacherRefused, match="redirect to 'http://elsewhere:9000/v1/"):
        client.probabilities("A state.", {"q": QUESTIONS["sky"]})


def _completion(top):
    return {"choices": [{"message": {"content": top[0]["token"] if top else ""},
                         "logprobs": {"content": [{"token": "x", "logprob": -0.1, "top_logprobs": top}] if top
                                      else None}}]}


def test_openai_teacher_reads_the_option_labels_log_probabilities(scripted):
    url, handler = scripted
    top = [{"token": "B", "logprob": float(np.log(0.6))}, {"token": " A", "logprob": float(np.log(0.3))},
           {"token": "The", "logprob": float(np.log(0.05))}]
    handler.script[:] = [(200, {}, _completion(top))]
    with connect(url, "openai", model="m") as client:
        got = client.probabilities("The blue team won.", {"q": QUESTIONS["team"]})
    np.testing.assert_allclose(got["q"], [0.3 / 0.9, 0.6 / 0.9])  # A = red, B = blue; renormalised over the labels
    sent = handler.seen[0]
    assert sent["logprobs"] is True and sent["max_tokens"] == 1 and sent["model"] == "m"
    assert "A. red" in sent["messages"][1]["content"] and "B. blue (the blue team)" in sent["messages"][1]["content"]


def test_openai_teacher_without_log_probabilities_is_a_clear_error(scripted):
    url, handler = scripted
    handler.script[:] = [(200, {}, _completion([]))]
    with connect(url, "openai") as client, pytest.raises(TeacherBadAnswer, match="no log-probabilities"):
        client.probabilities("A state.", {"q": QUESTIONS["sky"]})


def test_label_distribution_gives_a_missing_label_the_least_listed_probability():
    top = [{"token": "yes", "logprob": np.log(0.7)}, {"token": "Maybe", "logprob": np.log(0.1)}]
    np.testing.assert_allclose(label_distribution(top, ["yes", "no"], noul=True), [0.7 / 0.8, 0.1 / 0.8])
    with pytest.raises(TeacherBadAnswer, match="none of the option labels"):
        label_distribution([{"token": "Maybe", "logprob": -0.1}], ["A", "B"], noul=False)
    with pytest.raises(TeacherRefused, match="at most 20 options"):
        openai_prompt("s", Choice("Which?", {f"o{i}": None for i in range(21)}))


def test_records_rotate_under_their_cap_and_hold_only_whole_lines(tmp_path):
    records = Records(tmp_path, max_bytes=4096, file_bytes=1024)
    line = json.dumps({"state": "x" * 80}).encode() + b"\n"
    for _ in range(100):
        assert records.write(line)
    records.close()
    files = records.files()
    assert sum(f.stat().st_size for f in files) <= 4096 and all(f.stat().st_size <= 1024 for f in files)
    assert records.deleted > 0 and records.rows == 100
    assert all(json.loads(x) for f in files for x in f.read_text().splitlines())
    assert not records.write(b'{"no newline": 1}') and records.failed == 1


def test_a_failed_record_write_leaves_no_half_line(tmp_path):
    """A real write failure: a file size limit (RLIMIT_FSIZE) met in the middle of a line. The file is cut back to
    its last whole line and the next row starts a new file; every file holds whole rows only."""
    code = """
import resource, sys
from onepass.runtime.server.records import Records
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
records = Records(sys.argv[1], max_bytes=1 << 20, file_bytes=1 << 16)
ok = sum(records.write(('{"n": %d, "pad": "%s"}\\n' % (i, "x" * 40)).encode()) for i in range(50))
print(ok, records.failed)
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ok, failed = map(int, out.stdout.split())
    assert failed >= 1 and ok + failed == 50
    lines = [x for f in sorted(tmp_path.glob("teacher-*.jsonl")) for x in f.read_bytes().split(b"\n")[:-1]]
    assert len(lines) == ok and all(json.loads(x)["pad"] == "x" * 40 for x in lines)
    assert all(f.read_bytes().endswith(b"\n") for f in tmp_path.glob("teacher-*.jsonl") if f.stat().st_size)


def _metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#") and (not want or want in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _post(url, state, questions, headers=None):
    body = {"state": state, "questions": {q: to_wire(v) for q, v in questions.items()}}
    response = httpx2.post(url + "/v1/systemone", json=body, timeout=60, headers=headers or {})
    assert response.status_code == 200, response.text
    return response


def _wait_for(predicate, seconds=60.0):
    until = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < until, "timed out waiting"
        time.sleep(0.2)


def test_shadow_mode_records_the_teachers_answers_and_never_changes_the_local_ones(
        tiny_engine_dir, teacher_dir, teacher_url, tmp_path):
    records = tmp_path / "records"
    url, proc = serve_process(tiny_engine_dir, _port(), tmp_path / "student.log", "--teacher", teacher_url,
                              "--shadow-rate", "1", "--record", str(records))
    try:
        base, teacher = Engine.load(tiny_engine_dir), Engine.load(teacher_dir)
        for state in STATES[:3]:
            got = _post(url, state, QUESTIONS).json()["answers"]
            assert got == {q: a.to_wire() for q, a in base.ask(state, QUESTIONS).items()}  # local, unchanged
        _wait_for(lambda: _metric(httpx2.get(url + "/metrics").text, "onepass_teacher_records_total") >= 12)
        text = httpx2.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    assert _metric(text, "onepass_teacher_calls_total", mode="shadow", outcome="ok") == 3
    assert _metric(text, "onepass_teacher_shadowed_questions_total") == 12
    assert _metric(text, "onepass_questions_answered_total", by="local") == 12
    rows, _ = load_rows(sorted(records.glob("*.jsonl")))  # tune reads the records as they are
    assert len(rows) == 12
    for r in rows:  # each row is the teacher's distribution (reference: the teacher engine in process)
        want = _probs(teacher, r.state, {"q": r.question})["q"]
        np.testing.assert_allclose(r.target, want, atol=1e-6)
    agreements = sum(int(np.argmax(r.target) == np.argmax(_probs(base, r.state, {"q": r.question})["q"]))
                     for r in rows)
    assert _metric(text, "onepass_teacher_agreements_total") == agreements


def test_gate_mode_answers_doubtful_questions_with_the_teacher_within_the_deadline(
        tiny_engine_dir, teacher_dir, teacher_url, tmp_path):
    url, proc = serve_process(tiny_engine_dir, _port(), tmp_path / "student.log", "--teacher", teacher_url,
                              "--min-confidence", "0.9999")
    try:
        teacher, base = Engine.load(teacher_dir), Engine.load(tiny_engine_dir)
        response = _post(url, STATES[4], QUESTIONS)
        text = httpx2.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    by = dict(item.split("=") for item in response.headers["x-onepass-answered-by"].split(","))
    local = base.ask(STATES[4], QUESTIONS)
    want = teacher.ask(STATES[4], QUESTIONS)
    for q, answer in response.json()["answers"].items():
        expected = (want if local[q].certainty < 0.9999 else local)[q]
        assert by[q] == (f"systemone:{teacher_url.split('//')[1]}" if local[q].certainty < 0.9999 else base.name)
        np.testing.assert_allclose(answer_distribution(QUESTIONS[q], type(expected)(**_fields(answer))),
                                   answer_distribution(QUESTIONS[q], expected), atol=1e-6)
    forwarded = [q for q in by if by[q] != base.name]
    assert forwarded and _metric(text, "onepass_questions_answered_total", by="teacher") == len(forwarded)


def test_a_distilled_engines_gate_is_served_with_its_teacher(tiny_engine_dir, teacher_url, tmp_path):
    """An engine whose manifest carries a gate, served with --teacher and no other flag: the question it was
    distilled on is answered locally above its threshold (0 here: always), every other question by the teacher."""
    import dataclasses

    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.readout_calibration import question_key

    gated = mf.copy_engine(tiny_engine_dir, tmp_path / "gated")
    base = Engine.load(tiny_engine_dir)
    q = QUESTIONS["sky"]
    key = question_key(q.type, base.encoder.instructions(q), base.encoder.options(q))
    m = mf.load(gated, verify=False)
    mf.write(gated, dataclasses.replace(m, gate={"per_key": {key: 0.0}, "default": 1.0, "target_agreement": 0.95}))
    url, proc = serve_process(gated, _port(), tmp_path / "student.log", "--teacher", teacher_url)
    try:
        response = _post(url, STATES[8], QUESTIONS)
    finally:
        proc.terminate()
        proc.wait(30)
    by = dict(item.split("=") for item in response.headers["x-onepass-answered-by"].split(","))
    assert by["sky"] == base.name and all(by[other] != base.name for other in ("fish", "team", "loud"))


def _fields(wire: dict) -> dict:
    return {k: v for k, v in wire.items() if k not in ("type",)}


@pytest.mark.parametrize("mode", ["shadow", "gate"])
def test_a_teacher_that_is_down_changes_nothing_and_records_nothing(tiny_engine_dir, tmp_path, mode):
    records = tmp_path / "records"
    flags = ["--shadow-rate", "1"] if mode == "shadow" else ["--min-confidence", "1.0"]
    url, proc = serve_process(tiny_engine_dir, _port(), tmp_path / "student.log", "--teacher",
                              f"http://127.0.0.1:{_port()}", "--teacher-timeout", "1", "--record", str(records),
                              *flags)
    try:
        base = Engine.load(tiny_engine_dir)
        response = _post(url, STATES[5], QUESTIONS)
        assert response.json()["answers"] == {q: a.to_wire() for q, a in base.ask(STATES[5], QUESTIONS).items()}
        _wait_for(lambda: _metric(httpx2.get(url + "/metrics").text, "onepass_teacher_calls_total", mode=mode,
                                  outcome="unavailable") == 1)
    finally:
        proc.terminate()
        proc.wait(30)
    assert not list(records.glob("*.jsonl")) or all(f.stat().st_size == 0 for f in records.glob("*.jsonl"))


def test_a_hanging_teacher_in_gate_mode_leaves_every_request_its_local_answer_in_time(tiny_engine_dir, tmp_path):
    """A teacher that accepts connections and never answers: six requests at once, every question below the gate.
    Each gets a 200 with the local answers before its deadline; no call waits in line for a connection."""
    from concurrent.futures import ThreadPoolExecutor

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    url, proc = serve_process(tiny_engine_dir, _port(), tmp_path / "student.log", "--teacher",
                              f"http://127.0.0.1:{listener.getsockname()[1]}", "--min-confidence", "1.0")
    try:
        base = Engine.load(tiny_engine_dir)
        want = {q: a.to_wire() for q, a in base.ask(STATES[6], QUESTIONS).items()}
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: _post(url, STATES[6], QUESTIONS, {"X-Request-Timeout": "3"}),
                                      range(6)))
        text = httpx2.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
        listener.close()
    assert all(r.json()["answers"] == want for r in responses)  # 200s (checked in _post), local answers
    assert all(set(r.headers["x-onepass-answered-by"].split(",")) == {f"{q}={base.name}" for q in QUESTIONS}
               for r in responses)
    outcomes = {o: _metric(text, "onepass_teacher_calls_total", mode="gate", outcome=o)
                for o in ("unavailable", "late", "skipped", "circuit_open", "ok")}
    assert sum(outcomes.values()) == 6 and outcomes["ok"] == 0, outcomes
    assert _metric(text, "onepass_questions_answered_total", by="local") == 6 * len(QUESTIONS)


def test_a_teacher_answering_garbage_in_shadow_mode_is_counted_and_records_nothing(tiny_engine_dir, tmp_path,
                                                                                    scripted):
    teacher, handler = scripted
    handler.script[:] = [(200, {"content-type": "application/json"}, b"{not json")]
    records = tmp_path / "records"
    url, proc = serve_process(tiny_engine_dir, _port(), tmp_path / "student.log", "--teacher", teacher,
                              "--shadow-rate", "1", "--record", str(records))
    try:
        base = Engine.load(tiny_engine_dir)
        got = _post(url, STATES[7], QUESTIONS).json()["answers"]
        assert got == {q: a.to_wire() for q, a in base.ask(STATES[7], QUESTIONS).items()}
        _wait_for(lambda: _metric(httpx2.get(url + "/metrics").text, "onepass_teacher_calls_total", mode="shadow",
                                  outcome="bad_answer") == 1)
    finally:
        proc.terminate()
        proc.wait(30)
    assert len(handler.seen) == 1 and not any(f.stat().st_size for f in records.glob("*.jsonl"))


def test_the_breaker_opens_once_per_wave_and_lets_one_probe_through():
    from onepass.runtime.server.teaching import Breaker

    now = [0.0]
    breaker = Breaker(lambda: now[0])
    first, second = breaker.admit(), breaker.admit()
    breaker.result(first, False)
    breaker.result(second, False)  # the same wave: the cool-down is not doubled for it
    now[0] = 0.4
    assert breaker.admit() is None
    now[0] = 0.51
    probe = breaker.admit()
    assert probe is not None and breaker.admit() is None  # one probe at a time
    breaker.result(probe, True)
    assert breaker.admit() is not None


def test_serve_teacher_flags_are_checked(tmp_path, tiny_engine_dir):
    """Settings are refused before any engine loads (the engine does not exist), and a teacher that would never
    be asked once the engine shows it has no gate."""
    for engine, args, message in (
            (tiny_engine_dir, ["--teacher", "http://127.0.0.1:9"], "never asked"),
            (tmp_path / "none", ["--teacher", "ftp://x", "--shadow-rate", "1"], "http(s)://HOST"),
            (tmp_path / "none", ["--teacher", "http://127.0.0.1:9", "--shadow-rate", "2"], "within 0..1"),
            (tmp_path / "none", ["--teacher", "http://127.0.0.1:9", "--teacher-concurrency", "0"], "concurrency"),
            (tmp_path / "none", ["--min-confidence", "0.5"], "--cascade engine or a --teacher"),
            (tmp_path / "none", ["--shadow-rate", "0.5", "--record", "x"], "--shadow-rate, --record are settings"),
            (tmp_path / "none", ["--teacher", "http://h:99999", "--shadow-rate", "1"], "port must be")):
        out = subprocess.run([sys.executable, "-m", "onepass", "serve", "--engine", str(engine),
                              "--port", str(_port()), *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow
def test_distill_labels_tunes_gates_and_resumes(tiny_engine_dir, teacher_url, tmp_path):
    from onepass.calibration.teach.distill import _read_labels, distill, label, read_questions

    states = tmp_path / "states.jsonl"
    states.write_text("".join(json.dumps(s) + "\n" for s in STATES) + json.dumps({"state": STATES[0]}) + "\n")
    questions = tmp_path / "q.json"
    asked = {"sky": QUESTIONS["sky"], "fish": QUESTIONS["fish"]}
    questions.write_text(json.dumps({q: to_wire(v) for q, v in asked.items()}))

    class Interrupted(Exception):
        pass

    class Counting:
        """The real teacher client, counting calls; interrupted after ``stop`` of them."""

        def __init__(self, client, stop=None):
            self.client, self.name, self.calls, self.stop = client, client.name, 0, stop

        def probabilities(self, state, qs, deadline=None):
            self.calls += 1
            self.asked = getattr(self, "asked", []) + [set(qs)]
            if self.stop is not None and self.calls > self.stop:
                raise Interrupted
            return self.client.probabilities(state, qs, deadline)

    labels = tmp_path / "student.distill" / "labels.jsonl"
    with connect(teacher_url) as client:
        first = Counting(client, stop=5)
        with pytest.raises(Interrupted):
            label(first, STATES, read_questions(str(questions)), labels, concurrency=1, log=lambda *_: None)
        with open(labels, "ab") as fh:
            fh.write(b'{"state_id": "cut sh')  # a line cut short by the interruption
        done = len(_read_labels(labels))
        assert done == 5 and labels.read_bytes().endswith(b"\n")
        second = Counting(client)
        config = TuneConfig(rank=2, train_blocks=1, epochs=3, batch_questions=4, lr=1e-2, patience=3,
                               lora_min_rows=0)  # a LoRA student on 24 rows (fewer than 100 train the head only)
        report = distill(tiny_engine_dir, second, str(states), str(questions), tmp_path / "student",
                         target_agreement=0.9, holdout=0.25, config=config, concurrency=2, log=lambda *_: None)
        third = Counting(client)  # one more question later: only it is asked, of every state
        more = label(third, STATES[:6], {**asked, "team": QUESTIONS["team"]}, labels, concurrency=2,
                     log=lambda *_: None)
        assert third.asked == [{"team"}] * 6 and sorted(len(rows) for rows in more.values()) == [3] * 6
        fourth = Counting(client)  # a question dropped: nothing to ask, its rows left out
        fewer = label(fourth, STATES, {"sky": asked["sky"]}, labels, log=lambda *_: None)
        assert fourth.calls == 0 and len(fewer) == 16 and all(len(r) == 1 for r in fewer.values())
    assert second.calls == len(STATES) - done  # nothing asked twice
    assert report["labelled_states"] == 16 and report["train_states"] == 12 and report["held_out_states"] == 4
    rows = [json.loads(x) for x in labels.read_text().splitlines()]
    assert len(rows) == 32 + 6 and len({r["state_id"] for r in rows}) == 16
    student = Engine.load(tmp_path / "student")
    gate = student.manifest.gate
    assert gate["target_agreement"] == 0.9 and len(gate["per_key"]) == 2 and gate["teacher"] == client.name
    tuning = report["tuning"]
    assert tuning["heldout_best"]["nll"] < tuning["heldout_before"]["nll"]  # closer to the teacher than the base
    assert 0.0 <= report["requests_saved"] <= report["coverage_at_target"] <= 1.0 and 0.0 <= report["agreement"] <= 1.0
    assert report["teacher_requests"] == 11 and not (tmp_path / "student.distill" / "engine").exists()
    assert json.loads((tmp_path / "student-report" / "distill.json").read_text())["labelled_states"] == 16
    from onepass.runtime.core.cascade import Gate

    thresholds = Gate.from_manifest(gate).for_questions(student, asked)
    assert {thresholds.threshold(q) for q in asked} == set(gate["per_key"].values())
    assert Gate.from_manifest(gate).for_questions(student, {"x": QUESTIONS["team"]}).threshold("x") == 1.0


def test_the_gate_threshold_takes_tied_confidences_all_in_or_all_out():
    from onepass.calibration.teach.distill import threshold_for

    conf = np.array([0.9, 0.8, 0.8, 0.8, 0.5])
    hits = np.array([True, True, True, False, False])
    assert threshold_for(conf, hits, 0.75) == 0.8  # the 0.8 tie: 3 of 4 agree (and 3 of 5 with the 0.5)
    assert threshold_for(conf, hits, 0.9) == 0.9  # taking any 0.8 takes all three, and one disagrees
    assert threshold_for(conf, ~hits, 0.5) == 1.0  # no share reaches it: everything goes to the teacher


def test_distill_refuses_what_tune_would_before_asking_the_teacher(tmp_path, tiny_engine_dir):
    from onepass.calibration.teach.distill import distill
    from onepass.runtime.core.errors import InvalidRequest, LimitExceeded

    class Never:
        name = "never"

        def probabilities(self, *a, **k):
            raise AssertionError("the teacher was asked")

    states = tmp_path / "states.jsonl"
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"q": to_wire(QUESTIONS["sky"])}))
    states.write_text(json.dumps("word " * 2000) + "\n" + "".join(json.dumps(s) + "\n" for s in STATES))
    with pytest.raises(LimitExceeded, match="state 1 of --states"):
        distill(tiny_engine_dir, Never(), str(states), str(questions), tmp_path / "out", log=lambda *_: None)
    states.write_text("".join(json.dumps(s) + "\n" for s in STATES))
    questions.write_text(json.dumps({"a": to_wire(QUESTIONS["sky"]), "b": to_wire(QUESTIONS["sky"])}))
    with pytest.raises(InvalidRequest, match="the same question"):
        distill(tiny_engine_dir, Never(), str(states), str(questions), tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.distill").exists()


def test_distill_cli_errors_are_one_line_and_write_nothing(tmp_path, tiny_engine_dir):
    states = tmp_path / "states.jsonl"
    states.write_text('"one"\n"two"\n')
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"q": to_wire(QUESTIONS["sky"])}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"one"\n7\n')
    base = [sys.executable, "-m", "onepass", "distill", "--engine", str(tiny_engine_dir), "--out",
            str(tmp_path / "out"), "--questions", str(questions)]
    for args, message in (([f"--teacher=http://127.0.0.1:{_port()}", "--states", str(states),
                            "--teacher-timeout", "1"], "gave no answer"),
                          (["--teacher", "http://x", "--states", str(bad)], "bad.jsonl:2"),
                          (["--teacher", "http://x", "--states", str(states), "--target-agreement", "1.5"],
                           "--target-agreement")):
        out = subprocess.run(base + args, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_openai_teacher_against_llama_cpp_server(tmp_path):
    """The OpenAI path against a real OpenAI-compatible server: llama-cpp-python's, on the default model's GGUF.
    llama-cpp-python builds from source (~9 min on 2 cores), so CI does not install it and this test is skipped
    there; `pip install 'llama-cpp-python[server]'` (CMAKE_ARGS="-DGGML_NATIVE=OFF") runs it."""
    pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is not installed")
    from onepass.export.model_source import default_gguf

    port = _port()
    log = tmp_path / "llama.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf()),
                                 "--port", str(port), "--n_ctx", "1024", "--logits_all", "true", "--n_threads", "2"],
                                stdout=fh, stderr=fh)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _ready(url) or proc.poll() is not None, seconds=180)
        assert proc.poll() is None, log.read_text()[-2000:]
        questions = {"refund": Noul("Does the customer ask for their money back?"),
                     "team": Choice("Which team should handle this?", {"billing": "payments, refunds",
                                                                        "technical": None, "sales": None})}
        state = "I was charged twice for my subscription this month. Please refund the second charge."
        with connect(url, "openai", model="smollm2", timeout_s=60) as client:
            got = client.probabilities(state, questions)
            answers = client.ask(state, questions)
        for q, p in got.items():
            assert p.shape == (2 if q == "refund" else 3,) and abs(p.sum() - 1) < 1e-9 and (p > 0).all()
            np.testing.assert_allclose(answer_distribution(questions[q], answers[q]), p, atol=1e-9)
        # the distribution is the endpoint's own: the same prompt's top log-probabilities, read directly
        messages, labels = openai_prompt(state, questions["team"])
        raw = httpx2.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 20}).json()
        top = raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        np.testing.assert_allclose(label_distribution(top, labels, noul=False), got["team"], atol=1e-6)
    finally:
        proc.terminate()
        proc.wait(30)


def _ready(url: str) -> bool:
    try:
        return httpx2.get(url + "/v1/models", timeout=2).status_code == 200
    except httpx2.HTTPError:
        return False


def test_a_teacher_found_down_is_skipped_for_a_doubling_cool_down_then_tried_again():
    from types import SimpleNamespace

    from onepass.runtime.server.metrics import Metrics
    from onepass.runtime.server.teaching import TeacherLink, TeacherSetup
    from onepass.runtime.core.cascade import Gate

    class Down:
        name, config, calls, up = "down", SimpleNamespace(max_concurrency=2), 0, False

        async def aprobabilities(self, state, questions, deadline=None):
            self.calls += 1
            if not self.up:
                raise TeacherUnavailable("connection refused")
            return {q: np.array([0.9, 0.1]) for q in questions}

        def close(self):
            pass

    now = [100.0]
    teacher, metrics = Down(), Metrics(None, lambda: 0)
    link = TeacherLink(TeacherSetup(teacher, gate=Gate(1.0)), metrics, clock=lambda: now[0])
    q = {"q": QUESTIONS["sky"]}

    def call():
        try:
            return asyncio.run(link._call("gate", "s", q, None))
        except TeacherUnavailable:
            return None

    outcomes = []
    for at in (100.0, 100.1, 100.6, 100.7, 101.7, 101.8):  # cool-downs 0.5 s, then 1 s
        now[0] = at
        before = teacher.calls
        call()
        outcomes.append(teacher.calls - before)
    assert outcomes == [1, 0, 1, 0, 1, 0]  # asked, skipped, asked after 0.5 s, skipped, asked after 1 s, skipped
    teacher.up = True
    now[0] = 104.0
    assert call() is not None and teacher.calls == 4
    now[0] = 104.01
    assert call() is not None and teacher.calls == 5  # back up: no cool-down
    assert metrics.teacher_calls.labels("gate", "circuit_open")._value.get() == 3
    link.close()


@pytest.fixture
def trickler():
    t = Trickler(0.3)
    yield t
    t.close()


def test_a_teacher_trickling_its_head_is_cut_at_the_deadline_and_at_each_attempts_limit(trickler):
    """httpx's timeouts are per read, so a byte every 0.3 s held a call for the head's length x 0.3 s; now the
    deadline, and without one each attempt's timeout, end it from outside the reads."""
    with connect(trickler.url, timeout_s=5.0, retries=2) as client:
        start = time.monotonic()
        with pytest.raises(TeacherLate, match="1 of 3 attempts"):
            client.probabilities("A state.", {"q": QUESTIONS["sky"]}, deadline=time.monotonic() + 1.0)
        assert time.monotonic() - start < 3  # a hang detector: about 1 s (the head alone takes 24 s)
    with connect(trickler.url, timeout_s=0.5, retries=1, backoff_s=0.01) as client:
        start = time.monotonic()
        with pytest.raises(TeacherUnavailable, match=r"2 of 2 attempts.*no whole answer within") as err:
            client.probabilities("A state.", {"q": QUESTIONS["sky"]})
        assert not isinstance(err.value, TeacherLate)  # its own timeout, not the caller's deadline
        assert time.monotonic() - start < 4


def test_cancel_ends_every_call_spawned_started_or_not(trickler):
    """A review found cancel() missed calls spawned but not yet started on the client's loop (19 of 20 escaped) and
    close() let them run on the closed client: both now cancel the calls' futures themselves."""
    with connect(trickler.url, timeout_s=30.0) as client:
        calls = [client.spawn(client.aprobabilities("A state.", {"q": QUESTIONS["sky"]}, time.monotonic() + 30))
                 for _ in range(20)]
        client.cancel()
        time.sleep(0.5)
        assert all(c.cancelled() for c in calls)
        late = client.spawn(client.aprobabilities("A state.", {"q": QUESTIONS["sky"]}, time.monotonic() + 30))
    assert late.cancelled()  # close() ended it too
    with pytest.raises(TeacherUnavailable, match="closed"):
        client.probabilities("A state.", {"q": QUESTIONS["sky"]})


def test_gate_mode_with_a_trickling_teacher_answers_every_request_locally_by_its_deadline(tiny_engine_dir, tmp_path,
                                                                                        trickler):
    """Deadlines of 1, 2 and 3 s got 503 'ready after the deadline' though the local answer was ready in 0.13 s,
    and the stuck calls held every gate slot for 40 s. Now each request is answered 200 before its deadline with
    the local answers, and every call is counted once: the first is cut at its cut-off (late, which opens the
    breaker: the teacher was too slow), the others skip the teacher at once (circuit_open), none waits for a slot."""
    from concurrent.futures import ThreadPoolExecutor

    log = tmp_path / "student.log"
    url, proc = serve_process(tiny_engine_dir, _port(), log, "--teacher", trickler.url, "--min-confidence", "1.0")
    try:
        want = {q: a.to_wire() for q, a in Engine.load(tiny_engine_dir).ask(STATES[8], QUESTIONS).items()}
        spans = []
        for seconds in (1, 2, 3):
            start = time.monotonic()
            response = _post(url, STATES[8], QUESTIONS, {"X-Request-Timeout": str(seconds)})
            spans.append(time.monotonic() - start - seconds)
            assert response.json()["answers"] == want
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: _post(url, STATES[8], QUESTIONS, {"X-Request-Timeout": "1"}), range(4)))
        text = httpx2.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    assert max(spans) < 0.3, spans  # answered before its deadline (the cut-off keeps a tenth of the time)
    outcomes = {o: _metric(text, "onepass_teacher_calls_total", mode="gate", outcome=o)
                for o in ("late", "skipped", "unavailable", "circuit_open", "ok", "cancelled")}
    assert outcomes["late"] >= 1 and outcomes["late"] + outcomes["circuit_open"] == 7, outcomes
    assert sum(outcomes.values()) == 7, outcomes
    assert "never retrieved" not in log.read_text() and "Traceback" not in log.read_text()


def test_shadow_calls_queued_while_the_teacher_is_down_are_asked_once_it_is_back(scripted):
    """The breaker opened and threw away every queued shadow call as circuit_open; now queued calls wait for its
    cool-down. The teacher fails its first call (503), then answers: one call unavailable, the other nine asked."""
    from onepass.runtime.server.metrics import Metrics
    from onepass.runtime.server.teaching import TeacherLink, TeacherSetup

    url, handler = scripted
    handler.script[:] = [(503, {}, b"{}"), (200, {}, NOUL_OK)]
    metrics = Metrics(None, lambda: 0)
    link = TeacherLink(TeacherSetup(connect(url, retries=0, max_concurrency=2), shadow_rate=1.0), metrics)
    try:
        from onepass.runtime.core.questions import NoulAnswer
        for _ in range(10):
            link.shadow("A state.", {"q": QUESTIONS["sky"]}, {"q": NoulAnswer(noul=0.8)})
        _wait_for(lambda: link._pending == 0, 30)
    finally:
        link.close()
    count = lambda o: metrics.teacher_calls.labels("shadow", o)._value.get()  # noqa: E731
    assert (count("unavailable"), count("ok"), count("circuit_open"), count("dropped")) == (1, 9, 0, 0)
    assert len(handler.seen) == 10


def test_distill_against_a_trickling_teacher_ends_within_its_bound_and_writes_nothing(tmp_path, tiny_engine_dir,
                                                                                     trickler):
    """It ran past 200 s (three states failed by 115 s, the rest still waited on); now each call ends within
    --teacher-timeout x 3 attempts and labelling stops at the third failed state, ending the calls under way."""
    states = tmp_path / "states.jsonl"
    states.write_text("".join(json.dumps(s) + "\n" for s in STATES))
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"q": to_wire(QUESTIONS["sky"])}))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "onepass", "distill", "--engine", str(tiny_engine_dir), "--out",
                          str(tmp_path / "out"), "--questions", str(questions), "--states", str(states),
                          "--teacher", trickler.url, "--teacher-timeout", "1"], capture_output=True, text=True,
                         timeout=300)
    took = time.monotonic() - start
    assert out.returncode == 2 and "gave no answer" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()
    assert took < 60, took  # a hang detector: 3 attempts x 1 s and the start-up (the bound at the defaults: 30 s)


def test_a_call_settled_after_its_caller_stopped_is_not_printed_and_other_errors_are(caplog):
    """A call that failed with a TeacherError as cancel() or close() ended it is never awaited by anyone; the client's
    loop does not print it as "Task exception was never retrieved" (distill's stderr once carried that traceback).
    Negative control: any other unretrieved error still reaches asyncio's log."""
    import asyncio
    import logging

    from onepass.runtime.teacher.client import TeacherUnavailable, _settled_calls_quiet

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            _settled_calls_quiet(loop, {"message": "Task exception was never retrieved",
                                        "exception": TeacherUnavailable("the teacher gave no answer")})
            assert caplog.text == ""
            _settled_calls_quiet(loop, {"message": "Task exception was never retrieved",
                                        "exception": ValueError("a bug")})
        assert "never retrieved" in caplog.text and "a bug" in caplog.text
    finally:
        loop.close()


@pytest.mark.slow
def test_distill_task_adds_the_student_beside_the_engine_with_its_measured_gate(tiny_engine_dir, teacher_url,
                                                                                tmp_path, capsys):
    """`onepass distill --task`: the teacher's labels (beside the engine, resumable) tune a task of a copy of the
    engine, whose own files do not change; the task's agreement and gate are measured on held-out states and recorded
    in its card; the engine answers the task's questions."""
    import hashlib

    from onepass.cli import main
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core import task_store

    engine = tmp_path / "engine"
    mf.copy_engine(tiny_engine_dir, engine)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine.iterdir() if p.is_file()}
    states, questions = tmp_path / "states.jsonl", tmp_path / "q.json"
    states.write_text("".join(json.dumps(s) + "\n" for s in STATES))
    questions.write_text(json.dumps({q: to_wire(QUESTIONS[q]) for q in ("sky", "fish")}))
    assert main(["distill", "--engine", str(engine), "--teacher", teacher_url, "--states", str(states),
                 "--questions", str(questions), "--task", "facts", "--target-agreement", "0.9", "--holdout", "0.25",
                 "--rank", "2", "--train-blocks", "1", "--epochs", "3", "--batch-questions", "4", "--lr", "1e-2",
                 "--keep-base"]) == 0
    printed = capsys.readouterr().out
    assert "task 'facts'" in printed and "recorded in the task's card" in printed, printed
    card = task_store.read_card(engine, "facts")
    measured = card["distill"]["measured"]
    assert card["distill"]["target_agreement"] == 0.9 and measured["held_out_questions"] == 8
    assert 0.0 <= measured["agreement"] <= 1.0 and card["distill"]["teacher"]
    assert len((tmp_path / "engine.facts.distill" / "labels.jsonl").read_text().splitlines()) == 32
    assert before == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in engine.iterdir() if p.is_file()}
    with Engine.load(engine) as served:
        assert served.tasks.names == ("facts",)
        served.ask(STATES[0], {"q": Noul("Is the sky blue on a clear day?", task="facts")})
    assert main(["distill", "--engine", str(engine), "--teacher", teacher_url, "--states", str(states),
                 "--questions", str(questions), "--task", "facts", "--out", str(tmp_path / "x")]) != 0
