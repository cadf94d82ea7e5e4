"""Build TensorRT plans from an engine directory's ONNX graph (ahead of time; no GPU needed for RTX).

A thin adapter serves both TensorRT flavours: standard ``tensorrt`` 10.x (data-centre GPUs,
JetPack) and ``tensorrt_rtx`` (TensorRT for RTX, installable from PyPI, which compiles for
chosen compute capabilities without a GPU). Networks are strongly typed: precision comes from
the ONNX tensor types (fp32 graphs build fp32 plans). Two optimisation profiles span the
engine's limits (packed length 1..max_packed_tokens, state length 0..max_state_tokens), each
tuned for one role of the graph: ``prefill`` (index 0: a prefill chunk over a short past) and
``score`` (index 1: a packed question tree over a long state). With standard TensorRT a
timing cache file, when given, is read before the build and written after it, so later builds
on that device skip kernel timing (TensorRT for RTX times nothing ahead of time: its timing
cache calls are no-ops, so none is kept).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import contract
from .errors import BackendUnavailable, EngineFileError
from .model import EngineDescription

FLAVOURS = ("tensorrt", "tensorrt_rtx")


def import_tensorrt(flavour: str | None = None):
    """The TensorRT module: ``flavour`` if given, else standard TensorRT, else TensorRT for RTX."""
    names = [flavour] if flavour else list(FLAVOURS)
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise BackendUnavailable("TensorRT is not installed: use the TensorRT of JetPack/NGC (`tensorrt`), or "
                             "`pip install tensorrt-rtx-cu13==1.7.1.116` to build plans for RTX/Ampere GPUs")


@dataclass(frozen=True)
class Profile:
    """min/opt/max of the three dynamic axes."""

    packed: tuple
    past: tuple
    readout: tuple

    @classmethod
    def from_manifest(cls, manifest: EngineDescription, opt_packed: int = 512, opt_past: int = 512,
                      opt_readout: int = 128) -> "Profile":
        """Span the engine's limits; optimise for typical lengths."""
        lim = manifest.limits
        n_max, s_max = lim.max_packed_tokens, lim.max_state_tokens
        return cls((1, min(opt_packed, n_max), n_max), (0, min(opt_past, s_max), s_max),
                   (1, min(opt_readout, n_max), n_max))

    def as_dict(self) -> dict:
        return {"packed": self.packed, "past": self.past, "readout": self.readout}

    def shapes(self, spec: contract.TensorSpec) -> tuple:
        """(min, opt, max) shapes of one input."""
        axis = {contract.PACKED: self.packed, contract.PAST: self.past, contract.READOUT: self.readout}
        return tuple(tuple(d if isinstance(d, int) else axis[d][i] for d in spec.shape) for i in range(3))


def network_has(network, name: str) -> bool:
    """Whether the parsed network has an input called ``name``."""
    return any(network.get_input(i).name == name for i in range(network.num_inputs))


def role_profiles(manifest: EngineDescription) -> dict[str, Profile]:
    """The plan's profiles in index order: prefill chunks (short past, no read-out to speak of) and
    score passes (a packed tree of ~128 tokens over a ~512-token state)."""
    lim = manifest.limits
    chunk = min(lim.prefill_chunk, lim.max_packed_tokens)
    return {"prefill": Profile.from_manifest(manifest, opt_packed=chunk, opt_past=0, opt_readout=1),
            "score": Profile.from_manifest(manifest, opt_packed=128, opt_past=512, opt_readout=64)}


def _replace(out: Path, data: bytes) -> None:
    """``data`` as ``out``, through a new file renamed over it: never written through a hard link an engine copy
    shares with its source (manifest.copy_engine), never left half-written."""
    fd, part = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(part, out)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise


def build_plan(root: Path, manifest: EngineDescription, out: Path, *, compute_capability: str | None = None,
               flavour: str | None = None, profiles: dict[str, Profile] | None = None,
               timing_cache: Path | None = None, workspace_bytes: int | None = None, tf32: bool = False,
               log=print) -> dict:
    """Parse ``root/manifest.graph`` and write a serialized plan to ``out``; returns what to record. ``tf32``: an fp32
    plan may round its GEMM inputs to TF32 (10 significant bits, tensor cores: ~7x the CUDA cores' fp32 on an H200);
    off by default, so that an fp32 plan reproduces the fp32 golden file."""
    trt = import_tensorrt(flavour)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None or trt.__name__ == "tensorrt_rtx"
                                     else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    graph = root / manifest.graph
    if not parser.parse_from_file(str(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineFileError(f"TensorRT could not parse {graph}: {errors}")
    config = _builder_config(trt, builder, manifest, compute_capability, workspace_bytes, tf32)
    profiles = profiles or role_profiles(manifest)
    m = manifest.model
    for profile in profiles.values():
        opt = builder.create_optimization_profile()
        for spec in contract.input_specs(m.num_layers, m.num_kv_heads, m.head_dim):
            if any(isinstance(d, str) for d in spec.shape) and network_has(network, spec.name):
                opt.set_shape(spec.name, *profile.shapes(spec))  # static inputs (past_length) take no range
        config.add_optimization_profile(opt)
    cache = None
    if timing_cache is not None and trt.__name__ == "tensorrt":
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
        config.set_timing_cache(cache, False)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        if workspace_bytes is not None:
            raise EngineFileError(f"TensorRT could not build a plan from {graph} within a {workspace_bytes >> 20} MiB "
                                  "workspace (see the log above): this engine's limits need more on that device; "
                                  "export one with smaller --max-packed-tokens / --max-state-tokens for it")
        raise EngineFileError(f"TensorRT failed to build a plan from {graph} (see the log above)")
    data = bytes(plan)
    _replace(out, data)
    seconds = time.perf_counter() - t0
    if cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = timing_cache.with_name(timing_cache.name + ".tmp")
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
        os.replace(tmp, timing_cache)
    log(f"built {out.name}: {len(data) / 2**20:.1f} MiB in {seconds:.0f} s")
    return {"file": out.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "tensorrt": f"{trt.__name__} {trt.__version__}", "compute_capability": compute_capability or "current",
            "precision": manifest.precision, "profiles": {name: p.as_dict() for name, p in profiles.items()},
            "timing_cache": str(timing_cache) if cache is not None else None,
            "tf32": bool(config.get_flag(trt.BuilderFlag.TF32)) if hasattr(trt.BuilderFlag, "TF32") else None,
            "workspace_bytes": int(config.get_memory_pool_limit(trt.MemoryPoolType.WORKSPACE)),
            "user_allocation": (bool(config.get_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION))
                                if hasattr(trt.BuilderFlag, "REQUIRE_USER_ALLOCATION") else None),
            "build_seconds": round(seconds, 1)}


def _builder_config(trt, builder, manifest: EngineDescription, compute_capability: str | None,
                    workspace_bytes: int | None, tf32: bool):
    """The builder's settings: the target architecture, the workspace budget, TF32 for an fp32 plan, and memory
    the backend allocates itself."""
    config = builder.create_builder_config()
    if compute_capability:
        if not hasattr(config, "set_compute_capability"):
            raise BackendUnavailable(f"{trt.__name__} cannot target {compute_capability} ahead of time; "
                                     "build on the device or use tensorrt_rtx")
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, compute_capability.upper()), 0)
    if workspace_bytes is not None:  # a device's budget (devices.DEVICES): tactics needing more are not chosen
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if manifest.precision == "fp32" and hasattr(trt.BuilderFlag, "TF32"):
        if tf32:  # (TF32 is on by default in TensorRT)
            config.set_flag(trt.BuilderFlag.TF32)
        else:
            config.clear_flag(trt.BuilderFlag.TF32)
    if hasattr(trt.BuilderFlag, "REQUIRE_USER_ALLOCATION"):  # TensorRT for RTX >= 1.2: the plan runs in the
        config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)  # memory the backend gives it, as stream capture needs
    return config
