"""Four tuned tasks, one engine, one pass (issue 45): what the task slots cost in time and memory.

The README ticket (a ~510-token state) and 12 of its questions, 3 per task for 4 tasks (LoRA rank 16 each,
random factors: the time does not depend on their values). The engine's model is exported here three times in a
child process (so that torch stays out of the measured process): the plain graph, and task-slot graphs with slots
on every block and on the top 4. Then, on OpenVINO's CPU plugin (f32, the default backend), interleaved rounds of:

* warm (the state's K/V cached): ``base`` the 12 questions untuned in one pass; ``slots, K=0`` the slot graph fed
  no task (the slots' own cost); ``slots, 4 tasks`` the 12 questions of 4 tasks in one pass (tasks share no
  token); ``4 engines`` four passes of 3 questions of the plain graph over the one cached state (a floor for four
  whole engines, each of which would also hold its own cache);
* cold: one prefill + one pass (``base``; ``slots, 4 tasks``, its prefill fed no task) against four prefills and
  four passes (``4 engines``: each tuned engine prefills the state with its own weights).

Memory: the process's RSS grows by one compiled graph per engine: measured for the plain graph compiled 4 times
(four whole engines) against each slot graph compiled once, plus the tasks' factors.

    python benchmarks/studies/task_slots.py --engine engines/smollm2 --rounds 9
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from latency import QUESTIONS, TICKET  # noqa: E402
from tune_eval import _machine  # noqa: E402

import numpy as np  # noqa: E402
import openvino as ov  # noqa: E402

from onepass.runtime.backends import contract  # noqa: E402
from onepass.runtime.backends.batch import causal  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.prompt import PromptEncoder  # noqa: E402
from onepass.runtime.core.tasks import TaskAdapter, projection_shapes, stack  # noqa: E402
from onepass.runtime.core.tree import pack  # noqa: E402
from onepass.runtime.server.memory import rss_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TASKS, PER_TASK = 4, 3


def _compile(path: Path, threads: int):
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
    return core.compile_model(core.read_model(str(path)), "CPU", config)


def _random_tasks(rank: int, blocks, shapes: dict, seed: int = 0) -> list[TaskAdapter]:
    rng = np.random.default_rng(seed)
    return [TaskAdapter(f"task{t}", rank, {(b, p): (rng.normal(0, d_in ** -0.5, (rank, d_in)).astype(np.float32),
                                                      rng.normal(0, 0.01, (d_out, rank)).astype(np.float32))
                                           for b in blocks for p, (d_in, d_out) in shapes.items()})
            for t in range(TASKS)]


def export(engine_dir: Path, out: Path) -> None:
    """(child process) The plain graph and the slot graphs of the engine's model into ``out``, with shapes.json."""
    from onepass.export.model_source import engine_source, load_model
    from onepass.export.onnx_graph import export_decoder, export_task_decoder
    from onepass.runtime.backends.torch_decoder import PackedDecoder, TaskDecoder

    spec, adapters = engine_source(mf.load(engine_dir, verify=False))
    decoder = PackedDecoder(load_model(spec, adapters).model).eval()
    d = decoder.dims
    shapes = projection_shapes(d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size)
    export_decoder(decoder, out / "base.onnx")
    for count in BLOCKS:
        export_task_decoder(TaskDecoder(decoder, _top(count, d.num_layers)), shapes, out / f"slots{count}.onnx")
    (out / "shapes.json").write_text(json.dumps(shapes))


def _top(count: int, layers: int) -> list[int]:
    return list(range(layers - min(count, layers), layers))


BLOCKS = (30, 4)  # slots on every block of SmolLM2 and on the top 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export", help=argparse.SUPPRESS)  # the child process: export into this folder
    args = ap.parse_args()
    root = Path(args.engine)
    if args.export:
        return export(root, Path(args.export))
    m = mf.load(root, verify=False)
    d = m.model
    encoder = PromptEncoder(str(root / m.tokenizer), m.prompt)
    state = encoder.state(TICKET)
    encoded = [encoder.question(q) for q in list(QUESTIONS.values())[:TASKS * PER_TASK]]
    task_of = [i % TASKS for i in range(len(encoded))]
    names = [s.name for s in contract.input_specs(d.num_layers, d.num_kv_heads, d.head_dim)]
    past_names = names[3:3 + 2 * d.num_layers]
    empty = [np.zeros((d.num_kv_heads, 0, d.head_dim), np.float32)] * (2 * d.num_layers)
    prefill = causal(state, 0)
    prefill_none = dataclasses.replace(prefill, token_task=np.full(len(state), -1, dtype=np.int64))

    def feed(batch, kv):
        return {**contract.batch_inputs(batch), **dict(zip(past_names, kv)),
                contract.PAST_LENGTH: np.asarray(kv[0].shape[1], dtype=np.int64)}

    def presents(result):
        return [np.array(result[i]) for i in range(1, 1 + 2 * d.num_layers)]

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--engine", str(root), "--export", tmp], check=True)
        exported = time.perf_counter() - started
        shapes = {k: tuple(v) for k, v in json.loads((Path(tmp) / "shapes.json").read_text()).items()}
        rss = [("start", rss_bytes())]
        reqs = []
        for i in range(TASKS):
            reqs.append(_compile(Path(tmp) / "base.onnx", args.threads).create_infer_request())
            rss.append((f"plain graph compiled x{i + 1}", rss_bytes()))
        past = presents(reqs[0].infer(feed(prefill, empty)))
        base_batch = pack(encoded, len(state))
        groups = [pack([q for q, t in zip(encoded, task_of) if t == k], len(state)) for k in range(TASKS)]

        def engines(cold: bool):
            for r, g in zip(reqs, groups):
                r.infer(feed(g, presents(r.infer(feed(prefill, empty))) if cold else past))

        runs = {"warm: base (12 untuned, 1 pass)": lambda: reqs[0].infer(feed(base_batch, past)),
                "warm: 4 engines (4 passes of 3)": lambda: engines(False),
                "cold: base (prefill + 1 pass)":
                    lambda: reqs[0].infer(feed(base_batch, presents(reqs[0].infer(feed(prefill, empty))))),
                "cold: 4 engines (4 prefills + 4 passes)": lambda: engines(True)}
        packed, variants = {"base": base_batch.num_tokens}, {}
        for count in BLOCKS:
            blocks = _top(count, d.num_layers)
            req = _compile(Path(tmp) / f"slots{count}.onnx", args.threads).create_infer_request()
            rss.append((f"slot graph ({count} blocks) compiled", rss_bytes()))
            stacked, none = stack(_random_tasks(args.rank, blocks, shapes), blocks, shapes), stack([], blocks, shapes)
            batch = pack(encoded, len(state), tasks=task_of)
            untasked = pack(encoded, len(state), tasks=[-1] * len(encoded))
            packed["tasks"] = batch.num_tokens
            slot_names = [s.name for s in contract.task_input_specs(blocks, shapes)]

            def slots(b, s, kv, req=req, slot_names=slot_names):
                return req.infer({**feed(b, kv), **dict(zip(slot_names, [s.mask(b.token_task), *s.inputs]))})

            label = f"slots on {count} blocks"
            runs[f"warm: {label}, K=0 (12 untuned)"] = lambda f=slots, u=untasked, n=none: f(u, n, past)
            runs[f"warm: {label}, 4 tasks x 3 (1 pass)"] = lambda f=slots, b=batch, s=stacked: f(b, s, past)
            runs[f"cold: {label}, 4 tasks (prefill + 1 pass)"] = (
                lambda f=slots, b=batch, s=stacked, n=none: f(b, s, presents(f(prefill_none, n, empty))))
            variants[str(count)] = {"blocks": count, "task_bytes_fp32": int(sum(a.nbytes for a in stacked.inputs)),
                                    "task_bytes_per_task_fp16": int(sum(a.nbytes for a in stacked.inputs) / TASKS / 2)}
        times = {k: [] for k in runs}
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(args.rounds):
            for k, fn in runs.items():
                started = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - started)
        graph_bytes = sum(f.stat().st_size for f in Path(tmp).iterdir() if f.name.startswith("base.onnx"))
    out = {"machine": _machine(), "state_tokens": len(state), "questions": len(encoded), "tasks": TASKS,
           "rank": args.rank, "rounds": args.rounds, "graph_bytes": graph_bytes, "export_seconds": exported,
           "packed_tokens": packed, "variants": variants, "rss": dict(rss),
           "seconds": {k: {"p50": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()}}
    (RESULTS / "task_slots.json").write_text(json.dumps(out, indent=2) + "\n")
    write_md(out)


def write_md(out: dict) -> None:
    s = out["seconds"]
    base = {kind: s[f"{kind}: base (12 untuned, 1 pass)" if kind == "warm" else "cold: base (prefill + 1 pass)"]["p50"]
            for kind in ("warm", "cold")}
    rss = out["rss"]
    mib = 2 ** 20
    lines = [f"# Four tuned tasks in one pass: the task slots' time and memory ({out['machine']['cpu']}, "
             f"{out['machine']['when']})", "",
             f"The README ticket ({out['state_tokens']}-token state) and {out['questions']} of its questions, "
             f"{PER_TASK} per task for {out['tasks']} tasks (LoRA rank {out['rank']}, random factors); OpenVINO CPU "
             f"f32, 2 threads; medians of {out['rounds']} interleaved rounds after a warm-up. Packed tokens: "
             f"{out['packed_tokens']['base']} untuned (questions share template tokens), "
             f"{out['packed_tokens']['tasks']} with tasks (no token shared across tasks). Warm: the state's K/V "
             "cached; cold: prefill + pass(es). The `4 engines` rows run the plain graph as four tuned engines would "
             "(the same shapes, other weights).", "",
             "| run | p50 s | min s | vs the same kind (warm / cold) of 12 untuned questions |", "|---|---|---|---|"]
    for k, v in s.items():
        lines.append(f"| {k} | {v['p50']:.3f} | {v['min']:.3f} | {v['p50'] / base[k.split(':')[0]]:.2f}x |")
    one = rss["plain graph compiled x1"] - rss["start"]
    four = rss[f"plain graph compiled x{TASKS}"] - rss["start"]
    steps = list(rss.items())  # each slot graph's growth: over the step before it
    slot_rss = {k.split("(")[1].split(" ")[0]: v - steps[i - 1][1] for i, (k, v) in enumerate(steps)
                if k.startswith("slot graph")}
    lines += ["", f"Memory (RSS growth of the process, MiB): one plain graph compiled {one / mib:.0f}; four (four "
              f"whole engines) {four / mib:.0f}; " + "; ".join(
                  f"the slot graph on {b} blocks {g / mib:.0f}" for b, g in slot_rss.items())
              + f". The graph's weights on disk: {out['graph_bytes'] / mib:.0f} MiB. The 4 tasks' factors fed: "
              + "; ".join(f"slots on {k} blocks {v['task_bytes_fp32'] / mib:.1f} MiB fp32 "
                          f"({v['task_bytes_per_task_fp16'] / mib:.1f} MiB per task stored in fp16)"
                          for k, v in out["variants"].items()) + ".", "",
              "    python benchmarks/studies/task_slots.py --engine engines/smollm2 --rounds 9"]
    (RESULTS / "task_slots.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
