"""What the web console and scripts see of a running engine: ``GET /engine/state`` (one JSON
snapshot) and ``GET /engine/events`` (the same snapshot as a server-sent event per interval).

A snapshot holds counts, lengths, bytes and timings only, never prompt or output text. It is
read on the event loop while the engine thread keeps stepping, without a lock, as the
Prometheus collector reads (``prometheus_metrics.racy_read``): each part is a short read
retried if the engine changed a container under it.

Snapshot fields (all present in every snapshot):
    time            server wall clock (Unix seconds)
    model, policy, dtype, kv_cache_dtype, kernel_path
    running, waiting            sequences in the engine
    groups          decode groups as the policy keeps them (cohorts under ``aligned``):
                    [{rows, min_len, max_len, tier}], longest first
    last_step       the decode batches of the latest step: [{rows, min_len, max_len}]
                    (empty once no step ran for ``IDLE_S`` seconds)
    kv              per tier: {used_bytes, total_bytes}
    bubble_recent   share of padded decode attention lost to misalignment, recent steps
    output_tok_s    tokens sampled per second over the last ``RATE_SPAN_S`` seconds
    ttft_p50_s, tpot_p50_s      medians over requests finished in the last ``LATENCY_SPAN_S``
                                seconds (null when none finished)
    steps           engine steps since start
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from alignedserve.entrypoints.prometheus_metrics import racy_read
from alignedserve.outputs import RequestOutput

RATE_SPAN_S = 10.0
BUBBLE_STEPS = 64  # bubble_recent covers this many latest steps
IDLE_S = 2.0  # no step for this long: the engine is idle, last_step is empty
LATENCY_SPAN_S = 300.0


class RecentLatencies:
    """TTFT and TPOT of the requests that finished in the last ``span_s`` seconds."""

    def __init__(self, span_s: float = LATENCY_SPAN_S, clock=time.monotonic):
        self.span_s = span_s
        self.clock = clock
        self._ends: deque[tuple[float, float, float | None]] = deque(maxlen=10000)

    def observe(self, out: RequestOutput | None) -> None:
        """Record a finished request's latencies (aborted or failed ones are skipped)."""
        if out is None or not out.finished or out.error or out.metrics.ttft is None:
            return
        m, longest = out.metrics, max((len(c.token_ids) for c in out.outputs), default=0)
        tpot = (m.e2e - m.ttft) / (longest - 1) if m.e2e is not None and longest > 1 else None
        self._ends.append((self.clock(), m.ttft, tpot))

    def medians(self) -> tuple[float | None, float | None]:
        """(TTFT p50, TPOT p50) over the span; None where no request qualifies."""
        cutoff = self.clock() - self.span_s
        recent = [e for e in tuple(self._ends) if e[0] >= cutoff]
        ttfts = [e[1] for e in recent]
        tpots = [e[2] for e in recent if e[2] is not None]
        return (statistics.median(ttfts) if ttfts else None,
                statistics.median(tpots) if tpots else None)


def _groups(engine: Any) -> list[dict[str, Any]]:
    groups = engine.scheduler.decode_groups()
    groups.sort(key=lambda g: -g.max_len)
    return [{"rows": g.rows, "min_len": g.min_len, "max_len": g.max_len, "tier": g.tier}
            for g in groups]


def engine_snapshot(engine: Any, model: str, latencies: RecentLatencies) -> dict[str, Any]:
    """The snapshot described in the module docstring."""
    stats = engine.stats
    now = time.monotonic()
    timeline = tuple(stats.timeline)
    # the latest step's batches while the engine is stepping; none once it has gone idle
    # (the window only ever grows or rotates, so once non-empty its last record stays readable)
    last = (stats.window[-1].batches
            if stats.window and timeline and now - timeline[-1][0] < IDLE_S else ())
    ttft, tpot = latencies.medians()
    usage = racy_read(engine.store.usage_bytes, {})
    return {
        "time": time.time(),
        "model": model,
        "policy": engine.config.policy,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "kernel_path": engine.kernels.name,
        "running": racy_read(engine.scheduler.num_running, 0),
        "waiting": racy_read(engine.scheduler.num_waiting, 0),
        "groups": racy_read(lambda: _groups(engine), []),
        "last_step": [{"rows": b.rows, "min_len": b.min_len, "max_len": b.max_len}
                      for b in last],
        "kv": {tier: {"used_bytes": used, "total_bytes": total}
               for tier, (used, total) in sorted(usage.items())},
        "bubble_recent": stats.recent_bubble_fraction(BUBBLE_STEPS),
        "output_tok_s": stats.output_tokens_per_s(now, RATE_SPAN_S),
        "ttft_p50_s": ttft,
        "tpot_p50_s": tpot,
        "steps": stats.steps,
    }
