"""What the HTTP server needs of whatever runs the model: ``EngineBackend``.

Two kinds exist: ``InProcessEngine`` (one ``AsyncEngine`` in this process, the default
``alignedserve serve``) and ``alignedserve.cluster.replicated.ReplicatedEngine`` (engine
replicas on Ray Serve, ``serve --replicas N``). The routes, admission, drain and error handling
are the same code for both; only this surface differs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from alignedserve.async_engine import AsyncEngine
    from alignedserve.entrypoints.engine_state import RecentLatencies
    from alignedserve.entrypoints.openai_prepare import ModelInfo
    from alignedserve.outputs import RequestOutput
    from alignedserve.sampling_params import SamplingParams

ExtraGauges = Callable[[], dict[str, tuple[str, float]]]


class EngineBackend(Protocol):
    """The engine as the server sees it.

    ``generate`` streams cumulative outputs until one is finished, raises ValueError for an
    invalid request, ``EngineOverloaded`` / ``EngineDead`` when it cannot take one; leaving
    the stream early aborts the request (its KV is freed).
    """

    @property
    def is_running(self) -> bool: ...

    def generate(self, request_id: str, prompt: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    def model_info(self) -> ModelInfo: ...

    def collector(self, model_name: str, extra_gauges: ExtraGauges) -> Collector:
        """Prometheus engine series (queues, KV, steps, alignment), read at scrape time."""
        ...

    def snapshot(self, model_name: str, latencies: RecentLatencies) -> dict[str, Any]:
        """The ``/engine/state`` document."""
        ...

    async def start(self) -> None:
        """Called once on the server's event loop before the first request."""
        ...

    def shutdown(self) -> None: ...


class InProcessEngine:
    """An ``AsyncEngine`` in this process as an ``EngineBackend``."""

    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine

    @property
    def is_running(self) -> bool:
        return self.async_engine.is_running

    def generate(self, request_id: str, prompt: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self.async_engine.generate(request_id, prompt, params)

    def model_info(self) -> ModelInfo:
        from alignedserve.entrypoints.openai_prepare import ModelInfo

        return ModelInfo.of(self.async_engine.engine)

    def collector(self, model_name: str, extra_gauges: ExtraGauges) -> Collector:
        from alignedserve.entrypoints.prometheus_metrics import EngineCollector

        return EngineCollector(self.async_engine.engine, model_name, extra_gauges)

    def snapshot(self, model_name: str, latencies: RecentLatencies) -> dict[str, Any]:
        from alignedserve.entrypoints.engine_state import engine_snapshot

        return engine_snapshot(self.async_engine.engine, model_name, latencies)

    async def start(self) -> None:
        pass  # the engine thread started with the AsyncEngine

    def shutdown(self) -> None:
        self.async_engine.shutdown()


def as_backend(engine: AsyncEngine | EngineBackend) -> EngineBackend:
    """``engine`` itself if it is a backend already, else an ``AsyncEngine`` wrapped in one."""
    return engine if hasattr(engine, "model_info") else InProcessEngine(engine)
