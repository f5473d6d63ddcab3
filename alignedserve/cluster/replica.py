"""One engine replica as a Ray Serve deployment: ``EngineReplica``.

Each replica is its own process (a Ray actor) with its own ``AsyncEngine``, KV budget and
threads. The front end (``cluster/replicated.py``) calls it through a Ray Serve handle:

* ``generate`` streams the engine's cumulative outputs. When the front end reads slower than
  the engine steps, only the newest of the waiting outputs is sent: they are cumulative, so
  nothing is lost, and the Ray hop costs one message per read instead of one per step.
  Leaving the stream (the front end cancels it when its client is gone) aborts the request.
* ``record_routing_stats`` is called by Ray Serve every ``request_routing_stats_period_s``;
  it answers what the router ranks replicas by (``routing.ReplicaLoad``) and, as a side
  effect, posts this replica's engine snapshot and Prometheus series to the stats board
  (``cluster/stats_board.py``) that the front end's ``/metrics`` and ``/engine/state`` read.
* ``check_health`` fails once the engine has stopped or, by default, once one of its steps
  failed: a replica is cheap to replace and its siblings serve meanwhile, so Ray restarts it
  fresh rather than let it go on in a state a failed step may have left.

Test-only fault injection: with ``ALIGNEDSERVE_INJECT_STEP_FAILURE_TOKEN=<id>`` in the
environment, the next engine step after a request whose prompt contains that token id is
received raises. It is off unless that variable is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from alignedserve.cluster.routing import ReplicaLoad, group_lengths
from alignedserve.config import EngineConfig
from alignedserve.entrypoints.prometheus_metrics import racy_read
from alignedserve.outputs import RequestOutput
from alignedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
FAULT_TOKEN_ENV = "ALIGNEDSERVE_INJECT_STEP_FAILURE_TOKEN"


class EngineReplica:
    """An ``AsyncEngine`` serving requests a Ray Serve router sends it (see module docstring)."""

    def __init__(self, config: EngineConfig, model_name: str | None, max_pending: int,
                 board_name: str | None = None, restart_on_step_failure: bool = True,
                 make_engine: Callable[[], Any] | None = None):
        """``make_engine`` builds the engine (default: ``LLMEngine(config)``; tests pass a
        fake one)."""
        from alignedserve.async_engine import AsyncEngine
        from alignedserve.engine import LLMEngine
        from alignedserve.entrypoints.engine_state import RecentLatencies
        from alignedserve.entrypoints.prometheus_metrics import EngineCollector

        self.replica_id = _replica_id()
        self.restart_on_step_failure = restart_on_step_failure
        self.engine = AsyncEngine(make_engine or (lambda: LLMEngine(config)),
                                  max_pending=max_pending)
        self.model_name = model_name or self.engine.engine.loaded.name
        self._collector = EngineCollector(self.engine.engine, self.model_name)
        self._latencies = RecentLatencies()
        self._received_tokens = 0  # prompt tokens of every request ever given (routing)
        self._unprefilled: dict[str, int] = {}  # request id -> prompt tokens, until 1st output
        self._board = _stats_board(board_name)
        self._fault_token = _fault_token()
        self._fail_next_step = False
        if self._fault_token is not None:
            self._arm_fault_injection()
        log.info("replica %s: engine up (%s)", self.replica_id, self.engine.engine.kernels.name)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       prompt_tokens: int | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, newest only when several are waiting.
        (``prompt_tokens`` is for the router, which reads the call's arguments.)"""
        self._received_tokens += len(prompt)
        self._unprefilled[request_id] = len(prompt)
        if self._fault_token is not None and self._fault_token in prompt:
            self._fail_next_step = True
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(request_id, prompt, params, queue))
        try:
            while True:
                item = await queue.get()
                while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
                    item = queue.get_nowait()  # cumulative outputs: the newest says it all
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._unprefilled.pop(request_id, None)
                yield item
                if item.finished:
                    self._latencies.observe(item)
                    return
        finally:
            self._unprefilled.pop(request_id, None)
            pump.cancel()  # leaving early aborts the engine request (AsyncEngine.generate)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump

    async def _pump(self, request_id: str, prompt: list[int], params: SamplingParams,
                    queue: asyncio.Queue) -> None:
        try:
            async for out in self.engine.generate(request_id, prompt, params):
                queue.put_nowait(out)
        except Exception as exc:  # handed to the reader, who raises it to the front end
            queue.put_nowait(exc)
        queue.put_nowait(None)

    def healthy(self) -> bool:
        if not self.engine.is_running:
            return False
        return not (self.restart_on_step_failure and self.engine.failed_steps)

    def check_health(self) -> None:
        """Ray Serve's health check: raising marks this replica for replacement."""
        if not self.healthy():
            raise RuntimeError(f"replica {self.replica_id}: the engine "
                               f"{'stopped' if not self.engine.is_running else 'failed a step'}")

    def load(self) -> ReplicaLoad:
        engine = self.engine.engine
        store = engine.store
        capacity = sum(store.total(t) for t in store.device_tiers) or 1
        held = sum(store.used(t) for t in store.tiers)
        groups = group_lengths(racy_read(engine.scheduler.decode_groups, []))
        return ReplicaLoad(self.replica_id, held + sum(self._unprefilled.values()), capacity,
                           racy_read(engine.scheduler.num_running, 0),
                           racy_read(engine.scheduler.num_waiting, 0), groups,
                           self._received_tokens)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve calls this periodically; the dict reaches the router as ``routing_stats``."""
        stats = {**self.load().to_stats(), "healthy": self.healthy(), "time": time.time()}
        if self._board is not None:
            self._board.put.remote(self.replica_id, self.board_entry())
        return stats

    def board_entry(self) -> dict[str, Any]:
        """This replica's engine snapshot and Prometheus families, for the front end."""
        from alignedserve.entrypoints.engine_state import engine_snapshot

        snapshot = engine_snapshot(self.engine.engine, self.model_name, self._latencies)
        return {"time": time.time(),
                "snapshot": {**snapshot, "replica": self.replica_id, "pid": os.getpid()},
                "families": list(self._collector.collect())}

    def model_facts(self) -> dict[str, Any]:
        """What a front end without the model needs to check and tokenize requests."""
        engine = self.engine.engine
        return {"tokenizer": engine.tokenizer, "vocab_size": engine.loaded.config.vocab_size,
                "max_model_len": engine.max_model_len, "kernel_path": engine.kernels.name,
                "name": engine.loaded.name}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown(timeout=5)

    def _arm_fault_injection(self) -> None:
        engine = self.engine.engine
        step = engine.step

        def step_or_fail():
            if self._fail_next_step:
                self._fail_next_step = False
                raise RuntimeError("injected step failure (test)")
            return step()

        engine.step = step_or_fail


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray Serve (unit tests): one replica in this process
        return f"local-{os.getpid()}"


def _stats_board(name: str | None) -> Any:
    if name is None:
        return None
    import ray

    from alignedserve.cluster.stats_board import NAMESPACE

    return ray.get_actor(name, namespace=NAMESPACE)


def _fault_token() -> int | None:
    value = os.environ.get(FAULT_TOKEN_ENV)
    return int(value) if value else None
