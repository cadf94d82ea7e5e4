"""Memory goes back after heavy requests (runtime/server/memory.py, Backend.release_memory).

The policy with a fake RSS: an idle server releases its backend's working memory only when its resident size
(RSS less the state cache's bytes, which the operator sized) is above 1.2x its warm size, and counts it; the
OpenVINO release itself on the tiny engine: a new compiled model, the same answers, a new infer request per
thread. The measured figures (a 1000-option choice on SmolLM2) are in benchmarks/studies/results/memory_options.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from onepass import Choice, Engine, Noul
from onepass.runtime.server.memory import MemoryFloor

MB = 1 << 20


class _Cache:
    def __init__(self):
        self.bytes = 0


class _Engine:
    def __init__(self, releases: bool = True):
        self.cache, self.releases, self.asked = _Cache(), releases, 0

    def release_memory(self) -> bool:
        self.asked += 1
        return self.releases


def _floor(engine, rss: list) -> MemoryFloor:
    counted = []
    floor = MemoryFloor(engine, rss=lambda: rss[0], on_release=lambda: counted.append(1), background=False)
    floor.counted = counted
    return floor


def test_release_only_above_the_factor_of_the_warm_resident_size():
    engine, rss = _Engine(), [1000 * MB]
    floor = _floor(engine, rss)
    assert not floor.on_idle() and engine.asked == 0  # not warm yet: nothing to compare with
    floor.mark()
    rss[0] = 1200 * MB  # exactly 1.2x: kept
    assert not floor.on_idle() and engine.asked == 0
    rss[0] = 1201 * MB
    assert floor.on_idle() and engine.asked == 1 and floor.releases == 1 and floor.counted == [1]


def test_the_state_caches_are_not_counted_as_growth():
    engine, cascade, rss = _Engine(), _Engine(), [1000 * MB]
    floor = MemoryFloor([engine, cascade, None], rss=lambda: rss[0], background=False)
    floor.mark()
    rss[0], engine.cache.bytes, cascade.cache.bytes = 1500 * MB, 300 * MB, 100 * MB  # the caches grew, nothing else
    assert not floor.on_idle() and engine.asked == 0
    engine.cache.bytes = 100 * MB  # 1300 MB resident: both engines are asked
    assert floor.on_idle() and engine.asked == 1 and cascade.asked == 1


def test_a_release_that_cannot_reach_the_floor_is_not_repeated_on_every_idle_moment():
    """Memory no backend can give back (here: nothing is freed) raises the limit to 1.2x what the release left:
    the next release waits for that much more growth (it used to recompile on every idle moment)."""
    engine, rss = _Engine(), [1000 * MB]
    floor = _floor(engine, rss)
    floor.mark()
    rss[0] = 1300 * MB
    assert [floor.on_idle() for _ in range(5)] == [True, False, False, False, False] and engine.asked == 1
    rss[0] = 1561 * MB  # past 1.2 x 1300
    assert floor.on_idle() and engine.asked == 2


def test_unknown_rss_releases_nothing():
    engine = _Engine()
    floor = _floor(engine, [0])  # no /proc: rss_bytes() is 0
    floor.mark()
    assert floor.floor is None and not floor.on_idle() and engine.asked == 0


def test_a_backend_with_nothing_to_release_is_not_counted():
    engine, rss = _Engine(releases=False), [1000 * MB]
    floor = _floor(engine, rss)
    floor.mark()
    rss[0] = 3000 * MB
    assert floor.on_idle() and engine.asked == 1 and floor.releases == 0 and floor.counted == []


def test_the_release_runs_beside_the_engine_thread():
    """In the server the release runs on a thread of its own: on_idle returns at once, one release at a time."""
    import threading

    gate = threading.Event()

    class Slow(_Engine):
        def release_memory(self):
            gate.wait(30)
            return super().release_memory()

    engine, rss = Slow(), [1000 * MB]
    floor = MemoryFloor(engine, rss=lambda: rss[0])
    floor.mark()
    rss[0] = 2000 * MB
    assert floor.on_idle() and not floor.on_idle()  # started, and not twice while it runs
    gate.set()
    floor.wait(30)
    assert engine.asked == 1 and floor.releases == 1


def test_openvino_release_rebuilds_the_model_and_keeps_every_answer(tiny_engine_dir):
    pytest.importorskip("openvino")
    engine = Engine.load(tiny_engine_dir, backend="openvino-cpu", verify=False)
    questions = {"q": Noul("Is it billing?"), "c": Choice("Which team?", {f"o{i}": None for i in range(40)})}
    state = "I was charged twice for my subscription. " * 10

    def probabilities():
        wire = {k: a.to_wire() for k, a in engine.ask(state, questions).items()}
        return np.array([wire["q"]["noul"], *wire["c"]["probabilities"].values()])

    before, compiled, request = probabilities(), engine.backend.compiled, engine.backend._request()
    engine.cache.clear()  # the passes run again, on the new model
    assert engine.release_memory() is True
    assert engine.backend.compiled is not compiled
    np.testing.assert_allclose(probabilities(), before, rtol=0, atol=1e-6)
    mine = engine.backend._request()
    assert mine is engine.backend._request() and mine is not request  # this thread's request, of the new model


def test_other_backends_have_nothing_to_release(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    engine.ask("A ticket.", {"q": Noul("Is it billing?")})
    assert engine.release_memory() is False
