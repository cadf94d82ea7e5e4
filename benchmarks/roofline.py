"""How close the 13-question pass runs to what this CPU's GEMMs can do (a roofline: measured against the GEMM peak).

The pass: the 13 questions of ``latency.py`` on a cached 511-token state, packed into one tree and scored in
one dense pass (``backend.score_all``; the block-split request runs the same work in 256/512-token passes).
Its FLOPs are counted from the graph: every block GEMM (2 x in x out per packed token, from the initializers'
shapes), attention (QK^T and PV over the state plus the packed tokens, dense as the graph computes it) and
the read-out (log-softmax over the vocabulary at each read-out position). The ceiling: numpy's matmul
(its BLAS, the same thread count) on the pass's own GEMM shapes, timed as one sequence, and on one square
2048 x 2048 GEMM. Reported: each backend's achieved GFLOP/s and its share of the ceiling, medians after a
warm-up, interleaved rounds. With ``openvino-cpu`` among the backends, also where its pass's time goes: OpenVINO's
own per-operation counters (``PERF_COUNT``) summed by kind, its fused attention (one ``Subgraph`` per block:
QK^T, the masked softmax and PV) apart from the GEMMs (``FullyConnected``); and the share of the attention's
packed x packed entries the tree mask hides, so what computing only the unmasked blocks could save at most.
Writes benchmarks/results/roofline.{json,md}.

    python benchmarks/roofline.py --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

THREADS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # numpy's BLAS: the backends' thread count
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(THREADS))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, cpu_name, state_of_tokens  # noqa: E402

from onepass import Engine  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GEMMS = ("q", "k", "v", "o", "gate", "up", "down")


def gemm_shapes(engine: Engine) -> list[tuple[int, int]]:
    """(in, out) of every block GEMM weight, from the graph's initializers."""
    graph = onnx.load(str(engine.root / engine.manifest.graph), load_external_data=False).graph
    shapes = []
    for init in graph.initializer:
        parts = init.name.split(".")
        if parts[0] == "blocks" and parts[2] in GEMMS and parts[-1] == "weight":
            out_features, in_features = init.dims  # torch Linear layout [out, in]
            shapes.append((int(in_features), int(out_features)))
    return shapes


def pass_flops(engine: Engine, shapes, n: int, past: int, readouts: int) -> dict:
    """FLOPs of one dense pass of ``n`` packed tokens over a ``past``-token state, by part."""
    m = engine.manifest.model
    heads = m.num_heads
    return {"block GEMMs": 2 * n * sum(i * o for i, o in shapes),
            "attention": m.num_layers * 2 * 2 * heads * m.head_dim * n * (past + n),
            "read-out": 2 * readouts * m.hidden_size * m.vocab_size}


def openvino_profile(engine_dir: str, state, batch, rounds: int) -> dict:
    """Milliseconds per pass by OpenVINO operation kind (its own counters, medians over ``rounds`` passes after a
    warm-up), from a second compile of the engine's graph with ``PERF_COUNT`` on: what the timed backend runs."""
    from onepass.runtime.backends.openvino_cpu import OpenVinoCpuBackend

    engine = Engine.load(engine_dir, threads=THREADS, backend="openvino-cpu")
    backend: OpenVinoCpuBackend = engine.backend
    backend.config["PERF_COUNT"] = "YES"
    backend.release_memory()  # compiles again, now with the counters
    backend.score_all(state.kv, batch)
    per_kind: dict = {}
    for _ in range(rounds):
        backend.score_all(state.kv, batch)
        for kind, ms in op_kind_ms(backend._request().profiling_info).items():
            per_kind.setdefault(kind, []).append(ms)
    medians = {kind: statistics.median(v) for kind, v in per_kind.items()}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


def op_kind_ms(profiling_info) -> dict:
    """Milliseconds per OpenVINO operation kind of one pass, from an infer request's ``profiling_info``."""
    sums: dict = {}
    for op in profiling_info:
        sums[op.node_type] = sums.get(op.node_type, 0.0) + op.real_time.total_seconds() * 1e3
    return sums


def masked_share(batch) -> float:
    """The share of the packed x packed attention entries the tree mask hides (a token sees itself and its
    ancestors only)."""
    return 1.0 - float(batch.tree_mask.sum()) / batch.tree_mask.size


def profile_lines(profile: dict, n: int, past: int, hidden: float) -> list[str]:
    """The profile's table and what skipping the masked attention could save at most."""
    total = sum(profile.values())
    attention = profile.get("Subgraph", 0.0)
    packed_part = n / (past + n)  # the packed x packed share of the attention's entries (and of its FLOPs)
    bound = attention * packed_part * hidden
    lines = ["", f"Where OpenVINO's pass goes (its own counters, {total:.0f} ms in all; medians):", "",
             "| operation | ms | share |", "|---|---|---|"]
    lines += [f"| {kind} | {ms:.1f} | {ms / total:.1%} |" for kind, ms in profile.items() if ms / total >= 0.005]
    lines += ["", f"The fused attention (`Subgraph`, one per block) takes {attention / total:.0%} of the pass and "
              f"the GEMMs (`FullyConnected`) {profile.get('FullyConnected', 0.0) / total:.0%}. Of the attention's "
              f"entries, {packed_part:.0%} are packed x packed ({n} x {n} of {n} x {past + n}) and the tree mask "
              f"hides {hidden:.1%} of those: an attention that computed only the unmasked entries (every state "
              f"entry stays) could save at most {bound:.0f} ms, {bound / total:.0%} of the pass "
              f"(attention FLOPs at best {1 - packed_part * hidden:.0%} of today's)."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--backends", nargs="+", default=["onnxruntime", "openvino-cpu"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "roofline"))
    args = ap.parse_args(argv)

    engines = {name: Engine.load(args.engine, threads=THREADS, backend=name) for name in args.backends}
    first = next(iter(engines.values()))
    text = state_of_tokens(first, 512)
    encoded = first.encode_questions(QUESTIONS)
    shapes = gemm_shapes(first)
    runs = {}
    for name, engine in engines.items():
        state = engine.state(text)
        batch = engine.pack(state, encoded)
        runs[name] = (engine, state, batch)
    _, state, batch = runs[args.backends[0]]
    n, readouts, past = batch.num_tokens, batch.readout_index.shape[0], state.num_tokens
    flops = pass_flops(first, shapes, n, past, readouts)
    total = sum(flops.values())

    a = {w: np.random.default_rng(0).standard_normal((n, w), dtype=np.float32) for w in {i for i, _ in shapes}}
    weights = [np.random.default_rng(1).standard_normal((i, o), dtype=np.float32) for i, o in shapes]
    square = np.random.default_rng(2).standard_normal((2048, 2048), dtype=np.float32)

    timings: dict = {name: [] for name in runs}
    timings["numpy: the pass's GEMMs"], timings["numpy: 2048^3 GEMM"] = [], []
    for name, (engine, st, b) in runs.items():  # warm-up
        engine.backend.score_all(st.kv, b)
    for _ in range(args.rounds):
        for name, (engine, st, b) in runs.items():
            t = time.perf_counter()
            engine.backend.score_all(st.kv, b)
            timings[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        for w in weights:
            a[w.shape[0]] @ w
        timings["numpy: the pass's GEMMs"].append(time.perf_counter() - t)
        t = time.perf_counter()
        square @ square
        timings["numpy: 2048^3 GEMM"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in timings.items()}
    ceiling = flops["block GEMMs"] / med["numpy: the pass's GEMMs"] / 1e9
    peak = 2 * 2048 ** 3 / med["numpy: 2048^3 GEMM"] / 1e9
    rows = {name: {"median_ms": med[name] * 1e3, "gflops_per_s": total / med[name] / 1e9,
                   "share_of_pass_gemm_ceiling": total / med[name] / 1e9 / ceiling,
                   "share_of_square_gemm_peak": total / med[name] / 1e9 / peak} for name in runs}
    result = {"cpu": cpu_name(), "threads": THREADS, "engine": first.name, "packed_tokens": n, "state_tokens": past,
              "readouts": readouts, "flops": flops, "total_gflop": total / 1e9,
              "ceiling_gflops_per_s": {"pass_gemm_shapes": ceiling, "square_2048": peak},
              "numpy_blas": np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {}).get("name"),
              "backends": rows, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if "openvino-cpu" in runs:
        _, st, b = runs["openvino-cpu"]
        result["openvino_profile_ms"] = openvino_profile(args.engine, st, b, args.rounds)
        result["masked_share_of_packed_attention"] = masked_share(b)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Roofline of the 13-question pass ({first.name}, {result['cpu']}, {THREADS} threads, {result['date']})",
             "", f"One dense pass: {n} packed tokens over a {past}-token cached state, {readouts} read-outs: "
             f"{total / 1e9:.1f} GFLOP (block GEMMs {flops['block GEMMs'] / 1e9:.1f}, attention "
             f"{flops['attention'] / 1e9:.1f}, read-out {flops['read-out'] / 1e9:.1f}).", "",
             f"Ceiling: numpy's matmul ({result['numpy_blas']}, {THREADS} threads) on the pass's own GEMM shapes "
             f"{ceiling:.0f} GFLOP/s; on one 2048 x 2048 GEMM {peak:.0f} GFLOP/s. Medians of {args.rounds} "
             "interleaved rounds after a warm-up.", "",
             "| backend | pass ms | GFLOP/s | of the pass-shape ceiling | of the square-GEMM peak |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['median_ms']:.0f} | {r['gflops_per_s']:.0f} | "
                     f"{r['share_of_pass_gemm_ceiling']:.0%} | {r['share_of_square_gemm_peak']:.0%} |")
    if "openvino_profile_ms" in result:
        lines += profile_lines(result["openvino_profile_ms"], n, past,
                               result["masked_share_of_packed_attention"])
    lines += ["", f"    python benchmarks/roofline.py --engine {args.engine}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
