"""Kernel launches of the GPU pass, counted without a GPU: one 13-question pass and one 512-token prefill chunk.

    python benchmarks/gpu_kernels.py --engine engines/smollm2 --json benchmarks/results/gpu/kernels.json

The torch backend runs on torch's ``meta`` device at the engine's real dimensions (shapes propagate, nothing is
computed), with the operations the fused pass picks on CUDA (``fused_decoder.Kernels``), under a dispatch-mode counter
of every ATen call that writes memory (``runtime/backends/launches.py``: views and bare allocations launch nothing).
Counted per precision (fp16, bf16) for the fused pass, and for the reference decoder (the export's: the "before").
Each pass is counted warm: the state already in the workspace (a new state adds one copy, counted apart).

Padding: padded / unpadded packed tokens (and read-outs) of 1, 13 and 64 questions on a ~512-token state, and the
worst state padding over every state length from 100 to 2,048 tokens (``batch.bucket``).

JSON keys: ``launches_per_layer`` (the fp16 13-question pass's launches / layers, its per-pass launches included),
``prefill_launches_per_layer`` (one 512-token chunk, fp16), ``padding`` (the worst padded/unpadded token ratio over
the cases), then ``padding_cases`` and ``counts`` (by pass and precision, with launches by operation). A Markdown table beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, many_questions, state_of_tokens  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends import factory  # noqa: E402
from onepass.runtime.backends.launches import count  # noqa: E402
from onepass.runtime.backends.batch import bucket  # noqa: E402

TARGET_PER_LAYER = 14
TARGET_PADDING = 1.25


def counts(engine_dir: str, precision: str, fused: bool) -> dict:
    """Launches of a warm 13-question pass, the same over a new state, and a 512-token prefill chunk."""
    options = dict(precision=precision, fused=fused) | (dict(buckets=True) if fused else {})
    engine = Engine.load(engine_dir, backend=factory("torch-cpu", device="meta", **options), verify=False)
    layers = engine.manifest.model.num_layers
    text = state_of_tokens(engine, 512)
    state = engine.state(text)
    batch = engine.pack(state, engine.encode_questions(QUESTIONS))
    engine.backend.score_all(state.kv, batch)  # first use: the workspace is allocated
    warm = count(lambda: engine.backend.score_all(state.kv, batch))
    other = engine.state("Another ticket: " + text)
    if fused:
        engine.backend.slots.forget()  # the workspace no longer holds the state: a copy in
    new = count(lambda: engine.backend.score_all(other.kv, batch))
    ids = engine.encoder.state(text)[:512]
    engine.backend.prefill(ids, 512)
    prefill = count(lambda: engine.backend.prefill(ids, 512))
    return {"layers": layers, "pass": warm.total, "pass_per_layer": warm.total / layers,
            "pass_ops": dict(warm.ops), "pass_new_state": new.total,
            "prefill_512": prefill.total, "prefill_per_layer": prefill.total / layers,
            "prefill_ops": dict(prefill.ops), "packed_tokens": batch.num_tokens,
            "state_tokens": state.num_tokens}


def padding(engine_dir: str) -> dict:
    """Padded / unpadded tokens of 1, 13 and 64 questions on a ~512-token state, and of states of 100-2,048 tokens."""
    engine = Engine.load(engine_dir, backend="onnxruntime", verify=False)
    state = engine.state(state_of_tokens(engine, 512))
    cases = {}
    for k in (1, 13, 64):
        batch = engine.pack(state, engine.encode_questions(QUESTIONS if k == 13 else many_questions(k)))
        n, r = batch.num_tokens, batch.readout_index.shape[0]
        cases[f"{k} questions"] = {"tokens": n, "padded": bucket(n), "ratio": bucket(n) / n,
                                   "readouts": r, "padded_readouts": bucket(r), "readout_ratio": bucket(r) / r}
    worst = max(range(100, 2049), key=lambda n: bucket(n) / n)
    cases["states 100-2048"] = {"worst_length": worst, "padded": bucket(worst), "ratio": bucket(worst) / worst,
                                "state_512": {"tokens": state.num_tokens, "padded": bucket(state.num_tokens)}}
    return {"cases": cases, "worst": max(c["ratio"] for c in cases.values())}


def markdown(report: dict) -> str:
    lines = ["# Kernel launches of the GPU pass, counted on the meta device", "",
             f"Produced by `python benchmarks/gpu_kernels.py` ({report['engine']}). Targets: <= {TARGET_PER_LAYER} "
             f"launches per layer for the fp16 13-question pass and per prefill chunk; padding <= {TARGET_PADDING}x.",
             "", "| pass | precision | 13 questions: launches | per layer | over a new state | prefill 512: launches "
             "| per layer |", "|---|---|---|---|---|---|---|"]
    for name, c in report["counts"].items():
        kind, precision = name.rsplit(" ", 1)
        lines.append(f"| {kind} | {precision} | {c['pass']} | {c['pass_per_layer']:.2f} | {c['pass_new_state']} | "
                     f"{c['prefill_512']} | {c['prefill_per_layer']:.2f} |")
    lines += ["", "Launches of the fused fp16 pass by operation: " + ", ".join(
        f"{k} {v}" for k, v in report["counts"]["fused fp16"]["pass_ops"].items()), "",
              "| padding case | tokens | padded | ratio | read-outs | padded | ratio |", "|---|---|---|---|---|---|---|"]
    for name, c in report["padding_cases"].items():
        if "readouts" in c:
            lines.append(f"| {name} | {c['tokens']} | {c['padded']} | {c['ratio']:.3f} | {c['readouts']} | "
                         f"{c['padded_readouts']} | {c['readout_ratio']:.2f} |")
        else:
            lines.append(f"| {name} (worst: {c['worst_length']}) | {c['worst_length']} | {c['padded']} | "
                         f"{c['ratio']:.3f} | | | |")
    lines += ["", f"launches_per_layer {report['launches_per_layer']:.2f}, prefill_launches_per_layer "
              f"{report['prefill_launches_per_layer']:.2f}, padding {report['padding']:.3f}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--json", default="benchmarks/results/gpu/kernels.json")
    args = ap.parse_args(argv)
    report = {"engine": args.engine, "counts": {}}
    for fused in (True, False):
        for precision in ("fp16", "bf16"):
            name = f"{'fused' if fused else 'reference'} {precision}"
            report["counts"][name] = counts(args.engine, precision, fused)
            print(name, {k: v for k, v in report["counts"][name].items() if not k.endswith("ops")}, flush=True)
    pad = padding(args.engine)
    fp16 = report["counts"]["fused fp16"]
    report = {"launches_per_layer": fp16["pass_per_layer"], "prefill_launches_per_layer": fp16["prefill_per_layer"],
              "padding": pad["worst"], "padding_cases": pad["cases"], **report}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
