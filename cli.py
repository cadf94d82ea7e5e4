"""The ``onepass`` command: export an engine, ask questions about a state.

Errors print one line (``error: ...``) and exit with status 2; never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .flags import parser
from .runtime.core.errors import OnepassError


# what each command needs beyond the runtime: a missing import is one line naming the extra to install
EXTRAS = {"serve": "serve", "mcp": "serve", "cluster": "cluster", "calibrate": "calibrate", "eval": "calibrate",
          "tune": "export,calibrate", "distill": "export,calibrate,serve", "export": "export", "quantize": "export", "build-trt": "trt-build"}


def _limits(args) -> dict:
    keys = ("max_state_tokens", "max_packed_tokens", "max_questions", "max_options", "max_request_tokens")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cmd_ask(args) -> int:
    """Answer a TypeSafe request and print the response JSON (stdout: the JSON alone; the backend on stderr)."""
    from .runtime.core.engine import Engine
    from .runtime.tools.request_files import request_body

    body = request_body(args.questions, args.state, args.json_state)
    engine = Engine.load(args.engine, threads=args.threads, backend=args.backend)
    response = engine.request(body)
    print(f"answered on {engine.backend.name}", file=sys.stderr)
    print(json.dumps(response, indent=2, ensure_ascii=False))
    return 0


def cmd_bench(args) -> int:
    """Latency percentiles of an engine in process (per backend) or of a server over HTTP, open or closed loop."""
    from .runtime.tools.bench import bench
    from .runtime.tools.request_files import request_body, states

    body = request_body(args.questions, args.state, args.json_state)
    report = bench(body, states(args.states, body), engine=args.engine, url=args.url, backends=args.backend,
                   threads=args.threads, api_key=args.api_key, model=args.model, kinds=args.kind, rates=args.rate,
                   concurrencies=args.concurrency, duration=args.duration, warmup=args.warmup, seed=args.seed,
                   cold_fraction=args.cold_fraction, requests=args.requests, compare_with=args.compare,
                   force=args.force, report_dir=args.report)
    return 130 if report["interrupted"] and not args.report else 0


def cmd_check(args) -> int:
    """Verify an engine's files (sha256) and run its golden file through the graph."""
    from .runtime.core.engine import Engine
    from .runtime.core.selfcheck import report_lines

    engine = Engine.load(args.engine, threads=args.threads, backend=args.backend)
    print("\n".join(report_lines(engine) + [f"ok: {args.engine} verified on {engine.backend.name}"]))
    return 0


def _server_config(args):
    """The HTTP settings `onepass serve` and `onepass cluster` share, ONEPASS_API_KEY as the key's default."""
    from .runtime.server.config import ServerConfig

    return ServerConfig.from_env(host=args.host, port=args.port, api_key=args.api_key,
                                 max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                                 batch_window_ms=args.batch_window_ms, max_batch=args.max_batch,
                                 request_timeout_s=args.request_timeout, client_header=args.client_header,
                                 docs=getattr(args, "docs", None))


def cmd_guarantee(args) -> int:
    """Measure OpenVINO's bf16 against its fp32 on the given requests; with --write, record it in the manifest."""
    from .runtime.tools.guarantee import measure, read_requests, record, report_lines

    requests = read_requests(args.requests)  # every line checked before any engine loads
    result = measure(args.engine, requests, threads=args.threads)
    print("\n".join(report_lines(result)))
    if args.write:
        print(f"recorded in {record(args.engine, result['variant'], result['guarantee'])}")
    return 0


def cmd_serve(args) -> int:
    """Run the TypeSafe System One HTTP server."""
    from .runtime.server.run import serve
    from .runtime.core.config import EngineConfig
    from .runtime.server.config import TransportLimits
    exporter = None
    if args.export_if_missing:
        from .export.build import export_engine as exporter
    transport = TransportLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                keep_alive_s=args.keep_alive, max_header_bytes=args.max_header_bytes,
                                max_connections=args.max_connections,
                                max_connections_per_client=args.max_connections_per_client,
                                framing_penalty_s=args.framing_penalty)
    if args.teacher is None:
        given = [flag for flag, value in (("--shadow-rate", args.shadow_rate), ("--record", args.record),
                                          ("--teacher-key", args.teacher_key), ("--teacher-model", args.teacher_model))
                 if value]
        if given:
            raise OnepassError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} settings of a teacher: give "
                               "--teacher URL")
    teacher = None if args.teacher is None else {
        "url": args.teacher, "shadow_rate": args.shadow_rate, "record": args.record,
        "record_max_mib": args.record_max_mib, **_teacher_client(args)}
    engine = EngineConfig(backend=args.backend, threads=args.threads, cache_mib=args.cache_mib, limits=_limits(args))
    serve(args.engine, _server_config(args), transport, engine, cascade=args.cascade,
          min_confidence=args.min_confidence, teacher=teacher, exporter=exporter,
          build_trt_if_missing=args.build_trt_if_missing)
    return 0


def cmd_distill(args) -> int:
    """Label unlabelled states with a teacher, tune on its answers, write the engine with its gate."""
    from .calibration.teach.distill import distill, summary_lines
    from .runtime.teacher.client import connect

    config = _tune_config(args)
    if args.task is not None:
        from .calibration.tune.task import task_config

        if args.out is not None or args.name:
            raise OnepassError("--task adds the student to --engine as a task: --out and --name do not apply")
        config = task_config(config, rlcd_given=args.rlcd_weight is not None)
    elif args.out is None:
        raise OnepassError("distill needs --out (the student engine to write) or --task NAME (a task of --engine)")
    with connect(args.teacher, **_teacher_client(args)) as teacher:
        report = distill(args.engine, teacher, args.states, args.questions, args.out,
                         target_agreement=args.target_agreement, holdout=args.holdout, config=config,
                         concurrency=args.teacher_concurrency, resume=args.resume, name=args.name, task=args.task)
    print("\n".join(summary_lines(report, args.out or f"task {args.task!r} of {args.engine}")))
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
    from .runtime.core.config import EngineConfig
    from .runtime.server import cluster
    engine = EngineConfig(threads=args.threads, cache_mib=args.cache_mib)
    cluster.run(args.engine, _server_config(args), engine, replicas=args.replicas, autoscale=args.autoscale,
                routing=args.routing, address=args.address, num_cpus=args.num_cpus,
                cpus_per_replica=args.cpus_per_replica, retries=args.retries)
    return 0


def cmd_mcp(args) -> int:
    """Run the MCP tool server on stdio."""
    from .runtime.server.mcp_tools import serve_stdio
    from .runtime.core.engine import Engine

    serve_stdio(Engine.load(args.engine, threads=args.threads, backend=args.backend))
    return 0


def cmd_calibrate(args) -> int:
    """Fit calibration on labelled rows and store it in the engine manifest."""
    from .calibration.measure.calibrate import calibrate, summary
    report = calibrate(args.engine, args.data, holdout=args.holdout, seed=args.seed, report_dir=args.report)
    print("\n".join(summary(report, args.engine, args.report)))
    return 0


def cmd_eval(args) -> int:
    """Accuracy vs majority, NLL, Brier, ECE, coverage and confusion of an engine on labelled rows."""
    from .calibration.measure.evaluate import evaluate_engine, summary, write
    report = evaluate_engine(args.engine, args.data, args.min_confidence, args.target_accuracy, args.threads)
    if args.compare:
        report["compare"] = evaluate_engine(args.compare, args.data, args.min_confidence, args.target_accuracy,
                                            args.threads)
    print("\n".join(summary(report)))
    if args.report:
        write(report, Path(args.report))
        print(f"report written to {args.report}")
    return 0


def _tune_config(args):
    """TuneConfig from the flags :func:`_training` adds."""
    from .calibration.tune.config import TuneConfig

    return TuneConfig(method=args.method, rank=args.rank, train_blocks=args.train_blocks, lr=args.lr,
                      epochs=args.epochs, max_minutes=args.max_minutes, max_steps=args.max_steps,
                      batch_questions=args.batch_questions, holdout=args.holdout,
                      rlcd_weight=TuneConfig.rlcd_weight if args.rlcd_weight is None else args.rlcd_weight,
                      seed=args.seed, max_state_tokens=args.max_state_tokens, eval_every=args.eval_every,
                      patience=args.patience, keep_base=args.keep_base, write=args.write,
                      head_candidate=args.head_candidate, lora_min_rows=args.lora_min_rows,
                      head_depths=args.head_depths)


def cmd_tune(args) -> int:
    """Fine-tune an engine's decoder on labelled rows and export the tuned engine (or add a task to it)."""
    from .calibration.tune.engine import summary_lines, tune
    if args.task is not None:
        return _tune_task(args)
    if args.out is None:
        raise OnepassError("tune needs --out (the tuned engine to write) or --task NAME (a task added to --engine)")
    report_dir = args.report or f"{args.out}-report"
    summary = tune(args.engine, args.data, args.out, _tune_config(args), resume=args.resume, report_dir=report_dir,
                   name=args.name, validation=args.validation)
    print("\n".join(summary_lines(summary, args.out, report_dir)))
    return 0


def _tune_task(args) -> int:
    from .calibration.tune.task import task_config, tune_task

    if args.out is not None or args.validation or args.resume or args.report or args.name:
        raise OnepassError("--task adds a task to --engine in place: --out, --validation, --resume, --report and "
                           "--name do not apply")
    config = task_config(_tune_config(args), rlcd_given=args.rlcd_weight is not None)
    tune_task(args.engine, args.data, args.task, config)
    return 0


def cmd_tasks(args) -> int:
    """List or remove the tuned tasks beside an engine."""
    from .runtime.core import task_store

    if args.action == "remove":
        if not args.name:
            raise OnepassError("onepass tasks remove ENGINE NAME: name the task to remove")
        try:
            task_store.remove(args.engine, args.name)
        except ValueError as err:
            raise OnepassError(str(err)) from None
        print(f"task {args.name!r} removed from {args.engine}")
        return 0
    from .runtime.core import manifest as mf

    mf.load(args.engine, verify=False)  # not an engine directory: said, not an empty list
    if args.name:
        raise OnepassError("onepass tasks list ENGINE lists every task; name one only to remove it")
    for name in task_store.names(args.engine):
        card = task_store.read_card(args.engine, name)
        choice = card.get("metrics", {}).get("choice", {})
        print(f"{name}\t{choice.get('chosen', '?')}\trank {card['rank']}\tblocks {len(card['blocks'])}\t"
              f"{card.get('rows', '?')} rows\t{(card.get('instructions') or card.get('questions') or [''])[0][:60]}")
    return 0


def cmd_plan(args) -> int:
    """Print the memory budget and latency floor of an engine on a device."""
    from .runtime.tools.plan import plan, render

    result = plan(args.engine, args.device, args.precision, args.state_tokens, args.packed_tokens)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def cmd_build_trt(args) -> int:
    """Build TensorRT plans (one per compute capability) into the engine directory and record them."""
    from .runtime.core.plans import build_plans

    records = build_plans(Path(args.engine), args.arch, precision=args.precision, flavour=args.flavour,
                          device=args.device, tf32=args.tf32)
    print(f"recorded {len(records)} plan(s) in {Path(args.engine) / 'manifest.json'}")
    return 0


def cmd_quantize(args) -> int:
    """Build an INT8 engine that keeps its answers on labelled rows, or refuse."""
    from .calibration.measure.quantize import quantize_engine
    r = quantize_engine(args.engine, args.out, args.data, min_agreement=args.min_agreement, max_error=args.max_error)
    print(f"INT8 engine written to {args.out}: agreement {r['agreement']:.1%} on {r['rows']} rows, "
          f"max log-prob error {r['max_logprob_error']:.3f}, {r['speedup']:.2f}x")
    return 0


def cmd_export(args) -> int:
    """Compile a model into an engine directory."""
    from .export.build import export_from_options
    export_from_options(args.out, args.model, name=args.name, limits=_limits(args), readout=args.readout,
                        precision=args.precision, adapter=args.adapter, head=args.head, prompt=args.prompt)
    return 0


COMMANDS = {"export": cmd_export, "ask": cmd_ask, "bench": cmd_bench, "check": cmd_check, "guarantee": cmd_guarantee,
            "calibrate": cmd_calibrate, "eval": cmd_eval, "tune": cmd_tune, "tasks": cmd_tasks, "plan": cmd_plan,
            "build-trt": cmd_build_trt, "quantize": cmd_quantize, "distill": cmd_distill, "serve": cmd_serve,
            "cluster": cmd_cluster, "mcp": cmd_mcp}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``onepass`` command."""
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
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
