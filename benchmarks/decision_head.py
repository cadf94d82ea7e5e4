"""Train and measure the RLCD decision head on BIG-bench (tasks a..g only), then export it.

    python benchmarks/decision_head.py --engine engines/smollm2 [--export engines/smollm2-head]

Steps: fetch the ``bigbench`` sdist (PyPI) into the cache; take up to ``--per-task`` examples
of every a..g multiple-choice task with at least 10 usable examples; split the *tasks* into
train / val / test (seeded); extract option features with the exported decoder in PyTorch
(cached); fit temperature calibration on the train+val tasks; select heads (a small grid:
linear vs MLP, cross-entropy only vs + RLCD, epochs) by leave-tasks-out cross-validation on
the train+val tasks; retrain the selected ones on train+val; report every method on the test
tasks, which no step has seen. Tasks h..z are never read.
Writes ``benchmarks/results/decision_head.{md,json}`` and the selected head to the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from onepass.calibration.data import bigbench as bb
from onepass.calibration.heads import head as hd
from onepass.calibration.scoring.fit import fit
from onepass.calibration.heads.features import OptionFeatures, extract
from onepass.calibration.scoring.metrics import accuracy, brier, ece, nll
from onepass.export.model_source import cache_root
from onepass.runtime.core import manifest as mf
from onepass.runtime.core.prompt import PromptEncoder
from onepass.runtime.core.readout import softmax

RESULTS = Path(__file__).parent / "results"
GRID = [hd.HeadConfig(width=w, rlcd_weight=r, lr=1e-3, weight_decay=wd, epochs=10)
        for w, wd in ((0, 1.0), (16, 0.01)) for r in (0.0, 1.0)]
FOLDS = 5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def padded(probs: list[np.ndarray]) -> np.ndarray:
    """[N, Kmax] probabilities, zero-padded."""
    k = max(len(p) for p in probs)
    out = np.zeros((len(probs), k))
    for i, p in enumerate(probs):
        out[i, :len(p)] = p
    return out


def metrics(probs: list[np.ndarray], labels: np.ndarray) -> dict:
    p = padded(probs)
    return {"n": int(len(labels)), "accuracy": accuracy(p, labels), "nll": nll(p, labels), "brier": brier(p, labels),
            "ece": ece(p, labels)}


def calibration_rows(feats: OptionFeatures) -> list[dict]:
    z = feats.mean_logprob()
    return [{"type": "choice", "scores": z[feats.offsets[i]:feats.offsets[i + 1]].tolist(), "label": int(feats.label[i]),
             "qkey": None, "names": None} for i in range(feats.num_questions)]


def calibrated(cal, feats: OptionFeatures) -> list[np.ndarray]:
    return [softmax(cal.apply("choice", np.array(r["scores"]), None, None)) for r in calibration_rows(feats)]


def majority(train_free: OptionFeatures) -> list[np.ndarray]:
    """Always the option position most often correct *within the task* (an oracle prior, for scale)."""
    out = []
    counts: dict = {}
    for i in range(train_free.num_questions):
        counts.setdefault(str(train_free.task[i]), Counter())[int(train_free.label[i])] += 1
    for i in range(train_free.num_questions):
        k = int(train_free.offsets[i + 1] - train_free.offsets[i])
        best = counts[str(train_free.task[i])].most_common(1)[0][0]
        p = np.zeros(k)
        p[min(best, k - 1)] = 1.0
        out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--per-task", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--features", help="cached features .npz (default: in the onepass cache)")
    ap.add_argument("--export", help="also export an engine with the selected head into this directory")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    examples, split = bb.training_examples(bb.fetch(cache_root()), args.per_task, args.seed)
    log(f"{sum(map(len, split.values()))} usable a..g tasks, {len(examples)} examples; split "
        + ", ".join(f"{k} {len(v)} tasks" for k, v in split.items()))

    engine_dir = Path(args.engine)
    manifest = mf.load(engine_dir, verify=False)
    cache = Path(args.features or cache_root() / f"bigbench-features-{args.per_task}-{args.seed}.npz")
    if cache.exists():
        feats = OptionFeatures.load(cache)
    else:
        from onepass.runtime.backends.torch_decoder import PackedDecoder
        from onepass.export.model_source import engine_source, load_model

        encoder = PromptEncoder(str(engine_dir / manifest.tokenizer), manifest.prompt)
        decoder = PackedDecoder(load_model(*engine_source(manifest)).model).eval()
        feats = extract(decoder, encoder, examples)
        feats.save(cache)
    if feats.num_questions != len(examples):
        raise SystemExit(f"{cache} holds {feats.num_questions} questions, expected {len(examples)}: delete it")
    part = {k: feats.select(np.isin(feats.task, v)) for k, v in split.items()}
    log(f"features ready ({time.perf_counter() - t0:.0f}s): " + ", ".join(f"{k} {f.num_questions}" for k, f in part.items()))

    dev = feats.select(np.isin(feats.task, split["train"] + split["val"]))  # everything but the test tasks
    cal = fit(calibration_rows(dev), readout="mean")
    runs = []
    for config in GRID:
        cv = hd.cross_validate(dev, config, folds=FOLDS, seed=args.seed)
        runs.append((config, cv))
        log(f"  width {config.width} RLCD {config.rlcd_weight} wd {config.weight_decay}: CV acc {cv['accuracy']:.3f} "
            f"NLL {cv['nll']:.3f} at {cv['epochs']} epochs")

    def final(rows):
        config, cv = min(rows, key=lambda r: r[1]["nll"])
        config = replace(config, epochs=cv["epochs"])
        return config, hd.train(dev, None, config)[0]

    best_ce = final([r for r in runs if r[0].rlcd_weight == 0])
    best_rl = final([r for r in runs if r[0].rlcd_weight > 0])

    test = part["test"]
    methods = {
        "majority position (per task, oracle)": majority(test),
        "zero-shot (mean read-out)": test.zero_shot_probabilities(),
        "zero-shot + temperature (fit on train+val tasks)": calibrated(cal, test),
        "head, cross-entropy only": hd.probabilities(best_ce[1], test),
        "head, cross-entropy + RLCD": hd.probabilities(best_rl[1], test),
    }
    table = {name: metrics(p, test.label) for name, p in methods.items()}
    per_task = {}
    for task in sorted(np.unique(test.task)):
        mask = test.task == task
        per_task[str(task)] = {name: metrics([p for p, m in zip(probs, mask) if m], test.label[mask])
                               for name, probs in methods.items()}

    head_path = cache_root() / "decision-head.pt"
    config, model = best_rl[0], best_rl[1]
    info = {"data": f"bigbench {bb.VERSION} (PyPI sdist), tasks a..g only", "split": split,
            "per_task": args.per_task, "seed": args.seed, "recipe": asdict(config),
            "test_metrics": table["head, cross-entropy + RLCD"],
            "zero_shot_test_metrics": table["zero-shot (mean read-out)"]}
    hd.save(model, config, head_path, info)
    report = {"split": split, "examples": {k: f.num_questions for k, f in part.items()},
              "selected": {"ce": asdict(best_ce[0]), "rlcd": asdict(best_rl[0])},
              "cv": [{"config": asdict(c), **{k: v for k, v in cv.items() if k != "curve"}, "curve": cv["curve"]}
                     for c, cv in runs],
              "test": table, "test_per_task": per_task, "beta": float(model.beta.detach()), "head": str(head_path),
              "seconds": round(time.perf_counter() - t0, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decision_head.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "decision_head.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    if args.export:
        from onepass.export.build import export_engine
        from onepass.export.model_source import engine_source

        spec, adapters = engine_source(manifest)
        export_engine(args.export, spec, adapters=adapters, name=manifest.name + "-head",
                      limits=manifest.limits, prompt=manifest.prompt, head=model.head,
                      head_info=mf.HeadInfo(beta=float(model.beta.detach()), width=config.width, training=info))
    return 0


def markdown(report: dict) -> str:
    lines = ["# Decision head (RLCD) on held-out BIG-bench tasks", "",
             "Produced by `python benchmarks/decision_head.py` (tasks a..g only; whole tasks held out).", "",
             f"Split (tasks): train {len(report['split']['train'])}, val {len(report['split']['val'])}, "
             f"test {len(report['split']['test'])}; examples {report['examples']}.",
             f"Test tasks (never seen in training, tuning or selection): {', '.join(report['split']['test'])}.", "",
             "| method | accuracy | NLL | Brier | ECE (15 bins) |", "|---|---|---|---|---|"]
    for name, m in report["test"].items():
        lines.append(f"| {name} | {m['accuracy']:.3f} | {m['nll']:.3f} | {m['brier']:.3f} | {m['ece']:.3f} |")
    zs, rl = report["test"]["zero-shot (mean read-out)"], report["test"]["head, cross-entropy + RLCD"]
    lines += ["", f"RLCD head vs zero-shot: {100 * (rl['accuracy'] - zs['accuracy']):+.1f} accuracy points "
              f"(target +10), ECE {zs['ece']:.3f} -> {rl['ece']:.3f}. beta = {report['beta']:.3f}.", "",
              "Per test task (accuracy: zero-shot / calibrated / head CE / head RLCD):", "",
              "| task | n | zero-shot | calibrated | head CE | head RLCD |", "|---|---|---|---|---|---|"]
    for task, ms in report["test_per_task"].items():
        vals = [m["accuracy"] for name, m in ms.items() if not name.startswith("majority")]
        n = next(iter(ms.values()))["n"]
        lines.append(f"| {task} | {n} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines += ["", f"Selection: {FOLDS}-fold leave-tasks-out cross-validation on the train+val tasks (held-out NLL "
              "per epoch); the selected configuration is retrained on all train+val tasks for its best epoch count.",
              "", "| width | RLCD weight | weight decay | CV acc | CV NLL | epochs |", "|---|---|---|---|---|---|"]
    for v in report["cv"]:
        c = v["config"]
        lines.append(f"| {c['width']} | {c['rlcd_weight']} | {c['weight_decay']} | {v['accuracy']:.3f} | "
                     f"{v['nll']:.3f} | {v['epochs']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
