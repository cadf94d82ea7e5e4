"""What a tuned task costs beside a whole-engine tune: the time of `onepass tune --task` against `onepass tune` on the
same rows, and the disk of an engine with two tasks against the engine alone.

For each data set (``--datasets``, two by default): ``--rows`` labelled rows (tune_eval's seeded sample), tuned once
as a whole engine (`tune`, its own candidates and choice) and once as a task of one engine copy (`tune --task`, the
same rows), each timed whole (loading, training, choosing, writing). Then the disk of that copy with its tasks, a
file hard-linked twice counted once (as the file system stores it), against the engine alone.

    python benchmarks/task_cost.py --engine engines/smollm2 [--rows 50] [--datasets tweets_choice rotten]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_eval import _machine, user_rows  # noqa: E402

from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.tune.config import TuneConfig  # noqa: E402
from onepass.calibration.tune.engine import tune  # noqa: E402
from onepass.calibration.tune.task import task_config, tune_task  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def disk(directory: Path) -> int:
    """Bytes ``directory`` holds on disk, a file hard-linked twice counted once."""
    seen = {}
    for p in Path(directory).rglob("*"):
        if p.is_file():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def run(args) -> dict:
    out = {"engine": args.engine, "rows": args.rows, "seed": args.seed, "machine": _machine(), "note": args.note,
           "datasets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tasked = Path(tmp) / "tasked"
        mf.copy_engine(args.engine, tasked)
        for name in args.datasets:
            rows, _ = user_rows(name, args.rows, args.seed)
            data = Path(tmp) / f"{name}.jsonl"
            write_jsonl(rows, data)
            t0 = time.perf_counter()
            tune(args.engine, [data], Path(tmp) / f"{name}_engine", TuneConfig(seed=args.seed), log=lambda *a: None)
            whole = time.perf_counter() - t0
            t0 = time.perf_counter()
            card = tune_task(tasked, [data], name.replace("_", "-"),  # kept whatever wins: its files are measured
                             task_config(TuneConfig(seed=args.seed, keep_base=True)), log=lambda *a: None)
            task = time.perf_counter() - t0
            out["datasets"][name] = {"tune_s": whole, "tune_task_s": task, "ratio": task / whole,
                                     "task_chosen": card["metrics"]["choice"]["chosen"]}
            print(f"{name}: tune {whole:.0f} s, tune --task {task:.0f} s ({task / whole:.2f}x)", flush=True)
        base, with_tasks = disk(Path(args.engine)), disk(tasked)
        out["disk"] = {"engine_bytes": base, "with_tasks_bytes": with_tasks, "ratio": with_tasks / base,
                       "tasks": len(args.datasets),
                       "files": sorted(str(p.relative_to(tasked)) for p in tasked.rglob("*") if p.is_file())}
        print(f"disk: {with_tasks / 2**20:.0f} MiB with {len(args.datasets)} tasks against {base / 2**20:.0f} MiB "
              f"({with_tasks / base:.2f}x)", flush=True)
    return out


def write_md(out: dict, path: Path) -> None:
    d = out["disk"]
    lines = ["# A tuned task's cost: time against a whole-engine tune, disk against the engine alone", "",
             f"`python benchmarks/task_cost.py --engine {out['engine']} --rows {out['rows']}` "
             f"({out['machine']['cpu']}, {out['machine']['when']}); each data set's {out['rows']} rows tuned as a whole "
             "engine (`tune`) and as a task of one engine copy (`tune --task`), each timed whole."
             + (f" {out['note']}" if out.get("note") else ""), "",
             "| data set | tune s | tune --task s | ratio | the task's choice |", "|---|---:|---:|---:|---|"]
    for name, r in out["datasets"].items():
        lines.append(f"| {name} | {r['tune_s']:.0f} | {r['tune_task_s']:.0f} | {r['ratio']:.2f}x | "
                     f"{r['task_chosen']} |")
    lines += ["", f"Disk, a file hard-linked twice counted once: the engine with {d['tasks']} tasks "
              f"{d['with_tasks_bytes'] / 2**20:.1f} MiB against {d['engine_bytes'] / 2**20:.1f} MiB alone "
              f"(**{d['ratio']:.2f}x**). Its files: " + ", ".join(f"`{f}`" for f in d["files"]) + ".", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--datasets", nargs="+", default=["tweets_choice", "rotten"])
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "task_cost"), help="written: OUT.json and OUT.md")
    ap.add_argument("--note", default="", help="how the run was made, written beside its figures")
    args = ap.parse_args()
    out = run(args)
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    write_md(out, Path(args.out + ".md"))


if __name__ == "__main__":
    main()
