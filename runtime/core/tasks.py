"""Tuned tasks as low-rank updates and decision heads fed with the pass. Pure numpy.

A LoRA task is an adapter trained with the state's K/V from the base weights (``PackedScorer(state_weights=...)``):
it acts on its own question and option tokens only, so several tasks can share one prefill of a state and one
packed pass. The graph with task slots (``TaskDecoder``) takes, per adapted block and projection, every task's
factors side by side — A [in, K] and B [K, out], K the sum of the tasks' ranks — and a mask [N, K] that is 1 on
the slots of each packed token's task. Adding a task changes the data fed, never the graph.

A task may instead be a decision head read after its own number of blocks (``TaskHead``): the slot graph exported with
task heads reads each read-out row's hidden state after its task's exit block and runs every head's units on it, the
row keeping its own head's (``contract.task_head_specs``). Heads of any depths share one pass with each other, with
LoRA tasks and with untasked questions.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..backends.contract import (HEAD_IN, HEAD_IN_BIAS, HEAD_OUT, PROJECTIONS, TASK_MASK, TaskFeeds,  # noqa: F401
                                 projection_shapes, task_factor_names)

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class TaskAdapter:
    """One task's factors: (block, projection) -> (A [r, in], B [out, r] with the LoRA scale folded in)."""

    name: str
    rank: int
    factors: dict

    @classmethod
    def from_peft(cls, name: str, state: dict, scale: float) -> "TaskAdapter":
        """From a PEFT state dict (``...layers.{i}.self_attn.q_proj.lora_A[.adapter].weight`` -> array) and the
        adapter's one scale (alpha / r, as onepass's ``lora_config`` trains: no rank or alpha patterns, no rsLoRA)."""
        parts: dict = {}
        for key, value in state.items():
            m = _KEY.search(key)
            if m is None:
                raise ValueError(f"task {name!r}: {key!r} is not a LoRA factor of a block's projection")
            block, proj, side = int(m.group(1)), m.group(2), m.group(3)
            if proj not in PROJECTIONS:
                raise ValueError(f"task {name!r}: unknown projection {proj!r} (known: {', '.join(PROJECTIONS)})")
            parts.setdefault((block, proj), {})[side] = np.asarray(value, dtype=np.float32)
        factors, ranks = {}, set()
        for where, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"task {name!r}: block {where[0]} {where[1]} has lora_{''.join(ab)} alone")
            factors[where] = (ab["A"], ab["B"] * np.float32(scale))
            ranks.add(ab["A"].shape[0])
        if len(ranks) != 1:
            raise ValueError(f"task {name!r}: one rank expected, found {sorted(ranks)}")
        return cls(name, ranks.pop(), factors)


HEAD_KEYS = ("shift", "scale", "inner.weight", "inner.bias", "out.weight", "out.bias")  # a DecisionHead's state


@dataclass(frozen=True)
class TaskHead:
    """A decision head read after ``depth`` blocks, as the slot graph runs it: ``score(h) = w_out . silu(h @ w_in +
    b_in) + b_out`` over the final-normed hidden state h of an option's last read-out row (the head's standardisation
    folded into ``w_in`` and ``b_in``); an option's score is ``beta * mean log-likelihood + score``, both read after
    ``depth`` blocks."""

    depth: int
    beta: float
    w_in: np.ndarray  # [d, W]
    b_in: np.ndarray  # [W]
    w_out: np.ndarray  # [W]
    b_out: float

    @classmethod
    def from_state(cls, state: dict, depth: int, beta: float) -> "TaskHead":
        """From a ``DecisionHead``'s state dict (``HEAD_KEYS``, numpy) with a hidden layer (``width`` > 0)."""
        missing = [k for k in HEAD_KEYS if k not in state]
        if missing:
            raise ValueError(f"a task head needs a hidden layer and its standardisation; missing {', '.join(missing)}")
        shift, scale = (np.asarray(state[k], np.float64) for k in ("shift", "scale"))
        inner = np.asarray(state["inner.weight"], np.float64) / scale[None, :]  # [W, d]: (h - shift) / scale folded
        b_in = np.asarray(state["inner.bias"], np.float64) - inner @ shift
        out = np.asarray(state["out.weight"], np.float64).reshape(-1)
        if inner.shape[0] != out.shape[0] or shift.shape != scale.shape or inner.shape[1] != shift.shape[0]:
            raise ValueError(f"a task head's layers disagree in shape: inner {inner.shape}, out {out.shape}, "
                             f"shift {shift.shape}")
        if not (all(np.isfinite(np.asarray(state[k], np.float64)).all() for k in HEAD_KEYS) and np.isfinite(beta)
                and (scale != 0).all()):
            raise ValueError("a task head's weights, beta and scale must be finite, its scale non-zero")
        return cls(int(depth), float(beta), inner.T.astype(np.float32), b_in.astype(np.float32),
                   out.astype(np.float32), float(np.asarray(state["out.bias"]).reshape(-1)[0]))


def head_feeds(feeds: TaskFeeds, graph_heads: dict | None, heads: Sequence, layers: int) -> TaskFeeds:
    """``feeds`` for a graph of ``layers`` blocks whose task heads are fed as ``graph_heads`` with no head
    (``TaskFeeds.none``'s; None: the graph takes none), with the tasks' ``heads`` (per task a ``TaskHead`` or None)
    side by side on the unit axis, each task's exit (its head's depth; every block for a task without one) and head
    bias; ValueError where the slot graph takes no task heads or a depth is outside 1..``layers`` (``TaskFeeds``
    checks the exits)."""
    if not any(h is not None for h in heads):
        return dataclasses.replace(feeds, heads=graph_heads, exits=np.full(len(heads), layers, np.int64),
                                   head_bias=np.zeros(len(heads), np.float32), layers=layers)
    if graph_heads is None:
        raise ValueError("a task is a decision head, and this engine's slot graph takes no task heads (it was "
                         "exported before them): tune a task again to export it anew")
    some = [h for h in heads if h is not None]
    unit_task = np.concatenate([np.full(h.w_out.shape[0], t, np.int64) for t, h in enumerate(heads) if h is not None])
    weights = {HEAD_IN: np.concatenate([h.w_in for h in some], axis=1),
               HEAD_IN_BIAS: np.concatenate([h.b_in for h in some]), HEAD_OUT: np.concatenate([h.w_out for h in some])}
    return dataclasses.replace(feeds, heads=weights, unit_task=unit_task, layers=layers,
                               exits=np.array([layers if h is None else h.depth for h in heads], np.int64),
                               head_bias=np.array([0.0 if h is None else h.b_out for h in heads], np.float32))


@dataclass(frozen=True)
class TaskStack:
    """Tasks side by side: the graph's task inputs (in ``TaskDecoder`` order) and each task's slots."""

    names: tuple
    slots: tuple  # per task, its (start, stop) on the K axis
    inputs: list  # per task block and projection: A [in, K], B [K, out] (float32)
    blocks: tuple = ()  # the task blocks, in the inputs' order

    @property
    def width(self) -> int:
        """K, every task's rank summed."""
        return self.slots[-1][1] if self.slots else 0

    def slot_task(self) -> np.ndarray:
        """[K] int64: the task number of each slot."""
        return np.repeat(np.arange(len(self.slots)), [stop - start for start, stop in self.slots]).astype(np.int64)

    def feeds(self) -> TaskFeeds:
        """What a backend feeds the task-slot graph: the factors by input name, and each slot's task."""
        return TaskFeeds(dict(zip(task_factor_names(self.blocks), self.inputs)), self.slot_task(), len(self.slots))

    def mask(self, token_task: Sequence[int]) -> np.ndarray:
        """[N, K] float32: 1 on the slots of each token's task (-1: none, a row of zeros)."""
        return self.feeds().inputs(token_task, len(token_task))[TASK_MASK]


def stack(tasks: Sequence[TaskAdapter], task_blocks: Sequence[int], shapes: dict) -> TaskStack:
    """The tasks' factors side by side for a graph with slots on ``task_blocks``; ``shapes``: projection ->
    (in, out). A block or projection a task does not adapt gets zeros in its slots; a task that adapts a block
    without slots is refused (the graph could not apply it)."""
    blocks = set(task_blocks)
    slots, start = [], 0
    for task in tasks:
        outside = sorted({b for b, _ in task.factors} - blocks)
        if outside:
            raise ValueError(f"task {task.name!r} adapts blocks {outside}; this engine has task slots on "
                             f"blocks {sorted(blocks)} only")
        slots.append((start, start + task.rank))
        start += task.rank
    inputs = []
    for block in task_blocks:
        for proj in PROJECTIONS:
            d_in, d_out = shapes[proj]
            a, b = np.zeros((d_in, start), np.float32), np.zeros((start, d_out), np.float32)
            for task, (lo, hi) in zip(tasks, slots):
                if (block, proj) in task.factors:
                    fa, fb = task.factors[(block, proj)]
                    if fa.shape != (task.rank, d_in) or fb.shape != (d_out, task.rank):
                        raise ValueError(f"task {task.name!r}: block {block} {proj} has factors {fa.shape} and "
                                         f"{fb.shape}; this engine's {proj} takes ({task.rank}, {d_in}) and "
                                         f"({d_out}, {task.rank})")
                    a[:, lo:hi], b[lo:hi, :] = fa.T, fb.T
            inputs += [a, b]
    return TaskStack(tuple(t.name for t in tasks), tuple(slots), inputs, tuple(task_blocks))


def feed_tasks(backend, tasks, cut: bool = False) -> None:
    """``backend`` feeds its task-slot graph the engine's ``tasks`` (``task_feeds``; ``cut``: a slot graph cut at a
    depth, ``cut_feeds``) from now on; where it cannot, it is closed (the engine that opened it fails to load) and the
    error raised."""
    try:
        backend.tasks = cut_feeds(tasks, backend) if cut else task_feeds(tasks, backend)
    except Exception:
        backend.close()
        raise


def task_feeds(tasks, backend) -> TaskFeeds:
    """What ``backend`` feeds its task-slot graph for the engine's ``tasks`` (``task_store.Tasks``): their factors
    side by side on the graph's blocks. BackendUnavailable where the backend runs no task slots."""
    none = backend.tasks  # the graph's own feeds with no task: they give each projection's (in, out)
    if none is None:
        raise no_tasks_on(backend.name)
    if none.blocks != tuple(tasks.blocks):
        from ..backends.errors import EngineFileError

        raise EngineFileError(f"the slot graph {tasks.graph} has task inputs on blocks {list(none.blocks)}, its card "
                              f"says {list(tasks.blocks)}: tune a task again to export it anew")
    block = tasks.blocks[0]
    shapes = {p: (none.factors[f"task_a.{block}.{p}"].shape[0], none.factors[f"task_b.{block}.{p}"].shape[1])
              for p in PROJECTIONS}
    feeds = stack(tasks.adapters, tasks.blocks, shapes).feeds()
    try:
        return head_feeds(feeds, none.heads, tasks.heads or (None,) * len(tasks.names), backend.model.num_layers)
    except ValueError as err:
        from ..backends.errors import EngineFileError

        raise EngineFileError(str(err)) from None


def cut_feeds(tasks, backend) -> TaskFeeds:
    """What ``backend`` feeds a slot graph cut at its depth (no task slots, task heads): the heads read there or
    above. A question of any other task never runs on it (``depths.Depths``)."""
    none = backend.tasks
    if none is None or none.heads is None or none.blocks:
        raise no_tasks_on(backend.name)
    depth = backend.model.num_layers
    heads = tuple(h if h is not None and h.depth <= depth else None for h in tasks.heads)
    return head_feeds(TaskFeeds({}, np.zeros(0, np.int64), len(tasks.names)), none.heads, heads, depth)


def no_tasks_on(backend: str):
    """The error for a backend that runs no task slots, asked to serve an engine with tasks."""
    from ..backends.errors import BackendUnavailable

    return BackendUnavailable(f"the {backend} backend does not run tuned tasks (task slots); use openvino-cpu, "
                              "onnxruntime or torch-cpu/torch-cuda, or remove the tasks (onepass tasks remove)")
