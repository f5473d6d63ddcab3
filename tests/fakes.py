"""Test doubles: a fake executor that checks what a real one relies on, and request factories."""

from __future__ import annotations

from alignedserve.kv.store import KVOpKind, KVStore
from alignedserve.request import Request
from alignedserve.sampling_params import SamplingParams
from alignedserve.sched.plan import SampledToken, StepOutput, StepPlan

FAKE_TOKEN = 7
EOS = 2


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0,
                 ignore_eos: bool = True, max_model_len: int = 100_000) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(rid, list(range(10, 10 + prompt_len)), params, eos_token_ids=frozenset({EOS}),
                   max_model_len=max_model_len, arrival_time=arrival)


class FakeExecutor:
    """Mirrors the KV op log and asserts the plan is executable; samples a fixed token.

    Checks: ops are well-formed (no double alloc, no use of unknown handles, moves paired);
    every computed request's KV is resident on a device tier, not mid-move, with capacity for
    the positions written; prefill chunks continue exactly where the KV ends; no request
    appears twice in a step.
    """

    def __init__(self, store: KVStore, token: int = FAKE_TOKEN, cost=None):
        """``cost(prompt_tokens, decode_rows)``, when given, is the step's reported compute
        time in seconds (a cost model for what the scheduler times)."""
        self.store = store
        self.token = token
        self.cost = cost
        self.tiers: dict = {}
        self.capacity: dict = {}
        self.moving: dict = {}
        self.steps = 0

    def _replay(self, plan: StepPlan) -> None:
        for op in plan.kv_ops:
            h = op.handle
            if op.kind is KVOpKind.ALLOC:
                assert h not in self.tiers
                self.tiers[h], self.capacity[h] = op.tier, op.capacity
            elif op.kind is KVOpKind.GROW:
                assert h in self.tiers and h not in self.moving
                assert op.capacity > self.capacity[h]
                self.capacity[h] = op.capacity
            elif op.kind is KVOpKind.MOVE_BEGIN:
                assert h in self.tiers and h not in self.moving
                self.moving[h] = op.tier
            elif op.kind is KVOpKind.MOVE_END:
                assert self.moving.pop(h) == op.tier
                self.tiers[h] = op.tier
            elif op.kind is KVOpKind.FREE:
                assert h in self.tiers
                self.moving.pop(h, None)
                del self.tiers[h], self.capacity[h]

    def _check_resident(self, request: Request, end: int) -> None:
        h = request.kv
        assert h is not None, f"{request.request_id} computed without KV"
        assert self.tiers[h] == "dev0" and h not in self.moving, "KV not on the compute device"
        assert self.capacity[h] >= end, f"capacity {self.capacity[h]} < {end}"

    def execute(self, plan: StepPlan) -> StepOutput:
        self.steps += 1
        self._replay(plan)
        out = StepOutput()
        seen: set[str] = set()
        for chunk in plan.prefills:
            r = chunk.request
            assert r.request_id not in seen
            seen.add(r.request_id)
            assert chunk.start == r.num_computed_tokens and chunk.num_tokens > 0
            self._check_resident(r, chunk.start + chunk.num_tokens)
            if chunk.sample:
                out.sampled[r.request_id] = SampledToken(self.token, -0.5)
        for r in plan.decode_requests:
            assert r.request_id not in seen
            seen.add(r.request_id)
            assert r.num_computed_tokens == r.num_tokens - 1, "decode row is not caught up"
            self._check_resident(r, r.num_tokens)
            out.sampled[r.request_id] = SampledToken(self.token, -0.5)
        if self.cost is not None:
            out.compute_s = self.cost(sum(c.num_tokens for c in plan.prefills),
                                      len(plan.decode_requests))
        return out


def run_to_completion(scheduler, executor, max_steps: int = 100_000, on_step=None) -> int:
    """Step until the scheduler is empty; return the step count."""
    steps = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        out = executor.execute(plan)
        scheduler.update(plan, out)
        scheduler.store.check_invariants()
        if on_step is not None:
            on_step(plan)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps
