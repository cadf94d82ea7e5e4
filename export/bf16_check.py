"""Checking a bf16 graph on a CPU whose ONNX Runtime has no bf16 GEMM.

Two checks, each exact for what it covers:

* **the graph's wiring and weights** — its *fp32 twin* (every bf16 initializer upcast, which
  is exact, and every cast to bf16 turned into a cast to float32) runs on ONNX Runtime and
  must reproduce, at the fp32 tolerances, PyTorch running the same model with its block
  weights rounded to bf16 and float32 arithmetic. What the twin drops is only the rounding
  of the GEMM inputs to bf16, which no CPU kernel here can run.
* **the stored bf16 weights** — the PyTorch backend, rebuilt from the graph's own
  initializers, runs the bf16 GEMMs and must reproduce the golden file (written by the bf16
  PyTorch module at export) at the bf16 tolerances.

What neither covers is how a GPU's bf16 kernels round: that is the TensorRT/CUDA golden check
on the device (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from ..runtime.core import manifest as mf
from ..runtime.core.engine import Engine
from ..runtime.core.prompt import PromptEncoder
from ..runtime.core.selfcheck import check_golden
from ..runtime.backends.torch_decoder import PackedDecoder
from .golden import write_golden

BLOCK_GEMMS = ("q", "k", "v", "o", "gate", "up", "down")


def fp32_twin(graph: Path, out: Path) -> int:
    """Write the fp32 twin of a bf16 graph to ``out`` (external data beside it); returns the tensors upcast."""
    model = onnx.load(str(graph))
    count = 0
    for i, tensor in enumerate(model.graph.initializer):
        if tensor.data_type == TensorProto.BFLOAT16:
            values = numpy_helper.to_array(tensor).astype(np.float32)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values, tensor.name))
            count += 1
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.BFLOAT16:
                attr.i = TensorProto.FLOAT
    for info in model.graph.value_info:
        if info.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data")
    return count


def bf16_weights_fp32_math(decoder: PackedDecoder) -> PackedDecoder:
    """``decoder`` (fp32) with its block GEMM weights rounded to bf16, in place; arithmetic stays float32."""
    with torch.no_grad():
        for block in decoder.blocks:
            for name in BLOCK_GEMMS:
                weight = getattr(block, name).weight
                weight.copy_(weight.to(torch.bfloat16).float())
    return decoder


def check_bf16_engine(root: Path, reference: PackedDecoder, work: Path) -> dict:
    """Both checks for the bf16 engine at ``root``; ``reference`` is the fp32 decoder it was lowered from
    (changed in place). Raises EngineFileError when either fails; returns the differences."""
    from ..runtime.backends import factory

    manifest = mf.load(root, verify=False)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        shutil.copy(root / manifest.tokenizer, work / manifest.tokenizer)
        fp32_twin(root / manifest.graph, work / manifest.graph)
        write_golden(bf16_weights_fp32_math(reference), PromptEncoder(str(work / manifest.tokenizer), manifest.prompt),
                     work / manifest.golden)
        mf.write(work, dataclasses.replace(manifest, precision="fp32"))
        twin = check_golden(Engine.load(work, verify=False, backend="onnxruntime"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # the reference decoder's arithmetic (fp32 residual, bf16 GEMMs): what the golden file was written with
    arithmetic = check_golden(Engine.load(root, verify=False, backend=factory("torch-cpu", fused=False)))
    return {"fp32_twin": twin, "torch_bf16": arithmetic}
