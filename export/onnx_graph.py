"""Export the packed decoder to ONNX with dynamic packed, past and read-out lengths."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch.export import Dim

from ..runtime.backends import contract
from ..runtime.backends.torch_decoder import PackedDecoder, TaskDecoder

log = logging.getLogger("onepass.export")
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # "torchvision missing"

OPSET = 18


def example_inputs(dims, packed: int = 7, past: int = 5, readout: int = 3) -> tuple:
    """Small inputs of the contract's shapes, used to trace the graph."""
    n = packed
    ids = torch.arange(10, 10 + n, dtype=torch.int64)
    pos = torch.arange(past, past + n, dtype=torch.int64)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    kv = [torch.randn(dims.num_kv_heads, past, dims.head_dim) for _ in range(2 * dims.num_layers)]
    r_index = torch.arange(readout, dtype=torch.int64)
    r_target = torch.arange(20, 20 + readout, dtype=torch.int64)
    return (ids, pos, mask, *kv, r_index, r_target, torch.tensor(past - 1, dtype=torch.int64))


def dynamic_shapes(specs) -> tuple:
    """The dynamic axes of every input spec, in input order (see contract)."""
    axes = {contract.PACKED: Dim.DYNAMIC, contract.PAST: Dim.DYNAMIC, contract.READOUT: Dim.DYNAMIC,
            contract.TASK_RANK: Dim.DYNAMIC, contract.HEAD_UNITS: Dim.DYNAMIC}
    per_input = [{i: axes[a] for i, a in enumerate(spec.shape) if isinstance(a, str)} for spec in specs]
    return (*per_input[:3], tuple(per_input[3:]))  # forward(input_ids, position_ids, tree_mask, *args)


def _export(module, inputs: tuple, specs: list, names_out: list, path: Path) -> None:
    """``module`` traced on ``inputs`` and written to ``path`` (+ ``path.data`` external weights), its inputs named and
    their axes dynamic as ``specs`` say."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, inputs, dynamo=True, input_names=[s.name for s in specs],
                                    output_names=names_out, dynamic_shapes=dynamic_shapes(specs),
                                    opset_version=OPSET, optimize=True, verbose=False)
    program.save(str(path), external_data=True)


def export_decoder(decoder: PackedDecoder, path: Path) -> None:
    """Write ``path`` (+ ``path.data`` external weights) with the contract's names."""
    dims = decoder.dims
    names_out = [s.name for s in contract.output_specs(dims.num_layers, dims.num_kv_heads, dims.head_dim,
                                                       head=decoder.head is not None)]
    _export(decoder, example_inputs(dims), contract.input_specs(dims.num_layers, dims.num_kv_heads, dims.head_dim),
            names_out, path)


def export_task_decoder(graph: TaskDecoder, shapes: dict, path: Path) -> None:
    """Write the task-slot graph (``contract.task_input_specs`` after the contract's inputs, then, with task heads,
    ``contract.task_head_specs`` and the ``head_score`` output) to ``path`` (+ ``path.data``), its task rank and head
    unit axes dynamic: tasks are added by feeding more slots and units, not by export."""
    dims = graph.dims
    specs = [*contract.input_specs(dims.num_layers, dims.num_kv_heads, dims.head_dim),
             *contract.task_input_specs(graph.task_blocks, shapes),
             *(contract.task_head_specs(dims.hidden_size) if graph.heads else ())]
    names_out = [s.name for s in contract.output_specs(dims.num_layers, dims.num_kv_heads, dims.head_dim,
                                                       head=graph.heads)]
    base = example_inputs(dims)
    packed, readout = base[0].shape[0], base[-3].shape[0]
    sizes = {contract.PACKED: packed, contract.READOUT: readout, contract.TASK_RANK: 5, contract.HEAD_UNITS: 6}
    extra = []  # a traced rank of 5 and 6 head units (no other axis is either): any K and U (0 included) run
    for spec in specs[len(base):]:
        shape = [sizes.get(a, a) for a in spec.shape]
        extra.append(torch.randint(1, dims.num_layers + 1, shape) if spec.dtype == "int64" else torch.randn(*shape))
    _export(graph, (*base, *extra), specs, names_out, path)
