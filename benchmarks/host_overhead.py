"""Host time of one warm ask: the device pass replaced by an instant stub, so what is left is the host's share.

On a GPU a 13-question pass is ~1 ms of kernels replayed from a CUDA graph; whatever the host spends around it
(tokenising, planning, packing, building masks and read-outs, reading answers out) adds to every answer's wall time.
This measures that share on any machine: the state is prefilled for real, then the backend's ``score_all`` is
replaced by a stub that returns log-probabilities at once, and each ask is timed whole.

Workloads (a ~512-token state, questions from ``latency.py``: 1, 13 and 64):

* ``repeated``: the same question set asked again and again (a service's fixed questions);
* ``new``: a question set never seen before on every ask (every instruction reworded);
* ``compiled``: the repeated set compiled once and held by the caller (``engine.compile``; trees that have it);
* ``async``: the repeated set through ``AsyncEngine`` (the server's dispatcher, without HTTP).

    python benchmarks/host_overhead.py --engine engines/smollm2 [--json OUT.json]
    python benchmarks/host_overhead.py --engine engines/smollm2 --against /tmp/base --rounds 3

``--against TREE`` times another checkout (say the code before a change) in the same run: one worker process per
tree and round, the trees alternating, each worker importing ``onepass`` from its tree; medians over rounds and the
ratio per workload. Results go to ``benchmarks/results/host_overhead.{json,md}`` unless ``--json`` says where.

``--bench`` instead runs the real passes: ``onepass bench`` (warm, one sender) of the 13 questions on the 512-token
state, for each CPU backend, from each tree in turn (``benchmarks/results/host_overhead_bench.{json,md}``):

    python benchmarks/host_overhead.py --engine engines/smollm2 --against /tmp/base --bench --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
COUNTS = (1, 13, 64)
STATE_TOKENS = 512


def _import_tree(tree: str | None) -> None:
    """Make ``import onepass`` load the checkout ``tree`` (a symlink named onepass on the path's front)."""
    if tree is None:
        return
    link = Path(tempfile.mkdtemp()) / "onepass"
    link.symlink_to(Path(tree).resolve())
    sys.path.insert(0, str(link.parent))


def _stub(engine, seed: int = 0) -> None:
    """The backend's pass replaced by an instant one: seeded log-probabilities of the right size, no head."""
    import numpy as np

    rng = np.random.default_rng(seed)
    table = -rng.random(1 << 16, dtype=np.float32) * 4.0

    def score_all(kv, batch):
        return table[:batch.readout_index.shape[0]], None
    engine.backend.score_all = score_all


def _timed(ask, iters: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``ask(i)`` after ``warmup`` untimed ones."""
    for i in range(warmup):
        ask(i)
    out = []
    for i in range(warmup, warmup + iters):
        t0 = time.perf_counter()
        ask(i)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _reworded(questions: dict, k: int) -> dict:
    """``questions`` with every instruction changed: a set no cache has seen."""
    return {qid: type(q)(f"{q.instructions} ({k})", q.criteria) for qid, q in questions.items()}


def worker(engine_dir: str, iters: int, warmup: int) -> dict:
    """Every workload's per-ask milliseconds in this process (the tree ``onepass`` imports from)."""
    import asyncio

    sys.path.insert(0, str(HERE))
    from latency import many_questions, state_of_tokens
    from onepass import Engine

    engine = Engine.load(engine_dir, threads=2)
    state = engine.state(state_of_tokens(engine, STATE_TOKENS))
    _stub(engine)
    out: dict = {}
    for count in COUNTS:
        questions = many_questions(count)
        fresh = [_reworded(questions, k) for k in range(warmup + iters)]
        out[f"repeated/{count}"] = _timed(lambda i: engine.ask(state, questions), iters, warmup)
        out[f"new/{count}"] = _timed(lambda i: engine.ask(state, fresh[i]), iters, warmup)
        if hasattr(engine, "compile"):
            held = engine.compile(questions)
            out[f"compiled/{count}"] = _timed(lambda i: engine.ask(state, held), iters, warmup)
        out[f"async/{count}"] = asyncio.run(_async_times(engine, state, questions, iters, warmup))
    engine.close()
    return out


async def _async_times(engine, state, questions, iters: int, warmup: int) -> list[float]:
    from onepass.runtime.server.embed import AsyncEngine

    async with AsyncEngine(engine, window_ms=0) as served:
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            await served.ask(state, questions)
            times.append((time.perf_counter() - t0) * 1000)
    return times[warmup:]


def _run_worker(tree: str | None, args) -> dict:
    """One worker process importing ``onepass`` from ``tree`` (None: this checkout)."""
    cmd = [sys.executable, __file__, "--worker", "--engine", args.engine, "--iters", str(args.iters),
           "--warmup", str(args.warmup)] + (["--tree", tree] if tree else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if done.returncode:
        raise SystemExit(f"the worker for {tree or 'this tree'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "min": ordered[0], "max": ordered[-1]}


def _machine() -> dict:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def _git(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def compare(args) -> dict:
    """Rounds of one worker per tree, alternating; each workload's median per round, then over rounds."""
    trees = {"this": None} | ({"against": args.against} if args.against else {})
    per: dict = {name: {} for name in trees}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            for workload, samples in _run_worker(tree, args).items():
                per[name].setdefault(workload, []).extend(samples)
    out = {"machine": _machine(), "engine": args.engine, "state_tokens": STATE_TOKENS, "iters": args.iters,
           "warmup": args.warmup, "rounds": args.rounds,
           "trees": {name: {"path": tree or str(HERE.parent), "commit": _git(tree or str(HERE.parent))}
                     for name, tree in trees.items()},
           "results": {name: {w: _summary(s) for w, s in sorted(v.items())} for name, v in per.items()}}
    if args.against:
        mine, theirs = out["results"]["this"], out["results"]["against"]
        out["ratio_p50"] = {w: theirs[w]["p50"] / mine[w]["p50"] for w in mine if w in theirs}
        for count in COUNTS:  # a tree without compile: its best repeated path is the dict
            if f"compiled/{count}" in mine and f"repeated/{count}" in theirs:
                out["ratio_p50"][f"compiled/{count} vs repeated"] = (theirs[f"repeated/{count}"]["p50"]
                                                                    / mine[f"compiled/{count}"]["p50"])
    return out


def markdown(out: dict) -> str:
    lines = ["# Host time per ask, device pass stubbed", "",
             f"{out['machine']['cpu']}, {out['machine']['cores']} cores, Python {out['machine']['python']}; "
             f"a {out['state_tokens']}-token state; {out['rounds']} rounds x {out['iters']} asks after "
             f"{out['warmup']} warm-up per workload and tree, the trees alternating. Milliseconds.", "",
             "Command: `python benchmarks/host_overhead.py --engine " + out["engine"]
             + (" --against TREE" if "against" in out["trees"] else "") + f" --rounds {out['rounds']}`", ""]
    names = list(out["results"])
    head = "| workload | " + " | ".join(f"{n} ({out['trees'][n]['commit']}) p50 / p90" for n in names)
    lines += [head + (" | ratio p50 |" if "ratio_p50" in out else " |"),
              "|---" * (len(names) + 1 + ("ratio_p50" in out)) + "|"]
    workloads = sorted({w for r in out["results"].values() for w in r})
    for w in workloads:
        cells = [f"{out['results'][n][w]['p50']:.3f} / {out['results'][n][w]['p90']:.3f}"
                 if w in out["results"][n] else "-" for n in names]
        row = f"| {w} | " + " | ".join(cells) + " |"
        if "ratio_p50" in out:
            ratio = out["ratio_p50"].get(w)
            row += f" {ratio:.1f}x |" if ratio is not None else " - |"
        lines.append(row)
    for w, ratio in out.get("ratio_p50", {}).items():
        if " vs " in w:
            lines.append(f"| {w} | " + " | ".join("" for _ in names) + f" | {ratio:.1f}x |")
    return "\n".join(lines) + "\n"


BENCH_BACKENDS = ("openvino-cpu", "onnxruntime")


def _bench_workload(engine_dir: str, folder: Path) -> tuple[Path, Path]:
    """(state file, questions file) of the 13-question workload on a ~512-token state, written into ``folder``."""
    sys.path.insert(0, str(HERE))
    from latency import QUESTIONS, state_of_tokens
    from onepass import Engine
    from onepass.runtime.core.questions import to_wire

    engine = Engine.load(engine_dir, verify=False, backend="onnxruntime")
    state, questions = folder / "state.txt", folder / "questions.json"
    state.write_text(state_of_tokens(engine, STATE_TOKENS))
    questions.write_text(json.dumps({qid: to_wire(q) for qid, q in QUESTIONS.items()}))
    engine.close()
    return state, questions


def bench(args) -> dict:
    """``onepass bench`` (warm, closed loop, one sender) of each CPU backend, from each tree in turn, rounds
    alternating; per tree and backend the median over rounds of each run's p50 and p99."""
    work = Path(tempfile.mkdtemp())
    state, questions = _bench_workload(args.engine, work)
    trees = {"this": None} | ({"against": args.against} if args.against else {})
    runs: dict = {name: {} for name in trees}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            env = dict(os.environ)
            if tree:
                link = Path(tempfile.mkdtemp()) / "onepass"
                link.symlink_to(Path(tree).resolve())
                env["PYTHONPATH"] = f"{link.parent}:{env.get('PYTHONPATH', '')}"
            report = work / f"{name}-{r}"
            subprocess.run([sys.executable, "-m", "onepass", "bench", "--engine", args.engine, "--state", str(state),
                            "--questions", str(questions), "--backend", *BENCH_BACKENDS, "--kind", "warm",
                            "--threads", "2", "--requests", str(args.iters), "--warmup", str(args.warmup),
                            "--report", str(report)], env=env, check=True, capture_output=True)
            for run in json.loads((report / "bench.json").read_text())["runs"]:
                runs[name].setdefault(run["target"], []).append({"p50": run["p50"], "p99": run["p99"]})
    out = {"machine": _machine(), "engine": args.engine, "state_tokens": STATE_TOKENS, "requests": args.iters,
           "warmup": args.warmup, "rounds": args.rounds,
           "trees": {name: {"path": tree or str(HERE.parent), "commit": _git(tree or str(HERE.parent))}
                     for name, tree in trees.items()},
           "results": {name: {b: {k: statistics.median(x[k] for x in v) for k in ("p50", "p99")}
                              for b, v in per.items()} for name, per in runs.items()}}
    if args.against:
        out["ratio_p50"] = {b: out["results"]["against"][b]["p50"] / out["results"]["this"][b]["p50"]
                            for b in out["results"]["this"] if b in out["results"]["against"]}
    return out


def bench_markdown(out: dict) -> str:
    names = list(out["results"])
    lines = ["# onepass bench, warm, 13 questions, side by side", "",
             f"{out['machine']['cpu']}, {out['machine']['cores']} cores; a {out['state_tokens']}-token state; "
             f"{out['rounds']} rounds x {out['requests']} requests per backend and tree (one sender, 2 threads), the "
             "trees alternating; medians over rounds of each run's p50 and p99, milliseconds.", "",
             "Command: `python benchmarks/host_overhead.py --engine " + out["engine"]
             + (" --against TREE" if "against" in out["trees"] else "") + f" --bench --rounds {out['rounds']}`", "",
             "| backend | " + " | ".join(f"{n} ({out['trees'][n]['commit']}) p50 / p99" for n in names)
             + (" | before / after p50 |" if "ratio_p50" in out else " |"),
             "|---" * (len(names) + 1 + ("ratio_p50" in out)) + "|"]
    for b in out["results"]["this"]:
        cells = [f"{out['results'][n][b]['p50']:.1f} / {out['results'][n][b]['p99']:.1f}" for n in names]
        ratio = out.get("ratio_p50", {}).get(b)
        lines.append(f"| {b} | " + " | ".join(cells) + (f" | {ratio:.3f} |" if ratio is not None else " |"))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="engines/smollm2")
    parser.add_argument("--iters", type=int, default=40, help="timed asks per workload and round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="worker processes per tree, alternating")
    parser.add_argument("--against", help="another checkout to time in the same run (the code before a change)")
    parser.add_argument("--json", help="where to write the JSON (default benchmarks/results/host_overhead.json)")
    parser.add_argument("--bench", action="store_true", help="onepass bench of the real passes instead (see above)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _import_tree(args.tree)
        print(json.dumps(worker(args.engine, args.iters, args.warmup)))
        return
    out, render = (bench(args), bench_markdown) if args.bench else (compare(args), markdown)
    path = Path(args.json) if args.json else RESULTS / ("host_overhead_bench.json" if args.bench else
                                                        "host_overhead.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    path.with_suffix(".md").write_text(render(out))
    print(render(out))


if __name__ == "__main__":
    main()
