"""What the HTTP server is configured with (``ServerSettings``) and what its route handlers
share (``ServerState``, built by ``build_state`` and kept on ``app.state.server``).

Its own module so that the app builder (``server.py``) and the routes (``server_routes.py``)
both depend on it and not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alignedserve.entrypoints.engine_backend import EngineBackend
    from alignedserve.entrypoints.engine_client import EngineClient, ServerLifecycle
    from alignedserve.entrypoints.engine_state import RecentLatencies
    from alignedserve.entrypoints.openai_prepare import ModelInfo
    from alignedserve.entrypoints.prometheus_metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server-level knobs (the engine has its own EngineConfig).

    ``max_inflight`` bounds the sequences accepted and not yet finished (running + queued in
    the engine); past it requests get 503 + Retry-After instead of an ever-growing queue.
    """

    model_names: tuple[str, ...]
    api_key: str | None = None
    max_inflight: int = 1280
    max_body_bytes: int = 4 << 20
    shutdown_grace_s: float = 30.0
    retry_after_s: int = 1
    owns_engine: bool = True  # shut the AsyncEngine down with the app
    ui: bool = True  # serve the web console at /


@dataclass(slots=True)
class ServerState:
    """Everything the route handlers share, kept on ``app.state.server`` (not in globals)."""

    settings: ServerSettings
    engine: EngineBackend
    client: EngineClient
    info: ModelInfo
    metrics: ServerMetrics
    lifecycle: ServerLifecycle
    latencies: RecentLatencies  # TTFT/TPOT of recently finished requests, for /engine/state


def build_state(engine: EngineBackend, settings: ServerSettings) -> ServerState:
    from alignedserve.entrypoints.engine_client import Admission, EngineClient, ServerLifecycle
    from alignedserve.entrypoints.engine_state import RecentLatencies
    from alignedserve.entrypoints.prometheus_metrics import ServerMetrics

    admission = Admission(settings.max_inflight)
    lifecycle = ServerLifecycle(settings.shutdown_grace_s)

    def server_gauges() -> dict[str, tuple[str, float]]:
        return {"num_sequences_admitted": ("Sequences accepted by the server and not finished.",
                                           admission.in_use),
                "num_sequences_admitted_limit": ("The server's queue bound, in sequences.",
                                                 admission.limit)}

    name = settings.model_names[0]
    metrics = ServerMetrics(name, engine.collector(name, server_gauges))
    latencies = RecentLatencies()

    def observe_request_end(out) -> None:
        metrics.observe_request_end(out)
        latencies.observe(out)

    client = EngineClient(engine, admission, lifecycle, observe_request_end,
                          metrics.observe_rejected, settings.retry_after_s)
    return ServerState(settings, engine, client, engine.model_info(), metrics, lifecycle,
                       latencies)
