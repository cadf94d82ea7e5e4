"""onepass on Ray Serve: replicas of the HTTP server behind one ingress that routes by state.

The expensive part of a request is prefilling its state; the replica that already holds a state's K/V
answers the next request about it in one cheap pass. So the ingress keeps requests about one state on one
replica, over Ray Serve's consistent-hash router (experimental in Ray 2.60, hence the pinned version):

* ``Ingress`` (one replica, no CPU reserved) reads the raw body (bounded by ``max_body_bytes`` before any
  work), derives the routing key — a hash of the state's canonical text, the text whose tokens key each
  replica's state cache — and forwards the untouched request to an ``EngineReplica`` with that key as the
  Serve session id. A body it cannot parse is forwarded without a key: the replica answers the error.
  A replica that dies mid-request (``ActorDiedError``) is dropped from the ingress's ring at once and the
  request is retried on the ring's next replica, so clients see no failure; Serve starts a replacement.
* ``EngineReplica`` is today's server: the same FastAPI app as ``onepass serve`` (its engine, state cache,
  request merging, bounded deadline-aware queue, limits, errors, API key, zstd/gzip bodies), called
  in-process over ASGI. It warms up before Serve hands it traffic, ``check_health`` fails once its
  engine thread is gone, and every response names it (``x-onepass-replica``) and says whether its state
  was cached (``x-onepass-state-cache``).
* ``/metrics`` on the ingress: Prometheus multiprocess aggregation over every replica's counters and
  histograms (the server's own metrics, summed), plus per-replica state-cache hits and misses.

``build`` is a Serve application builder: ``onepass cluster`` calls it, and so does ``serve deploy``
with ``docker/ray-serve.yaml`` (the same file a KubeRay RayService embeds on Kubernetes).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.config import EngineConfig
from ..core.errors import OnepassError
from ..core.prompt import state_text
from .app import STATE_CACHE, create_app, served_engine
from .body import decode, parse_json, read_raw
from .config import ServerConfig
from .errors import InternalError, NotFound, NotReady, error_response, status_of
from .metrics import MULTIPROC_ENV

REPLICA = "x-onepass-replica"
HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"}


REPLICA_ENGINE = {"threads": 1}  # a replica's engine settings unless told otherwise: one thread, its one Ray CPU


@dataclass(frozen=True)
class ClusterConfig:
    """How the replicas are sized and routed; ``server`` holds what ``onepass serve`` takes (validated there)."""

    engine: str
    replicas: int = 2
    autoscale: tuple | None = None  # (min, max) replicas: Serve's autoscaler, instead of a fixed count
    routing: str = "state"  # "state": consistent hash of the state; "default": Serve's own router
    cpus_per_replica: float = 1.0  # Ray's logical CPUs reserved per replica
    engine_config: dict = field(default_factory=lambda: dict(REPLICA_ENGINE))  # EngineConfig's fields per replica
    retries: int = 1  # a request whose replica died is retried this often on the ring's next replica
    metrics_dir: str | None = None  # Prometheus multiprocess directory shared by the ingress and replicas
    server: dict = field(default_factory=dict)

    def __post_init__(self):
        EngineConfig(**self.engine_config)  # refused here, before any replica starts
        if self.routing not in ("state", "default"):
            raise ValueError(f"routing must be 'state' or 'default', got {self.routing!r}")
        if self.autoscale is None and self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 1 <= low <= high:
                raise ValueError(f"autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {low}:{high}")
        if self.cpus_per_replica <= 0:
            raise ValueError("cpus_per_replica must be positive")
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        ServerConfig(**self.server)  # the server settings fail here, before any replica starts


def _metrics_dir() -> None:
    """Create this node's Prometheus multiprocess directory (the builder named it, maybe on another node)."""
    if os.environ.get(MULTIPROC_ENV):
        os.makedirs(os.environ[MULTIPROC_ENV], exist_ok=True)


def state_key(raw: bytes, encoding: str, limit: int) -> str | None:
    """The routing key of a raw System One body: a hash of its state's canonical text (requests with equal keys
    share a replica, hence its cached K/V); None for a body the replica will refuse anyway."""
    try:
        data = parse_json(decode(raw, encoding, limit))
        text = state_text(data["state"])
    except (OnepassError, KeyError, TypeError):
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


async def call_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple:
    """(status, raw headers, body) of one request answered by an ASGI app in this process. Hand-written because
    it is this small: an HTTP client's in-process transport (httpx) would be a dependency for it."""
    done = asyncio.Event()
    response: dict = {"status": status_of(InternalError("no response")), "headers": [], "body": []}
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client stays connected until the response is complete
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            response["status"], response["headers"] = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            response["body"].append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode("latin-1"), "query_string": query, "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return response["status"], response["headers"], b"".join(response["body"])


class EngineReplica:
    """One replica: the ``onepass serve`` app over its own engine, answering forwarded requests."""

    def __init__(self, config: dict):
        cfg = ClusterConfig(**config)
        _metrics_dir()
        engine = served_engine(cfg.engine, EngineConfig(**cfg.engine_config))
        self.app = create_app(engine, ServerConfig(**cfg.server), warm=False)
        self.server = self.app.state.server
        self.server.warm_up()  # Serve hands a replica traffic only once its constructor returns
        context = serve.get_replica_context()
        self.replica = f"{context.replica_id.unique_id}:{os.getpid()}"  # stable for the replica's life
        self.states = Counter("onepass_cluster_state_cache", "Requests answered by each replica, by whether "
                              "their state was in its cache", ["replica", "result"], registry=None)

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple:
        """Answer one request exactly as ``onepass serve`` would, naming this replica."""
        status, out, content = await call_asgi(self.app, method, path, query, headers, body)
        for name, value in out:
            if name == STATE_CACHE.encode():
                self.states.labels(self.replica, value.decode()).inc()
        return status, out + [(REPLICA.encode(), self.replica.encode())], content

    def check_health(self) -> None:
        """Serve's health check: the engine thread must be running (a replica without it only queues)."""
        if not self.server.dispatcher.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.dispatcher.close()


class Ingress:
    """HTTP entry: bounded read, routing key, forward with retry; health and aggregated metrics itself."""

    def __init__(self, replicas, config: dict):
        self.replicas = replicas
        self.cfg = ClusterConfig(**config)
        _metrics_dir()
        self.limit = ServerConfig(**self.cfg.server).max_body_bytes
        self.retried = Counter("onepass_cluster_retries", "Requests retried on the next replica because theirs "
                               "died", registry=None)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/healthz":
            return JSONResponse({"status": "ok"})
        if path == "/metrics":
            return self.metrics()
        try:
            raw = await read_raw(request, self.limit)
        except OnepassError as err:
            return error_response(err)
        key = None
        if path == "/v1/systemone" and request.method == "POST":
            key = state_key(raw, request.headers.get("content-encoding", ""), self.limit)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_BY_HOP]
        handle = self.replicas.options(session_id=key) if key and self.cfg.routing == "state" else self.replicas
        for attempt in range(self.cfg.retries + 1):
            try:
                status, out, content = await handle.forward.remote(request.method, path, request.url.query.encode(),
                                                                   headers, raw)
                break
            except (ActorDiedError, ActorUnavailableError):
                self.retried.inc()
                if attempt == self.cfg.retries:  # Serve's router has dropped the dead replica from the ring
                    return error_response(NotReady("no replica could answer; retry later"))
        response = Response(content, status_code=status)
        response.raw_headers = [(k, v) for k, v in out if k.lower() not in HOP_BY_HOP]
        return response

    def metrics(self) -> Response:
        """Every replica's counters and histograms, summed (Prometheus multiprocess), and per-replica cache counts."""
        if not os.environ.get(MULTIPROC_ENV):
            return error_response(NotFound("metrics are off: no multiprocess directory"))
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def replica_engine_config(config: dict) -> dict:
    """A replica's EngineConfig fields from a deploy config (``config`` loses the top-level ones): ``engine_config``
    with one thread per replica unless it says otherwise, and the ``threads``/``cache_mib``/``backend`` that deploy
    files written before ``engine_config`` put at the top (each given once)."""
    legacy = {k: config.pop(k) for k in ("threads", "cache_mib", "backend") if k in config}
    given = config.get("engine_config") or {}
    both = sorted(set(legacy) & set(given))
    if both:
        raise ValueError(f"{', '.join(both)} given both at the top and in engine_config: give each once")
    return {**REPLICA_ENGINE, **given, **legacy}


def build(config: dict):
    """The Serve application: an ingress in front of the engine replicas (a Serve application builder)."""
    config = dict(config)
    config["engine_config"] = replica_engine_config(config)
    if isinstance(config.get("autoscale"), list):
        config["autoscale"] = tuple(config["autoscale"])
    if not config.get("metrics_dir"):
        config["metrics_dir"] = tempfile.mkdtemp(prefix="onepass-metrics-")
    cfg = ClusterConfig(**config)
    env = {"runtime_env": {"env_vars": {MULTIPROC_ENV: cfg.metrics_dir}}}
    options: dict = {"ray_actor_options": {"num_cpus": cfg.cpus_per_replica, **env},
                     "max_ongoing_requests": ServerConfig(**cfg.server).max_queue,
                     "health_check_period_s": 2.0, "health_check_timeout_s": 30.0}
    if cfg.autoscale is not None:
        options["autoscaling_config"] = {"min_replicas": cfg.autoscale[0], "max_replicas": cfg.autoscale[1],
                                         "target_ongoing_requests": 4}
    else:
        options["num_replicas"] = cfg.replicas
    if cfg.routing == "state":
        options["request_router_config"] = RequestRouterConfig(request_router_class=HASH_ROUTER)
    replicas = serve.deployment(EngineReplica).options(name="EngineReplica", **options).bind(asdict(cfg))
    ingress = serve.deployment(Ingress).options(name="Ingress", num_replicas=1, max_ongoing_requests=1000,
                                                ray_actor_options={"num_cpus": 0, **env})
    return ingress.bind(replicas, asdict(cfg))


def serve_until_stopped(config: dict, host: str, port: int, stop, address: str | None = None,
                        num_cpus: int | None = None, on_ready=None) -> None:
    """Start Ray (or join ``address``), run :func:`build`'s application on ``host:port``, call ``on_ready()``, and
    serve until ``stop`` (a threading.Event: ``onepass cluster`` sets it on SIGINT or SIGTERM) is set. Then Serve
    and Ray are shut down and every process this one started is gone: what ``ray.shutdown()`` leaves running (its
    dashboard and runtime-env agents) is ended (runtime/server/processes.py)."""
    import ray

    from ..core.interrupt import stop_signals_set
    from .processes import descendants, end

    ClusterConfig(**config)  # bad settings fail here, before Ray starts
    before = descendants()  # a caller's own children are not ours to end
    started: dict = {}
    try:
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False)
        with stop_signals_set(stop):  # again: ray.init installed its own SIGTERM handler (which exits at once)
            serve.start(http_options={"host": host, "port": port})
            serve.run(build(config), name="onepass", route_prefix="/")
            if on_ready is not None and not stop.is_set():
                on_ready()
            while not stop.wait(0.5):
                started.update(descendants())  # Ray starts workers and agents as it goes
    finally:
        import threading

        with stop_signals_set(threading.Event()):  # a second SIGINT or SIGTERM cannot cut the clean-up short
            started.update(descendants())
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
            if not address:  # a cluster we joined is not ours to end
                end({pid: t for pid, t in started.items() if before.get(pid) != t})


def autoscale_range(text: str | None) -> tuple | None:
    """``MIN:MAX`` replicas as a tuple (None stays None)."""
    if text is None:
        return None
    low, sep, high = text.partition(":")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()):
        raise OnepassError(f"--autoscale must be MIN:MAX replicas (e.g. 1:4), got {text!r}")
    return int(low), int(high)


def run(engine_dir: str, server: ServerConfig, engine_config: EngineConfig | None = None, *, replicas: int = 2,
        autoscale: str | None = None, routing: str = "state", address: str | None = None, num_cpus: int | None = None,
        cpus_per_replica: float = 1.0, retries: int = 1, echo=print) -> None:
    """`onepass cluster`: serve ``engine_dir`` from replicas on Ray Serve until SIGINT or SIGTERM (SIGINT also when
    inherited ignored, as in a script's background job), then stop Serve and Ray and every process started here.
    ``engine_config``: each replica's engine settings (default: one thread per replica, as its one logical CPU)."""
    import shutil
    import threading

    from ..core.interrupt import stop_signals_set

    engine = Path(engine_dir).resolve()
    if not (engine / "manifest.json").is_file():
        raise OnepassError(f"{engine_dir} holds no engine (no manifest.json); run `onepass export --out "
                           f"{engine_dir}` first")
    metrics_dir = tempfile.mkdtemp(prefix="onepass-metrics-")
    config = dict(engine=str(engine), replicas=replicas, autoscale=autoscale_range(autoscale), routing=routing,
                  cpus_per_replica=cpus_per_replica,
                  engine_config=asdict(engine_config or EngineConfig(**REPLICA_ENGINE)), retries=retries,
                  metrics_dir=metrics_dir, server=asdict(server))
    size = f"{autoscale} replicas (autoscaled)" if autoscale else f"{replicas} replicas"
    stop = threading.Event()
    try:
        with stop_signals_set(stop):
            serve_until_stopped(config, server.host, server.port, stop, address=address, num_cpus=num_cpus,
                                on_ready=lambda: echo(f"onepass cluster: {engine.name} on http://{server.host}:"
                                                      f"{server.port} with {size}, routing by {routing}; Ctrl-C or "
                                                      "SIGTERM stops it", flush=True))
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    echo("onepass cluster: stopped", flush=True)
