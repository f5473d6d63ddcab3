"""``alignedserve serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

``build_app(engine, settings)`` makes the ASGI app (tests drive it in-process);
``listen_socket`` claims the port; ``serve_app`` runs the app on it under uvicorn with graceful
shutdown; ``add_parser`` registers the CLI subcommand. fastapi/uvicorn and the engine are
imported inside functions so that the CLI (which imports this module to build its parser)
starts fast.

Graceful shutdown on SIGTERM/SIGINT: uvicorn stops accepting connections and waits for open
ones; we mark the server draining (new requests and /health answer 503) and, after
``shutdown_grace_s``, fail whatever still runs with an explicit error (an SSE error event, or
a 503 body), so that no client sees a silently truncated answer. Then the engine stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from alignedserve.entrypoints.server_state import ServerSettings, build_state

if TYPE_CHECKING:
    from fastapi import FastAPI

    from alignedserve.async_engine import AsyncEngine
    from alignedserve.entrypoints.engine_backend import EngineBackend

log = logging.getLogger(__name__)
API_KEY_ENV = "ALIGNEDSERVE_API_KEY"


def build_app(engine: AsyncEngine | EngineBackend, settings: ServerSettings) -> FastAPI:
    """The app over ``engine``: an in-process ``AsyncEngine`` or any ``EngineBackend``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from alignedserve import __version__
    from alignedserve.entrypoints.engine_backend import as_backend
    from alignedserve.entrypoints.http_guards import ApiKeyGuard, BodyGuard
    from alignedserve.entrypoints.openai_errors import install_error_handlers
    from alignedserve.entrypoints.server_routes import api_router

    backend = as_backend(engine)
    state = build_state(backend, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.lifecycle.bind(asyncio.get_running_loop())
        await backend.start()
        yield
        if settings.owns_engine:
            await asyncio.to_thread(backend.shutdown)

    app = FastAPI(title="AlignedServe", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(api_router(settings.ui))
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes)
    if settings.api_key:  # added last = outermost: unauthenticated bodies are never read
        # The console page itself is open (it holds no data and asks for the key); the
        # state endpoints and the API behind it are not.
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key,
                           open_paths=frozenset({"/health", "/"}))
    return app


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, claimed before the model loads or Ray starts: a port
    that is taken fails at once, and no process started meanwhile (Ray's workers open many
    connections, each from an ephemeral port) can take it first. Not inheritable (PEP 446),
    so the processes we start do not hold it."""
    # The family as uvicorn picks it for a host name (so "localhost" stays 127.0.0.1).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def serve_app(app: FastAPI, sock: socket.socket, log_level: str = "info",
              access_log: bool = True) -> None:
    """Run under uvicorn on ``sock`` (from ``listen_socket``) until SIGTERM/SIGINT, draining
    as described in the module docstring; the socket is closed when it returns."""
    import uvicorn

    lifecycle = app.state.server.lifecycle

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            lifecycle.request_drain()
            super().handle_exit(sig, frame)

    # uvicorn's own deadline is a backstop only: our expiry answers every open run first.
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=int(lifecycle.grace_s) + 10)
    with sock:
        DrainingServer(config).run(sockets=[sock])


# ---- command line ------------------------------------------------------------------------------

def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from alignedserve.cluster.launch import add_replica_args
    from alignedserve.entrypoints.args import add_engine_args

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="model directory or .gguf file (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the model's name)")
    g.add_argument("--max-queue", type=int, default=1024,
                   help="sequences that may wait beyond --max-num-seqs before requests get 503")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body accepted (413 beyond)")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request")
    g.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the web console at / (the API is unchanged)")
    add_engine_args(p, serving=True)
    add_replica_args(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from alignedserve.async_engine import AsyncEngine
    from alignedserve.engine import LLMEngine
    from alignedserve.entrypoints.args import engine_config_from_args

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    args.model = args.model_path or args.model
    if args.max_queue < 0 or args.max_body_bytes < 1 or args.shutdown_grace < 0:
        raise ValueError("--max-queue, --max-body-bytes and --shutdown-grace must be positive")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach it can use it",
                    args.host)

    def settings_for(names: tuple[str, ...], max_inflight: int) -> ServerSettings:
        return ServerSettings(model_names=names, api_key=api_key, max_inflight=max_inflight,
                              max_body_bytes=args.max_body_bytes,
                              shutdown_grace_s=args.shutdown_grace, ui=args.ui)

    sock = listen_socket(args.host, args.port)
    if args.replicas:
        from alignedserve.cluster.launch import serve_replicated

        return serve_replicated(args, config, settings_for, sock)
    max_inflight = args.max_num_seqs + args.max_queue
    # The engine thread builds the engine, so one thread does all of the model's torch work.
    # The engine's own bound counts requests; ours counts sequences (>= requests), so the
    # server's 503 always comes first and the engine never refuses what we admitted.
    async_engine = AsyncEngine(lambda: LLMEngine(config), max_pending=max_inflight)
    names = tuple(args.served_model_name or [args.model or async_engine.engine.loaded.name])
    serve_app(build_app(async_engine, settings_for(names, max_inflight)), sock, args.log_level,
              args.access_log)
    return 0
