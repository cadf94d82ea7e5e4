"""The README's headline table, rendered from the result files behind each claim.

Each row is one claim about what a user gets today (the current default engine, the current commands), every figure
read from a JSON file of ``benchmarks/results/`` (or, for what a test guarantees, from the test's own tolerance), with
its source linked. The README holds the render between two markers; ``--check`` exits 0 when it equals a fresh render
and 1 otherwise (``tests/test_readme_table.py`` runs it), so a figure can only change with its result file. History
(what changed when, and the old figures) is in CHANGELOG.md.

    python benchmarks/readme_table.py            # rewrite the README's table
    python benchmarks/readme_table.py --check    # 0: the README's table is the render; 1: it is not
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- headline table: rendered by benchmarks/readme_table.py from benchmarks/results -->", \
    "<!-- end of the headline table -->"


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


def row_depth() -> tuple:
    name = "depth_probe.json"
    r = load(name)
    layers = str(r["layers"])
    cells = []
    for key, run in r["runs"].items():
        if not key.endswith("/200"):
            continue
        full = run["depths"][layers]
        fine = [int(d) for d, v in run["depths"].items() if v["accuracy"] >= full["accuracy"] - 0.01]
        cells.append(f"{key.split('/')[0]} {full['accuracy']:.2f} (block {min(fine)}: "
                     f"{run['depths'][str(min(fine))]['accuracy']:.2f})")
    text = "200 rows, 300 unseen states each, the head at full depth (the shallowest within a point): " + \
        "; ".join(cells)
    sources = [link(name)]
    if (RESULTS / "depth_speed.json").is_file():
        s = load("depth_speed.json")
        text += (f"; an engine cut at {s['blocks']['depth']} of {s['blocks']['full']} blocks: "
                 f"{s['ratio']['full / depth warm']:.2f}x warm, {s['ratio']['full / depth cold']:.2f}x cold")
        if "llama.cpp / depth warm" in s["ratio"]:
            apart = "not side by side" in s["llama_cpp"]
            text += (f", {s['ratio']['llama.cpp / depth warm']:.1f}x llama.cpp warm"
                     + (" (its median from another run on this CPU model)" if apart else ""))
        sources.append(link("depth_speed.json"))
    return ("`onepass tune` on 200 labelled rows: a decision head, read at the shallowest block that serves", text,
            ", ".join(sources))


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


def table_in(text: str) -> str | None:
    """The README's table between the markers (markers included), None where they are missing."""
    start, end = text.find(BEGIN), text.find(END)
    return text[start:end + len(END)] if 0 <= start < end else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 unless the README's table is the render")
    ap.add_argument("--readme", default=str(README))
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text()
    current, fresh = table_in(text), render()
    if current is None:
        print(f"{path}: no headline table between the markers {BEGIN!r} and {END!r}", file=sys.stderr)
        return 1
    if args.check:
        if current != fresh:
            print(f"{path}: the headline table differs from the render of benchmarks/results; run "
                  "`python benchmarks/readme_table.py`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text.replace(current, fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
