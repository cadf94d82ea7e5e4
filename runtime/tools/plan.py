"""`onepass plan`: memory budget and latency floor of an engine on a target device, assumptions stated.

Everything is arithmetic on the manifest and the weight file: no device is needed. The floor
is the larger of (bytes read) / (memory bandwidth) and (FLOPs) / (peak dense tensor FLOPs);
real latency sits above it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..backends.devices import DEVICES
from ..core import manifest as mf


BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}


def _gib(n: float) -> float:
    return n / 2**30


def plan(engine_dir: str | Path, device: str, precision: str = "fp16", state_tokens: int = 512,
         packed_tokens: int = 512) -> dict:
    """The budget and floor for one device, precision and workload (state and packed lengths)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; known: {', '.join(DEVICES)}")
    if precision not in BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(BYTES)}")
    root = Path(engine_dir)
    m = mf.load(root, verify=False)
    dev, model, limits = DEVICES[device], m.model, m.limits
    weight_file = root / m.graph.replace(".onnx", ".onnx.data")
    params = (weight_file.stat().st_size if weight_file.exists() else 0) / 4  # the exported graph is fp32
    embed = model.vocab_size * model.hidden_size
    b = BYTES[precision]
    act_b = 2 if precision in ("int8", "fp8") else b  # activations and K/V stay 16-bit under INT8/FP8 weights
    weights = params * b
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * act_b
    n, s = limits.max_packed_tokens, limits.max_state_tokens
    activations = (model.num_heads * n * (s + n) * 4  # attention scores of one layer, fp32 softmax
                   + 4 * n * max(model.hidden_size * 4, model.head_dim * model.num_heads * 3) * act_b)
    budget = dev.memory_gib * 2**30 * dev.usable_fraction
    workspace = dev.workspace_mib * 2**20  # the plan build's limit (onepass build-trt --device)
    free = budget - weights - activations - workspace
    cache_tokens = max(0, int(free // kv_per_token))

    def floor_ms(tokens: int, context: int) -> dict:
        flops = 2 * (params - embed) * tokens + 4 * model.num_layers * model.num_heads * model.head_dim * tokens * context
        peak = (dev.int8_tops if precision in ("int8", "fp8") else dev.fp16_tflops) * 1e12
        if precision == "fp32":
            peak = dev.fp32_tflops * 1e12  # the CUDA cores' FP32 (TF32 tensor cores not assumed)
        read = weights - embed * b + kv_per_token * context
        return {"compute_ms": flops / peak * 1e3, "memory_ms": read / (dev.bandwidth_gbs * 1e9) * 1e3,
                "floor_ms": max(flops / peak, read / (dev.bandwidth_gbs * 1e9)) * 1e3}

    return {
        "device": asdict(dev), "precision": precision, "engine": m.name,
        "memory": {"budget_gib": _gib(budget), "weights_gib": _gib(weights), "params": int(params),
                   "kv_bytes_per_state_token": kv_per_token,
                   "activations_gib_at_limits": _gib(activations), "limits": asdict(limits),
                   "tensorrt_workspace_gib": _gib(workspace),
                   "state_cache_tokens": cache_tokens, "state_cache_states": cache_tokens // max(1, state_tokens)},
        "latency_floor": {"prefill": {"tokens": state_tokens, **floor_ms(state_tokens, state_tokens)},
                          "score": {"tokens": packed_tokens, **floor_ms(packed_tokens, state_tokens + packed_tokens)}},
        "assumptions": [
            f"{dev.note}; {dev.usable_fraction:.0%} of memory usable by onepass",
            "weights: the fp32 weight file's size / 4 parameters, stored at the chosen precision "
            "(INT8/FP8: K/V and activations stay 16-bit)",
            "FLOPs: 2 x non-embedding parameters per token + 4 x layers x heads x head_dim x context (attention); "
            "logits only at read-out rows (ignored)",
            f"peak: dense tensor cores at fp16/bf16 ({dev.fp16_tflops:g} TFLOPS) and INT8/FP8 ({dev.int8_tops:g} TOPS); "
            f"fp32 on the CUDA cores ({dev.fp32_tflops:g} TFLOPS: TF32 not assumed)",
            "memory traffic: every non-embedding weight read once per pass plus the state's K/V",
            "activations: one layer's fp32 attention scores at the packed/state limits plus MLP buffers",
            f"TensorRT workspace: {dev.workspace_mib} MiB, the limit `onepass build-trt --device {device}` builds with",
        ],
    }


def render(p: dict) -> str:
    """A human-readable summary of :func:`plan`'s result."""
    mem, lat = p["memory"], p["latency_floor"]
    lines = [f"{p['device']['name']} - engine {p['engine']} at {p['precision']}",
             f"  memory budget      {mem['budget_gib']:.2f} GiB",
             f"  weights            {mem['weights_gib']:.3f} GiB ({mem['params'] / 1e6:.1f}M parameters)",
             f"  K/V per token      {mem['kv_bytes_per_state_token'] / 1024:.1f} KiB",
             f"  activations        {mem['activations_gib_at_limits']:.3f} GiB at the engine's limits",
             f"  TensorRT workspace {mem['tensorrt_workspace_gib']:.3f} GiB (build-trt --device limit)",
             f"  state cache        {mem['state_cache_tokens']:,} tokens = {mem['state_cache_states']:,} states "
             f"of {lat['prefill']['tokens']} tokens"]
    for name in ("prefill", "score"):
        f = lat[name]
        lines.append(f"  floor {name:8s}     {f['floor_ms']:.3f} ms for {f['tokens']} tokens "
                     f"(compute {f['compute_ms']:.3f} ms, memory {f['memory_ms']:.3f} ms)")
    lines += ["  assumptions:"] + [f"   - {a}" for a in p["assumptions"]]
    return "\n".join(lines)
