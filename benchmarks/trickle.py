"""Trickles and fairness against a real `onepass serve` over loopback: what one slow client or one slow teacher
costs everyone else (issue: harden-trickle).

    python benchmarks/trickle.py --engine engines/smollm2 --label after
    python benchmarks/trickle.py --engine engines/smollm2 --label before --pythonpath /tmp/before-pkg
    python benchmarks/trickle.py --report

Scenarios (the issue's, shortened where a minute proves the same):

1. ``chunks``: a legal 1,000,000-byte body sent as 1-byte chunks (6 MB of framing) as fast as the socket takes
   it, while another client asks ``/healthz`` back to back: the body's status and seconds, the probes'
   p50 / max; the server's CPU per such connection (from new addresses, and reconnecting from a penalised one)
   beside that of a 1-byte invalid body and of a valid request; then 8 valid clients for 20 s beside 2
   processes (other addresses) that keep sending such bodies, reconnecting at once, against the same 8 alone:
   requests/s, failures. The attackers share the machine's 2 cores with the server and the clients.
2. ``cap``: the server capped at 60 connections; 80 connections from 127.0.0.2 holding half a request head;
   from 127.0.0.1, 20 ``/healthz`` and 20 POSTs: their statuses, and ``/metrics``' refusals.
3. ``gate``: gate mode (``--min-confidence 0.99``) with a teacher that sends its response head a byte every
   0.3 s: requests with deadlines 1, 2, 3 and 4.5 s one after another, then 8 at once with 2 s: status and
   seconds past the deadline; the gate outcomes in ``/metrics``.
4. ``distill``: ``onepass distill`` at its defaults against a teacher trickling a byte every 0.5 s: seconds to
   its end (killed at 200 s), exit code, its last line, whether ``--out`` exists.
5. ``admission``: 400 identical yes/no questions and 300 distinct ones, the default deadline: status, message.

Writes benchmarks/results/trickle_<label>.json; ``--report`` writes trickle.md from the runs saved.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hardening import NOUL, TICKET, body, free_port, post  # noqa: E402
from hostile import Trickler  # noqa: E402  (the tests' hostile teacher)

RESULTS = Path(__file__).resolve().parent / "results"


class Server:
    """`onepass serve` in a subprocess, ready."""

    def __init__(self, args, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": args.pythonpath} if args.pythonpath else dict(os.environ)
        self.log = tempfile.NamedTemporaryFile(suffix=".log", delete=False)
        self.proc = subprocess.Popen([args.python, "-m", "onepass", "serve", "--engine", args.engine, "--port",
                                      str(self.port), *extra], env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 240
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start: " + Path(self.log.name).read_text()[-2000:])
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/readyz", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self, name: str) -> dict:
        try:
            page = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        except OSError as err:
            return {"error": str(err)}
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in page.splitlines()
                if line.startswith(name)}

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return Path(self.log.name).read_text()


def healthz(url: str, timeout: float = 10.0) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout) as r:
            return r.status, time.perf_counter() - start
    except urllib.error.HTTPError as err:
        return err.code, time.perf_counter() - start
    except OSError:
        return 0, time.perf_counter() - start


def one_byte_chunks(size: int = 1_000_000) -> list:
    """A legal request of ``size`` bytes of JSON framed as 1-byte chunks, in 24 KiB writes (6 MB in all)."""
    raw = body(state=TICKET + " " * (size - len(body()) - 1))
    framed = b"".join(b"1\r\n" + raw[j:j + 1] + b"\r\n" for j in range(len(raw)))
    return [framed[i:i + 24576] for i in range(0, len(framed), 24576)]


def chunked_body(port: int, writes: list, source: str = "127.0.0.2") -> tuple[str, float]:
    """One request sent as ``writes`` (one_byte_chunks) from address ``source``: (status line or how it ended,
    seconds)."""
    start = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    try:
        s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in writes:
            s.sendall(piece)
        s.sendall(b"0\r\n\r\n")
        answer = s.recv(200)
    except OSError as err:
        try:
            answer = s.recv(200)
        except OSError:
            answer = f"closed: {type(err).__name__}".encode()
    finally:
        s.close()
    return answer.split(b"\r\n", 1)[0].decode(errors="replace"), time.perf_counter() - start


def percentiles(xs: list) -> dict:
    a = np.asarray(xs or [np.nan])
    return {"n": len(xs), "p50_s": round(float(np.median(a)), 4), "max_s": round(float(a.max()), 4)}


def scenario_chunks(args) -> dict:
    server = Server(args)
    try:
        probes, done = [], threading.Event()

        def probe():
            while not done.is_set():
                probes.append(healthz(server.url))
                time.sleep(0.05)

        t = threading.Thread(target=probe)
        t.start()
        status, seconds = chunked_body(server.port, one_byte_chunks(), "127.0.3.1")
        done.set()
        t.join()
        one = {"body": {"status": status, "seconds": round(seconds, 3)},
               "healthz": {**percentiles([s for _, s in probes]), "failed": sum(c != 200 for c, _ in probes)}}

        def valid_load(seconds: float, clients: int = 8) -> dict:
            until, statuses, spans = time.monotonic() + seconds, [], []

            def client(i):
                while time.monotonic() < until:
                    code, took, _ = post(server.url, body(state=f"{TICKET} (ticket {i}-{len(statuses)})"))
                    statuses.append(code)
                    spans.append(took)

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(client, range(clients)))
            return {"requests_per_s": round(sum(c == 200 for c in statuses) / seconds, 2), "requests": len(statuses),
                    "failed": sum(c != 200 for c in statuses), "p50_s": round(float(np.median(spans)), 3)}

        def cpu_s() -> float:  # the server process's CPU time (user + system)
            fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        def cost(send, n: int = 500, budget_s: float = 30.0) -> float:  # server CPU ms per connection of ``send``
            before, until, done = cpu_s(), time.monotonic() + budget_s, 0
            while done < n and time.monotonic() < until:
                send()
                done += 1
            return round((cpu_s() - before) / done * 1000, 3)

        writes = one_byte_chunks()
        sources = iter(f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(1000))  # a new address each: no penalty
        one["server_cpu_ms_per_connection"] = {
            "1MB_in_1_byte_chunks_refused": cost(lambda: chunked_body(server.port, writes, next(sources))),
            "the same, reconnecting from a penalised address": cost(lambda: chunked_body(server.port, writes)),
            "a 1-byte invalid body (400)": cost(lambda: post(server.url, b"{")),
            "a valid 1-question request (200)": cost(lambda: post(server.url, body()), 100)}
        alone = valid_load(20)
        attackers = [subprocess.Popen([args.python, __file__, "--attack", str(server.port), "--source", f"127.0.4.{i}"])
                     for i in (1, 2)]
        beside = valid_load(20)
        for a in attackers:
            a.terminate()
            a.wait(timeout=30)
        return {**one, "load_alone": alone, "load_beside_2_chunkers": beside,
                "refusals": server.metrics("onepass_transport_refusals_total")}
    finally:
        server.stop()


def scenario_cap(args) -> dict:
    server = Server(args, "--max-connections", "60")
    held = []
    try:
        for _ in range(80):
            try:
                s = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0))
                s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
            except OSError:
                pass
        time.sleep(0.5)
        probes = [healthz(server.url) for _ in range(20)]
        posts = [post(server.url, body(state=f"{TICKET} ({i})"))[:2] for i in range(20)]
        return {"healthz_statuses": sorted({c for c, _ in probes}), "healthz_200": sum(c == 200 for c, _ in probes),
                "post_statuses": sorted({c for c, _ in posts}), "post_200": sum(c == 200 for c, _ in posts),
                "refusals": server.metrics("onepass_transport_refusals_total")}
    finally:
        for s in held:
            s.close()
        server.stop()


def scenario_gate(args) -> dict:
    teacher = Trickler(0.3)
    server = Server(args, "--teacher", teacher.url, "--min-confidence", "0.99")
    try:
        questions = {"refund": NOUL, "angry": {"type": "noul", "instructions": "Is the customer angry?"}}
        one = []
        for seconds in (1, 2, 3, 4.5):
            code, took, _ = post(server.url, body(questions=questions), {"X-Request-Timeout": str(seconds)})
            one.append({"deadline_s": seconds, "status": code, "past_deadline_s": round(took - seconds, 3)})
        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(lambda i: post(server.url, body(state=f"{TICKET} ({i})", questions=questions),
                                                 {"X-Request-Timeout": "2"})[:2], range(8)))
        outcomes = server.metrics('onepass_teacher_calls_total{mode="gate"')
    finally:
        log = server.stop()
        teacher.close()
    return {"one_by_one": one, "burst_8_deadline_2s": {"statuses": sorted({c for c, _ in burst}),
                                                         "past_deadline_max_s": round(max(t for _, t in burst) - 2, 3)},
            "gate_outcomes": outcomes, "never_retrieved_in_log": log.count("never retrieved")}


def scenario_distill(args) -> dict:
    teacher = Trickler(0.5)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "states.jsonl").write_text("".join(json.dumps(f"{TICKET} Ticket {i}.") + "\n" for i in range(40)))
    (tmp / "q.json").write_text(json.dumps({"refund": NOUL}))
    env = {**os.environ, "PYTHONPATH": args.pythonpath} if args.pythonpath else dict(os.environ)
    start = time.monotonic()
    try:
        out = subprocess.run([args.python, "-m", "onepass", "distill", "--engine", args.engine, "--teacher",
                              teacher.url, "--states", str(tmp / "states.jsonl"), "--questions", str(tmp / "q.json"),
                              "--out", str(tmp / "out")], env=env, capture_output=True, text=True, timeout=200)
        code, last = out.returncode, (out.stderr.strip().splitlines() or [""])[-1][:300]
    except subprocess.TimeoutExpired:
        code, last = None, "did not end: killed at 200 s"
    finally:
        teacher.close()
    return {"seconds": round(time.monotonic() - start, 1), "exit_code": code, "last_line": last,
            "out_exists": (tmp / "out").exists()}


def scenario_admission(args) -> dict:
    server = Server(args)
    try:
        same = {f"q{i}": {"type": "noul", "instructions": "Does the customer ask for a refund?"} for i in range(400)}
        distinct = {f"q{i}": {"type": "noul", "instructions": f"Is ticket topic number {i} mentioned?"}
                    for i in range(300)}
        out = {}
        for name, questions in (("identical_400", same), ("distinct_300", distinct)):
            code, took, raw = post(server.url, body(questions=questions))
            message = json.loads(raw).get("error", {}).get("message", "") if code != 200 else ""
            out[name] = {"status": code, "seconds": round(took, 3), "message": message[:200]}
        return out
    finally:
        server.stop()


SCENARIOS = {"chunks": scenario_chunks, "cap": scenario_cap, "gate": scenario_gate, "distill": scenario_distill,
             "admission": scenario_admission}


def _label(series: str, name: str) -> str:
    """A Prometheus series' label value: ``x{a="1",b="2"}`` -> "2" for b."""
    return series.split(f'{name}="', 1)[1].split('"', 1)[0]


def _rows(run: dict) -> dict:
    """The figures the issue's targets name, from one run."""
    chunks, cap, gate = run.get("chunks", {}), run.get("cap", {}), run.get("gate", {})
    distill, admission = run.get("distill", {}), run.get("admission", {})
    cost = chunks.get("server_cpu_ms_per_connection", {})
    alone, beside = chunks.get("load_alone", {}), chunks.get("load_beside_2_chunkers", {})
    refusals = {k.split('"')[1]: int(v) for k, v in cap.get("refusals", {}).items() if '"' in k and v}
    return {
        "1 MB body in 1-byte chunks: its answer, seconds": f"{chunks.get('body', {}).get('status', '')[9:]}, "
                                                            f"{chunks.get('body', {}).get('seconds')}",
        "/healthz during it: p50 / max s": f"{chunks.get('healthz', {}).get('p50_s')} / "
                                           f"{chunks.get('healthz', {}).get('max_s')}",
        "server CPU per such connection, ms (new address / penalised)":
            f"{cost.get('1MB_in_1_byte_chunks_refused')} / {cost.get('the same, reconnecting from a penalised address')}",
        "server CPU per 1-byte invalid body / valid request, ms":
            f"{cost.get('a 1-byte invalid body (400)')} / {cost.get('a valid 1-question request (200)')}",
        "8 valid clients: requests/s alone -> beside 2 chunk senders":
            f"{alone.get('requests_per_s')} -> {beside.get('requests_per_s')} (failed {beside.get('failed')}, "
            f"p50 {alone.get('p50_s')} -> {beside.get('p50_s')} s)",
        "cap 60, 80 connections from one address: other address's /healthz 200 / POST 200 (of 20)":
            f"{cap.get('healthz_200')} / {cap.get('post_200')}" + (f" (refused: {refusals})" if refusals else ""),
        "gate, teacher trickling 0.3 s/byte, deadlines 1/2/3/4.5 s: statuses": ", ".join(
            str(r["status"]) for r in gate.get("one_by_one", [])),
        "... seconds past the deadline (negative: before it)": ", ".join(
            str(r["past_deadline_s"]) for r in gate.get("one_by_one", [])),
        "... 8 at once (2 s): statuses; gate outcomes": f"{gate.get('burst_8_deadline_2s', {}).get('statuses')}; "
            + ", ".join(f"{_label(k, 'outcome')} {int(v)}" for k, v in gate.get("gate_outcomes", {}).items()),
        "distill vs a teacher trickling 0.5 s/byte: seconds, exit, --out written":
            f"{distill.get('seconds')}, {distill.get('exit_code')}, {distill.get('out_exists')}",
        "... its last line": f"{distill.get('last_line', '')[:160]}",
        "400 identical questions, default deadline": f"{admission.get('identical_400', {}).get('status')} "
                                                      f"{admission.get('identical_400', {}).get('message', '')[:90]}",
        "300 distinct questions": f"{admission.get('distinct_300', {}).get('status')} "
                                  f"{admission.get('distinct_300', {}).get('message', '')[:90]}",
    }


def report() -> None:
    runs = {p.stem.split("_", 1)[1]: json.loads(p.read_text()) for p in sorted(RESULTS.glob("trickle_*.json"))}
    labels = [label for label in ("before", "after") if label in runs] + sorted(set(runs) - {"before", "after"})
    rows = {label: _rows(runs[label]) for label in labels}
    lines = ["# Trickles and fairness (`python benchmarks/trickle.py`)", "",
             "A real `onepass serve` of the default engine (SmolLM2-135M, OpenVINO) over loopback on this machine "
             f"({', '.join(sorted({runs[label].get('machine', '') for label in labels}))}); `before`: the code before "
             "the change (commit 862a9c5, `--pythonpath` to its checkout), `after`: with it. The attackers, the "
             "clients and the server share the machine's 2 cores. Raw figures: `trickle_<label>.json`.", "",
             "| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name in rows[labels[0]] if labels else []:
        lines.append(f"| {name} | " + " | ".join(rows[label][name].replace("|", "/") for label in labels) + " |")
    lines += [""] + [f"Note on `{label}`: {runs[label]['notes']}." for label in labels if runs[label].get("notes")]
    (RESULTS / "trickle.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--label", default="after")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH of the processes (to measure another checkout)")
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    ap.add_argument("--report", action="store_true", help="only write trickle.md from the saved runs")
    ap.add_argument("--attack", type=int, default=None, help=argparse.SUPPRESS)  # a process sending chunkers
    ap.add_argument("--source", default="127.0.0.2", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.attack:  # 1 MB bodies in 1-byte chunks, one after another, until terminated
        writes = one_byte_chunks()
        while True:
            chunked_body(args.attack, writes, args.source)
    if not args.report:
        path = RESULTS / f"trickle_{args.label}.json"
        out = json.loads(path.read_text()) if path.exists() and args.only else {}
        out.update(label=args.label, machine=f"{os.cpu_count()} cores, {os.uname().machine}")
        for name in args.only or SCENARIOS:
            print(f"{name} ...", flush=True)
            out[name] = SCENARIOS[name](args)
            print(json.dumps(out[name], indent=1), flush=True)
            RESULTS.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=1) + "\n")
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
