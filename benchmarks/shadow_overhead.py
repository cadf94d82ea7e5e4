"""What shadow mode costs a local answer: `onepass bench` against the server with and without `--teacher`.

Two `onepass serve` processes of the same engine, one with `--teacher URL --shadow-rate 1 --record DIR` (every
request shadowed and every teacher answer recorded: the most work shadow mode does), one without; the teacher a
third `onepass serve` process of a small engine (the tiny Llama of the tests: a teacher whose compute is mostly
not on this host, as a remote one's is not). `onepass bench` (closed loop, one client, the README's ticket and
13 questions, warm state) runs against each in alternating rounds; the report gives each round's p50 and the
median difference. Writes results/shadow_overhead.{json,md}.

    python benchmarks/shadow_overhead.py --engine engines/smollm2 --rounds 4 --requests 60
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = Path(__file__).parent / "results"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_engine() -> Path:
    """The tests' tiny Llama engine (made and cached as the tests make it)."""
    import conftest

    cached = conftest.cache_root() / "test-engines" / f"llama-tiny-{conftest._tiny_fingerprint()}"
    model, engine = cached / "model", cached / "engine"

    def build():
        import shutil

        from onepass.export.build import export_engine

        shutil.rmtree(cached, ignore_errors=True)
        conftest._build_tiny_llama(model)
        export_engine(engine, str(model))

    conftest._cached(cached, engine, build, also=(model / "config.json",))
    return engine


def main(argv=None) -> None:
    from conftest import serve_process

    from onepass.runtime.bench import bench
    from onepass.runtime.request_files import request_body

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=60, help="measured requests per round and server")
    args = p.parse_args(argv)
    body = request_body(str(ROOT / "tests/data/questions.json"), str(ROOT / "tests/data/ticket.txt"))
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            teacher, proc = serve_process(_tiny_engine(), _port(), tmp / "teacher.log", "--threads", "1")
            procs.append(proc)
            plain, proc = serve_process(Path(args.engine), _port(), tmp / "plain.log")
            procs.append(proc)
            shadowed, proc = serve_process(Path(args.engine), _port(), tmp / "shadow.log", "--teacher", teacher,
                                           "--shadow-rate", "1", "--record", str(tmp / "records"))
            procs.append(proc)
            rounds = []
            for i in range(args.rounds):
                row = {}
                for name, url in (("without", plain), ("with", shadowed))[::1 if i % 2 == 0 else -1]:
                    report = bench(body, [body["state"]], url=url, kinds=["warm"], concurrencies=[1],
                                   requests=args.requests, warmup=5, echo=lambda *_: None)
                    run = report["runs"][0]
                    row[name] = {"p50": run["p50"], "p90": run["p90"], "p99": run["p99"], "ok": run.get("ok")}
                row["difference_p50_ms"] = row["with"]["p50"] - row["without"]["p50"]
                rounds.append(row)
                print(f"round {i + 1}: p50 without {row['without']['p50']:.2f} ms, with {row['with']['p50']:.2f} ms")
            time.sleep(2)
            import urllib.request

            metrics = urllib.request.urlopen(shadowed + "/metrics", timeout=10).read().decode()
            recorded = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith("onepass_teacher_records_total"))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((x.split(":", 1)[1].strip() for x in cpu.splitlines() if x.startswith("Model name")), "")
    diffs = [r["difference_p50_ms"] for r in rounds]
    result = {"machine": {"cpu": model, "python": platform.python_version(),
                          "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "rounds": rounds, "median_difference_p50_ms": statistics.median(diffs), "records": recorded}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shadow_overhead.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Shadow mode's cost to the local answer ({result['machine']['when']}, {model})", "",
             "`onepass bench --url` (closed loop, 1 client, the README ticket's 13 questions, warm state, "
             f"{args.requests} measured requests per round) against two `onepass serve` processes of `{args.engine}`: "
             "without a teacher, and with `--teacher URL --shadow-rate 1 --record DIR` (every request shadowed, every "
             "teacher answer recorded). Rounds alternate which server goes first.", "",
             "| round | p50 without (ms) | p50 with (ms) | with - without (ms) | p99 without | p99 with |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        lines.append(f"| {i} | {r['without']['p50']:.2f} | {r['with']['p50']:.2f} | {r['difference_p50_ms']:+.2f} | "
                     f"{r['without']['p99']:.2f} | {r['with']['p99']:.2f} |")
    lines += ["", f"Median p50 difference: **{result['median_difference_p50_ms']:+.2f} ms** (target: <= 1 ms); "
                  f"teacher answers recorded meanwhile: {recorded:.0f}.", "",
              f"    python benchmarks/shadow_overhead.py --engine {args.engine} --rounds {args.rounds} "
              f"--requests {args.requests}"]
    (RESULTS / "shadow_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
