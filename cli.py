"""The ``onepass`` command: export an engine, ask questions about a state.

Errors print one line (``error: ...``) and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .runtime.backends import BACKENDS
from .runtime.errors import OnepassError
from .runtime.plan import DEVICES


# what each command needs beyond the runtime: a missing import is one line naming the extra to install
EXTRAS = {"serve": "serve", "mcp": "serve", "cluster": "cluster", "calibrate": "calibrate", "eval": "calibrate",
          "tune": "export,calibrate", "distill": "export,calibrate,serve", "export": "export", "quantize": "export", "build-trt": "trt-build"}


def _limits(args) -> dict:
    keys = ("max_state_tokens", "max_packed_tokens", "max_questions", "max_options", "max_request_tokens")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cmd_ask(args) -> int:
    """Answer a TypeSafe request and print the response JSON (stdout: the JSON alone; the backend on stderr)."""
    from .runtime.engine import Engine
    from .runtime.request_files import request_body

    body = request_body(args.questions, args.state, args.json_state)
    engine = Engine.load(args.engine, threads=args.threads, backend=args.backend)
    response = engine.request(body)
    print(f"answered on {engine.backend.name}", file=sys.stderr)
    print(json.dumps(response, indent=2, ensure_ascii=False))
    return 0


def cmd_bench(args) -> int:
    """Latency percentiles of an engine in process (per backend) or of a server over HTTP, open or closed loop."""
    from .runtime.bench import bench
    from .runtime.request_files import request_body, states

    body = request_body(args.questions, args.state, args.json_state)
    report = bench(body, states(args.states, body), engine=args.engine, url=args.url, backends=args.backend,
                   threads=args.threads, api_key=args.api_key, model=args.model, kinds=args.kind, rates=args.rate,
                   concurrencies=args.concurrency, duration=args.duration, warmup=args.warmup, seed=args.seed,
                   cold_fraction=args.cold_fraction, requests=args.requests, compare_with=args.compare,
                   force=args.force, report_dir=args.report)
    return 130 if report["interrupted"] and not args.report else 0


def cmd_check(args) -> int:
    """Verify an engine's files (sha256) and run its golden file through the graph."""
    from .runtime.engine import Engine
    from .runtime.selfcheck import report_lines

    engine = Engine.load(args.engine, threads=args.threads, backend=args.backend)
    print("\n".join(report_lines(engine) + [f"ok: {args.engine} verified on {engine.backend.name}"]))
    return 0


def _server_config(args):
    """The HTTP settings `onepass serve` and `onepass cluster` share, ONEPASS_API_KEY as the key's default."""
    from .runtime.server.config import ServerConfig

    return ServerConfig.from_env(host=args.host, port=args.port, api_key=args.api_key,
                                 max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                                 batch_window_ms=args.batch_window_ms, request_timeout_s=args.request_timeout,
                                 docs=getattr(args, "docs", None))


def cmd_serve(args) -> int:
    """Run the TypeSafe System One HTTP server."""
    from .runtime.server.run import serve
    from .runtime.server.transport import TransportLimits
    exporter = None
    if args.export_if_missing:
        from .export.build import export_engine as exporter
    transport = TransportLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                keep_alive_s=args.keep_alive, max_header_bytes=args.max_header_bytes,
                                max_connections=args.max_connections)
    limits = {k: v for k, v in _limits(args).items() if k != "max_request_tokens"}
    teacher = None if args.teacher is None else {
        "url": args.teacher, "shadow_rate": args.shadow_rate, "record": args.record,
        "record_max_mib": args.record_max_mib, **_teacher_client(args)}
    serve(args.engine, _server_config(args), transport, backend=args.backend, threads=args.threads,
          cache_mib=args.cache_mib, limits=limits, max_request_tokens=args.max_request_tokens, cascade=args.cascade,
          min_confidence=args.min_confidence, exporter=exporter, build_trt_if_missing=args.build_trt_if_missing,
          teacher=teacher)
    return 0


def cmd_distill(args) -> int:
    """Label unlabelled states with a teacher, tune on its answers, write the engine with its gate."""
    from .calibration.distill import distill, summary_lines
    from .calibration.tune import TuneConfig
    from .runtime.teacher import connect

    config = TuneConfig(rank=args.rank, lr=args.lr, epochs=args.epochs, max_minutes=args.max_minutes,
                        max_steps=args.max_steps, seed=args.seed)
    with connect(args.teacher, **_teacher_client(args)) as teacher:
        report = distill(args.engine, teacher, args.states, args.questions, args.out,
                         target_agreement=args.target_agreement, holdout=args.holdout, config=config,
                         concurrency=args.teacher_concurrency, resume=args.resume, name=args.name)
    print("\n".join(summary_lines(report, args.out)))
    return 0


def _teacher_client(args) -> dict:
    """The teacher client's settings `serve` and `distill` share; ONEPASS_TEACHER_KEY as the key's default."""
    import os

    return {"kind": args.teacher_kind, "api_key": args.teacher_key or os.environ.get("ONEPASS_TEACHER_KEY") or None,
            "model": args.teacher_model, "timeout_s": args.teacher_timeout,
            "max_concurrency": args.teacher_concurrency}


def cmd_cluster(args) -> int:
    """Serve the same HTTP API from replicas on Ray Serve, requests about one state kept on one replica."""
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from .runtime.server import cluster
    cluster.run(args.engine, _server_config(args), replicas=args.replicas, autoscale=args.autoscale,
                routing=args.routing, address=args.address, num_cpus=args.num_cpus,
                cpus_per_replica=args.cpus_per_replica, threads=args.threads, cache_mib=args.cache_mib,
                retries=args.retries)
    return 0


def cmd_mcp(args) -> int:
    """Run the MCP tool server on stdio."""
    from .runtime.server.mcp_tools import serve_stdio
    from .runtime.engine import Engine

    serve_stdio(Engine.load(args.engine, threads=args.threads, backend=args.backend))
    return 0


def cmd_calibrate(args) -> int:
    """Fit calibration on labelled rows and store it in the engine manifest."""
    from .calibration.run import calibrate, summary
    report = calibrate(args.engine, args.data, holdout=args.holdout, seed=args.seed, report_dir=args.report)
    print("\n".join(summary(report, args.engine, args.report)))
    return 0


def cmd_eval(args) -> int:
    """Accuracy vs majority, NLL, Brier, ECE, coverage and confusion of an engine on labelled rows."""
    from .calibration.evaluate import evaluate_engine, summary, write
    report = evaluate_engine(args.engine, args.data, args.min_confidence, args.target_accuracy, args.threads)
    if args.compare:
        report["compare"] = evaluate_engine(args.compare, args.data, args.min_confidence, args.target_accuracy,
                                            args.threads)
    print("\n".join(summary(report)))
    if args.report:
        write(report, Path(args.report))
        print(f"report written to {args.report}")
    return 0


def cmd_tune(args) -> int:
    """Fine-tune an engine's decoder on labelled rows and export the tuned engine."""
    from .calibration.tune import TuneConfig
    from .calibration.tune_engine import summary_lines, tune
    config = TuneConfig(method=args.method, rank=args.rank, train_blocks=args.train_blocks, lr=args.lr,
                        epochs=args.epochs, max_minutes=args.max_minutes, max_steps=args.max_steps,
                        batch_questions=args.batch_questions, rlcd_weight=args.rlcd_weight, holdout=args.holdout,
                        seed=args.seed, max_state_tokens=args.max_state_tokens, eval_every=args.eval_every,
                        patience=args.patience, keep_base=args.keep_base)
    report_dir = args.report or f"{args.out}-report"
    summary = tune(args.engine, args.data, args.out, config, resume=args.resume, report_dir=report_dir,
                   name=args.name, validation=args.validation)
    print("\n".join(summary_lines(summary, args.out, report_dir)))
    return 0


def cmd_plan(args) -> int:
    """Print the memory budget and latency floor of an engine on a device."""
    from .runtime.plan import plan, render

    result = plan(args.engine, args.device, args.precision, args.state_tokens, args.packed_tokens)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def cmd_build_trt(args) -> int:
    """Build TensorRT plans (one per compute capability) into the engine directory and record them."""
    from .runtime.backends.tensorrt_build import build_plans

    records = build_plans(Path(args.engine), args.arch, precision=args.precision, flavour=args.flavour,
                          device=args.device)
    print(f"recorded {len(records)} plan(s) in {Path(args.engine) / 'manifest.json'}")
    return 0


def cmd_quantize(args) -> int:
    """Build an INT8 engine that keeps its answers on labelled rows, or refuse."""
    from .calibration.quantize import quantize_engine
    r = quantize_engine(args.engine, args.out, args.data, min_agreement=args.min_agreement, max_error=args.max_error)
    print(f"INT8 engine written to {args.out}: agreement {r['agreement']:.1%} on {r['rows']} rows, "
          f"max log-prob error {r['max_logprob_error']:.3f}, {r['speedup']:.2f}x")
    return 0


def cmd_export(args) -> int:
    """Compile a model into an engine directory."""
    from .export.build import export_from_options
    export_from_options(args.out, args.model, name=args.name, limits=_limits(args), readout=args.readout,
                        precision=args.precision, adapter=args.adapter, head=args.head)
    return 0


THREADS = "inference threads (the backend's intra-op threads; default: its own choice)"


def _engine(p, backend: str | None = "auto", help: str = "engine directory") -> None:
    """--engine, --threads and (unless None) --backend: what every command that loads an engine takes."""
    p.add_argument("--engine", required=True, help=help)
    p.add_argument("--threads", type=int, default=None, help=THREADS)
    if backend is not None:
        p.add_argument("--backend", choices=("auto", *BACKENDS), default=backend,
                       help="auto: OpenVINO's CPU plugin where it reproduces the golden file here, else ONNX Runtime")


def _http(p) -> None:
    """The HTTP settings serve and cluster share."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or ONEPASS_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests (per replica) before answering 429")
    p.add_argument("--request-timeout", type=float, default=10.0, help="seconds, unless it sends X-Request-Timeout")
    p.add_argument("--batch-window-ms", type=float, default=2.0, help="requests about one state within it share a pass")
    p.add_argument("--cache-mib", type=int, default=512, help="state cache size in MiB (per replica)")


def _teacher(p, required: bool) -> None:
    p.add_argument("--teacher", required=required, default=None, metavar="URL",
                   help="the teacher's base URL (a System One server, or an OpenAI-compatible one)")
    p.add_argument("--teacher-kind", choices=("systemone", "openai"), default="systemone")
    p.add_argument("--teacher-key", default=None, help="the teacher's API key (default: $ONEPASS_TEACHER_KEY)")
    p.add_argument("--teacher-model", default=None, help="the model named in teacher requests")
    p.add_argument("--teacher-timeout", type=float, default=10.0, help="seconds per teacher call attempt")
    p.add_argument("--teacher-concurrency", type=int, default=4, help="teacher calls in flight at once")


def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from . import __version__

    p = argparse.ArgumentParser(prog="onepass", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"onepass {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="compile a model into an engine directory")
    ex.add_argument("--out", required=True, help="engine directory to write")
    ex.add_argument("--model", help="a .gguf file or a local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    ex.add_argument("--name", help="engine name (default: from the model)")
    for flag, default, what in (("state", None, "state tokens (default: the context window minus 1024)"),
                                ("packed", 4096, "tokens of one packed pass"), ("request", 262144, "packed tokens "
                                "over all passes of one request")):
        ex.add_argument(f"--max-{flag}-tokens", type=int, default=default, help=what)
    ex.add_argument("--max-questions", type=int, default=5000)
    ex.add_argument("--max-options", type=int, default=1000)
    ex.add_argument("--readout", choices=["sum", "mean", "prior"], default=None,
                    help="option log-likelihoods to probabilities (default: the adapter's, else mean)")
    ex.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                    help="of the block weights and GEMMs (the rest stays fp32); bf16: TensorRT or PyTorch only")
    ex.add_argument("--adapter", default="default", help="LoRA merged into the weights: 'default' (shipped for the "
                                                          "default model), 'none', or a folder from `onepass tune`")
    ex.add_argument("--head", help="a decision head (.pt, benchmarks/decision_head.py) exported into the graph")
    ex.set_defaults(func=cmd_export)
    ask = sub.add_parser("ask", help="answer questions about a state; prints the TypeSafe response JSON")
    _engine(ask)
    ask.add_argument("--state", help="file with the state text ('-' for stdin); or give state inside --questions")
    ask.add_argument("--json-state", action="store_true", help="the state file holds JSON (serialised canonically)")
    ask.add_argument("--questions", required=True, help="JSON: {id: {type, instructions, criteria}} or a full request")
    ask.set_defaults(func=cmd_ask)
    bench = sub.add_parser("bench", help="latency percentiles of an engine (in process) or a server (HTTP)")
    where = bench.add_mutually_exclusive_group(required=True)
    where.add_argument("--engine", help="engine directory (in-process)")
    where.add_argument("--url", help="a TypeSafe System One server, e.g. http://127.0.0.1:8000")
    bench.add_argument("--state", help="file with the state text")
    bench.add_argument("--states", help="a directory of state files: each request takes one at random (seeded)")
    bench.add_argument("--json-state", action="store_true", help="the state file holds JSON")
    bench.add_argument("--questions", required=True, help="JSON questions or a full request")
    bench.add_argument("--backend", choices=BACKENDS, nargs="+", help="in process: backends side by side (default all)")
    bench.add_argument("--kind", choices=("warm", "cold", "prefill"), nargs="+", help="cached state, fresh state, "
                       "prefill alone (default: all three in process, warm over HTTP)")
    bench.add_argument("--cold-fraction", type=float, default=0.0, help="share of fresh states in warm runs, 0..1")
    bench.add_argument("--requests", type=int, default=None, help="requests per run instead of --duration")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--model", default="jev-latest", help="model name sent over HTTP")
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--rate", type=float, nargs="*", help="open loop: requests/s (Poisson arrivals), one run each")
    bench.add_argument("--concurrency", type=int, nargs="*", help="closed loop: senders, one run each (default 1)")
    bench.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    bench.add_argument("--warmup", type=int, default=3, help="requests before measuring")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--report", help="directory for bench.json, bench.md, latency_cdf.png and throughput_p99.png")
    bench.add_argument("--compare", help="an earlier bench.json: print new/old per percentile for the same runs")
    bench.add_argument("--force", action="store_true", help="compare even when the workload or machine differ")
    bench.set_defaults(func=cmd_bench)
    check = sub.add_parser("check", help="verify an engine's files and its graph against the golden file")
    _engine(check, backend="onnxruntime")  # the reference; bf16 engines: tensorrt or torch-*
    check.set_defaults(func=cmd_check)
    cal = sub.add_parser("calibrate", help="fit temperature/bias on labelled JSONL into the engine manifest")
    cal.add_argument("--engine", required=True, help="engine directory (its manifest is updated)")
    cal.add_argument("--data", required=True, help="JSONL rows: {state, question, label}")
    cal.add_argument("--holdout", type=float, default=0.3, help="rows kept out of the fit; a group needs 20 to fit")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--report", default=None, help="folder for report.json/.md, reliability.png, coverage.png")
    cal.set_defaults(func=cmd_calibrate)
    ev = sub.add_parser("eval", help="how good an engine is on labelled JSONL rows (accuracy, NLL, ECE, coverage)")
    _engine(ev, backend=None)
    ev.add_argument("--data", required=True, help="JSONL rows: {state, question, label}")
    ev.add_argument("--min-confidence", type=float, default=None, help="report coverage and accuracy above it")
    ev.add_argument("--target-accuracy", type=float, default=None, help="find the confidence that reaches it")
    ev.add_argument("--compare", default=None, metavar="DIR2", help="a second engine, side by side on the same rows")
    ev.add_argument("--report", default=None, help="folder for eval.json/.md and plots")
    ev.set_defaults(func=cmd_eval)
    tn = sub.add_parser("tune", help="fine-tune the decoder on labelled rows; writes a tuned engine")
    tn.add_argument("--engine", required=True, help="the base engine directory")
    tn.add_argument("--data", required=True, nargs="+", help="JSONL rows: state, question, label (or probabilities)")
    tn.add_argument("--out", required=True, help="tuned engine directory to write (only when the run succeeds)")
    tn.add_argument("--method", choices=["lora", "full", "head"], default="lora",
                    help="LoRA adapters merged on export, every weight, or a decision head over the frozen decoder")
    tn.add_argument("--rank", type=int, default=16, help="LoRA rank")
    tn.add_argument("--train-blocks", type=int, default=None, help="train only the top N decoder blocks (default all)")
    tn.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-4 LoRA, 2e-5 full)")
    tn.add_argument("--epochs", type=int, default=3)
    tn.add_argument("--max-minutes", type=float, default=None, help="stop after this long, keeping the best weights")
    tn.add_argument("--keep-base", action="store_true", help="write an engine even if tuning never beats the base")
    tn.add_argument("--max-steps", type=int, default=None, help="stop after this many optimiser steps")
    tn.add_argument("--batch-questions", type=int, default=8, help="questions per optimiser step")
    tn.add_argument("--rlcd-weight", type=float, default=0.5, help="weight of the RLCD term (0: cross-entropy only)")
    tn.add_argument("--holdout", type=float, default=0.2, help="share of states held out (early stopping, report)")
    tn.add_argument("--validation", nargs="+", default=None, help="held-out JSONL rows instead of a --holdout split")
    tn.add_argument("--eval-every", type=int, default=None, help="optimiser steps between held-out evaluations")
    tn.add_argument("--patience", type=int, default=2, help="held-out evaluations without improvement, then stop")
    tn.add_argument("--max-state-tokens", type=int, default=1024, help="longer states are refused")
    tn.add_argument("--seed", type=int, default=0)
    tn.add_argument("--resume", action="store_true", help="continue from the checkpoint in <out>.tune/")
    tn.add_argument("--report", help="report directory (default: <out>-report)")
    tn.add_argument("--name", help="tuned engine name (default: <base name>-tuned)")
    tn.set_defaults(func=cmd_tune)
    pl = sub.add_parser("plan", help="memory budget and latency floor on a device (assumptions stated)")
    pl.add_argument("--engine", required=True, help="engine directory")
    pl.add_argument("--device", required=True, choices=["orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb", "h200"])
    pl.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16", "int8", "fp8"])
    pl.add_argument("--state-tokens", type=int, default=512)
    pl.add_argument("--packed-tokens", type=int, default=512)
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(func=cmd_plan)
    trt = sub.add_parser("build-trt", help="build TensorRT plans from the engine's ONNX graph (ahead of time)")
    trt.add_argument("--engine", required=True, help="engine directory (plans are added and recorded)")
    trt.add_argument("--arch", nargs="+", default=["sm80", "sm86", "sm89"], help="sm75..sm121, or native: this GPU")
    trt.add_argument("--precision", default=None, choices=["fp32", "fp16", "bf16", "fp8", "int8"],
                     help="(default: the graph's)")
    trt.add_argument("--device", default=None, choices=sorted(DEVICES), help="the builder's workspace budget")
    trt.add_argument("--flavour", choices=["tensorrt", "tensorrt_rtx"], default=None, help="default: tensorrt if any")
    trt.set_defaults(func=cmd_build_trt)
    qz = sub.add_parser("quantize", help="INT8 engine that must keep its answers on labelled rows (else refused)")
    qz.add_argument("--engine", required=True, help="fp32 engine directory")
    qz.add_argument("--out", required=True, help="INT8 engine directory to write")
    qz.add_argument("--data", required=True, help="JSONL rows {state, question, label} to measure agreement on")
    qz.add_argument("--min-agreement", type=float, default=0.99)
    qz.add_argument("--max-error", type=float, default=0.1, help="largest allowed option log-prob error")
    qz.set_defaults(func=cmd_quantize)
    ds = sub.add_parser("distill", help="learn a task from a teacher model's answers on unlabelled states")
    ds.add_argument("--engine", required=True, help="the engine to start from (the student)")
    _teacher(ds, required=True)
    ds.add_argument("--states", required=True, help="JSONL: one state per line (a JSON string or {\"state\": ...})")
    ds.add_argument("--questions", required=True, help="JSON: the questions by id, asked about every state")
    ds.add_argument("--out", required=True, help="the student engine directory to write (with its gate)")
    ds.add_argument("--target-agreement", type=float, default=0.95,
                    help="the gate: answer locally where the student agrees with the teacher this often")
    ds.add_argument("--holdout", type=float, default=0.2, help="share of states held out (early stopping, gate)")
    ds.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ds.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-4)")
    ds.add_argument("--epochs", type=int, default=3)
    ds.add_argument("--max-minutes", type=float, default=None, help="tuning budget, keeping the best weights")
    ds.add_argument("--max-steps", type=int, default=None, help="stop after this many optimiser steps")
    ds.add_argument("--seed", type=int, default=0)
    ds.add_argument("--resume", action="store_true", help="continue tuning from the checkpoint in <out>.tune/")
    ds.add_argument("--name", help="the student's name (default: <engine name>-distilled)")
    ds.set_defaults(func=cmd_distill)
    serve = sub.add_parser("serve", help="serve the TypeSafe System One HTTP API")
    _engine(serve)
    _http(serve)
    for flag, what in (("state-tokens", "state limit"), ("packed-tokens", "packed-token limit"),
                       ("questions", "questions per request"), ("options", "options per choice")):
        serve.add_argument(f"--max-{flag}", type=int, default=None, help=f"lower the engine's {what}")
    serve.add_argument("--max-request-tokens", type=int, default=None, help="packed tokens per request")
    serve.add_argument("--build-trt-if-missing", action="store_true", help="build this GPU's plan first if missing")
    serve.add_argument("--export-if-missing", action="store_true", help="export the default model first if missing")
    serve.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send the headers, else 408")
    serve.add_argument("--body-timeout", type=float, default=30.0, help="seconds to send the body, else 408")
    serve.add_argument("--keep-alive", type=int, default=5, help="seconds an idle keep-alive connection is kept")
    serve.add_argument("--max-header-bytes", type=int, default=16384, help="larger request heads get 431")
    serve.add_argument("--max-connections", type=int, default=None, help="at once, 503 beyond (default 1000)")
    serve.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    serve.add_argument("--cascade", default=None, help="an engine that answers again below --min-confidence")
    serve.add_argument("--min-confidence", type=float, default=None,
                       help="the threshold (0..1) below which the --cascade engine or the --teacher answers")
    _teacher(serve, required=False)
    serve.add_argument("--shadow-rate", type=float, default=0.0,
                       help="share of requests also asked of the teacher in the background (0..1)")
    serve.add_argument("--record", default=None, metavar="DIR",
                       help="write the teacher's answers as tune rows to rotating JSONL files in DIR (off by default)")
    serve.add_argument("--record-max-mib", type=int, default=1024, help="the records' cap; the oldest files go first")
    serve.set_defaults(func=cmd_serve)
    cl = sub.add_parser("cluster", help="serve the same HTTP API from replicas on Ray Serve, routed by state")
    cl.add_argument("--engine", required=True, help="engine directory (every replica loads it)")
    cl.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    cl.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                    help="let Serve's autoscaler keep MIN..MAX replicas instead of a fixed --replicas")
    cl.add_argument("--routing", choices=("state", "default"), default="state",
                    help="state: requests about one state go to one replica (its cached K/V); default: Serve's own")
    _http(cl)
    cl.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto); default: start one here")
    cl.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the Ray cluster started here")
    cl.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs reserved per replica")
    cl.add_argument("--threads", type=int, default=1, help=THREADS)
    cl.add_argument("--retries", type=int, default=1, help="retries of a request whose replica died")
    cl.set_defaults(func=cmd_cluster)
    mcp = sub.add_parser("mcp", help="serve noul/choice/score as MCP tools on stdio")
    _engine(mcp)
    mcp.set_defaults(func=cmd_mcp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``onepass`` command."""
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except OnepassError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # limits and other validated settings
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an extra not installed
        extra = EXTRAS.get(args.command)
        if extra is None:
            raise
        torch = "pip install torch==2.13.0 && " if "export" in extra else ""
        print(f"error: onepass {args.command} needs the [{extra}] extra ({err.name} is missing): {torch}pip install "
              f"'onepass[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (writers clean up after themselves)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
