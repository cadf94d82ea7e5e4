"""TensorRT plans recorded in an engine directory: built by the backends' ``tensorrt_build`` (one plan per compute
capability), hashed into the engine's manifest like its other files, and built on first start on a GPU where the
engine has none that loads there. The manifest is the core's, so this lives here (core -> backends, never back)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..backends import tensorrt_build
from ..backends.errors import EngineFileError, OnepassError
from . import manifest as mf
from .paths import cache_root


def build_plans(root: Path, archs, *, precision: str | None = None, flavour: str | None = None,
                device: str | None = None, tf32: bool = False, log=print) -> list[dict]:
    """Build one plan per compute capability in ``archs`` (``"native"``: this machine's GPU, recorded under its real
    compute capability) into the engine directory ``root`` and record them in its manifest (replacing an earlier
    plan of the same compute capability). ``precision`` must be the graph's (default: it is); ``device`` names a
    ``devices.DEVICES`` profile whose workspace budget limits the builder; ``tf32`` lets fp32 plans use TF32."""
    root = Path(root)
    manifest = mf.load(root)
    if precision is not None and precision != manifest.precision:
        raise OnepassError(f"this engine's graph is {manifest.precision}; plans are built at the graph's precision "
                           f"(strongly typed networks), so --precision {precision} needs a graph exported at it "
                           f"(onepass export --precision {precision})")
    native = None
    if "native" in archs:  # build on this device, for this device; record its real compute capability
        from ..backends import cuda_device

        native = cuda_device.CudaDevice().compute_capability
    workspace = None
    if device:
        from ..backends.devices import DEVICES

        workspace = DEVICES[device].workspace_mib << 20
    trt = tensorrt_build.import_tensorrt(flavour)
    plans, files, records = list(manifest.plans), dict(manifest.files), []
    for asked in archs:
        arch = native if asked == "native" else asked
        out = root / f"decoder.{arch}.plan"
        timing = cache_root() / "tensorrt" / f"{trt.__name__}-{trt.__version__}-{arch}.timing"
        record = tensorrt_build.build_plan(root, manifest, out, compute_capability=None if asked == "native" else arch,
                                           flavour=trt.__name__, timing_cache=timing, workspace_bytes=workspace,
                                           tf32=tf32, log=log)
        record["compute_capability"] = arch
        plans = [p for p in plans if p["compute_capability"] != arch]  # one plan file per compute capability
        plans.append(record)
        files[out.name] = record["sha256"]
        records.append(record)
    mf.write(root, dataclasses.replace(manifest, plans=plans, files=files))
    return records


def build_native_plan_if_missing(root: Path, log=print) -> dict | None:
    """First start on a GPU: build this device's TensorRT plan unless the engine already has one that loads here.
    Returns the new plan's record, or None when the engine already had one. Without TensorRT or a CUDA device, a
    clear ``BackendUnavailable`` and nothing built."""
    from ..backends import cuda_device
    from ..backends.tensorrt import select_plan, tensorrt_version

    root = Path(root)
    manifest = mf.load(root)
    trt, device = tensorrt_build.import_tensorrt(), cuda_device.CudaDevice()  # neither there: a clear error
    try:
        select_plan(manifest, tensorrt_version(trt), device.compute_capability)
        return None
    except EngineFileError:
        return build_plans(root, ["native"], flavour=trt.__name__, log=log)[0]
