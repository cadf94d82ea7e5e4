"""Tuned tasks stored beside an engine: ``DIR/tasks/NAME/`` per task, ``DIR/tasks/slots/`` the graph with
task slots that answers them. The engine's own files are never touched: a task is an add-on, written and removed
whole (a directory renamed into place), and read back verified (hashes, and the engine it was tuned on).

    DIR/tasks/NAME/task.json      the task's card: its engine, rank, blocks, factors' sha256, calibration, the
                                  questions and data it was tuned on, its metrics
    DIR/tasks/NAME/factors.npz    A.{block}.{proj} [r, in] and B.{block}.{proj} [out, r] (the LoRA scale folded into
                                  B), float16
    DIR/tasks/NAME/head.npz       a task that is a decision head: its ``DecisionHead`` state (float32), read after
                                  the card's ``head.depth`` blocks with its ``head.beta`` (``tasks.TaskHead``)
    DIR/tasks/slots/graph.onnx    the engine's decoder with task slots on some blocks (``TaskDecoder``), exported
    DIR/tasks/slots/slots.json    by ``onepass tune --task``; its blocks and files' sha256
    DIR/tasks/slots/decoder.onnx.data   the engine's own weights file, hard-linked: the slot graph reads the
                                  decoder's weights from it (``export.shared_weights``), not from a copy

Pure numpy and json: the runtime reads tasks without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EngineFileError
from .manifest import Manifest, graph_files, link_or_copy, sha256_file
from .readout_calibration import Calibration
from .tasks import HEAD_KEYS, TaskAdapter, TaskHead

TASKS, SLOTS, CARD, FACTORS, SLOTS_CARD = "tasks", "slots", "task.json", "factors.npz", "slots.json"
HEAD = "head.npz"
GRAPH = "graph.onnx"
CARD_KEYS = ("engine_weights", "rank", "blocks", "factors_sha256")
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
NAME_RULE = "1-64 characters of a-z, 0-9, '_' and '-', starting with a letter or digit"


def check_name(name) -> str:
    """A task name as stored (a folder name), or ValueError saying what is allowed."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name == SLOTS:
        raise ValueError(f"task name {name!r} is not allowed: {NAME_RULE} (and not {SLOTS!r})")
    return name


def engine_weights(manifest: Manifest) -> str:
    """The identity of an engine's weights: a digest of its graph files' sha256 (a task is tuned on these)."""
    files = graph_files(manifest)
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


@dataclass(frozen=True)
class Tasks:
    """An engine's tuned tasks as loaded: numbered in name order (a question's ``task`` is looked up here)."""

    names: tuple
    adapters: tuple  # TaskAdapter per task
    cards: tuple  # task.json per task
    calibrations: tuple  # Calibration or None per task
    blocks: tuple  # the blocks the slot graph has slots on
    graph: str  # the slot graph, relative to the engine directory
    files: dict  # the slot graph's files (relative to the engine directory) -> sha256
    weights: dict | None = None  # the slot graph's map of reference weight names to its initializers (its card's)
    heads: tuple = ()  # TaskHead or None per task (() : none has one)
    depth_graphs: dict = dataclasses.field(default_factory=dict)  # depth -> its cut slot graph (engine-relative)


def root_of(engine: Path) -> Path:
    return Path(engine) / TASKS


def names(engine: str | os.PathLike) -> list[str]:
    """The tasks stored beside an engine, in name order."""
    root = root_of(Path(engine))
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and NAME.fullmatch(p.name) and p.name != SLOTS
                  and (p / CARD).is_file())


def _json(path: Path, keys: tuple = ()) -> dict:
    """A card, with ``keys`` present, or EngineFileError saying what to do."""
    what = "the task" if path.name == CARD else "a task (the slot graph is exported again)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        data, why = None, str(err)
    else:
        missing = [k for k in keys if k not in data] if isinstance(data, dict) else list(keys)
        why = f"it lacks {', '.join(missing)}" if missing else None
    if why is not None or not isinstance(data, dict):
        raise EngineFileError(f"{path} cannot be read ({why or 'not an object'}): remove {what} and tune it again "
                              "(onepass tasks remove / onepass tune --task)")
    return data


@contextlib.contextmanager
def locked(engine: str | os.PathLike):
    """The engine's task store held by this process (an exclusive lock on the engine directory itself, so no file is
    added to it): one writer at a time adds, replaces or removes tasks and exports the slot graph."""
    fd = os.open(Path(engine), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_card(engine: str | os.PathLike, name: str) -> dict:
    return _json(root_of(Path(engine)) / check_name(name) / CARD, CARD_KEYS)


def load(engine: str | os.PathLike, manifest: Manifest, verify: bool = True) -> Tasks | None:
    """The engine's tasks (None where it has none), each checked against the engine it was tuned on (EngineFileError
    otherwise) and, with ``verify``, its files' sha256."""
    engine = Path(engine)
    found = names(engine)
    if not found:
        return None
    slots_dir = root_of(engine) / SLOTS
    slots = _json(slots_dir / SLOTS_CARD, ("engine_weights", "blocks", "files"))
    mapped = slots.get("weights")
    if mapped is not None and not (isinstance(mapped, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                    for k, v in mapped.items())):
        raise EngineFileError(f"{slots_dir / SLOTS_CARD}: its weights must map weight names to initializer names; "
                              "tune a task again to export the slot graph anew")
    cuts = slots.get("depths", [])
    if not (isinstance(cuts, list) and all(type(d) is int and 1 <= d < manifest.model.num_layers
                                           and depth_graph(d) in slots["files"] for d in cuts)):
        raise EngineFileError(f"{slots_dir / SLOTS_CARD}: its depths must be block counts below the engine's "
                              f"{manifest.model.num_layers}, each graph among its files, got {cuts!r}; tune a task "
                              "again to export it anew")
    weights = engine_weights(manifest)
    if slots.get("engine_weights") != weights:
        raise EngineFileError(f"{slots_dir} was exported from other weights than {engine}'s; tune the tasks again")
    files = {f"{TASKS}/{SLOTS}/{k}": v for k, v in slots["files"].items()}
    adapters, cards, calibrations = [], [], []
    for name in found:
        card = read_card(engine, name)
        if card.get("engine_weights") != weights:
            raise EngineFileError(f"task {name!r} was tuned on other weights than {engine}'s ({card.get('engine')}); "
                                  f"tune it again on this engine, or remove it (onepass tasks remove {engine} {name})")
        outside = sorted(set(card["blocks"]) - set(slots["blocks"]))
        if outside:
            raise EngineFileError(f"task {name!r} adapts blocks {outside}, which the slot graph has no slots on: tune "
                                  "it again (the slot graph is exported again)")
        files[f"{TASKS}/{name}/{FACTORS}"] = card["factors_sha256"]
        if card.get("head") is not None:
            if not slots.get("heads"):
                raise EngineFileError(f"task {name!r} is a decision head, which the slot graph takes none of (it was "
                                      "exported before task heads): tune a task again to export it anew")
            files[f"{TASKS}/{name}/{HEAD}"] = _head_card(card, name)["sha256"]
        cards.append(card)
    if verify:  # before any file is parsed: a damaged one is named, never a traceback of its parser
        for rel, sha in files.items():
            if not (engine / rel).is_file() or sha256_file(engine / rel) != sha:
                raise EngineFileError(f"{engine / rel} is missing or does not match its recorded sha256: the file "
                                      "changed after the task was written; tune the task again")
    heads = []
    for name, card in zip(found, cards):
        adapters.append(_adapter(engine / TASKS / name / FACTORS, name, card))
        heads.append(_head(engine / TASKS / name / HEAD, name, card["head"], manifest.model)
                     if card.get("head") is not None else None)
        try:
            calibrations.append(Calibration.from_dict(card["calibration"]) if card.get("calibration") else None)
        except (TypeError, ValueError, KeyError) as err:
            raise EngineFileError(f"task {name!r}'s calibration is invalid ({err}): tune it again") from None
    return Tasks(tuple(found), tuple(adapters), tuple(cards), tuple(calibrations), tuple(slots["blocks"]),
                 f"{TASKS}/{SLOTS}/{GRAPH}", files, mapped, tuple(heads),
                 {int(d): f"{TASKS}/{SLOTS}/{depth_graph(d)}" for d in slots.get("depths", ())})


def served(engine: Path, manifest: Manifest, verify: bool = True) -> tuple[Manifest, Tasks | None]:
    """(the manifest the backend reads, the engine's tasks): with tasks, the manifest's graph is their slot graph (which
    answers untasked questions as the engine's own graph, its task inputs empty), its files added, and its map of
    weights to initializers (which the PyTorch backend rebuilds the decoder through) the slot graph's."""
    tasks = load(engine, manifest, verify)
    if tasks is None:
        return manifest, None
    source = {**manifest.source, "weights": tasks.weights}  # None: a slot graph exported before its card had one
    return dataclasses.replace(manifest, graph=tasks.graph, files={**manifest.files, **tasks.files},
                               source=source), tasks


def _adapter(path: Path, name: str, card: dict) -> TaskAdapter:
    try:
        with np.load(path, allow_pickle=False) as data:
            factors: dict = {}
            for key in data.files:
                side, block, proj = key.split(".")
                factors.setdefault((int(block), proj), {})[side] = data[key].astype(np.float32)
        return TaskAdapter(name, int(card["rank"]), {k: (v["A"], v["B"]) for k, v in factors.items()})
    except Exception as err:  # noqa: BLE001 - any damage to a file that was not verified (verify=False)
        raise EngineFileError(f"{path} cannot be read ({type(err).__name__}: {err}): tune task {name!r} again") from None


def _head_card(card: dict, name: str) -> dict:
    """A head task's card entry ``head`` (depth, beta, sha256), or EngineFileError saying what to do."""
    head = card["head"]
    ok = (isinstance(head, dict) and type(head.get("depth")) is int and head["depth"] >= 1
          and type(head.get("beta")) in (int, float) and np.isfinite(head["beta"])
          and isinstance(head.get("sha256"), str))
    if not ok:
        raise EngineFileError(f"task {name!r}'s head entry is invalid ({head!r}): it needs a depth (a block count), a "
                              "beta and the head file's sha256; tune it again")
    return head


def _head(path: Path, name: str, head: dict, model) -> TaskHead:
    """The head task ``name``'s head from its file, its card entry ``head`` checked already (``_head_card``)."""
    if head["depth"] > model.num_layers:
        raise EngineFileError(f"task {name!r} reads its head after {head['depth']} blocks; the engine has "
                              f"{model.num_layers}: tune it again on this engine")
    try:
        with np.load(path, allow_pickle=False) as data:
            state = {k: data[k] for k in data.files}
        read = TaskHead.from_state(state, head["depth"], head["beta"])
        if read.w_in.shape[0] != model.hidden_size:
            raise ValueError(f"it reads hidden states of {read.w_in.shape[0]}, the engine's have {model.hidden_size}")
        return read
    except Exception as err:  # noqa: BLE001 - any damage to a file that was not verified (verify=False)
        raise EngineFileError(f"{path} cannot be read ({type(err).__name__}: {err}): tune task {name!r} again") from None


def _replace_dir(tmp: Path, final: Path) -> None:
    """``tmp`` renamed to ``final``; an old ``final`` is moved aside first and deleted after: never half of one."""
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        if old.exists():
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _staging(engine: Path, name: str) -> Path:
    tmp = root_of(engine) / f".{name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def write_task(engine: str | os.PathLike, manifest: Manifest, adapter: TaskAdapter, card: dict,
               head: tuple | None = None) -> Path:
    """Add or replace the task ``adapter.name`` beside the engine, atomically: its factors (float16) and its card
    (``card`` plus the engine's identity, rank, blocks and the factors' sha256); ``head``: (a ``DecisionHead``'s state
    as numpy, ``HEAD_KEYS``; depth; beta) for a task that is a decision head read after that many blocks."""
    engine = Path(engine)
    name = check_name(adapter.name)
    tmp = _staging(engine, name)
    try:
        arrays = {f"{side}.{block}.{proj}": value.astype(np.float16)
                  for (block, proj), pair in sorted(adapter.factors.items()) for side, value in zip("AB", pair)}
        np.savez(tmp / FACTORS, **arrays)
        full = {**card, "name": name, "engine": manifest.name, "engine_weights": engine_weights(manifest),
                "rank": adapter.rank, "blocks": sorted({b for b, _ in adapter.factors}),
                "factors_sha256": sha256_file(tmp / FACTORS), "head": None}
        if head is not None:
            state, depth, beta = head
            TaskHead.from_state(state, depth, beta)  # refused here, before anything is in place, where it cannot run
            np.savez(tmp / HEAD, **{k: np.asarray(state[k], np.float32) for k in HEAD_KEYS})
            full["head"] = {"depth": int(depth), "beta": float(beta), "sha256": sha256_file(tmp / HEAD),
                            "width": int(np.asarray(state["out.weight"]).size)}
        (tmp / CARD).write_text(json.dumps(full, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _replace_dir(tmp, root_of(engine) / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root_of(engine) / name


def update_card(engine: str | os.PathLike, name: str, extra: dict) -> None:
    """Add ``extra`` to a task's card (what was measured of it after it was written), atomically, under the lock."""
    path = root_of(Path(engine)) / check_name(name) / CARD
    with locked(engine):
        card = {**read_card(engine, name), **extra}
        tmp = path.with_name(f".{CARD}.{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(json.dumps(card, indent=2, sort_keys=True, default=float) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def slot_card(engine: str | os.PathLike) -> dict:
    """The engine's slot graph card (its blocks, whether it takes task heads, its cut depths, its files); {} where it
    has none."""
    path = root_of(Path(engine)) / SLOTS / SLOTS_CARD
    return _json(path) if path.is_file() else {}


def depth_graph(depth: int) -> str:
    """The file name of the slot graph cut at ``depth`` blocks (in the slots folder)."""
    return f"graph.d{int(depth)}.onnx"


def write_slots(engine: str | os.PathLike, manifest: Manifest, blocks, export, weight_map=None,
                heads: bool = False, depths=()) -> None:
    """Export the slot graph on ``blocks`` with ``export(path)`` (it writes ``path`` and ``path``.data) and put it in
    place atomically with its card; ``weight_map(path)``: the graph's {reference weight name: initializer}, recorded
    in the card (as an engine's manifest records its own); ``heads``: whether the graph takes task heads; ``depths``:
    the depths ``export`` also wrote a graph cut at (``depth_graph``)."""
    engine = Path(engine)
    tmp = _staging(engine, SLOTS)
    try:
        export(tmp / GRAPH)
        card = {"blocks": sorted(blocks), "engine": manifest.name, "engine_weights": engine_weights(manifest),
                "files": {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}, "heads": bool(heads),
                "depths": sorted(int(d) for d in depths)}
        mapped = weight_map(tmp / GRAPH) if weight_map is not None else None
        if mapped is not None:
            card["weights"] = mapped
        _put_slots(tmp, card, root_of(engine) / SLOTS)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def add_cuts(engine: str | os.PathLike, depths, export) -> None:
    """Add graphs cut at ``depths`` to the engine's slot graph folder, the rest kept as it is: the folder staged with
    its files hard-linked (its card written anew, never through a link), ``export(path, depth)`` writing each cut
    graph at the path ``depth_graph`` names, then renamed into place whole."""
    engine = Path(engine)
    current = root_of(engine) / SLOTS
    card = _json(current / SLOTS_CARD, ("blocks", "files"))
    tmp = _staging(engine, SLOTS)
    try:
        for path in current.iterdir():
            if path.name != SLOTS_CARD:
                link_or_copy(path, tmp / path.name)
        for depth in depths:
            export(tmp / depth_graph(depth), depth)
        new = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.name not in card["files"]}
        _put_slots(tmp, {**card, "files": {**card["files"], **new},
                         "depths": sorted({*card.get("depths", ()), *(int(d) for d in depths)})}, current)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _put_slots(tmp: Path, card: dict, final: Path) -> None:
    """The staged slots folder ``tmp`` given its ``card`` and renamed to ``final``, once every cut graph the card
    names was written (EngineFileError otherwise)."""
    missing = [depth_graph(d) for d in card["depths"] if depth_graph(d) not in card["files"]]
    if missing:
        raise EngineFileError(f"the slot graph's export wrote no {missing[0]}")
    (tmp / SLOTS_CARD).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _replace_dir(tmp, final)


def remove(engine: str | os.PathLike, name: str) -> None:
    """Remove a task (ValueError naming the tasks there when it is not one); the slot graph goes with the last task.
    Under the store's lock."""
    engine = Path(engine)
    with locked(engine):
        present = names(engine)
        if check_name(name) not in present:
            raise ValueError(f"{engine} has no task {name!r}; its tasks: {', '.join(present) or 'none'}")
        gone = root_of(engine) / f".{name}.removed-{uuid.uuid4().hex[:8]}"
        (root_of(engine) / name).rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
        if not names(engine):  # the slot graph goes with the last task (writers wait on the lock)
            shutil.rmtree(root_of(engine), ignore_errors=True)
