"""Policies by name: ``--policy NAME`` picks the scheduler class."""

from __future__ import annotations

from alignedserve.config import SchedulerConfig
from alignedserve.kv.store import KVStore
from alignedserve.sched.aligned import AlignedScheduler
from alignedserve.sched.fcfs import FcfsScheduler
from alignedserve.sched.interface import BaseScheduler
from alignedserve.sched.static import StaticScheduler

POLICIES: dict[str, type[BaseScheduler]] = {
    AlignedScheduler.name: AlignedScheduler,
    FcfsScheduler.name: FcfsScheduler,
    StaticScheduler.name: StaticScheduler,
}


def make_scheduler(policy: str, config: SchedulerConfig, store: KVStore, **kwargs) -> BaseScheduler:
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}") from None
    return cls(config, store, **kwargs)
