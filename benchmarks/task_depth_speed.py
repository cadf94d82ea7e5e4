"""A task tuned into an engine as a head read at a depth: its passes and prefills cut there, against every block.

`onepass tune --task` on ``--rows`` labelled rows of a data set (its default candidates: base, base+calibrate, the
decision head read after 40/50/60/80% of the blocks and after all of them; no LoRA run under --lora-min-rows), into a
copy of the engine. Then the same tasked engine loaded twice: as served (the slot graph cut at the task's depth runs
its passes and its states' prefills: ``runtime/core/depths.py``) and with ``cut_graphs=False`` (every pass runs every
block: the same answers). Both answer the README ticket's 13 questions asked of the task, warm (the state cached) and
cold (prefilled in the call), in interleaved rounds after a warm-up round (medians and p90), beside the engine's own
13 questions untasked on the untouched engine (every block: what the README measures). Also: the largest difference
between the two ways' probabilities, each way's resident memory (VmHWM of a process of its own that loads the engine
and answers once), the tune's seconds, and the task's accuracy and NLL as served on TEST_ROWS rows of other states.
llama.cpp's medians come from ``--llama-reference`` (the same CPU model, another run: not side by side), which
answers zero-shot at full depth.

    python benchmarks/task_depth_speed.py --engine engines/smollm2 [--dataset bbc] [--rows 200] [--rounds 11]
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

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, TICKET, interleaved  # noqa: E402
from tune_eval import TEST_ROWS, _machine, user_rows  # noqa: E402

from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.data.rows import load_rows  # noqa: E402
from onepass.calibration.tune.config import TuneConfig  # noqa: E402
from onepass.calibration.tune.task import task_config, tune_task  # noqa: E402
from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.guarantee import cpu_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"
THREADS = 2
RSS = ("import sys; from onepass.runtime import Engine; sys.path.insert(0, {bench!r}); "
       "from latency import QUESTIONS, TICKET; e = Engine.load({engine!r}, threads=2, cut_graphs={cut}); "
       "e.ask(TICKET, {questions}); "
       "print(next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')))")


def asked_of(task: str | None) -> dict:
    """The README ticket's 13 questions, asked of ``task``."""
    return {k: type(q)(q.instructions, q.criteria, task) for k, q in QUESTIONS.items()}


def rss_mib(engine: Path, cut: bool, task: str | None) -> float:
    """Peak resident memory (MiB) of a process that loads ``engine`` and answers the 13 questions once."""
    questions = "{k: type(q)(q.instructions, q.criteria, %r) for k, q in QUESTIONS.items()}" % task
    code = RSS.format(bench=str(Path(__file__).parent), engine=str(engine), cut=cut, questions=questions)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def probabilities(answer) -> np.ndarray:
    if not hasattr(answer, "probabilities"):
        return np.array([answer.noul, 1 - answer.noul])
    return np.array(list(answer.probabilities.values()))


def served(engine: Engine, path: Path, task: str) -> dict:
    """Accuracy and NLL of the task as served (its calibration applied) on the labelled rows at ``path``."""
    rows, _ = load_rows([path])
    hits, nll = 0, 0.0
    for r in rows:
        q = r.question
        p = probabilities(engine.ask(r.state, {"q": type(q)(q.instructions, q.criteria, task)})["q"])
        hits += int(np.argmax(p) == r.label)
        nll -= float(np.log(max(p[r.label], 1e-12)))
    return {"accuracy": round(hits / len(rows), 4), "nll": round(nll / len(rows), 4), "rows": len(rows)}


def llama_side_by_side(engine: Engine, questions: dict):
    """llama.cpp's best state reuse on the engine's own token ids of the ticket and ``questions``
    (``llama_cpp_side_by_side.LlamaBranching``), or None where llama-cpp-python or the GGUF is not installed."""
    from llama_cpp_side_by_side import LlamaBranching, gguf

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    model = gguf()
    if model is None:
        return None
    prepared = engine.prepare(TICKET, questions)
    return LlamaBranching(model, list(prepared.ids), list(prepared.encoded))


def run(args, work: Path) -> dict:
    tasked, task = work / "tasked", args.dataset.replace("_", "-")
    train, test = user_rows(args.dataset, args.rows, args.seed)
    if (tasked / "tasks" / task).is_dir():  # tuned by an earlier run into the same --work: its card's time
        card = json.loads((tasked / "tasks" / task / "task.json").read_text())
        tune_s = json.loads((work / "tune_s.json").read_text())
    else:
        mf.copy_engine(args.engine, tasked)
        data = work / "train.jsonl"
        write_jsonl(train, data)
        t0 = time.perf_counter()
        card = tune_task(tasked, [data], task, task_config(TuneConfig(seed=args.seed)), log=print)
        tune_s = time.perf_counter() - t0
        (work / "tune_s.json").write_text(json.dumps(tune_s))
    engines = {"cut": Engine.load(tasked, threads=THREADS), "every block": Engine.load(tasked, threads=THREADS,
                                                                                         cut_graphs=False),
               "engine": Engine.load(args.engine, threads=THREADS)}
    colds = {k: Engine.load(p, threads=THREADS, cache_bytes=0, cut_graphs=k == "cut")
             for k, p in (("cut", tasked), ("every block", tasked), ("engine", args.engine))}
    asked = {"cut": asked_of(task), "every block": asked_of(task), "engine": asked_of(None)}
    cut_p = engines["cut"].ask(TICKET, asked["cut"])
    every_p = engines["every block"].ask(TICKET, asked["every block"])
    diff = max(float(np.abs(probabilities(cut_p[k]) - probabilities(every_p[k])).max()) for k in QUESTIONS)
    runs = {}
    for k in engines:
        runs[f"{k} warm"] = lambda e=engines[k], q=asked[k]: e.ask(TICKET, q)
        runs[f"{k} cold"] = lambda e=colds[k], q=asked[k]: e.ask(TICKET, q)
    branching = llama_side_by_side(engines["engine"], asked["engine"])
    if branching is not None:  # in the same rounds: side by side
        runs["llama.cpp warm"] = lambda: branching.ask(cold=False)
        runs["llama.cpp cold"] = lambda: branching.ask(cold=True)
    times = interleaved(runs, args.rounds, progress=lambda r: print(f"round {r}/{args.rounds}", file=sys.stderr))
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in times.items()}
    ratio = {f"{base} / cut {w}": med[f"{base} {w}"] / med[f"cut {w}"] for base in ("every block", "engine")
             for w in ("warm", "cold")}
    llama = None
    if branching is not None:
        llama = {w: med[f"llama.cpp {w}"] for w in ("warm", "cold")}
        ratio.update({f"llama.cpp / cut {w}": llama[w] / med[f"cut {w}"] for w in ("warm", "cold")})
        args.llama_reference = None  # measured here, in the same rounds
    elif args.llama_reference:
        ref = json.loads(Path(args.llama_reference).read_text())
        if ref.get("cpu") != cpu_model():
            raise SystemExit(f"{args.llama_reference} was measured on {ref.get('cpu')!r}, this CPU is {cpu_model()!r}")
        llama = {w: ref["median_s"][f"llama.cpp {w}"] for w in ("warm", "cold")}
        ratio.update({f"llama.cpp / cut {w}": llama[w] / med[f"cut {w}"] for w in ("warm", "cold")})
    head = card.get("head") or {}
    result = {"cpu": cpu_model(), "machine": _machine(), "threads": THREADS, "rounds": args.rounds,
              "engine": args.engine, "dataset": args.dataset, "rows": args.rows, "seed": args.seed,
              "backends": {k: e.backend.name for k, e in engines.items()},
              "chosen": card["metrics"]["choice"]["chosen"], "depth": head.get("depth"),
              "blocks": engines["engine"].manifest.model.num_layers, "tune_task_s": round(tune_s, 1),
              "cut_graphs": sorted(engines["cut"].depths.backends), "backend": engines["cut"].backend.name,
              "max_abs_dp_cut_vs_every_block": diff,
              "median_s": {k: round(v, 4) for k, v in med.items()}, "p90_s": {k: round(v, 4) for k, v in p90.items()},
              "ratio": {k: round(v, 2) for k, v in ratio.items()},
              "llama_cpp_s": llama, "llama_reference": args.llama_reference,
              "llama_cpp_version": __import__("llama_cpp").__version__ if branching is not None else None,
              "candidates": card["metrics"]["choice"]["candidates"]}
    for e in (*engines.values(), *colds.values()):
        e.close()
    result["rss_mib"] = {"cut": round(rss_mib(tasked, True, task), 1),
                         "every block": round(rss_mib(tasked, False, task), 1),
                         "engine": round(rss_mib(Path(args.engine), True, None), 1)}
    write_jsonl(test[:TEST_ROWS], work / "test.jsonl")
    with Engine.load(tasked, threads=THREADS) as e:
        result["test"] = served(e, work / "test.jsonl", task)
    return result


def markdown(r: dict) -> str:
    m, p, x = r["median_s"], r["p90_s"], r["ratio"]
    lines = [f"# A task read at a depth: its passes and prefills cut there ({r['cpu']}, {r['threads']} threads)", "",
             f"`python benchmarks/task_depth_speed.py --engine {r['engine']} --dataset {r['dataset']} --rows "
             f"{r['rows']} --rounds {r['rounds']}` ({r['machine']['when']}). `tune --task` on {r['rows']} rows of "
             f"{r['dataset']} chose **{r['chosen']}** (its head read after {r['depth'] or r['blocks']} of "
             f"{r['blocks']} blocks) in {r['tune_task_s']:.0f} s; the tasked engine served as it loads (the slot graph "
             f"cut at {r['cut_graphs'] or 'no'} blocks runs the task's passes and prefills, {r['backend']}) and with "
             "`cut_graphs=False` (every block, the same answers: largest probability difference "
             f"{r['max_abs_dp_cut_vs_every_block']:.1e}), on the README ticket's 13 questions asked of the task; "
             "beside them the untouched engine's 13 questions untasked (every block). "
             f"{r['rounds']} interleaved rounds after a warm-up.", "",
             "| | warm median | warm p90 | cold median | cold p90 | peak RSS |", "|---|---:|---:|---:|---:|---:|"]
    for k in ("cut", "every block", "engine"):
        lines.append(f"| {k} | {m[f'{k} warm'] * 1000:.1f} ms | {p[f'{k} warm'] * 1000:.1f} ms | "
                     f"{m[f'{k} cold'] * 1000:.1f} ms | {p[f'{k} cold'] * 1000:.1f} ms | {r['rss_mib'][k]:.0f} MiB |")
    lines += ["", f"Cut against every block: **{x['every block / cut warm']:.2f}x warm, "
              f"{x['every block / cut cold']:.2f}x cold**; against the engine's own untasked questions "
              f"{x['engine / cut warm']:.2f}x warm, {x['engine / cut cold']:.2f}x cold."]
    if r.get("llama_cpp_s"):
        where = (f"{r['llama_reference']}: the same CPU model, another run, not side by side" if r["llama_reference"]
                 else f"llama-cpp-python {r['llama_cpp_version']}, in the same interleaved rounds")
        lines.append(f"Against llama.cpp's best state reuse ({where}; zero-shot, every block: "
                     f"{r['llama_cpp_s']['warm'] * 1000:.1f} ms warm, {r['llama_cpp_s']['cold'] * 1000:.1f} ms cold): "
                     f"{x['llama.cpp / cut warm']:.2f}x warm, {x['llama.cpp / cut cold']:.2f}x cold.")
    t = r["test"]
    lines += ["", f"Served on {t['rows']} rows of other states: accuracy **{t['accuracy']:.3f}**, NLL {t['nll']:.3f}.",
              "", "Candidates (cross-validated over whole states):", "",
              "| candidate | NLL | accuracy |", "|---|---:|---:|"]
    for c in r["candidates"]:
        lines.append(f"| {c['name']} | {c.get('heldout_nll', float('nan')):.4f} | "
                     f"{c.get('heldout_accuracy', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--dataset", default="bbc")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--llama-reference", default=None, help="a llama_cpp_side_by_side result of this CPU model")
    ap.add_argument("--work", default=None, help="a folder kept for the tasked engine (an earlier run's is reused)")
    ap.add_argument("--out", default=None, help="written: OUT.json and OUT.md (default task_depth_speed_DATASET)")
    args = ap.parse_args()
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        result = run(args, Path(args.work))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args, Path(tmp))
    out = RESULTS / (args.out or f"task_depth_speed_{args.dataset}")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
