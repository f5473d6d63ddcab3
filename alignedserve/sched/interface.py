"""The scheduler protocol and the bookkeeping every policy shares.

Call order, per engine step: ``plan = schedule()`` -> executor runs the plan ->
``update(plan, output)``. Between steps the engine may call ``add_request``,
``abort_request`` and ``finish_request``. A policy only decides *what runs*; appending tokens,
stop checks and freeing KV are common and live here.

Invariants: every request added is, at any moment, in exactly one of the policy's queues or
finished; a finished request holds no KV; ``KVStore`` ops are drained into the next plan.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from alignedserve.config import SchedulerConfig
from alignedserve.kv.store import HOST, KVStore, device_tier
from alignedserve.sched.budget import PromptBudget
from alignedserve.request import FinishReason, Request, RequestStatus
from alignedserve.sched.plan import PrefillChunk, StepOutput, StepPlan


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One group of decoding requests as the policy keeps them (a cohort under ``aligned``):
    how many rows, the range of their KV lengths, and the tier holding their KV."""

    rows: int
    min_len: int
    max_len: int
    tier: str


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``: the caller should back off and retry."""


class Scheduler(Protocol):
    store: KVStore

    def add_request(self, request: Request) -> None: ...
    def abort_request(self, request_id: str) -> Request | None: ...
    def finish_request(self, request: Request, reason: FinishReason) -> None: ...
    def schedule(self) -> StepPlan: ...
    def update(self, plan: StepPlan, output: StepOutput) -> list[Request]: ...
    def has_unfinished(self) -> bool: ...
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...


class BaseScheduler:
    """Shared state and the token-level bookkeeping; subclasses implement ``schedule``."""

    name = "base"

    def __init__(self, config: SchedulerConfig, store: KVStore, clock=time.monotonic):
        self.config = config
        self.store = store
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._step_ids = itertools.count()
        self.prompt_budget = PromptBudget(config.max_num_batched_tokens, config.step_time_target_s,
                                          config.min_prompt_tokens_per_step)

    # ---- policy hooks --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        raise NotImplementedError

    def _forget(self, request: Request) -> None:
        """Remove ``request`` from the policy's queues (it finished or was aborted)."""
        raise NotImplementedError

    def num_waiting(self) -> int:
        raise NotImplementedError

    def num_running(self) -> int:
        raise NotImplementedError

    def decode_groups(self) -> list[DecodeGroup]:
        """The decoding requests as the policy groups them, for display (no request text).
        By default one group per tier: every request past its prefill whose KV sits there."""
        lengths: dict[str, list[int]] = {}
        for request in list(self.requests.values()):
            if request.kv is not None and not request.in_prefill:
                lengths.setdefault(self.store.tier_of(request.kv), []).append(request.num_tokens)
        return [DecodeGroup(len(ls), min(ls), max(ls), tier) for tier, ls in lengths.items()]

    # ---- shared --------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return device_tier(0)

    @property
    def host(self) -> str:
        return HOST

    def add_request(self, request: Request) -> None:
        """Queue a request; raises QueueFull when the bounded waiting queue is full."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._enqueue(request)
        self.requests[request.request_id] = request

    def _enqueue(self, request: Request) -> None:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, FinishReason.ABORT)
        return request

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """Mark finished, leave the queues, free KV. Idempotent."""
        if request.is_finished:
            return
        self._forget(request)
        self._release_kv(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = self.clock()
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def _release_kv(self, request: Request) -> None:
        if request.kv is not None:
            self.store.free_handle(request.kv)
            request.kv = None

    def update(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """Advance KV lengths, append sampled tokens, apply token-level stops; time the
        prompt budget."""
        touched: list[Request] = []
        self.prompt_budget.observe(sum(c.num_tokens for c in plan.prefills), output.compute_s)
        for chunk in plan.prefills:
            chunk.request.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                self._append(chunk.request, output, touched)
        for request in plan.decode_requests:
            request.num_computed_tokens += 1
            self._append(request, output, touched)
        return touched

    def _append(self, request: Request, output: StepOutput, touched: list[Request]) -> None:
        if request.is_finished:  # aborted while the step ran
            return
        token = output.sampled[request.request_id]
        request.output_token_ids.append(token.token_id)
        if request.params.logprobs is not None:
            top = dict(token.top_logprobs or {})
            top[token.token_id] = token.logprob
            request.output_logprobs.append(top)
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        reason = request.stop_reason_after_append()
        if reason is not None:
            self.finish_request(request, reason)
        touched.append(request)

    # ---- helpers for policies ------------------------------------------------------------
    def _new_plan(self) -> StepPlan:
        return StepPlan(step_id=next(self._step_ids))

    def _seal(self, plan: StepPlan) -> StepPlan:
        """Attach the KV op log and the finished ids accumulated since the last plan."""
        plan.kv_ops = self.store.drain_ops()
        plan.finished_request_ids, self._finished_ids = self._finished_ids, []
        return plan

    @staticmethod
    def prefill_target(request: Request) -> int:
        """Tokens that must be in the KV cache before the request can decode."""
        if not request.output_token_ids:
            return request.num_prompt_tokens
        return request.num_tokens - 1  # recompute after preemption: all but the newest token

    def prefill_tokens_left(self, request: Request) -> int:
        """Tokens still to prefill before ``request`` can decode."""
        return self.prefill_target(request) - request.num_computed_tokens

    def prompt_allowance(self, cap_left: int) -> int:
        """Prompt tokens this step may take when ``cap_left`` tokens of the step's token cap
        are left (the cap counts decode rows too), held to the step-time budget."""
        return min(cap_left, self.prompt_budget.tokens())

    def next_chunk(self, request: Request, budget: int) -> PrefillChunk | None:
        """The next prefill chunk of ``request`` within ``budget`` tokens, or None."""
        target = self.prefill_target(request)
        n = min(self.prefill_tokens_left(request), budget)
        if n <= 0:
            return None
        end = request.num_computed_tokens + n
        sample = end == target and not request.output_token_ids
        return PrefillChunk(request, request.num_computed_tokens, n, sample)

    def initial_capacity(self, request: Request) -> int:
        """KV capacity to reserve at admission: what it holds plus some output headroom."""
        reserve = self.config.kv_reserve_tokens
        return min(request.num_tokens + reserve, request.max_total_tokens)

    def ensure_decode_capacity(self, request: Request) -> bool:
        """Grow the request's KV so the token it feeds this step fits; False if no room."""
        assert request.kv is not None
        need = request.num_tokens
        if self.store.capacity_of(request.kv) >= need:
            return True
        want = min(need + self.config.kv_reserve_tokens, request.max_total_tokens)
        return self.store.grow(request.kv, want) or self.store.grow(request.kv, need)

    def admit_head(self, waiting: deque[Request], capacity: Callable[[Request], int],
                   alone: bool) -> Request | None:
        """Pop the head of ``waiting`` with ``capacity(head)`` tokens of device KV, mark it
        running and return it; None when ``waiting`` is empty or the device has no room now.

        ``alone`` says nothing else holds device KV: then a head that still does not fit never
        will, so it is failed with an explicit error and the next head is tried.
        """
        while waiting:
            request = waiting[0]
            handle = self.store.allocate(self.device, capacity(request))
            if handle is None:
                if not alone:
                    return None
                waiting.popleft()
                self.fail_unfittable(request)
                continue
            waiting.popleft()
            request.kv, request.status = handle, RequestStatus.RUNNING
            return request
        return None

    def fail_unfittable(self, request: Request) -> None:
        """Finish a request whose KV can never fit on the device with an explicit error."""
        request.error = (f"request needs KV for {request.num_tokens} tokens but the device "
                         f"KV budget holds {self.store.total(self.device)}: raise --device-kv-gb")
        self.finish_request(request, FinishReason.ERROR)
