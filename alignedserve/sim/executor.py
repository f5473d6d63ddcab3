"""SimulatedExecutor: the executor interface (``execute(plan) -> StepOutput``) on a virtual clock.

It replays the plan's KV ops the way the real ``KVPool`` does — a tier move copies the
allocation's whole capacity, ``MOVE_BEGIN`` starts the copy and ``MOVE_END`` waits for it,
``GROW`` re-allocates and copies on the compute device — but instead of moving bytes it
prices them on the link they cross, and instead of running the model it asks the
``CostModel``.

Timeline of one step starting at ``now``:

1. the host spends ``host_s`` scheduling and launching (not overlapped);
2. at ``issue = now + host_s`` the step's copies are queued on their links; a link carries
   one copy at a time per direction, so a copy starts when its link is free and its source
   is complete (a batch staged on a peer must land there before it hops on);
3. compute starts once every copy into the compute device that the plan ends
   (``MOVE_END``), and every copy that began in this same plan, has completed — so a
   prefetch begun in the previous step overlapped that step's compute, while a synchronous
   move (begin and end in one plan) is on the critical path; then ``GROW`` copies run;
4. compute takes ``CostModel.price(plan).device_s``; ``now`` moves to its end.

Copies between non-compute tiers (host -> staging device) never stall compute by
themselves; they only occupy their links. Invariant: ``now`` never decreases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from alignedserve.kv.store import HOST, KVHandle, KVOpKind, device_tier
from alignedserve.sched.plan import SampledToken, StepOutput, StepPlan
from alignedserve.sim.costmodel import CostModel, StepCost
from alignedserve.sim.hardware import NodeProfile

COMPUTE_TIER = device_tier(0)
SIM_TOKEN = SampledToken(token_id=1, logprob=0.0)  # any id that is not an EOS id
_REQUEST_ID = attrgetter("request_id")


@dataclass(slots=True)
class ExecutorTotals:
    """Sums over all steps (seconds of virtual time, bytes)."""

    steps: int = 0
    host_s: float = 0.0
    device_s: float = 0.0
    linear_s: float = 0.0
    prefill_attn_s: float = 0.0
    decode_attn_s: float = 0.0
    lm_head_sample_s: float = 0.0
    grow_s: float = 0.0
    copy_wait_s: float = 0.0
    copy_bytes: dict[str, int] = field(default_factory=dict)  # by route kind

    def add_cost(self, cost: StepCost) -> None:
        self.host_s += cost.host_s
        self.device_s += cost.device_s
        self.linear_s += cost.linear_s
        self.prefill_attn_s += cost.prefill_attn_s
        self.decode_attn_s += cost.decode_attn_s
        self.lm_head_sample_s += cost.lm_head_s + cost.sample_s


@dataclass(frozen=True, slots=True)
class _Route:
    kind: str  # "h2d", "d2h" or "peer": for the totals
    channels: tuple[tuple[str, ...], ...]  # every link direction the copy occupies
    rate: float  # bytes/s of the slowest of them
    latency_s: float


class SimulatedExecutor:
    """Executes plans in virtual time. ``now`` is the clock the scheduler should read."""

    def __init__(self, cost: CostModel, node: NodeProfile, bytes_per_token: int,
                 start_time: float = 0.0):
        self.cost = cost
        self.node = node
        self.bytes_per_token = bytes_per_token
        self.now = start_time
        self.totals = ExecutorTotals()
        self.last_cost = StepCost()  # of the latest step, for the runner's step record
        self._tier: dict[KVHandle, str] = {}
        self._cap: dict[KVHandle, int] = {}
        self._ready: dict[KVHandle, float] = {}  # when the handle's latest copy completes
        self._free_at: dict[tuple[str, ...], float] = {}  # per link direction
        self._routes: dict[tuple[str, str], _Route] = {}

    # ---- the interface ------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        cost = self.last_cost = self.cost.price(plan)
        issue = self.now + cost.host_s
        wait_until, grow_s, copied = self._replay(plan, issue)
        start = max(issue, wait_until)
        compute_s = grow_s + cost.device_s
        self.now = start + compute_s
        t = self.totals
        t.steps += 1
        t.add_cost(cost)
        t.grow_s += grow_s
        t.copy_wait_s += start - issue
        out = StepOutput(compute_s=compute_s, copy_wait_s=start - issue, copy_bytes=copied)
        sampled = out.sampled
        for chunk in plan.prefills:
            if chunk.sample:
                sampled[chunk.request.request_id] = SIM_TOKEN
        for batch in plan.decode_batches:
            sampled.update(dict.fromkeys(map(_REQUEST_ID, batch.requests), SIM_TOKEN))
        return out

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (no-op if the clock is already past it)."""
        if t > self.now:
            self.now = t

    # ---- KV ops -------------------------------------------------------------------------
    def _replay(self, plan: StepPlan, issue: float) -> tuple[float, float, int]:
        """Apply the op log; return (compute may start at, grow seconds, bytes copied)."""
        wait_until, grow_s, copied = issue, 0.0, 0
        begun: set[KVHandle] = set()
        bpt = self.bytes_per_token
        for op in plan.kv_ops:
            h, kind = op.handle, op.kind
            if kind is KVOpKind.ALLOC:
                self._tier[h] = op.tier
                self._cap[h] = op.capacity
                self._ready[h] = issue
            elif kind is KVOpKind.MOVE_BEGIN:
                nbytes = op.capacity * bpt
                self._ready[h] = self._copy(self._tier[h], op.tier, nbytes, issue, self._ready[h])
                begun.add(h)
                copied += nbytes
            elif kind is KVOpKind.MOVE_END:
                self._tier[h] = op.tier
                if op.tier == COMPUTE_TIER or h in begun:
                    wait_until = max(wait_until, self._ready[h])
            elif kind is KVOpKind.GROW:
                # the pool re-allocates and copies the old contents in place: read + write
                grow_s += 2 * self._cap[h] * bpt / self.cost.device.bandwidth
                self._cap[h] = op.capacity
            elif kind is KVOpKind.FREE:
                self._tier.pop(h, None)
                self._cap.pop(h, None)
                self._ready.pop(h, None)
        return wait_until, grow_s, copied

    def _copy(self, src: str, dst: str, nbytes: int, issue: float, ready: float) -> float:
        """Queue a copy on its link(s); return when it completes."""
        route = self._route(src, dst)
        start = max(issue, ready, *(self._free_at.get(c, 0.0) for c in route.channels))
        end = start + route.latency_s + nbytes / route.rate
        for c in route.channels:
            self._free_at[c] = end
        by_kind = self.totals.copy_bytes
        by_kind[route.kind] = by_kind.get(route.kind, 0) + nbytes
        return end

    def _route(self, src: str, dst: str) -> _Route:
        key = (src, dst)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._make_route(src, dst)
        return route

    def _make_route(self, src: str, dst: str) -> _Route:
        host, peer = self.node.host_link, self.node.peer_link
        if src == HOST or dst == HOST:
            kind = "h2d" if src == HOST else "d2h"
            dev = dst if src == HOST else src
            channels: tuple[tuple[str, ...], ...] = (("pcie", dev, kind),)
            rate, latency = host.rate, host.latency_s
        elif peer is not None:
            kind = "peer"
            channels = (("peer-out", src), ("peer-in", dst))
            rate, latency = peer.rate, peer.latency_s
        else:  # no peer link: bounce through host memory over both host links
            kind = "peer"
            channels = (("pcie", src, "d2h"), ("pcie", dst, "h2d"))
            rate, latency = host.rate, 2 * host.latency_s
        if self.node.single_copy_queue:
            channels = (("copy-queue",),)
        return _Route(kind, channels, rate, latency)
