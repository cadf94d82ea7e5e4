"""`onepass tune --task NAME --engine DIR --data rows.jsonl`: a tuned task added to an engine in place.

The candidates and the choice are a whole-engine tune's: base, base + calibrate, a decision head over the engine's
hidden states read after each of several depths (``config.head_depths``) and at the full depth, and, with
``--lora-min-rows`` rows or more, a LoRA run (tuned, tuned + calibrate), cross-validated over whole states below
``CV_BELOW_ROWS`` rows or without a LoRA run. The task's LoRA is trained on the question and option tokens only: the
state's K/V come from the engine's own weights (``PackedScorer(state_weights=...)``), as the engine serves it, with
the state prefilled once for every task. What is chosen is stored beside the engine (``runtime.core.task_store``): the
factors in float16 or the head (``head.npz``, read after its depth), and a card with its calibration, the questions
and data it was tuned on and its metrics. The engine's files are untouched. The graph with task slots and task heads
(``TaskDecoder``) is exported once per engine, again only when a task needs blocks it has no slots on.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ...runtime.core import manifest as mf
from ...runtime.core import task_store
from ...runtime.core.errors import OnepassError
from ...runtime.core.prompt import PromptEncoder
from ...runtime.core.readout_calibration import question_key
from ...runtime.core.tasks import TaskAdapter, projection_shapes
from ..data.rows import group_by_state, load_rows, split_states
from ..heads import candidate as head_candidate
from .candidates import head_depth, is_head
from .choice import CV_BELOW_ROWS, CV_FOLDS, Runs, check_cv_states, train_and_choose
from .config import TuneConfig, head_depths, resolved
from .trainer import NothingLearned, PackedScorer, encode_groups


# A task's own defaults, where tune's flags leave them open. The top 4 blocks: its slots then cost 1.07x an untuned
# pass where slots on every block cost 1.23x (benchmarks/studies/results/task_slots.md). Cross-entropy only: with RLCD (tune's
# 0.5) the question-side LoRA on Rotten Tomatoes (200 rows, on the default engine) grew confidently wrong (held-out NLL
# 0.55 -> 2.0 while its accuracy rose), so tune kept the calibrated base; without it the held-out NLL fell (0.41
# calibrated, accuracy 0.85 against the calibrated base's 0.725): benchmarks/results/tasks_served.md. Every block
# instead (tasks_served_every_block.md): 0.930 / 0.783 / 0.620 / 0.607 served on BBC, Rotten Tomatoes and tweets
# (choice, score) against the top 4's 0.937 / 0.747 / 0.637 / 0.640, at more memory (1.15x against 1.04x).
TASK_BLOCKS, TASK_RLCD_WEIGHT = 4, 0.0


def task_config(config: TuneConfig, rlcd_given: bool = False) -> TuneConfig:
    """``config`` with a task's defaults where it leaves them open (``train_blocks`` None; ``rlcd_weight`` unless the
    caller gave one)."""
    blocks = TASK_BLOCKS if config.train_blocks is None else config.train_blocks
    return dataclasses.replace(config, train_blocks=blocks,
                               rlcd_weight=config.rlcd_weight if rlcd_given else TASK_RLCD_WEIGHT)


def tune_task(engine_dir: str | Path, data: list[str | Path], name: str,
              config: TuneConfig = task_config(TuneConfig()), log=print) -> dict:
    """Tune the task ``name`` on ``data`` and store it beside the engine ``engine_dir`` (replacing a task of that
    name); returns the card written. ``config``: tune's settings (``task_config`` gives a task's defaults)."""
    from ...export.model_source import engine_source, load_model
    from ...runtime.backends.torch_decoder import PackedDecoder
    from .engine import _fingerprint, _trainable

    t0 = time.perf_counter()
    engine_dir = Path(engine_dir)
    try:
        task_store.check_name(name)
    except ValueError as err:
        raise OnepassError(str(err)) from None
    if config.method != "lora":
        raise OnepassError(f"a task is chosen among its candidates (a LoRA adapter on the question tokens, a decision "
                           f"head at a depth); --method {config.method} writes a whole engine (leave out --task)")
    base = mf.load(engine_dir)
    if base.head is not None:
        raise OnepassError("the engine has a decision head, which task slots do not combine with; add tasks to an "
                           "engine exported without --head")
    if base.precision != "fp32" or base.quantization is not None:
        raise OnepassError(f"the engine is {base.precision}{' INT8' if base.quantization else ''}; its graph with task "
                           "slots would be fp32 and answer its untuned questions otherwise than it does: add tasks to "
                           "an fp32 engine")
    rows, files = load_rows(data)
    encoder = PromptEncoder(str(engine_dir / base.tokenizer), base.prompt)
    heads = config.head_candidate and config.write == "best"
    lora = not heads or len(rows) >= config.lora_min_rows  # as a whole-engine tune: else the head is the only learner
    states = group_by_state(rows)
    cv = config.write == "best" and (len(rows) < CV_BELOW_ROWS or (not lora and len(states) >= 2 * CV_FOLDS))
    train_groups, held_groups = (states, []) if cv else split_states(states, config.holdout, config.seed)
    if cv:
        check_cv_states(train_groups)
    config = resolved(config, sum(len(g) for g in train_groups), base.model.num_layers,
                      sum(len(g) for g in held_groups))
    train, held = (encode_groups(g, encoder, config, base.limits) for g in (train_groups, held_groups))
    spec, adapters = engine_source(base)
    torch.manual_seed(config.seed)
    model, params = _trainable(load_model(spec, adapters).model, config)
    model.train()
    layers = base.model.num_layers
    frozen = layers - config.train_blocks if config.train_blocks and lora else 0
    scorer = PackedScorer(PackedDecoder(model.base_model.model, share=True), base.scoring.readout,
                          torch.device("cpu"), bool(config.bf16), frozen, state_weights=model.disable_adapter)
    work = Path(tempfile.mkdtemp(prefix=f"onepass-task-{name}-"))  # the runs' checkpoints; never in the engine
    depths = head_depths(config, layers) if heads else ()  # a task's scorer reads any depth (the state's K/V kept)
    log(f"tuning task {name!r} of {base.name} on {sum(len(g) for g in train_groups)} rows ({len(train_groups)} "
        "states): " + (f"LoRA rank {config.rank} on " + (f"the top {config.train_blocks} blocks" if config.train_blocks
                                                         else "every block") if lora else
                       f"no LoRA run ({len(rows)} rows, under --lora-min-rows {config.lora_min_rows})")
        + (f"; a decision head read after {', '.join(map(str, depths))} and all blocks" if heads else "")
        + "; the state's K/V from the engine's own weights (shared by every task)")
    try:
        runs = Runs(scorer, params, config, work, _fingerprint(files, engine_dir), encoder, log, depths)
        outcome = train_and_choose(runs, train, held, cv, False, base.scoring.readout, config.seed, heads, lora)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    chosen, found, judged = outcome.chosen, outcome.found, outcome.judged
    log(outcome.candidates_line())
    adapter = _adapter(model, name) if chosen.name.startswith("tuned") else TaskAdapter(name, 0, {})
    chosen, adapter = named_as_it_answers(chosen, adapter, log)
    head = None
    if is_head(chosen.name):  # the head as served: its prior's bias is the calibration of its read-out
        served, calibration = head_candidate.served(outcome.head)
        chosen = dataclasses.replace(chosen, calibration=calibration)
        head = ({k: v.detach().float().cpu().numpy() for k, v in served.head.state_dict().items()},
                head_depth(chosen.name) or layers, float(served.beta.detach()))
    if chosen.name == "base" and not config.keep_base:
        raise NothingLearned(f"on the {judged} rows neither calibrating nor tuning beat the engine's own answers, so "
                             f"no task was written. Give more labelled rows, or pass --keep-base to store the task "
                             "anyway (it then answers as the engine)")
    seconds = outcome.seconds
    card = {"calibration": chosen.calibration.to_dict() if chosen.calibration else None,
            "questions": sorted({question_key(r.question.type, encoder.instructions(r.question),
                                              encoder.options(r.question)) for r in rows}),
            "instructions": sorted({encoder.instructions(r.question) for r in rows})[:20],  # what `tasks list` shows
            "data": files, "rows": len(rows), "scale_folded": True,
            "config": {**dataclasses.asdict(config), "learning_rate": config.learning_rate},
            "metrics": {"choice": {"chosen": chosen.name, "judged": judged,
                                   "candidates": [c.as_dict() for c in found]},
                        "train_seconds": seconds, "rows_per_second": outcome.rows_trained / max(seconds, 1e-9)}}
    with task_store.locked(engine_dir):  # one writer of the engine's tasks at a time
        ensure_slots(engine_dir, base, lambda: load_model(spec, adapters).model, {b for b, _ in adapter.factors}, log,
                     depths=(head[1],) if head else ())
        path = task_store.write_task(engine_dir, base, adapter, card, head)
    what = f"a decision head read after {head[1]} of {layers} blocks" if head else f"rank {adapter.rank}"
    log(f"task {name!r} ({chosen.name}, {what}) written to {path} in {time.perf_counter() - t0:.0f} s")
    return task_store.read_card(engine_dir, name)


def named_as_it_answers(chosen, adapter: TaskAdapter, log=print) -> tuple:
    """(chosen, adapter), a tuned candidate whose adapter changes nothing (``no_op``: the best held-out weights were
    the untrained ones) named for what it is: the engine's own answers, "base" (or "base+calibrate" with its
    calibration), and no adapter. Never written as "tuned"."""
    if not chosen.name.startswith("tuned") or not no_op(adapter):
        return chosen, adapter
    chosen = dataclasses.replace(chosen, name=chosen.name.replace("tuned", "base"))
    log(f"training moved no weight of the adapter (every LoRA B factor is still 0: the untrained weights did best): "
        f"it answers as the engine, so it counts as {chosen.name!r}; train longer (more rows or epochs, a larger "
        "--max-steps) to tune the task")
    return chosen, TaskAdapter(adapter.name, 0, {})


def no_op(adapter: TaskAdapter) -> bool:
    """Whether the adapter changes no output: every B factor exactly 0 (LoRA starts there; too few steps leave it)."""
    return all(not np.any(b) for _, b in adapter.factors.values())


def _adapter(model, name: str) -> TaskAdapter:
    """The trained LoRA as a task (its scale folded into B)."""
    from peft import get_peft_model_state_dict

    cfg = model.peft_config["default"]
    state = {k: v.detach().float().cpu().numpy() for k, v in get_peft_model_state_dict(model).items()}
    return TaskAdapter.from_peft(name, state, cfg.lora_alpha / cfg.r)


def _weight_map(decoder, path: Path, log) -> dict | None:
    """The slot graph's weight map (``export.build.weight_map``), or None, said, where a weight matched no
    initializer: ONNX Runtime and OpenVINO need no map, and the PyTorch backend refuses a slot graph without one."""
    from ...export.build import weight_map

    try:
        return weight_map(decoder, path)
    except OnepassError as err:
        log(f"the slot graph's weights could not be mapped ({err}): the PyTorch backend will not run this engine's "
            "tasks; ONNX Runtime and OpenVINO will")
        return None


def ensure_slots(engine_dir: Path, manifest: mf.Manifest, base_model, blocks: set, log=print, depths=()) -> None:
    """The engine's slot graph, exported again (on the blocks it had and ``blocks``, with task heads, and a graph cut
    at each depth it had and each of ``depths`` below the model's) only where it lacks a block or a depth or takes no
    task heads (exported before them); ``base_model()`` loads the engine's own model (transformers, no adapter of the
    task's). A depth's graph holds that many blocks and task heads only: it answers a pass whose questions are all
    head tasks read there or above, and prefills their states (``runtime.core.depths``). Where only cuts are
    missing, they alone are exported and added beside the rest (``task_store.add_cuts``)."""
    from ...export.model_source import cut
    from ...export.onnx_graph import export_task_decoder
    from ...export.shared_weights import share
    from ...runtime.backends.torch_decoder import PackedDecoder, TaskDecoder

    card = task_store.slot_card(engine_dir)
    have, had = set(card.get("blocks", ())), set(card.get("depths", ()))
    cuts = sorted(had | {d for d in depths if d < manifest.model.num_layers})
    kept = have and blocks <= have and card.get("heads")
    if kept and set(cuts) <= had:
        return

    def export_cut(path: Path, depth: int) -> None:  # task heads, no task slots (so no projection shapes)
        export_task_decoder(TaskDecoder(PackedDecoder(cut(base_model().eval(), depth)), (), heads=True), {}, path)
        share(path, engine_dir / manifest.graph)

    if kept:  # only cut graphs are missing: the slot graph and the cuts it has stay as they are
        missing = sorted(set(cuts) - had)
        log(f"exporting the engine's first {', '.join(map(str, missing))} blocks for the head tasks read there; "
            f"~{len(missing)} min")
        with torch.no_grad():
            task_store.add_cuts(engine_dir, missing, export_cut)
        return
    want = sorted(have | blocks) or [manifest.model.num_layers - 1]  # a task of no factors still needs a graph
    log(f"exporting the engine's graph with task slots on blocks {want[0]}..{want[-1]} ({len(want)} blocks) and "
        "task heads" + (f", and its first {', '.join(map(str, cuts))} blocks for the head tasks read there" if cuts
                        else "") + f"; ~{1 + len(cuts)} min")
    graph = TaskDecoder(PackedDecoder(base_model().eval()), want, heads=True)
    d = graph.dims
    shapes = projection_shapes(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size)

    def export(path: Path) -> None:  # the decoder's weights read from the engine's own file, not a copy of it
        export_task_decoder(graph, shapes, path)
        share(path, engine_dir / manifest.graph)
        for depth in cuts:
            export_cut(path.with_name(task_store.depth_graph(depth)), depth)

    with torch.no_grad():
        task_store.write_slots(engine_dir, manifest, want, export, lambda path: _weight_map(graph.decoder, path, log),
                               heads=True, depths=cuts)
