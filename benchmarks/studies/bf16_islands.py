"""Where OpenVINO's bf16 loses the decisions: bf16 variants of the same fp32 engine against OpenVINO f32.

OpenVINO's CPU plugin, asked for bf16 (``openvino-cpu-bf16``), rounds almost every node to bf16: the GEMMs, the
residual stream, norms, rotary, attention. This benchmark keeps chosen nodes in f32 (the runtime attribute
``DisablePrecisionConversion``, which the plugin honours) to find which rounding costs the decisions:

- ``bf16 everywhere``: OpenVINO's own bf16, nothing kept (what ``openvino-cpu-bf16`` runs).
- ``bf16 GEMMs``: only the GEMMs against weights in bf16; every other float node kept f32.
- ``f32 GEMMs``: every float node kept f32, the weight GEMMs too. What is left is the rounding the plugin does
  anyway: its fused RMSNorm writes bf16, and the read-out GEMM (whose weights it transposes) loses the mark. The
  floor of rounding the GEMMs' inputs alone; a diagnostic, not an engine choice.

Each on the requests of ``bf16_guarantee.py`` (N questions per data set, fixed seed): argmax agreement, max and mean
|dp| against f32; and the README ticket's 13 questions warm, every variant and f32 interleaved round by round
(medians after a warm-up). Writes benchmarks/studies/results/bf16_islands.{json,md}.

    python benchmarks/studies/bf16_islands.py --engine engines/smollm2 [--n 100] [--rounds 9]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import openvino as ov

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from bf16_guarantee import parser, requests  # noqa: E402
from latency import QUESTIONS, TICKET, cpu_name, interleaved  # noqa: E402

from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.backends.openvino_cpu import OpenVinoCpuBackend  # noqa: E402
from onepass.runtime.core.guarantee import BF16, REFERENCE, cpu_bf16_kind  # noqa: E402
from onepass.runtime.tools.guarantee import Closeness, probabilities  # noqa: E402

RESULTS = Path(__file__).parent / "results"

# The attribute that keeps a node out of the plugin's bf16 has no constructor in OpenVINO's Python API
# (ov::disable_conversion is C++ only), but the IR reader makes one from XML: the Relu of this one-node IR carries it,
# and Node.set_rt_info copies it onto the engine graph's nodes.
KEEP_F32_IR = b"""<?xml version="1.0"?><net name="keep_f32" version="11"><layers>
<layer id="0" name="x" type="Parameter" version="opset1"><data shape="1" element_type="f32"/>
<output><port id="0" precision="FP32"><dim>1</dim></port></output></layer>
<layer id="1" name="kept" type="Relu" version="opset1"><rt_info>
<attribute name="DisablePrecisionConversion" version="0" value="dynamic:dynamic"/></rt_info>
<input><port id="0" precision="FP32"><dim>1</dim></port></input>
<output><port id="1" precision="FP32"><dim>1</dim></port></output></layer>
<layer id="2" name="y" type="Result" version="opset1"><input><port id="0" precision="FP32"><dim>1</dim></port>
</input></layer></layers><edges><edge from-layer="0" from-port="0" to-layer="1" to-port="0"/>
<edge from-layer="1" from-port="1" to-layer="2" to-port="0"/></edges></net>"""


def _keep_attribute():
    """(key, value) of the runtime attribute that keeps a node in its own precision, read from KEEP_F32_IR."""
    model = ov.Core().read_model(KEEP_F32_IR, ov.Tensor(np.zeros(0, dtype=np.uint8)))
    rt = next(op for op in model.get_ordered_ops() if op.get_friendly_name() == "kept").get_rt_info()
    key = next(k for k in rt.keys() if k.startswith("DisablePrecisionConversion"))
    return key, rt[key]


def _weights(output) -> bool:
    """Whether ``output`` is a constant, seen through the layout ops an exporter puts before a GEMM's weights."""
    node = output.get_node()
    while node.get_type_name() in ("Transpose", "Convert", "Reshape"):
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Constant"


def keep_f32(model, gemms: bool) -> int:
    """Keep every float32 node of ``model`` in f32 under the plugin's bf16 but the GEMMs against weights (``gemms``:
    those too); returns how many nodes were marked. Integer and boolean nodes (masks, positions, shapes) never run
    in bf16, and the plugin refuses them marked."""
    key, value = _keep_attribute()
    marked = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() in ("Parameter", "Result", "Constant"):
            continue
        types = [i.get_element_type() for i in node.inputs()] + [o.get_element_type() for o in node.outputs()]
        if any(t != ov.Type.f32 for t in types):
            continue
        if not gemms and node.get_type_name() == "MatMul" and _weights(node.input_value(1)):
            continue
        node.set_rt_info(value, key)
        marked += 1
    return marked


MARKING = {"bf16 everywhere": lambda model: 0, "bf16 GEMMs": lambda model: keep_f32(model, gemms=False),
           "f32 GEMMs": lambda model: keep_f32(model, gemms=True)}


def _compiler(mark):
    """An OpenVinoCpuBackend._compile that marks the graph with ``mark`` before the plugin compiles it (the count of
    nodes marked kept as the backend's ``marked``)."""
    def compile_marked(backend):
        core = ov.Core()
        model = core.read_model(backend.graph_path)
        backend.marked = mark(model)
        return core.compile_model(model, "CPU", backend.config)
    return compile_marked


def load(engine_dir: str, variant: str | None, threads: int, cache_bytes: int | None = None) -> Engine:
    """The engine on OpenVINO f32 (variant None) or on ``openvino-cpu-bf16`` compiled with ``variant``'s marking."""
    kwargs = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    if variant is None:
        return Engine.load(engine_dir, backend=REFERENCE, threads=threads, **kwargs)
    plain, OpenVinoCpuBackend._compile = OpenVinoCpuBackend._compile, _compiler(MARKING[variant])
    try:
        return Engine.load(engine_dir, backend=BF16, threads=threads, **kwargs)
    finally:
        OpenVinoCpuBackend._compile = plain


def ran_bf16(compiled) -> dict:
    """How many GEMMs, fused attentions, elementwise ops and norms of the compiled model ran in bf16 (its execution
    graph): the evidence that a marking took."""
    ran: dict = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str)
        if kind in ("FullyConnected", "Subgraph", "Eltwise", "RMS") and info["runtimePrecision"].astype(str) == "bf16":
            ran[kind] = ran.get(kind, 0) + 1
    return ran


def answers(engine: Engine, asked: list) -> list[dict]:
    return [{qid: probabilities(a) for qid, a in engine.ask(state, questions).items()}
            for _, (state, questions) in asked]


def closeness(asked: list, ref: list[dict], got: list[dict]) -> dict:
    """Per data set: questions, argmax agreement, max and mean |dp| of ``got`` against ``ref``."""
    close = Closeness()
    for (dataset, _), want, have in zip(asked, ref, got):
        for qid, p in want.items():
            close.add(dataset, p, have[qid])
    return {name: {k: round(v, 4) for k, v in m.items()} for name, m in close.datasets().items()}


def markdown(result: dict, args) -> str:
    lines = [f"# Where bf16 loses the decisions ({result['cpu']}, {args.threads} threads, CPU bf16: "
             f"{result['cpu_bf16']})", "",
             f"{args.n} questions per data set (seed {args.seed}, the requests of bf16_guarantee.py), each variant "
             "against OpenVINO f32; warm: the README ticket's 13 questions, "
             f"{args.rounds} interleaved rounds after a warm-up (median, seconds).", "",
             "| variant | nodes kept f32 | ran in bf16 (GEMMs / attention / elementwise / norms) | warm p50 | "
             + " | ".join(f"{d}: argmax / max dp / mean dp" for d in result["datasets"]) + " |",
             "|---|---|---|---|" + "---|" * len(result["datasets"])]
    for name, v in result["variants"].items():
        cells = [f"{m['argmax_agreement']:.2f} / {m['max_abs_dp']:.3f} / {m['mean_abs_dp']:.4f}"
                 for m in v["datasets"].values()]
        ran = " / ".join(str(v["ran_bf16"].get(k, 0)) for k in ("FullyConnected", "Subgraph", "Eltwise", "RMS"))
        lines.append(f"| {name} | {v['marked']} | {ran} | {v['warm_p50_s']} | " + " | ".join(cells) + " |")
    lines.append(f"| f32 (reference) | - | 0 | {result['f32_warm_p50_s']} | " + " | ".join(
        "1 / 0 / 0" for _ in result["datasets"]) + " |")
    lines += ["", f"    python benchmarks/studies/bf16_islands.py --engine {args.engine} --n {args.n} --seed {args.seed} "
              f"--rounds {args.rounds}", ""]
    return "\n".join(lines)


def main() -> None:
    args = parser(__doc__).parse_args()
    if cpu_bf16_kind() is None:
        sys.exit("this CPU has no native bf16 (AMX or AVX512-BF16): OpenVINO would run every variant in f32")
    asked = requests(args.n, args.seed)
    reference = load(args.engine, None, args.threads, cache_bytes=0)
    ref = answers(reference, asked)
    reference.close()
    result = {"cpu": cpu_name(), "cpu_bf16": cpu_bf16_kind(), "variants": {}}
    for name in MARKING:
        engine = load(args.engine, name, args.threads, cache_bytes=0)
        if engine.backend.precision != "bf16":
            sys.exit(f"OpenVINO computes in {engine.backend.precision} here, not bf16")
        result["variants"][name] = {"marked": engine.backend.marked, "ran_bf16": ran_bf16(engine.backend.compiled),
                                    "datasets": closeness(asked, ref, answers(engine, asked))}
        engine.close()
        print(name, json.dumps(result["variants"][name]["datasets"]), file=sys.stderr, flush=True)
    warm = {name: load(args.engine, name, args.threads) for name in MARKING}
    warm["f32"] = load(args.engine, None, args.threads)
    times = interleaved({name: lambda e=e: e.ask(TICKET, QUESTIONS) for name, e in warm.items()}, args.rounds)
    for name, engine in warm.items():
        engine.close()
        p50 = round(statistics.median(times[name]), 3)
        if name == "f32":
            result["f32_warm_p50_s"] = p50
        else:
            result["variants"][name]["warm_p50_s"] = p50
    result["datasets"] = list(next(iter(result["variants"].values()))["datasets"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bf16_islands.json").write_text(json.dumps({**result, "args": vars(args)}, indent=2) + "\n")
    (RESULTS / "bf16_islands.md").write_text(markdown(result, args))
    print((RESULTS / "bf16_islands.md").read_text())


if __name__ == "__main__":
    main()
