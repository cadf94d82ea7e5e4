"""Requests about one state, merged: the engine before and after a request is grouped once (its state made text and
tokenised once per group, where each request did both and the engine then grouped again by token ids).

Each version runs in a process of its own, from a git worktree of its commit (the package is this repository's
root), over the same engine: ``--requests`` requests of one yes/no question each, all about one cached state of
about ``--state-tokens`` tokens, answered by ``Engine.run_many`` (what the server's dispatcher did before; now the
dispatcher calls ``run_group`` with a group it made). Processes alternate (base, head, base, head, ...) so that the
machine's drift falls on both; medians over every timed round after a warm-up.

    python benchmarks/studies/grouping.py --engine engines/smollm2 --base 8f5a69c
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[2]  # the checkout (benchmarks/studies/..)
SENTENCE = "The customer wrote again about order 4521, the damaged parcel and the second charge on the card. "

CHILD = """
import json, sys, time
import onepass
from onepass import Engine, Noul
engine_dir, state_tokens, requests, rounds, warm = sys.argv[1], *map(int, sys.argv[2:6])
engine = Engine.load(engine_dir)
sentence = {sentence!r}
state = sentence * max(1, int(state_tokens / (len(engine.encoder.state(sentence * 20)) / 20)))
asks = [(state, {{f"q{{i}}": Noul(f"Does the text mention item {{i}}?")}}) for i in range(requests)]
times = []
for r in range(warm + rounds):
    start = time.perf_counter()
    results = engine.run_many(asks)
    if r >= warm:
        times.append((time.perf_counter() - start) * 1000)
assert all(hasattr(x, "answers") for x in results), results[:1]
print(json.dumps({{"file": onepass.__file__, "tokens": results[0].input_tokens - results[0].packed_tokens,
                  "ms": times}}))
"""


def worktree(rev: str, where: Path) -> Path:
    """A folder whose ``onepass`` is the repository at ``rev`` (``HEAD``: the working tree as it is)."""
    where.mkdir(parents=True, exist_ok=True)
    pkg = where / "onepass"
    if rev == "HEAD":
        pkg.symlink_to(ROOT)
    else:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where / "tree"), rev],
                       check=True, capture_output=True)
        pkg.symlink_to(where / "tree")
    return where


def run(path: Path, args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(sentence=SENTENCE), args.engine, str(args.state_tokens),
                          str(args.requests), str(args.rounds), str(args.warmup)],
                         env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True,
                         timeout=1200)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    got = json.loads(out.stdout.splitlines()[-1])
    assert Path(got["file"]).resolve().parent == (path / "onepass").resolve(), got["file"]  # the version asked for
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--base", default="8f5a69c", help="the commit before the change")
    ap.add_argument("--state-tokens", type=int, default=4000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per process")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="processes per version, alternating")
    ap.add_argument("--out", default=str(RESULTS / "grouping"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"base": worktree(args.base, Path(tmp) / "base"), "head": worktree("HEAD", Path(tmp) / "head")}
        times: dict = {"base": [], "head": []}
        tokens = None
        try:
            for _ in range(args.repeats):
                for name, path in paths.items():
                    got = run(path, args)
                    times[name] += got["ms"]
                    tokens = got["tokens"]
                    print(f"{name}: median {statistics.median(got['ms']):.1f} ms", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(paths["base"] / "tree")],
                           capture_output=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    report = {"engine": args.engine, "state_tokens": tokens, "requests": args.requests, "base": args.base,
              "head": head, "rounds": len(times["head"]), "machine": platform.processor() or platform.machine(),
              **{f"{k}_ms": {"p50": statistics.median(v), "p10": sorted(v)[len(v) // 10],
                             "p90": sorted(v)[len(v) * 9 // 10]} for k, v in times.items()}}
    report["speedup_p50"] = report["base_ms"]["p50"] / report["head_ms"]["p50"]
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# {args.requests} requests about one state, merged: before and after grouping once", "",
             f"`python benchmarks/studies/grouping.py --engine {args.engine} --base {args.base}` (head {head}); "
             f"{report['state_tokens']}-token cached state, one yes/no question per request, `Engine.run_many`; "
             f"{report['rounds']} timed rounds per version over {args.repeats} alternating processes.", "",
             "| version | p10 ms | p50 ms | p90 ms |", "|---|---|---|---|"]
    for k in ("base", "head"):
        m = report[f"{k}_ms"]
        rev = args.base if k == "base" else head
        lines.append(f"| {k} ({rev}) | {m['p10']:.1f} | {m['p50']:.1f} | {m['p90']:.1f} |")
    lines += ["", f"Median ratio base / head: **{report['speedup_p50']:.2f}x**.", ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
