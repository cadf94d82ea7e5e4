"""The README's headline table and the figures of docs/benchmarks.md, rendered from the result files behind them.

Each README row is one claim about what a user gets today (the current default engine, the current commands), every
figure read from a JSON file of ``benchmarks/results/`` (or, for what a test guarantees, from the test's own
tolerance), with its source linked; docs/benchmarks.md holds the longer tables behind those rows. Each file holds its
render between two markers; ``--check`` exits 0 when both equal a fresh render and 1 otherwise
(``tests/test_readme_table.py`` runs it), so a figure can only change with its result file. History (what changed
when, and the old figures) is in CHANGELOG.md; what each study found, in its words of the day, in
benchmarks/studies/FINDINGS.md.

    python benchmarks/readme_table.py            # rewrite both renders
    python benchmarks/readme_table.py --check    # 0: both files hold the render; 1: one does not
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from onepass.runtime.core.guarantee import dataset_misses

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- headline table: rendered by benchmarks/readme_table.py from benchmarks/results -->", \
    "<!-- end of the headline table -->"
DOCS_BEGIN, DOCS_END = "<!-- figures: rendered by benchmarks/readme_table.py from benchmarks/results -->", \
    "<!-- end of the rendered figures -->"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def link(name: str) -> str:
    return f"[{Path(name).name}](benchmarks/results/{name})"


def tolerance(test: str, name: str) -> float:
    """A tolerance constant (``NAME = value``) of a test file: what the test guarantees."""
    found = re.search(rf"^{name}\s*=\s*([0-9.e-]+)", (ROOT / "tests" / test).read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"tests/{test} has no constant {name}")
    return float(found.group(1))


def _pct_range(values) -> str:
    values = sorted(values)
    return f"{values[0]:.2f}-{values[-1]:.2f}"


def row_exact() -> tuple:
    t = tolerance("test_depth.py", "TOL")
    return ("packed pass == each question alone, at full depth or cut at a depth",
            f"tested <= {t:.0e} (log-likelihood and head scores), against transformers' hidden states too",
            "[test_parity.py](tests/test_parity.py), [test_depth.py](tests/test_depth.py)")


def row_llama() -> tuple:
    name = "llama_cpp_side_by_side_compact.json"
    r = load(name)
    m = r["median_s"]
    warm, cold = m["llama.cpp warm"] / m["onepass auto warm"], m["llama.cpp cold"] / m["onepass auto cold"]
    return (f"{r['questions']} questions on a {r['state_tokens']}-token state, against llama.cpp's best state reuse "
            f"(same token ids, {r['threads']} threads, {r['cpu']})",
            f"warm **{m['onepass auto warm']:.2f} s** vs {m['llama.cpp warm']:.2f} s (**{warm:.1f}x**), cold "
            f"{m['onepass auto cold']:.2f} vs {m['llama.cpp cold']:.2f} s ({cold:.1f}x); {r['packed_tokens']} packed "
            f"tokens, {r['gflop_total']} GFLOP, {r['backend_auto']}", link(name))


def row_bf16() -> tuple:
    name = "bf16_guarantee_compact.json"
    g = load(name)
    d = g["guarantee"]["datasets"]
    s = g["speed"]
    b = g["guarantee"]["bounds"]
    return ("bf16 only by guarantee (`onepass guarantee`): the default where every data set keeps "
            f">= {b['argmax_agreement']:.0%} of argmaxes and max abs dp <= {b['max_abs_dp']}",
            f"{s['openvino-cpu warm']['p50_s'] / s['openvino-cpu-bf16 warm']['p50_s']:.2f}x warm, but argmax kept "
            f"{_pct_range(v['argmax_agreement'] for v in d.values())}, max abs dp "
            f"{_pct_range(v['max_abs_dp'] for v in d.values())} on {len(d)} data sets: fp32 stays the default",
            link(name))


def row_roofline() -> tuple:
    name = "roofline.json"
    r = load(name)
    ov, ort = r["backends"]["openvino-cpu"], r["backends"]["onnxruntime"]
    return (f"how close to the CPU's limit: a {r['packed_tokens']}-token pass ({r['total_gflop']:.1f} GFLOP)",
            f"openvino-cpu {ov['gflops_per_s']:.0f} GFLOP/s = {ov['share_of_pass_gemm_ceiling']:.0%} of the pass's own "
            f"GEMM shapes on numpy; onnxruntime {ort['gflops_per_s']:.0f} GFLOP/s ({r['cpu']})", link(name))


def row_host() -> tuple:
    name = "host_overhead.json"
    r = load(name)["results"]["this"]
    return ("host time of a warm ask, the pass stubbed (what a GPU's graph replay leaves to the host)",
            f"a question set asked again is found compiled: 13 questions {r['repeated/13']['p50']:.3f} ms, 64 "
            f"{r['repeated/64']['p50']:.2f} ms; held (`engine.compile`) {r['compiled/13']['p50']:.3f} / "
            f"{r['compiled/64']['p50']:.2f} ms", link(name))


def row_admission() -> tuple:
    name = "admission.json"
    s = load(name)["scenarios"]
    met = sum(v["met"] for v in s.values() if "met" in v)
    f = s["fairness"]
    return ("admission and fairness of a real server",
            f"{met} of {sum('met' in v for v in s.values())} targets met: a small request after large ones answered in "
            f"{s['poison']['small_at_once']['seconds']:.2f} s; beside eight heavy clients a ninth's p90 is "
            f"{f['quiet_p90_over_heavy_median']:.2f}x a heavy median; an abuser's neighbours "
            f"{s['penalty']['neighbour_answered']:.0%} answered", link(name))


def _speeds() -> list:
    """(file name, result) of every cut engine timed against full depth (``depth_speed.py --out depth_speed_NAME``),
    shallowest first."""
    found = [(p.name, json.loads(p.read_text())) for p in RESULTS.glob("depth_speed_*.json")]
    return sorted(found, key=lambda x: (x[1]["blocks"]["depth"], x[0]))


def _speed_label(name: str) -> str:
    return name.removeprefix("depth_speed_").removesuffix(".json")


def _task_llama(s: dict) -> str:
    """A task speed's ratio to llama.cpp, saying whether it was measured side by side."""
    if not s.get("llama_cpp_s"):
        return ""
    where = "its median from another run" if s.get("llama_reference") else "side by side"
    return f", {s['ratio']['llama.cpp / cut warm']:.1f}x llama.cpp warm ({where})"


def _task_speeds() -> list:
    """(file name, result) of every task whose passes were timed cut at its depth against every block
    (``task_depth_speed.py``)."""
    return sorted((p.name, json.loads(p.read_text())) for p in RESULTS.glob("task_depth_speed_*.json"))


def row_depth() -> tuple:
    sources, cells = [], []
    if (RESULTS / "depth_tune.json").is_file():
        t = load("depth_tune.json")
        d = t["datasets"]
        kept = [n for n, v in d.items() if v["chosen"]["accuracy"] >= v["full"]["accuracy"] - 0.01]
        missed = "; ".join(f"{n} {100 * (v['chosen']['accuracy'] - v['full']['accuracy']):+.1f} points"
                           for n, v in d.items() if n not in kept)
        cells.append(f"on {t['rows']} rows it chose " + ", ".join(f"{v['chosen']['blocks']}" for v in d.values())
                     + f" of {max(v['full']['blocks'] for v in d.values())} blocks ({', '.join(d)}); on "
                     f"{t['test_rows']} unseen states within a point of the full-depth head on {len(kept)} of {len(d)}"
                     + (f" ({missed})" if missed else ""))
        sources.append(link("depth_tune.json"))
    speeds = _speeds()
    if speeds:
        name, s = speeds[0]  # the shallowest cut measured
        cell = (f"cut at {s['blocks']['depth']} blocks ({_speed_label(name)}): "
                f"**{s['ratio']['full / depth warm']:.2f}x** warm, {s['ratio']['full / depth cold']:.2f}x cold")
        if "llama.cpp / depth warm" in s["ratio"]:
            apart = "not side by side" in s["llama_cpp"]
            cell += (f", {s['ratio']['llama.cpp / depth warm']:.1f}x llama.cpp warm"
                     + (" (its median from another run)" if apart else ""))
        cells.append(cell)
        sources += [link(n) for n, _ in speeds]
    for name, s in _task_speeds():
        cells.append(f"a task of one engine ({s['dataset']}, `tune --task`) read at {s['depth'] or s['blocks']} "
                     f"blocks, its passes cut there: **{s['ratio']['every block / cut warm']:.2f}x** warm, "
                     f"{s['ratio']['every block / cut cold']:.2f}x cold against every block" + _task_llama(s))
        sources.append(link(name))
    return ("`onepass tune` on labelled rows: a decision head, read at the shallowest block that serves",
            "; ".join(cells), ", ".join(sources))


def row_tasks() -> tuple:
    name = "tasks_served.json"
    r = load(name)
    acc = r["accuracy"]
    lat = r["latency"]
    return (f"{len(acc)} tuned tasks in one engine (`tune --task`, {r['rows']} rows each), over one shared state",
            "task vs the untuned engine on 300 unseen states: " + ", ".join(
                f"{k} {v['task']:.2f} / {v['engine']:.2f}" for k, v in acc.items())
            + f"; warm {lat['warm: 4 tasks x 3']['p50'] / lat['warm: 12 untuned']['p50']:.2f}x the time of 12 "
              f"untuned questions; RSS {r['rss']['engine with its tasks'] / r['rss']['engine alone']:.2f}x",
            link(name))


def row_distill() -> tuple:
    name = "distill.json"
    tasks = load(name)["tasks"]
    return ("`onepass distill`: a student taught only by a teacher's answers on 300 unlabelled states",
            "agreement with the teacher on 300 other states: " + ", ".join(
                f"{t['task']} {t['agreement']:.3f}" for t in tasks)
            + f"; {_pct_range(t['local_share'] for t in tasks)} of questions answered locally at the gate",
            link(name))


def row_cluster() -> tuple:
    name = "cluster.json"
    r = load(name)
    by = {(x["replicas"], x["routing"]): x for x in r["runs"]}
    state, default = by[(3, "state")], by[(3, "default")]
    fails = sum(r["failover"]["open"]["failures"].values()) if r["failover"]["open"]["failures"] else 0
    return ("replicas on Ray Serve (`onepass cluster`), 3 replicas",
            f"state-cache hit rate {state['hit_rate_closed']:.3f} state-affine vs {default['hit_rate_closed']:.3f} "
            f"with Serve's default router; {fails} failed requests through a replica SIGKILL", link(name))


def row_blocks() -> tuple:
    name = "blocks_5000.json"
    rows = load(name)["rows"]
    big = max(rows, key=lambda x: x["questions"])
    return ("many questions about one state (blocks of whole questions)",
            f"{big['questions']} questions in {big['passes']} passes, {big['ms_per_token']:.2f} ms per packed token",
            link(name))


def row_gpu() -> tuple:
    name = "gpu/kernels.json"
    k = load(name)
    p = k["padding_cases"]["13 questions"]
    return ("GPU / TensorRT / Jetson",
            "not run on a GPU here; counted without one: **"
            f"{k['launches_per_layer']:.1f} kernel launches per block** for the 13-question fp16 pass, "
            f"{k['prefill_launches_per_layer']:.1f} per prefill chunk; 13 questions pad {p['tokens']} -> "
            f"{p['padded']} tokens", link(name) + ", [docs/gpu.md](docs/gpu.md)")


ROWS = (row_exact, row_llama, row_bf16, row_roofline, row_depth, row_host, row_admission, row_tasks, row_distill,
        row_cluster, row_blocks, row_gpu)


def render() -> str:
    lines = [BEGIN, "| what | measured | where |", "|---|---|---|"]
    for row in ROWS:
        cells = row()
        if any("|" in c for c in cells):
            raise SystemExit(f"{row.__name__}: a cell holds '|', which would split the table's row")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [END])


# docs/benchmarks.md: the tables behind the README's rows (links relative to docs/)

def _doc_link(name: str) -> str:
    return f"[{Path(name).name}](../benchmarks/results/{name})"


def _table(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if any("|" in str(c) for c in row):
            raise SystemExit(f"a cell of {header} holds '|', which would split the table's row")
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return out


def docs_llama() -> list:
    name = "llama_cpp_side_by_side_compact.json"
    r = load(name)
    m = r["median_s"]
    ratio = lambda who, kind: f"{m[f'llama.cpp {kind}'] / m[f'{who} {kind}']:.1f}x"  # noqa: E731
    same = r["llama_q4_vs_onepass_fp32_same_weights"]
    return [f"### Against llama.cpp ({_doc_link(name)}; `python benchmarks/llama_cpp_side_by_side.py`)", "",
            f"{r['questions']} questions over a {r['state_tokens']}-token state, the same token ids, {r['threads']} "
            f"threads on {r['cpu']}, medians of {r['rounds']} interleaved rounds. llama.cpp ({r['llama_cpp']}) reuses "
            f"the state as its API allows: it evaluates {r['llama_cpp_tokens_evaluated_warm']} tokens warm; onepass "
            f"packs {r['packed_tokens']} ({r['packed_tokens_per_question']} per question, {r['readouts']} read-outs, "
            f"{r['gflop_total']} GFLOP). On the same weights llama.cpp picks the same option on "
            f"{same['same_option']} of {r['questions']} questions.", "",
            *_table(["", "warm", "cold", "warm vs llama.cpp", "cold vs llama.cpp"], [
                [f"onepass default ({r['backend_auto']}, fp32)", f"{m['onepass auto warm']:.3f} s",
                 f"{m['onepass auto cold']:.3f} s", ratio("onepass auto", "warm"), ratio("onepass auto", "cold")],
                ["onepass openvino-cpu-bf16", f"{m['onepass openvino-cpu-bf16 warm']:.3f} s",
                 f"{m['onepass openvino-cpu-bf16 cold']:.3f} s", ratio("onepass openvino-cpu-bf16", "warm"),
                 ratio("onepass openvino-cpu-bf16", "cold")],
                ["llama.cpp", f"{m['llama.cpp warm']:.3f} s", f"{m['llama.cpp cold']:.3f} s", "", ""]])]


def docs_bf16() -> list:
    name = "bf16_guarantee_compact.json"
    g = load(name)
    b, s = g["guarantee"]["bounds"], g["speed"]
    rows = [[k, f"{v['argmax_agreement']:.2f}", f"{v['max_abs_dp']:.3f}", f"{v['mean_abs_dp']:.3f}",
             "missed" if dataset_misses(k, v) else "kept"] for k, v in g["guarantee"]["datasets"].items()]
    return [f"### bf16, only where its guarantee holds ({_doc_link(name)}; `python benchmarks/bf16_guarantee.py`)", "",
            f"{g['n']} questions per data set (seed {g['seed']}), OpenVINO bf16 against f32. The bounds: >= "
            f"{b['argmax_agreement']:.0%} of argmaxes kept and max abs dp <= {b['max_abs_dp']} on every data set. bf16 "
            f"is {s['openvino-cpu warm']['p50_s'] / s['openvino-cpu-bf16 warm']['p50_s']:.2f}x fp32 warm "
            f"({s['openvino-cpu-bf16 warm']['p50_s']:.3f} s against {s['openvino-cpu warm']['p50_s']:.3f} s) and "
            f"{s['openvino-cpu cold']['p50_s'] / s['openvino-cpu-bf16 cold']['p50_s']:.2f}x cold.", "",
            *_table(["data set", "argmax kept", "max abs dp", "mean abs dp", "bounds"], rows)]


def docs_roofline() -> list:
    name = "roofline.json"
    r = load(name)
    f = {k: v / 1e9 for k, v in r["flops"].items()}
    rows = [[k, f"{v['median_ms']:.0f} ms", f"{v['gflops_per_s']:.0f}", f"{v['share_of_pass_gemm_ceiling']:.0%}"]
            for k, v in r["backends"].items()]
    return [f"### How close to the CPU's limit ({_doc_link(name)}; `python benchmarks/roofline.py`)", "",
            f"A pass of {r['packed_tokens']} packed tokens over {r['state_tokens']} state tokens, {r['total_gflop']:.1f}"
            " GFLOP counted from the graph (" + ", ".join(f"{k} {v:.1f}" for k, v in f.items()) + f"); numpy's "
            f"matmul ({r['numpy_blas']}, {r['threads']} threads) runs the pass's own GEMM shapes at "
            f"{r['ceiling_gflops_per_s']['pass_gemm_shapes']:.0f} GFLOP/s on {r['cpu']} ({r['date']}). The tree mask "
            f"hides {r['masked_share_of_packed_attention']:.1%} of the packed x packed attention.", "",
            *_table(["backend", "pass", "GFLOP/s", "of the pass-shape ceiling"], rows)]


def docs_depth() -> list:
    name = "depth_probe.json"
    r = load(name)
    layers = str(r["layers"])
    runs = {k: v for k, v in r["runs"].items() if k.endswith("/200")}
    depths = sorted({int(d) for v in runs.values() for d in v["depths"]})
    first = next(iter(runs.values()))
    rows = []
    for key, run in runs.items():
        full = run["depths"][layers]["accuracy"]
        rows.append([key.split("/")[0], *(f"**{run['depths'][str(d)]['accuracy']:.3f}**"
                                          if run["depths"][str(d)]["accuracy"] >= full - 0.01
                                          else f"{run['depths'][str(d)]['accuracy']:.3f}" for d in depths)])
    out = [f"### The decision head read at each block ({_doc_link(name)}; `python benchmarks/depth_probe.py`)", "",
           f"The head fitted on {first['train_rows']} labelled rows and read after k of the model's {layers} blocks; "
           f"accuracy on {first['test_rows']} rows of states never trained on (bold: within a point of the full "
           f"depth, or better); {r['cpu']}, {r['when']}.", "",
           *_table(["data set", *(f"k={d}" for d in depths)], rows)]
    if (RESULTS / "depth_tune.json").is_file():
        t = load("depth_tune.json")
        rows = [[n, v["chosen"]["chosen"], v["chosen"]["blocks"], f"{v['chosen']['accuracy']:.3f}",
                 f"{v['full']['accuracy']:.3f}", f"{100 * (v['chosen']['accuracy'] - v['full']['accuracy']):+.1f}"]
                for n, v in t["datasets"].items()]
        out += ["", f"What `onepass tune` chose on {t['rows']} rows ({_doc_link('depth_tune.json')}; `python "
                "benchmarks/depth_tune.py`), served on the same unseen rows against `tune --head-depths full`:", "",
                *_table(["data set", "chosen", "blocks", "accuracy", "full-depth head", "points"], rows)]
    for name, s in _speeds():
        m = s["median_s"]
        out += ["", f"An engine cut at {s['blocks']['depth']} of {s['blocks']['full']} blocks ({_speed_label(name)}) "
                f"against {'the same task with its head at full depth' if s['full_has_head'] else 'the engine it was tuned from'}"
                f" ({s['blocks']['full']} blocks; {_doc_link(name)}; `python "
                f"benchmarks/depth_speed.py`), {s['cpu']}, medians of {s['rounds']} interleaved rounds: warm "
                f"{m['depth warm']:.3f} s against {m['full warm']:.3f} s ({s['ratio']['full / depth warm']:.2f}x), "
                f"cold {m['depth cold']:.3f} s against {m['full cold']:.3f} s ({s['ratio']['full / depth cold']:.2f}x); "
                f"peak RSS {s['rss_mib']['depth']:.0f} against {s['rss_mib']['full']:.0f} MiB, "
                f"{s['engine_mib']['depth']:.0f} against {s['engine_mib']['full']:.0f} MiB on disk."]
    for name, s in _task_speeds():
        m, x, rss = s["median_s"], s["ratio"], s["rss_mib"]
        out += ["", f"A task tuned into the engine ({s['dataset']}, {s['rows']} rows, `tune --task` chose "
                f"{s['chosen']}) answering the README ticket's 13 questions asked of it, its passes and prefills on "
                f"the slot graph cut at {s['depth'] or s['blocks']} blocks against the same engine running every "
                f"block ({_doc_link(name)}; `python benchmarks/task_depth_speed.py`; {s['backend']}), {s['cpu']}, "
                f"medians of {s['rounds']} interleaved rounds: warm {m['cut warm']:.3f} s against "
                f"{m['every block warm']:.3f} s ({x['every block / cut warm']:.2f}x), cold {m['cut cold']:.3f} s "
                f"against {m['every block cold']:.3f} s ({x['every block / cut cold']:.2f}x); the same answers "
                f"(largest probability difference {s['max_abs_dp_cut_vs_every_block']:.1e}); peak RSS "
                f"{rss['cut']:.0f} against {rss['every block']:.0f} MiB (the engine alone {rss['engine']:.0f}); "
                f"served on {s['test']['rows']} unseen states: accuracy {s['test']['accuracy']:.3f}"
                + (f"; llama.cpp's best state reuse (zero-shot, every block) {s['llama_cpp_s']['warm']:.3f} s warm, "
                   f"{s['llama_cpp_s']['cold']:.3f} s cold: {x['llama.cpp / cut warm']:.2f}x and "
                   f"{x['llama.cpp / cut cold']:.2f}x the cut task's time ("
                   + ("another run's medians, not side by side" if s.get("llama_reference") else
                      "in the same interleaved rounds") + ")" if s.get("llama_cpp_s") else "") + "."]
    return out


def docs_host() -> list:
    name = "host_overhead.json"
    r = load(name)
    res = r["results"]
    trees = [t for t in res if t != "this"]
    cases = list(res["this"])
    rows = [[c, f"{res['this'][c]['p50']:.3f} ms", *(f"{res[t][c]['p50']:.3f} ms" if c in res[t] else "" for t in trees)]
            for c in cases]
    commits = {t: r["trees"][t]["commit"] for t in ("this", *trees)}
    return [f"### Host time per ask, the pass stubbed ({_doc_link(name)}; `python benchmarks/host_overhead.py`)", "",
            f"One warm ask over a {r['state_tokens']}-token state with the backend's pass replaced by an instant stub "
            f"(what the host spends around a pass a GPU replays), p50 per kind of ask and question count, "
            f"{r['machine']['cpu']}; the code at {commits['this']} (now) against "
            + ", ".join(f"{commits[t]} (before compiled question sets)" for t in trees)
            + " in the same run, the trees alternating. `new`: a question set asked for the first time (compiled "
            "then); `repeated`: the same set asked again (found compiled); `compiled`: held by `engine.compile`; "
            "`async`: through the engine thread.", "",
            *_table(["ask / questions", f"{commits['this']} (now)", *(f"{commits[t]} (before)" for t in trees)], rows)]


def docs_blocks() -> list:
    name = "blocks_5000.json"
    b = load(name)
    rows = [[x["workload"], x["questions"], x["passes"], x["packed_tokens"], f"{x['median_ms'] / 1000:.1f} s",
             f"{x['ms_per_token']:.2f}"] for x in b["rows"]]
    return [f"### Many questions about one state ({_doc_link(name)}; `python benchmarks/blocks.py`)", "",
            f"Blocks of whole questions, {b['machine']['cpu']}, {b['machine']['when']}.", "",
            *_table(["workload", "questions", "passes", "packed tokens", "time", "ms per packed token"], rows)]


DOCS_SECTIONS = (docs_llama, docs_bf16, docs_roofline, docs_depth, docs_host, docs_blocks)


def render_docs() -> str:
    lines = [DOCS_BEGIN]
    for section in DOCS_SECTIONS:
        lines += ["", *section()]
    return "\n".join(lines + ["", DOCS_END])


def table_in(text: str, begin: str = BEGIN, end: str = END) -> str | None:
    """The render between the markers (markers included), None where they are missing."""
    start, stop = text.find(begin), text.find(end)
    return text[start:stop + len(end)] if 0 <= start < stop else None


def _one(path: Path, begin: str, end: str, fresh: str, what: str, check: bool) -> int:
    text = path.read_text()
    current = table_in(text, begin, end)
    if current is None:
        print(f"{path}: no {what} between the markers {begin!r} and {end!r}", file=sys.stderr)
        return 1
    if check:
        if current != fresh:
            print(f"{path}: the {what} differs from the render of benchmarks/results; run "
                  "`python benchmarks/readme_table.py`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text.replace(current, fresh))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 unless both files hold the render")
    ap.add_argument("--readme", default=str(README))
    ap.add_argument("--docs", default=str(DOCS))
    args = ap.parse_args(argv)
    return max(_one(Path(args.readme), BEGIN, END, render(), "headline table", args.check),
               _one(Path(args.docs), DOCS_BEGIN, DOCS_END, render_docs(), "rendered figures", args.check))


if __name__ == "__main__":
    sys.exit(main())
