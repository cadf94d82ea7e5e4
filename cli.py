"""The ``onepass`` command: export an engine, ask questions about a state.

Errors print one line (``error: ...``) and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .runtime.backends import BACKENDS
from .runtime.errors import OnepassError


def _read_text(path: str, what: str) -> str:
    raw = sys.stdin.buffer.read() if path == "-" else _read_bytes(path, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise OnepassError(f"{what} {path} is not valid UTF-8 (byte {err.start}); save it as UTF-8") from None


def _read_bytes(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise OnepassError(f"cannot read {what} {path}: {err.strerror}") from None


def _request(args) -> dict:
    try:
        questions = json.loads(_read_text(args.questions, "questions file"))
    except json.JSONDecodeError as err:
        raise OnepassError(f"questions file {args.questions} is not valid JSON: {err}") from None
    body = questions if isinstance(questions, dict) and "questions" in questions else {"questions": questions}
    if args.state is not None:
        text = _read_text(args.state, "state file")
        if args.json_state:
            try:
                text = json.loads(text)
            except json.JSONDecodeError as err:
                raise OnepassError(f"state file {args.state} is not valid JSON: {err}") from None
        body = {**body, "state": text}
    return body


def cmd_ask(args) -> int:
    """Answer a TypeSafe request and print the response JSON."""
    from .runtime.engine import Engine

    body = _request(args)
    engine = Engine.load(args.engine, threads=args.threads, backend=args.backend)
    response = engine.request(body)
    print(f"answered on {engine.backend.name}", file=sys.stderr)  # stdout stays the response JSON alone
    print(json.dumps(response, indent=2, ensure_ascii=False))
    return 0


def cmd_bench(args) -> int:
    """Latency percentiles of an engine in process (per backend) or of a server over HTTP, open or closed loop."""
    from .runtime import bench

    body = _request(args)
    states = _states(args, body)
    body = {k: v for k, v in body.items() if k != "state"}
    rates, concurrencies = args.rate or [], args.concurrency or ([] if args.rate else [1])
    bench.check_loads(rates, concurrencies, args.duration, args.cold_fraction, args.requests)
    old = None
    if args.compare:
        try:
            old = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise OnepassError(f"--compare {args.compare}: not a readable bench.json ({err})") from None
    skipped = {}
    if args.engine:
        backends = args.backend or list(BACKENDS)
        targets, skipped = bench.engine_targets(args.engine, backends, args.threads, body, states,
                                                args.cold_fraction, args.seed)
        for name, why in skipped.items():
            print(f"{name}: skipped ({why})")
        if not targets:
            raise OnepassError(f"no backend could load {args.engine}: " + "; ".join(f"{k}: {v}" for k, v in
                                                                                   skipped.items()))
        kinds = args.kind or ["warm", "cold", "prefill"]
    else:
        targets = [bench.url_target(args.url, args.api_key, args.model, body, states, args.cold_fraction, args.seed)]
        kinds = args.kind or ["warm"]
    report = bench.run_bench(targets, kinds, rates, concurrencies, args.duration, args.warmup, args.seed, body,
                             states, args.cold_fraction, skipped=skipped, old=old, force=args.force,
                             report_dir=args.report, requests=args.requests)
    return 130 if report["interrupted"] and not args.report else 0


def _states(args, body: dict) -> list:
    """The workload's states: --states DIR (one state per file, sorted by name), else the request's one state."""
    if args.states is None:
        if "state" not in body:
            raise OnepassError("give the state: --state FILE, --states DIR, or a full request in --questions")
        return [body["state"]]
    folder = Path(args.states)
    if not folder.is_dir():
        raise OnepassError(f"--states {args.states} is not a directory of state files")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise OnepassError(f"--states {args.states} holds no state file")
    return [_read_text(str(p), "state file") for p in files]


def cmd_check(args) -> int:
    """Verify an engine's files (sha256) and run its golden file through the graph."""
    from .runtime.engine import Engine
    from .runtime.selfcheck import check_golden, tolerances

    engine = Engine.load(args.engine, threads=args.threads, backend=args.backend)
    diffs = check_golden(engine)
    tol = tolerances(engine)
    for name, diff in diffs.items():
        print(f"{name:20s} max |diff| {diff:.2e}  (tolerance {tol[name]:.0e})")
    print(f"ok: {args.engine} verified on {engine.backend.name}")
    return 0


def _serve_extra(err: ImportError) -> OnepassError:
    return OnepassError(f"serving needs the [serve] extra ({err.name} is missing): pip install 'onepass[serve]'")


def _server_config(args):
    """The HTTP settings `onepass serve` and `onepass cluster` share, ONEPASS_API_KEY as the key's default."""
    try:
        from .runtime.server.config import ServerConfig
    except ImportError as err:
        raise _serve_extra(err) from None
    return ServerConfig.from_env(host=args.host, port=args.port, api_key=args.api_key,
                                 max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                                 batch_window_ms=args.batch_window_ms, request_timeout_s=args.request_timeout,
                                 docs=getattr(args, "docs", None))


def _transport(args):
    """The connection limits of `onepass serve` (header and body read timeouts, keep-alive, header size, cap)."""
    from .runtime.server.transport import TransportLimits

    try:
        return TransportLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                               keep_alive_s=args.keep_alive, max_header_bytes=args.max_header_bytes,
                               max_connections=args.max_connections)
    except ValueError as err:
        raise OnepassError(str(err)) from None


def cmd_serve(args) -> int:
    """Run the TypeSafe System One HTTP server."""
    try:
        import uvicorn

        from .runtime.server.app import create_app, server_engine
    except ImportError as err:
        raise _serve_extra(err) from None
    from .runtime.engine import Engine

    config = _server_config(args)
    if (args.cascade is None) != (args.min_confidence is None):  # refused before any export or engine load
        raise OnepassError("--cascade DIR and --min-confidence go together: questions answered below the "
                           "confidence are asked again of the cascade engine")
    from .runtime.server.transport import listen

    sock = listen(config.host, config.port)  # a taken port: one line, before any engine is loaded
    if args.export_if_missing and not (Path(args.engine) / "manifest.json").exists():
        try:
            from .export.build import export_engine
        except ImportError as err:
            raise OnepassError(f"--export-if-missing needs the export dependencies ({err.name} is missing)") from None
        export_engine(args.engine)  # first start on this device: the default model, cached in the volume
    if args.build_trt_if_missing and args.backend == "tensorrt":  # the images' default; moot for other backends
        from .runtime.backends.tensorrt_build import build_native_plan_if_missing

        build_native_plan_if_missing(Path(args.engine))
    engine = Engine.load(args.engine, threads=args.threads, cache_bytes=args.cache_mib << 20,
                         backend=args.backend)
    engine = engine.with_limits(max_state_tokens=args.max_state_tokens, max_packed_tokens=args.max_packed_tokens,
                                max_questions=args.max_questions, max_options=args.max_options)
    engine = server_engine(engine, args.max_request_tokens)
    cascade = Engine.load(args.cascade, threads=args.threads) if args.cascade else None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onepass.serve").info("serving %s on the %s backend", engine.name, engine.backend.name)
    app = create_app(engine, config, cascade=cascade, min_confidence=args.min_confidence)
    server = uvicorn.Server(uvicorn.Config(app, access_log=False, log_level="info", **_transport(args).uvicorn_options()))
    server.run(sockets=[sock])
    return 0


def _autoscale(text: str | None) -> tuple | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()):
        raise OnepassError(f"--autoscale must be MIN:MAX replicas (e.g. 1:4), got {text!r}")
    return int(low), int(high)


def cmd_cluster(args) -> int:
    """Serve the same HTTP API from replicas on Ray Serve, requests about one state kept on one replica."""
    import dataclasses
    import os
    import shutil
    import tempfile
    import threading

    from .runtime.interrupt import stop_signals_set

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        from .runtime.server.cluster import serve_until_stopped
    except ImportError as err:
        raise OnepassError(f"the cluster needs the [cluster] extra ({err.name} is missing): "
                           "pip install 'onepass[cluster]'") from None
    engine = Path(args.engine).resolve()
    if not (engine / "manifest.json").is_file():
        raise OnepassError(f"{args.engine} holds no engine (no manifest.json); run `onepass export --out "
                           f"{args.engine}` first")
    server = _server_config(args)
    metrics_dir = tempfile.mkdtemp(prefix="onepass-metrics-")
    config = dict(engine=str(engine), replicas=args.replicas, autoscale=_autoscale(args.autoscale),
                  routing=args.routing, cpus_per_replica=args.cpus_per_replica, threads=args.threads,
                  cache_mib=args.cache_mib, retries=args.retries, metrics_dir=metrics_dir,
                  server=dataclasses.asdict(server))
    size = f"{args.autoscale} replicas (autoscaled)" if args.autoscale else f"{args.replicas} replicas"

    def ready():
        print(f"onepass cluster: {engine.name} on http://{args.host}:{args.port} with {size}, routing by "
              f"{args.routing}; Ctrl-C or SIGTERM stops it", flush=True)

    stop = threading.Event()
    try:
        with stop_signals_set(stop):  # SIGINT (even inherited ignored, as in a script's background job) and SIGTERM
            serve_until_stopped(config, args.host, args.port, stop, address=args.address, num_cpus=args.num_cpus,
                                on_ready=ready)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    print("onepass cluster: stopped", flush=True)
    return 0


def cmd_mcp(args) -> int:
    """Run the MCP tool server on stdio."""
    try:
        from .runtime.server.mcp_tools import serve_stdio
    except ImportError as err:
        raise _serve_extra(err) from None
    from .runtime.engine import Engine

    serve_stdio(Engine.load(args.engine, threads=args.threads, backend=args.backend))
    return 0


def cmd_calibrate(args) -> int:
    """Fit calibration on labelled rows and store it in the engine manifest."""
    try:
        from .calibration.run import calibrate
    except ImportError as err:
        raise OnepassError(f"calibration needs the [calibrate] extra ({err.name} is missing): "
                           "pip install 'onepass[calibrate]'") from None
    report = calibrate(args.engine, args.data, holdout=args.holdout, seed=args.seed, report_dir=args.report)
    for phase in ("before", "after"):
        m = report[phase]["all"]
        print(f"{phase:6s} held-out rows {m['rows']}: accuracy {m['accuracy']:.3f}  NLL {m['nll']:.3f}  "
              f"Brier {m['brier']:.3f}  ECE {m['ece']:.3f}")
    for key, n in report["skipped"].items():
        print(f"skipped {key if len(key) <= 80 else key[:77] + '...'}: {n} training rows, {report['min_rows']} needed")
    print(f"calibration of {len(report['calibration']['groups'])} groups written to {args.engine}/manifest.json"
          + (f"; report in {args.report}" if args.report else ""))
    return 0


def cmd_eval(args) -> int:
    """Accuracy vs majority, NLL, Brier, ECE, coverage and confusion of an engine on labelled rows."""
    try:
        from .calibration.evaluate import engine_reports, evaluate_engine, write
    except ImportError as err:
        raise OnepassError(f"eval needs the [calibrate] extra ({err.name} is missing): "
                           "pip install 'onepass[calibrate]'") from None
    report = evaluate_engine(args.engine, args.data, args.min_confidence, args.target_accuracy, args.threads)
    if args.compare:
        report["compare"] = evaluate_engine(args.compare, args.data, args.min_confidence, args.target_accuracy,
                                            args.threads)
    for r in engine_reports(report):
        m = r["all"]
        print(f"{r['name']} on {r.get('backend', '?')}: {r['rows']} rows ({r['rows_per_second']:.1f}/s): accuracy {m['accuracy']:.3f} "
              f"(majority {m['majority']:.3f})  NLL {m['nll']:.3f}  Brier {m['brier']:.3f}  ECE {m['ece']:.3f}")
        if "at_min_confidence" in m:
            at = m["at_min_confidence"]
            acc = f"{at['accuracy']:.3f}" if at["accuracy"] is not None else "-"
            print(f"  confidence >= {at['min_confidence']}: coverage {at['coverage']:.3f}, accuracy {acc}")
        if "for_target_accuracy" in m:
            t = m["for_target_accuracy"]
            print(f"  accuracy >= {t['target']}: coverage {t['coverage']:.3f} at confidence >= {t['min_confidence']}")
    if args.report:
        write(report, Path(args.report))
        print(f"report written to {args.report}")
    return 0


def cmd_tune(args) -> int:
    """Fine-tune an engine's decoder on labelled rows and export the tuned engine."""
    try:
        from .calibration.tune import TuneConfig
        from .calibration.tune_engine import tune
    except ImportError as err:
        raise OnepassError(f"tune needs the [export,calibrate] extras ({err.name} is missing): "
                           "pip install torch==2.13.0 && pip install 'onepass[export,calibrate]'") from None
    config = TuneConfig(method=args.method, rank=args.rank, train_blocks=args.train_blocks, lr=args.lr,
                        epochs=args.epochs, max_minutes=args.max_minutes, max_steps=args.max_steps,
                        batch_questions=args.batch_questions,
                        rlcd_weight=args.rlcd_weight, holdout=args.holdout, seed=args.seed,
                        max_state_tokens=args.max_state_tokens, eval_every=args.eval_every, patience=args.patience,
                        keep_base=args.keep_base)
    summary = tune(args.engine, args.data, args.out, config, resume=args.resume,
                   report_dir=args.report or f"{args.out}-report", name=args.name, validation=args.validation)
    if "head" in summary:
        h = summary["head"]
        print(f"decision head: held-out NLL {h['heldout_nll_before']:.4f} (zero-shot) -> {h['heldout_nll_after']:.4f}")
    else:
        _print_tuning(summary["tuning"])
    for phase, r in summary.get("report", {}).items():
        print(f"{phase:6s} (ONNX Runtime, held-out rows {r['rows']}): accuracy {r['accuracy']:.3f}  NLL {r['nll']:.3f}  "
              f"Brier {r['brier']:.3f}  ECE {r['ece']:.3f}")
    print(f"tuned engine written to {args.out}; report in {args.report or f'{args.out}-report'}")
    return 0


def _print_tuning(tuning: dict) -> None:
    m = tuning["metrics"]
    print(f"held-out before: accuracy {m['heldout_before']['accuracy']:.3f} NLL {m['heldout_before']['nll']:.4f}; "
          f"best: accuracy {m['heldout_best']['accuracy']:.3f} NLL {m['heldout_best']['nll']:.4f} "
          f"({tuning['steps']} steps, {m['rows_per_second']:.2f} rows/s)")


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


def _device_names() -> list:
    from .runtime.plan import DEVICES

    return list(DEVICES)


def cmd_quantize(args) -> int:
    """Build an INT8 engine that keeps its answers on labelled rows, or refuse."""
    try:
        from .calibration.quantize import quantize_engine
    except ImportError as err:
        raise OnepassError(f"quantize needs the [export] extra ({err.name} is missing)") from None
    record = quantize_engine(args.engine, args.out, args.data, min_agreement=args.min_agreement,
                             max_error=args.max_error)
    print(f"INT8 engine written to {args.out}: agreement {record['agreement']:.1%} on {record['rows']} rows, "
          f"max log-prob error {record['max_logprob_error']:.3f}, {record['speedup']:.2f}x")
    return 0


def cmd_export(args) -> int:
    """Compile a model into an engine directory."""
    try:
        from .export.build import export_engine
    except ImportError as err:
        raise OnepassError(f"export needs the [export] extra ({err.name} is missing): "
                           "pip install torch==2.13.0 && pip install 'onepass[export]'") from None
    from .runtime.manifest import Scoring

    limits = dict(max_state_tokens=args.max_state_tokens, max_packed_tokens=args.max_packed_tokens,
                  max_questions=args.max_questions, max_options=args.max_options,
                  max_request_tokens=args.max_request_tokens)  # over the limits derived from the model
    head = head_info = None
    if args.head:
        from .calibration.head import load_head_info

        head, head_info = load_head_info(args.head)
    from .export.adapter import resolve

    scoring = Scoring(args.readout) if args.readout else None
    export_engine(args.out, args.model, name=args.name, limits=limits, scoring=scoring,
                  head=head, head_info=head_info, precision=args.precision, adapters=resolve(args.adapter, args.model))
    return 0


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
    ex.add_argument("--max-state-tokens", type=int, default=None,
                    help="default: the model's context window minus 1024 positions for the questions")
    ex.add_argument("--max-packed-tokens", type=int, default=4096, help="tokens of one packed pass")
    ex.add_argument("--max-questions", type=int, default=5000)
    ex.add_argument("--max-options", type=int, default=1000)
    ex.add_argument("--max-request-tokens", type=int, default=262144,
                    help="packed tokens over all passes of one request (blocks of whole questions)")
    ex.add_argument("--readout", choices=["sum", "mean", "prior"], default=None,
                    help="how option log-likelihoods become probabilities (default: the read-out the adapter was "
                         "trained for, else mean; see benchmarks/results/readout_eval.md)")
    ex.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                    help="fp16/bf16: block weights and GEMMs in fp16/bf16 (half the weight bytes; norms, softmax, "
                         "residual stream, read-out and K/V stay float32); bf16 engines run on TensorRT or "
                         "the PyTorch backend")
    ex.add_argument("--adapter", default="default",
                    help="LoRA adapter merged into the weights: 'default' (the tuned adapter shipped for the default "
                         "model; none for other models), 'none' (the plain base model), or a folder from `onepass tune`")
    ex.add_argument("--head", help="a trained decision head (.pt from benchmarks/decision_head.py) to export into "
                                   "the graph; the engine then answers with the 'head' read-out")
    ex.set_defaults(func=cmd_export)
    ask = sub.add_parser("ask", help="answer questions about a state; prints the TypeSafe response JSON")
    ask.add_argument("--engine", required=True, help="engine directory")
    ask.add_argument("--state", help="file with the state text ('-' for stdin); or give state inside --questions")
    ask.add_argument("--json-state", action="store_true", help="the state file holds JSON (serialised canonically)")
    ask.add_argument("--questions", required=True, help="JSON: {id: {type, instructions, criteria}} or a full request")
    ask.add_argument("--threads", type=int, default=None, help="inference threads (the backend's intra-op threads; default: its own choice)")
    ask.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                     help="as for serve (default auto: OpenVINO where it reproduces the golden file, else ONNX Runtime)")
    ask.set_defaults(func=cmd_ask)
    bench = sub.add_parser("bench", help="latency percentiles of an engine (in process) or a server (HTTP)")
    where = bench.add_mutually_exclusive_group(required=True)
    where.add_argument("--engine", help="engine directory (in-process)")
    where.add_argument("--url", help="a TypeSafe System One server, e.g. http://127.0.0.1:8000")
    bench.add_argument("--state", help="file with the state text")
    bench.add_argument("--states", help="a directory of state files: each request takes one at random (seeded)")
    bench.add_argument("--json-state", action="store_true", help="the state file holds JSON")
    bench.add_argument("--questions", required=True, help="JSON questions or a full request")
    bench.add_argument("--backend", choices=BACKENDS, nargs="+", default=None,
                       help="in process: the backends to measure side by side (default: every one that loads here)")
    bench.add_argument("--kind", choices=("warm", "cold", "prefill"), nargs="+", default=None,
                       help="warm: cached state; cold: a fresh state per request (prefill included); prefill: "
                            "prefill alone (default: all three in process, warm over HTTP)")
    bench.add_argument("--cold-fraction", type=float, default=0.0,
                       help="share of fresh (uncached) states mixed into warm runs, 0..1")
    bench.add_argument("--requests", type=int, default=None,
                       help="requests per run instead of --duration (open loop: requests / rate seconds)")
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
    check.add_argument("--engine", required=True, help="engine directory")
    check.add_argument("--threads", type=int, default=None, help="inference threads (the backend's intra-op threads; default: its own choice)")
    check.add_argument("--backend", choices=BACKENDS, default="onnxruntime",
                       help="which backend runs the golden file (bf16 engines: tensorrt or torch-*)")
    check.set_defaults(func=cmd_check)
    cal = sub.add_parser("calibrate", help="fit temperature/bias on labelled JSONL into the engine manifest")
    cal.add_argument("--engine", required=True, help="engine directory (its manifest is updated)")
    cal.add_argument("--data", required=True, help="JSONL rows: {state, question, label}")
    cal.add_argument("--holdout", type=float, default=0.3, help="share of rows kept out of the fit for the report; "
                     "each group (question type, or one question) needs 20 training rows to be fitted")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--report", default=None, help="folder for report.json/.md, reliability.png, coverage.png")
    cal.set_defaults(func=cmd_calibrate)
    ev = sub.add_parser("eval", help="how good an engine is on labelled JSONL rows (accuracy, NLL, ECE, coverage)")
    ev.add_argument("--engine", required=True, help="engine directory")
    ev.add_argument("--data", required=True, help="JSONL rows: {state, question, label}")
    ev.add_argument("--min-confidence", type=float, default=None, help="report coverage and accuracy above it")
    ev.add_argument("--target-accuracy", type=float, default=None, help="find the confidence that reaches it")
    ev.add_argument("--compare", default=None, metavar="DIR2",
                    help="a second engine directory evaluated on the same rows, side by side (e.g. base vs tuned)")
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--report", default=None, help="folder for eval.json/.md and plots")
    ev.set_defaults(func=cmd_eval)
    tn = sub.add_parser("tune", help="fine-tune the decoder (LoRA or all weights) on labelled rows; writes a tuned engine")
    tn.add_argument("--engine", required=True, help="the base engine directory")
    tn.add_argument("--data", required=True, nargs="+", help="JSONL rows: state, question, label (or probabilities)")
    tn.add_argument("--out", required=True, help="tuned engine directory to write (only when the run succeeds)")
    tn.add_argument("--method", choices=["lora", "full", "head"], default="lora",
                    help="lora: LoRA adapters (peft), merged on export; full: every weight; head: a decision head "
                         "(MLP width 16, CE + RLCD, early stopping) over the frozen decoder, exported into the graph")
    tn.add_argument("--rank", type=int, default=16, help="LoRA rank")
    tn.add_argument("--train-blocks", type=int, default=None, help="train only the top N decoder blocks (default all)")
    tn.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-4 LoRA, 2e-5 full)")
    tn.add_argument("--epochs", type=int, default=3)
    tn.add_argument("--max-minutes", type=float, default=None, help="stop after this long, keeping the best weights")
    tn.add_argument("--keep-base", action="store_true", help="write the engine even when tuning never beats the base "
                                                              "on the held-out rows (by default: no engine, exit 2)")
    tn.add_argument("--max-steps", type=int, default=None,
                    help="stop after this many optimiser steps (reproducible, unlike --max-minutes)")
    tn.add_argument("--batch-questions", type=int, default=8, help="questions per optimiser step")
    tn.add_argument("--rlcd-weight", type=float, default=0.5, help="weight of the RLCD term (0: cross-entropy only)")
    tn.add_argument("--holdout", type=float, default=0.2, help="share of states held out (early stopping, report)")
    tn.add_argument("--validation", nargs="+", default=None,
                    help="JSONL rows held out instead of a --holdout split of --data (early stopping and the report "
                         "run on them): e.g. tasks not in the training data, to keep the weights that transfer")
    tn.add_argument("--eval-every", type=int, default=None, help="optimiser steps between held-out evaluations")
    tn.add_argument("--patience", type=int, default=2, help="held-out evaluations without NLL improvement before "
                                                             "stopping (the best weights are kept)")
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
    trt.add_argument("--arch", nargs="+", default=["sm80", "sm86", "sm89"],
                     help="compute capabilities (TensorRT for RTX: sm75 sm80 sm86 sm89 sm120 sm121), or native: "
                          "this machine's GPU (standard TensorRT on NGC/JetPack builds on the device)")
    trt.add_argument("--precision", default=None, choices=["fp32", "fp16", "bf16", "fp8", "int8"],
                     help="the graph's precision (the default); plans are built at it")
    trt.add_argument("--device", default=None, choices=sorted(_device_names()),
                     help="limit the builder's workspace to this device's budget (see `onepass plan`)")
    trt.add_argument("--flavour", choices=["tensorrt", "tensorrt_rtx"], default=None,
                     help="which TensorRT to use (default: tensorrt if installed, else tensorrt_rtx)")
    trt.set_defaults(func=cmd_build_trt)
    qz = sub.add_parser("quantize", help="INT8 engine that must keep its answers on labelled rows (else refused)")
    qz.add_argument("--engine", required=True, help="fp32 engine directory")
    qz.add_argument("--out", required=True, help="INT8 engine directory to write")
    qz.add_argument("--data", required=True, help="JSONL rows {state, question, label} to measure agreement on")
    qz.add_argument("--min-agreement", type=float, default=0.99)
    qz.add_argument("--max-error", type=float, default=0.1, help="largest allowed option log-prob error")
    qz.set_defaults(func=cmd_quantize)
    serve = sub.add_parser("serve", help="serve the TypeSafe System One HTTP API")
    serve.add_argument("--engine", required=True, help="engine directory")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or ONEPASS_API_KEY)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    serve.add_argument("--request-timeout", type=float, default=10.0,
                       help="seconds a request may take, queue included, unless the client sends X-Request-Timeout; "
                            "requests that cannot be answered in time get 429 (on arrival) or 503 (queued)")
    serve.add_argument("--batch-window-ms", type=float, default=2.0,
                       help="requests about one state arriving within this window share a pass (0: off)")
    serve.add_argument("--cache-mib", type=int, default=512, help="state cache size in MiB")
    serve.add_argument("--max-state-tokens", type=int, default=None, help="lower the engine's state limit")
    serve.add_argument("--max-packed-tokens", type=int, default=None, help="lower the engine's packed-token limit")
    serve.add_argument("--max-questions", type=int, default=None, help="lower the engine's questions per request")
    serve.add_argument("--max-options", type=int, default=None, help="lower the engine's options per choice")
    serve.add_argument("--max-request-tokens", type=int, default=None,
                       help="packed tokens per request over all its passes (default: one pass's, max_packed_tokens; "
                            "up to the engine's max_request_tokens)")
    serve.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                       help="auto (default: openvino-cpu where it is installed and reproduces the engine's golden "
                            "file here, else onnxruntime), onnxruntime (CPU, the reference), onnxruntime-gpu (its CUDA provider: no build step; needs "
                            "the onnxruntime-gpu package), tensorrt (the engine's plan for this GPU), "
                            "the PyTorch backend on CPU or CUDA, or OpenVINO's CPU plugin at f32 or in the CPU's "
                            "native bf16: openvino-cpu is as exact as onnxruntime and 1.3x faster on the measured AMX Xeon, "
                            "openvino-cpu-bf16 2.9x faster with answer probabilities within 0.14)")
    serve.add_argument("--build-trt-if-missing", action="store_true",
                       help="with --backend tensorrt: build this GPU's TensorRT plan into --engine first if it has "
                            "none (first start)")
    serve.add_argument("--export-if-missing", action="store_true",
                       help="export the default model into --engine first if it holds no engine (first start)")
    serve.add_argument("--threads", type=int, default=None, help="inference threads (the backend's intra-op threads; default: its own choice)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection has to send a request's headers (else 408 and closed)")
    serve.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds a request has to send its whole body once its headers are in (else 408)")
    serve.add_argument("--keep-alive", type=int, default=5, help="seconds an idle keep-alive connection is kept")
    serve.add_argument("--max-header-bytes", type=int, default=16384, help="larger request heads get 431")
    serve.add_argument("--max-connections", type=int, default=None,
                       help="connections at once, 503 beyond (default 1000, below the open-files limit)")
    serve.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    serve.add_argument("--cascade", default=None, help="a second (stronger) engine directory: questions answered "
                                                        "below --min-confidence are asked again of it")
    serve.add_argument("--min-confidence", type=float, default=None, help="the cascade's threshold (0..1)")
    serve.set_defaults(func=cmd_serve)
    cl = sub.add_parser("cluster", help="serve the same HTTP API from replicas on Ray Serve, routed by state")
    cl.add_argument("--engine", required=True, help="engine directory (every replica loads it)")
    cl.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    cl.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                    help="let Serve's autoscaler keep MIN..MAX replicas instead of a fixed --replicas")
    cl.add_argument("--routing", choices=("state", "default"), default="state",
                    help="state: requests about one state go to one replica (its cached K/V); default: Serve's "
                         "own load balancing")
    cl.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    cl.add_argument("--port", type=int, default=8000)
    cl.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto); default: start one here")
    cl.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the Ray cluster started here")
    cl.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs reserved per replica")
    cl.add_argument("--threads", type=int, default=1, help="inference threads per replica (the backend's intra-op threads)")
    cl.add_argument("--cache-mib", type=int, default=512, help="state cache size per replica in MiB")
    cl.add_argument("--retries", type=int, default=1, help="retries of a request whose replica died")
    cl.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or ONEPASS_API_KEY)")
    cl.add_argument("--max-body-bytes", type=int, default=1 << 20)
    cl.add_argument("--max-queue", type=int, default=64, help="waiting requests per replica before 429")
    cl.add_argument("--request-timeout", type=float, default=10.0, help="seconds a request may take by default")
    cl.add_argument("--batch-window-ms", type=float, default=2.0)
    cl.set_defaults(func=cmd_cluster)
    mcp = sub.add_parser("mcp", help="serve noul/choice/score as MCP tools on stdio")
    mcp.add_argument("--engine", required=True, help="engine directory")
    mcp.add_argument("--threads", type=int, default=None, help="inference threads (the backend's intra-op threads; default: its own choice)")
    mcp.add_argument("--backend", choices=("auto", *BACKENDS), default="auto", help="as for serve (default auto)")
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
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (writers clean up after themselves)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
