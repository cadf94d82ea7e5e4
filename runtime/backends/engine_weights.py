"""An engine graph's weights by the reference decoder's names, whatever names the exporter gave them.

The dynamo exporter names an initializer after the module parameter it holds ("blocks.3.q.weight"), but that is the
exporter's choice, not a contract: another torch may name it otherwise, and the ONNX optimizer merges identical
initializers into one. So export records, in the manifest's ``source.weights``, which initializer holds each
reference-decoder weight, matched by content (``match``); the PyTorch backend reads the weights through that map
(``by_name``), falling back to the initializer names for engines exported before it. numpy and onnx only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import EngineFileError


def initializer_array(root: Path, tensor, graph_dir: Path | None = None) -> np.ndarray:
    """An initializer's values, read from its external-data file by offset and length when it has one: the file is
    named relative to the graph's directory ``graph_dir`` (default ``root``), and must lie inside ``root``.

    (onnx's own loader refuses external data with several hard links, which engine copies have.)
    """
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor).copy()
    info = {e.key: e.value for e in tensor.external_data}
    path = ((graph_dir or root) / info["location"]).resolve()
    if root.resolve() not in path.parents:
        raise EngineFileError(f"initializer {tensor.name} points outside the engine directory: {info['location']}")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
    with open(path, "rb") as fh:
        fh.seek(int(info.get("offset", 0)))
        data = fh.read(int(info.get("length", count * np.dtype(dtype).itemsize)))
    return np.frombuffer(data, dtype=dtype, count=count).reshape(tuple(tensor.dims)).copy()


def fingerprint(shape, raw: bytes) -> tuple:
    """What two tensors share when they hold the same values in the same dtype and shape."""
    return tuple(int(d) for d in shape), hashlib.sha256(raw).hexdigest()


TRANSPOSED = "^T"  # a map entry "<initializer>^T": the initializer holds the weight transposed


def match(weights: dict, graph_path: Path) -> dict[str, str]:
    """{weight name: the graph initializer holding exactly its values} for ``weights`` {name: (shape, raw bytes,
    raw bytes of its transpose or None)}: as it is, or transposed (``TRANSPOSED``: the exporter folds ``h @ w.t()``
    of an untied vocabulary head into a transposed constant); a weight no initializer holds either way is left
    out."""
    graph = onnx.load(str(graph_path), load_external_data=False)
    found: dict = {}
    for init in graph.graph.initializer:
        array = initializer_array(graph_path.parent, init)
        found.setdefault(fingerprint(array.shape, array.tobytes()), init.name)
    out = {}
    for name, (shape, raw, raw_transposed) in weights.items():
        key = fingerprint(shape, raw)
        if key in found:
            out[name] = found[key]
        elif raw_transposed is not None:
            flipped = fingerprint(tuple(reversed(shape)), raw_transposed)
            if flipped in found:
                out[name] = found[flipped] + TRANSPOSED
    return out


def by_name(root: Path, graph_file: str, mapping: dict | None, wanted) -> dict[str, np.ndarray]:
    """The engine graph's weights by reference name: through ``mapping`` (the manifest's ``source.weights``), or,
    for an engine exported before it, by initializer name for the initializers ``wanted(name)`` accepts."""
    graph = onnx.load(str(root / graph_file), load_external_data=False)
    inits = {i.name: i for i in graph.graph.initializer}
    graph_dir = (root / graph_file).parent  # external data is named relative to the graph (a slot graph's subdirectory)
    if not mapping:
        return {name: initializer_array(root, i, graph_dir) for name, i in inits.items() if wanted(name)}
    out = {}
    for name, entry in mapping.items():
        init_name = entry[:-len(TRANSPOSED)] if entry.endswith(TRANSPOSED) else entry
        if init_name not in inits:
            raise EngineFileError(f"{root}: the manifest maps {name} to initializer {init_name}, which the graph lacks; "
                                  "re-export the engine")
        array = initializer_array(root, inits[init_name], graph_dir)
        out[name] = np.ascontiguousarray(array.T) if entry.endswith(TRANSPOSED) else array
    return out


def vocabulary_matrices(root: Path, graph_file: str, vocab: int) -> list[str]:
    """Names of the graph's 2-D initializers with a vocabulary-sized axis (an embedding or a vocabulary head)."""
    graph = onnx.load(str(root / graph_file), load_external_data=False)
    return [i.name for i in graph.graph.initializer if len(i.dims) == 2 and vocab in list(i.dims)]
