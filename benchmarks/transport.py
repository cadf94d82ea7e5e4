"""The transport and admission faults of a real `onepass serve` process, measured from a client over loopback.

    python benchmarks/transport.py --engine engines/smollm2 --label after [--onepass DIR] [--report]

``--onepass DIR`` runs the server from another checkout (e.g. a git worktree of an older commit: ``before``).
Each probe has a client-side time limit and reports what it saw, so a server that hangs is measured as
"held past the limit" instead of hanging the run:

1. the escaped-quote body (``"`` then ``\\"`` repeated), gzipped (about 100-1000 bytes on the wire), at 64 KiB,
   128 KiB and 1 MiB: status and seconds to the refusal, and the seconds of a ``/healthz`` sent 50 ms after it;
2. 300 half-open connections (half a head, or nothing): the seconds of a valid request beside them, and
   how many the server itself closed within 15 s;
3. an 8 MB header: status and seconds;
4. an upload abandoned after 1 byte of a 100-byte body: the statuses /metrics counted for it;
5. a legal 5,500-word state with a 2 s deadline: status and seconds; then a small request's.

Writes benchmarks/results/transport_<label>.json; ``--report`` writes transport.md from before and after.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NOUL = {"type": "noul", "instructions": "Does the customer ask for a refund?"}
LIMIT_S = 60.0  # a client waits at most this long for any one answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, raw: bytes, headers: dict | None = None, timeout: float = LIMIT_S) -> tuple:
    """(status or a word for what happened, seconds)."""
    req = urllib.request.Request(url + "/v1/systemone", data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        status = err.code
    except (TimeoutError, socket.timeout):
        status = f"no answer within {timeout:g} s"
    except (urllib.error.URLError, OSError) as err:
        status = f"connection failed: {type(err).__name__}"
    return status, round(time.perf_counter() - t0, 3)


def healthz(url: str) -> float | str:
    t0 = time.perf_counter()
    try:
        urllib.request.urlopen(url + "/healthz", timeout=LIMIT_S).read()
    except (TimeoutError, socket.timeout, urllib.error.URLError, OSError):
        return f"no answer within {LIMIT_S:g} s"
    return round(time.perf_counter() - t0, 3)


def small(url: str) -> tuple:
    return post(url, json.dumps({"state": "I was charged twice.", "questions": {"q": NOUL}}).encode())


def escaped_quotes(url: str) -> dict:
    out = {}
    for size in (64 << 10, 128 << 10, 1 << 20):
        raw = gzip.compress(b'"' + b'\\"' * (size // 2 - 1))
        with ThreadPoolExecutor(2) as pool:
            refused = pool.submit(post, url, raw, {"Content-Encoding": "gzip"})
            time.sleep(0.05)
            health = pool.submit(healthz, url)
            status, seconds = refused.result()
            out[f"{size >> 10} KiB"] = {"wire_bytes": len(raw), "status": status, "seconds": seconds,
                                        "healthz_seconds": health.result()}
        print("escaped quotes", size >> 10, "KiB:", out[f"{size >> 10} KiB"], flush=True)
        if not isinstance(status, int):
            break  # the server is still busy with it: larger sizes would only queue behind
    return out


def _closed_by_server(sock: socket.socket, until: float) -> bool:
    sock.settimeout(max(0.01, until - time.monotonic()))
    try:
        while sock.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def half_open(url: str, port: int) -> dict:
    held = []
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")
        held.append(s)
    status, seconds = small(url)
    until = time.monotonic() + 15
    closed = sum(_closed_by_server(s, until) for s in held)
    for s in held:
        s.close()
    return {"valid_status": status, "valid_seconds": seconds, "closed_by_server_within_15_s": closed}


def big_header(port: int) -> dict:
    s = socket.create_connection(("127.0.0.1", port), timeout=LIMIT_S)
    t0 = time.perf_counter()
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n\r\n")
        answer = s.recv(64)
    except (socket.timeout, TimeoutError):
        answer = b"(no answer)"
    except OSError:  # the server answered and closed before taking all 8 MB
        try:
            answer = s.recv(64) or b"(closed without an answer)"
        except OSError:
            answer = b"(closed without an answer)"
    s.close()
    return {"answer": answer.split(b"\r\n")[0].decode(errors="replace"), "seconds": round(time.perf_counter() - t0, 3)}


def abandoned(url: str, port: int) -> dict:
    def counted():
        page = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in page.splitlines()
                if line.startswith("onepass_requests_total{") and "systemone" in line}
    before = counted()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    s.close()
    time.sleep(1.0)
    after = counted()
    return {k.split("status=")[1].strip('"}'): after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)}


def long_state(url: str) -> dict:
    words = ("The customer writes again about the duplicate charge and the crashing reports page. " * 400).split()
    raw = json.dumps({"state": " ".join(words[:5500]), "questions": {"q": NOUL}}).encode()
    status, seconds = post(url, raw, {"X-Request-Timeout": "2"})
    next_status, next_seconds = small(url)
    return {"status": status, "seconds": seconds, "next_status": next_status, "next_seconds": next_seconds}


def run(args) -> dict:
    port = free_port()
    env = dict(os.environ)
    if args.onepass:
        pkg = Path(tempfile.mkdtemp())
        (pkg / "onepass").symlink_to(Path(args.onepass).resolve())
        env["PYTHONPATH"] = str(pkg)
    log = open(Path(tempfile.gettempdir()) / f"onepass-transport-{args.label}.log", "wb")  # the server's own log
    proc = subprocess.Popen([args.python, "-m", "onepass", "serve", "--engine", args.engine, "--port", str(port)],
                            stdout=log, stderr=log, env=env, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=5).status == 200:
                break
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start (see {log.name})")
        time.sleep(0.5)
    try:
        out = {"label": args.label, "onepass": args.onepass or "this checkout"}
        out["long_state_2s_deadline"] = long_state(url)
        print("long state:", out["long_state_2s_deadline"], flush=True)
        out["abandoned_upload_counted_as"] = abandoned(url, port)
        print("abandoned:", out["abandoned_upload_counted_as"], flush=True)
        out["header_8mb"] = big_header(port)
        print("8 MB header:", out["header_8mb"], flush=True)
        out["half_open_300"] = half_open(url, port)
        print("300 half-open:", out["half_open_300"], flush=True)
        out["escaped_quotes_gzip"] = escaped_quotes(url)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    (RESULTS / f"transport_{args.label}.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def report() -> None:
    runs = {label: json.loads((RESULTS / f"transport_{label}.json").read_text()) for label in ("before", "after")
            if (RESULTS / f"transport_{label}.json").exists()}
    lines = ["# Transport and admission: `onepass serve` against hostile clients", "",
             "`python benchmarks/transport.py --engine engines/smollm2 --label before|after` (2 cores; `before` = the "
             "server at 3066e93, `after` = this one; each answer waited for at most 60 s).", "",
             "| probe | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]

    def row(name, get):
        cells = []
        for r in runs.values():
            try:
                cells.append(str(get(r)))
            except (KeyError, TypeError):
                cells.append("not reached")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    for size in ("64 KiB", "128 KiB", "1024 KiB"):
        row(f"escaped quotes {size} gzipped: status, s / healthz s",
            lambda r, s=size: "{status}, {seconds} / {healthz_seconds}".format(**r["escaped_quotes_gzip"][s]))
    row("300 half-open: valid request status, s", lambda r: "{valid_status}, {valid_seconds}".format(
        **r["half_open_300"]))
    row("300 half-open: closed by the server within 15 s", lambda r: r["half_open_300"]["closed_by_server_within_15_s"])
    row("8 MB header: answer, s", lambda r: "{answer}, {seconds}".format(**r["header_8mb"]))
    row("abandoned upload counted as (status: count)", lambda r: r["abandoned_upload_counted_as"])
    row("5,500-word state, 2 s deadline: status, s", lambda r: "{status}, {seconds}".format(
        **r["long_state_2s_deadline"]))
    row("... the next small request: status, s", lambda r: "{next_status}, {next_seconds}".format(
        **r["long_state_2s_deadline"]))
    (RESULTS / "transport.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--label", default="after")
    ap.add_argument("--onepass", default=None, help="run the server from this checkout instead")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--report", action="store_true", help="only write transport.md from the saved runs")
    args = ap.parse_args()
    if not args.report:
        run(args)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
