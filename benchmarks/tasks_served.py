"""Four tuned tasks served by one engine, end to end: `onepass tune --task` per data set into one
engine, then that engine (the default backend) answering.

1. ``tune``: for each data set, ``--rows`` labelled rows (tune_eval's seeded sample) tuned as a task of a copy of
   ``--engine`` (tune's own settings for the row count; the candidates and the choice are tune's), timed.
2. ``accuracy``: on the data set's test rows (other states, never trained on), each question asked of its task and of
   the engine itself in one request, as served (the task's calibration, or the engine's).
3. ``latency``: the README ticket (~510 tokens) and 12 questions, 3 per task, in one request: asked of the 4 tasks
   against the same 12 untuned, warm (the state cached) and cold (a new state each round), interleaved rounds.
4. ``memory``: the RSS of a fresh process that loads the engine and answers the 12 questions once, with the tasks and
   without (the engine's own graph).

    python benchmarks/tasks_served.py --engine engines/smollm2 --work /tmp/scratch/tasked --rows 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, TICKET  # noqa: E402
from tune_eval import RESULTS, _machine, _majority, user_rows  # noqa: E402

from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core import task_store  # noqa: E402
from onepass.runtime.core.engine import Engine  # noqa: E402
from onepass.runtime.core.questions import from_wire  # noqa: E402

DATASETS = ("bbc", "rotten", "tweets_choice", "tweets_score")
PER_TASK = 3


def with_task(question, task):
    return type(question)(question.instructions, question.criteria, task)


def tune_tasks(work: Path, names, rows: int, config) -> dict:
    from onepass.calibration.tune.task import tune_task

    out = {}
    for name in names:
        if name in task_store.names(work):
            continue
        train, _ = user_rows(name, rows, config.seed)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "train.jsonl"
            write_jsonl(train, path)
            started = time.perf_counter()
            card = tune_task(work, [path], name, config)
            out[name] = {"seconds": time.perf_counter() - started, "chosen": card["metrics"]["choice"]["chosen"],
                         "blocks": len(card["blocks"]), "rank": card["rank"],
                         "train_seconds": card["metrics"]["train_seconds"]}
    return out


def accuracy(engine: Engine, names, rows: int, seed: int) -> dict:
    out = {}
    for name in names:
        _, test = user_rows(name, rows, seed)
        right = {"task": 0, "engine": 0}
        for row in test:
            q = from_wire("q", row["question"])
            answers = engine.ask(row["state"], {"task": with_task(q, name), "engine": q})
            for key, a in answers.items():
                right[key] += predicted(a) == row["label"]
        out[name] = {"rows": len(test), "majority": _majority(test),
                     **{k: v / len(test) for k, v in right.items()}}
    return out


def predicted(answer):
    """An answer as a label: yes/no, the chosen option, or the most probable level's index."""
    if hasattr(answer, "noul"):
        return "yes" if answer.noul >= 0.5 else "no"
    if hasattr(answer, "score"):
        return int(max(answer.probabilities, key=answer.probabilities.get))
    return answer.choice


def twelve(names) -> tuple[dict, dict]:
    """(12 questions, 3 per task, named by task; the same 12 untuned)."""
    base = list(QUESTIONS.values())[:PER_TASK * len(names)]
    tasked = {f"q{i}.{names[i % len(names)]}": with_task(q, names[i % len(names)]) for i, q in enumerate(base)}
    return tasked, {f"q{i}": q for i, q in enumerate(base)}


def latency(engine: Engine, names, rounds: int) -> dict:
    tasked, untuned = twelve(names)
    runs = {"warm: 12 untuned": lambda r: engine.ask(TICKET, untuned),
            "warm: 4 tasks x 3": lambda r: engine.ask(TICKET, tasked),
            "cold: 12 untuned": lambda r: engine.ask(f"{TICKET}\n(round {r}a)", untuned),
            "cold: 4 tasks x 3": lambda r: engine.ask(f"{TICKET}\n(round {r}b)", tasked)}
    times: dict = {k: [] for k in runs}
    for fn in runs.values():
        fn(-1)
    for r in range(rounds):
        for key, fn in runs.items():
            started = time.perf_counter()
            fn(r)
            times[key].append(time.perf_counter() - started)
    return {k: {"p50": statistics.median(v), "p99": sorted(v)[min(len(v) - 1, int(0.99 * len(v)))], "min": min(v)}
            for k, v in times.items()}


def memory(engine_dir: Path, names: list | None) -> int:
    """RSS bytes of a fresh process that loads ``engine_dir`` and answers the 12 questions (of the tasks, or
    untuned where ``names`` is None)."""
    code = ("import sys, json; sys.path.insert(0, %r); from tasks_served import *; "
            "from onepass.runtime.server.memory import rss_bytes; e = Engine.load(%r); names = %r; "
            "e.ask(TICKET, twelve(names)[0] if names else twelve(['x'] * 4)[1]); print(rss_bytes())"
            % (str(Path(__file__).parent), str(engine_dir), names))
    return int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
               .stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--work", default="/tmp/scratch/tasked", help="the engine copy the tasks are added to")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS))
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="tasks_served", help="the results' file name in benchmarks/results (.json, .md)")
    ap.add_argument("--write", choices=("best", "tuned"), default="best", help="tune's --write")
    ap.add_argument("--lr", type=float, default=None, help="tune's --lr (default: its choice for the row count)")
    ap.add_argument("--rlcd-weight", type=float, default=None, help="tune's --rlcd-weight (default: a task's, 0)")
    ap.add_argument("--train-blocks", type=int, default=None, help="tune's --train-blocks (default: a task's, 4)")
    args = ap.parse_args()
    from onepass.calibration.tune.config import TuneConfig
    from onepass.calibration.tune.task import task_config

    config = task_config(TuneConfig(seed=args.seed, write=args.write, lr=args.lr, train_blocks=args.train_blocks,
                                    rlcd_weight=args.rlcd_weight or 0.0), rlcd_given=args.rlcd_weight is not None)
    work = Path(args.work)
    if not work.exists():
        mf.copy_engine(Path(args.engine), work)
    path = RESULTS / f"{args.out}.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    out["machine"], out["rows"] = _machine(), args.rows
    out["config"] = {"write": args.write, "lr": args.lr, "rlcd_weight": args.rlcd_weight,
                     "train_blocks": args.train_blocks}
    out.setdefault("tune", {}).update(tune_tasks(work, args.datasets, args.rows, config))
    path.write_text(json.dumps(out, indent=2) + "\n")
    with Engine.load(work) as engine:
        out["backend"] = engine.backend.name
        out["accuracy"] = accuracy(engine, args.datasets, args.rows, args.seed)
        path.write_text(json.dumps(out, indent=2) + "\n")
        out["latency"] = latency(engine, list(args.datasets), args.rounds)
    out["rss"] = {"engine alone": memory(Path(args.engine), None),
                  "engine with its tasks": memory(work, list(args.datasets))}
    path.write_text(json.dumps(out, indent=2) + "\n")
    write_md(out, args.out)


def write_md(out: dict, stem: str = "tasks_served") -> None:
    m = out["machine"]
    lines = [f"# Four tuned tasks served by one engine ({m['cpu']}, {m['when']})", "",
             f"`onepass tune --task` on {out['rows']} rows of each data set into one engine (tune's settings for the "
             f"row count), then that engine answering ({out.get('backend')}). Test rows: other states, never trained "
             f"on; each question asked of its task and of the engine itself in one request, as served. Settings: "
             f"{out.get('config')} (None: a task's default).", "",
             "| task | chosen | blocks | tune s | test rows | majority | engine | task |", "|---|---|---|---|---|---|---|---|"]
    for name, a in out.get("accuracy", {}).items():
        t = out["tune"].get(name, {})
        lines.append(f"| {name} | {t.get('chosen', '-')} | {t.get('blocks', '-')} | {t.get('seconds', 0):.0f} | "
                     f"{a['rows']} | {a['majority']:.3f} | {a['engine']:.3f} | **{a['task']:.3f}** |")
    if "latency" in out:
        lat = out["latency"]
        lines += ["", "The README ticket, 12 questions (3 per task) in one request, seconds (p50 / p99 / min):", "",
                  "| | p50 | p99 | min |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['p50']:.3f} | {v['p99']:.3f} | {v['min']:.3f} |" for k, v in lat.items()]
        for kind in ("warm", "cold"):
            ratio = lat[f"{kind}: 4 tasks x 3"]["p50"] / lat[f"{kind}: 12 untuned"]["p50"]
            lines.append(f"\n{kind}: 4 tasks x 3 / 12 untuned = **{ratio:.2f}x**")
    if "rss" in out:
        lines += ["", "RSS of a fresh process loading the engine and answering the 12 questions once: " + "; ".join(
            f"{k} {v / 2**20:.0f} MiB" for k, v in out["rss"].items() if v)]
        r = out["rss"]
        if r.get("engine alone"):
            lines.append(f"(ratio {r['engine with its tasks'] / r['engine alone']:.2f}x)")
    blocks = (out.get("config") or {}).get("train_blocks")
    lines += ["", f"    python benchmarks/tasks_served.py --engine engines/smollm2 --work /tmp/scratch/{stem} --rows "
              f"{out['rows']}" + (f" --train-blocks {blocks}" if blocks is not None else "")
              + (f" --out {stem}" if stem != "tasks_served" else "")]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
