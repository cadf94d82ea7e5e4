"""Latency of onepass vs baselines on one workload, side by side in one run.

Workload: a support-ticket state of ~512 tokens and 13 questions (5 noul, 4 choice with 4
options, 4 score with 3 levels). After warm-up, each variant is timed for a number of
iterations (fixed seed, CPU, 2 threads everywhere); p50/p90/p99 and spread are reported:

  onepass_warm       state cached (prefilled earlier), one packed pass for the 13 questions
  onepass_cold       prefill of the state included (state cache disabled)
  onepass_13_calls   13 separate calls, each with a fresh state (prefill each time)
  hf_generate_json   transformers generate (greedy) of a JSON object answering the 13 questions
  hf_score_options   transformers scoring every option of every question, full forward each, no KV reuse

plus onepass warm latency vs number of questions (1, 4, 13, 64) and cold/warm vs state length
(64, 512, 2048). Writes benchmarks/results/latency.{json,md}.

    python benchmarks/latency.py --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from onepass import Choice, Engine, Noul, Score
from onepass.runtime.core.guarantee import cpu_model
from onepass.runtime.tools.loadgen import Run, closed_loop

RESULTS = Path(__file__).parent / "results"
THREADS = 2

TICKET = (
    "Subject: Charged twice, app crashes, and I want to cancel\n\n"
    "Hello support team,\n\n"
    "My name is Dana Whitfield and I have been a Pro customer for three years (account DW-88213). "
    "On March 3rd I noticed two charges of $29.00 on my credit card for the same monthly subscription. "
    "I only have one account and I never signed up for a second plan. I contacted you by email on March 4th "
    "and again on March 6th, and nobody has answered. I would like the duplicate charge refunded to my card.\n\n"
    "On top of that, since the update to version 5.2 last week the mobile app crashes every time I open the "
    "reports page. I reinstalled it twice and cleared the cache, but it still crashes on my Pixel 7 running "
    "Android 14. The desktop web version works, but it is very slow when I export data to CSV; an export of "
    "about 2,000 rows took more than ten minutes yesterday.\n\n"
    "I also tried to upgrade my colleague's account to the Team plan last month, but the checkout page kept "
    "showing an error and nobody from sales called back. Honestly I am running out of patience. I rely on your "
    "product for my small bakery's bookkeeping, and right now I cannot see my monthly reports, I have been "
    "billed twice, and nobody replies. If this is not fixed by Friday I will cancel my subscription and move "
    "to another provider, and I will tell the other shop owners in our association about this experience.\n\n"
    "Please confirm that you received this message, tell me when the refund will arrive, and let me know "
    "whether there is a workaround for the crash. I attached screenshots of both charges and of the error "
    "message in the app. You can reach me at this address or by phone in the afternoon.\n\n"
    "Thanks,\nDana\n\n"
    "Order history: Pro monthly (since 2023), add-on: extra storage 50 GB, payment method: Visa ending 4417. "
    "Previous tickets: one in 2024 about a password reset, solved the same day. Customer satisfaction survey "
    "last quarter: 4 out of 5. Region: EU, language: English. Device: Pixel 7, Android 14, app 5.2.0."
)

FOUR = {"billing": "payments, refunds, invoices", "technical": "bugs, crashes, performance",
        "sales": "plans, upgrades, new purchases", "account": "login, profile, cancellation"}
QUESTIONS = {
    "refund": Noul("Does the customer ask for a refund?"),
    "churn": Noul("Does the customer threaten to cancel?"),
    "crash": Noul("Does the customer report a crash?"),
    "repeat": Noul("Has the customer contacted support before about this?"),
    "legal": Noul("Does the customer threaten legal action?"),
    "team": Choice("Which team should handle this ticket first?", FOUR),
    "topic": Choice("What is the main topic of the ticket?", {"double charge": None, "app crash": None,
                                                              "slow export": None, "upgrade error": None}),
    "channel": Choice("How should we reply?", {"email": None, "phone": None, "chat": None, "no reply": None}),
    "segment": Choice("What kind of customer is this?", {"small business": None, "enterprise": None,
                                                         "student": None, "consumer": None}),
    "frustration": Score("How frustrated is the customer?", ["Calm", "Annoyed", "Very angry"]),
    "urgency": Score("How urgent is this ticket?", ["Can wait", "Soon", "Immediately"]),
    "clarity": Score("How clearly is the problem described?", ["Unclear", "Partly clear", "Very clear"]),
    "value": Score("How valuable is this customer?", ["Low", "Medium", "High"]),
}


def _short(summary: dict) -> dict:
    return {"n": summary["requests"], **{k: summary[k] for k in ("p50", "p90", "p99", "min", "max", "mean", "std")}}


def percentiles(samples: list[float]) -> dict:
    """p50/p90/p99, min, max, mean and stdev (ms) of samples in seconds, from the HdrHistogram `onepass bench`
    uses (runtime/tools/loadgen.py: one measurement core)."""
    run = Run("samples")
    for seconds in samples:
        run.record(seconds)
    return _short(run.summary())


def timed(fn, iters: int, warmup: int = 1) -> dict:
    """Run ``fn`` warm-up times untimed, then ``iters`` runs back to back through `onepass bench`'s closed loop
    (CPU: no device to synchronise)."""
    for _ in range(warmup):
        fn()
    return _short(closed_loop(lambda: (fn(), None)[1], concurrency=1, requests=iters).summary())  # no stages


def interleaved(runs: dict, rounds: int, progress=None) -> dict[str, list[float]]:
    """Seconds of each of ``runs`` ({name: callable}), called in turn round by round so that the machine's noise hits
    all alike; round 0 warms up and is not kept. ``progress(r)`` after each round."""
    times: dict = {name: [] for name in runs}
    for r in range(rounds + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if r:
                times[name].append(time.perf_counter() - start)
        if progress:
            progress(r)
    return times


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo)."""
    return cpu_model() or "cpu"


def state_of_tokens(engine: Engine, n: int) -> str:
    """A state whose segment is about ``n`` tokens: the ticket repeated and cut at a word boundary."""
    words = (TICKET + "\n\n") .split(" ") * (1 + n // 200)
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(engine.encoder.state(" ".join(words[:mid]))) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def many_questions(k: int) -> dict:
    """k distinct questions: the workload's 13, then numbered variants of them ("Check 14: ...").

    Identical questions would share every packed token (the trie), so each variant has its own wording.
    """
    items = list(QUESTIONS.items())
    out = {}
    for i in range(k):
        qid, q = items[i % len(items)]
        text = q.instructions if i < len(items) else f"Check {i + 1}: {q.instructions}"
        out[f"{qid}_{i}"] = type(q)(text, q.criteria) if hasattr(q, "criteria") else type(q)(text)
    return out


class HFBaselines:
    """Transformers (float32, eager) with the engine's own weights and tokenizer, on ``device`` (read from the
    engine directory: no model package or download needed)."""

    def __init__(self, engine: Engine, device: str = "cpu"):
        import torch
        from onepass.export.hf_from_engine import hf_model_from_engine

        torch.set_num_threads(THREADS)
        self.torch = torch
        self.device = device
        model, self.tok = hf_model_from_engine(engine.root, engine.manifest)
        self.model = model.to(device)
        self.model.generation_config.pad_token_id = self.tok.eos_token_id

    def prompt_json(self, state: str) -> str:
        lines = []
        for qid, q in QUESTIONS.items():
            if isinstance(q, Noul):
                allowed = '"yes" or "no"'
            elif isinstance(q, Choice):
                allowed = " or ".join(f'"{o}"' for o in q.criteria)
            else:
                allowed = " or ".join(f'"{o}"' for o in q.criteria)
            lines.append(f'- "{qid}": {q.instructions} Answer {allowed}.')
        msg = (f"Text:\n{state}\n\nAnswer each question about the text. Reply with one JSON object mapping each "
               "key to its answer and nothing else.\n" + "\n".join(lines))
        return self.tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                            add_generation_prompt=True)

    def generate_json(self, state: str, max_new_tokens: int, exactly: bool = False) -> int:
        """Greedy generation of the JSON answer (at most ``max_new_tokens``, or exactly that many with ``exactly``:
        the decode work of writing a given answer, whether or not the model stops earlier); returns the count."""
        ids = self.tok(self.prompt_json(state), return_tensors="pt", add_special_tokens=False).to(self.device)
        floor = {"min_new_tokens": max_new_tokens} if exactly else {}
        with self.torch.no_grad():
            out = self.model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens, **floor)
        return int(out.shape[1] - ids["input_ids"].shape[1])

    def answer_tokens(self, engine: Engine, state: str) -> int:
        """Tokens of the JSON answer onepass gives to the workload's questions on ``state`` (what a generating
        baseline must write to answer the same)."""
        answers = engine.ask(state, QUESTIONS)
        text = json.dumps({qid: _label(a) for qid, a in answers.items()})
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def score_options(self, engine: Engine, state: str) -> None:
        state_ids = engine.encoder.state(state)
        for q in engine.encode_questions(QUESTIONS):
            for option in q.options:
                seq = self.torch.tensor([list(state_ids) + list(q.trunk) + list(option)], device=self.device)
                with self.torch.no_grad():
                    logits = self.model(seq).logits[0]
                self.torch.log_softmax(logits[-len(option) - 1:-1], dim=-1).cpu()


def _label(answer) -> str:
    """An answer as the word a generating model would write: yes/no, the option, or the level's description."""
    from onepass.runtime.core.questions import ChoiceAnswer, NoulAnswer

    if isinstance(answer, NoulAnswer):
        return "yes" if answer.noul >= 0.5 else "no"
    if isinstance(answer, ChoiceAnswer):
        return answer.choice
    return answer.legend[str(max(answer.probabilities, key=lambda k: answer.probabilities[k]))]


def run(args) -> dict:
    engine = Engine.load(args.engine, threads=THREADS)
    nocache = Engine(engine.root, engine.manifest, engine.backend, cache_bytes=0)
    state_text = state_of_tokens(engine, 512)
    state = engine.state(state_text)
    enc = engine.encode_questions(QUESTIONS)
    engine.ask(state, QUESTIONS)  # priors of these questions are computed once and cached
    packed = engine.pack(state, enc).num_tokens
    res = {"workload": {"state_tokens": state.num_tokens, "questions": len(QUESTIONS), "packed_tokens": packed,
                        "readout": engine.manifest.scoring.readout}}
    it = args.iters
    print(f"state {state.num_tokens} tokens, 13 questions pack into {packed} tokens", flush=True)
    side = {}
    side["onepass_warm"] = timed(lambda: engine.ask(state, QUESTIONS), it)
    side["onepass_cold"] = timed(lambda: nocache.ask(state_text, QUESTIONS), max(3, it // 2))
    side["onepass_13_calls"] = timed(lambda: [nocache.ask(state_text, {k: q}) for k, q in QUESTIONS.items()],
                                     max(3, it // 6))
    if not args.skip_hf:
        hf = HFBaselines(engine)
        generated = []
        side["hf_generate_json"] = timed(lambda: generated.append(hf.generate_json(state_text, args.max_new_tokens)),
                                         args.hf_iters)
        side["hf_generate_json"]["new_tokens"] = generated[-1]
        side["hf_score_options"] = timed(lambda: hf.score_options(engine, state_text), args.hf_iters)
    for name, r in side.items():
        print(f"{name:18s} p50 {r['p50']:9.1f} ms  p90 {r['p90']:9.1f}  p99 {r['p99']:9.1f}", flush=True)
    res["side_by_side"] = side
    warm = side["onepass_warm"]["p50"]
    ratios = {"packed_vs_13_calls": side["onepass_13_calls"]["p50"] / warm}
    if "hf_generate_json" in side:
        ratios["warm_vs_hf_generate_json"] = side["hf_generate_json"]["p50"] / warm
        ratios["cold_vs_hf_generate_json"] = side["hf_generate_json"]["p50"] / side["onepass_cold"]["p50"]
        ratios["warm_vs_hf_score_options"] = side["hf_score_options"]["p50"] / warm
    res["speedups_p50"] = ratios
    res["vs_questions"] = {}
    for k in (1, 4, 13, 64):
        qs = many_questions(k)
        engine.ask(state, qs)
        r = timed(lambda: engine.ask(state, qs), max(3, it // 2))
        r["packed_tokens"] = engine.pack(state, engine.encode_questions(qs)).num_tokens
        res["vs_questions"][k] = r
        print(f"questions {k:3d}: warm p50 {r['p50']:8.1f} ms ({r['packed_tokens']} packed tokens)", flush=True)
    res["vs_state_tokens"] = {}
    for n in (64, 512, 2048):
        text = state_of_tokens(engine, n)
        s = engine.state(text)
        cold = timed(lambda: nocache.ask(text, QUESTIONS), 3)
        warm_n = timed(lambda: engine.ask(s, QUESTIONS), max(3, it // 2))
        res["vs_state_tokens"][n] = {"state_tokens": s.num_tokens, "cold": cold, "warm": warm_n}
        print(f"state {s.num_tokens:5d}: cold p50 {cold['p50']:8.1f} ms  warm p50 {warm_n['p50']:8.1f} ms", flush=True)
    return res


def markdown(res: dict) -> str:
    w = res["workload"]
    lines = [f"# Latency on {res['machine']['cpu']} ({THREADS} threads)", "",
             f"Workload: state {w['state_tokens']} tokens, {w['questions']} questions packed into "
             f"{w['packed_tokens']} tokens, read-out `{w['readout']}`. Times in ms after warm-up.", "",
             "| variant | p50 | p90 | p99 | min | max | n |", "|---|---|---|---|---|---|---|"]
    for name, r in res["side_by_side"].items():
        lines.append(f"| {name} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p99']:.1f} | {r['min']:.1f} | {r['max']:.1f} "
                     f"| {r['n']} |")
    lines += ["", "Speed-ups (ratio of p50s, same run):", ""]
    lines += [f"- {k}: **{v:.1f}x**" for k, v in res["speedups_p50"].items()]
    lines += ["", "## Warm latency vs number of questions", "", "| questions | packed tokens | p50 | p90 | p99 |",
              "|---|---|---|---|---|"]
    for k, r in res["vs_questions"].items():
        lines.append(f"| {k} | {r['packed_tokens']} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p99']:.1f} |")
    lines += ["", "## 13 questions vs state length", "", "| state tokens | cold p50 | cold p90 | warm p50 | warm p90 |",
              "|---|---|---|---|---|"]
    for r in res["vs_state_tokens"].values():
        lines.append(f"| {r['state_tokens']} | {r['cold']['p50']:.1f} | {r['cold']['p90']:.1f} | {r['warm']['p50']:.1f} "
                     f"| {r['warm']['p90']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--hf-iters", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "latency"))
    args = ap.parse_args()
    import onnxruntime

    res = run(args)
    res["machine"] = {"cpu": cpu_name(), "platform": platform.platform(), "python": platform.python_version(),
                      "onnxruntime": onnxruntime.__version__, "threads": THREADS}
    res["engine"] = {"name": res.get("engine_name"), "graph_sha256": json.loads(
        (Path(args.engine) / "manifest.json").read_text())["files"]["decoder.onnx.data"]}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
