"""Two prompt forms side by side (issue 46): packed tokens, GFLOP and time of the README ticket's pass, and accuracy
on rows neither engine's adapter was trained on.

``--chat`` is the shipped engine as it was (the ``chat`` form: each question closes the user's turn and opens the
assistant's, under a hint such as "Answer yes or no."); ``--compact`` an engine whose adapter was trained in the
``compact`` form (``prompt.FORMS``: the question stays in the user's turn and ends "Answer:", no hint that only
repeats the options), by `make train-default`. Each engine answers in the form its adapter was
trained in, so the comparison is of the whole product: form and adapter.

* Work: the 13 questions over a 511-token state, one pass: packed tokens (per question), read-outs, GFLOP by part
  (``roofline.pass_flops``).
* Time: the 13 questions on the README ticket, warm (the state cached) and cold (no cache), both engines on the
  default backend, interleaved round by round after a warm-up round; medians.
* Accuracy: ``--heldout`` rows (``python -m onepass.calibration.mixture --heldout``: Rotten Tomatoes as sentiment
  and as plot vs review, the generated ``compare`` family: held out of the mixture, never trained on by either
  adapter); accuracy and NLL per data set, each engine through its own read-out and calibration.

Writes benchmarks/results/prompt_forms.{json,md}.

    python benchmarks/prompt_forms.py --chat engines/smollm2-chat --compact engines/smollm2 --heldout build/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, TICKET, interleaved, state_of_tokens  # noqa: E402
from roofline import gemm_shapes, pass_flops  # noqa: E402

from onepass.calibration.evaluate import evaluate_engine  # noqa: E402
from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.guarantee import cpu_model  # noqa: E402
from onepass.runtime.core.prompt import FORMS  # noqa: E402

RESULTS = Path(__file__).parent / "results"
THREADS = 2


def work(engine: Engine) -> dict:
    """Packed tokens, read-outs and GFLOP of the 13 questions over a 511-token state in one pass."""
    state = engine.state(state_of_tokens(engine, 512))
    batch = engine.pack(state, engine.encode_questions(QUESTIONS))
    n, readouts = batch.num_tokens, batch.readout_index.shape[0]
    flops = pass_flops(engine, gemm_shapes(engine), n, state.num_tokens, readouts)
    return {"state_tokens": state.num_tokens, "packed_tokens": n, "per_question": round(n / len(QUESTIONS), 1),
            "readouts": readouts, "gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
            "gflop_total": round(sum(flops.values()) / 1e9, 1)}


def training(m) -> dict:
    """How the engine's adapter was trained, from its manifest: rows, steps, the held-out split's best (the mixture's
    own held-out states: each adapter's split, not comparable across mixtures)."""
    t = m.tuning
    if t is None:
        return {}
    best = (t.metrics or {}).get("heldout_best") or {}
    return {"data": [f"{d.get('path')} ({d.get('rows')} rows)" for d in t.data or []], "rows": t.rows,
            "steps": t.steps, "best_step": best.get("step"), "heldout_accuracy": best.get("accuracy"),
            "heldout_nll": best.get("nll"), "heldout_rows": t.holdout_rows}


def speed(dirs: dict, rounds: int) -> dict:
    """Warm and cold seconds of the README ticket's 13 questions, the engines interleaved round by round."""
    warm = {name: Engine.load(d, threads=THREADS) for name, d in dirs.items()}
    cold = {name: Engine.load(d, threads=THREADS, cache_bytes=0) for name, d in dirs.items()}
    times = interleaved({f"{name} {kind}": lambda e=engines[name]: e.ask(TICKET, QUESTIONS)  # round 0 fills the caches
                         for name in dirs for kind, engines in (("warm", warm), ("cold", cold))}, rounds)
    backends = {name: f"{warm[name].backend.name} / {cold[name].backend.name}" for name in dirs}
    for engine in [*warm.values(), *cold.values()]:
        engine.close()
    return {"backend": "; ".join(f"{n}: {b}" for n, b in backends.items()),
            **{k: {"p50_s": round(statistics.median(v), 3), "min_s": round(min(v), 3)} for k, v in times.items()}}


def accuracy(engine_dir: str, heldout: str) -> dict:
    """Accuracy and NLL on the held-out rows, overall and per data set."""
    report = evaluate_engine(engine_dir, heldout, threads=THREADS)
    keep = lambda b: {"accuracy": round(b["accuracy"], 3), "nll": round(b["nll"], 3), "rows": b["rows"]}  # noqa: E731
    return {"all": keep(report["all"]), **{name: keep(b) for name, b in report["datasets"].items()}}


def _trained(name: str, t: dict) -> str:
    return (f"{name}: {t['rows']} rows from {', '.join(t['data'])}, {t['steps']} steps, best at step {t['best_step']} "
            f"(held-out accuracy {t['heldout_accuracy']:.3f}, NLL {t['heldout_nll']:.3f} on {t['heldout_rows']} rows)")


def markdown(res: dict) -> str:
    names = list(res["engines"])
    lines = [f"# Prompt forms side by side ({res['cpu']}, {THREADS} threads, {res['when']})", "",
             "Each engine answers in the form its adapter was trained in: " + "; ".join(
                 f"**{n}** `{res['engines'][n]['dir']}` ({res['engines'][n]['adapter']})" for n in names) + ".", "",
             "Training (each adapter's own held-out split of its own mixture, so not comparable across them): "
             + "; ".join(_trained(n, res["engines"][n]["training"]) for n in names if res["engines"][n]["training"])
             + ".", "",
             "## Work of one pass: the README's 13 questions over a 511-token state", "",
             "| form | packed tokens | per question | read-outs | GFLOP | block GEMMs | attention | read-out |",
             "|---|---|---|---|---|---|---|---|"]
    for n in names:
        w = res["engines"][n]["work"]
        g = w["gflop"]
        lines.append(f"| {n} | {w['packed_tokens']} | {w['per_question']} | {w['readouts']} | {w['gflop_total']} | "
                     f"{g['block GEMMs']} | {g['attention']} | {g['read-out']} |")
    s = res["speed"]
    lines += ["", f"## Time: the README ticket's 13 questions ({s['backend']}, medians of {res['rounds']} interleaved "
              "rounds after a warm-up; min in brackets)", "", "| form | warm s | cold s |", "|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {s[n + ' warm']['p50_s']} ({s[n + ' warm']['min_s']}) | "
                     f"{s[n + ' cold']['p50_s']} ({s[n + ' cold']['min_s']}) |")
    base = names[0]
    for n in names[1:]:
        lines.append(f"\n{n} against {base}: warm {s[base + ' warm']['p50_s'] / s[n + ' warm']['p50_s']:.2f}x, "
                     f"cold {s[base + ' cold']['p50_s'] / s[n + ' cold']['p50_s']:.2f}x faster.")
    sets = list(res["engines"][base]["accuracy"])
    lines += ["", f"## Accuracy on rows no adapter was trained on (`{res['heldout']}`)", "",
              "| data set | rows | " + " | ".join(f"{n} accuracy | {n} NLL" for n in names) + " |",
              "|---|---|" + "---|---|" * len(names)]
    for d in sets:
        a = [res["engines"][n]["accuracy"][d] for n in names]
        cells = " | ".join(f"{x['accuracy']:.3f} | {x['nll']:.3f}" for x in a)
        lines.append(f"| {d} | {a[0]['rows']} | {cells} |")
    for n in names[1:]:
        a, b = res["engines"][base]["accuracy"]["all"], res["engines"][n]["accuracy"]["all"]
        se = (a["accuracy"] * (1 - a["accuracy"]) / a["rows"]) ** 0.5
        kept = b["accuracy"] >= a["accuracy"] - se
        lines += ["", f"**{n} against {base}, all held-out rows: {b['accuracy'] - a['accuracy']:+.3f} accuracy "
                  f"(one standard error {se:.3f}), NLL {b['nll'] - a['nll']:+.3f}: accuracy "
                  f"{'kept' if kept else 'not kept'}.**"]
    lines += ["", "One standard error of an accuracy near 0.7 on 150 rows is about 3.7 points.", "",
              "    " + res["command"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chat", required=True, help="the engine whose adapter was trained in the chat form")
    ap.add_argument("--compact", required=True, help="the engine whose adapter was trained in the compact form")
    ap.add_argument("--heldout", required=True, help="JSONL rows neither adapter was trained on")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "prompt_forms"))
    args = ap.parse_args(argv)
    dirs = {"chat": args.chat, "compact": args.compact}
    res = {"cpu": cpu_model() or platform.machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "rounds": args.rounds, "heldout": args.heldout, "engines": {},
           "command": "python benchmarks/prompt_forms.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for name, d in dirs.items():
        with Engine.load(d, threads=THREADS) as engine:
            m = engine.manifest
            if m.prompt != FORMS[name]:
                raise SystemExit(f"--{name} {d}: its prompt is not the {name} form ({m.prompt.question!r})")
            adapters = (m.source or {}).get("adapters") or []
            res["engines"][name] = {"dir": d, "work": work(engine), "training": training(m),
                                    "adapter": f"{len(adapters)} adapter(s), readout {m.scoring.readout}"}
    res["speed"] = speed(dirs, args.rounds)
    for name, d in dirs.items():
        res["engines"][name]["accuracy"] = accuracy(d, args.heldout)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
