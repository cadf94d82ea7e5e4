"""onepass on Ray Serve, measured on this machine: 1 vs 3 replicas, state-affine vs Serve's default routing,
and the cost of one replica failover. Writes benchmarks/results/cluster.{json,md}.

Workload: requests about 20 states (a ticket-like text each, one noul question), the state of each request
drawn at random. Closed loop (8 senders) gives requests/s at saturation; open loop (Poisson arrivals, latency
from the intended send time, the loadgen of `onepass bench`) gives p50/p99 at a fixed offered rate.

    python benchmarks/cluster.py --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from onepass.runtime.core.guarantee import cpu_model  # noqa: E402
from onepass.runtime.tools.loadgen import closed_loop, open_loop  # noqa: E402
from onepass.runtime.server.cluster import build  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STATES = [f"Ticket {i}: the customer writes about order {1000 + i}, item {i * 7}, which arrived late and damaged; "
          f"they want to know what happens next and whether the courier will collect it." for i in range(20)]
BODY = {"q": {"type": "noul", "instructions": "Is the customer asking about a delivery?"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """Sends requests about random states; remembers which replica answered and whether it was a cache hit."""

    def __init__(self, base: str, seed: int = 0):
        self.base, self.rng, self.lock = base, random.Random(seed), threading.Lock()
        self.log: list = []  # (monotonic time, state index, replica, hit|miss, seconds)

    def send(self) -> None:
        with self.lock:
            i = self.rng.randrange(len(STATES))
        t0 = time.monotonic()
        req = urllib.request.Request(self.base + "/v1/systemone", json.dumps({"state": STATES[i], "questions": BODY})
                                     .encode(), {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            entry = (t0, i, resp.headers["x-onepass-replica"], resp.headers["x-onepass-state-cache"],
                     time.monotonic() - t0)
        with self.lock:
            self.log.append(entry)

    def hit_rate(self) -> float:
        return sum(e[3] == "hit" for e in self.log) / max(1, len(self.log))


def deploy(engine: str, replicas: int, routing: str) -> None:
    serve.delete("onepass")
    serve.run(build({"engine": engine, "replicas": replicas, "routing": routing, "cpus_per_replica": 1,
                     "engine_config": {"threads": 1}, "server": {"request_timeout_s": 60.0}}),
              name="onepass", route_prefix="/")


def measure(base: str, engine: str, replicas: int, routing: str, rate: float, seconds: float) -> dict:
    deploy(engine, replicas, routing)
    closed = Client(base, seed=1)
    sat = closed_loop(closed.send, concurrency=8, duration=seconds).summary()
    deploy(engine, replicas, routing)  # fresh caches for the open-loop run
    opened = Client(base, seed=2)
    lat = open_loop(opened.send, rate=rate, duration=seconds, senders=32).summary()
    return {"replicas": replicas, "routing": routing, "closed": sat, "open": lat,
            "hit_rate_closed": closed.hit_rate(), "hit_rate_open": opened.hit_rate(),
            "replicas_seen": len({e[2] for e in closed.log})}


def failover(base: str, engine: str, rate: float, seconds: float) -> dict:
    """Open loop over 3 state-affine replicas; one replica is SIGKILLed a third of the way in."""
    deploy(engine, 3, "state")
    client = Client(base, seed=3)
    killed: dict = {}

    def killer():
        time.sleep(seconds / 3)
        with client.lock:
            victim = client.log[-1][2]
        killed.update(at=time.monotonic(), replica=victim)
        os.kill(int(victim.split(":")[1]), signal.SIGKILL)

    thread = threading.Thread(target=killer)
    thread.start()
    run = open_loop(client.send, rate=rate, duration=seconds, senders=32).summary()
    thread.join()
    after = [e for e in client.log if e[0] >= killed["at"]]
    moved = [e for e in after if e[2] != killed["replica"] and any(
        b[1] == e[1] and b[2] == killed["replica"] for b in client.log if b[0] < killed["at"])]
    first_moved = {}
    for e in sorted(moved):
        first_moved.setdefault(e[1], e)
    before = [e[4] for e in client.log if e[0] < killed["at"]]
    new = {e[2] for e in after} - {e[2] for e in client.log if e[0] < killed["at"]}
    return {"open": run, "killed": killed["replica"], "requests_after_kill": len(after),
            "states_moved": len(first_moved),
            "median_ms_before": 1000 * sorted(before)[len(before) // 2],
            "first_request_of_moved_states_ms": sorted(1000 * e[4] for e in first_moved.values()),
            "misses_after_kill": sum(e[3] == "miss" for e in after), "replacement_seen": sorted(new)}


def write_md(out: dict) -> None:
    lines = [f"# onepass on Ray Serve ({out['machine']['when']}, {out['machine']['cpu']}, {out['machine']['cores']} "
             "cores)", "",
             "CPU-bound: every replica runs on the same 2 cores with one ONNX Runtime thread, so one replica uses one "
             "core and three use both (hence their higher throughput here, and nothing beyond 2x is possible); on a "
             "multi-node cluster each replica brings its own cores. Workload: 20 states, one noul question per "
             "request, state drawn at "
             f"random; closed loop with 8 senders for {out['seconds']:.0f} s; open loop (Poisson, latency from the "
             f"intended send time) at {out['rate']:g} requests/s for {out['seconds']:.0f} s; fresh replicas for "
             "each run. Hit rates include each state's first request (a miss wherever it lands): the open loop's "
             f"~{out['rate'] * out['seconds']:.0f} requests over 20 states cap it near "
             f"{1 - 20 / (out['rate'] * out['seconds']):.2f}.", "",
             "| replicas | routing | closed: requests/s | closed: p50 ms | closed: p99 ms | open: p50 ms | "
             "open: p99 ms | failures | state-cache hit rate (closed / open) |", "|---" * 9 + "|"]
    for r in out["runs"]:
        c, o = r["closed"], r["open"]
        fails = sum(c["failures"].values()) + sum(o["failures"].values())
        lines.append(f"| {r['replicas']} | {r['routing']} | {c['throughput']:.1f} | {c['p50']:.0f} | {c['p99']:.0f} | "
                     f"{o['p50']:.0f} | {o['p99']:.0f} | {fails} | {r['hit_rate_closed']:.3f} / "
                     f"{r['hit_rate_open']:.3f} |")
    f = out["failover"]
    lines += ["", "## One replica killed (SIGKILL) a third of the way into an open-loop run (3 replicas, state-affine)",
              "", f"- failed requests: {sum(f['open']['failures'].values())} of {f['open']['requests']} "
              "(requests in flight on the dead replica are retried by the ingress on the ring's next replica)",
              f"- the dead replica's states answered elsewhere after the kill: {f['states_moved']}; cache misses "
              f"after the kill: {f['misses_after_kill']} (a moved state prefills once on its new replica; a "
              "replacement that joins the ring takes some states over and prefills them once)",
              f"- first request of each moved state: {', '.join(f'{x:.0f}' for x in f['first_request_of_moved_states_ms'])} "
              f"ms, against a median of {f['median_ms_before']:.0f} ms before the kill",
              f"- whole run: p50 {f['open']['p50']:.0f} ms, p99 {f['open']['p99']:.0f} ms, max {f['open']['max']:.0f} ms",
              f"- replacement replica answering within the run: {'yes' if f['replacement_seen'] else 'no'}"]
    (RESULTS / "cluster.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rate", type=float, default=8.0, help="open-loop requests/s")
    args = ap.parse_args()
    engine = str(Path(args.engine).resolve())
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        runs = [measure(base, engine, n, routing, args.rate, args.seconds)
                for n, routing in ((1, "state"), (3, "state"), (3, "default"))]
        fo = failover(base, engine, args.rate, args.seconds * 2)
    finally:
        serve.shutdown()
        ray.shutdown()
    cpu = cpu_model() or ""
    out = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                       "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
           "seconds": args.seconds, "rate": args.rate, "runs": runs, "failover": fo}
    (RESULTS / "cluster.json").write_text(json.dumps(out, indent=2) + "\n")
    write_md(out)


if __name__ == "__main__":
    sys.exit(main())
