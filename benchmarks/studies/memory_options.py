"""Memory after the heaviest legal request a server sees: one 1000-option choice, per backend.

    python benchmarks/studies/memory_options.py --engine engines/smollm2 [--options 1000]

Two measurements, each backend in a fresh process:

* in-process, side by side: an engine answers two small requests (warm), then one choice of ``--options`` short
  options about a ~400-token state; RSS and the state cache's bytes after warm-up, after the request, and after
  ``Engine.release_memory()`` (all after ``malloc_trim``). *Resident* is RSS less the state cache's bytes: the
  cache is memory the operator sized (``--cache-mib``) and its job is to keep states; the target (<= 1.2x warm)
  is on what grows past it.
* a real ``onepass serve`` on the default backend: RSS from /proc and the cache's bytes from /metrics once warm,
  and again once the server has gone idle after the request (it releases a backend's working memory itself when
  idle above 1.2x its warm resident size: ``onepass_memory_releases_total``).

Writes benchmarks/studies/results/memory_options.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (benchmarks/studies/..)
RESULTS = Path(__file__).parent / "results"

CHILD = r"""
import gc, json, sys, time
from onepass import Choice, Engine, Noul
from onepass.runtime.server.memory import release_free_memory, rss_bytes

engine = Engine.load(sys.argv[1], backend=sys.argv[2])
def sizes():
    gc.collect()
    release_free_memory()
    return {"rss_mb": rss_bytes() / 2**20, "cache_mb": engine.cache.bytes / 2**20}
engine.ask("Warm-up ticket: charged twice.", {"q": Noul("Is it billing?")})
engine.ask("Another warm-up ticket: the app crashes.", {"q": Noul("Is it a bug?")})
out = {"backend": sys.argv[2], "warm": sizes()}
options = {f"o{i}": None for i in range(int(sys.argv[3]))}
start = time.perf_counter()
engine.ask("I was charged twice for my subscription. Please refund it. " * 20, {"t": Choice("Which team?", options)})
out["seconds"] = time.perf_counter() - start
out["after"] = sizes()
start = time.perf_counter()
out["released"] = engine.release_memory()
out["release_seconds"] = time.perf_counter() - start
out["after_release"] = sizes()
print(json.dumps(out))
"""

TICKET = "I was charged twice for my subscription. Please refund it. " * 20


def in_process(engine: str, backend: str, options: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, engine, backend, str(options)], capture_output=True,
                          text=True, timeout=1800, cwd=RESULTS)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not line:
        return {"backend": backend, "error": done.stderr[-500:]}
    return json.loads(line[-1])


def _metric(url: str, name: str) -> float:
    page = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(ln.split()[-1]) for ln in page.splitlines() if ln.startswith(name + " ") or
               ln.startswith(name + "{"))


def served(engine: str, options: int) -> dict:
    from onepass.runtime.server.memory import rss_bytes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "onepass", "serve", "--engine", engine, "--port", str(port)],
                                stdout=fh, stderr=fh, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/readyz", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            return {"error": log.read_text()[-500:]}

        def sizes():
            return {"rss_mb": rss_bytes(proc.pid) / 2**20, "cache_mb": _metric(url, "onepass_state_cache_bytes") / 2**20,
                    "releases": _metric(url, "onepass_memory_releases_total")}
        out = {"backend": json.loads(urllib.request.urlopen(url + "/readyz").read()).get("backend", "default"),
               "warm": sizes()}
        body = {"state": TICKET, "questions": {"t": {
            "type": "choice", "instructions": "Which team?", "criteria": {f"o{i}": None for i in range(options)}}}}
        request = urllib.request.Request(url + "/v1/systemone", json.dumps(body).encode(),
                                         {"Content-Type": "application/json", "X-Request-Timeout": "600"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=900) as r:
            out["status"] = r.status
        out["seconds"] = time.perf_counter() - start
        for _ in range(60):  # the release runs on the engine thread once idle: wait for it (or a minute)
            time.sleep(1.0)
            out["after"] = sizes()
            if out["after"]["releases"] > out["warm"]["releases"]:
                time.sleep(1.0)
                out["after"] = sizes()
                break
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def resident(sizes: dict) -> float:
    return sizes["rss_mb"] - sizes["cache_mb"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--options", type=int, default=1000)
    ap.add_argument("--only", choices=("in-process", "served"), help="run one measurement; keep the other's "
                    "figures from the last results file")
    args = ap.parse_args()
    engine = str(Path(args.engine).resolve())
    last = json.loads((RESULTS / "memory_options.json").read_text()) if args.only else {}
    rows = last.get("in_process", []) if args.only == "served" else []
    if args.only != "served":
        for backend in ("onnxruntime", "openvino-cpu"):
            rows.append(in_process(engine, backend, args.options))
            print(rows[-1], flush=True)
    server = last.get("served", {"error": "not run"}) if args.only == "in-process" else served(engine, args.options)
    print(server, flush=True)
    (RESULTS / "memory_options.json").write_text(json.dumps({"options": args.options, "in_process": rows,
                                                             "served": server}, indent=2) + "\n")
    lines = [f"# Memory after one {args.options}-option choice (target: resident <= 1.2x warm)", "",
             f"`python benchmarks/studies/memory_options.py --engine engines/smollm2` (2 cores, AMD EPYC, "
             f"{time.strftime('%Y-%m-%d')}). All after malloc_trim. *Resident* = RSS less the state cache's bytes "
             "(the cache is sized by `--cache-mib`, 512 MiB by default, and reported in /metrics; the request's "
             "trunk, prefilled onto the state, is cached there as a longer state).", "",
             "## In-process, side by side", "",
             "| backend | warm RSS MB | request s | after: RSS MB (cache MB) | after / warm, resident "
             "| after release_memory(): RSS MB | resident / warm | release s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error'][:200]} | | | | | | |")
            continue
        w, a, rel = r["warm"], r["after"], r["after_release"]
        lines.append(f"| {r['backend']} | {w['rss_mb']:.0f} | {r['seconds']:.1f} | {a['rss_mb']:.0f} ({a['cache_mb']:.0f}) "
                     f"| {resident(a) / resident(w):.2f} | {rel['rss_mb']:.0f} | {resident(rel) / resident(w):.2f} "
                     f"| {r['release_seconds']:.2f} |")
    lines += ["", "## `onepass serve` (default backend), measured from outside", ""]
    if "error" in server:
        lines.append(f"failed: {server['error'][:300]}")
    else:
        w, a = server["warm"], server["after"]
        lines += ["| backend | warm RSS MB (cache MB) | request s, status | idle after: RSS MB (cache MB) "
                  "| releases | resident / warm | RSS / warm |", "|---|---|---|---|---|---|---|",
                  f"| {server['backend']} | {w['rss_mb']:.0f} ({w['cache_mb']:.0f}) | {server['seconds']:.1f}, "
                  f"{server['status']} | {a['rss_mb']:.0f} ({a['cache_mb']:.0f}) | {a['releases'] - w['releases']:.0f} "
                  f"| {resident(a) / resident(w):.2f} | {a['rss_mb'] / w['rss_mb']:.2f} |"]
    lines += ["", "Before this change (same script, 2026-12-02, no release): ONNX Runtime 1.45x RSS, OpenVINO 2.36x RSS "
              "(2.14x with its infer request dropped)."]
    (RESULTS / "memory_options.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
