"""``aligned``: length-aligned decode cohorts from a deep in-flight pool (AlignedServe).

Requests are admitted (prefilled on the device) while device room exists, evicting idle
cohorts to the host tier to make room: the number in flight is bounded by device + host KV,
not by the device alone. Which waiting request is admitted next is ``admission``: shortest
prompt first with aging (default; see ``alignedserve.sched.waiting``) or arrival order. A
request that finishes prefill joins a cohort whose KV lengths are within ``align_tolerance``
of its own, or starts one. Each step the scheduler picks cohorts to decode, by priority:

1. *starving* cohorts (not run for more than ``max_wait_steps`` steps), oldest first;
2. cohorts already on the device (no copy needed);
3. the least recently run.

A chosen cohort on the host is brought to the device (synchronously, if it was not
prefetched); others are written back to make room. After choosing, the scheduler *prefetches*
the host cohorts that will lead next step's order (``MOVE_BEGIN`` now, ``MOVE_END`` next step),
so their copy overlaps this step's compute. Cohorts whose lengths meet are merged; cohorts above
``max_cohort_rows`` are split. A cohort that does not run falls behind those that do, which is
how a lagging cohort catches up with a longer one and merges.

With several devices, ``dev0`` computes and the others stage KV for it: when the compute
device's host link is used up for a step (``prefetch_link_tokens``), the next cohort is copied
host -> peer device over the peer's own link, then peer -> compute device over the peer link
(GPU-Prefetch-For-GPU); peers are also where evicted cohorts park before the host.

Copy-aware pool: with a finite link budget (``prefetch_link_tokens`` > 0) the KV parked on the
host is capped at ``prefetch_link_tokens * max_wait_steps`` tokens, the KV the link can rotate
through the device within one waiting bound. Beyond that, fairness would demand more traffic
than prefetch can hide and steps would wait on copies (the simulator shows steps spending
most of their time in copies without the cap, docs/simulation.md); new requests wait in the
queue instead.
With an unlimited link (0, the default, e.g. on CPU where both tiers are RAM) there is no cap.

Waiting bound: when device KV can hold the prefilling requests plus any one cohort and the host
can take the rest, a ready cohort waits at most ``max_wait_steps + C`` steps, C being the number
of cohorts in flight (starving cohorts go first, oldest first wherever their KV is, and at least
one runs per step). Joins and merges never make a cohort whose KV (plus a growth block a row)
exceeds the compute device, and one that grows past it is split, so any one cohort can always
be made resident.
"""

from __future__ import annotations

import itertools

from alignedserve.request import Request, RequestStatus
from alignedserve.sched.cohort import Cohort, merge_pass, split_members
from alignedserve.sched.interface import BaseScheduler, DecodeGroup, QueueFull
from alignedserve.sched.plan import DecodeBatch, StepPlan
from alignedserve.sched.waiting import WaitingQueue


class AlignedScheduler(BaseScheduler):
    name = "aligned"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting = WaitingQueue(self.config.admission, self.config.max_admit_wait_steps)
        self.prefilling: list[Request] = []
        self.cohorts: dict[int, Cohort] = {}
        self._cohort_of: dict[str, Cohort] = {}
        self._cohort_ids = itertools.count()
        self.step_index = 0

    # ---- queues ---------------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue)")
        self.waiting.push(request, self.step_index, self.prefill_tokens_left(request))

    def _forget(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.prefilling:
            self.prefilling.remove(request)
        elif (cohort := self._cohort_of.pop(request.request_id, None)) is not None:
            cohort.requests.remove(request)
            if not cohort.requests:
                del self.cohorts[cohort.cohort_id]

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.prefilling) + sum(c.rows for c in self.cohorts.values())

    def num_inflight(self) -> int:
        return self.num_running()

    def decode_groups(self) -> list[DecodeGroup]:
        """One group per cohort, in the tier its KV is in (or moving to)."""
        return [DecodeGroup(c.rows, c.min_len, c.max_len, c.moving_to or c.tier)
                for c in list(self.cohorts.values()) if c.requests]

    # ---- the step -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step_index += 1
        plan = self._new_plan()
        self._finish_moves()
        self._absorb_prefilled()
        self._reshape()
        chosen = self._select(plan)
        budget = self.prompt_allowance(
            self.config.max_num_batched_tokens - sum(c.rows for c in chosen))
        budget = self._continue_prefills(plan, budget)
        self._admit(plan, budget, chosen)
        if not plan.has_work and self.cohorts:
            self._unblock(chosen)
        self._prefetch(chosen)
        return self._seal(plan)

    def _finish_moves(self) -> None:
        for cohort in self.cohorts.values():
            if cohort.moving_to is not None:
                self.store.end_group_move([request.kv for request in cohort.requests])
                cohort.tier, cohort.moving_to = cohort.moving_to, None
                self._set_status(cohort)

    def _set_status(self, cohort: Cohort) -> None:
        status = RequestStatus.RUNNING if cohort.tier == self.device else RequestStatus.PAUSED
        for request in cohort.requests:
            request.status = status

    def _absorb_prefilled(self) -> None:
        for request in [r for r in self.prefilling if not r.in_prefill]:
            self.prefilling.remove(request)
            self._join(request)

    def _join(self, request: Request) -> None:
        tier = self.store.tier_of(request.kv)
        tol, max_rows = self.config.align_tolerance, self._max_rows
        joinable = [c for c in self.cohorts.values()
                    if c.tier == tier and c.accepts(request, tol, max_rows, self._fits_device)]
        if joinable:
            cohort = max(joinable, key=lambda c: c.rows)
        else:
            cohort = Cohort(next(self._cohort_ids), tier, last_run_step=self.step_index - 1)
            self.cohorts[cohort.cohort_id] = cohort
        cohort.requests.append(request)
        self._cohort_of[request.request_id] = cohort

    @property
    def _max_rows(self) -> int:
        """The most rows a cohort may have: ``max_cohort_rows``, and no more than one step can
        decode (a cohort above ``max_num_seqs`` or the token budget could never be chosen,
        and would be dropped and recomputed forever)."""
        c = self.config
        return max(1, min(c.max_cohort_rows, c.max_num_seqs, c.max_num_batched_tokens))

    def _fits_device(self, requests: list[Request]) -> bool:
        """Whether ``requests`` may form one cohort: their KV, plus a growth block per row,
        fits the compute device on its own (so any one cohort can always be made resident,
        which the waiting bound rests on)."""
        kv = sum(self.store.capacity_of(r.kv) for r in requests)
        return kv + len(requests) * self.store.granularity <= self.store.total(self.device)

    def _reshape(self) -> None:
        """Merge cohorts whose lengths met; split the ones above ``_max_rows`` or grown too
        large for the device."""
        tol, max_rows = self.config.align_tolerance, self._max_rows
        cohorts = list(self.cohorts.values())
        for keep, absorbed in merge_pass(cohorts, tol, max_rows, self._fits_device):
            for request in absorbed.requests:
                self._cohort_of[request.request_id] = keep
            keep.requests.extend(absorbed.requests)
            del self.cohorts[absorbed.cohort_id]
        for cohort in [c for c in self.cohorts.values()
                       if c.rows > max_rows or (c.rows > 1 and not self._fits_device(c.requests))]:
            members = sorted(cohort.requests, key=lambda r: r.num_tokens)
            first, *rest = split_members(members, max_rows, self._fits_device)
            cohort.requests = first
            for part_members in rest:
                part = Cohort(next(self._cohort_ids), cohort.tier, cohort.last_run_step,
                              part_members, cohort.moving_to)
                self.cohorts[part.cohort_id] = part
                for request in part.requests:
                    self._cohort_of[request.request_id] = part

    def _priority(self, cohort: Cohort, step: int) -> tuple:
        """Sort key, smallest first: starving cohorts oldest first wherever their KV is (the
        waiting bound rests on this: a device-resident cohort that only just starved must not
        go before an older one on the host, or two such cohorts can take turns indefinitely);
        then device-resident before host, least recently run first."""
        if step - cohort.last_run_step > self.config.max_wait_steps:
            return (0, cohort.last_run_step, False, cohort.cohort_id)
        return (1, cohort.tier != self.device, cohort.last_run_step, cohort.cohort_id)

    def _select(self, plan: StepPlan) -> list[Cohort]:
        rows_left = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        ready = [c for c in self.cohorts.values() if c.moving_to is None]
        ready.sort(key=lambda c: self._priority(c, self.step_index))
        kv_left = self.store.total(self.device) - self._admission_reserve()
        held = self._catchup_holds(ready)
        chosen: list[Cohort] = []
        for cohort in ready:
            kv = self._kv_tokens(cohort) + cohort.rows * self.store.granularity
            if cohort.rows > rows_left or (chosen and kv > kv_left) or cohort in held:
                continue
            if self._make_resident(cohort, chosen) and self._grow(cohort, chosen):
                chosen.append(cohort)
                rows_left -= cohort.rows
                kv_left -= kv
        for cohort in chosen:
            plan.decode_batches.append(DecodeBatch(list(cohort.requests), cohort.cohort_id))
            cohort.last_run_step = self.step_index
        return chosen

    def _catchup_holds(self, ready: list[Cohort]) -> set[Cohort]:
        """Small cohorts to pause this step so the next shorter cohort catches up and merges.

        A cohort is held while the shorter neighbour (same tier, rows that fit together) is
        within ``catchup_window`` steps of meeting it; starving cohorts are never held.
        """
        window, tol = self.config.catchup_window, self.config.align_tolerance
        max_rows = self._max_rows
        small = [c for c in ready if c.rows <= max_rows // 2]
        small.sort(key=lambda c: (c.tier, c.min_len))
        held: set[Cohort] = set()
        for shorter, longer in zip(small, small[1:]):
            gap = longer.max_len - shorter.min_len - tol
            starving = self.step_index - longer.last_run_step > self.config.max_wait_steps
            if (shorter.tier == longer.tier and 0 < gap <= window and not starving
                    and shorter not in held and shorter.rows + longer.rows <= max_rows):
                held.add(longer)
        return held

    # ---- memory -----------------------------------------------------------------------------
    def _admission_reserve(self) -> int:
        """Device KV kept free of chosen cohorts so the pool can keep admitting.

        Without it, cohorts that fit the device would all run every step, none could be
        written back, and the in-flight pool could never grow past the device.
        """
        if not self.waiting or self.num_inflight() >= self.config.max_inflight:
            return 0
        need = self.store.round_up(self.initial_capacity(self.waiting.peek(self.step_index)))
        return need if self._host_can_take(need) else 0

    def _host_can_take(self, tokens: int) -> bool:
        """Whether the pool may grow by ``tokens`` of KV that push others out to the host."""
        return tokens <= self.store.free(self.host) and self._within_pool_cap(tokens)

    def _within_pool_cap(self, tokens: int) -> bool:
        """The copy-aware cap: with a finite link, in-flight KV beyond what the device tiers
        hold stays within ``prefetch_link_tokens * max_wait_steps`` after adding ``tokens``.
        Counted over all tiers at admission, so swaps and growth cannot open a way around it."""
        link = self.config.prefetch_link_tokens
        if link <= 0:
            return True
        return self.store.tokens_beyond_devices() + tokens <= link * self.config.max_wait_steps

    def _kv_tokens(self, cohort: Cohort) -> int:
        return sum(self.store.capacity_of(r.kv) for r in cohort.requests)

    def _make_resident(self, cohort: Cohort, protected: list[Cohort]) -> bool:
        if cohort.tier == self.device:
            return True
        need = self._kv_tokens(cohort)
        if not self._make_room(need, protected + [cohort]):
            return False
        self._move(cohort, self.device, now=True)
        return True

    def _grow(self, cohort: Cohort, protected: list[Cohort]) -> bool:
        for request in cohort.requests:
            if self.ensure_decode_capacity(request):
                continue
            self._make_room(self.config.kv_reserve_tokens, protected + [cohort])
            if not self.ensure_decode_capacity(request):
                return False
        return True

    def _make_room(self, tokens: int, protected: list[Cohort]) -> bool:
        """Write idle device cohorts back (to where the store parks them) until ``tokens``
        fit on the device."""
        if self.store.free(self.device) >= tokens:
            return True
        victims = [c for c in self.cohorts.values() if c.tier == self.device
                   and c.moving_to is None and all(c is not p for p in protected)]
        # Smallest first (least traffic: a whole cohort moves), then the just-run (they go
        # last again in the order anyway).
        victims.sort(key=lambda c: (self._kv_tokens(c), -c.last_run_step))
        for victim in victims:
            if dst := self.store.parking_tier(self._kv_tokens(victim), self.device):
                self._move(victim, dst, now=True)
                if self.store.free(self.device) >= tokens:
                    return True
        return self.store.free(self.device) >= tokens

    def _move(self, cohort: Cohort, dst: str, now: bool) -> None:
        """Move every member's KV to ``dst``; ``now=False`` leaves the copy running."""
        handles = [request.kv for request in cohort.requests]
        moved = self.store.begin_group_move(handles, dst)
        assert moved, "caller checked room for the whole cohort"
        cohort.moving_to = dst
        if now:
            self.store.end_group_move(handles)
            cohort.tier, cohort.moving_to = dst, None
            self._set_status(cohort)

    def _prefetch(self, chosen: list[Cohort]) -> None:
        """Start copying toward the device the cohorts that lead next step's order.

        Host cohorts go straight to the compute device while its host link has budget this
        step; otherwise they are staged on a peer device with a free link (GPU-Prefetch-For-GPU)
        and hop to the compute device over the peer link on a later step.
        """
        rows_left = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        ready = [c for c in self.cohorts.values() if c.moving_to is None]
        ready.sort(key=lambda c: self._priority(c, self.step_index + 1))
        headroom = self.config.kv_reserve_tokens * sum(c.rows for c in chosen)
        link_budget = self.config.prefetch_link_tokens or float("inf")
        links = dict.fromkeys(self.store.device_tiers, link_budget)
        for cohort in ready:
            if cohort.rows > rows_left:
                continue
            rows_left -= cohort.rows
            if cohort.tier == self.device:
                continue
            need = self._kv_tokens(cohort)
            if self.store.free(self.device) - headroom >= need and (
                    cohort.tier != self.host or links[self.device] >= need):
                if cohort.tier == self.host:
                    links[self.device] -= need
                self._move(cohort, self.device, now=False)
            elif cohort.tier == self.host and (
                    stage := self.store.staging_tier(need, self.device, links)):
                links[stage] -= need
                self._move(cohort, stage, now=False)

    # ---- prefill ----------------------------------------------------------------------------
    def _continue_prefills(self, plan: StepPlan, budget: int) -> int:
        for request in self.prefilling:
            if budget <= 0:
                break
            if chunk := self.next_chunk(request, budget):
                plan.prefills.append(chunk)
                budget -= chunk.num_tokens
        return budget

    def _admit(self, plan: StepPlan, budget: int, chosen: list[Cohort]) -> None:
        while self.waiting and budget > 0 and self.num_inflight() < self.config.max_inflight:
            request = self.waiting.peek(self.step_index)
            capacity = self.initial_capacity(request)
            need = self.store.round_up(capacity)
            if not self._within_pool_cap(need) and (self.prefilling or self.cohorts):
                return
            handle = self.store.allocate(self.device, capacity)
            if handle is None and self._host_can_take(need) and self._make_room(need, chosen):
                handle = self.store.allocate(self.device, capacity)
            if handle is None:
                if not self.prefilling and not self.cohorts:
                    self.waiting.remove(request)
                    self.fail_unfittable(request)
                    continue
                return
            self.waiting.remove(request)
            request.kv, request.status = handle, RequestStatus.RUNNING
            self.prefilling.append(request)
            chunk = self.next_chunk(request, budget)
            assert chunk is not None
            plan.prefills.append(chunk)
            budget -= chunk.num_tokens

    def _unblock(self, chosen: list[Cohort]) -> None:
        """Nothing could run (device and host full): drop one idle cohort's KV to recompute."""
        candidates = [c for c in self.cohorts.values()
                      if c.moving_to is None and all(c is not k for k in chosen)]
        if not candidates:
            return
        victim = max(candidates, key=lambda c: (c.tier == self.device, c.last_run_step))
        del self.cohorts[victim.cohort_id]
        for request in reversed(victim.requests):
            self._cohort_of.pop(request.request_id, None)
            self._release_kv(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            request.status = RequestStatus.WAITING
            self.waiting.push_front(request)
