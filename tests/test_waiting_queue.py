"""Admission order without a model: shortest prompt first with aging, or arrival order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.sched.waiting import WaitingQueue
from tests.fakes import make_request, run_to_completion
from tests.test_scheduler import build


def _queue(order="shortest", age=10, lengths=(300, 20, 150, 20)):
    queue = WaitingQueue(order, age)
    reqs = [make_request(f"r{i}", n, 1) for i, n in enumerate(lengths)]
    for r in reqs:
        queue.push(r, 0, r.num_prompt_tokens)
    return queue, reqs


def _drain(queue: WaitingQueue, step: int) -> list[str]:
    order = []
    while (r := queue.peek(step)) is not None:
        order.append(r.request_id)
        queue.remove(r)
    return order


def test_shortest_first_ties_in_arrival_order():
    queue, _ = _queue()
    assert _drain(queue, step=1) == ["r1", "r3", "r2", "r0"]


def test_fcfs_is_arrival_order():
    queue, _ = _queue("fcfs")
    assert _drain(queue, step=1) == ["r0", "r1", "r2", "r3"]


def test_an_aged_request_goes_before_younger_shorter_ones():
    queue, reqs = _queue(age=10)
    late = make_request("late", 5, 1)
    queue.push(late, 8, 5)
    assert queue.peek(9) is late  # shortest
    assert queue.peek(10) is reqs[0]  # r0 has waited 10 steps: oldest first
    assert _drain(queue, step=10) == ["r0", "r1", "r2", "r3", "late"]  # all aged: FCFS


def test_preempted_requests_go_first_and_removed_ones_never_come_back():
    queue, reqs = _queue()
    queue.remove(reqs[1])
    back = make_request("back", 900, 1)
    queue.push_front(back)
    assert len(queue) == 4 and back in queue and reqs[1] not in queue
    assert [r.request_id for r in queue] == ["back", "r0", "r2", "r3"]
    assert _drain(queue, step=1) == ["back", "r3", "r2", "r0"]
    assert queue.peek(1) is None


def test_preempted_requests_keep_their_age():
    """Back from preemption, a request is aged but keeps the step it first queued at: it goes
    before younger ones (other preempted ones included) and after an older aged one."""
    queue = WaitingQueue("shortest", 10)
    old, mid, young = (make_request(n, 50, 1) for n in ("old", "mid", "young"))
    for step, r in enumerate((old, mid, young)):
        queue.push(r, step, 50)
    for r in (old, mid, young):
        queue.remove(r)  # admitted
    queue.push_front(young)  # preempted, younger first (a cohort's reversed order)
    queue.push_front(mid)
    waiting = make_request("waiting", 5, 1)
    queue.push(waiting, 1, 5)  # queued with mid: on a tie the preempted one goes first
    assert [r.request_id for r in queue] == ["mid", "young", "waiting"]
    assert _drain(queue, step=5) == ["mid", "young", "waiting"]
    queue.push_front(old)
    queue.push(waiting, 1, 5)
    queue.push(make_request("later", 5, 1), 4, 5)
    assert _drain(queue, step=20) == ["old", "waiting", "later"]  # all aged: by first step


def test_rejects_unknown_orders():
    with pytest.raises(ValueError, match="admission"):
        WaitingQueue("lifo")
    with pytest.raises(ValueError, match="max_admit_wait_steps"):
        WaitingQueue("shortest", -1)


def test_short_prompts_are_prefilled_before_an_earlier_long_one():
    sched, ex = build("aligned", max_num_batched_tokens=64)
    long, short = make_request("long", 1000, 2), make_request("short", 30, 2)
    sched.add_request(long)
    sched.add_request(short)
    first_prefill = []
    run_to_completion(sched, ex, on_step=lambda plan: first_prefill.extend(
        c.request.request_id for c in plan.prefills if c.start == 0))
    assert first_prefill == ["short", "long"]
    assert short.first_token_time <= long.first_token_time


def test_fcfs_admission_keeps_arrival_order():
    sched, ex = build("aligned", max_num_batched_tokens=64, admission="fcfs")
    sched.add_request(make_request("long", 1000, 2))
    sched.add_request(make_request("short", 30, 2))
    first_prefill = []
    run_to_completion(sched, ex, on_step=lambda plan: first_prefill.extend(
        c.request.request_id for c in plan.prefills if c.start == 0))
    assert first_prefill == ["long", "short"]


arrivals = st.lists(st.tuples(st.integers(1, 400), st.integers(1, 20), st.integers(0, 30)),
                    min_size=1, max_size=40)


@settings(max_examples=50, deadline=None)
@given(work=arrivals, dev_tokens=st.integers(600, 3000), age=st.integers(0, 8),
       budget=st.integers(16, 160))
def test_no_request_is_passed_over_once_aged_and_none_is_lost(work, dev_tokens, age, budget):
    """The documented bound: once a request has waited ``max_admit_wait_steps`` steps, no
    younger request is admitted before it; every request finishes with all its tokens."""
    sched, ex = build("aligned", dev_tokens=dev_tokens, host_tokens=100_000,
                      max_num_batched_tokens=budget, max_admit_wait_steps=age,
                      kv_reserve_tokens=16)
    pending = sorted((arrive, i, p, m) for i, (p, m, arrive) in enumerate(work))
    reqs, queued_at, step = {}, {}, 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, p, m = pending.pop(0)
            reqs[i] = make_request(f"r{i}", p, m)
            queued_at[reqs[i].request_id] = sched.step_index
            sched.add_request(reqs[i])
        before = {r.request_id for r in sched.waiting}
        plan = sched.schedule()
        now = sched.step_index
        after = {r.request_id for r in sched.waiting}
        for admitted in before - after:
            passed_over = [w for w in after if queued_at[w] < queued_at[admitted]
                           and now - queued_at[w] >= age]
            assert not passed_over, (admitted, passed_over)
        sched.update(plan, ex.execute(plan))
        step += 1
        assert step < 20_000
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs.values())
    assert all(sched.store.used(t) == 0 for t in sched.store.tiers)
