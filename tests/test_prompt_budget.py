"""The step-time prompt budget: its fixed point, its bounds, and every policy honouring it."""

import pytest

from alignedserve.sched.budget import PromptBudget
from alignedserve.sched.registry import POLICIES
from tests.fakes import make_request, run_to_completion
from tests.test_scheduler import build


def settle(budget: PromptBudget, per_token_s: float, decode_s: float, steps: int = 60) -> int:
    """Run ``steps`` steps that each take the whole budget, timed by a linear cost model."""
    for _ in range(steps):
        tokens = budget.tokens()
        budget.observe(tokens, tokens * per_token_s + decode_s)
    return budget.tokens()


def test_the_cap_holds_until_a_step_is_timed():
    budget = PromptBudget(cap=2048, target_s=0.5, floor=256)
    assert budget.tokens() == 2048
    budget.observe(0, 0.3)  # a decode-only step says nothing about prompt cost
    assert budget.tokens() == 2048


@pytest.mark.parametrize("per_token_s, decode_s", [(1e-3, 0.1), (0.5e-3, 0.05), (2e-3, 0.0)])
def test_steps_settle_at_the_target_time(per_token_s, decode_s):
    budget = PromptBudget(cap=4096, target_s=0.6, floor=64, quantum=16)
    tokens = settle(budget, per_token_s, decode_s)
    assert tokens == pytest.approx((0.6 - decode_s) / per_token_s, abs=2 * 16)
    assert tokens * per_token_s + decode_s == pytest.approx(0.6, rel=0.1)


def test_the_budget_stays_within_floor_and_cap():
    fast = PromptBudget(cap=2048, target_s=0.5, floor=256)
    assert settle(fast, 1e-5, 0.0) == 2048  # a fast machine keeps the cap
    slow = PromptBudget(cap=2048, target_s=0.5, floor=256)
    assert settle(slow, 1e-3, 0.6) == 256  # decode rows alone overrun the target


def test_a_short_chunk_does_not_shrink_the_budget():
    budget = PromptBudget(cap=2048, target_s=0.5, floor=256)
    settle(budget, 0.5e-3, 0.0)
    before = budget.tokens()
    budget.observe(10, 0.2)  # a short prompt's last chunk beside many decode rows
    assert budget.tokens() == before


def test_a_zero_target_keeps_the_token_cap():
    budget = PromptBudget(cap=512, target_s=0.0, floor=64)
    assert settle(budget, 1e-2, 0.0) == 512


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_chunks_prompts_to_the_time_budget(policy):
    """2 ms per prompt token against a 0.25 s target: once timed, no step carries more than
    ~125 prompt tokens, though the token cap would allow 1024; every request still completes."""
    sched, ex = build(policy, max_num_batched_tokens=1024, step_time_target_s=0.25,
                      min_prompt_tokens_per_step=32)
    ex.cost = lambda prompt_tokens, rows: prompt_tokens * 2e-3 + rows * 1e-4
    reqs = [make_request(f"r{i}", 600, 4) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    prompt_sizes = []
    run_to_completion(sched, ex, on_step=lambda plan: prompt_sizes.append(
        sum(c.num_tokens for c in plan.prefills)))
    assert prompt_sizes[0] == 1024  # untimed: the cap
    assert 0 < max(prompt_sizes[1:]) <= 128
    assert all(len(r.output_token_ids) == 4 for r in reqs)


def test_serve_targets_step_time_and_offline_keeps_the_token_budget():
    """`serve` turns the step-time target on by default; `generate` (offline) leaves it off."""
    from alignedserve.config import SERVING_STEP_TIME_TARGET_S
    from alignedserve.entrypoints.args import engine_config_from_args
    from alignedserve.entrypoints.cli import build_parser

    def target(*argv: str) -> float:
        return engine_config_from_args(build_parser().parse_args(argv)).scheduler.step_time_target_s

    assert target("serve") == SERVING_STEP_TIME_TARGET_S > 0
    assert target("serve", "--step-time-target", "0") == 0
    assert target("generate", "--prompt", "hi") == 0
