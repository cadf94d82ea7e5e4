"""One source of settings: every default of `onepass serve` and `onepass cluster` is the settings classes' own
(``EngineConfig``, ``ServerConfig``, ``TransportLimits``), so are `tune`'s, `distill`'s and `export`'s (``TuneConfig``,
``TeacherConfig``, the manifest's ``Limits``), and ``AsyncEngine`` and the library's ``serve`` and
``cluster.run`` take theirs from the same classes. Negative control: a flag whose default was written by hand and
differs is found."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from onepass.flags import parser
from onepass.runtime.core.config import EngineConfig
from onepass.calibration.tune.config import TuneConfig
from onepass.runtime.core.manifest import Limits
from onepass.runtime.server.config import ServerConfig, TransportLimits
from onepass.runtime.teacher.client import TeacherConfig

# flag dest -> (settings class, field)
FLAGS = {
    "backend": (EngineConfig, "backend"), "threads": (EngineConfig, "threads"),
    "cache_mib": (EngineConfig, "cache_mib"),
    "host": (ServerConfig, "host"), "port": (ServerConfig, "port"), "max_body_bytes": (ServerConfig, "max_body_bytes"),
    "max_queue": (ServerConfig, "max_queue"), "batch_window_ms": (ServerConfig, "batch_window_ms"),
    "max_batch": (ServerConfig, "max_batch"), "request_timeout": (ServerConfig, "request_timeout_s"),
    "header_timeout": (TransportLimits, "header_timeout_s"), "body_timeout": (TransportLimits, "body_timeout_s"),
    "keep_alive": (TransportLimits, "keep_alive_s"), "max_header_bytes": (TransportLimits, "max_header_bytes"),
    "max_connections": (TransportLimits, "max_connections"),
    "max_connections_per_client": (TransportLimits, "max_connections_per_client"),
    "framing_penalty": (TransportLimits, "framing_penalty_s"), "client_header": (ServerConfig, "client_header"),
}
CLUSTER_OWN = {"threads": 1}  # a replica's one Ray CPU: one thread, the cluster's documented default


def _differences(args, flags: dict, own: dict | None = None) -> list[str]:
    own = own or {}
    return [f"--{dest.replace('_', '-')} defaults to {getattr(args, dest)!r}, {cls.__name__}.{name} to "
            f"{own.get(dest, getattr(cls(), name))!r}"
            for dest, (cls, name) in flags.items()
            if hasattr(args, dest) and getattr(args, dest) != own.get(dest, getattr(cls(), name))]


def test_the_serve_flags_default_to_the_settings():
    args = parser().parse_args(["serve", "--engine", "e"])
    assert all(hasattr(args, dest) for dest in FLAGS), [d for d in FLAGS if not hasattr(args, d)]
    assert _differences(args, FLAGS) == []


def test_the_cluster_flags_default_to_the_settings():
    args = parser().parse_args(["cluster", "--engine", "e"])
    engine_and_http = [d for d, (cls, _) in FLAGS.items() if cls is not TransportLimits and d != "backend"]
    assert all(hasattr(args, dest) for dest in engine_and_http), [d for d in engine_and_http if not hasattr(args, d)]
    assert _differences(args, FLAGS, CLUSTER_OWN) == []


def test_max_batch_reaches_the_server_settings_of_serve_and_cluster():
    from onepass.cli import _server_config

    for command in ("serve", "cluster"):
        args = parser().parse_args([command, "--engine", "e", "--max-batch", "4"])
        assert _server_config(args).max_batch == 4


TUNE_FLAGS = {name: (TuneConfig, name) for name in ("method", "rank", "write", "lora_min_rows", "batch_questions",
                                                     "holdout", "max_state_tokens", "seed", "head_depths")}
TEACHER_FLAGS = {"teacher_kind": "kind", "teacher_timeout": "timeout_s", "teacher_concurrency": "max_concurrency"}


def test_the_tune_distill_and_export_flags_default_to_the_settings():
    tune = parser().parse_args(["tune", "--engine", "e", "--data", "d", "--out", "o"])
    assert _differences(tune, TUNE_FLAGS) == [] and all(hasattr(tune, d) for d in TUNE_FLAGS)
    distill = parser().parse_args(["distill", "--engine", "e", "--states", "s", "--questions", "q", "--out", "o",
                                   "--teacher", "http://t"])
    teacher = {f.name: f.default for f in dataclasses.fields(TeacherConfig)}
    assert {d: getattr(distill, d) for d in TEACHER_FLAGS} == {d: teacher[f] for d, f in TEACHER_FLAGS.items()}
    export = parser().parse_args(["export", "--out", "o"])
    assert (export.max_questions, export.max_options) == (Limits().max_questions, Limits().max_options)


def test_a_default_written_by_hand_is_found():
    """Negative control: a serve parser whose --max-queue default is 256 (AsyncEngine's once) differs."""
    p = parser()
    serve = next(a for a in p._subparsers._group_actions[0].choices.values() if a.prog.endswith(" serve"))
    serve.set_defaults(max_queue=256)
    found = _differences(p.parse_args(["serve", "--engine", "e"]), FLAGS)
    assert found == ["--max-queue defaults to 256, ServerConfig.max_queue to 64"]


def test_the_library_takes_the_same_defaults():
    pytest.importorskip("ray", reason="the cluster extra is not installed")
    pytest.importorskip("uvicorn", reason="the server extra is not installed")
    from onepass.runtime.core.engine import DEFAULT_CACHE_BYTES
    from onepass.runtime.server import cluster, run
    from onepass.runtime.server.embed import AsyncEngine

    server = ServerConfig()
    params = inspect.signature(AsyncEngine).parameters
    assert (params["window_ms"].default, params["max_queue"].default, params["max_batch"].default,
            params["timeout_s"].default) == (server.batch_window_ms, server.max_queue, server.max_batch,
                                              server.request_timeout_s)
    assert DEFAULT_CACHE_BYTES == EngineConfig().cache_bytes  # Engine.load's own default
    assert inspect.signature(run.serve).parameters["engine_config"].default is None  # None: EngineConfig()
    assert len(inspect.signature(run.serve).parameters) <= 9
    assert cluster.ClusterConfig(engine="e").engine_config == {"threads": 1}


@pytest.mark.parametrize("bad, match", [({"threads": -1}, "threads"), ({"cache_mib": -1}, "cache_mib"),
                                        ({"backend": "cuda"}, "backend"), ({"limits": {"max_tokens": 1}}, "limits")])
def test_engine_settings_are_checked_when_made(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)
    assert dataclasses.replace(EngineConfig(), limits={"max_questions": 8}).limits == {"max_questions": 8}
    assert EngineConfig(threads=0).threads is None  # --threads 0: the backend's own choice, as it always was


@pytest.mark.parametrize("make, bad, match", [
    (EngineConfig, {"limits": {"max_options": 1}}, "max_options must be an integer of at least 2"),
    (EngineConfig, {"limits": {"max_request_tokens": 0}}, "max_request_tokens must be an integer of at least 64"),
    (EngineConfig, {"limits": {"max_state_tokens": 10}}, "max_state_tokens must be an integer of at least 64"),
    (TransportLimits, {"max_header_bytes": 10}, "max_header_bytes must be at least 1024"),
    (ServerConfig, {"max_body_bytes": 10}, "max_body_bytes must be at least 1024"),
    (ServerConfig, {"client_header": "x api key"}, "client_header must be an HTTP header name"),
])
def test_settings_under_their_usable_minimum_are_refused_at_start(make, bad, match):
    """A setting below which every request would be refused is an error when the server starts (--max-header-bytes
    10, --max-options 1 were accepted, --max-request-tokens 0 silently meant the default). The controls: each at
    its minimum is accepted."""
    with pytest.raises(ValueError, match=match):
        make(**bad)
    (name, value), = (bad["limits"] if "limits" in bad else bad).items()
    least = {"max_options": 2, "max_request_tokens": 64, "max_state_tokens": 64, "max_header_bytes": 1024,
             "max_body_bytes": 1024, "client_header": "x-api-key"}[name]
    made = make(**({"limits": {name: least}} if "limits" in bad else {name: least}))
    assert (made.limits[name] if "limits" in bad else getattr(made, name)) == least


def test_serve_refuses_an_unusable_flag_in_one_line(tmp_path, capsys):
    """`onepass serve --max-header-bytes 10` is a one-line error and exit 2, before any engine is loaded."""
    from onepass.cli import main

    assert main(["serve", "--engine", str(tmp_path / "none"), "--max-header-bytes", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_header_bytes must be at least 1024" in err[0], err
