"""Which engine replica a request goes to: the routing decision, in pure Python.

The Ray Serve request router (``cluster/ray_router.py``) and the simulator's replica cluster
(``sim/cluster.py``) both call ``Router.rank``, so what the simulator reports at 64 replicas is
what the served router does at 2.

Inputs are what each replica reports about itself (``ReplicaLoad``, from its routing stats)
plus what this router sent it since that report (``RoutingBook``): reports are periodic, and
without the second term a burst of arrivals between two reports would all see the same
"least loaded" replica and go to it together.

Policies:
* ``kv``: power of two choices on KV load: sample two replicas, prefer the one whose committed
  KV (held + queued prompts + sent since its report) is the smaller share of its device KV.
* ``kv+length``: the same, plus length affinity: among the replicas whose KV load is within
  ``imbalance`` of the least loaded, prefer the one running the most rows in decode groups
  whose KV length the new request will meet after its prefill (a group at length L is met by
  a prompt of P tokens when ``P - behind <= L <= P + ahead``: groups grow by one token per
  step while the prompt waits and prefills; the aligned policy can hold a group briefly so a
  shorter one catches up). Without such a replica it is ``kv``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

POLICIES = ("kv", "kv+length")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's own report.

    ``kv_tokens``: KV tokens held (every tier) plus prompt tokens received and not yet
    prefilled; ``kv_capacity``: its device KV budget in tokens; ``groups``: (KV length,
    rows) of its decode groups; ``received_tokens``: prompt tokens of every request it was ever
    given (a running total, so a router can tell which of its sends a report already counts).
    """

    replica_id: str
    kv_tokens: int = 0
    kv_capacity: int = 1
    running: int = 0
    waiting: int = 0
    groups: tuple[tuple[int, int], ...] = ()
    received_tokens: int = 0

    @property
    def load(self) -> float:
        return self.kv_tokens / max(1, self.kv_capacity)

    def to_stats(self) -> dict[str, Any]:
        return {"kv_tokens": self.kv_tokens, "kv_capacity": self.kv_capacity,
                "running": self.running, "waiting": self.waiting,
                "groups": [list(g) for g in self.groups],
                "received_tokens": self.received_tokens}

    @classmethod
    def from_stats(cls, replica_id: str, stats: Mapping[str, Any] | None) -> ReplicaLoad:
        """From a replica's routing-stats dict; a replica that has not reported yet is empty."""
        if not stats:
            return cls(replica_id)
        return cls(replica_id, int(stats["kv_tokens"]), max(1, int(stats["kv_capacity"])),
                   int(stats["running"]), int(stats["waiting"]),
                   tuple((int(length), int(rows)) for length, rows in stats["groups"]),
                   int(stats["received_tokens"]))


def group_lengths(groups: Iterable[Any]) -> tuple[tuple[int, int], ...]:
    """(KV length, rows) of each decode group (anything with ``min_len``, ``max_len``,
    ``rows``: the scheduler's ``DecodeGroup``), as ``ReplicaLoad.groups`` holds them."""
    return tuple((round((g.min_len + g.max_len) / 2), g.rows) for g in groups)


@dataclass(slots=True)
class RoutingBook:
    """What this router sent each replica, to add to replica reports that predate it.

    Invariant: ``sent[r] >= 0`` is the prompt tokens routed to ``r`` in total; a report's
    ``received_tokens`` counts those that reached it, so the difference is still on its way.
    """

    sent: dict[str, int] = field(default_factory=dict)

    def note_sent(self, replica_id: str, prompt_tokens: int) -> None:
        self.sent[replica_id] = self.sent.get(replica_id, 0) + prompt_tokens

    def forget(self, replica_id: str) -> None:
        self.sent.pop(replica_id, None)

    def with_in_flight(self, load: ReplicaLoad) -> ReplicaLoad:
        """``load`` plus the tokens sent to it that its report does not count yet."""
        in_flight = max(0, self.sent.get(load.replica_id, 0) - load.received_tokens)
        return replace(load, kv_tokens=load.kv_tokens + in_flight) if in_flight else load


@dataclass(frozen=True, slots=True)
class Router:
    """``rank`` orders replicas best first for one request (a pure function of its inputs and
    ``rng``); callers send to the first that accepts."""

    policy: str = "kv"
    imbalance: float = 0.10  # kv+length: loads within this share of capacity count as equal
    behind: int = 32  # kv+length: a group up to this many tokens shorter than the prompt
    ahead: int = 8  # kv+length: ... or this many longer

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; one of {POLICIES}")
        if self.imbalance < 0 or self.behind < 0 or self.ahead < 0:
            raise ValueError("imbalance, behind and ahead must be >= 0")

    def rank(self, loads: Sequence[ReplicaLoad], prompt_tokens: int | None,
             rng: random.Random) -> list[str]:
        """Replica ids, best first; every replica appears once (the tail is a fallback order
        by load, so a full replica never strands a request that another can take)."""
        if not loads:
            return []
        by_load = sorted(loads, key=lambda r: (r.load, r.replica_id))
        first = self._power_of_two(loads, rng)
        if self.policy == "kv+length" and prompt_tokens is not None:
            first = self._affine(by_load, prompt_tokens) or first
        return [first] + [r.replica_id for r in by_load if r.replica_id != first]

    @staticmethod
    def _power_of_two(loads: Sequence[ReplicaLoad], rng: random.Random) -> str:
        if len(loads) == 1:
            return loads[0].replica_id
        a, b = rng.sample(list(loads), 2)
        return min((a, b), key=lambda r: (r.load, rng.random())).replica_id

    def _affine(self, by_load: list[ReplicaLoad], prompt_tokens: int) -> str | None:
        """The near-least-loaded replica with the most rows the prompt will meet, if any."""
        floor = by_load[0].load + self.imbalance
        best, best_rows = None, 0
        for r in by_load:  # least loaded first, so ties go to the lighter replica
            if r.load > floor:
                break
            rows = self.matching_rows(r, prompt_tokens)
            if rows > best_rows:
                best, best_rows = r.replica_id, rows
        return best

    def matching_rows(self, load: ReplicaLoad, prompt_tokens: int) -> int:
        lo, hi = prompt_tokens - self.behind, prompt_tokens + self.ahead
        return sum(rows for length, rows in load.groups if lo <= length <= hi)


class RoundRobin:
    """The baseline: replicas in turn, whatever they hold."""

    def __init__(self) -> None:
        self._next = 0

    def rank(self, replica_ids: Sequence[str]) -> list[str]:
        if not replica_ids:
            return []
        ids = sorted(replica_ids)
        start = self._next % len(ids)
        self._next += 1
        return ids[start:] + ids[:start]
