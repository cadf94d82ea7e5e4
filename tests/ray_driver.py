"""The Ray driver of tests/test_cluster.py, in a process of its own: a local Ray cluster with Serve's HTTP proxy on
the loopback port given, commanded by JSON lines on stdin, answering on stdout.

Why not inside the pytest worker: a Ray driver leaves its gRPC threads behind after ``ray.shutdown()`` and puts
SIGSEGV and SIGABRT back to their default actions, so a fault later in that worker killed it without a traceback.
Here the driver is a process like a user's ``onepass cluster``, and the pytest worker never hosts Ray.

Commands: ``{"op": "deploy", "args": {...}}`` (a fresh application ``onepass`` from ``cluster.build(args)``, its
replicas ready on return) and ``{"op": "replicas"}`` (the live engine replicas' ids). Each answer is one line
``REPLY {"ok": ...}`` or ``REPLY {"error": "..."}``. End of stdin shuts Serve and Ray down.
"""

from __future__ import annotations

import json
import sys

REPLY = "REPLY "


def reply(message: dict) -> None:
    print(REPLY + json.dumps(message), flush=True)


def replica_ids(ray) -> list:
    """From Ray's named actors (Serve names them SERVE_REPLICA::app#deployment#id)."""
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"].rsplit("#", 1)[1] for n in names if "#EngineReplica#" in n["name"])


def main(port: int) -> None:
    import ray
    from ray import serve

    from onepass.runtime.server.cluster import build

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)  # logical CPUs
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        reply({"ok": "ready"})
        for line in sys.stdin:
            command = json.loads(line)
            try:
                if command["op"] == "deploy":
                    serve.delete("onepass")
                    serve.run(build(command["args"]), name="onepass", route_prefix="/")
                    reply({"ok": "deployed"})
                elif command["op"] == "replicas":
                    reply({"ok": replica_ids(ray)})
                else:
                    reply({"error": f"unknown op {command['op']!r}"})
            except Exception as err:  # noqa: BLE001 - the test sees the error in its assertion
                reply({"error": f"{type(err).__name__}: {err}"})
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
