"""onepass on Ray Serve: a real local Ray cluster on loopback, three engine replicas.

What is proven: requests about one state stay on one replica (hit rate >= 0.9; Serve's default router,
same traffic, clearly lower), the official SDK gets the answers Engine.ask gives, the HTTP API is the
server's (errors, limits, compressed bodies, models, metrics aggregated over replicas), and a replica
killed with SIGKILL mid-run costs no client request and re-prefills only the states it held.
Everything is bounded: fixed request counts, timeouts on every wait, Ray shut down at the end. The Ray driver runs
in a process of its own (tests/ray_driver.py), as a user's `onepass cluster` does: a driver inside the pytest
worker left gRPC threads behind and the fault signals at their default actions, so a later fault killed the worker
silently.

Every deployment here, and the `onepass cluster` command, serves the tiny random Llama (SmolLM2's architecture and
real tokenizer, exported through the same path): what they prove does not depend on the weights, and a request
costs milliseconds instead of a SmolLM2 pass, so the 400 routed requests and the replica kill take seconds, not
minutes. The module needs no SmolLM2 export, so under pytest-xdist it runs while another worker exports.
"""

from __future__ import annotations

import gzip
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

import test_server  # noqa: E402
from ray_driver import REPLY  # noqa: E402
from test_server import QUESTIONS, TICKET, _free_port, get, sdk_client  # noqa: E402

from onepass import Choice, Engine, Noul, Score  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
STATES = [f"Ticket {i}: the customer writes about order {1000 + i} and the delivery of item {i * 7}." for i in range(20)]
ROUNDS = 10
ASK = {"q": {"type": "noul", "instructions": "Is the customer asking about a delivery?"}}
KEY = "test-key"  # every deployment requires it; the SDK helper sends it
AUTH = {"Authorization": f"Bearer {KEY}"}
TOL = 1e-5  # replicas run ONNX Runtime on one thread, the reference on its default: summation order differs


def _status(base: str, path: str) -> int:
    """The status of a GET, 0 while nothing listens."""
    try:
        return get(base, path)[0]
    except OSError:
        return 0


def _session(sid: int) -> list[str]:
    """Processes of session ``sid`` still running (zombies excluded), as "pid name"."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            if int(rest[3]) == sid and rest[0] != "Z":
                out.append(f"{entry.name} {name}")
    return out


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["sigint-background-job", "sigterm"])
def test_the_cluster_command_serves_and_stops_cleanly(tiny_engine_dir, tmp_path, capsys, stop):
    """`onepass cluster` as a user runs it (its own Ray instance; this test runs before the module's cluster): it
    answers over HTTP, and stops with status 0 leaving no process behind (its session is empty: Ray's dashboard and
    runtime-env agents used to outlive ray.shutdown(), and SIGTERM killed it before any cleanup) on SIGTERM (what
    containers and process managers send) and on SIGINT even when started as a script's background job (SIGINT
    inherited ignored; it used to stay ignored). Bad settings are one-line errors, refused before Ray starts
    (checked in this process: no Ray instance is left behind by them)."""
    from onepass.cli import main

    for args, message in ((["--engine", str(tmp_path)], "holds no engine"),
                          (["--engine", str(tiny_engine_dir), "--autoscale", "4"], "MIN:MAX")):
        assert main(["cluster", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not ray.is_initialized()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "onepass", "cluster", "--engine", str(tiny_engine_dir), "--replicas", "1",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` in a script
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while _status(base, "/readyz") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "onepass cluster did not become ready"
            time.sleep(0.5)
        status, headers, body = test_server.post(base, {"state": STATES[0], "questions": ASK})
        assert status == 200 and headers["x-onepass-replica"] and 0 <= body["answers"]["q"]["noul"] <= 1
        assert len(_session(proc.pid)) > 3  # the driver, raylet, GCS, agents, replicas
    finally:
        proc.send_signal(stop)
        try:
            rc = proc.wait(timeout=120)
        finally:
            left = _session(proc.pid)
            for line in left:
                os.kill(int(line.split()[0]), signal.SIGKILL)
    assert rc == 0 and proc.stdout.read().rstrip().endswith("onepass cluster: stopped")
    assert left == []


class RayDriver:
    """tests/ray_driver.py in its own process (see there why): commands as JSON lines, every answer awaited with a
    timeout; its stderr (Ray's and Serve's messages) goes to a log that a failed command quotes."""

    def __init__(self, port: int, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ray_driver.py")), str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        self._lines = queue.Queue()  # stdout's lines, then None at its end
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def answer(self, timeout: float):
        """The next reply's value; the driver's exit, a timeout or an error reply fails the test."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the Ray driver gave no answer in {timeout:.0f} s: {self._log_tail()}")
            if line is None:
                pytest.fail(f"the Ray driver exited ({self.proc.wait(timeout=30)}): {self._log_tail()}")
            if line.startswith(REPLY):
                message = json.loads(line[len(REPLY):])
                assert "error" not in message, message["error"]
                return message["ok"]

    def _log_tail(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def call(self, op: str, timeout: float = 240, **fields):
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # the driver shuts Serve and Ray down
            self.proc.wait(timeout=120)
        except Exception:  # noqa: BLE001 - a driver that does not stop is killed
            self.proc.kill()
            self.proc.wait(timeout=30)
        finally:
            self._err.close()


@pytest.fixture(scope="module")
def ray_driver(tmp_path_factory):
    """A local Ray cluster (logical CPUs only; the machine's 2 cores are shared) with Serve's HTTP proxy on a free
    loopback port, driven from its own process; shut down at the end."""
    port = _free_port()
    driver = RayDriver(port, tmp_path_factory.mktemp("ray") / "driver.log")
    try:
        driver.answer(timeout=240)  # "ready"
        yield driver
    finally:
        driver.close()
    assert not ray.is_initialized()  # this process never hosted a Ray driver


@pytest.fixture(scope="module")
def cluster(ray_driver):
    """The cluster's base URL."""
    return ray_driver.url


def post(base: str, body, headers: dict | None = None, raw: bytes | None = None):
    """test_server's POST with the API key."""
    return test_server.post(base, body, {**AUTH, **(headers or {})}, raw=raw)


def deploy(driver: RayDriver, engine_dir, routing: str, replicas: int = 3):
    """A fresh application (new replicas, empty caches) routed by ``routing``."""
    driver.call("deploy", args={"engine": str(engine_dir), "replicas": replicas, "routing": routing,
                                "cpus_per_replica": 1, "engine_config": {"threads": 1},
                                "server": {"request_timeout_s": 60.0, "api_key": KEY}})


def replica_ids(driver: RayDriver) -> set:
    """The live engine replicas' ids."""
    return set(driver.call("replicas", timeout=60))


def ask(base: str, state: str) -> tuple:
    """(replica "id:pid", 'hit'|'miss') of one request about ``state``; any status but 200 fails the test."""
    status, headers, body = post(base, {"state": state, "questions": ASK})
    assert status == 200, body
    return headers["x-onepass-replica"], headers["x-onepass-state-cache"]


def traffic(base: str) -> list:
    """ROUNDS requests about each of the STATES, interleaved: [(state index, replica, cache)]."""
    return [(i, *ask(base, STATES[i])) for _ in range(ROUNDS) for i in range(len(STATES))]


def hit_rate(log: list) -> float:
    return sum(cache == "hit" for _, _, cache in log) / len(log)


@pytest.fixture(scope="module")
def sticky(cluster, ray_driver, tiny_engine_dir):
    deploy(ray_driver, tiny_engine_dir, "state")
    return cluster


def test_sdk_against_the_cluster_equals_engine_ask(sticky, tiny_engine_dir):
    from typesafe_sdk import Choice as SChoice, Noul as SNoul, Score as SScore

    with sdk_client(sticky) as client:
        result = client.system_one(state=TICKET, questions={
            "refund": SNoul(instructions=QUESTIONS["refund"]["instructions"]),
            "team": SChoice(instructions=QUESTIONS["team"]["instructions"], criteria=QUESTIONS["team"]["criteria"]),
            "mood": SScore(instructions=QUESTIONS["mood"]["instructions"], criteria=QUESTIONS["mood"]["criteria"]),
        })
        names = [m.name for m in client.models.list().models]
    with Engine.load(tiny_engine_dir) as engine:
        want = engine.ask(TICKET, {"refund": Noul(QUESTIONS["refund"]["instructions"]),
                                   "team": Choice(QUESTIONS["team"]["instructions"], QUESTIONS["team"]["criteria"]),
                                   "mood": Score(QUESTIONS["mood"]["instructions"], QUESTIONS["mood"]["criteria"])})
        assert engine.name in names and "jev-latest" in names
    answers = result.answers
    assert answers["refund"].noul == pytest.approx(want["refund"].noul, abs=TOL)
    assert answers["team"].choice == want["team"].choice
    assert answers["team"].probabilities == pytest.approx(want["team"].probabilities, abs=TOL)
    assert answers["mood"].score == pytest.approx(want["mood"].score, abs=TOL)
    # negative control: a different state's answer is not within the tolerance
    with sdk_client(sticky) as client:
        other = client.system_one(state="The weather is lovely today.", questions={
            "refund": SNoul(instructions=QUESTIONS["refund"]["instructions"])}).answers["refund"].noul
    assert abs(other - want["refund"].noul) > TOL


def test_the_cluster_speaks_the_servers_http_api(sticky):
    status, _, body = test_server.post(sticky, {"state": "text", "questions": ASK})  # no API key
    assert status == 401 and "API key" in body["error"]["message"]
    status, headers, body = post(sticky, {"state": "text", "questions": {"q": {"type": "maybe"}}})
    assert status == 422 and body["error"]["field"] and headers["x-onepass-replica"]
    status, _, body = post(sticky, None, raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    packed = gzip.compress(json.dumps({"state": STATES[0], "questions": ASK}).encode())
    status, headers, body = post(sticky, None, {"Content-Encoding": "gzip"}, raw=packed)
    assert status == 200 and 0 <= body["answers"]["q"]["noul"] <= 1
    status, _, body = post(sticky, None, raw=b" " * (2 << 20))  # over max_body_bytes: refused by the ingress
    assert status == 413 and "at most" in body["error"]["message"]
    assert get(sticky, "/healthz")[0] == 200
    status, _, limits = get(sticky, "/v1/limits", AUTH)
    assert status == 200 and json.loads(limits)["max_questions"] >= 1


STICKY_MIN = 0.9  # state-affine hit rate: only each state's first request may miss (20 of 200)


def test_state_affine_routing_keeps_each_state_on_one_replica(sticky):
    log = traffic(sticky)
    owners = {i: {replica for j, replica, _ in log if j == i} for i in range(len(STATES))}
    assert all(len(r) == 1 for r in owners.values()), owners
    assert len(set().union(*owners.values())) == 3, "20 states should spread over all 3 replicas"
    sticky_rate = hit_rate(log)
    print(f"state cache hit rate, state-affine: {sticky_rate:.3f}")
    assert sticky_rate >= STICKY_MIN
    status, _, text = get(sticky, "/metrics")  # every replica's counters, summed, and per-replica cache counts
    text = text.decode()
    assert status == 200 and text.count('onepass_cluster_state_cache_total{replica=') >= 3
    served = sum(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith('onepass_requests_total{') and 'status="200"' in line)
    assert served >= len(log)


def test_a_replica_killed_mid_run_costs_no_request(sticky, ray_driver):
    """On the state-affine deployment (its states already prefilled by the traffic above, or by the first ask
    here when run alone): the last test of ``sticky``, which it leaves with a replacement replica."""
    cluster = sticky
    owner = {i: ask(cluster, s)[0] for i, s in enumerate(STATES)}  # each state prefilled on its owner
    before = replica_ids(ray_driver)
    victim = owner[0]
    requests = len(STATES) * 12

    def one(k: int):
        i = k % len(STATES)
        return (i, *ask(cluster, STATES[i]))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, k) for k in range(requests)]
        deadline = time.monotonic() + 120
        while sum(f.done() for f in futures) < requests // 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(int(victim.split(":")[1]), signal.SIGKILL)  # mid-run: requests are in flight
        killed_after = sum(f.done() for f in futures)
        log = [f.result(timeout=120) for f in futures]  # a failed request fails the test here
    assert killed_after < requests

    deadline = time.monotonic() + 120
    while not (replica_ids(ray_driver) - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    new = replica_ids(ray_driver) - before
    assert new, "Serve should have started a replacement replica"
    for i, replica, cache in log:
        if replica == owner[i]:
            assert cache == "hit", (i, replica)  # never prefilled again where it was
        else:  # moved: only the dead replica's states, or to the replacement once it joined the ring
            assert owner[i] == victim or replica.split(":")[0] in new, (i, owner[i], replica)
    victims = {i for i in owner if owner[i] == victim}
    assert {i for i, replica, _ in log if replica != owner[i] and owner[i] == victim} == victims
    metrics = get(cluster, "/metrics")[2].decode()
    retried = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("onepass_cluster_retries_total"))
    print(f"replica kill: {requests} requests, 0 failed, {retried:.0f} retried; {len(victims)} of {len(STATES)} "
          "states moved")


def test_serves_default_router_spreads_states_and_misses_the_cache(cluster, ray_driver, tiny_engine_dir):
    """The control for the state-affine test: the same traffic over Serve's default router (power of two
    choices), on a fresh deployment, sends states to several replicas and hits the cache clearly less often
    (measured 0.70 against 0.905). Replaces the state-affine deployment, so it runs after every test of it."""
    deploy(ray_driver, tiny_engine_dir, "default")
    spread = traffic(cluster)
    default_rate = hit_rate(spread)
    print(f"state cache hit rate, Serve's default router: {default_rate:.3f}")
    assert default_rate < STICKY_MIN - 0.1
    assert any(len({r for j, r, _ in spread if j == i}) > 1 for i in range(len(STATES)))


def test_the_serve_deploy_config_builds_the_application(tmp_path):
    """docker/ray-serve.yaml is a valid Serve config whose import path and args build the application."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from onepass.runtime.server.cluster import build

    config = yaml.safe_load((Path(__file__).parent.parent / "docker" / "ray-serve.yaml").read_text())
    app = ServeDeploySchema.model_validate(config).applications[0]
    assert app.import_path == "onepass.runtime.server.cluster:build"
    assert build(app.args) is not None
    with pytest.raises(ValueError, match="routing"):
        build({**app.args, "routing": "random"})
    app.args["metrics_dir"] = str(tmp_path)  # built below without a temporary folder each
    with pytest.raises(ValueError, match="cache_mib"):  # the engine's settings are checked before any replica starts
        build({**app.args, "engine_config": {"cache_mib": -1}})
    legacy = {k: v for k, v in app.args.items() if k != "engine_config"}  # a deploy file from before engine_config
    with pytest.raises(ValueError, match="threads"):
        build({**legacy, "threads": -1})
    assert build({**legacy, "threads": 1, "cache_mib": 256}) is not None
    with pytest.raises(ValueError, match="threads given both"):
        build({**app.args, "threads": 2})
    from onepass.runtime.server.cluster import replica_engine_config

    assert replica_engine_config({"engine_config": {"cache_mib": 64}}) == {"threads": 1, "cache_mib": 64}
    assert replica_engine_config({"engine_config": None, "threads": 2}) == {"threads": 2}
