"""The front end's view of engine replicas on Ray Serve: ``ReplicatedEngine``, an
``EngineBackend`` (``entrypoints/engine_backend.py``), so the HTTP server's routes, admission,
drain and error handling run unchanged in front of N replicas.

* ``generate`` calls the replicas' ``generate`` through a streaming Ray Serve handle; the
  request router (``cluster/ray_router.py``) picks the replica, from ``prompt_tokens`` among
  others. If the chosen replica dies before the request's first output, the request is sent
  once more (nothing was delivered, so nothing is repeated); after that, the stream ends with
  ``ReplicaLost``, which the server turns into an explicit error (an SSE error event).
  Leaving the stream early cancels the Ray call, which aborts the request on its replica.
* ``/metrics`` and ``/engine/state`` read the stats board (``cluster/stats_board.py``), which
  a background task copies every ``refresh_s``: every engine series gets a ``replica`` label,
  and the state document sums the replicas' counts (``replicas`` lists each one's own).
* ``is_running``: false once shut down or when no replica has posted for the board's staleness
  bound (every one is dead or wedged); ``/health`` answers 503 then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from alignedserve.entrypoints.engine_backend import ExtraGauges
from alignedserve.entrypoints.engine_state import RecentLatencies
from alignedserve.entrypoints.openai_prepare import ModelInfo
from alignedserve.entrypoints.prometheus_metrics import P
from alignedserve.outputs import RequestOutput
from alignedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ReplicaLost(Exception):
    """The replica serving a request stopped after the request had produced output."""


def _replica_failure_types() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (ActorDiedError, ActorUnavailableError, RayActorError)


class ReplicatedEngine:
    """Engine replicas behind a Ray Serve handle, as one ``EngineBackend``."""

    def __init__(self, handle: Any, board: Any, facts: dict[str, Any], refresh_s: float = 0.5):
        self._handle = handle
        self._board = board
        self._facts = facts
        self.refresh_s = refresh_s
        self._entries: dict[str, dict[str, Any]] = {}
        self._refresher: asyncio.Task | None = None
        self._stopped = False
        self._lost = _replica_failure_types()

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self._refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def _refresh(self) -> None:
        try:
            self._entries = await self._board.entries.remote()
        except Exception:  # the board is gone: Ray is shutting down; keep the last view
            log.warning("could not read the replicas' stats board", exc_info=True)

    async def _refresh_forever(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.refresh_s)
            await self._refresh()

    def shutdown(self) -> None:
        self._stopped = True
        if self._refresher is not None:
            self._refresher.cancel()

    @property
    def is_running(self) -> bool:
        return not self._stopped and bool(self._entries)

    @property
    def replica_ids(self) -> list[str]:
        return sorted(self._entries)

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        for attempt in (1, 2):
            produced = False
            finished = False
            stream = self._handle.options(stream=True).generate.remote(
                request_id, prompt, params, prompt_tokens=len(prompt))
            try:
                async for out in stream:
                    produced = True
                    finished = out.finished
                    yield out
                return
            except self._lost as exc:
                if produced or attempt == 2:
                    raise ReplicaLost(f"the replica serving this request stopped: "
                                      f"{type(exc).__name__}") from exc
                log.warning("replica lost before %s started; sending it again", request_id)
            finally:
                if not finished:
                    with contextlib.suppress(Exception):
                        stream.cancel()

    # ---- what the server shows --------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        f = self._facts
        return ModelInfo.from_facts(f["tokenizer"], f["vocab_size"], f["max_model_len"],
                                    f["kernel_path"])

    def collector(self, model_name: str, extra_gauges: ExtraGauges) -> Collector:
        return ReplicaSeries(self, model_name, extra_gauges)

    def snapshot(self, model_name: str, latencies: RecentLatencies) -> dict[str, Any]:
        return merged_snapshot([e["snapshot"] for _, e in sorted(self._entries.items())],
                               model_name, latencies)


class ReplicaSeries(Collector):
    """Every replica's engine series with a ``replica`` label, plus the server's own gauges."""

    def __init__(self, engine: ReplicatedEngine, model_name: str, extra_gauges: ExtraGauges):
        self.engine = engine
        self.model_name = model_name
        self.extra_gauges = extra_gauges

    def collect(self) -> Iterator[Metric]:
        entries = dict(self.engine._entries)
        replicas = GaugeMetricFamily(P + "replicas", "Engine replicas posting stats.",
                                     labels=["model_name"])
        replicas.add_metric([self.model_name], len(entries))
        yield replicas
        for name, (doc, value) in self.extra_gauges().items():
            family = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        yield from relabel_by_replica(entries)


def relabel_by_replica(entries: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """One family per metric name, holding every replica's samples with a ``replica`` label."""
    merged: dict[str, Metric] = {}
    for replica_id, entry in sorted(entries.items()):
        for family in entry["families"]:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            for s in family.samples:
                target.samples.append(s._replace(labels={**s.labels, "replica": replica_id}))
    yield from merged.values()


def merged_snapshot(snapshots: list[dict[str, Any]], model_name: str,
                    latencies: RecentLatencies) -> dict[str, Any]:
    """The single-engine ``/engine/state`` fields summed over replicas (groups and the last
    step's batches carry their ``replica``; KV tiers are named ``replica/tier``), latencies
    from the front end's own record, and each replica's document under ``replicas``."""
    first = snapshots[0] if snapshots else {}
    ttft, tpot = latencies.medians()
    decode_rows = [sum(g["rows"] for g in s["groups"]) for s in snapshots]
    bubbles = [s["bubble_recent"] for s in snapshots]
    return {
        "time": max((s["time"] for s in snapshots), default=0.0),
        "model": model_name,
        **{k: first.get(k) for k in ("policy", "dtype", "kv_cache_dtype", "kernel_path")},
        "running": sum(s["running"] for s in snapshots),
        "waiting": sum(s["waiting"] for s in snapshots),
        "groups": [{**g, "replica": s["replica"]} for s in snapshots for g in s["groups"]],
        "last_step": [{**b, "replica": s["replica"]} for s in snapshots for b in s["last_step"]],
        "kv": {f"{s['replica']}/{tier}": v for s in snapshots for tier, v in s["kv"].items()},
        # weighted by decode rows: the share of the whole service's padded work that is lost
        "bubble_recent": (sum(b * r for b, r in zip(bubbles, decode_rows)) / sum(decode_rows)
                          if sum(decode_rows) else statistics.fmean(bubbles or [0.0])),
        "output_tok_s": sum(s["output_tok_s"] for s in snapshots),
        "ttft_p50_s": ttft,
        "tpot_p50_s": tpot,
        "steps": sum(s["steps"] for s in snapshots),
        "replicas": snapshots,
    }
