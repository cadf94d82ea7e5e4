"""What shadow mode costs a local answer: `onepass bench` against the server with and without `--teacher`.

`onepass serve` processes of the same engine: one without a teacher, the others with `--teacher URL
--shadow-rate R --record DIR` against a remote-like teacher (a process answering the System One wire at once
with canned distributions: the teacher's compute is elsewhere, as a remote one's is) at R = 1 and 0.1, and
against `onepass serve` of the tests' tiny Llama on this host (its compute shares the 2 cores). `onepass bench`
(closed loop, one client, the README's ticket and 13 questions, warm state) runs against each in rotating
rounds; the report gives each round's p50 and the median difference. Writes results/shadow_overhead.{json,md}.

    python benchmarks/studies/shadow_overhead.py --engine engines/smollm2 --rounds 4 --requests 60
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (benchmarks/studies/..)
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = Path(__file__).parent / "results"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_engine() -> Path:
    """The tests' tiny Llama engine (made and cached as the tests make it)."""
    import conftest

    from onepass.runtime.core.paths import cache_root

    cached = cache_root() / "test-engines" / f"llama-tiny-{conftest._tiny_fingerprint()}"
    model, engine = cached / "model", cached / "engine"

    def build():
        import shutil

        from onepass.export.build import export_engine

        shutil.rmtree(cached, ignore_errors=True)
        conftest._build_tiny_llama(model)
        export_engine(engine, str(model))

    conftest._cached(cached, engine, build, also=(model / "config.json",))
    return engine


CANNED = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Teacher(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        answers = {}
        for qid, q in body["questions"].items():
            if q["type"] == "noul":
                answers[qid] = {"type": "noul", "noul": 0.5}
            else:
                keys = list(q["criteria"]) if q["type"] == "choice" else [str(i) for i in range(len(q["criteria"]))]
                probs = {k: 1.0 / len(keys) for k in keys}
                answers[qid] = {"type": q["type"], "probabilities": probs, "confidence": 0.0,
                                **({"choice": keys[0]} if q["type"] == "choice" else {"score": 1.0, "legend": {}})}
        raw = json.dumps({"model": "canned", "answers": answers, "usage": {"input_tokens": 0, "output_tokens": 0}})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw.encode())

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Teacher).serve_forever()
"""


def main(argv=None) -> None:
    from conftest import serve_process

    from onepass.runtime.tools.bench import bench
    from onepass.runtime.tools.request_files import request_body

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=60, help="measured requests per round and server")
    p.add_argument("--with-local-engine", action="store_true",
                   help="also a teacher engine on this host (the tests' tiny Llama), whose compute competes")
    args = p.parse_args(argv)
    body = request_body(str(ROOT / "tests/data/questions.json"), str(ROOT / "tests/data/ticket.txt"))
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            port = _port()
            procs.append(subprocess.Popen([sys.executable, "-c", CANNED, str(port)]))
            canned = f"http://127.0.0.1:{port}"
            tiny = None
            if args.with_local_engine:
                tiny, proc = serve_process(_tiny_engine(), _port(), tmp / "teacher.log", "--threads", "1")
                procs.append(proc)
            servers = {}
            for name, flags in (("without", []),
                                ("remote-like, rate 1", ["--teacher", canned, "--shadow-rate", "1"]),
                                ("remote-like, rate 0.1", ["--teacher", canned, "--shadow-rate", "0.1"]),
                                *([("engine on this host, rate 1", ["--teacher", tiny, "--shadow-rate", "1"])]
                                  if args.with_local_engine else [])):
                record = ["--record", str(tmp / name.replace(" ", "_").replace(",", ""))] if flags else []
                servers[name], proc = serve_process(Path(args.engine), _port(), tmp / f"{len(servers)}.log",
                                                    *flags, *record)
                procs.append(proc)
            rounds = []
            names = list(servers)
            for i in range(args.rounds):
                row = {}
                for name in names[i % len(names):] + names[:i % len(names)]:  # each round starts elsewhere
                    report = bench(body, [body["state"]], url=servers[name], kinds=["warm"], concurrencies=[1],
                                   requests=args.requests, warmup=5, echo=lambda *_: None)
                    run = report["runs"][0]
                    row[name] = {"p50": run["p50"], "p90": run["p90"], "p99": run["p99"]}
                rounds.append(row)
                print(f"round {i + 1}: " + ", ".join(f"{n} p50 {row[n]['p50']:.2f} ms" for n in names))
            time.sleep(2)
            import urllib.request

            recorded = {}
            for name in names[1:]:
                metrics = urllib.request.urlopen(servers[name] + "/metrics", timeout=10).read().decode()
                recorded[name] = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                     if line.startswith("onepass_teacher_records_total"))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((x.split(":", 1)[1].strip() for x in cpu.splitlines() if x.startswith("Model name")), "")
    diffs = {n: statistics.median(r[n]["p50"] - r["without"]["p50"] for r in rounds) for n in names[1:]}
    result = {"machine": {"cpu": model, "python": platform.python_version(),
                          "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "rounds": rounds, "median_difference_p50_ms": diffs, "records": recorded}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shadow_overhead.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Shadow mode's cost to the local answer ({result['machine']['when']}, {model})", "",
             "`onepass bench --url` (closed loop, 1 client, the README ticket's 13 questions, warm state, "
             f"{args.requests} measured requests per round and server) against `onepass serve` processes of "
             f"`{args.engine}`: without a teacher, and with `--teacher URL --shadow-rate R --record DIR` (every shadowed "
             "request's 13 teacher answers recorded). Teachers: *remote-like*, a process that answers the System One "
             "wire at once with canned distributions (the teacher's compute elsewhere, as a remote one's is); and "
             "*engine on this host*, `onepass serve` of the tests' tiny Llama on the same 2 cores (its compute "
             "competes with the student's). Each round starts with another server.", "",
             "| round | " + " | ".join(f"p50 {n} (ms)" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, r in enumerate(rounds, 1):
        lines.append(f"| {i} | " + " | ".join(f"{r[n]['p50']:.2f}" for n in names) + " |")
    lines += ["", "Median over rounds of (p50 with - p50 without), target <= 1 ms:", ""]
    lines += [f"- {n}: **{d:+.2f} ms** ({recorded[n]:.0f} teacher answers recorded)" for n, d in diffs.items()]
    spread = [max(r[n]["p50"] for r in rounds) - min(r[n]["p50"] for r in rounds) for n in names]
    lines += ["", f"Round-to-round spread of one server's p50 on this shared machine: {min(spread):.1f} to "
                  f"{max(spread):.1f} ms.", "",
              f"    python benchmarks/studies/shadow_overhead.py --engine {args.engine} --rounds {args.rounds} "
              f"--requests {args.requests}" + (" --with-local-engine" if args.with_local_engine else "")]
    (RESULTS / "shadow_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
