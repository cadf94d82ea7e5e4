"""A request is prepared once (``Engine.prepare``): its state tokenised once per request and its questions once per
question set (a set asked again is found compiled), on every path in (HTTP, ``AsyncEngine``, ``run_many``, where a
state text the batch shares is tokenised once for it), never on the engine thread, and a merged pass that fails never
tokenises anything again.

The tokenizer's two entry points (``PromptEncoder.state`` and ``PromptEncoder.question``) are counted, with the
thread that called them. The negative control: the same counter sees the questions tokenised again once the
compiled sets are dropped (``engine.question_sets.clear()``)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import pytest

from onepass import Choice, Engine, Noul
from onepass.runtime.core.questions import to_wire

pytest.importorskip("fastapi")

from test_server import running  # noqa: E402

STATES = ["The parcel arrived late and the box was damaged.", "I was charged twice for one order."]
QUESTIONS = {"late": Noul("Is the parcel late?"), "team": Choice("Which team?", {"billing": None, "shipping": None})}


class _Count:
    """Counts calls of an encoder's ``state`` and ``question``, by thread name."""

    def __init__(self, engine: Engine, monkeypatch):
        self.calls: list = []
        encoder = engine.encoder
        for name in ("state", "question"):
            real = getattr(encoder, name)

            def counted(value, _real=real, _name=name):
                self.calls.append((_name, threading.current_thread().name))
                return _real(value)

            monkeypatch.setattr(encoder, name, counted)

    def of(self, kind: str) -> int:
        return sum(1 for k, _ in self.calls if k == kind)


@pytest.fixture
def tiny(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    yield engine
    engine.close()


def test_run_many_tokenises_each_request_once_and_a_failed_merge_never_again(tiny, monkeypatch):
    count = _Count(tiny, monkeypatch)
    requests = [(s, {f"{q}{i}": v for q, v in QUESTIONS.items()}) for i, s in enumerate(STATES * 2)]
    results = tiny.run_many(requests)
    assert all(not isinstance(r, Exception) for r in results)
    assert count.of("state") == 2 and count.of("question") == 8  # one per state text of the batch, one per question
    real = tiny.runner.score
    calls = []

    def merged_fails(state, jobs, clock=None, deadline=None):  # the merged pass fails once; alone they pass
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("a device fault in the merged pass")
        return real(state, jobs, clock, deadline)

    monkeypatch.setattr(tiny.runner, "score", merged_fails)
    count.calls.clear()
    results = tiny.run_many([(STATES[0], {"a": QUESTIONS["late"]}), (STATES[0], {"b": QUESTIONS["team"]})])
    assert all(not isinstance(r, Exception) for r in results) and calls == [2, 1, 1]
    assert count.of("state") == 1 and count.of("question") == 2  # the re-runs tokenised nothing
    count.calls.clear()
    prepared = tiny.prepare(STATES[0], QUESTIONS)
    tiny.run(STATES[0], QUESTIONS)  # compiled a second time: now kept
    tiny.run(STATES[0], QUESTIONS)  # found compiled
    assert prepared.packed_tokens > 0 and count.of("question") == 4
    tiny.question_sets.clear()
    tiny.run(STATES[0], QUESTIONS)  # the control: without the compiled set it is tokenised again, and counted
    assert count.of("question") == 6


def test_async_engine_tokenises_off_the_engine_thread_once(tiny, monkeypatch):
    from onepass.runtime.server.embed import AsyncEngine

    count = _Count(tiny, monkeypatch)

    async def main():
        async with AsyncEngine(tiny, window_ms=200) as engine:
            return await asyncio.gather(*(engine.ask(s, QUESTIONS) for s in STATES * 2))

    for _ in range(2):  # compiled twice here: kept
        tiny.prepare(STATES[0], QUESTIONS)
    count.calls.clear()
    assert len(asyncio.run(main())) == 4
    assert count.of("state") == 4 and count.of("question") == 0  # each state once; the set found compiled
    assert not any(thread == "onepass-engine" for _, thread in count.calls)


def test_http_tokenises_each_request_once_off_the_engine_thread(tiny, monkeypatch):
    with running(tiny) as base:
        count = _Count(tiny, monkeypatch)
        for state in STATES + STATES[:1]:
            body = {"state": state, "questions": {q: to_wire(v) for q, v in QUESTIONS.items()}}
            req = urllib.request.Request(base + "/v1/systemone", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
    assert count.of("state") == 3 and count.of("question") == 4  # compiled twice, then kept: the third found it
    assert not any(thread == "onepass-engine" for _, thread in count.calls)
