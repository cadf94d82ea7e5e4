"""Where does 8-bit rounding move SmolLM2's answers? Simulated INT8 schemes, measured before building kernels.

The decoder is rebuilt in PyTorch from the engine (fp32) and 8-bit rounding is simulated
exactly (quantize -> dequantize in float32) on the block GEMMs:

* ``W8``: weights per output channel, symmetric int8; activations untouched.
* ``W8A8-token``: plus each GEMM input per token (row), symmetric int8, as dynamic INT8
  kernels with per-token scales compute.
* ``SmoothQuant a``: W8A8-token after migrating activation outliers into the weights,
  ``s_j = max|X_j|^a / max|W_j|^(1-a)`` per input channel, ``X/s``, ``W*s``; one ``s`` per
  GEMM input (q/k/v share one, gate/up share one), so it folds exactly into the preceding
  RMSNorm weight, the V projection and the up projection. Channel maxima come from five
  calibration texts that are not in the evaluation.
* ``keep k``: the same with the ``k`` most sensitive blocks (by the W8 per-block scan) in fp32.

Workload: six states x the 13 latency questions (78 questions, 256 options), answers compared
with the fp32 decoder: argmax agreement and max option log-likelihood error. Targets:
agreement >= 99% and error <= 0.1. Writes benchmarks/studies/results/int8_sensitivity.{json,md}.

    python benchmarks/studies/int8_sensitivity.py --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from int8_explore import TEXTS  # noqa: E402
from latency import QUESTIONS, state_of_tokens  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends import factory  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CALIBRATION = ["Hello, I would like to change the address on my account, I moved last month.",
               "Your last update broke the export button; nothing happens when I click it.",
               "Please cancel my subscription at the end of this billing period.",
               "Thanks for the quick fix yesterday, the dashboard loads fine now.",
               "Why was my card declined? It works everywhere else and I have funds."]
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def fake_quant(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Symmetric int8 quantize -> dequantize with one scale per slice along ``dim`` (max |x| -> 127)."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 127.0
    return (x / scale).round().clamp(-127, 127) * scale


class Scheme:
    """Installs simulated rounding on the block GEMMs of a decoder; ``remove`` restores it exactly."""

    def __init__(self, decoder, weights: bool, acts: bool, smooth: dict | None, keep: set):
        self.decoder, self.hooks, self.saved = decoder, [], {}
        for i, block in enumerate(decoder.blocks):
            if i in keep:
                continue
            for group in GROUPS:
                s = smooth.get((i, group)) if smooth else None
                for name in group:
                    lin = getattr(block, name)
                    self.saved[(i, name)] = lin.weight.detach().clone()
                    w = lin.weight.data * s if s is not None else lin.weight.data
                    lin.weight.data = fake_quant(w, 1) if weights else w
                    if acts or s is not None:
                        self.hooks.append(lin.register_forward_pre_hook(self._hook(s, acts)))

    @staticmethod
    def _hook(s, acts):
        def pre(_module, args):
            x = args[0] / s if s is not None else args[0]
            return (fake_quant(x, -1) if acts else x,)
        return pre

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        for (i, name), w in self.saved.items():
            getattr(self.decoder.blocks[i], name).weight.data = w


def channel_maxima(engine: Engine) -> dict:
    """Per block and GEMM-input group: max |input| per channel over the calibration texts."""
    maxima, hooks = {}, []
    for i, block in enumerate(engine.backend.decoder.blocks):
        for group in GROUPS:
            def rec(_m, args, key=(i, group)):
                m = args[0].detach().abs().amax(dim=0)
                maxima[key] = torch.maximum(maxima[key], m) if key in maxima else m
            hooks.append(getattr(block, group[0]).register_forward_pre_hook(rec))
    for text in CALIBRATION:
        engine.cache.clear()
        engine.option_logprobs(text, engine.encode_questions(QUESTIONS))
    for h in hooks:
        h.remove()
    return maxima


def smoothing(engine: Engine, maxima: dict, alpha: float) -> dict:
    out = {}
    for (i, group), xmax in maxima.items():
        block = engine.backend.decoder.blocks[i]
        wmax = torch.stack([getattr(block, n).weight.abs().amax(dim=0) for n in group]).amax(dim=0)
        out[(i, group)] = (xmax.clamp_min(1e-5) ** alpha / wmax.clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
    return out


def answers(engine: Engine, texts) -> list:
    engine.cache.clear()
    return [lp for t in texts for lp in engine.option_logprobs(t, engine.encode_questions(QUESTIONS))]


def compare(got, ref) -> dict:
    agree = np.mean([int(np.argmax(a) == np.argmax(b)) for a, b in zip(got, ref)])
    err = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    return {"agreement": float(agree), "max_error": err,
            "median_error": float(np.median(np.concatenate([np.abs(a - b) for a, b in zip(got, ref)])))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    engine = Engine.load(args.engine, backend=factory("torch-cpu"), verify=False)
    dec = engine.backend.decoder
    texts = TEXTS + [state_of_tokens(engine, 512)]
    ref = answers(engine, texts)
    res = {"questions": len(ref), "schemes": {}, "per_block_w8": {}}

    def run(name, **kw):
        scheme = Scheme(dec, **kw)
        try:
            r = compare(answers(engine, texts), ref)
        finally:
            scheme.remove()
        print(f"[{time.perf_counter() - t0:5.0f}s] {name}: {r}", flush=True)
        return r

    res["schemes"]["W8 (all blocks)"] = run("W8", weights=True, acts=False, smooth=None, keep=set())
    for i in range(len(dec.blocks)):  # one block rounded at a time: its share of the error
        res["per_block_w8"][i] = run(f"W8 block {i} only", weights=True, acts=False, smooth=None,
                                     keep=set(range(len(dec.blocks))) - {i})
    assert compare(answers(engine, texts), ref)["max_error"] == 0.0  # every scheme was removed exactly
    order = sorted(res["per_block_w8"], key=lambda i: -res["per_block_w8"][i]["max_error"])
    res["sensitive_blocks"] = order[:6]
    res["schemes"]["W8A8-token"] = run("W8A8-token", weights=True, acts=True, smooth=None, keep=set())
    maxima = channel_maxima(engine)
    for alpha in (0.5, 0.8):
        sm = smoothing(engine, maxima, alpha)
        res["schemes"][f"SmoothQuant {alpha} W8A8-token"] = run(f"SQ {alpha}", weights=True, acts=True, smooth=sm,
                                                                keep=set())
    best_alpha = min((0.5, 0.8), key=lambda a: res["schemes"][f"SmoothQuant {a} W8A8-token"]["max_error"])
    sm = smoothing(engine, maxima, best_alpha)
    for k in (2, 6):
        keep = set(order[:k])
        res["schemes"][f"W8, keep {k} blocks fp32"] = run(f"W8 keep {k}", weights=True, acts=False, smooth=None,
                                                          keep=keep)
        res["schemes"][f"SmoothQuant {best_alpha} W8A8-token, keep {k} blocks fp32"] = run(
            f"SQ keep {k}", weights=True, acts=True, smooth=sm, keep=keep)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_sensitivity.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# INT8 sensitivity (simulated rounding, PyTorch fp32 decoder from the engine)", "",
             "Produced by `python benchmarks/studies/int8_sensitivity.py`. Exact quantize-dequantize simulation of "
             "symmetric int8 on the block GEMMs (see the script's docstring); "
             f"{res['questions']} questions (six states x 13), compared with the fp32 decoder. "
             "Targets: agreement >= 0.99, max option log-likelihood error <= 0.1.", "",
             "| scheme | argmax agreement | max error | median error |", "|---|---|---|---|"]
    for name, r in res["schemes"].items():
        lines.append(f"| {name} | {r['agreement']:.3f} | {r['max_error']:.3f} | {r['median_error']:.4f} |")
    lines += ["", "W8 on one block at a time (every other block fp32):", "",
              "| block | agreement | max error |", "|---|---|---|"]
    for i, r in res["per_block_w8"].items():
        lines.append(f"| {i} | {r['agreement']:.3f} | {r['max_error']:.3f} |")
    lines += ["", f"Most sensitive blocks: {res['sensitive_blocks']}. SmoothQuant alpha for the keep rows: "
              f"{best_alpha}. Time: {res['seconds']:.0f} s.", ""]
    (RESULTS / "int8_sensitivity.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
