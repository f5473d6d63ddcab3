"""``fcfs``: continuous batching in arrival order, in the manner of vLLM's scheduler.

Every step: running requests decode (one token each), unfinished prefills continue in chunks,
swapped-out requests come back, then waiting requests are admitted in arrival order while the
token budget, ``max_num_seqs`` and device KV allow. When a running request's KV cannot grow,
the most recently admitted request is preempted: its KV is swapped to the host tier if there
is room there, otherwise dropped and recomputed later. All decode rows form one batch, of
whatever lengths they happen to have.
"""

from __future__ import annotations

from collections import deque

from alignedserve.request import Request, RequestStatus
from alignedserve.sched.interface import BaseScheduler
from alignedserve.sched.plan import DecodeBatch, StepPlan


class FcfsScheduler(BaseScheduler):
    name = "fcfs"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []

    def _enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def _forget(self, request: Request) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> StepPlan:
        plan = self._new_plan()
        budget = self.config.max_num_batched_tokens
        decode = self._schedule_decodes(budget)
        budget = self.prompt_allowance(budget - len(decode))
        for request in self.running:
            if budget <= 0:
                break
            if request.in_prefill and (chunk := self.next_chunk(request, budget)):
                plan.prefills.append(chunk)
                budget -= chunk.num_tokens
        if not self.swapped:  # swapped requests come back before new ones are admitted
            budget = self._admit_waiting(plan, budget)
        self._swap_in()
        if decode:
            plan.decode_batches.append(DecodeBatch(decode))
        return self._seal(plan)

    def _schedule_decodes(self, budget: int) -> list[Request]:
        rows: list[Request] = []
        for request in list(self.running):
            if len(rows) >= budget:
                break
            if request not in self.running or request.in_prefill:
                continue  # preempted as a victim earlier in this loop, or still prefilling
            while not self.ensure_decode_capacity(request):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                rows.append(request)
        return rows

    def _preempt(self, request: Request) -> None:
        """Swap ``request`` out to the host tier, or drop its KV for recomputation."""
        self.running.remove(request)
        request.num_preemptions += 1
        if request.kv is not None and self.store.move(request.kv, self.host):
            request.status = RequestStatus.PAUSED
            self.swapped.append(request)
            return
        self._release_kv(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if not self.store.move(request.kv, self.device):
                break
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.admit_head(self.waiting, self.initial_capacity,
                                      alone=not self.running and not self.swapped)
            if request is None:
                break
            self.running.append(request)
            chunk = self.next_chunk(request, budget)
            assert chunk is not None
            plan.prefills.append(chunk)
            budget -= chunk.num_tokens
        return budget
