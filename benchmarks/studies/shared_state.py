"""What a shared state cache costs a tuned task (issue 45, item 2): the adapter on the state and the question, or on the
question and option tokens only.

Several tuned tasks can share one prefill of a state only if the state's K/V are the base engine's: a task's
parameters then act on its own question and option tokens. This trains the same LoRA twice on the same rows, with
the same seed, settings (tune's own choice for the row count) and held-out split for early stopping:

* ``whole``: the adapter on every token, state included (what `onepass tune` writes today, one engine per task);
* ``question``: the state's K/V from the base weights (``PackedScorer(state_weights=...)``), computed once per state;
  only the packed tokens pass through the adapter.

Both are then scored on test rows of other states (never trained on) by the very computation they were trained with
(the scorer: for ``question`` that is an engine prefilling with the base and answering with the task), so the gap is
the accuracy the shared cache costs. Training seconds and rows/s beside each.

    python benchmarks/studies/shared_state.py --base engines/smollm2-base --datasets bbc rotten tweets_choice tweets_score
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from tune_eval import RESULTS, _machine, _majority, user_rows  # noqa: E402

import torch  # noqa: E402

from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.tune.config import TuneConfig, resolved  # noqa: E402
from onepass.calibration.tune.trainer import PackedScorer, Trainer, encode_groups, evaluate  # noqa: E402
from onepass.calibration.data.rows import group_by_state, load_rows, split_states  # noqa: E402
from onepass.calibration.tune.engine import _trainable  # noqa: E402
from onepass.export.model_source import engine_source, load_model  # noqa: E402
from onepass.runtime.backends.torch_decoder import PackedDecoder  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.prompt import PromptEncoder  # noqa: E402

MODES = ("whole", "question")


def _rows(rows: list[dict], tmp: Path, name: str):
    """``rows`` (dicts) as tune's rows, read back through its own loader."""
    path = tmp / f"{name}.jsonl"
    write_jsonl(rows, path)
    return load_rows([path])[0]


def run_mode(mode: str, base_dir: str, train_rows, test_rows, config: TuneConfig, work: Path) -> dict:
    """Train one LoRA in ``mode`` on ``train_rows`` (20% of their states held out for early stopping); its test
    accuracy and NLL by the scorer it was trained with, and the seconds it trained."""
    base = mf.load(Path(base_dir), verify=False)
    encoder = PromptEncoder(str(Path(base_dir) / base.tokenizer), base.prompt)
    train_groups, held_groups = split_states(group_by_state(train_rows), config.holdout, config.seed)
    config = resolved(config, sum(len(g) for g in train_groups), base.model.num_layers,
                      sum(len(g) for g in held_groups))
    train, held, test = (encode_groups(g, encoder, config, base.limits)
                         for g in (train_groups, held_groups, group_by_state(test_rows)))
    torch.manual_seed(config.seed)
    spec, adapters = engine_source(base)
    model, params = _trainable(load_model(spec, adapters).model, config)
    model.train()
    layers = base.model.num_layers
    frozen = layers - config.train_blocks if config.train_blocks else 0
    scorer = PackedScorer(PackedDecoder(model.base_model.model, share=True), base.scoring.readout,
                          torch.device("cpu"), False, frozen,
                          state_weights=model.disable_adapter if mode == "question" else None)
    before = evaluate(scorer, test)
    scorer.trunks.clear()  # the cache's budget is for the training chunks (the test ones are scored twice only)
    scorer.cached_bytes = 0
    trainer = Trainer(scorer, params, config, train, held, work / f"{mode}.pt", {}, log=print)
    started = time.perf_counter()
    progress = trainer.run()
    seconds = time.perf_counter() - started
    after = evaluate(scorer, test)
    return {"before": before, "after": after, "train_seconds": seconds, "steps": progress.step,
            "rows_per_second": progress.rows_seen / max(seconds, 1e-9),
            "config": {"train_blocks": config.train_blocks, "lr": config.lr, "epochs": config.epochs,
                       "rank": config.rank, "rlcd_weight": config.rlcd_weight}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="engines/smollm2-base")
    ap.add_argument("--datasets", nargs="+", default=["bbc", "rotten", "tweets_choice", "tweets_score"])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--train-blocks", type=int, default=None, help="default: tune's choice for the row count")
    ap.add_argument("--epochs", type=int, default=None, help="default: tune's choice for the row count")
    ap.add_argument("--lr", type=float, default=None, help="default: tune's choice for the row count")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rlcd-weight", type=float, default=0.5, help="tune's --rlcd-weight (a task's default: 0)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    path = RESULTS / "shared_state.json"
    results = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    results["machine"] = _machine()
    config = TuneConfig(rank=args.rank, holdout=0.2, seed=args.seed, train_blocks=args.train_blocks, epochs=args.epochs,
                        lr=args.lr, rlcd_weight=args.rlcd_weight)
    for name in args.datasets:
        train, test = user_rows(name, args.rows, args.seed)
        with tempfile.TemporaryDirectory() as tmp:
            train_rows = _rows(train, Path(tmp), "train")
            test_rows = _rows(test, Path(tmp), "test")
            run = {"dataset": name, "rows": args.rows, "test_rows": len(test), "majority": _majority(test)}
            for mode in args.modes:
                print(f"== {name} / {args.rows} rows / {mode}", flush=True)
                run[mode] = run_mode(mode, args.base, train_rows, test_rows, config, Path(tmp))
        results["runs"][f"{name}/{args.rows}" + (f"/{args.tag}" if args.tag else "")] = run
        path.write_text(json.dumps(results, indent=2) + "\n")
        write_md(results)


def write_md(results: dict) -> None:
    m = results["machine"]
    lines = [f"# A shared state cache: the adapter on the question tokens only ({m['cpu']}, {m['when']})", "",
             "The same LoRA (rank 16, tune's settings for the row count, 20% of the training states held out for "
             "early stopping, seed 0) trained twice on the same rows: **whole**, the adapter on every token (one "
             "engine per task, today), and **question**, the state's K/V from the base weights (what one engine "
             "shared by several tuned tasks can serve: the state prefilled once). Test rows: other states, never "
             "trained on; accuracy (NLL) by the computation each was trained with, uncalibrated.", "",
             "| data set | rows | majority | base | whole | question | question - whole | train s whole | "
             "train s question | rows/s whole | rows/s question |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    acc = lambda x: f"{x['accuracy']:.3f} ({x['nll']:.3f})" if x else "–"  # noqa: E731
    num = lambda x, key, f: format(x[key], f) if x else "–"  # noqa: E731
    for key, r in results["runs"].items():
        w, q = r.get("whole"), r.get("question")
        tag = key.split("/")[2] if key.count("/") == 2 else ""
        gap = f"{q['after']['accuracy'] - w['after']['accuracy']:+.3f}" if w and q else "–"
        lines.append(f"| {r['dataset']}{f' ({tag})' if tag else ''} | {r['rows']} | {r['majority']:.3f} | "
                     f"{acc((w or q)['before'])} | {acc(w and w['after'])} | {acc(q and q['after'])} | {gap} | "
                     f"{num(w, 'train_seconds', '.0f')} | {num(q, 'train_seconds', '.0f')} | "
                     f"{num(w, 'rows_per_second', '.2f')} | {num(q, 'rows_per_second', '.2f')} |")
    lines += ["", "Settings per run (blocks 0: every block): " + "; ".join(
        f"{k}: {(r.get('whole') or r.get('question'))['config']}" for k, r in results["runs"].items()), "",
        "    python benchmarks/studies/shared_state.py --base engines/smollm2-base --datasets bbc rotten tweets_choice "
        "tweets_score"]
    (RESULTS / "shared_state.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
