"""Length groups of a decode step, for engines whose batches we do not build ourselves.

Pure functions (no torch, no engine): the vLLM plug-in calls them on every step, and the tests
call them directly.

Invariant of ``length_groups``: every group's lengths lie within ``tolerance`` of the group's
shortest (``max - min <= tolerance``), groups are in ascending length order, and a length joins
the group before it whenever that keeps the invariant (so the grouping is the fewest groups a
left-to-right sweep can make). ``ordered_groups`` applies it to requests: groups in the order of
their oldest member's arrival, members by arrival (the order the plug-in gives vLLM's running
list).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
class DecodeStepRecord:
    """What alignment looked like in one step's decode rows.

    ``spread`` is the KV-length range over all decode rows (what a kernel padding the whole
    batch would pad to); ``bubble`` the share of that padded work lost,
    ``1 - sum(len) / (rows * max(len))``; ``group_bubble`` the same if each length group ran
    as its own padded batch; ``max_group_spread`` the widest group (<= the tolerance).
    """

    step: int
    rows: int
    groups: int
    spread: int
    max_group_spread: int
    bubble: float
    group_bubble: float
    prefill_tokens: int

    @classmethod
    def of(cls, step: int, lengths: list[int], tolerance: int,
           prefill_tokens: int = 0) -> DecodeStepRecord:
        groups = length_groups(lengths, tolerance)
        total = sum(lengths)
        padded = len(lengths) * max(lengths, default=0)
        group_padded = sum(len(g) * g[-1] for g in groups)
        return cls(step=step, rows=len(lengths), groups=len(groups),
                   spread=max(lengths, default=0) - min(lengths, default=0),
                   max_group_spread=max((g[-1] - g[0] for g in groups), default=0),
                   bubble=1.0 - total / padded if padded else 0.0,
                   group_bubble=1.0 - total / group_padded if group_padded else 0.0,
                   prefill_tokens=prefill_tokens)
