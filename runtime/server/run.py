"""`onepass serve` as a function: the start-up steps (bind, first-start export and TensorRT plan, engine, limits,
cascade) and uvicorn with the transport's limits. The command only parses its flags into these arguments.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from ..engine import Engine
from ..errors import OnepassError
from .config import ServerConfig
from .transport import TransportLimits, listen


def serve(engine_dir: str, config: ServerConfig, transport: TransportLimits | None = None, *, backend: str = "auto",
          threads: int | None = None, cache_mib: int = 512, limits: dict | None = None,
          max_request_tokens: int | None = None, cascade: str | None = None, min_confidence: float | None = None,
          exporter=None, build_trt_if_missing: bool = False) -> None:
    """Serve ``engine_dir`` until stopped (Ctrl-C or SIGTERM: uvicorn's graceful shutdown). ``limits`` lowers the
    engine's (max_state_tokens, max_packed_tokens, max_questions, max_options); ``max_request_tokens`` is the
    packed tokens one request may take over its passes (default: one pass's). With ``cascade``, questions answered
    below ``min_confidence`` are asked again of that engine. ``exporter`` (the export package's export_engine; the
    runtime never imports export) writes the default model into ``engine_dir`` on a first start where it holds no
    engine. The port is bound first: a taken one is an error before any engine loads."""
    import uvicorn

    from .app import create_app, server_engine

    if (cascade is None) != (min_confidence is None):  # refused before any export or engine load
        raise OnepassError("--cascade DIR and --min-confidence go together: questions answered below the "
                           "confidence are asked again of the cascade engine")
    transport = transport or TransportLimits()
    socks = listen(config.host, config.port)
    if exporter is not None and not (Path(engine_dir) / "manifest.json").exists():
        exporter(engine_dir)  # first start on this device: the default model, cached in the volume
    if build_trt_if_missing and backend == "tensorrt":  # the images' default; moot for other backends
        from ..backends.tensorrt_build import build_native_plan_if_missing

        build_native_plan_if_missing(Path(engine_dir))
    engine = Engine.load(engine_dir, threads=threads, cache_bytes=cache_mib << 20, backend=backend)
    engine = server_engine(engine.with_limits(**(limits or {})), max_request_tokens)
    second = Engine.load(cascade, threads=threads) if cascade else None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onepass.serve").info("serving %s on the %s backend", engine.name, engine.backend.name)
    app = create_app(engine, config, cascade=second, min_confidence=min_confidence)
    server = uvicorn.Server(uvicorn.Config(app, access_log=False, log_level="info", **transport.uvicorn_options()))
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
