"""Length alignment for engines whose batches we do not build ourselves: which decode rows go
together, which waiting request joins next, and what a step looked like.

Pure functions and small classes (standard library only: no torch, no engine, no vLLM). The
vLLM plug-in (``vllm.py``) calls them on every step; the simulator's model of that plug-in
(``alignedserve.sim.plugin_policy``) calls the very same functions; the tests call them directly.

* ``length_groups``: every group's lengths lie within ``tolerance`` of the group's shortest
  (``max - min <= tolerance``), groups are in ascending length order, and a length joins the
  group before it whenever that keeps the invariant (so the grouping is the fewest groups a
  left-to-right sweep can make).
* ``ordered_groups``: the same grouping over requests, groups in the order of their oldest
  member's arrival, members by arrival (the order the plug-in gives vLLM's running list).
* ``admission_order``: the admission lever. Waiting requests are offered in this order:
  pinned ones (vLLM's preempted requests) first, in queue order; then *aged* ones (waited at
  least ``max_wait_steps`` steps), oldest first; then those whose prompt length lies within
  ``tolerance`` of a running decode row's KV length, oldest first; then the rest, oldest
  first. **Bound**: once a request has waited ``max_wait_steps`` steps, no request that
  entered the queue after it is offered before it, except pinned ones (which the host engine
  puts first anyway). So it waits at most ``max_wait_steps`` steps plus what arrival order
  would make it wait behind the requests that entered before it (property-tested).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def length_groups(lengths: list[int], tolerance: int) -> list[list[int]]:
    """``lengths`` sorted and cut into groups whose spread is at most ``tolerance``."""
    if tolerance < 0:
        raise ValueError("tolerance must be >= 0")
    groups: list[list[int]] = []
    for n in sorted(lengths):
        if groups and n - groups[-1][0] <= tolerance:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


def ordered_groups(items: Sequence[T], length: Callable[[T], int],
                   arrival: Callable[[T], float], tolerance: int) -> list[list[T]]:
    """``items`` cut into ``length_groups`` by ``length``; members ordered by ``arrival``,
    groups by their oldest member's arrival (ties keep the input order)."""
    by_length: dict[int, list[T]] = {}
    for item in items:
        by_length.setdefault(length(item), []).append(item)
    groups = []
    for lengths in length_groups(list(by_length), tolerance):
        members = [item for n in lengths for item in by_length[n]]
        members.sort(key=arrival)
        groups.append(members)
    groups.sort(key=lambda g: arrival(g[0]))
    return groups


@dataclass(frozen=True, slots=True)
class Candidate:
    """A waiting request as the admission lever sees it.

    ``length``: the KV length it will decode from (its prompt); ``waited``: scheduler steps
    since it entered the waiting queue; ``arrival``: when it entered (breaks ties between equal
    waits, earlier first); ``pinned``: keeps its place at the front (a preempted request).
    """

    length: int
    waited: int
    arrival: float = 0.0
    pinned: bool = False


def fits_a_group(length: int, running_sorted: Sequence[int], tolerance: int) -> bool:
    """Whether some running length lies within ``tolerance`` of ``length`` (sorted input)."""
    i = bisect.bisect_left(running_sorted, length - tolerance)
    return i < len(running_sorted) and running_sorted[i] <= length + tolerance


def admission_order(candidates: Sequence[Candidate], running_lengths: Iterable[int],
                    tolerance: int, max_wait_steps: int) -> list[int]:
    """Indices of ``candidates`` in the order they should be offered for admission (see the
    module docstring for the classes and the bound)."""
    if tolerance < 0 or max_wait_steps < 0:
        raise ValueError("tolerance and max_wait_steps must be >= 0")
    running = sorted(running_lengths)
    pinned, aged, fitting, rest = [], [], [], []
    for i, c in enumerate(candidates):
        if c.pinned:
            pinned.append(i)
        elif c.waited >= max_wait_steps:
            aged.append(i)
        elif fits_a_group(c.length, running, tolerance):
            fitting.append(i)
        else:
            rest.append(i)

    def oldest_first(i: int) -> tuple[int, float, int]:
        return -candidates[i].waited, candidates[i].arrival, i

    return pinned + sorted(aged, key=oldest_first) + sorted(fitting, key=oldest_first) + \
        sorted(rest, key=oldest_first)


def churn(before: set[Hashable], after: set[Hashable]) -> int:
    """Requests that entered or left the scheduled set between two steps."""
    return len(before ^ after)


class WaitClock:
    """Scheduler steps each waiting request has waited: ``observe`` the queue once per step;
    keys no longer waiting are forgotten (a request that comes back starts again)."""

    def __init__(self) -> None:
        self._since: dict[Hashable, int] = {}

    def observe(self, keys: Iterable[Hashable], step: int) -> None:
        present = set(keys)
        for key in present:
            self._since.setdefault(key, step)
        for key in [k for k in self._since if k not in present]:
            del self._since[key]

    def waited(self, key: Hashable, step: int) -> int:
        """Steps ``key`` has waited at ``step`` (0 if it is not being watched)."""
        return step - self._since.get(key, step)


@dataclass(frozen=True, slots=True)
class DecodeStepRecord:
    """What alignment looked like in one step's decode rows.

    ``spread`` is the KV-length range over all decode rows (what a kernel padding the whole
    batch would pad to); ``bubble`` the share of that padded work lost,
    ``1 - sum(len) / (rows * max(len))``; ``group_bubble`` the same if each length group ran
    as its own padded batch; ``max_group_spread`` the widest group (<= the tolerance).
    ``churn``: requests that entered or left the set of scheduled requests since the previous
    step (admissions, finishes, preemptions, and rows the token budget left out: what vLLM's
    persistent input batch adds and removes); ``admitted``: requests that joined the running
    set from the waiting queue this step,
    ``admitted_fitting`` of them whose prompt lay within the tolerance of a running decode
    length, ``max_admit_wait`` the longest any of them had waited (scheduler steps).
    """

    step: int
    rows: int
    groups: int
    spread: int
    max_group_spread: int
    bubble: float
    group_bubble: float
    prefill_tokens: int
    churn: int = 0
    admitted: int = 0
    admitted_fitting: int = 0
    max_admit_wait: int = 0

    @classmethod
    def of(cls, step: int, lengths: list[int], tolerance: int, prefill_tokens: int = 0,
           **counts: int) -> DecodeStepRecord:
        """The record of decode rows with KV ``lengths``; ``counts`` fills ``churn`` and the
        admission fields."""
        groups = length_groups(lengths, tolerance)
        total = sum(lengths)
        padded = len(lengths) * max(lengths, default=0)
        group_padded = sum(len(g) * g[-1] for g in groups)
        return cls(step=step, rows=len(lengths), groups=len(groups),
                   spread=max(lengths, default=0) - min(lengths, default=0),
                   max_group_spread=max((g[-1] - g[0] for g in groups), default=0),
                   bubble=1.0 - total / padded if padded else 0.0,
                   group_bubble=1.0 - total / group_padded if group_padded else 0.0,
                   prefill_tokens=prefill_tokens, **counts)
