"""Ray Serve request routers for engine replicas (the ``RequestRouter`` API).

Ray Serve instantiates these inside the front end's process, from the class path given in the
deployment's ``RequestRouterConfig``; ``choose_replicas`` returns ranks of replicas, best
first, and Ray sends the request to the first that accepts it (a replica at its
``max_ongoing_requests`` refuses). The decisions themselves are ``cluster/routing.py``'s
(pure Python, also run by the simulator); this module only adapts Ray's types.

* ``KVAwareRouter``: ``routing.Router`` (``policy`` ``kv`` or ``kv+length``), on the
  replicas' routing stats plus the router's own record of what it sent since their reports.
  A replica that reports itself unhealthy (its engine stopped or failed a step: Ray is
  replacing it) is ranked only if no other is left.
* ``RoundRobinRouter``: replicas in turn, the baseline.
Ray's default (power of two choices on queue length) is the third option of the command line.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from alignedserve.cluster.routing import ReplicaLoad, RoundRobin, Router, RoutingBook

PROMPT_TOKENS_KWARG = "prompt_tokens"  # the front end passes len(prompt) under this name


def prompt_tokens_of(request: PendingRequest | None) -> int | None:
    if request is None:
        return None
    value = request.kwargs.get(PROMPT_TOKENS_KWARG)
    return value if isinstance(value, int) else None


def _key(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Routes by KV load (and optionally length affinity); see ``routing.Router``."""

    def initialize_state(self, policy: str = "kv", seed: int | None = None,
                         **router_kwargs: Any) -> None:
        self._router = Router(policy, **router_kwargs)
        self._book = RoutingBook()
        self._rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {_key(r.replica_id): r for r in candidate_replicas}
        healthy = [r for r in candidate_replicas if r.routing_stats.get("healthy", True)]
        pool = healthy or candidate_replicas
        loads = [self._book.with_in_flight(ReplicaLoad.from_stats(_key(r.replica_id),
                                                                  r.routing_stats))
                 for r in pool]
        order = self._router.rank(loads, prompt_tokens_of(pending_request), self._rng)
        return [[by_id[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._book.note_sent(_key(replica_id), prompt_tokens_of(pending_request) or 0)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._book.forget(_key(replica_id))


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Replicas in turn (healthy ones first)."""

    def initialize_state(self, **_: Any) -> None:
        self._turns = RoundRobin()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {_key(r.replica_id): r for r in candidate_replicas}
        healthy = [i for i, r in by_id.items() if r.routing_stats.get("healthy", True)]
        order = self._turns.rank(healthy or list(by_id))
        return [[by_id[i]] for i in order]
