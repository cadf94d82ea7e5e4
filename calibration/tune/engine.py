"""`onepass tune --engine DIR --data rows.jsonl --out DIR`: from a base engine and labelled rows to a tuned engine.

The base engine's model (its source and the adapters merged into it) is loaded, trained with
:mod:`onepass.calibration.tune.trainer`, and the result exported through the ordinary export path into
``--out``: golden file, self-check, manifest with the tuning recorded. Nothing is written to
``--out`` unless the whole run succeeds; checkpoints live in ``<out>.tune/`` until then.
A report (accuracy, NLL, Brier, ECE, reliability plot) compares the base and the tuned engine,
both run by ONNX Runtime, on the held-out states.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from ...runtime.core import manifest as mf
from ...runtime.core.engine import Engine
from ...runtime.core.errors import OnepassError
from ...runtime.core.prompt import PromptEncoder
from ..data.rows import TuneRow, group_by_state, load_rows, split_states
from .candidates import RULE, TIE, head_depth, is_head
from .choice import CV_BELOW_ROWS, CV_FOLDS, Runs, check_cv_states, train_and_choose
from .config import TuneConfig, head_depths, resolved
from .trainer import NothingLearned, PackedScorer, encode_groups


def _trainable(model, config: TuneConfig):
    """(model to train, its trainable parameters): LoRA wrappers (peft) or the chosen blocks' own weights."""
    layers = model.config.num_hidden_layers
    chosen = list(range(layers - config.train_blocks, layers)) if config.train_blocks else None
    if config.method == "lora":
        from peft import get_peft_model

        from ...export.adapter import lora_config

        model = get_peft_model(model, lora_config(config.rank, config.alpha, chosen))
        return model, [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    blocks = [model.model.layers[i] for i in (chosen or range(layers))]
    extra = [] if chosen else [model.model.norm, model.model.embed_tokens]
    for m in blocks + extra:
        m.requires_grad_(True)
    return model, [p for p in model.parameters() if p.requires_grad]


def _held_out(states: list, validation, config: TuneConfig) -> tuple[list, list, list]:
    """(train groups, held-out groups, validation files): a seeded split of ``states`` (the rows grouped by state), or
    the given files."""
    if not validation:
        return (*split_states(states, config.holdout, config.seed), [])
    held_rows, files = load_rows(validation)
    train, held = states, group_by_state(held_rows)
    shared = {g[0].state for g in train} & {g[0].state for g in held}
    if shared:
        example = next(iter(shared))
        raise OnepassError(f"{len(shared)} state(s) are both in --data and in --validation (for example "
                           f"{example[:60]!r}); validation states must not be trained on")
    return train, held, files


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fingerprint(files: list[dict], base: Path) -> dict:
    return {"data": [f["sha256"] for f in files], "base": str(base)}


def _score_rows(engine: Engine, rows: list[TuneRow]) -> list[dict]:
    from ..measure.calibrate import score_rows

    return score_rows(engine, [{"state": r.state, "question": r.question, "label": r.label,
                                "dataset": r.dataset or "rows"} for r in rows])


@dataclasses.dataclass
class Plan:
    """What a tune run works from, read and checked before any weight is loaded: the base engine, the rows and how
    they are split (held-out states, or a cross-validated choice), the settings resolved for them, the chunks."""

    base_dir: Path
    base: mf.Manifest
    encoder: PromptEncoder
    rows: list
    files: list
    heads: bool  # a decision head is a candidate
    lora: bool  # LoRA runs are trained (else the head is the only learner)
    cv: bool  # the choice is cross-validated over whole states
    train_groups: list
    held_groups: list
    val_files: list
    config: TuneConfig  # resolved
    train: list  # chunks
    held: list

    @property
    def held_rows(self) -> list:
        return [r for g in self.held_groups for r in g]

    @property
    def train_rows(self) -> int:
        return sum(len(g) for g in self.train_groups)


def plan(engine_dir: str | Path, data: list[str | Path], config: TuneConfig,
         validation: list[str | Path] | None = None) -> Plan:
    """The rows read and split, the settings resolved, every chunk encoded and checked against the engine's limits."""
    base_dir = Path(engine_dir)
    rows, files = load_rows(data)
    base = mf.load(base_dir, verify=False)
    if base.head is not None:
        raise OnepassError("the base engine has a decision head; tune an engine exported without --head")
    encoder = PromptEncoder(str(base_dir / base.tokenizer), base.prompt)
    heads = config.head_candidate and config.write == "best" and config.method == "lora"
    lora = not heads or len(rows) >= config.lora_min_rows  # else the head is the only learner: no run, no frozen cache
    # too few rows for one held-out split to choose on, or no LoRA run (the head's fits take seconds, so every row is
    # judged by a fit that did not see it and the chosen one is fitted on all, where the states are enough to fold);
    # --write tuned chooses nothing
    states = group_by_state(rows)
    cv = validation is None and config.write == "best" and (
        len(rows) < CV_BELOW_ROWS or (not lora and len(states) >= 2 * CV_FOLDS))
    if cv:
        train_groups, held_groups, val_files = states, [], []
    else:
        train_groups, held_groups, val_files = _held_out(states, validation, config)
    config = resolved(config, sum(len(g) for g in train_groups), base.model.num_layers,
                      sum(len(g) for g in held_groups))
    train, held = (encode_groups(g, encoder, config, base.limits) for g in (train_groups, held_groups))
    if config.method == "head" and cv:
        raise OnepassError(f"--method head needs at least {CV_BELOW_ROWS} rows (or --validation files); "
                           f"got {len(rows)}")
    if cv:
        check_cv_states(train_groups, f" (or {CV_BELOW_ROWS} rows or more, which are split once, or --validation files)")
    return Plan(base_dir, base, encoder, rows, files, heads, lora, cv, train_groups, held_groups, val_files, config,
                train, held)


def tune(engine_dir: str | Path, data: list[str | Path], out: str | Path, config: TuneConfig = TuneConfig(),
         resume: bool = False, report_dir: str | Path | None = None, name: str | None = None, log=print,
         validation: list[str | Path] | None = None) -> dict:
    """Tune the base engine's decoder on ``data`` and export the tuned engine to ``out``; returns a summary.

    ``validation``: JSONL files whose rows are held out instead of a ``config.holdout`` split of ``data``
    (early stopping and the report run on them; every row of ``data`` is trained on). Use it to select
    on tasks or data sets that are not in the training data, so that the kept weights are the ones that
    transfer. A state on both sides is refused.
    """
    from ...export.model_source import engine_source, load_model

    t0 = time.perf_counter()
    out = Path(out)
    p = plan(engine_dir, data, config, validation)
    spec, adapters = engine_source(p.base)
    torch.manual_seed(p.config.seed)
    loaded = load_model(spec, adapters)
    if p.config.method == "head":
        summary = _tune_head(loaded, p.encoder, p.base_dir, p.base, spec, adapters, p.train_groups, p.held_groups,
                             p.files, p.config, out, name, log)
        if report_dir is not None:
            summary["report"] = write_tune_report(p.base_dir, out, p.held_rows, Path(report_dir))
        return summary
    runs, model, work = _runs(p, loaded, out, resume, log)
    outcome = train_and_choose(runs, p.train, p.held, p.cv, resume, p.base.scoring.readout, p.config.seed, p.heads,
                               p.lora)
    model.eval()
    runs.scorer.trunks.clear()  # the frozen blocks' outputs: not needed by the export
    log(outcome.candidates_line())
    _check_learned(p, outcome, work, out, log)
    found, chosen = outcome.found, outcome.chosen
    layers = p.base.model.num_layers
    choice = {"chosen": chosen.name, "candidates": [{**c.as_dict(), **_pass_cost(c.name, layers)} for c in found],
              "judged": outcome.judged, "rule": RULE, **({"why": outcome.why} if outcome.why else {})}
    history = outcome.progress.history
    metrics = {"seconds": outcome.seconds, "rows_per_second": outcome.rows_trained / max(outcome.seconds, 1e-9),
               "evaluations": history, "choice": choice,
               "weights": WEIGHTS_WRITTEN.get("head" if is_head(chosen.name) else chosen.name, "tuned")}
    if p.held and history:  # no history: no LoRA run was trained
        metrics.update(heldout_before=_metric(history[0]), heldout_best=_best(history))
    if chosen.name == "base+calibrate" or is_head(chosen.name):
        summary = {"choice": choice, "seconds_total": time.perf_counter() - t0,
                   "tuning": {"metrics": metrics, "steps": outcome.progress.step}}
        if outcome.head is not None:
            _write_head_engine(outcome.head, choice, p.base_dir, p.base, spec, adapters, p.files, p.train_rows, out,
                               name or f"{p.base.name}-head")
        else:
            write_calibrated_copy(p.base_dir, out, chosen.calibration, {**choice, "data": p.files},
                                  name or f"{p.base.name}-calibrated")
    else:
        tuning = _write_tuned(p, loaded, model, spec, adapters, outcome, metrics, out, work, name)
        summary = {"tuning": dataclasses.asdict(tuning), "choice": choice, "seconds_total": time.perf_counter() - t0}
    if report_dir is not None:
        summary["report"] = write_tune_report(p.base_dir, out, p.held_rows, Path(report_dir), choice)
    shutil.rmtree(work, ignore_errors=True)
    return summary


def _pass_cost(name: str, layers: int) -> dict:
    """What a candidate's engine runs per pass and prefill: its blocks, and their share of the model's."""
    blocks = head_depth(name) or layers
    return {"blocks": blocks, "pass_cost": round(blocks / layers, 3)}


def _runs(p: Plan, loaded, out: Path, resume: bool, log) -> tuple:
    """(the runs over the trainable model, the model, the work folder of their checkpoints): the LoRA wrappers (or
    trainable blocks) on the device, the scorer over them, what tune is about to do logged."""
    from ...runtime.backends.torch_decoder import PackedDecoder

    config, device = p.config, _device()
    model, params = _trainable(loaded.model, config)
    model.to(device).train()
    hf = model.base_model.model if config.method == "lora" else model
    frozen = max(0, hf.config.num_hidden_layers - config.train_blocks) if config.train_blocks and p.lora else 0
    scorer = PackedScorer(PackedDecoder(hf, share=True), p.base.scoring.readout, device,
                          config.bf16 if config.bf16 is not None else device.type == "cuda", frozen)
    work = out.with_name(out.name + ".tune")
    work.mkdir(parents=True, exist_ok=True)
    what = (f"tuning {p.base.name} ({config.method}, {len(params)} tensors, "
            f"{sum(x.numel() for x in params):,} trainable parameters)" if p.lora else
            f"choosing for {p.base.name} among base, base+calibrate and the decision head (no LoRA run: {len(p.rows)} "
            f"rows are fewer than --lora-min-rows {config.lora_min_rows})")
    log(f"{what} on {p.train_rows} rows ({len(p.train_groups)} states); "
        + (f"the choice cross-validated over {CV_FOLDS} folds of whole states" if p.cv else
           f"{len(p.held_rows)} rows ({len(p.held_groups)} states) held out")
        + f"; device {device.type}" + (f"; the lower {frozen} blocks computed once per state" if frozen else ""))
    if resume and not p.lora and any(work.glob("*.pt")):
        log(f"warning: --resume finds LoRA checkpoints in {work}, but with {len(p.rows)} rows (under --lora-min-rows "
            f"{config.lora_min_rows}) no LoRA run is trained; pass --lora-min-rows 0 to continue that run")
    depths = head_depths(config, p.base.model.num_layers, frozen) if p.heads else ()
    runs = Runs(scorer, params, config, work, _fingerprint(p.files, p.base_dir), p.encoder, log, depths)
    log(f"scoring the {len(p.train) + len(p.held)} chunks with the base weights (the untuned candidates)"
        + (f"; their lower {frozen} blocks are kept for every run" if frozen else "")
        + (f"; a decision head read after {', '.join(map(str, depths))} and all blocks" if depths else ""))
    return runs, model, work


def _check_learned(p: Plan, outcome, work: Path, out: Path, log) -> None:
    """NothingLearned (the work folder removed) where the base engine was chosen, or ``--write tuned`` did not beat
    it, unless ``--keep-base``; a warning where it is written anyway."""
    config, found, chosen = p.config, outcome.found, outcome.chosen
    untuned = found[0]  # the base engine, zero-shot
    if not (chosen.name == "base" or (config.write == "tuned" and chosen.nll >= untuned.nll - TIE)):
        return
    message = (f"tuning never improved on the base engine: on the {outcome.judged} rows the base engine's NLL, "
               f"{untuned.nll:.4f}, was not beaten " + ("by tuning it (--write tuned)" if config.write == "tuned"
                                                        else "by calibrating it, by a decision head or by tuning it"))
    if not config.keep_base:
        shutil.rmtree(work, ignore_errors=True)
        more = ("Give more labelled rows or steps (--epochs, --max-steps), try another --lr" if p.lora else
                f"No LoRA run was trained ({len(p.rows)} rows, under --lora-min-rows {config.lora_min_rows}): give "
                "more labelled rows, or pass --lora-min-rows 0 to train one")
        raise NothingLearned(f"{message}, so no engine was written to {out}. {more}, or pass --keep-base to write "
                             "the base weights anyway")
    log(f"warning: {message}; the engine written " + ("is the tuned one (--keep-base)" if chosen.name == "tuned"
                                                        else "is the base engine's weights (--keep-base)"))


def _write_tuned(p: Plan, loaded, model, spec, adapters, outcome, metrics: dict, out: Path, work: Path,
                 name: str | None) -> mf.TuningInfo:
    """The tuned weights exported to ``out`` (the LoRA adapter merged, or the whole tuned model), the tuning and the
    chosen candidate's calibration recorded; returns the tuning recorded."""
    from ...export.adapter import CARD, CONFIG, WEIGHTS, save
    from ...export.build import export_engine

    config, base, chosen, progress = p.config, p.base, outcome.chosen, outcome.progress
    device = _device()
    tuning = mf.TuningInfo(
        method=config.method, base=f"{base.name} ({loaded.source.get('sha256', loaded.source.get('path'))})",
        adapters=[{"path": str(a), "sha256": x["sha256"]} for a, x in zip(adapters, loaded.source.get("adapters", []))],
        data=p.files, rows=p.train_rows, holdout_rows=len(p.held_rows), steps=progress.step,
        validation=p.val_files,
        rank=config.rank if config.method == "lora" else None,
        config={**dataclasses.asdict(config), "learning_rate": config.learning_rate, "device": device.type},
        metrics=metrics)
    extra, model_spec, export_adapters = {}, spec, list(adapters)
    if config.method == "lora":
        adapter_dir = save(model, work / "adapter", {"base_sha256": loaded.source.get("sha256"),
                                                     "base": tuning.base, "readout": base.scoring.readout,
                                                     "prompt": dataclasses.asdict(base.prompt),
                                                     "tuning": dataclasses.asdict(tuning)})
        export_adapters.append(adapter_dir)
        extra = {n: adapter_dir / n for n in (WEIGHTS, CONFIG, CARD)}
    else:
        model_spec, export_adapters = work / "full_model", []
        shutil.rmtree(model_spec, ignore_errors=True)
        model.save_pretrained(model_spec)
        loaded.tokenizer.save_pretrained(model_spec)
    export_engine(out, model_spec, name=name or f"{base.name}-tuned", limits=base.limits, scoring=base.scoring,
                  prompt=base.prompt, precision=base.precision, adapters=export_adapters, tuning=tuning,
                  extra_files=extra,
                  finish=lambda m: dataclasses.replace(adapter_at(m, out), calibration=chosen.calibration))
    return tuning


WEIGHTS_WRITTEN = {"base": "initial (the base engine's, --keep-base)", "base+calibrate": "initial (the base engine's)",
                   "head": "initial (the base engine's) with a decision head"}  # the manifest's metrics.weights


def _write_head_engine(head, choice: dict, base_dir: Path, base, spec, adapters, files, rows: int, out: Path,
                       name: str) -> None:
    """``out``: the base engine's weights with the chosen decision head (its temperature folded in) in the graph
    (read-out ``head``), the bias of the prior it corrects as the calibration of that read-out
    (``head_candidate.served``; the head has no calibrated twin)."""
    from ..heads import candidate as head_candidate

    head, calibration = head_candidate.served(head)
    depth = getattr(head, "depth", None)
    info = {"method": "tune (the decision head candidate)", "data": files, "rows": rows, "choice": choice,
            "config": {k: v for k, v in dataclasses.asdict(head.config).items() if k != "seed"},
            "seeds": head_candidate.SEEDS, "temperature": head.temperature,  # config: of each head averaged
            "targets": head.targets, "blocks_of_model": base.model.num_layers}
    head_info = mf.HeadInfo(beta=float(head.beta.detach()), width=head.head.width, training=info, depth=depth)
    write_head_engine(base_dir, base, spec, adapters, out, name, head.head, head_info, calibration)


def write_head_engine(base_dir: Path, base, spec, adapters, out: Path, name: str, head, head_info,
                      calibration=None) -> None:
    """``out``: the base engine with ``head`` in its graph (and ``calibration``, of its ``head`` read-out, in its
    manifest): appended to the base's graph where it can be (seconds; ``export.head_graph``), else the decoder exported
    again with it (about a minute); a head read at a depth (``head_info.depth``) is always exported again, with only
    the blocks it reads."""
    from ...export import head_graph

    def finish(m):
        return dataclasses.replace(adapter_at(m, out), calibration=calibration)
    depth = head_info.depth
    if depth is None and head_graph.can_append(base_dir, base):
        try:
            head_graph.append_head(base_dir, base, out, name=name, head=head, head_info=head_info, finish=finish)
            return
        except Exception as e:  # noqa: BLE001 - a graph this path did not foresee: the full export below still can
            logging.getLogger(__name__).warning("appending the head to %s's graph failed (%s): exporting the decoder "
                                                "with it", base.name, e)
    from ...export.build import export_engine

    export_engine(out, spec, name=name, limits=base.limits, prompt=base.prompt, precision=base.precision,
                  adapters=adapters, head=head, head_info=head_info, finish=finish, depth=depth)


def write_calibrated_copy(base_dir: Path, out: Path, calibration, choice: dict, name: str) -> None:
    """``out``: the base engine (its weights hard-linked where the file system allows) with ``calibration`` in its
    manifest, the choice (and the data it was made on) recorded in the calibration's source. What was measured of the
    base's probabilities (a distilled engine's gate, a backend's guarantees against fp32) does not hold once they are
    calibrated: dropped.
    Written beside ``out`` and renamed: all or nothing."""
    with mf.staged(out) as tmp:
        mf.copy_engine(base_dir, tmp)
        m = mf.load(tmp, verify=False)
        calibration = dataclasses.replace(calibration, source={**calibration.source, "tune": choice})
        mf.write(tmp, dataclasses.replace(adapter_at(m, out), name=name, calibration=calibration, gate=None,
                                          guarantees={}))
        Engine.load(tmp)  # hashes verified, calibration read back


def adapter_at(m: mf.Manifest, engine_dir: Path) -> mf.Manifest:
    """``m`` with its last adapter's path at ``engine_dir`` when the engine holds that adapter's files (a PEFT
    folder): its manifest then names the engine, not the work folder that is deleted, so the engine can be re-exported
    or tuned again. An engine without adapter files of its own (the base, or a calibrated copy of it) is left as it
    is: its adapters are its base's."""
    from ...export.adapter import WEIGHTS

    if WEIGHTS not in m.files or not m.source.get("adapters"):
        return m
    adapters = [dict(a) for a in m.source["adapters"]]
    adapters[-1]["path"] = str(Path(engine_dir).resolve())
    return dataclasses.replace(m, source={**m.source, "adapters": adapters})


def _tune_head(loaded, encoder, base_dir, base, spec, adapters, train_groups, held_groups, files, config, out, name,
               log) -> dict:
    """``method="head"``: the RLCD decision head over the frozen decoder's features, written into the graph."""
    from ...runtime.backends.torch_decoder import PackedDecoder
    from ..heads import head as hd
    from ..heads.features import extract

    decoder = PackedDecoder(loaded.model).eval()
    train, held = ([r for g in groups for r in g] for groups in (train_groups, held_groups))
    feats_train, feats_held = extract(decoder, encoder, train, False), extract(decoder, encoder, held, False)
    head_config = hd.HeadConfig(width=16, rlcd_weight=config.rlcd_weight, lr=1e-3, seed=config.seed)
    model, history = hd.train(feats_train, feats_held, head_config, log=log)
    before = hd.heldout_nll(feats_held.zero_shot_probabilities(), feats_held)
    after = min((h["val_nll"] for h in history), default=before)
    if after >= before - 1e-4:
        message = (f"the decision head never improved on the zero-shot read-out: held-out NLL {before:.4f} before, "
                   f"{after:.4f} at best")
        if not config.keep_base:
            raise NothingLearned(f"{message}, so no engine was written to {out}. Give more labelled rows, or pass "
                                 "--keep-base to write it anyway")
        log(f"warning: {message} (--keep-base)")
    info = {"method": "tune --method head", "data": files, "rows": len(train), "holdout_rows": len(held),
            "config": dataclasses.asdict(head_config), "targets": hd.targets_of(feats_train),
            "heldout_nll_before": before,
            "heldout_nll_after": after}
    head_info = mf.HeadInfo(beta=float(model.beta.detach()), width=model.head.width, training=info)
    write_head_engine(base_dir, base, spec, adapters, out, name or f"{base.name}-head", model.head, head_info)
    return {"head": info}


def _metric(entry: dict) -> dict:
    return {"accuracy": entry["accuracy"], "nll": entry["nll"], "questions": entry["questions"], "step": entry["step"]}


def _best(history: list[dict]) -> dict:
    return _metric(min(history, key=lambda e: e["nll"]))


def write_tune_report(base_dir: Path, tuned_dir: Path, held: list[TuneRow], out: Path,
                      choice: dict | None = None) -> dict:
    """Base vs tuned engine (ONNX Runtime) on the held-out rows: the calibration report's metrics and plots, and the
    candidates tune chose from. A cross-validated choice holds no rows out: the report then records the choice."""
    from ..scoring.report import write_report
    from ..measure.calibrate import evaluate

    if not held:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({"choice": choice, "note": "no held-out rows: the choice was "
                                                     "cross-validated over whole states"}, indent=2) + "\n")
        return {}
    base, written = Engine.load(base_dir, verify=False), Engine.load(tuned_dir)
    before, after = _score_rows(base, held), _score_rows(written, held)
    report = {"before": evaluate(before, base.manifest.calibration),
              "after": evaluate(after, written.manifest.calibration), "choice": choice,
              "note": "before: the base engine; after: the engine written; each as it answers (its own calibration, "
                      "if it has one, applied); held-out states only (never trained on)"}
    write_report(report, out)
    return {k: {m: report[k]["all"][m] for m in ("accuracy", "nll", "brier", "ece", "rows")}
            for k in ("before", "after")}


def summary_lines(summary: dict, out, report_dir) -> list[str]:
    """What `onepass tune` prints: held-out before and best (or the head's NLL), the report's before/after."""
    lines = []
    if "head" in summary:
        h = summary["head"]
        lines.append(f"decision head: held-out NLL {h['heldout_nll_before']:.4f} (zero-shot) -> "
                     f"{h['heldout_nll_after']:.4f}")
    else:
        tuning = summary["tuning"]
        m = tuning["metrics"]
        if "heldout_before" in m:
            lines.append(f"held-out before: accuracy {m['heldout_before']['accuracy']:.3f} NLL "
                         f"{m['heldout_before']['nll']:.4f}; best: accuracy {m['heldout_best']['accuracy']:.3f} NLL "
                         f"{m['heldout_best']['nll']:.4f} ({tuning['steps']} steps, {m['rows_per_second']:.2f} rows/s)")
    if "choice" in summary:
        c = summary["choice"]
        lines.append(f"{c['judged']} candidates: " + "; ".join(f"{x['name']} NLL {x['heldout_nll']:.4f} accuracy "
                                                         f"{x['heldout_accuracy']:.3f}" for x in c["candidates"])
                     + f"; written: {c['chosen']}" + (f" ({c['why']})" if "why" in c else ""))
    for phase, r in summary.get("report", {}).items():
        lines.append(f"{phase:6s} (ONNX Runtime, held-out rows {r['rows']}): accuracy {r['accuracy']:.3f}  "
                     f"NLL {r['nll']:.3f}  Brier {r['brier']:.3f}  ECE {r['ece']:.3f}")
    chosen = summary.get("choice", {}).get("chosen", "tuned")
    what = {"base": "the base engine (--keep-base)", "base+calibrate": "the base engine with a calibration",
            "head": "the base engine with a decision head",
            "tuned": "tuned engine", "tuned+calibrate": "tuned engine (with a calibration)"}.get(
        chosen, f"the base engine's first {chosen.partition('@')[2]} blocks with a decision head")
    lines.append(f"{what} written to {out}; report in {report_dir}")
    return lines
