"""`onepass serve` as a function: the start-up steps (bind, first-start export and TensorRT plan, engine, limits,
cascade) and uvicorn with the transport's limits. The command only parses its flags into these arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path

from ..core.engine import Engine
from ..core.config import EngineConfig
from ..core.errors import OnepassError
from .config import ServerConfig, TransportLimits
from .transport import TransportStats, listen, uvicorn_options


def check_teacher(url: str, kind: str = "systemone", shadow_rate: float = 0.0, record: str | None = None,
                  record_max_mib: int = 1024, **client) -> None:
    """`onepass serve --teacher`'s settings checked before any engine loads (a typed error naming the flag)."""
    from .records import Records
    from ..teacher.client import TeacherConfig
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
    from ..teacher.client import connect
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


def serve(engine_dir: str, config: ServerConfig, transport: TransportLimits | None = None,
          engine_config: EngineConfig | None = None, *, cascade: str | None = None,
          min_confidence: float | None = None, teacher: dict | None = None, exporter=None,
          build_trt_if_missing: bool = False) -> None:
    """Serve ``engine_dir`` until stopped (Ctrl-C or SIGTERM: uvicorn's graceful shutdown), with the HTTP settings
    ``config``, the connection limits ``transport`` and the engine's settings ``engine_config`` (backend, threads,
    cache, lowered limits; ``max_request_tokens`` is the packed tokens one request may take over its passes, by
    default one pass's). With ``cascade``, questions answered below ``min_confidence`` are asked again of that
    engine. ``teacher``: :func:`teacher_setup`'s arguments (a remote model in shadow mode, gate mode with
    ``min_confidence`` or the engine's distilled gate, or both). ``exporter`` (the export package's export_engine;
    the runtime never imports export) writes the default model into ``engine_dir`` on a first start where it holds
    no engine. The port is bound first: a taken one is an error before any engine loads."""
    from .app import create_app, served_engine

    check_second_opinion(cascade, min_confidence, teacher)  # refused before any export or engine load
    transport, engine_config = transport or TransportLimits(), engine_config or EngineConfig()
    socks = listen(config.host, config.port)
    if exporter is not None and not (Path(engine_dir) / "manifest.json").exists():
        exporter(engine_dir)  # first start on this device: the default model, cached in the volume
    if build_trt_if_missing and engine_config.backend == "tensorrt":  # the images' default; moot for the others
        from ..core.plans import build_native_plan_if_missing

        build_native_plan_if_missing(Path(engine_dir))
    engine = served_engine(engine_dir, engine_config)
    second = Engine.load(cascade, threads=engine_config.threads) if cascade else None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onepass.serve").info("serving %s on the %s backend", engine.name, engine.backend.name)
    setup = None if teacher is None else teacher_setup(engine, min_confidence=min_confidence, **teacher)
    app = create_app(engine, config, cascade=second, min_confidence=min_confidence if second else None,
                     teacher=setup)
    # the framing cap follows the body limit; a penalty reaches the client key the engine queue tells clients by
    run_uvicorn(app, socks, dataclasses.replace(transport, max_body_bytes=config.max_body_bytes,
                                                client_header=config.client_header))


def check_second_opinion(cascade: str | None, min_confidence: float | None, teacher: dict | None) -> None:
    """A cascade engine or a teacher (never both), and a --min-confidence only with one of them."""
    if cascade is not None and min_confidence is None:
        raise OnepassError("--cascade DIR needs --min-confidence: questions answered below it are asked again of the "
                           "cascade engine")
    if min_confidence is not None and cascade is None and teacher is None:
        raise OnepassError("--min-confidence is the threshold of a --cascade engine or a --teacher's gate: give one")
    if cascade is not None and teacher is not None:
        raise OnepassError("--cascade and --teacher: one second opinion per server (a distilled engine forwards to "
                           "its teacher; a cascade engine answers locally)")
    if teacher is not None:
        check_teacher(**teacher)


def run_uvicorn(app, socks: list, transport: TransportLimits) -> None:
    """uvicorn on the bound ``socks`` with the transport's limits, its refusals counted into the app's metrics."""
    import uvicorn

    stats = TransportStats()
    app.state.server.metrics.watch_transport(stats)
    options = uvicorn_options(transport, stats)
    server = uvicorn.Server(uvicorn.Config(app, access_log=False, log_level="info", **options))
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
