"""Does describing an option ever work against it? Accuracy by which options carry a description, two renderings.

    python benchmarks/studies/option_descriptions.py --engine engines/smollm2 [--n 100]

The README ticket answered *sales* when only billing was described: the old option line, ``- {name}:
{description}``, puts a colon after a described name where an undescribed one ends its line, so the model expects
the described name to go on and the answer "{name}<|im_end|>" loses probability. The new line keeps every name
alone on its line, the description indented under it in parentheses. Measured on labelled data nobody here tuned
on for this (the rendering was chosen on the README ticket alone): BBC News topics (5-way) and CrowdFlower tweet
sentiment (3-way), each article asked with no option described, every option described, each option alone
described, and every option but one described; the same states and passes for both renderings.
Writes benchmarks/studies/results/option_descriptions.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for readout_eval
from readout_eval import bbc, tweets  # noqa: E402

from onepass import Choice, Engine  # noqa: E402
from onepass.runtime.core.prompt import OLD_OPTION_LINE as OLD_LINE, PromptTemplate  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DESCRIPTIONS = {
    "bbc": {"business": "companies, markets, trade and the economy", "entertainment": "film, music, television and "
            "celebrities", "politics": "government, elections, parties and parliament", "sport": "matches, players, "
            "teams and competitions", "tech": "computers, the internet, phones and gadgets"},
    "tweets": {"negative": "complaints, anger or disappointment", "neutral": "facts or questions without feeling",
               "positive": "praise, joy or thanks"},
}


def variants(names: list[str]) -> dict[str, set]:
    """Which options are described: none, all, each alone, all but each."""
    out = {"none": set(), "all": set(names)}
    out.update({f"only {n}": {n} for n in names})
    out.update({f"all but {n}": set(names) - {n} for n in names})
    return out


def run(engine: Engine, rows: list[tuple], descriptions: dict, templates: dict) -> dict:
    """Per rendering and variant: accuracy, and the gold option's mean probability when it is described vs when it
    is not. Row by row (each state prefilled once, then every variant and rendering asked about it)."""
    names = list(descriptions)
    kinds = variants(names)
    tally = {(r, v): {"hits": 0, "desc": [], "bare": []} for r in templates for v in kinds}
    for text, question, gold in rows:
        for rendering, template in templates.items():
            engine.encoder.template = template
            for label, described in kinds.items():
                options = {n: (descriptions[n] if n in described else None) for n in names}
                answer = engine.ask(text, {"q": Choice(question.instructions, options)})["q"]
                t = tally[rendering, label]
                t["hits"] += answer.choice == gold
                t["desc" if gold in described else "bare"].append(answer.probabilities[gold])
    mean = lambda v: float(np.mean(v)) if v else None  # noqa: E731
    return {r: {v: {"accuracy": tally[r, v]["hits"] / len(rows), "gold_p_described": mean(tally[r, v]["desc"]),
                    "gold_p_bare": mean(tally[r, v]["bare"])} for v in kinds} for r in templates}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--n", type=int, default=100)
    args = ap.parse_args()
    engine = Engine.load(args.engine)
    new = dataclasses.replace(engine.encoder.template, option_line=PromptTemplate().option_line)
    data = {"bbc": bbc(args.n, random.Random(0)), "tweets": tweets(args.n, random.Random(0), as_score=False)}
    report = {"n": args.n, "backend": engine.backend.name, "new_line": new.option_line, "old_line": OLD_LINE}
    start = time.time()
    templates = {"old": dataclasses.replace(new, option_line=OLD_LINE), "new": new}
    for name, rows in data.items():
        for rendering, result in run(engine, rows, DESCRIPTIONS[name], templates).items():
            report[f"{name}/{rendering}"] = result
            print(name, rendering, json.dumps(result), flush=True)
    engine.encoder.template = new
    report["seconds"] = time.time() - start
    (RESULTS / "option_descriptions.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Option descriptions: accuracy by which options are described", "",
             f"`python benchmarks/studies/option_descriptions.py --engine engines/smollm2 --n {args.n}` ({time.strftime('%Y-%m-%d')}, "
             f"{engine.backend.name}, {report['seconds']:.0f} s). Old line `{OLD_LINE.strip()}`, new line "
             f"`{new.option_line.strip()!r}`. Same articles, same passes over each state; only the option list differs.",
             ""]
    for name in data:
        old, newr = report[f"{name}/old"], report[f"{name}/new"]
        lines += [f"## {name} ({args.n} rows, {len(DESCRIPTIONS[name])} options)", "",
                  "| described | old accuracy | new accuracy | old P(gold) described / bare | new P(gold) described / bare |",
                  "|---|---|---|---|---|"]
        fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
        for label in old:
            o, n = old[label], newr[label]
            lines.append(f"| {label} | {o['accuracy']:.2f} | {n['accuracy']:.2f} | {fmt(o['gold_p_described'])} / "
                         f"{fmt(o['gold_p_bare'])} | {fmt(n['gold_p_described'])} / {fmt(n['gold_p_bare'])} |")
        worst = lambda r: min(v["accuracy"] for v in r.values())  # noqa: E731
        lines += ["", f"Worst variant: old {worst(old):.2f}, new {worst(newr):.2f}; spread (max - min accuracy): old "
                  f"{max(v['accuracy'] for v in old.values()) - worst(old):.2f}, new "
                  f"{max(v['accuracy'] for v in newr.values()) - worst(newr):.2f}.", ""]
    (RESULTS / "option_descriptions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
