"""Hostile requests against a real `onepass serve` process over loopback: status, time, RSS, harm to others.

    python benchmarks/hardening.py --engine engines/smollm2 [--label after] [--python .venv/bin/python]

Starts the server as a subprocess (its RSS its own; address space capped, 6 GiB by default, so a runaway
allocation fails instead of taking the machine down), then:

1. each hostile request once, with 10 valid requests in flight beside it: status, seconds,
   server RSS after, and whether the valid requests got 200 with their answers unchanged;
2. 100 hostile requests (the list, cycled): RSS after vs after warm-up;
3. 1,000 GETs to unknown paths: /metrics series and page size;
4. a burst of 120 concurrent requests (distinct states, 4 questions each) with the default 10 s
   deadline, then again with ``X-Request-Timeout: 2``: statuses and the waits of accepted
   requests (client-side, from send to answer).

Writes benchmarks/results/hardening_<label>.json; ``--report`` merges before/after into hardening.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

from onepass.runtime.server.memory import rss_bytes

RESULTS = Path(__file__).resolve().parent / "results"
NOUL = {"type": "noul", "instructions": "Does the customer ask for a refund?"}
TICKET = "I was charged twice for my subscription this month. Please refund the second payment."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    return rss_bytes(pid) / 2**20


def post(url: str, raw: bytes, headers: dict | None = None, timeout: float = 120):
    """(status, seconds, body bytes) of one POST; never raises on HTTP errors; status 0 on a dropped connection."""
    req = urllib.request.Request(url + "/v1/systemone", data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, time.perf_counter() - start, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, time.perf_counter() - start, err.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, time.perf_counter() - start, b""


def body(state=TICKET, questions=None, **extra) -> bytes:
    return json.dumps({"model": "jev-latest", "state": state, "questions": questions or {"r": NOUL}, **extra}).encode()


def hostile() -> dict:
    """The hostile requests: name -> (raw body, headers)."""
    nested = b'{"a": ' * 960 + b"1" + b"}" * 960  # written out: json.dumps itself would recurse too deeply
    deep = body(questions={"q": {"type": "noul", "instructions": "N"}}).replace(b'"N"', nested)
    gz = gzip.compress(body())
    zs = zstandard.ZstdCompressor(write_checksum=True).compress(body() * 1)
    return {
        "instructions_40k_tokens": (body(questions={"q": {"type": "noul", "instructions": "x " * 40000}}), {}),
        "instructions_200k_tokens": (body(questions={"q": {"type": "noul", "instructions": "x " * 200000}}), {}),
        "state_200k_tokens": (body(state="x " * 200000), {}),
        "nested_10000_brackets": (b'{"model": "jev-latest", "state": ' + b"[" * 10000 + b"]" * 10000
                                  + b', "questions": {}}', {}),
        "instructions_nested_960": (deep, {}),
        "integer_5000_digits": (b'{"model": "jev-latest", "state": ' + b"9" * 5000 + b', "questions": {"r": '
                                + json.dumps(NOUL).encode() + b"}}", {}),
        "lone_surrogate_question_id": (b'{"model": "jev-latest", "state": "hi", "questions": {"\\ud800": '
                                       + json.dumps(NOUL).encode() + b"}}", {}),
        "gzip_without_trailer": (gz[:-8], {"Content-Encoding": "gzip"}),
        "gzip_trailing_garbage": (gz + b"garbage", {"Content-Encoding": "gzip"}),
        "zstd_truncated": (zs[:-6], {"Content-Encoding": "zstd"}),
    }


class ServerProcess:
    def __init__(self, python: str, engine: str, cwd: str, env: dict, cap_gb: float):
        self.port = free_port()
        cap = int(cap_gb * (1 << 30))  # address space: a runaway allocation fails instead of taking the machine
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # the access log: a file, so a full pipe never blocks the server
        self.proc = subprocess.Popen([python, "-m", "onepass", "serve", "--engine", engine, "--port", str(self.port)],
                                     cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=self.log,
                                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError("server did not start: " + self.log.read().decode()[-2000:])
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def valid_answers(url: str, n: int) -> list:
    """n valid requests in parallel: (status, answers)."""
    def one(i):
        status, _, raw = post(url, body(questions={f"v{i}": NOUL}))
        return status, json.loads(raw)["answers"] if status == 200 else None
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def run(args) -> dict:
    env = {**os.environ, "PYTHONPATH": args.pythonpath} if args.pythonpath else dict(os.environ)
    server = ServerProcess(args.python, args.engine, args.cwd, env, args.memory_cap_gb)
    try:
        return measure(server)
    finally:
        if server.alive():
            server.stop()


def measure(server: ServerProcess) -> dict:
    url = server.url
    for _ in range(5):
        post(url, body())
    reference = valid_answers(url, 10)
    out: dict = {"rss_warm_mb": rss_mb(server.proc.pid), "requests": {}}
    cases = hostile()
    for name, (raw, headers) in cases.items():
        if not server.alive():
            out["requests"][name] = {"status": "server dead"}
            continue
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(post, url, raw, headers)
            time.sleep(0.05)
            good = pool.submit(valid_answers, url, 10)
            status, seconds, resp = bad.result()
            mates = good.result()
        harmed = sum(1 for (s, a), (_, ref) in zip(mates, reference) if s != 200 or a != ref)
        out["requests"][name] = {"status": status, "seconds": round(seconds, 3), "valid_harmed": harmed,
                                 "rss_mb": round(rss_mb(server.proc.pid), 1) if server.alive() else None,
                                 "message": resp[:160].decode("utf-8", "replace")}
        print(name, out["requests"][name], flush=True)
    statuses = []
    for i in range(100):
        if not server.alive():
            break
        raw, headers = list(cases.values())[i % len(cases)]
        statuses.append(post(url, raw, headers)[0])
    out["hostile_100"] = {"statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
                          "alive": server.alive()}
    if server.alive():
        valid_answers(url, 4)
        out["rss_after_100_hostile_mb"] = round(rss_mb(server.proc.pid), 1)
        out["rss_ratio"] = round(out["rss_after_100_hostile_mb"] / out["rss_warm_mb"], 3)
        probe_failures = 0
        for i in range(1000):
            try:
                urllib.request.urlopen(f"{url}/v1/probe-{i}", timeout=30).read()
            except urllib.error.HTTPError:
                pass
            except (urllib.error.URLError, OSError):
                probe_failures += 1
        out["probe_failures"] = probe_failures
        page = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        out["metrics_after_1000_unknown_paths"] = {
            "request_series": sum(1 for line in page.splitlines() if line.startswith("onepass_requests_total{")),
            "page_bytes": len(page)}
        burst = [body(state=f"Ticket {i}: " + TICKET, questions={f"q{j}": NOUL for j in range(4)}) for i in range(120)]
        bursts = (("burst_120", {}, 10.0), ("burst_120_deadline_2s", {"X-Request-Timeout": "2"}, 2.0))
        for name, headers, limit in bursts:
            start = time.perf_counter()
            with ThreadPoolExecutor(120) as pool:
                results = list(pool.map(lambda raw: post(url, raw, headers, timeout=120), burst))
            wall = time.perf_counter() - start
            waits = np.array([t for s, t, _ in results if s == 200])
            out[name] = {
                "statuses": {str(s): [r[0] for r in results].count(s) for s in sorted({r[0] for r in results})},
                "accepted_wait_p50_s": round(float(np.percentile(waits, 50)), 2) if len(waits) else None,
                "accepted_wait_max_s": round(float(waits.max()), 2) if len(waits) else None,
                f"accepted_over_{limit:g}s": int((waits > limit).sum()),
                "refused_seconds_max": round(max((t for s, t, _ in results if s != 200), default=0), 3),
                "wall_s": round(wall, 2)}
            print(name, out[name], flush=True)
    out["alive_at_end"] = server.alive()
    return out


def report() -> None:
    runs = {p.stem.split("_", 1)[1]: json.loads(p.read_text()) for p in sorted(RESULTS.glob("hardening_*.json"))}
    order = [k for k in ("before", "after") if k in runs] + [k for k in runs if k not in ("before", "after")]
    lines = ["# Hardening: hostile requests against `onepass serve` (a real process over loopback)", "",
             f"`python benchmarks/hardening.py --engine engines/smollm2 --label <label>` ({time.strftime('%Y-%m-%d')},"
             " 2 cores; `before` = the server at 9fec485, `after` = this one). Each hostile request is sent with 10 "
             "valid requests in flight beside it; `harmed` = valid requests that did not get 200 with the same "
             "answers as when sent alone.", "",
             "| request | " + " | ".join(f"{k}: status, s, harmed, RSS MB" for k in order) + " |",
             "|---|" + "---|" * len(order)]
    for name in runs[order[0]]["requests"]:
        cells = []
        for k in order:
            r = runs[k]["requests"].get(name, {})
            cells.append(f"{r.get('status')}, {r.get('seconds')}, {r.get('valid_harmed')}, {r.get('rss_mb')}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| figure | " + " | ".join(order) + " |", "|---|" + "---|" * len(order)]
    for key, get in [("RSS after warm-up, MB", lambda r: r.get("rss_warm_mb")),
                     ("RSS after 100 hostile requests, MB", lambda r: r.get("rss_after_100_hostile_mb")),
                     ("RSS ratio (target <= 1.2)", lambda r: r.get("rss_ratio")),
                     ("statuses of the 100 hostile requests", lambda r: r.get("hostile_100", {}).get("statuses")),
                     ("/metrics request series after 1,000 unknown paths",
                      lambda r: r.get("metrics_after_1000_unknown_paths", {}).get("request_series")),
                     ("/metrics page bytes", lambda r: r.get("metrics_after_1000_unknown_paths", {}).get("page_bytes")),
                     ("burst of 120: statuses", lambda r: r.get("burst_120", {}).get("statuses")),
                     ("burst: accepted wait p50 s", lambda r: r.get("burst_120", {}).get("accepted_wait_p50_s")),
                     ("burst: accepted wait max s", lambda r: r.get("burst_120", {}).get("accepted_wait_max_s")),
                     ("burst: accepted answered after 10 s", lambda r: r.get("burst_120", {}).get("accepted_over_10s")),
                     ("burst with X-Request-Timeout: 2: statuses",
                      lambda r: r.get("burst_120_deadline_2s", {}).get("statuses")),
                     ("... accepted wait max s",
                      lambda r: r.get("burst_120_deadline_2s", {}).get("accepted_wait_max_s")),
                     ("... accepted answered after 2 s",
                      lambda r: r.get("burst_120_deadline_2s", {}).get("accepted_over_2s")),
                     ("server alive at the end", lambda r: r.get("alive_at_end"))]:
        lines.append(f"| {key} | " + " | ".join(str(get(runs[k])) for k in order) + " |")
    (RESULTS / "hardening.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--label", default="after")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cwd", default=".", help="directory the server runs in (a checkout of the code to measure)")
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH for the server (to measure another checkout)")
    ap.add_argument("--memory-cap-gb", type=float, default=6.0, help="RLIMIT_AS of the server process")
    ap.add_argument("--report", action="store_true", help="only merge the saved runs into hardening.md")
    args = ap.parse_args()
    if not args.report:
        out = {"label": args.label, **run(args)}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"hardening_{args.label}.json").write_text(json.dumps(out, indent=1) + "\n")
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
