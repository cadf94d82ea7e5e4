"""The ``onepass`` command's flags: one argparse subparser per command (``cli.py`` calls the library with them)."""

from __future__ import annotations

import argparse

import dataclasses

from .calibration.tune.config import DEPTH_FRACTIONS, TuneConfig
from .runtime.backends import AUTO, BACKENDS
from .runtime.backends.devices import DEVICES
from .runtime.core.config import EngineConfig
from .runtime.core.manifest import Limits
from .runtime.core.prompt import FORMS
from .runtime.server.config import ServerConfig, TransportLimits
from .runtime.teacher.client import TeacherConfig

# every default below is the settings' own (one source: the library and the command agree)
ENGINE, SERVER, TRANSPORT, TUNE, LIMITS = EngineConfig(), ServerConfig(), TransportLimits(), TuneConfig(), Limits()
TEACHER = {f.name: f.default for f in dataclasses.fields(TeacherConfig)}  # its url has no default


THREADS = "inference threads (the backend's intra-op threads; default: its own choice)"


def _depths(text: str) -> tuple:
    """--head-depths: block counts separated by commas, or 'full' (the full depth only: ())."""
    if text == "full":
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = (0,)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive block counts separated by commas, or 'full'; got {text!r}")
    return values


def _blocks(text: str) -> int:
    """--train-blocks: a positive count, or all (0)."""
    if text == "all":
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of blocks or 'all', got {text!r}")
    return value


def _engine(p, backend: str | None = ENGINE.backend, help: str = "engine directory") -> None:
    """--engine, --threads and (unless None) --backend: what every command that loads an engine takes."""
    p.add_argument("--engine", required=True, help=help)
    p.add_argument("--threads", type=int, default=ENGINE.threads, help=THREADS)
    if backend is not None:
        p.add_argument("--backend", choices=(AUTO, *BACKENDS), default=backend,
                       help="auto: OpenVINO's CPU plugin where it reproduces the golden file here, else ONNX Runtime")


def _http(p) -> None:
    """The HTTP settings serve and cluster share."""
    p.add_argument("--host", default=SERVER.host, help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=SERVER.port)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or ONEPASS_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=SERVER.max_body_bytes)
    p.add_argument("--max-queue", type=int, default=SERVER.max_queue,
                   help="waiting requests (per replica) before answering 429")
    p.add_argument("--request-timeout", type=float, default=SERVER.request_timeout_s,
                   help="seconds, unless it sends X-Request-Timeout")
    p.add_argument("--batch-window-ms", type=float, default=SERVER.batch_window_ms,
                   help="requests about one state within it share a pass")
    p.add_argument("--max-batch", type=int, default=SERVER.max_batch, help="requests about one state in one pass")
    p.add_argument("--client-header", default=SERVER.client_header, metavar="NAME",
                   help="the header that tells clients apart for fair turns in the engine queue and for penalties "
                        "(e.g. x-api-key, set by a trusted proxy: its value is taken as the client's identity; "
                        "default: the peer address)")
    p.add_argument("--cache-mib", type=int, default=ENGINE.cache_mib, help="state cache size in MiB (per replica)")


def _teacher(p, required: bool) -> None:
    p.add_argument("--teacher", required=required, default=None, metavar="URL",
                   help="the teacher's base URL (a System One server, or an OpenAI-compatible one)")
    p.add_argument("--teacher-kind", choices=("systemone", "openai"), default=TEACHER["kind"])
    p.add_argument("--teacher-key", default=None, help="the teacher's API key (default: $ONEPASS_TEACHER_KEY)")
    p.add_argument("--teacher-model", default=None, help="the model named in teacher requests")
    p.add_argument("--teacher-timeout", type=float, default=TEACHER["timeout_s"], help="seconds per teacher call attempt")
    p.add_argument("--teacher-concurrency", type=int, default=TEACHER["max_concurrency"], help="teacher calls in flight at once")


def _training(p, named: str, held: str) -> None:
    """The training flags tune and distill share (TuneConfig's fields; :func:`_tune_config` reads them)."""
    p.add_argument("--method", choices=["lora", "full", "head"], default=TUNE.method,
                   help="LoRA adapters merged on export, every weight, or a decision head over the frozen decoder")
    p.add_argument("--rank", type=int, default=TUNE.rank, help="LoRA rank")
    p.add_argument("--train-blocks", type=_blocks, default=None, metavar="N|all",
                   help="train only the top N decoder blocks, or all (default: LoRA on the top 4 under 80 training "
                        "rows, the lower blocks run once per state; every block from 80; full: all; a --task: 4)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 1e-3 for LoRA on up to 8 blocks, 3e-4 on more, 2e-5 full)")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs (default 3, more for a few dozen rows: at least 30 steps, at most 12 epochs)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this long, keeping the best weights")
    p.add_argument("--keep-base", action="store_true", help="write an engine even if tuning never beats the base")
    p.add_argument("--write", choices=("best", "tuned"), default=TUNE.write,
                   help="best: the candidate (base, base+calibrate, head, tuned, tuned+calibrate) "
                        "with the lowest NLL on rows it was not fitted on; tuned: the tuned weights, uncalibrated, "
                        "whatever the candidates say")
    p.add_argument("--no-head", dest="head_candidate", action="store_false",
                   help="leave the decision head (over the untuned engine's hidden states) out of the candidates")
    p.add_argument("--lora-min-rows", type=int, default=TUNE.lora_min_rows,
                   help="with the head candidate, fewer rows than this train no LoRA run: the candidates are base, "
                        "base+calibrate and the head, cross-validated and chosen in seconds (at 50 and 200 rows on "
                        "five data sets: docs/tune.md); 0: always train LoRA (a --task always does)")
    p.add_argument("--head-depths", type=_depths, default=None, metavar="K,K,...|full",
                   help="the block counts the decision head is also tried at (an engine written with a head read "
                        "after K blocks runs only those K, in its passes and prefills); default: "
                        + ", ".join(f"{f:.0%}" for f in DEPTH_FRACTIONS).replace("%", "%%")
                        + " of the model's blocks; full: the full depth only")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimiser steps")
    p.add_argument("--batch-questions", type=int, default=TUNE.batch_questions, help="questions per optimiser step")
    p.add_argument("--rlcd-weight", type=float, default=None,
                   help="weight of the RLCD term (0: cross-entropy only; default 0.5, and 0 for a --task)")
    p.add_argument("--holdout", type=float, default=TUNE.holdout, help=f"share of states {held}")
    p.add_argument("--eval-every", type=int, default=None, help="optimiser steps between held-out evaluations")
    p.add_argument("--patience", type=int, default=None,
                   help="held-out evaluations without improvement, then stop (default 2; no early stop with fewer than "
                        "50 held-out questions, where it would choose on noise)")
    p.add_argument("--max-state-tokens", type=int, default=TUNE.max_state_tokens, help="longer states are refused")
    p.add_argument("--seed", type=int, default=TUNE.seed)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in <out>.tune/")
    p.add_argument("--name", help=f"the engine's name (default: <base name>-{named})")


def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from . import __version__

    p = argparse.ArgumentParser(prog="onepass", description="Compile a small decoder into a one-pass decision engine; ask it typed questions about a text.")
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
    ex.add_argument("--max-questions", type=int, default=LIMITS.max_questions)
    ex.add_argument("--max-options", type=int, default=LIMITS.max_options)
    ex.add_argument("--readout", choices=["sum", "mean", "prior"], default=None,
                    help="option log-likelihoods to probabilities (default: the adapter's, else mean)")
    ex.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                    help="of the block weights and GEMMs (the rest stays fp32); bf16: TensorRT or PyTorch only")
    ex.add_argument("--adapter", default="default",
                    help="LoRA merged into the weights: 'default' (shipped for the default model: two adapters, "
                         "asking in the compact prompt form), 'default-chat' (the chat-form adapter alone: "
                         "1.56x slower, accuracy within two standard errors), 'none', or a "
                         "folder from `onepass tune`")
    ex.add_argument("--head", help="a decision head (.pt, benchmarks/decision_head.py) exported into the graph")
    ex.add_argument("--prompt", choices=sorted(FORMS), default=None,
                    help="how questions are written (default: the form the adapter was trained in; chat without one)")
    ask = sub.add_parser("ask", help="answer questions about a state; prints the TypeSafe response JSON")
    _engine(ask)
    ask.add_argument("--state", help="file with the state text ('-' for stdin); or give state inside --questions")
    ask.add_argument("--json-state", action="store_true", help="the state file holds JSON (serialised canonically)")
    ask.add_argument("--questions", required=True, help="JSON: {id: {type, instructions, criteria}} or a full request")
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
    check = sub.add_parser("check", help="verify an engine's files and its graph against the golden file")
    _engine(check, backend="onnxruntime")  # the reference; bf16 engines: tensorrt or torch-*
    gu = sub.add_parser("guarantee", help="measure bf16 against fp32 on your requests; --write lets the default use it")
    gu.add_argument("--engine", required=True, help="engine directory (its manifest is updated with --write)")
    gu.add_argument("--threads", type=int, default=ENGINE.threads, help=THREADS)
    gu.add_argument("--requests", required=True,
                    help="JSONL of System One request bodies, each with an optional \"dataset\" name")
    gu.add_argument("--write", action="store_true", help="record the guarantee in the engine's manifest")
    cal = sub.add_parser("calibrate", help="fit temperature/bias on labelled JSONL into the engine manifest")
    cal.add_argument("--engine", required=True, help="engine directory (its manifest is updated)")
    cal.add_argument("--data", required=True, help="JSONL rows: {state, question, label}")
    cal.add_argument("--holdout", type=float, default=0.3, help="rows kept out of the fit; a group needs 20 to fit")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--report", default=None, help="folder for report.json/.md, reliability.png, coverage.png")
    ev = sub.add_parser("eval", help="how good an engine is on labelled JSONL rows (accuracy, NLL, ECE, coverage)")
    _engine(ev, backend=None)
    ev.add_argument("--data", required=True, help="JSONL rows: {state, question, label}")
    ev.add_argument("--min-confidence", type=float, default=None, help="report coverage and accuracy above it")
    ev.add_argument("--target-accuracy", type=float, default=None, help="find the confidence that reaches it")
    ev.add_argument("--compare", default=None, metavar="DIR2", help="a second engine, side by side on the same rows")
    ev.add_argument("--report", default=None, help="folder for eval.json/.md and plots")
    tn = sub.add_parser("tune", help="fine-tune the decoder on labelled rows; writes a tuned engine")
    tn.add_argument("--engine", required=True, help="the base engine directory")
    tn.add_argument("--data", required=True, nargs="+", help="JSONL rows: state, question, label (or probabilities)")
    tn.add_argument("--out", help="tuned engine directory to write (only when the run succeeds); not with --task")
    tn.add_argument("--task", default=None, metavar="NAME",
                    help="add (or replace) the tuned task NAME beside --engine instead of writing a whole engine: "
                         "a small adapter on the question tokens, the state shared with the engine's other tasks")
    tn.add_argument("--validation", nargs="+", default=None, help="held-out JSONL rows instead of a --holdout split")
    _training(tn, "tuned", "held out (early stopping, report)")
    tn.add_argument("--report", help="report directory (default: <out>-report)")
    tk = sub.add_parser("tasks", help="list or remove the tuned tasks stored beside an engine (onepass tune --task)")
    tk.add_argument("action", choices=("list", "remove"))
    tk.add_argument("engine", help="engine directory")
    tk.add_argument("name", nargs="?", help="the task to remove")
    pl = sub.add_parser("plan", help="memory budget and latency floor on a device (assumptions stated)")
    pl.add_argument("--engine", required=True, help="engine directory")
    pl.add_argument("--device", required=True, choices=["orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb", "h200"])
    pl.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16", "int8", "fp8"])
    pl.add_argument("--state-tokens", type=int, default=512)
    pl.add_argument("--packed-tokens", type=int, default=512)
    pl.add_argument("--json", action="store_true", help="print JSON")
    trt = sub.add_parser("build-trt", help="build TensorRT plans from the engine's ONNX graph (ahead of time)")
    trt.add_argument("--engine", required=True, help="engine directory (plans are added and recorded)")
    trt.add_argument("--arch", nargs="+", default=["sm80", "sm86", "sm89"], help="sm75..sm121, or native: this GPU")
    trt.add_argument("--precision", default=None, choices=["fp32", "fp16", "bf16", "fp8", "int8"],
                     help="(default: the graph's)")
    trt.add_argument("--device", default=None, choices=sorted(DEVICES), help="the builder's workspace budget")
    trt.add_argument("--flavour", choices=["tensorrt", "tensorrt_rtx"], default=None, help="default: tensorrt if any")
    trt.add_argument("--tf32", action="store_true", help="fp32 plans may round GEMM inputs to TF32 (tensor cores; "
                     "off by default: an fp32 plan then reproduces the fp32 golden file)")
    qz = sub.add_parser("quantize", help="INT8 engine that must keep its answers on labelled rows (else refused)")
    qz.add_argument("--engine", required=True, help="fp32 engine directory")
    qz.add_argument("--out", required=True, help="INT8 engine directory to write")
    qz.add_argument("--data", required=True, help="JSONL rows {state, question, label} to measure agreement on")
    qz.add_argument("--min-agreement", type=float, default=0.99)
    qz.add_argument("--max-error", type=float, default=0.1, help="largest allowed option log-prob error")
    ds = sub.add_parser("distill", help="learn a task from a teacher model's answers on unlabelled states")
    ds.add_argument("--engine", required=True, help="the engine to start from (the student)")
    _teacher(ds, required=True)
    ds.add_argument("--states", required=True, help="JSONL: one state per line (a JSON string or {\"state\": ...})")
    ds.add_argument("--questions", required=True, help="JSON: the questions by id, asked about every state")
    ds.add_argument("--out", help="the student engine directory to write (with its gate); not with --task")
    ds.add_argument("--task", default=None, metavar="NAME",
                    help="the student is the tuned task NAME added beside --engine (onepass tune --task), its "
                         "agreement and gate measured into its card; labels and report in <engine>.NAME.distill")
    ds.add_argument("--target-agreement", type=float, default=0.95,
                    help="the gate: answer locally where the student agrees with the teacher this often")
    _training(ds, "distilled", "held out (early stopping, the gate)")
    serve = sub.add_parser("serve", help="serve the TypeSafe System One HTTP API")
    _engine(serve)
    _http(serve)
    for flag, what in (("state-tokens", "state limit"), ("packed-tokens", "packed-token limit"),
                       ("questions", "questions per request"), ("options", "options per choice")):
        serve.add_argument(f"--max-{flag}", type=int, default=None, help=f"lower the engine's {what}")
    serve.add_argument("--max-request-tokens", type=int, default=None, help="packed tokens per request")
    serve.add_argument("--build-trt-if-missing", action="store_true", help="build this GPU's plan first if missing")
    serve.add_argument("--export-if-missing", action="store_true", help="export the default model first if missing")
    serve.add_argument("--header-timeout", type=float, default=TRANSPORT.header_timeout_s,
                       help="seconds to send the headers, else 408")
    serve.add_argument("--body-timeout", type=float, default=TRANSPORT.body_timeout_s,
                       help="seconds to send the body, else 408")
    serve.add_argument("--keep-alive", type=int, default=TRANSPORT.keep_alive_s,
                       help="seconds an idle keep-alive connection is kept")
    serve.add_argument("--max-header-bytes", type=int, default=TRANSPORT.max_header_bytes,
                       help="larger request heads get 431")
    serve.add_argument("--max-connections", type=int, default=TRANSPORT.max_connections,
                       help="at once, 503 beyond (default 1000; /healthz and /readyz are still answered)")
    serve.add_argument("--max-connections-per-client", type=int, default=TRANSPORT.max_connections_per_client,
                       help="connections one client address may hold (default a quarter of --max-connections)")
    serve.add_argument("--framing-penalty", type=float, default=TRANSPORT.framing_penalty_s,
                       help="seconds an address that sent abusive chunked framing is refused (429); 0: never")
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
    cl.add_argument("--threads", type=int, default=1, help=THREADS + "; default 1 per replica, its one Ray CPU")
    cl.add_argument("--retries", type=int, default=1, help="retries of a request whose replica died")
    mcp = sub.add_parser("mcp", help="serve noul/choice/score as MCP tools on stdio")
    _engine(mcp)
    return p
