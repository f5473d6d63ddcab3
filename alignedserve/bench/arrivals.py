"""When each request is sent: replayed trace times, a Poisson/gamma process, or all at once.

The mode follows from the options, in this order:

1. a request rate is given: inter-arrival gaps are gamma-distributed with shape
   ``burstiness`` and mean ``1 / rate`` (``burstiness == 1`` is a Poisson process; below 1 is
   burstier, above 1 more regular); ``rate == inf`` sends everything at once;
2. the workload has arrival times: replay them (already time-scaled by ``Scaling``);
3. otherwise: everything at once, and ``--concurrency`` (if any) makes it a closed loop.

The first request is always due at 0 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from alignedserve.bench.workloads import Workload


@dataclass(frozen=True, slots=True)
class ArrivalPlan:
    """``offsets[i]`` is when request ``i`` is due, non-decreasing; ``mode`` names the rule."""

    offsets: tuple[float, ...]
    mode: str  # "poisson", "gamma", "replay" or "all-at-once"
    rate: float | None = None
    burstiness: float = 1.0


def gamma_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """``n`` arrival offsets with gamma(shape=burstiness, mean=1/rate) gaps, first at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def plan_arrivals(workload: Workload, rate: float | None, burstiness: float,
                  seed: int) -> ArrivalPlan:
    n = len(workload)
    if rate is not None:
        if math.isinf(rate):
            return ArrivalPlan(tuple([0.0] * n), "all-at-once", rate, burstiness)
        mode = "poisson" if burstiness == 1.0 else "gamma"
        # A distinct stream from the length RNG so changing the rate never changes lengths.
        return ArrivalPlan(tuple(gamma_offsets(n, rate, burstiness, seed + 1_000_003)), mode,
                           rate, burstiness)
    if workload.timed:
        return ArrivalPlan(tuple(r.arrival_s for r in workload.requests), "replay")
    return ArrivalPlan(tuple([0.0] * n), "all-at-once")
