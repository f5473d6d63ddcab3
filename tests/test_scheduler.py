"""fcfs and static policies on fake requests and a fake executor: no model, milliseconds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.config import SchedulerConfig
from alignedserve.kv.store import HOST, KVStore
from alignedserve.request import FinishReason
from alignedserve.sched.registry import POLICIES, make_scheduler
from tests.fakes import EOS, FakeExecutor, make_request, run_to_completion

BYTES_PER_TOKEN = 10


def build(policy, dev_tokens=10_000, host_tokens=50_000, devices=1, **cfg):
    store = KVStore.for_devices([dev_tokens * BYTES_PER_TOKEN] * devices,
                                host_tokens * BYTES_PER_TOKEN, BYTES_PER_TOKEN, granularity=16)
    config = SchedulerConfig(**{"max_num_batched_tokens": 256, "kv_reserve_tokens": 32, **cfg})
    sched = make_scheduler(policy, config, store)
    return sched, FakeExecutor(store)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_gets_exactly_max_tokens(policy):
    sched, ex = build(policy)
    reqs = [make_request(f"r{i}", p, m) for i, (p, m) in enumerate([(5, 3), (300, 40), (1, 1), (70, 100)])]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, ex)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert sched.store.used("dev0") == 0 and sched.store.used(HOST) == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_token_budget_is_respected_and_prompts_are_chunked(policy):
    sched, ex = build(policy, max_num_batched_tokens=64)
    sched.add_request(make_request("long", 1000, 5))
    sched.add_request(make_request("short", 10, 50))
    sizes = []
    run_to_completion(sched, ex, on_step=lambda plan: sizes.append(plan.num_tokens))
    assert max(sizes) <= 64


def test_fcfs_decodes_while_a_long_prompt_prefills():
    sched, ex = build("fcfs", max_num_batched_tokens=64)
    short = make_request("short", 8, 50)
    sched.add_request(short)
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, ex.execute(plan))
    sched.add_request(make_request("long", 2000, 5))
    decoded_during_prefill = 0
    for _ in range(10):
        plan = sched.schedule()
        if plan.prefills and plan.decode_requests:
            decoded_during_prefill += 1
        sched.update(plan, ex.execute(plan))
    assert decoded_during_prefill >= 5  # the long prompt did not freeze the short request


def test_static_admits_no_one_until_the_batch_is_done():
    sched, ex = build("static")
    first = make_request("first", 10, 20)
    sched.add_request(first)
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    late = make_request("late", 10, 5)
    sched.add_request(late)
    while not first.is_finished:
        plan = sched.schedule()
        assert late not in [c.request for c in plan.prefills]
        sched.update(plan, ex.execute(plan))
    run_to_completion(sched, ex)
    assert late.is_finished and late.first_token_time >= first.finish_time


def test_fcfs_preempts_by_swapping_to_host_and_resumes():
    sched, ex = build("fcfs", dev_tokens=400, kv_reserve_tokens=16)
    reqs = [make_request(f"r{i}", 100, 150) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, ex)
    assert all(len(r.output_token_ids) == 150 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0


def test_fcfs_recomputes_when_host_is_full_too():
    sched, ex = build("fcfs", dev_tokens=400, host_tokens=0, kv_reserve_tokens=16)
    reqs = [make_request(f"r{i}", 100, 150) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, ex)
    assert all(len(r.output_token_ids) == 150 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_request_that_can_never_fit_fails_explicitly(policy):
    sched, ex = build(policy, dev_tokens=100)
    big = make_request("big", 500, 10)
    ok = make_request("ok", 10, 5)
    sched.add_request(big)
    sched.add_request(ok)
    run_to_completion(sched, ex)
    assert big.finish_reason is FinishReason.ERROR and "device-kv-gb" in big.error
    assert ok.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_eos_stops_unless_ignored(policy):
    sched, ex = build(policy)
    ex.token = EOS
    stops = make_request("stops", 10, 20, ignore_eos=False)
    runs = make_request("runs", 10, 20, ignore_eos=True)
    sched.add_request(stops)
    sched.add_request(runs)
    run_to_completion(sched, ex)
    assert stops.output_token_ids == [EOS] and stops.finish_reason is FinishReason.STOP
    assert len(runs.output_token_ids) == 20


workloads = st.lists(
    st.tuples(st.integers(1, 400), st.integers(1, 60), st.integers(0, 30), st.booleans()),
    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), work=workloads,
       dev_tokens=st.integers(600, 5000), host_tokens=st.sampled_from([0, 2000, 20000]),
       budget=st.integers(16, 512))
def test_random_workloads_finish_with_exact_counts_and_no_leaks(policy, work, dev_tokens,
                                                               host_tokens, budget):
    """Arrivals over time, random aborts, tight memory: all requests end, KV returns to zero."""
    sched, ex = build(policy, dev_tokens=dev_tokens, host_tokens=host_tokens,
                      max_num_batched_tokens=budget)
    pending = sorted(((arrive, i, p, m, abort) for i, (p, m, arrive, abort) in enumerate(work)))
    reqs = {}
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, p, m, abort = pending.pop(0)
            reqs[i] = (make_request(f"r{i}", p, m), abort)
            sched.add_request(reqs[i][0])
        for i, (r, abort) in reqs.items():
            if abort and not r.is_finished and len(r.output_token_ids) >= 2:
                sched.abort_request(r.request_id)
        plan = sched.schedule()
        assert plan.num_tokens <= budget
        sched.update(plan, ex.execute(plan))
        sched.store.check_invariants()
        step += 1
        assert step < 20_000
    for r, abort in reqs.values():
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH:
            assert len(r.output_token_ids) == r.params.max_tokens
        else:
            assert r.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
            assert abort or r.finish_reason is FinishReason.ERROR
    # the executor's mirror and the store agree that nothing is held
    plan = sched.schedule()
    ex.execute(plan)
    assert not ex.tiers and all(sched.store.used(t) == 0 for t in sched.store.tiers)
