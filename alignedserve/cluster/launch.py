"""``alignedserve serve --replicas N``: engine replicas on Ray Serve behind this process's
OpenAI-compatible server.

What runs where:
* this process: the HTTP front end (the same FastAPI app as a single-engine server, over a
  ``ReplicatedEngine``), and the Ray Serve request router, which Ray runs inside the process
  that holds the handle;
* Ray: the Serve controller, a stats-board actor, and N ``EngineReplica`` actors, each with
  ``--replica-cpus`` CPUs (and ``--replica-gpus``), placed by Ray on any node of the cluster,
  health-checked and restarted by Ray Serve.

Ray's own HTTP proxies are not started: requests reach the replicas through one hop (front
end -> replica) instead of two (proxy -> ingress replica -> engine replica), and the front end
keeps the single-engine server's admission bound, drain and error handling.

Without ``--ray-address`` a local Ray cluster is started and stopped with the command; with
one (``auto`` or ``HOST:PORT`` of a ``ray start --head``), the command joins that cluster and
on exit removes only what it deployed. SIGTERM: the front end drains (as a single-engine
server does), then the application and, if started here, the local cluster are shut down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import time
from typing import Any

from alignedserve.config import EngineConfig

log = logging.getLogger(__name__)
APP_NAME = "alignedserve"
DEPLOYMENT_NAME = "engine"
BOARD_NAME = "alignedserve-stats"
ROUTERS = ("kv+length", "kv", "ray", "round_robin")
STATS_PERIOD_S = 0.5
_ROUTER_CLASSES = {"kv": "alignedserve.cluster.ray_router.KVAwareRouter",
                   "kv+length": "alignedserve.cluster.ray_router.KVAwareRouter",
                   "round_robin": "alignedserve.cluster.ray_router.RoundRobinRouter"}


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=0,
                   help="engine replicas on Ray Serve behind this server (0: one engine in "
                        "this process, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto' or HOST:PORT) instead of starting one")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: --num-threads, else the "
                        "machine's CPUs divided among the replicas)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica")
    g.add_argument("--router", default="kv+length", choices=ROUTERS,
                   help="how requests are spread: kv+length (default: power of two choices on "
                        "KV load, preferring a replica decoding at the request's length), kv "
                        "(without the length preference), ray (Ray Serve's default), "
                        "round_robin")


def replica_resources(args: argparse.Namespace) -> tuple[float, int]:
    """(CPUs reserved per replica, engine threads per replica)."""
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    cpus = args.replica_cpus
    if cpus is None:
        cpus = float(args.num_threads or max(1, (os.cpu_count() or 1) // args.replicas))
    if cpus <= 0 or args.replica_gpus < 0:
        raise ValueError("--replica-cpus must be > 0 and --replica-gpus >= 0")
    return cpus, args.num_threads or max(1, int(cpus))


def forwarded_env() -> dict[str, str]:
    """The engine's environment knobs, passed to replicas on every node."""
    prefixes = ("ALIGNEDSERVE_", "ONEDNN_")
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def deployment_options(args: argparse.Namespace, per_replica_inflight: int) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    cpus, _ = replica_resources(args)
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "num_replicas": args.replicas,
        "max_ongoing_requests": per_replica_inflight,
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": args.replica_gpus,
                              "runtime_env": {"env_vars": forwarded_env()}},
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 60.0,
        "graceful_shutdown_timeout_s": 5.0,
    }
    router_kwargs = {"policy": args.router} if args.router.startswith("kv") else {}
    router_class = _ROUTER_CLASSES.get(args.router)
    config = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S,
                                 request_routing_stats_timeout_s=10.0,
                                 **({"request_router_class": router_class,
                                     "request_router_kwargs": router_kwargs}
                                    if router_class else {}))
    options["request_router_config"] = config
    return options


def start_ray(args: argparse.Namespace) -> bool:
    """Connect to (or start) Ray; True if this command started the cluster."""
    import ray

    from alignedserve.cluster.stats_board import NAMESPACE

    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False,
                              "log_to_driver": True}
    if args.ray_address:
        ray.init(address=args.ray_address, **kwargs)
        return False
    cpus, _ = replica_resources(args)
    needed = cpus * args.replicas
    have = os.cpu_count() or 1
    if needed > have:
        log.warning("%d replicas x %g CPUs is more than this machine's %d CPUs: they will "
                    "share cores", args.replicas, cpus, have)
    ray.init(num_cpus=max(have, int(needed + 0.999)), **kwargs)
    return True


def deploy(args: argparse.Namespace, config: EngineConfig, model_name: str | None,
           per_replica_inflight: int) -> Any:
    """Start the stats board and the replicas; returns the handle once every replica is up."""
    from ray import serve

    from alignedserve.cluster.replica import EngineReplica
    from alignedserve.cluster.stats_board import start_board

    serve.start(proxy_location="Disabled")
    board = start_board(BOARD_NAME)
    deployment = serve.deployment(EngineReplica).options(
        **deployment_options(args, per_replica_inflight))
    app = deployment.bind(config, model_name, per_replica_inflight, BOARD_NAME)
    started = time.monotonic()
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    log.info("%d replicas up in %.1f s", args.replicas, time.monotonic() - started)
    return handle, board


def wait_for_reports(board: Any, replicas: int, timeout_s: float = 60.0) -> None:
    """Block until every replica has posted once (so /metrics and routing see all of them)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while len(ray.get(board.entries.remote())) < replicas:
        if time.monotonic() > deadline:
            log.warning("not every replica reported within %.0f s; serving anyway", timeout_s)
            return
        time.sleep(STATS_PERIOD_S)


def serve_replicated(args: argparse.Namespace, config: EngineConfig, settings_for,
                     sock: socket.socket) -> int:
    """Run the replicated server on ``sock`` (bound already, so no Ray process takes the
    port) until SIGTERM/SIGINT; ``settings_for(model_names, max_inflight)`` makes the front
    end's ``ServerSettings``."""
    import ray
    from ray import serve

    from alignedserve.cluster.replicated import ReplicatedEngine
    from alignedserve.entrypoints.server import build_app, serve_app

    _, threads = replica_resources(args)
    config = _with_threads(config, threads)
    per_replica = args.max_num_seqs + args.max_queue
    started_cluster = start_ray(args)
    try:
        names = list(args.served_model_name or ([args.model] if args.model else []))
        handle, board = deploy(args, config, names[0] if names else None, per_replica)
        facts = handle.model_facts.remote().result()
        names = names or [facts["name"]]
        wait_for_reports(board, args.replicas)
        backend = ReplicatedEngine(handle, board, facts)
        settings = settings_for(tuple(names), per_replica * args.replicas)
        # uvicorn handles SIGTERM/SIGINT while it runs and re-raises the signal after its
        # graceful shutdown; this handler turns that into a normal exit, so ``finally`` stops
        # the replicas (Ray's own driver handler would exit with status 15 instead).
        signal.signal(signal.SIGTERM, _exit_cleanly)
        signal.signal(signal.SIGINT, _exit_cleanly)
        serve_app(build_app(backend, settings), sock, args.log_level, args.access_log)
    finally:
        stop(started_cluster)
    return 0


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def stop(started_cluster: bool) -> None:
    """Remove what this command deployed. A local cluster is stopped whole (replicas, board,
    controller, Ray's own processes): the front end has drained, so nothing is left to
    lose. On a cluster we joined, only our application is deleted (the board, owned by this
    driver, goes when it disconnects)."""
    import ray
    from ray import serve

    log.info("stopping the replicas")
    try:
        if not started_cluster:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()


def _with_threads(config: EngineConfig, threads: int) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, num_threads=config.num_threads or threads)
