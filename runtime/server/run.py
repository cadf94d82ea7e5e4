"""`onepass serve` as a function: the start-up steps (bind, first-start export and TensorRT plan, engine, limits,
cascade) and uvicorn with the transport's limits. The command only parses its flags into these arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path

from ..core.engine import Engine
from ..core.state_cache import DEFAULT_CACHE_MIB
from ..core.errors import OnepassError
from .config import ServerConfig
from .transport import TransportLimits, TransportStats, listen


def check_teacher(url: str, kind: str = "systemone", shadow_rate: float = 0.0, record: str | None = None,
                  record_max_mib: int = 1024, **client) -> None:
    """`onepass serve --teacher`'s settings checked before any engine loads (a typed error naming the flag)."""
    from .records import Records
    from ..tools.teacher import TeacherConfig
    from .teaching import check_shadow_rate

    TeacherConfig(url=url, kind=kind, **client)
    check_shadow_rate(shadow_rate)
    caps = _record_caps(record_max_mib)
    if record is not None:
        Records(record, *caps).close()  # the folder creatable and writable


def _record_caps(max_mib: int) -> tuple[int, int]:
    """(bytes in all, bytes a file) of ``--record-max-mib``: a file is a quarter of the cap (64 MiB at most), so
    rotation keeps three quarters."""
    if not isinstance(max_mib, int) or max_mib < 1:
        raise OnepassError(f"--record-max-mib must be >= 1, got {max_mib}")
    return max_mib << 20, min(64 << 20, max_mib << 18)


def teacher_setup(engine: Engine, url: str, kind: str = "systemone", shadow_rate: float = 0.0,
                  record: str | None = None, record_max_mib: int = 1024, min_confidence: float | None = None,
                  **client):
    """The teacher `onepass serve --teacher` asks: the client (``client``: TeacherConfig's fields), its records and
    its gate. The gate: a distilled engine's manifest gate (its thresholds; ``min_confidence``, else 1.0, for the
    questions it was not distilled on), else ``min_confidence`` for every question; none: shadow mode only."""
    from ..core.cascade import Gate
    from .records import Records
    from ..tools.teacher import connect
    from .teaching import TeacherSetup

    check_teacher(url, kind, shadow_rate, record, record_max_mib, **client)
    if engine.manifest.gate is not None:
        gate = Gate.from_manifest(engine.manifest.gate, min_confidence)
    else:
        gate = None if min_confidence is None else Gate(min_confidence)
    records = None if record is None else Records(record, *_record_caps(record_max_mib))
    teacher = connect(url, kind, **client)
    try:
        return TeacherSetup(teacher, shadow_rate=shadow_rate, records=records, gate=gate)
    except OnepassError:  # a teacher never asked: nothing left open
        teacher.close()
        if records is not None:
            records.close()
        raise


def serve(engine_dir: str, config: ServerConfig, transport: TransportLimits | None = None, *, backend: str = "auto",
          threads: int | None = None, cache_mib: int = DEFAULT_CACHE_MIB, limits: dict | None = None,
          max_request_tokens: int | None = None, cascade: str | None = None, min_confidence: float | None = None,
          exporter=None, build_trt_if_missing: bool = False, teacher: dict | None = None) -> None:
    """Serve ``engine_dir`` until stopped (Ctrl-C or SIGTERM: uvicorn's graceful shutdown). ``limits`` lowers the
    engine's (max_state_tokens, max_packed_tokens, max_questions, max_options); ``max_request_tokens`` is the
    packed tokens one request may take over its passes (default: one pass's). With ``cascade``, questions answered
    below ``min_confidence`` are asked again of that engine. ``teacher``: :func:`teacher_setup`'s arguments (a remote
    model in shadow mode, gate mode with ``min_confidence`` or the engine's distilled gate, or both). ``exporter`` (the export package's export_engine; the
    runtime never imports export) writes the default model into ``engine_dir`` on a first start where it holds no
    engine. The port is bound first: a taken one is an error before any engine loads."""
    import uvicorn

    from .app import create_app, server_engine

    if cascade is not None and min_confidence is None:  # refused before any export or engine load
        raise OnepassError("--cascade DIR needs --min-confidence: questions answered below it are asked again of the "
                           "cascade engine")
    if min_confidence is not None and cascade is None and teacher is None:
        raise OnepassError("--min-confidence is the threshold of a --cascade engine or a --teacher's gate: give one")
    if cascade is not None and teacher is not None:
        raise OnepassError("--cascade and --teacher: one second opinion per server (a distilled engine forwards to "
                           "its teacher; a cascade engine answers locally)")
    if teacher is not None:
        check_teacher(**teacher)
    transport = transport or TransportLimits()
    socks = listen(config.host, config.port)
    if exporter is not None and not (Path(engine_dir) / "manifest.json").exists():
        exporter(engine_dir)  # first start on this device: the default model, cached in the volume
    if build_trt_if_missing and backend == "tensorrt":  # the images' default; moot for other backends
        from ..core.plans import build_native_plan_if_missing

        build_native_plan_if_missing(Path(engine_dir))
    engine = Engine.load(engine_dir, threads=threads, cache_bytes=cache_mib << 20, backend=backend)
    engine = server_engine(engine.with_limits(**(limits or {})), max_request_tokens)
    second = Engine.load(cascade, threads=threads) if cascade else None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onepass.serve").info("serving %s on the %s backend", engine.name, engine.backend.name)
    setup = None if teacher is None else teacher_setup(engine, min_confidence=min_confidence, **teacher)
    app = create_app(engine, config, cascade=second, min_confidence=min_confidence if second else None,
                     teacher=setup)
    stats = TransportStats()
    app.state.server.metrics.watch_transport(stats)
    transport = dataclasses.replace(transport, max_body_bytes=config.max_body_bytes)  # the framing cap follows it
    server = uvicorn.Server(uvicorn.Config(app, access_log=False, log_level="info", **transport.uvicorn_options(stats)))
    for sock in socks:
        address = sock.getsockname()
        logging.getLogger("onepass.serve").info("listening on http://%s:%d", *(
            (f"[{address[0]}]", address[1]) if sock.family == socket.AF_INET6 else address[:2]))
    try:
        server.run(sockets=socks)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl-C: a clean stop
        pass
    if not server.started:
        raise OnepassError("the HTTP server did not start (its error is in the log above)")
