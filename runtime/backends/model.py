"""What a backend is built for: the decoder's dimensions (``ModelInfo``), the precisions an engine's graph may
have, and the part of an engine's description a backend reads (``EngineDescription``).

The engine's manifest (``core.manifest.Manifest``) is written and verified by the core; the backends take it as an
``EngineDescription`` and never import the core (the dependency runs one way, core -> backends).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

PRECISIONS = ("fp32", "fp16", "bf16")  # what an engine's block GEMMs may be


@dataclass(frozen=True)
class ModelInfo:
    """Dimensions of the compiled decoder."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int

    def __post_init__(self):
        for f in fields(ModelInfo):  # a subclass (the PyTorch decoder's DecoderDims) adds floats and flags
            if f.name != "architecture" and (not isinstance(getattr(self, f.name), int) or getattr(self, f.name) <= 0):
                raise ValueError(f"model.{f.name} must be a positive integer")

    def kv_bytes_per_token(self) -> int:
        """Bytes of float32 K/V one state token occupies over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


class EngineLimits(Protocol):
    """The limits a backend sizes its buffers and graphs by."""

    max_state_tokens: int
    max_packed_tokens: int


class EngineDescription(Protocol):
    """What a backend reads of an engine's manifest: the graph file and its dimensions, precision and limits, the
    files' sha256s, the golden file, TensorRT plans and the export's source record (dims, weight map)."""

    model: ModelInfo
    graph: str
    golden: str
    precision: str
    quantization: Any
    limits: EngineLimits
    files: dict
    plans: list
    source: dict
