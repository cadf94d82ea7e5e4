"""The engine directory's manifest: the contract between compile time and serve time.

The runtime reads only ``manifest.json``; it never parses file names or guesses.
Every file of the engine is listed with its sha256 and verified on load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..backends.model import PRECISIONS, ModelInfo
from .readout_calibration import Calibration
from .errors import EngineFileError
from .prompt import PromptTemplate

# 2 adds `calibration` and `plans`; 3 adds `head` (decision head); 4 adds `tuning`; 5 adds `gate` (a distilled
# engine's thresholds); 6 adds `guarantees` (a reduced-precision backend measured against fp32). Older ones read
# without them
SCHEMA_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
TUNING_METHODS = ("lora", "full")
MANIFEST = "manifest.json"
READOUTS = ("sum", "mean", "prior", "head")


QUESTION_BUDGET = 1024  # positions an engine keeps for the questions after the longest state


@dataclass(frozen=True)
class Limits:
    """Request limits the engine enforces. Nothing is ever truncated: over a limit is an error."""

    max_state_tokens: int = 4096
    max_packed_tokens: int = 4096  # one pass (plan profiles, graph buckets); a question must fit in one
    max_questions: int = 5000
    max_options: int = 1000
    prefill_chunk: int = 512
    max_request_tokens: int = 262144  # over all the passes of one request (blocks of whole questions)

    def __post_init__(self):
        for f in fields(self):
            if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) <= 0:
                raise ValueError(f"limits.{f.name} must be a positive integer")

    @classmethod
    def for_model(cls, max_position: int, **given) -> "Limits":
        """The limits of an engine of a model with ``max_position`` positions: states up to the context window
        minus QUESTION_BUDGET positions for the questions; ``given`` (None values ignored) override them."""
        derived = {"max_state_tokens": max(1, max_position - QUESTION_BUDGET)}
        return cls(**{**derived, **{k: v for k, v in given.items() if v is not None}})


@dataclass(frozen=True)
class Scoring:
    """How option log-likelihoods become probabilities.

    ``sum``: the option's summed token log-likelihood; ``mean``: divided by its
    token count; ``prior``: minus the same sum given a content-free state; ``head``:
    ``beta * mean`` plus the graph's decision-head score (engines with a head only).
    """

    readout: str = "mean"  # chosen by measurement: benchmarks/results/readout_eval.md

    def __post_init__(self):
        if self.readout not in READOUTS:
            raise ValueError(f"scoring.readout must be one of {READOUTS}, got {self.readout!r}")


@dataclass(frozen=True)
class HeadInfo:
    """A decision head exported into the graph (output ``head_score``) and how it was trained."""

    beta: float  # weight of the zero-shot mean read-out in the option score
    width: int
    training: dict = field(default_factory=dict)  # data, tasks, recipe, measured metrics
    # the head reads the residual stream after this many of the model's blocks, and the graph holds only those (the
    # pass and the prefill stop there: the model's ``num_layers`` is this depth); None: after every block
    depth: int | None = None

    def __post_init__(self):
        if not isinstance(self.beta, (int, float)) or self.beta != self.beta:
            raise ValueError("head.beta must be a number")
        if self.depth is not None and (not isinstance(self.depth, int) or self.depth < 1):
            raise ValueError(f"head.depth must be a positive block count or null, got {self.depth!r}")


@dataclass(frozen=True)
class TuningInfo:
    """How the engine's decoder weights were tuned (`onepass tune`, or the default adapter's training)."""

    method: str  # lora | full
    base: str  # the base model (name and sha256)
    adapters: list = field(default_factory=list)  # merged LoRA adapters: path, sha256 of the weights
    data: list = field(default_factory=list)  # training files: path, sha256, rows
    rows: int = 0  # rows trained on (held-out rows excluded)
    holdout_rows: int = 0
    validation: list = field(default_factory=list)  # --validation files held out instead of a split (path, sha256)
    steps: int = 0  # optimiser steps
    rank: int | None = None  # LoRA rank
    config: dict = field(default_factory=dict)  # every hyper-parameter of the run
    metrics: dict = field(default_factory=dict)  # held-out accuracy / NLL before and after

    def __post_init__(self):
        if self.method not in TUNING_METHODS:
            raise ValueError(f"tuning.method {self.method!r} is not one of {TUNING_METHODS}")


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs to know about an engine directory."""

    name: str
    model: ModelInfo
    tokenizer: str
    graph: str
    golden: str
    files: dict
    dtype: str = "float32"
    limits: Limits = field(default_factory=Limits)
    prompt: PromptTemplate = field(default_factory=PromptTemplate)
    scoring: Scoring = field(default_factory=Scoring)
    source: dict = field(default_factory=dict)
    calibration: Calibration | None = None
    plans: list = field(default_factory=list)  # TensorRT plans: file, sha256, tensorrt version, compute capability
    quantization: dict | None = None  # INT8 scheme and its measured agreement, error and speed-up
    head: HeadInfo | None = None
    tuning: TuningInfo | None = None
    precision: str = "fp32"  # of the block GEMMs; "fp16": fp16 weights and GEMMs, everything else float32
    # `onepass distill`: per question key, the confidence at which the engine agrees with its teacher at the target
    # ({"per_key", "default", "target_agreement", "teacher", "measured"}); `onepass serve --teacher` forwards below it
    gate: dict | None = None
    # `onepass guarantee`: per reduced-precision backend (openvino-cpu-bf16), its answers measured against fp32 on the
    # user's data sets ({"reference", "cpu", "measured", "datasets": {name: {"questions", "argmax_agreement",
    # "max_abs_dp", ...}}}); the default backend uses it only where core.guarantee's bounds hold on this CPU's kind
    guarantees: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.schema_version not in READABLE_VERSIONS:
            raise ValueError(f"schema_version {self.schema_version} is not supported (this onepass reads "
                             f"{READABLE_VERSIONS})")
        if self.dtype != "float32":
            raise ValueError(f"dtype {self.dtype!r} is not supported by this runtime (float32)")
        for role in ("tokenizer", "graph", "golden"):
            if getattr(self, role) not in self.files:
                raise ValueError(f"{role} file {getattr(self, role)!r} is not listed in files")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.scoring.readout == "head" and self.head is None:
            raise ValueError("scoring.readout is 'head' but the engine has no decision head")
        if self.head is not None and self.head.depth not in (None, self.model.num_layers):
            raise ValueError(f"head.depth {self.head.depth} is not the graph's block count ({self.model.num_layers})")
        if not isinstance(self.guarantees, dict) or not all(isinstance(g, dict) for g in self.guarantees.values()):
            raise ValueError("guarantees must be an object of backend name -> measured guarantee")
        if self.gate is not None:
            from .cascade import Gate  # the gate's own checks: thresholds within 0..1

            Gate.from_manifest(self.gate)

    def to_json(self) -> str:
        """The manifest as stable, indented JSON (always written as the current schema version)."""
        data = asdict(self)
        data["calibration"] = self.calibration.to_dict() if self.calibration else None
        data["schema_version"] = SCHEMA_VERSION
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        """Build and validate from parsed JSON."""
        data = dict(data)
        data["model"] = ModelInfo(**data["model"])
        data["limits"] = Limits(**data.get("limits", {}))
        data["prompt"] = PromptTemplate(**data.get("prompt", {}))
        data["scoring"] = Scoring(**data.get("scoring", {}))
        data["calibration"] = Calibration.from_dict(data["calibration"]) if data.get("calibration") else None
        data["head"] = HeadInfo(**data["head"]) if data.get("head") else None
        data["tuning"] = TuningInfo(**data["tuning"]) if data.get("tuning") else None
        return cls(**data)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load(directory: str | os.PathLike, verify: bool = True) -> Manifest:
    """Read ``manifest.json`` of an engine directory; with ``verify``, check every file's sha256."""
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file():
        raise EngineFileError(f"{path} not found: {root} is not an engine directory; build one with `onepass export`")
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError, KeyError) as err:
        raise EngineFileError(f"{path} is invalid: {err}; re-export the engine with `onepass export`") from None
    if verify:
        verify_files(root, manifest)
    return manifest


def verify_files(root: Path, manifest: Manifest) -> None:
    """Raise EngineFileError naming the first missing or altered file."""
    for name, expected in sorted(manifest.files.items()):
        path = root / name
        if not path.is_file():
            raise EngineFileError(f"engine file {path} is missing; re-export the engine with `onepass export`")
        if sha256_file(path) != expected:
            raise EngineFileError(
                f"engine file {path} does not match its sha256 in the manifest (altered or corrupt); "
                "re-export the engine with `onepass export`"
            )


@contextlib.contextmanager
def staged(out: str | os.PathLike):
    """A directory to write an engine into that appears at ``out`` whole or not at all: ``out.partial`` is yielded,
    removed if the block raises, and renamed over ``out`` when it returns."""
    import shutil

    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def copy_engine(src: str | os.PathLike, dst: str | os.PathLike, link_above: int = 10 << 20) -> Path:
    """A copy of an engine directory whose files can be changed without touching ``src``.

    Files larger than ``link_above`` bytes (the weights) are hard links where the file system
    allows (ONNX Runtime refuses external data symlinked from elsewhere); every other file,
    the manifest included, is copied. A linked file is shared, so nothing writes an engine's files in place: the
    manifest and TensorRT plans are written beside and renamed over (a rename breaks the link, never the source).
    """
    import shutil

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.stat().st_size > link_above:
            link_or_copy(f, dst / f.name)
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def graph_files(manifest: "Manifest") -> list[tuple[str, str]]:
    """(name, sha256) of the graph and the weights files beside it: ``GRAPH.data``, and another graph's weights file
    hard-linked beside it (a task's slot graph reads the engine's own): what the graph computes from."""
    folder = Path(manifest.graph).parent
    return sorted((name, sha) for name, sha in manifest.files.items()
                  if name.startswith(manifest.graph) or (Path(name).parent == folder and name.endswith(".data")))


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``dst`` a hard link to ``src`` (its target, where ``src`` is a symlink), or a copy where the file system
    refuses links: the same bytes either way."""
    import shutil

    try:
        os.link(Path(src).resolve(), dst)
    except OSError:
        shutil.copy(src, dst)


def write(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Write the manifest atomically (temp file + rename)."""
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(manifest.to_json() + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()  # nothing half-written left behind
        raise EngineFileError(f"cannot write {path}: {err.strerror or err}") from None
    return path
