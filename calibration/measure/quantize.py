"""`onepass quantize`: an INT8 engine that must keep its answers, or no engine at all.

The graph's weight MatMuls are quantized to INT8 (ONNX Runtime dynamic quantization,
per-channel weights), keeping the first and last blocks and the read-out in fp32. Then
the INT8 and fp32 engines answer the labelled rows; the INT8 engine is written only if its
argmax agreement and its largest option log-prob error meet the thresholds. Measured
agreement, error and speed are recorded in the manifest.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import QuantType, quantize_dynamic

from ...runtime.core import manifest as mf
from ...runtime.core.engine import Engine
from ...runtime.core.errors import OnepassError
from .calibrate import load_rows

KEEP_EDGE = 2  # blocks kept in fp32 at each end of the network: the most sensitive to rounding


def default_keep_blocks(num_layers: int) -> tuple[int, ...]:
    """The blocks kept in fp32 by default: the first and last ``KEEP_EDGE`` of the engine's own ``num_layers``
    (SmolLM2's 30: 0, 1, 28, 29); a network of at most 2 * KEEP_EDGE blocks keeps them all."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return tuple(b for b in range(num_layers) if b < KEEP_EDGE or b >= num_layers - KEEP_EDGE)


class QuantizationRefused(OnepassError):
    """The INT8 graph changes too many answers; nothing was written."""


def excluded_nodes(model, keep_blocks, keep_parts=()) -> list[str]:
    """MatMul/Gemm nodes to keep in fp32: those without a block weight (attention, read-out), those of
    ``keep_blocks``, and those whose weight name contains one of ``keep_parts`` (e.g. ".down.").
    Both their names and the names the quantizer gives a Gemm once it is a MatMul are listed."""
    def weight(node):
        return next((i for i in node.input if i.startswith("blocks.")), "")

    keep = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and (
        not weight(n) or any(weight(n).startswith(f"blocks.{b}.") for b in keep_blocks)
        or any(p in weight(n) for p in keep_parts))]
    return keep + [k + "_MatMul" for k in keep]


def quantize_graph(graph: Path, out: Path, exclude: list[str]) -> None:
    """Dynamic INT8 (per-channel weights) of every weight MatMul/Gemm not in ``exclude``."""
    quantize_dynamic(str(graph), str(out), weight_type=QuantType.QInt8, per_channel=True, nodes_to_exclude=exclude,
                     op_types_to_quantize=["MatMul", "Gemm"], use_external_data_format=True,
                     extra_options={"MatMulConstBOnly": True})


def _compare(ref: Engine, q8: Engine, rows: list[dict]) -> dict:
    agree, err, t_ref, t_q8 = 0, 0.0, [], []
    for row in rows:
        questions = {"q": row["question"]}
        encoded = ref.encode_questions(questions)
        ref.state(row["state"]), q8.state(row["state"])  # prefill outside the timed pass
        t0 = time.perf_counter()
        a = ref.option_logprobs(row["state"], encoded)[0]
        t1 = time.perf_counter()
        b = q8.option_logprobs(row["state"], encoded)[0]
        t_ref.append(t1 - t0), t_q8.append(time.perf_counter() - t1)
        agree += int(np.argmax(a) == np.argmax(b))
        err = max(err, float(np.abs(a - b).max()))
    return {"rows": len(rows), "agreement": agree / len(rows), "max_logprob_error": err,
            "speedup": float(np.median(t_ref) / np.median(t_q8))}


def quantize_engine(src: str | Path, out: str | Path, data: str | Path, *, min_agreement: float = 0.99,
                    max_error: float = 0.1, keep_blocks: tuple[int, ...] | None = None) -> dict:
    """Write an INT8 engine to ``out`` if it keeps its answers on ``data``; else raise QuantizationRefused.
    ``keep_blocks``: the blocks left in fp32 (default: :func:`default_keep_blocks` of the engine's layer count)."""
    src, out = Path(src), Path(out)
    ref = Engine.load(src, backend="onnxruntime")  # INT8 is an ONNX Runtime scheme: like against like
    layers = ref.manifest.model.num_layers
    keep_blocks = default_keep_blocks(layers) if keep_blocks is None else tuple(keep_blocks)
    if set(range(layers)) <= set(keep_blocks):
        raise QuantizationRefused(f"the engine's {layers} blocks would all stay fp32 (kept: {list(keep_blocks)}): "
                                  "nothing to quantize; no engine written")
    with mf.staged(out) as tmp:  # a refusal or failure leaves no directory behind
        tmp.mkdir(parents=True)
        for name in (ref.manifest.tokenizer, ref.manifest.golden):
            shutil.copy(src / name, tmp / name)
        staging = tmp / "fp32"  # a private copy: onnx refuses external data that has other hard links
        staging.mkdir()
        for name in ref.manifest.files:
            if name.startswith(Path(ref.manifest.graph).stem):
                shutil.copy(src / name, staging / name)
        graph = staging / ref.manifest.graph
        model = onnx.load(str(graph), load_external_data=False)
        quantize_graph(graph, tmp / ref.manifest.graph, excluded_nodes(model, keep_blocks))
        shutil.rmtree(staging)
        files = {p.name: mf.sha256_file(p) for p in sorted(tmp.iterdir())}
        manifest = dataclasses.replace(ref.manifest, files=files, name=f"{ref.name}-int8")
        mf.write(tmp, manifest)
        measured = _compare(ref, Engine.load(tmp, backend="onnxruntime"), load_rows(data))
        if measured["agreement"] < min_agreement or measured["max_logprob_error"] > max_error:
            raise QuantizationRefused(
                f"INT8 agrees with fp32 on {measured['agreement']:.1%} of {measured['rows']} rows (need "
                f">= {min_agreement:.1%}) with max log-prob error {measured['max_logprob_error']:.2f} (allowed "
                f"{max_error}); no engine written. Keep more layers in fp32 or use static QDQ.")
        record = {"scheme": "onnxruntime dynamic int8, per-channel weights", "fp32_blocks": list(keep_blocks),
                  **measured, "data": str(data)}
        mf.write(tmp, dataclasses.replace(manifest, quantization=record))
    return record
