"""A decision head added to an engine's graph without exporting the decoder again.

A head engine is its base engine plus a few nodes after the read-out rows' final-normed hidden states (the input of
the vocabulary MatMul): standardise, the head's MLP, ``head_score`` [R]. Exporting the whole decoder for that took
45-55 s of a 50-row `onepass tune` whose choice took 6-10 s. Here the base graph's proto (2 MB) gets the head's nodes
and initializers appended, the weights file (~540 MB) is hard-linked (copied where links fail), and the engine is
checked as any export is: a golden file from the PyTorch decoder rebuilt from the graph's own weights with the head
attached, which ONNX Runtime must reproduce. An fp32 base engine only; anything else (a graph whose read-out is not
the expected LogSoftmax(MatMul(h, Transpose(embed))) pattern, a lower precision) is left to the full export.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..runtime.backends import contract
from ..runtime.backends.torch_backend import decoder_from_engine
from ..runtime.core import manifest as mf
from ..runtime.core.engine import Engine
from ..runtime.core.prompt import PromptEncoder
from ..runtime.core.selfcheck import check_golden
from .golden import write_golden

PREFIX = "head."  # the head's initializers, named as the reference decoder's state dict names them


def readout_hidden(graph: onnx.GraphProto) -> str | None:
    """The name of the read-out rows' final-normed hidden states [R, d]: the first input of the MatMul whose output
    the LogSoftmax reads (the vocabulary projection), or None when the graph is not of that shape."""
    producers = {out: node for node in graph.node for out in node.output}
    soft = [n for n in graph.node if n.op_type == "LogSoftmax"]
    if len(soft) != 1:
        return None
    matmul = producers.get(soft[0].input[0])
    if matmul is None or matmul.op_type != "MatMul":
        return None
    return matmul.input[0]


def can_append(base_dir: Path, base: mf.Manifest) -> bool:
    """Whether a head can be appended to this base engine's graph (else: the full export)."""
    if (base.precision != "fp32" or base.head is not None or base.quantization is not None
            or not base.source.get("weights") or not base.source.get("dims")):
        return False
    graph = onnx.load(str(Path(base_dir) / base.graph), load_external_data=False).graph
    taken = {name for node in graph.node for name in (*node.input, *node.output)} | {i.name for i in graph.initializer}
    return (readout_hidden(graph) is not None and contract.HEAD_SCORE not in {o.name for o in graph.output}
            and not any(name.startswith(("head_", PREFIX)) for name in taken))  # the names appended are free


def _head_nodes(head, hidden: str) -> tuple[list, list]:
    """(initializers, nodes) computing ``head_score`` [R] from ``hidden`` [R, d] as ``DecisionHead.forward`` does."""
    state = {PREFIX + k: v.detach().cpu().float().numpy() for k, v in head.state_dict().items()}
    inits = [numpy_helper.from_array(np.ascontiguousarray(v), name) for name, v in state.items()]
    node = helper.make_node
    nodes = [node("Sub", [hidden, PREFIX + "shift"], ["head_centred"]),
             node("Div", ["head_centred", PREFIX + "scale"], ["head_z"])]
    z = "head_z"
    if head.inner is not None:  # Gemm with transB: the initializer holds the torch weight [width, d] as it is
        nodes += [node("Gemm", [z, PREFIX + "inner.weight", PREFIX + "inner.bias"], ["head_inner"], transB=1),
                  node("Sigmoid", ["head_inner"], ["head_gate"]),
                  node("Mul", ["head_inner", "head_gate"], ["head_silu"])]
        z = "head_silu"
    inits.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "head_flat_shape"))
    nodes += [node("Gemm", [z, PREFIX + "out.weight", PREFIX + "out.bias"], ["head_out"], transB=1),
              node("Reshape", ["head_out", "head_flat_shape"], [contract.HEAD_SCORE])]
    return inits, nodes


def append_head(base_dir: Path, base: mf.Manifest, out: Path, *, name: str, head, head_info: mf.HeadInfo,
                finish=None) -> Path:
    """Write ``out``: the base engine with ``head`` (a DecisionHead) appended to its graph, read-out ``head``; written
    as ``out.partial`` and renamed, nothing left behind on failure. Call only where :func:`can_append` holds.
    ``finish``: Manifest -> Manifest before it is written (as ``export_engine``'s)."""
    base_dir, out = Path(base_dir), Path(out)
    model = onnx.load(str(base_dir / base.graph), load_external_data=False)
    hidden = readout_hidden(model.graph)
    inits, nodes = _head_nodes(head, hidden)
    model.graph.initializer.extend(inits)
    model.graph.node.extend(nodes)
    model.graph.output.append(helper.make_tensor_value_info(contract.HEAD_SCORE, onnx.TensorProto.FLOAT,
                                                            [contract.READOUT]))
    with mf.staged(out) as tmp:
        tmp.mkdir(parents=True)
        onnx.save(model, str(tmp / base.graph))  # the base's initializers keep pointing at its weights file's name
        plans = {p.get("file") for p in base.plans}  # TensorRT plans of the base's graph: not this graph's
        shared = {n for n in base.files if n not in (base.graph, base.golden, *plans)}  # the weights, the tokenizer
        for file_name in shared:
            mf.link_or_copy(base_dir / file_name, tmp / file_name)
        decoder = decoder_from_engine(base_dir, base).attach_head(head).eval()
        write_golden(decoder, PromptEncoder(str(tmp / base.tokenizer), base.prompt), tmp / base.golden)
        files = {n: mf.sha256_file(tmp / n) for n in (*shared, base.graph, base.golden)}  # ~1 s for the weights
        weights = {**base.source["weights"], **{k: k for k in (i.name for i in inits) if k.startswith(PREFIX)}}
        source = {**base.source, "weights": weights, "head_appended_to": {"engine": base.name, "graph": base.files[
            base.graph]}, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        manifest = dataclasses.replace(base, name=name, files=dict(sorted(files.items())), head=head_info,
                                       scoring=mf.Scoring(readout="head"), calibration=None, source=source,
                                       plans=[], gate=None, guarantees={})  # the base's: measured on its graph
        mf.write(tmp, finish(manifest) if finish else manifest)
        check_golden(Engine.load(tmp, verify=False, backend="onnxruntime"))
    return out
