"""Passes and prefills that stop at the depth their questions need: an engine's head tasks read below its last block.

A head task (``tasks.TaskHead``) reads its answer after its own number of blocks. Its slot graph holds a graph cut at
each such depth (``task_store.depth_graph``: those blocks and the task heads, nothing above), opened as one more
backend of the engine's kind. A pass runs on the shallowest graph that holds every question in it: untasked questions
and LoRA tasks need every block, so a pass with one of them runs the full slot graph, and a pass of head tasks only
runs to the deepest of them. A state is prefilled by the graph its questions need and cached with that many blocks'
K/V; a later question that needs more prefills it again on the deeper graph, which replaces it in the cache (its first
blocks' K/V are the same computation). A shallower graph reads the first blocks of a deeper state's K/V.

The cut graphs are ONNX graphs fed as the slot graph is; ONNX Runtime and OpenVINO at f32 open them. Any other backend
(the PyTorch reference decoder, OpenVINO's bf16, a custom factory) answers every pass on the full slot graph: the same
answers, every block run.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from ..backends.base import Backend, StateKV
from .tasks import feed_tasks

log = logging.getLogger("onepass.engine")

CUT_BACKENDS = ("onnxruntime", "onnxruntime-gpu", "openvino-cpu")  # the backends that open the cut graphs


class Depths:
    """The engine's cut graphs' backends and the depth each task's questions need."""

    def __init__(self, layers: int, backends: dict, task_depth: tuple):
        self.layers = layers
        self.backends = dict(sorted(backends.items()))  # depth (< layers) -> its backend
        self.task_depth = np.append(np.asarray(task_depth, np.int64), layers)  # per task; the last: no task

    @classmethod
    def none(cls, layers: int) -> "Depths":
        return cls(layers, {}, ())

    def __bool__(self) -> bool:
        return bool(self.backends)

    def graph(self, needed: int) -> int:
        """The depth of the shallowest graph that holds ``needed`` blocks (the model's: the full slot graph)."""
        return next((d for d in self.backends if d >= needed), self.layers)

    def of_tasks(self, tasks) -> int:
        """The graph depth for questions of ``tasks`` (task numbers, -1: none)."""
        tasks = np.asarray(tasks, dtype=np.int64)
        return self.graph(int(self.task_depth[tasks].max()) if tasks.size else 0)

    def of_batch(self, batch) -> int:
        """The graph depth a packed pass needs: every block where any token is of no task."""
        if not self or batch.token_task is None:
            return self.layers
        return self.of_tasks(np.unique(batch.token_task))

    def of_sets(self, sets) -> int:
        """The graph depth the state of question sets needs (their deepest question's)."""
        if not self:
            return self.layers
        return max((self._of_set(qs) for qs in sets), default=self.layers)

    def _of_set(self, qs) -> int:
        """One question set's graph depth, found once per compiled set."""
        if "depth" not in qs.memo:
            qs.memo["depth"] = self.of_tasks([q.task for q in qs.encoded])
        return qs.memo["depth"]

    def run_on(self, full: Backend, depth: int, kv: StateKV | None = None) -> tuple:
        """(the backend of the graph ``depth`` deep, ``kv``'s first ``depth`` blocks where it holds more)."""
        backend = full if depth >= self.layers else self.backends[depth]
        if kv is not None and len(kv.layers) > backend.model.num_layers:
            n = backend.model.num_layers
            kv = StateKV(kv.layers[:n], kv.length, kv.nbytes * n // len(kv.layers), None)
        return backend, kv

    def close(self) -> None:
        for backend in self.backends.values():
            with backend.serial():
                backend.close()


def open_cut(root, served, tasks, full: Backend, threads) -> Depths:
    """The engine's cut graphs opened as backends of ``full``'s kind (where it is one of ``CUT_BACKENDS``) and fed
    the tasks; none where the engine has no head task read below its last block. A graph that fails to open is
    logged and left out: its passes run on the full slot graph."""
    from .. import backends

    layers = served.model.num_layers
    if tasks is None or not tasks.heads:
        return Depths.none(layers)
    task_depth = tuple(layers if h is None else h.depth for h in tasks.heads)
    used = set(task_depth) & set(tasks.depth_graphs)
    if not used or full.name not in CUT_BACKENDS:
        return Depths(layers, {}, task_depth)
    opened = {}
    for depth in sorted(used):
        manifest = dataclasses.replace(served, graph=tasks.depth_graphs[depth],
                                       model=dataclasses.replace(served.model, num_layers=depth))
        try:
            backend = backends.factory(full.name)(root, manifest, threads)
            feed_tasks(backend, tasks, cut=True)
        except Exception as err:  # noqa: BLE001 - the full slot graph answers the same, every block run
            log.warning("%s: the slot graph cut at %d blocks did not open on %s (%s); its passes run every block",
                        root, depth, full.name, err)
            continue
        opened[depth] = backend
    return Depths(layers, opened, task_depth)
