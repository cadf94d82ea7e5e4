"""The decoder graph's I/O contract, written once.

One ONNX graph serves both roles of the engine:

* **prefill** — the state's tokens are one causal trunk with no past; the graph
  returns the K/V of those tokens (the state's cache);
* **score** — the packed question/option tree runs against the state's K/V
  (read-only) and returns the log-probabilities of the target tokens at the
  read-out positions.

Inputs (no batch axis: a packed pass is one sequence):

==================  =========  =====================  =========================================
name                dtype      shape                  meaning
==================  =========  =====================  =========================================
input_ids           int64      [N]                    packed token ids
position_ids        int64      [N]                    absolute rotary positions
tree_mask           bool       [N, N]                 True where token i may attend packed j
past_key.{l}        float32    [Hkv, S, D]            state keys of layer l (S may be 0)
past_value.{l}      float32    [Hkv, S, D]            state values of layer l
readout_index       int64      [R]                    packed index whose logits are read
readout_target      int64      [R]                    token id scored at that read-out
past_length         int64      []                     rows of past_* that are the state: rows from
                                                      it on are padding no token sees (a state
                                                      padded to a length bucket; S when unpadded)
==================  =========  =====================  =========================================

Outputs:

==================  =========  =====================  =========================================
target_logprob      float32    [R]                    log p(target | prefix), full-vocab softmax
present_key.{l}     float32    [Hkv, N, D]            keys of the N new tokens (not the past)
present_value.{l}   float32    [Hkv, N, D]            values of the N new tokens
head_score          float32    [R]                    decision-head score per read-out row
                                                      (only in engines with a decision head)
==================  =========  =====================  =========================================

Every packed token sees the first ``past_length`` rows of the past; ``tree_mask`` says
which packed tokens it sees. Logits are computed only at the R read-out rows, never
N x vocab. Graphs exported before ``past_length`` existed lack it (every past row is
then the state): backends feed it only where the graph has it (``io_names``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

#: Symbolic names of the dynamic axes.
PACKED, PAST, READOUT = "packed", "past", "readout"
#: The input that masks the padding rows of a bucketed past (absent from graphs exported before it).
PAST_LENGTH = "past_length"
#: The packed pass's inputs, each named as the ``PackedBatch`` field it is fed from (``batch_inputs``).
INPUT_IDS, POSITION_IDS, TREE_MASK = "input_ids", "position_ids", "tree_mask"
READOUT_INDEX, READOUT_TARGET = "readout_index", "readout_target"
BATCH_INPUTS = (INPUT_IDS, POSITION_IDS, TREE_MASK, READOUT_INDEX, READOUT_TARGET)
#: A block's linear maps, in peft's order (q_proj ... down_proj): the order of a task-slot graph's task inputs.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
#: The outputs read on the host, and the prefix of the new K/V outputs (which stay where the backend keeps K/V).
TARGET_LOGPROB, HEAD_SCORE, PRESENT = "target_logprob", "head_score", "present_"


@dataclass(frozen=True)
class TensorSpec:
    """Name, element type and shape (ints are fixed, strings are dynamic axes)."""

    name: str
    dtype: str
    shape: tuple


def input_specs(num_layers: int, num_kv_heads: int, head_dim: int) -> list[TensorSpec]:
    """The graph inputs, in order, for a model of the given dimensions."""
    specs = [
        TensorSpec(INPUT_IDS, "int64", (PACKED,)),
        TensorSpec(POSITION_IDS, "int64", (PACKED,)),
        TensorSpec(TREE_MASK, "bool", (PACKED, PACKED)),
    ]
    for layer in range(num_layers):
        specs.append(TensorSpec(f"past_key.{layer}", "float32", (num_kv_heads, PAST, head_dim)))
        specs.append(TensorSpec(f"past_value.{layer}", "float32", (num_kv_heads, PAST, head_dim)))
    specs.append(TensorSpec(READOUT_INDEX, "int64", (READOUT,)))
    specs.append(TensorSpec(READOUT_TARGET, "int64", (READOUT,)))
    specs.append(TensorSpec(PAST_LENGTH, "int64", ()))
    return specs


#: A task-slot graph's extra inputs (``TaskDecoder``): the per-token task mask and each task block's factors.
TASK_MASK, TASK_RANK = "task_mask", "task_rank"


def task_factor_names(task_blocks) -> list[str]:
    """The task factors' input names in the slot graph's (``TaskDecoder``'s) order: per block, per projection, A then
    B (what follows ``task_mask``)."""
    return [f"task_{side}.{block}.{proj}" for block in task_blocks for proj in PROJECTIONS for side in "ab"]


def task_input_specs(task_blocks, shapes: dict) -> list[TensorSpec]:
    """The inputs a task-slot graph takes after the contract's: ``task_mask`` [N, K], then per task block and
    projection ``task_a.{block}.{proj}`` [in, K] and ``task_b.{block}.{proj}`` [K, out] (``shapes``: projection ->
    (in, out)); K, every task's rank summed, is dynamic (0: no task)."""
    specs = [TensorSpec(TASK_MASK, "float32", (PACKED, TASK_RANK))]
    for block in task_blocks:
        for proj in PROJECTIONS:
            d_in, d_out = shapes[proj]
            specs += [TensorSpec(f"task_a.{block}.{proj}", "float32", (d_in, TASK_RANK)),
                      TensorSpec(f"task_b.{block}.{proj}", "float32", (TASK_RANK, d_out))]
    return specs


#: A slot graph with task heads: decision heads read after a task's own number of blocks, fed as data like the
#: factors. Per read-out row its exit (the block count its hidden state is read after: the row's target log-prob and
#: its head score both come from that block's residual stream, final-normed, as an engine cut there computes them),
#: the mask of its head's units and its head's output bias; the heads' weights side by side on the unit axis (each
#: head's standardisation folded into its first layer):
#: ``head_score`` = sum(silu(h @ in + in_bias) * out * mask) + bias.
READOUT_EXIT, HEAD_MASK, HEAD_BIAS = "readout_exit", "head_mask", "head_bias"
HEAD_IN, HEAD_IN_BIAS, HEAD_OUT = "task_head_in", "task_head_in_bias", "task_head_out"
HEAD_UNITS = "head_units"
HEAD_ROWS, HEAD_WEIGHTS = (READOUT_EXIT, HEAD_MASK, HEAD_BIAS), (HEAD_IN, HEAD_IN_BIAS, HEAD_OUT)  # per pass; fed once
HEAD_INPUTS = HEAD_ROWS + HEAD_WEIGHTS


def task_head_specs(hidden: int) -> list[TensorSpec]:
    """The inputs a slot graph with task heads takes after its factors (``TaskDecoder(heads=True)``'s order)."""
    return [TensorSpec(READOUT_EXIT, "int64", (READOUT,)), TensorSpec(HEAD_MASK, "float32", (READOUT, HEAD_UNITS)),
            TensorSpec(HEAD_BIAS, "float32", (READOUT,)), TensorSpec(HEAD_IN, "float32", (hidden, HEAD_UNITS)),
            TensorSpec(HEAD_IN_BIAS, "float32", (HEAD_UNITS,)), TensorSpec(HEAD_OUT, "float32", (HEAD_UNITS,))]


def projection_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> dict:
    """(in, out) of each projection of a block."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden),
            "gate": (hidden, intermediate), "up": (hidden, intermediate), "down": (intermediate, hidden)}


_TASK_INPUT = re.compile(r"task_[ab]\.(\d+)\.\w+$")


_NONE = np.zeros(0, np.int64)


@dataclass(frozen=True)
class TaskFeeds:
    """What a task-slot graph is fed beside the contract's inputs: every task's factors (constant, by input name) and
    the task of each slot, from which each pass's ``task_mask`` is built from its tokens' tasks; in a graph with task
    heads (``heads`` not None) also the heads' weights (constant) and each task's exit and head bias, from which each
    pass's ``readout_exit``, ``head_mask`` and ``head_bias`` are built from its read-out rows' tasks."""

    factors: dict  # task_a.{block}.{proj} [in, K], task_b.{block}.{proj} [K, out]: float32
    slot_task: np.ndarray  # [K] int64: the task number of each slot
    count: int = 0  # tasks fed (a task of rank 0, a calibration only, has no slot)
    heads: dict | None = None  # HEAD_IN [d, U], HEAD_IN_BIAS [U], HEAD_OUT [U]; None: the graph has no task heads
    unit_task: np.ndarray = field(default_factory=lambda: _NONE)  # [U] int64: the task number of each head unit
    exits: np.ndarray = field(default_factory=lambda: _NONE)  # [count] int64: per task, the block count read after
    head_bias: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # [count]: each head's out bias
    layers: int = 0  # the graph's blocks: the exit of a row of no task

    def __post_init__(self):
        """Each task's exit is checked once, here: a row read after no block, or after more blocks than the graph
        has, would read zeros."""
        if self.heads is not None and not (self.layers >= 1 and (self.exits >= 1).all()
                                           and (self.exits <= self.layers).all()):
            raise ValueError(f"task exits must be block counts in 1..{self.layers}, got {self.exits.tolist()}")

    @classmethod
    def none(cls, input_shapes: dict, layers: int) -> "TaskFeeds":
        """No task (K = 0) for a graph whose task inputs have ``input_shapes`` (name -> shape, the task rank axis any
        value): the graph then computes the base engine's pass (every row read after its ``layers`` blocks)."""
        factors = {}
        for name, shape in input_shapes.items():
            if _TASK_INPUT.match(name):
                factors[name] = np.zeros((shape[0], 0) if name.startswith("task_a.") else (0, shape[1]), np.float32)
        heads = None
        if READOUT_EXIT in input_shapes:
            hidden = input_shapes[HEAD_IN][0]
            heads = {HEAD_IN: np.zeros((hidden, 0), np.float32), HEAD_IN_BIAS: np.zeros(0, np.float32),
                     HEAD_OUT: np.zeros(0, np.float32)}
        return cls(factors, np.zeros(0, np.int64), heads=heads, layers=layers)

    def inputs(self, token_task, n: int, readout_index=None) -> dict:
        """The task inputs of a pass of ``n`` tokens whose tasks are ``token_task`` ([N], -1: none; None: no token
        has a task, as in a prefill); with task heads, of its read-out rows ``readout_index`` too."""
        if token_task is None:
            out = {TASK_MASK: np.zeros((n, self.slot_task.shape[0]), np.float32), **self.factors}
        else:
            token_task = np.asarray(token_task, dtype=np.int64)
            if token_task.size and (token_task.min() < -1 or token_task.max() >= self.count):
                raise ValueError(f"token tasks must be in -1..{self.count - 1} (the {self.count} tasks fed); "
                                 f"got {token_task.min()}..{token_task.max()}")
            out = {TASK_MASK: (token_task[:, None] == self.slot_task[None, :]).astype(np.float32), **self.factors}
        if self.heads is not None:
            out.update(self.head_inputs(token_task, readout_index))
        return out

    def head_inputs(self, token_task, readout_index) -> dict:
        """A graph with task heads' per-pass inputs: each read-out row's exit, head unit mask and head bias (a row of
        no task: every block, no unit, 0), and the heads' weights."""
        readout_index = np.asarray(readout_index if readout_index is not None else _NONE, dtype=np.int64)
        rows = (np.full(readout_index.shape[0], -1, np.int64) if token_task is None
                else np.asarray(token_task, dtype=np.int64)[readout_index])
        exits = np.append(self.exits, self.layers).astype(np.int64)  # row task -1 reads the last entry
        bias = np.append(self.head_bias, 0.0).astype(np.float32)
        return {READOUT_EXIT: exits[rows], HEAD_MASK: (rows[:, None] == self.unit_task[None, :]).astype(np.float32),
                HEAD_BIAS: bias[rows], **self.heads}

    @property
    def blocks(self) -> tuple:
        """The blocks the task inputs are for."""
        return tuple(sorted({int(m.group(1)) for m in map(_TASK_INPUT.match, self.factors) if m}))


def output_specs(num_layers: int, num_kv_heads: int, head_dim: int, head: bool = False) -> list[TensorSpec]:
    """The graph outputs, in order, for a model of the given dimensions (``head``: with a decision head)."""
    specs = [TensorSpec(TARGET_LOGPROB, "float32", (READOUT,))]
    for layer in range(num_layers):
        specs.append(TensorSpec(f"{PRESENT}key.{layer}", "float32", (num_kv_heads, PACKED, head_dim)))
        specs.append(TensorSpec(f"{PRESENT}value.{layer}", "float32", (num_kv_heads, PACKED, head_dim)))
    if head:
        specs.append(TensorSpec(HEAD_SCORE, "float32", (READOUT,)))
    return specs


def io_names(model, graph_outputs) -> tuple[list[str], list[str], bool]:
    """(past K/V input names in order, output names in order, whether the graph has a decision head) of an engine's
    graph whose outputs are ``graph_outputs``: what every ONNX-running backend needs to feed and read it (and
    ``PAST_LENGTH`` where the graph's inputs have it)."""
    dims = (model.num_layers, model.num_kv_heads, model.head_dim)
    past = [s.name for s in input_specs(*dims) if PAST in s.shape]  # the K/V inputs (past_length is not one)
    head = HEAD_SCORE in set(graph_outputs)
    return past, [s.name for s in output_specs(*dims, head=head)], head


def batch_inputs(batch, tasks: TaskFeeds | None = None) -> dict:
    """The packed pass's graph inputs of ``batch`` (a ``PackedBatch``) by their contract names (the past and
    ``past_length`` are the backend's to add), and the task inputs of a task-slot graph (``tasks``)."""
    inputs = {name: getattr(batch, name) for name in BATCH_INPUTS}
    if tasks is not None:
        inputs.update(tasks.inputs(batch.token_task, batch.num_tokens, batch.readout_index))
    return inputs
