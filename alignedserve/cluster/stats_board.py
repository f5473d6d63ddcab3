"""The stats board: a small named Ray actor where every engine replica posts its latest engine
snapshot and Prometheus families, and from which the front end reads them all at once.

Ray Serve routes a handle call to *one* replica, so the front end cannot ask each replica for
its metrics; the replicas post instead (on the routing-stats cadence, see
``cluster/replica.py``). An entry older than ``stale_s`` is dropped when read: a replica that
died or was replaced stops posting and leaves the board.
"""

from __future__ import annotations

import time
from typing import Any

NAMESPACE = "alignedserve"


class StatsBoard:
    """Replica id -> its latest posted entry (a dict with a ``time`` field, Unix seconds)."""

    def __init__(self, stale_s: float = 10.0):
        self.stale_s = stale_s
        self._entries: dict[str, dict[str, Any]] = {}

    def put(self, replica_id: str, entry: dict[str, Any]) -> None:
        self._entries[replica_id] = entry

    def entries(self) -> dict[str, dict[str, Any]]:
        """Every fresh entry; stale ones are forgotten."""
        now = time.time()
        self._entries = {r: e for r, e in self._entries.items()
                         if now - e.get("time", 0.0) <= self.stale_s}
        return dict(self._entries)


def start_board(name: str, stale_s: float = 10.0) -> Any:
    """Create (or find) the named board actor in the connected Ray cluster; returns its handle.

    It takes no CPU and lives as long as the job that created it.
    """
    import ray

    actor = ray.remote(num_cpus=0)(StatsBoard)
    return actor.options(name=name, namespace=NAMESPACE, get_if_exists=True,
                         lifetime=None).remote(stale_s)
