"""Admission and fairness of a real `onepass serve`, scenario by scenario: what clients get at the deadline boundary,
after large requests, and beside clients that keep the engine busy.

    python benchmarks/admission.py --engine engines/smollm2 [--only poison boundary fairness ahead]

* ``poison``: four large requests (a 1,294-word state each, a 5 s deadline), then a 12-token request with a 1 s
  deadline, at once and after 5 s idle: it must be answered (a cost model fitted per pass and per token, not an
  average of whole pass times that large requests inflate);
* ``boundary``: new states of 100 to 2,600 words with deadlines of 3 and 5 s, across the boundary of what fits: each
  answered in time, or refused at admission (413/429 within 0.5 s), or neither (late: a 503, or a 200 after its
  deadline); and the cost model's error (p90 of |predicted - actual| / actual) from ``/metrics``;
* ``fairness``: eight clients (eight source addresses) each keep one 300-word request about a new state in flight
  (60 s deadlines); a ninth sends one-question requests (the default 10 s deadline) one after another: its share
  answered and its latency against the heavy requests';
* ``ahead``: a 2,000-question request, and 0.3 s later the README ticket's 3 questions with a 2 s deadline from the
  same client: refused at once (429), not answered 503 after the big pass;
* ``penalty``: an abuser keeps 16 keep-alive connections and every 1.5 s sends a POST in ambiguous framing (renewing
  its penalty) for 12 s, then asks on each of its keep-alive connections; a neighbour behind the same address asks
  on a new connection every 0.5 s: its share answered (target >= 90%) and the abuser's keep-alive requests refused;
* ``stream``: a 4 KB JSON body written in 12-byte chunks (answered 200), and a 1 MB body in 1-byte chunks (refused)
  with ``/healthz`` probed beside it (its slowest answer; target <= 1 s).

Writes ``benchmarks/results/admission.{json,md}`` (the scenarios run, with the machine and the commit).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
WORDS = ("the customer writes that the order arrived late and the box was damaged so she wants a refund of the "
         "charge and asks whether the replacement can be sent before friday because the shop opens on monday").split()


def text(words: int, seed: int) -> str:
    """A state of ``words`` words, different for every ``seed``."""
    return f"Ticket {seed}. " + " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(words))


def post(port: int, body: dict, timeout_s: float | None, source: str = "127.0.0.1") -> tuple[int, float, str]:
    """(status, seconds, error message) of one request from ``source`` (its client address)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120, source_address=(source, 0))
    headers = {"Content-Type": "application/json", **({"X-Request-Timeout": str(timeout_s)} if timeout_s else {})}
    start = time.monotonic()
    try:
        conn.request("POST", "/v1/systemone", json.dumps(body), headers)
        resp = conn.getresponse()
        data = resp.read()
        took = time.monotonic() - start
        error = "" if resp.status == 200 else json.loads(data or b"{}").get("error", {}).get("message", "")
        return resp.status, took, error
    except OSError as err:
        return 0, time.monotonic() - start, f"{type(err).__name__}: {err}"
    finally:
        conn.close()


NOUL = {"q": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}


class Server:
    """`onepass serve` of the engine on a loopback port, until ``stop``."""

    def __init__(self, engine: str, port: int, *extra: str):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "onepass", "serve", "--engine", engine, "--port",
                                      str(port), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                if urllib.request.urlopen(self.url + "/readyz", timeout=5).status == 200:
                    return
            except OSError:
                time.sleep(1)
        raise SystemExit("the server did not become ready")

    def metric(self, name: str) -> float | None:
        for line in urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def poison(server: Server) -> dict:
    large = [post(server.port, {"state": text(1294, 100 + i), "questions": NOUL}, 5.0) for i in range(4)]
    small = {"state": "I was charged twice.", "questions": NOUL}
    at_once = post(server.port, small, 1.0)
    time.sleep(5)
    idle = post(server.port, small, 1.0)
    return {"large": [{"status": s, "seconds": round(t, 3)} for s, t, _ in large],
            "small_at_once": {"status": at_once[0], "seconds": round(at_once[1], 3), "error": at_once[2]},
            "small_after_5s_idle": {"status": idle[0], "seconds": round(idle[1], 3), "error": idle[2]},
            "target": "after four large requests (2.1-4.8 s each, under a 5 s deadline), a 12-token request with a "
                      "1 s deadline is answered 200, at once and after 5 s idle", "met": at_once[0] == idle[0] == 200}


def boundary(server: Server) -> dict:
    rows, seed = [], 1000
    for deadline in (3.0, 5.0):
        for words in range(100, 2700, 200):
            seed += 1
            status, took, error = post(server.port, {"state": text(words, seed), "questions": NOUL}, deadline)
            refused = status in (413, 429) and took < 0.5
            in_time = status == 200 and took <= deadline
            rows.append({"deadline": deadline, "words": words, "status": status, "seconds": round(took, 3),
                         "outcome": "answered" if in_time else "refused" if refused else "late"})
    good = sum(r["outcome"] != "late" for r in rows) / len(rows)
    return {"rows": rows, "answered_or_refused": good, "cost_model_error_p90": server.metric(
        "onepass_cost_model_error_p90"), "target": ">= 95% answered in time or refused at admission",
            "met": good >= 0.95}


def fairness(server: Server, seconds: float = 40.0) -> dict:
    stop, heavy, quiet = threading.Event(), [], []

    def heavy_client(c: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            heavy.append(post(server.port, {"state": text(300, 10_000 * (c + 1) + n), "questions": NOUL}, 60.0,
                              f"127.0.0.{10 + c}"))

    threads = [threading.Thread(target=heavy_client, args=(c,), daemon=True) for c in range(8)]
    for t in threads:
        t.start()
    time.sleep(3)  # every heavy client has a request queued
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        quiet.append(post(server.port, {"state": "I was charged twice.", "questions": NOUL}, None, "127.0.0.30"))
    stop.set()
    for t in threads:
        t.join(120)
    answered = [t for s, t, _ in quiet if s == 200]
    heavy_ok = [t for s, t, _ in heavy if s == 200]
    ratio = (statistics.quantiles(answered, n=10)[-1] / statistics.median(heavy_ok)
             if len(answered) >= 2 and heavy_ok else None)
    return {"quiet_requests": len(quiet), "quiet_answered": len(answered) / max(1, len(quiet)),
            "quiet_p50_s": statistics.median(answered) if answered else None,
            "quiet_p90_s": statistics.quantiles(answered, n=10)[-1] if len(answered) >= 2 else None,
            "heavy_answered": len(heavy_ok), "heavy_median_s": statistics.median(heavy_ok) if heavy_ok else None,
            "quiet_p90_over_heavy_median": ratio,
            "refusals": sorted({e[:120] for s, _, e in quiet if s != 200})[:5],
            "target": "the ninth client >= 90% answered, p90 <= 0.4x a heavy request's median latency",
            "met": bool(answered) and len(answered) / len(quiet) >= 0.9 and ratio is not None and ratio <= 0.4}


def ahead(server: Server) -> dict:
    ticket = (ROOT / "tests" / "data" / "ticket.txt").read_text()
    small = {"state": ticket, "questions": json.loads((ROOT / "tests" / "data" / "questions.json").read_text())}
    big = {"state": "Order 77 was delivered late and the box was damaged.", "questions": {
        f"q{i}": {"type": "noul", "instructions": f"Does the ticket mention product number {i} or its delivery "
                  "date?"} for i in range(2000)}}
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("big", post(server.port, big, 600)))
    thread.start()
    time.sleep(0.3)
    out["small"] = post(server.port, small, 2)
    thread.join()
    return {k: {"status": s, "seconds": round(t, 3), "error": e[:200]} for k, (s, t, e) in out.items()}


def _ask(sock, close: bool = False) -> bytes:
    """One GET /healthz on a raw connection: the answer's first line (b"" when the connection is gone), its whole
    answer read (head and Content-Length bytes of body)."""
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + (b"Connection: close\r\n" if close else b"") + b"\r\n")
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = sock.recv(65536)
            if not chunk:
                return out.split(b"\r\n", 1)[0]
            out += chunk
        head, _, body = out.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                       if line.startswith(b"content-length:")), 0)
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
        return head.split(b"\r\n", 1)[0]
    except OSError:
        return b""


def penalty(server: Server, seconds: float = 12.0) -> dict:
    import socket

    def connect():
        return socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.40", 0))

    kept = [connect() for _ in range(16)]
    opened = [_ask(s) for s in kept]
    stop, neighbour, abuser, offenses = threading.Event(), [], [], []

    def neighbour_client():
        while not stop.is_set():
            s = connect()
            neighbour.append(_ask(s, close=True))
            s.close()
            time.sleep(0.5)

    thread = threading.Thread(target=neighbour_client, daemon=True)
    thread.start()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        s = connect()
        s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n"
                  b"\r\n0\r\n\r\n")
        offenses.append(s.recv(65536).split(b"\r\n", 1)[0])
        s.close()
        abuser += [_ask(k) for k in kept]
        kept = [connect() for _ in range(16)]  # it comes back with new ones, to be refused at its next offense
        [_ask(k) for k in kept]
        time.sleep(1.5)
    stop.set()
    thread.join(30)
    for k in kept:
        k.close()
    answered = sum(a.startswith(b"HTTP/1.1 200") for a in neighbour) / max(1, len(neighbour))
    refused = sum(a.startswith(b"HTTP/1.1 429") for a in abuser) / max(1, len(abuser))
    return {"abuser_keepalive_opened": sum(a.startswith(b"HTTP/1.1 200") for a in opened),
            "offenses": len(offenses), "offenses_answered_400": sum(o.startswith(b"HTTP/1.1 400") for o in offenses),
            "neighbour_requests": len(neighbour), "neighbour_answered": answered,
            "abuser_keepalive_requests_after_offending": len(abuser), "abuser_keepalive_refused": refused,
            "target": "the neighbours >= 90% answered; the abuser's keep-alive requests refused while penalised",
            "met": answered >= 0.9 and refused == 1.0}


def stream(server: Server) -> dict:
    import socket

    body = json.dumps({"state": "I was charged twice. " * 180, "questions": NOUL}).encode()
    head = (b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=("127.0.0.41", 0))
    s.sendall(head)
    for i in range(0, len(body), 12):
        s.sendall(b"%x\r\n%s\r\n" % (len(body[i:i + 12]), body[i:i + 12]))
    s.sendall(b"0\r\n\r\n")
    small = s.recv(65536).split(b"\r\n", 1)[0].decode()
    s.close()
    probes, done = [], threading.Event()

    def attack():
        a = socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=("127.0.0.42", 0))
        a.sendall(head)
        try:
            for _ in range(256):
                a.sendall(b"1\r\n \r\n" * 4096)
        except OSError:
            pass
        try:
            done.answer = a.recv(65536).split(b"\r\n", 1)[0].decode()
        except OSError as err:
            done.answer = f"{type(err).__name__}"
        a.close()
        done.set()

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    while not done.is_set():
        t0 = time.monotonic()
        urllib.request.urlopen(server.url + "/healthz", timeout=30).read()
        probes.append(time.monotonic() - t0)
    thread.join(30)
    return {"4kb_in_12_byte_chunks": small, "1mb_in_1_byte_chunks": done.answer, "healthz_probes": len(probes),
            "healthz_max_s": round(max(probes, default=0.0), 3),
            "target": "a 4 KB body in 12-byte chunks: 200; a 1 MB body in 1-byte chunks refused, healthz max <= 1 s",
            "met": small.startswith("HTTP/1.1 200") and done.answer.startswith("HTTP/1.1 4")
            and max(probes, default=0.0) <= 1.0}


SCENARIOS = {"poison": ((), poison), "boundary": ((), boundary), "fairness": ((), fairness),
             "ahead": (("--max-questions", "5000", "--max-request-tokens", "262144"), ahead),
             "penalty": ((), penalty), "stream": ((), stream)}


def markdown(data: dict) -> str:
    lines = ["# Admission and fairness of a real server", "",
             f"`python benchmarks/admission.py --engine {data['engine']}` on {data['machine']} (commit "
             f"{data['commit']}); each scenario against a fresh `onepass serve` (the default backend).", ""]
    for name, r in data["scenarios"].items():
        lines += [f"## {name}", ""]
        if "target" in r:
            lines += [f"Target: {r['target']}: **{'met' if r['met'] else 'missed'}**.", ""]
        shown = {k: v for k, v in r.items() if k not in ("rows", "target", "met")}
        lines += ["```", json.dumps(shown, indent=1), "```", ""]
        if "rows" in r:
            lines += ["| deadline s | words | status | seconds | outcome |", "|---|---|---|---|---|"]
            lines += [f"| {x['deadline']:g} | {x['words']} | {x['status']} | {x['seconds']} | {x['outcome']} |"
                      for x in r["rows"]] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--port", type=int, default=8801)
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    args = ap.parse_args(argv)
    path = RESULTS / "admission.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data = {"engine": args.engine, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(), "scenarios": data.get("scenarios", {})}
    for name in args.only or list(SCENARIOS):
        extra, run = SCENARIOS[name]
        server = Server(args.engine, args.port, *extra)
        try:
            data["scenarios"][name] = run(server)
        finally:
            server.stop()
        print(name, json.dumps({k: v for k, v in data["scenarios"][name].items() if k != "rows"}), flush=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
