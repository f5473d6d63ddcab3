"""Tiered KV-cache bookkeeping: who holds how much KV memory in which tier.

Pure Python (no torch), so schedulers and their tests run without a model. The store never
touches tensors: every mutation is appended to an operation log (``drain_ops``) that the
executor replays on real memory, in order, so the tensors always mirror this bookkeeping.

Units are *tokens of KV capacity*; a tier's byte budget is divided by ``bytes_per_token``.
Capacities are rounded up to ``granularity`` tokens.

Invariants (``check_invariants``), for every tier at every moment:
    used(tier) + free(tier) == total(tier),  0 <= used(tier) <= total(tier),
    used(tier) == sum of capacities of allocations resident in (or moving into) the tier.
A handle in flight between tiers (``begin_move`` .. ``end_move``) holds capacity in both.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

HOST = "host"


def device_tier(index: int) -> str:
    """Name of the device tier for device ``index`` (``dev0``, ``dev1`` …)."""
    return f"dev{index}"


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Opaque reference to one request's KV allocation."""

    id: int


class KVOpKind(enum.Enum):
    ALLOC = "alloc"  # new allocation of `capacity` tokens in `tier`
    GROW = "grow"  # same tier, capacity raised to `capacity` (contents kept)
    MOVE_BEGIN = "move_begin"  # start copying to `tier` (source stays valid)
    MOVE_END = "move_end"  # copy must be complete; source released; handle lives in `tier`
    FREE = "free"  # release everything the handle holds


@dataclass(frozen=True, slots=True)
class KVOp:
    kind: KVOpKind
    handle: KVHandle
    tier: str
    capacity: int


@dataclass(slots=True)
class _Allocation:
    tier: str
    capacity: int
    moving_to: str | None = None


class OutOfKVMemory(Exception):
    """Raised by callers that cannot proceed without memory (the store itself returns False)."""


class KVStore:
    """Capacity accounting for KV caches over named tiers (``dev0``.. and ``host``)."""

    def __init__(self, tier_bytes: dict[str, int], bytes_per_token: int, granularity: int = 16):
        if bytes_per_token <= 0 or granularity <= 0:
            raise ValueError("bytes_per_token and granularity must be positive")
        self.bytes_per_token = bytes_per_token
        self.granularity = granularity
        self._total = {tier: max(0, b) // bytes_per_token for tier, b in tier_bytes.items()}
        self._used = dict.fromkeys(self._total, 0)
        self._allocs: dict[KVHandle, _Allocation] = {}
        self._ops: list[KVOp] = []
        self._ids = itertools.count()

    @classmethod
    def for_devices(cls, device_bytes: list[int], host_bytes: int, bytes_per_token: int,
                    granularity: int = 16) -> KVStore:
        tiers = {device_tier(i): b for i, b in enumerate(device_bytes)}
        tiers[HOST] = host_bytes
        return cls(tiers, bytes_per_token, granularity)

    # ---- queries -------------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        return list(self._total)

    @property
    def device_tiers(self) -> list[str]:
        return [t for t in self._total if t != HOST]

    def total(self, tier: str) -> int:
        return self._total[tier]

    def used(self, tier: str) -> int:
        return self._used[tier]

    def free(self, tier: str) -> int:
        return self._total[tier] - self._used[tier]

    def round_up(self, tokens: int) -> int:
        g = self.granularity
        return max(g, -(-tokens // g) * g)

    def tier_of(self, handle: KVHandle) -> str:
        return self._allocs[handle].tier

    def capacity_of(self, handle: KVHandle) -> int:
        return self._allocs[handle].capacity

    def is_moving(self, handle: KVHandle) -> bool:
        return self._allocs[handle].moving_to is not None

    def __contains__(self, handle: KVHandle) -> bool:
        return handle in self._allocs

    def __len__(self) -> int:
        return len(self._allocs)

    # ---- placement: where KV goes when a policy moves it -----------------------------------
    def parking_tier(self, tokens: int, compute: str) -> str | None:
        """Where ``tokens`` of KV written back from the ``compute`` tier go: the first other
        device tier with room (a closer parking place than the host), else the host if it has
        room; None when neither has."""
        for tier in self.device_tiers:
            if tier != compute and self.free(tier) >= tokens:
                return tier
        return HOST if self.free(HOST) >= tokens else None

    def staging_tier(self, tokens: int, compute: str, link_left: dict[str, float]) -> str | None:
        """A device tier other than ``compute`` with room for ``tokens`` and at least that much
        left of its host link this step (``link_left``), to stage host KV on its way to
        ``compute`` (GPU-Prefetch-For-GPU); None when there is none."""
        for tier in self.device_tiers:
            if tier != compute and self.free(tier) >= tokens and link_left[tier] >= tokens:
                return tier
        return None

    def tokens_beyond_devices(self) -> int:
        """KV in use over all tiers minus what the device tiers hold (negative while the
        devices still have room): the part of the pool that lives on the host."""
        return (sum(self._used.values())
                - sum(self._total[t] for t in self.device_tiers))

    # ---- mutations (each one logged for the executor) --------------------------------------
    def allocate(self, tier: str, tokens: int) -> KVHandle | None:
        """Reserve capacity for ``tokens`` tokens in ``tier``; None when the tier lacks room."""
        capacity = self.round_up(tokens)
        if capacity > self.free(tier):
            return None
        handle = KVHandle(next(self._ids))
        self._allocs[handle] = _Allocation(tier, capacity)
        self._used[tier] += capacity
        self._log(KVOpKind.ALLOC, handle, tier, capacity)
        return handle

    def grow(self, handle: KVHandle, tokens: int) -> bool:
        """Ensure capacity >= ``tokens`` in the handle's tier; False (unchanged) if no room.

        Not allowed while the handle is moving.
        """
        alloc = self._allocs[handle]
        if alloc.moving_to is not None:
            raise RuntimeError("cannot grow a KV allocation while it is moving")
        capacity = self.round_up(tokens)
        extra = capacity - alloc.capacity
        if extra <= 0:
            return True
        if extra > self.free(alloc.tier):
            return False
        alloc.capacity = capacity
        self._used[alloc.tier] += extra
        self._log(KVOpKind.GROW, handle, alloc.tier, capacity)
        return True

    def begin_move(self, handle: KVHandle, dst: str) -> bool:
        """Reserve the handle's capacity in ``dst`` and start a copy; False if no room."""
        alloc = self._allocs[handle]
        if alloc.moving_to is not None:
            raise RuntimeError("KV allocation is already moving")
        if dst == alloc.tier:
            raise ValueError("source and destination tier are the same")
        if alloc.capacity > self.free(dst):
            return False
        alloc.moving_to = dst
        self._used[dst] += alloc.capacity
        self._log(KVOpKind.MOVE_BEGIN, handle, dst, alloc.capacity)
        return True

    def end_move(self, handle: KVHandle) -> None:
        """Complete a move: release the source; the handle now lives in the destination."""
        alloc = self._allocs[handle]
        if alloc.moving_to is None:
            raise RuntimeError("KV allocation is not moving")
        self._used[alloc.tier] -= alloc.capacity
        alloc.tier, alloc.moving_to = alloc.moving_to, None
        self._log(KVOpKind.MOVE_END, handle, alloc.tier, alloc.capacity)

    def begin_group_move(self, handles: list[KVHandle], dst: str) -> bool:
        """``begin_move`` for every handle, all or none: False, with nothing changed, when
        ``dst`` lacks room for their total capacity."""
        if sum(self._allocs[h].capacity for h in handles) > self.free(dst):
            return False
        for handle in handles:
            moved = self.begin_move(handle, dst)
            assert moved, "room for the whole group was checked above"
        return True

    def end_group_move(self, handles: list[KVHandle]) -> None:
        """``end_move`` for every handle."""
        for handle in handles:
            self.end_move(handle)

    def move(self, handle: KVHandle, dst: str) -> bool:
        """Synchronous move: ``begin_move`` then ``end_move``."""
        if not self.begin_move(handle, dst):
            return False
        self.end_move(handle)
        return True

    def free_handle(self, handle: KVHandle) -> None:
        """Release everything the handle holds, including an in-flight move's destination."""
        alloc = self._allocs.pop(handle)
        self._used[alloc.tier] -= alloc.capacity
        if alloc.moving_to is not None:
            self._used[alloc.moving_to] -= alloc.capacity
        self._log(KVOpKind.FREE, handle, alloc.tier, 0)

    def drain_ops(self) -> list[KVOp]:
        """Return and clear the log of mutations since the last drain (executor replays it)."""
        ops, self._ops = self._ops, []
        return ops

    def _log(self, kind: KVOpKind, handle: KVHandle, tier: str, capacity: int) -> None:
        self._ops.append(KVOp(kind, handle, tier, capacity))

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the accounting identities in the module docstring."""
        expected = dict.fromkeys(self._total, 0)
        for alloc in self._allocs.values():
            expected[alloc.tier] += alloc.capacity
            if alloc.moving_to is not None:
                expected[alloc.moving_to] += alloc.capacity
        for tier, total in self._total.items():
            used = self._used[tier]
            assert used == expected[tier], f"{tier}: used {used} != allocated {expected[tier]}"
            assert 0 <= used <= total, f"{tier}: used {used} outside [0, {total}]"
            assert used + self.free(tier) == total

    def usage_bytes(self) -> dict[str, tuple[int, int]]:
        """Per tier: (used bytes, total bytes)."""
        bpt = self.bytes_per_token
        return {t: (self._used[t] * bpt, self._total[t] * bpt) for t in self._total}
