"""Requests waiting for admission, and which one is admitted next.

Two orders, chosen by ``SchedulerConfig.admission``:

* ``fcfs``: arrival order.
* ``shortest``: the request with the fewest prompt tokens to prefill first (shortest job first
  for the prefill: when a queue forms, short prompts are not stuck behind long ones, so the
  mean time to first token drops; the work done, hence throughput, is the same), with
  **aging**: a request that has waited ``max_admit_wait_steps`` scheduler steps goes before
  every younger one, and aged requests go in arrival order.

Waiting bound (``shortest``): a request is passed over by a younger request only during its
first ``max_admit_wait_steps`` steps in the queue; after that it waits at most what it would
under ``fcfs`` behind the requests that arrived before it. Preempted requests (``push_front``)
count as aged from the start and keep the step they first queued at: aged and preempted
requests go in that order, so a preempted request goes before every younger one (under
``fcfs``, before everything waiting, as in vLLM) but not before an older aged one.

Invariant: a queued request is in exactly one of ``_arrivals`` (never admitted: arrival order,
with the step it was queued at) and ``_preempted`` (back after preemption; few); ``_by_length``
is a heap over ``_arrivals``, with stale entries (removed requests) skipped lazily. Operations
on ``_arrivals`` are O(log n) amortised, so a deep queue (the default bound is 100k) costs
nothing per step; ``_preempted`` is scanned (it holds at most one cohort's worth per
preemption).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from alignedserve.request import Request

ADMISSION_ORDERS = ("shortest", "fcfs")
_NEVER_QUEUED = -(1 << 62)  # order key of a preempted request that was never pushed: oldest


class WaitingQueue:
    """Waiting requests with FCFS or aged shortest-first selection (the caller bounds its
    length: ``max_queue``)."""

    def __init__(self, order: str = "shortest", max_wait_steps: int = 64):
        if order not in ADMISSION_ORDERS:
            raise ValueError(f"admission must be one of {ADMISSION_ORDERS}, got {order!r}")
        if max_wait_steps < 0:
            raise ValueError("max_admit_wait_steps must be >= 0")
        self.order = order
        self.max_wait_steps = max_wait_steps
        self._arrivals: OrderedDict[str, tuple[int, Request]] = OrderedDict()
        # id -> (step first queued, seq, request): tuples order by when queued, then came back
        self._preempted: dict[str, tuple[int, int, Request]] = {}
        self._by_length: list[tuple[int, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._arrivals) + len(self._preempted)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._arrivals or request.request_id in self._preempted

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests: the preempted ones (oldest first), then the rest in arrival order."""
        yield from (entry[2] for entry in sorted(self._preempted.values()))
        yield from (request for _, request in self._arrivals.values())

    def push(self, request: Request, step: int, prefill_tokens: int) -> None:
        """Queue a new request at scheduler step ``step``; it needs ``prefill_tokens``."""
        if request.queued_step is None:
            request.queued_step = step
        self._arrivals[request.request_id] = (step, request)
        if self.order == "shortest":
            heapq.heappush(self._by_length, (prefill_tokens, next(self._seq), request))

    def push_front(self, request: Request) -> None:
        """Queue a preempted request; it counts as aged, ordered by when it first queued."""
        queued = _NEVER_QUEUED if request.queued_step is None else request.queued_step
        self._preempted[request.request_id] = (queued, next(self._seq), request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out (admitted or aborted); a heap entry of it goes stale."""
        if self._preempted.pop(request.request_id, None) is None:
            del self._arrivals[request.request_id]

    def peek(self, step: int) -> Request | None:
        """The request to admit next at scheduler step ``step`` (None if empty)."""
        oldest = None
        if self._arrivals:
            queued_at, request = next(iter(self._arrivals.values()))
            if self.order == "fcfs" or step - queued_at >= self.max_wait_steps:
                oldest = (queued_at, request)
        if self._preempted:
            queued_at, _, request = min(self._preempted.values())  # seq is unique: no tie
            if oldest is None or queued_at <= oldest[0]:
                return request
        if oldest is not None:
            return oldest[1]
        if not self._arrivals:
            return None
        while True:
            _, _, request = self._by_length[0]
            entry = self._arrivals.get(request.request_id)
            if entry is not None and entry[1] is request:
                return request
            heapq.heappop(self._by_length)  # stale: removed since it was pushed

