"""The vLLM plug-in's admission lever and step counts as pure logic
(``alignedserve.integrations.alignment``): which waiting request is offered first, the bound on
how long any request can be passed over, and the churn count. No vLLM needed; the same
functions run inside vLLM in ``tests/test_vllm_plugin.py``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.integrations.alignment import (Candidate, DecodeStepRecord, WaitClock,
                                                 admission_order, churn, fits_a_group)

candidates = st.lists(st.builds(Candidate, length=st.integers(1, 400),
                                waited=st.integers(0, 100), arrival=st.integers(0, 50),
                                pinned=st.booleans()), max_size=40)


def _is_older(a: Candidate, i: int, b: Candidate, j: int) -> bool:
    """``a`` (at index ``i``) entered the queue before ``b``: the order ``oldest first`` uses."""
    return (-a.waited, a.arrival, i) < (-b.waited, b.arrival, j)


@given(candidates, st.lists(st.integers(1, 400), max_size=20), st.integers(0, 40),
       st.integers(0, 80))
def test_admission_order_classes(cands, running, tolerance, max_wait):
    """A permutation: pinned ones first in queue order, then aged, fitting and the rest, each
    oldest first."""
    order = admission_order(cands, running, tolerance, max_wait)
    assert sorted(order) == list(range(len(cands)))

    def rank(i: int) -> int:
        c = cands[i]
        if c.pinned:
            return 0
        if c.waited >= max_wait:
            return 1
        return 2 if any(abs(c.length - n) <= tolerance for n in running) else 3

    assert [rank(i) for i in order] == sorted(rank(i) for i in order)
    pinned = [i for i in order if cands[i].pinned]
    assert pinned == sorted(pinned)
    for a, b in zip(order, order[1:]):
        if rank(a) == rank(b) > 0:
            assert _is_older(cands[a], a, cands[b], b)


@given(st.integers(0, 500), st.lists(st.integers(0, 500), max_size=30), st.integers(0, 50))
def test_fits_a_group_matches_a_scan(length, running, tolerance):
    assert fits_a_group(length, sorted(running), tolerance) == \
        any(abs(length - n) <= tolerance for n in running)


def test_fitting_requests_go_before_older_ones_until_those_age():
    running = [300, 310]
    queue = [Candidate(1000, waited=5, arrival=0), Candidate(305, waited=2, arrival=3),
             Candidate(50, waited=1, arrival=4), Candidate(280, waited=0, arrival=5)]
    assert admission_order(queue, running, tolerance=32, max_wait_steps=64) == [1, 3, 0, 2]
    # once the long prompt has waited max_wait_steps, nothing younger goes before it
    assert admission_order(queue, running, tolerance=32, max_wait_steps=5) == [0, 1, 3, 2]
    # a preempted request (pinned) keeps the front
    pinned = [Candidate(900, 0, 9, pinned=True)] + queue
    assert admission_order(pinned, running, 32, 64)[0] == 0
    with pytest.raises(ValueError):
        admission_order(queue, running, -1, 5)


def test_churn_counts_requests_entering_and_leaving():
    assert churn({"a", "b", "c"}, {"b", "c", "d", "e"}) == 3
    assert churn(set(), set()) == 0
    record = DecodeStepRecord.of(3, [10, 12], 4, churn=3, admitted=1, admitted_fitting=1)
    assert (record.churn, record.admitted, record.max_admit_wait) == (3, 1, 0)


def test_wait_clock_counts_steps_and_forgets():
    clock = WaitClock()
    clock.observe(["a"], 10)
    clock.observe(["a", "b"], 12)
    assert (clock.waited("a", 12), clock.waited("b", 12), clock.waited("c", 12)) == (2, 0, 0)
    clock.observe(["b"], 13)  # a was admitted
    clock.observe(["a", "b"], 20)  # a is back (preempted): its wait starts again
    assert (clock.waited("a", 20), clock.waited("b", 20)) == (0, 8)


def _simulate(seed: int, max_wait: int, tolerance: int, per_step: list[int] | None):
    """A queue under the lever for 120 steps of random arrivals, running lengths and
    admissions (``per_step``: admissions each step; None: random 0..3). Yields, per step,
    ``(step, queue_before, admitted_indices, enter_steps)``."""
    rng = random.Random(seed)
    clock, queue, enter, pinned, ident = WaitClock(), [], {}, set(), 0
    for step in range(120):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            queue.append(ident)
            enter[ident] = step
            if per_step is None and rng.random() < 0.05:
                pinned.add(ident)
            ident += 1
        clock.observe(queue, step)
        cands = [Candidate(8 + (q * 37) % 600, clock.waited(q, step), enter[q], q in pinned)
                 for q in queue]
        running = [rng.randrange(1, 600) for _ in range(rng.randrange(0, 12))]
        order = admission_order(cands, running, tolerance, max_wait)
        k = per_step[step % len(per_step)] if per_step else rng.randrange(0, 4)
        admitted = [queue[i] for i in order[:k]]
        yield step, list(queue), admitted, enter, pinned
        queue = [q for q in queue if q not in admitted]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 30), st.integers(0, 64))
def test_an_aged_request_is_never_passed_over_by_a_younger_one(seed, max_wait, tolerance):
    """The bound, step by step: whenever a request is admitted, no request that entered the
    queue before it and has waited ``max_wait`` steps is left waiting (pinned ones aside)."""
    for step, queue, admitted, enter, pinned in _simulate(seed, max_wait, tolerance, None):
        left = [q for q in queue if q not in admitted]
        for y in admitted:
            if y in pinned:
                continue
            assert not [x for x in left if x not in pinned and step - enter[x] >= max_wait
                        and (enter[x], x) < (enter[y], y)], (step, y)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 30), st.integers(0, 64))
def test_wait_is_at_most_max_wait_plus_the_fcfs_wait(seed, max_wait, tolerance):
    """One admission per step, nothing pinned: a request waits at most ``max_wait`` steps more
    than arrival order would make it wait (the requests older than it when it entered)."""
    older_at_entry: dict[int, int] = {}
    admitted_at: dict[int, int] = {}
    seen: set[int] = set()
    enter: dict[int, int] = {}
    for step, queue, admitted, enter, _ in _simulate(seed, max_wait, tolerance, [1]):
        for q in queue:
            if q not in seen:
                seen.add(q)
                older_at_entry[q] = sum(1 for x in queue if (enter[x], x) < (enter[q], q))
        for y in admitted:
            admitted_at[y] = step
    for q, step in admitted_at.items():
        assert step - enter[q] <= max_wait + older_at_entry[q], q
