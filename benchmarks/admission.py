"""Deadline-aware admission with a large request ahead: what a small request with a short deadline gets.

A real `onepass serve` process (limits raised to 5000 questions and 262144 request tokens) is warmed up
with the README ticket; then a 2000-question request is sent, and 0.3 s later the ticket's 3 questions
with ``X-Request-Timeout: 2``. The small request should be refused at once (429 with Retry-After: the
work ahead cannot end before its deadline), not held for the big request's whole pass and then
answered 503.

    python benchmarks/admission.py --engine ENGINE [--label after]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


def post(url: str, body: dict, timeout_s: float) -> tuple:
    req = urllib.request.Request(url + "/v1/systemone", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-Request-Timeout": str(timeout_s)})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, time.monotonic() - start, ""
    except urllib.error.HTTPError as err:
        return err.code, time.monotonic() - start, json.loads(err.read())["error"]["message"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--port", type=int, default=8801)
    ap.add_argument("--questions", type=int, default=2000)
    ap.add_argument("--label", default="after")
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-m", "onepass", "serve", "--engine", args.engine, "--port",
                             str(args.port), "--max-questions", "5000", "--max-request-tokens", "262144"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(180):
            try:
                if urllib.request.urlopen(url + "/readyz", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(1)
        ticket = (ROOT / "tests" / "data" / "ticket.txt").read_text()
        small = {"state": ticket, "questions": json.loads((ROOT / "tests" / "data" / "questions.json").read_text())}
        for _ in range(5):
            post(url, small, 30)
        big = {"state": "Order 77 was delivered late and the box was damaged.", "questions": {
            f"q{i}": {"type": "noul", "instructions": f"Does the ticket mention product number {i} or its delivery "
                      "date?"} for i in range(args.questions)}}
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("big", post(url, big, 600)))
        thread.start()
        time.sleep(0.3)
        out["small"] = post(url, small, 2)
        thread.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    record = {k: {"status": s, "seconds": round(t, 3), "error": e} for k, (s, t, e) in out.items()}
    path = RESULTS / "admission.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[args.label] = {"questions": args.questions, **record}
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
