"""Build an engine directory: load the model, export the graph, write tokenizer, golden file and manifest."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import onnx
import torch

from ..runtime.backends import contract
from ..runtime.core import manifest as mf
from ..runtime.core.engine import Engine
from ..runtime.core.errors import EngineFileError, ModelSourceError
from ..runtime.core.prompt import FORMS, PromptEncoder, PromptTemplate
from ..runtime.core.selfcheck import check_golden
from ..runtime.backends.engine_weights import match
from ..runtime.backends.torch_decoder import PackedDecoder, lower_precision
from .adapter import card, prompt_of, resolve
from .golden import write_golden
from .model_source import cut, load_model
from .onnx_graph import export_decoder

log = logging.getLogger("onepass.export")

GRAPH, TOKENIZER, GOLDEN = "decoder.onnx", "tokenizer.json", "golden.npz"


class _Steps:
    """Prints numbered progress lines with elapsed time to stderr."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.n += 1
        print(f"[{self.n}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {what}", file=sys.stderr, flush=True)


def name_dynamic_axes(path: Path, dims, head: bool = False) -> None:
    """Give the graph's dynamic axes the contract's names (packed, past, readout)."""
    model = onnx.load(str(path), load_external_data=False)
    specs = contract.input_specs(*dims) + contract.output_specs(*dims, head=head)
    by_name = {s.name: s for s in specs}
    for value in list(model.graph.input) + list(model.graph.output):
        for dim, want in zip(value.type.tensor_type.shape.dim, by_name[value.name].shape):
            if isinstance(want, str):
                dim.ClearField("dim_value")
                dim.dim_param = want
    onnx.save(model, str(path))


def export_engine(out: str | Path, model: str | None = None, *, name: str | None = None,
                  limits: mf.Limits | dict | None = None, scoring: mf.Scoring | None = None,
                  prompt: PromptTemplate | None = None, head=None, head_info: mf.HeadInfo | None = None,
                  precision: str = "fp32", adapters=None, tuning: mf.TuningInfo | None = None,
                  extra_files: dict | None = None, finish=None, depth: int | None = None) -> Path:
    """Compile ``model`` (None = the default SmolLM2 GGUF) into the engine directory ``out``.

    ``scoring`` None: the read-out the last adapter was trained for (its card's ``readout``), else the
    default (mean). ``prompt`` None: the form the last adapter was trained in (its card's ``prompt``), else the
    default (``chat``). ``head`` (a DecisionHead) with ``head_info`` exports a decision head into the graph and makes
    ``head`` the engine's read-out. ``precision="fp16"`` (or ``"bf16"``) stores the block weights in
    fp16 (bf16) and runs their GEMMs in it; embedding, norms, softmax, residual stream, read-out and
    K/V stay float32. A bf16 engine runs on TensorRT or the PyTorch backend, not ONNX Runtime's CPU.
    ``adapters``: LoRA adapter folders merged into the weights in order (None: the shipped default
    adapter for the default model, none for others; see :mod:`onepass.export.adapter`); ``tuning``
    is recorded in the manifest (else taken from the last adapter's card). ``extra_files``
    {name: path} are copied into the engine and hashed with the rest. ``finish``: Manifest -> Manifest, applied
    before the manifest is first written (what a caller records beside the export: a calibration, its adapter's
    final path), so that the engine appears at ``out`` whole. ``depth``: the graph keeps only the model's first
    ``depth`` blocks (:func:`onepass.export.model_source.cut`), read by ``head`` (required with it), which
    ``head_info.depth`` records.
    """
    if precision not in mf.PRECISIONS:
        raise ValueError(f"precision must be one of {mf.PRECISIONS}, got {precision!r}")
    if (head is None) != (head_info is None):
        raise ValueError("a decision head needs its HeadInfo (and the other way round)")
    if depth is not None and (head_info is None or head_info.depth != depth):
        raise ValueError("an engine cut to a depth needs a decision head fitted there (head_info.depth == depth)")
    out = Path(out)
    step = _Steps(6)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    step("loading model weights")
    adapters = resolve(None, model) if adapters is None else list(adapters)
    loaded = load_model(model, adapters)
    if depth is not None:
        cut(loaded.model, depth)
    if tuning is None and adapters and card(adapters[-1]).get("tuning"):
        tuning = mf.TuningInfo(**card(adapters[-1])["tuning"])
    trained_for = card(adapters[-1]).get("readout") if adapters else None
    trained_in = None
    if adapters:
        try:
            trained_in = prompt_of(adapters[-1])
        except ModelSourceError:
            if prompt is None:  # the form must come from the card; a caller naming one needs no warning from it
                raise
    _warn_unlike_training(adapters, trained_in, prompt, trained_for, scoring)
    if prompt is None:
        prompt = trained_in or PromptTemplate()
    if scoring is None:
        scoring = mf.Scoring(readout=trained_for) if trained_for else mf.Scoring()
    decoder = lower_precision(PackedDecoder(loaded.model).attach_head(head), precision).eval()
    dims = decoder.dims
    if head is not None:
        scoring = mf.Scoring(readout="head")
    with mf.staged(out) as tmp:  # nothing half-written: a failed export leaves no directory behind
        tmp.mkdir(parents=True)
        step(f"exporting the decoder graph ({dims.num_layers} layers, {dims.hidden_size} hidden) to ONNX; ~1 min")
        export_decoder(decoder, tmp / GRAPH)
        name_dynamic_axes(tmp / GRAPH, (dims.num_layers, dims.num_kv_heads, dims.head_dim), head=head is not None)
        weights = weight_map(decoder, tmp / GRAPH)
        step("writing tokenizer and golden file")
        loaded.tokenizer.backend_tokenizer.save(str(tmp / TOKENIZER))
        for file_name, path in (extra_files or {}).items():
            shutil.copyfile(path, tmp / file_name)
        write_golden(decoder, PromptEncoder(str(tmp / TOKENIZER), prompt), tmp / GOLDEN)
        step("hashing files and writing the manifest")
        files = {p.name: mf.sha256_file(p) for p in sorted(tmp.iterdir())}
        info = dims.model_info()
        if not isinstance(limits, mf.Limits):
            limits = mf.Limits.for_model(dims.max_position, **(limits or {}))
        manifest = mf.Manifest(name=name or loaded.name, model=info, tokenizer=TOKENIZER, graph=GRAPH, golden=GOLDEN,
                               files=files, limits=limits, prompt=prompt, scoring=scoring, head=head_info,
                               tuning=tuning, precision=precision,
                               source={**loaded.source, "exporter": f"torch {torch.__version__}", "opset": 18,
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "dims": asdict(dims), "weights": weights})
        mf.write(tmp, finish(manifest) if finish else manifest)
        if precision == "bf16":  # ONNX Runtime's CPU provider has no bf16 GEMM: see export/bf16_check.py
            from .bf16_check import check_bf16_engine

            step("checking the bf16 graph: its fp32 twin on ONNX Runtime, its weights in the PyTorch backend")
            diffs = check_bf16_engine(tmp, PackedDecoder(loaded.model).attach_head(head).eval(),
                                      out.with_name(out.name + ".bf16-twin"))
        else:
            step("checking the ONNX graph against the golden file (ONNX Runtime vs PyTorch fp32)")
            diffs = check_golden(Engine.load(tmp, verify=False, backend="onnxruntime"))
        log.info("golden max differences: %s", diffs)
    step(f"engine written to {out}")
    return out


def weight_map(decoder: PackedDecoder, graph: Path) -> dict[str, str]:
    """{the reference decoder's weight name: the graph initializer that holds it}, matched by content: the PyTorch
    backend rebuilds the decoder through it, whatever names this torch's exporter chose (runtime/backends/
    engine_weights.py). Names as the backend reads them (a lowered block layer's ``.inner.`` dropped)."""
    def canonical(name: str) -> str:  # a lowered block layer keeps its weight as "<layer>.inner.weight"
        return name.replace(".inner.", ".") if name.startswith("blocks.") else name

    def raw(t: torch.Tensor) -> bytes:
        return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()  # row-major order
    weights = {canonical(name): (tuple(t.shape), raw(t), raw(t.t()) if t.dim() == 2 else None)
               for name, t in decoder.state_dict().items()}
    found = match(weights, graph)
    lost = sorted(set(weights) - set(found))
    if lost:  # the backend would rebuild another decoder (an untied head silently tied, say): refuse now
        raise EngineFileError(f"the exported graph holds no initializer equal to {', '.join(lost[:3])} (as it is or "
                              "transposed): this torch's exporter transformed it; export with the torch this project "
                              "locks (constraints/ci.txt)")
    return found


def _warn_unlike_training(adapters, trained_in, prompt, trained_for, scoring) -> None:
    """A warning where the engine is told to ask in another prompt form, or read out otherwise, than its last adapter
    was trained in: allowed (a measurement may want it), but the adapter learned the tokens of its own form and read-out,
    so its answers are then not the ones its training measured."""
    log = logging.getLogger(__name__)
    if prompt is not None and trained_in is not None and prompt != trained_in:
        names = {template: name for name, template in FORMS.items()}
        log.warning("the adapter %s was trained in the %s prompt form and this engine asks in the %s form: its "
                    "answers are not those its training measured (leave --prompt out to ask in the adapter's form)",
                    adapters[-1], names.get(trained_in, "a custom"), names.get(prompt, "a custom"))
    if scoring is not None and trained_for and scoring.readout not in (trained_for, "head"):
        log.warning("the adapter %s was trained through the %r read-out and this engine reads out %r (leave "
                    "--readout out to use the adapter's)", adapters[-1], trained_for, scoring.readout)


def export_from_options(out: str, model: str | None = None, *, name: str | None = None, limits: dict | None = None,
                        readout: str | None = None, precision: str = "fp32", adapter: str = "default",
                        head: str | None = None, prompt: str | None = None) -> Path:
    """`onepass export`: ``limits`` (None values: derived from the model), ``readout`` (None: the adapter's), the
    ``adapter`` as the command names it ('default', 'none' or a folder), a trained decision ``head`` (.pt) and the
    ``prompt`` form by name (``prompt.FORMS``; None: the adapter's)."""
    from .adapter import resolve

    head_module = head_info = None
    if head:
        from .head_file import load_head_info

        head_module, head_info = load_head_info(head)
    return export_engine(out, model, name=name, limits=limits, scoring=mf.Scoring(readout) if readout else None,
                         head=head_module, head_info=head_info, precision=precision, adapters=resolve(adapter, model),
                         prompt=FORMS[prompt] if prompt else None)
