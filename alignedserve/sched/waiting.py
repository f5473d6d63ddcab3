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
count as aged: they go first, as under ``fcfs``.

Invariant: every request in the queue is in ``_arrivals`` (arrival order, with the step it
was queued at); ``_by_length`` is a heap over the same requests, with stale entries (removed
requests) skipped lazily. All operations are O(log n) amortised, so a deep queue (the
default bound is 100k) costs nothing per step.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from alignedserve.request import Request

ADMISSION_ORDERS = ("shortest", "fcfs")
_AGED = -(1 << 62)  # queued-at step of preempted requests: aged from the start


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
        self._by_length: list[tuple[int, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._arrivals)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._arrivals

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in arrival order (preempted ones first)."""
        return (request for _, request in self._arrivals.values())

    def push(self, request: Request, step: int, prefill_tokens: int) -> None:
        """Queue a new request at scheduler step ``step``; it needs ``prefill_tokens``."""
        self._arrivals[request.request_id] = (step, request)
        self._push_length(request, prefill_tokens)

    def push_front(self, request: Request, prefill_tokens: int) -> None:
        """Queue a preempted request ahead of everyone (it counts as aged)."""
        self._arrivals[request.request_id] = (_AGED, request)
        self._arrivals.move_to_end(request.request_id, last=False)
        self._push_length(request, prefill_tokens)

    def remove(self, request: Request) -> None:
        """Take ``request`` out (admitted or aborted); its heap entry goes stale."""
        del self._arrivals[request.request_id]

    def peek(self, step: int) -> Request | None:
        """The request to admit next at scheduler step ``step`` (None if empty)."""
        if not self._arrivals:
            return None
        queued_at, oldest = next(iter(self._arrivals.values()))
        if self.order == "fcfs" or step - queued_at >= self.max_wait_steps:
            return oldest
        while True:
            _, _, request = self._by_length[0]
            entry = self._arrivals.get(request.request_id)
            if entry is not None and entry[1] is request:
                return request
            heapq.heappop(self._by_length)  # stale: removed since it was pushed

    def _push_length(self, request: Request, prefill_tokens: int) -> None:
        if self.order == "shortest":
            heapq.heappush(self._by_length, (prefill_tokens, next(self._seq), request))
