"""Cohorts: decode batches whose members' KV lengths lie within a tolerance.

Every member of a cohort that runs gains exactly one token, so a cohort stays aligned for as
long as it exists; it changes only when members finish, when cohorts merge (their lengths
met) or when one is split. All members of a cohort keep their KV in the same tier.

Pure functions on lists of cohorts; no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from alignedserve.request import Request


@dataclass(slots=True, eq=False)
class Cohort:
    cohort_id: int
    tier: str
    last_run_step: int
    requests: list[Request] = field(default_factory=list)
    moving_to: str | None = None

    @property
    def rows(self) -> int:
        return len(self.requests)

    @property
    def min_len(self) -> int:
        return min(r.num_tokens for r in self.requests)

    @property
    def max_len(self) -> int:
        return max(r.num_tokens for r in self.requests)

    @property
    def spread(self) -> int:
        return self.max_len - self.min_len

    def accepts(self, request: Request, tolerance: int, max_rows: int,
                fits: Fits = None) -> bool:
        """Could ``request`` join without breaking the tolerance, the row cap or ``fits``?"""
        if self.rows >= max_rows or self.moving_to is not None:
            return False
        length = request.num_tokens
        if max(self.max_len, length) - min(self.min_len, length) > tolerance:
            return False
        return fits is None or fits([*self.requests, request])


# Whether a group of requests may form one cohort (e.g. their KV fits one device); None: always.
Fits = Callable[[list[Request]], bool] | None


def can_merge(a: Cohort, b: Cohort, tolerance: int, max_rows: int, fits: Fits = None) -> bool:
    return (a.tier == b.tier and a.moving_to is None and b.moving_to is None
            and a.rows + b.rows <= max_rows
            and max(a.max_len, b.max_len) - min(a.min_len, b.min_len) <= tolerance
            and (fits is None or fits(a.requests + b.requests)))


def merge_pass(cohorts: list[Cohort], tolerance: int, max_rows: int,
               fits: Fits = None) -> list[tuple[Cohort, Cohort]]:
    """Pairs (keep, absorbed) of neighbours in length order that can merge; each used once."""
    ordered = sorted(cohorts, key=lambda c: (c.tier, c.min_len))
    pairs: list[tuple[Cohort, Cohort]] = []
    i = 0
    while i + 1 < len(ordered):
        a, b = ordered[i], ordered[i + 1]
        if can_merge(a, b, tolerance, max_rows, fits):
            keep, absorbed = (a, b) if a.last_run_step <= b.last_run_step else (b, a)
            pairs.append((keep, absorbed))
            i += 2
        else:
            i += 1
    return pairs


def split_sizes(rows: int, max_rows: int) -> list[int]:
    """Near-equal part sizes, each <= max_rows, for splitting a cohort of ``rows``."""
    parts = -(-rows // max_rows)
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_members(members: list[Request], max_rows: int, fits: Fits = None) -> list[list[Request]]:
    """``members`` (sorted by length) cut into the fewest near-equal consecutive parts of at
    most ``max_rows`` rows that each satisfy ``fits`` (a single request always stands alone)."""
    parts = -(-len(members) // max_rows)
    while True:
        sizes = split_sizes(len(members), -(-len(members) // parts))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        groups = [members[a:a + n] for a, n in zip(starts, sizes)]
        if fits is None or all(len(g) == 1 or fits(g) for g in groups):
            return groups
        parts += 1
