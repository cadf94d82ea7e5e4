"""A graph that reads another graph's weights file instead of holding a copy of it.

The task-slot graph is the engine's decoder with slots added: exported on its own, it writes every weight again
(~540 MB for SmolLM2, so an engine with tasks was twice its size on disk). :func:`share` points each external
initializer of a graph whose bytes equal one of a base graph's at the base's weights file, at the base's offset, and
keeps only the others in the graph's own weights file. ONNX Runtime and OpenVINO refuse a weights path outside the
graph's directory, so the base's file is hard-linked beside the graph (copied where the file system refuses links:
the same bytes, only the saving lost). Bytes are compared by sha256, so a weight that differs in one bit is kept
apart and the graph computes exactly what it computed before.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..runtime.core.errors import EngineFileError
from ..runtime.core.manifest import link_or_copy

EXTERNAL = onnx.TensorProto.EXTERNAL


@dataclass(frozen=True)
class Where:
    """Where an external initializer's bytes are: a file beside the graph, an offset, a length."""
    location: str
    offset: int
    length: int


def _where(tensor) -> Where:
    data = {e.key: e.value for e in tensor.external_data}
    return Where(data["location"], int(data.get("offset", 0)), int(data["length"]))


def _read(directory: Path, where: Where) -> bytes:
    with open(directory / where.location, "rb") as f:
        f.seek(where.offset)
        data = f.read(where.length)
    if len(data) != where.length:
        raise EngineFileError(f"{directory / where.location} is shorter than its graph says ({where.offset} + "
                              f"{where.length} bytes)")
    return data


def _set(tensor, where: Where) -> None:
    del tensor.external_data[:]
    for key, value in (("location", where.location), ("offset", str(where.offset)), ("length", str(where.length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def external(model: onnx.ModelProto) -> list:
    """The initializers of ``model`` (loaded without its external data) whose bytes are in a file."""
    return [t for t in model.graph.initializer if t.data_location == EXTERNAL]


def share(graph: str | os.PathLike, base_graph: str | os.PathLike) -> dict:
    """Rewrite ``graph`` (an ONNX file with external weights) so that every weight equal to one of ``base_graph``'s
    is read from the base's weights file, hard-linked beside ``graph`` under its own name; the rest are written again
    into ``graph``'s weights file (removed when none is left). Returns the bytes shared and kept apart."""
    graph, base_graph = Path(graph), Path(base_graph)
    base = onnx.load(str(base_graph), load_external_data=False)
    by_digest = {}
    for tensor in external(base):
        where = _where(tensor)
        by_digest.setdefault(hashlib.sha256(_read(base_graph.parent, where)).digest(), where)
    model = onnx.load(str(graph), load_external_data=False)
    own = {_where(t).location for t in external(model)} | {graph.name + ".data"}  # the kept weights' file too
    linked = {w.location for w in by_digest.values()}
    clash = sorted(own & linked)
    if clash:
        raise EngineFileError(f"{graph}'s weights file and {base_graph}'s share the name {clash[0]!r}; export the "
                              "graph under another name")
    kept_path = graph.with_name(graph.name + ".data.kept")
    shared = kept = 0
    used = set()
    with open(kept_path, "wb") as out:
        for tensor in external(model):
            data = _read(graph.parent, _where(tensor))
            where = by_digest.get(hashlib.sha256(data).digest())
            if where is not None:
                _set(tensor, where)
                used.add(where.location)
                shared += where.length
            else:
                _set(tensor, Where(graph.name + ".data", out.tell(), len(data)))
                out.write(data)
                kept += len(data)
    for location in own:
        (graph.parent / location).unlink(missing_ok=True)
    if kept:
        kept_path.rename(graph.with_name(graph.name + ".data"))
    else:
        kept_path.unlink()
    for location in sorted(used):
        target = graph.parent / location
        if not (target.exists() and os.path.samefile(target, base_graph.parent / location)):  # another graph's link
            link_or_copy(base_graph.parent / location, target)
    onnx.save(model, str(graph))
    return {"shared_bytes": shared, "own_bytes": kept}
