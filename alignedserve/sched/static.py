"""``static``: whole batches run to completion, in the manner of FasterTransformer.

When no batch is active, up to ``max_num_seqs`` waiting requests are admitted in arrival order,
each reserving KV for its full length (prompt + max_tokens) so it can never be preempted. The
batch prefills (in token-budget chunks), then decodes in lockstep until every member has
finished; requests that arrive meanwhile wait for the next batch.
"""

from __future__ import annotations

from collections import deque

from alignedserve.request import Request
from alignedserve.sched.interface import BaseScheduler
from alignedserve.sched.plan import DecodeBatch, StepPlan


class StaticScheduler(BaseScheduler):
    name = "static"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []
        self._batch_ids = 0

    def _enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def _forget(self, request: Request) -> None:
        for queue in (self.batch, self.waiting):
            if request in queue:
                queue.remove(request)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.batch)

    def schedule(self) -> StepPlan:
        plan = self._new_plan()
        if not self.batch:
            self._admit_batch()
        budget = self.prompt_allowance(self.config.max_num_batched_tokens)
        prefilling = [r for r in self.batch if r.in_prefill]
        for request in prefilling:
            if budget <= 0:
                break
            if chunk := self.next_chunk(request, budget):
                plan.prefills.append(chunk)
                budget -= chunk.num_tokens
        if not prefilling:  # lockstep: decode only once the whole batch is prefilled
            plan.decode_batches.append(DecodeBatch(list(self.batch), batch_id=self._batch_ids))
        return self._seal(plan)

    def _admit_batch(self) -> None:
        self._batch_ids += 1
        while len(self.batch) < self.config.max_num_seqs:
            request = self.admit_head(self.waiting, lambda r: r.max_total_tokens,
                                      alone=not self.batch)
            if request is None:
                break
            self.batch.append(request)
