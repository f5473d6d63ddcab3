"""Benchmark metrics from per-request records (definitions in docs/benchmarks.md).

Everything here is a pure function of ``RequestRecord`` lists, so a report can be recomputed
from the raw JSON. Conventions:

* latencies are measured from when the client *sent* the request (``sent_s``), so time a
  request spent queued inside the engine counts, time held back by the client's own
  concurrency cap does not (that is reported separately as ``client_queue``);
* only successful requests (``ok``) enter latency distributions and throughputs;
* the run's duration is from the first request sent to the last response finished (failed
  ones included), so idle time before the first send does not dilute throughput;
* percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from alignedserve.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
RATIO_METRICS: tuple[tuple[str, str, bool], ...] = (
    # (name in the ratio table, path in Summary.to_json(), higher is better)
    ("out tok/s", "output_throughput", True),
    ("req/s", "request_throughput", True),
    ("TTFT p50", "ttft.p50", False),
    ("TTFT p99", "ttft.p99", False),
    ("TPOT p50", "tpot.p50", False),
    ("E2E p50", "e2e.p50", False),
    ("E2E p99", "e2e.p99", False),
)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of a sample of seconds; all fields NaN when the sample is empty."""

    count: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        arr = np.asarray(list(values), dtype=float)
        if arr.size == 0:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan, nan, nan)
        p = np.percentile(arr, PERCENTILES)
        return cls(int(arr.size), float(arr.mean()), float(arr.std()), float(arr.min()),
                   float(p[0]), float(p[1]), float(p[2]), float(p[3]), float(arr.max()))


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in seconds; None = no objective on that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft is None and self.tpot is None and self.e2e is None

    def met_by(self, r: RequestRecord) -> bool:
        """True if ``r`` succeeded and meets every objective (TPOT of a 1-token reply is 0)."""
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft), (self.tpot, r.tpot or 0.0), (self.e2e, r.e2e))
        return all(limit is None or (value is not None and value <= limit)
                   for limit, value in checks)


@dataclass(frozen=True, slots=True)
class Summary:
    completed: int
    failed: int
    not_sent: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_token_throughput: float
    goodput: float | None  # requests / s meeting the SLO (None without an SLO)
    goodput_fraction: float | None  # share of *sent* requests meeting the SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    client_queue: Distribution  # sent_s - scheduled_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_duration(records: list[RequestRecord]) -> float:
    """Seconds from the first send to the last finish over all sent requests (0 if none)."""
    sent = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    if not sent or not ends:
        return 0.0
    return max(0.0, max(ends) - min(sent))


def _per_second(amount: float, duration: float) -> float:
    return amount / duration if duration > 0 else math.nan


def summarize(records: list[RequestRecord], slo: SLO | None = None) -> Summary:
    """Aggregate one run's records into the reported metrics."""
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.sent_s is not None]
    duration = run_duration(records)
    inputs = sum(r.prompt_len_reported or r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    goodput = fraction = None
    if slo is not None and not slo.empty:
        good = sum(1 for r in ok if slo.met_by(r))
        goodput = _per_second(good, duration)
        fraction = good / len(sent) if sent else math.nan
    return Summary(
        completed=len(ok), failed=len(sent) - len(ok), not_sent=len(records) - len(sent),
        duration_s=duration, input_tokens=inputs, output_tokens=outputs,
        request_throughput=_per_second(len(ok), duration),
        input_throughput=_per_second(inputs, duration),
        output_throughput=_per_second(outputs, duration),
        total_token_throughput=_per_second(inputs + outputs, duration),
        goodput=goodput, goodput_fraction=fraction,
        ttft=Distribution.of(r.ttft for r in ok if r.ttft is not None),
        tpot=Distribution.of(r.tpot for r in ok if r.tpot is not None),
        itl=Distribution.of(g for r in ok for g in r.itls),
        e2e=Distribution.of(r.e2e for r in ok if r.e2e is not None),
        client_queue=Distribution.of(r.sent_s - r.scheduled_s for r in sent))


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, or None when either is missing, NaN or the baseline is 0."""
    if value is None or baseline is None or math.isnan(value) or math.isnan(baseline):
        return None
    return value / baseline if baseline else None
