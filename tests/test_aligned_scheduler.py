"""The aligned policy without a model: tolerance, deep pool, waiting bound, prefetch, backpressure."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from alignedserve.kv.store import HOST, KVOpKind
from alignedserve.request import FinishReason
from alignedserve.sched.interface import QueueFull
from tests.fakes import make_request, run_to_completion
from tests.test_scheduler import build


def test_decode_batches_respect_the_tolerance_and_stay_aligned():
    sched, ex = build("aligned", align_tolerance=2)
    for i, p in enumerate([100, 101, 102, 150, 151, 300, 30, 31, 33, 35]):
        sched.add_request(make_request(f"r{i}", p, 40))
    spreads = []

    def check(plan):
        for batch in plan.decode_batches:
            lengths = batch.kv_lengths()
            spreads.append(max(lengths) - min(lengths))
    run_to_completion(sched, ex, on_step=check)
    assert spreads and max(spreads) <= 2


def _run_pool(**cfg) -> tuple[int, int]:
    """40 requests of 150-430 tokens on a device that holds ~6 of them and a large host tier.
    Checks nothing is lost; returns the peaks of (requests in flight, KV tokens beyond the
    device)."""
    sched, ex = build("aligned", dev_tokens=1300, host_tokens=100_000, kv_reserve_tokens=16,
                      max_num_seqs=8, **cfg)
    reqs = [make_request(f"r{i}", 150 + 7 * i, 30) for i in range(40)]
    for r in reqs:
        sched.add_request(r)
    inflight = beyond = 0

    def observe(plan):
        nonlocal inflight, beyond
        inflight = max(inflight, sched.num_inflight())
        beyond = max(beyond, sched.store.used("dev0") + sched.store.used(HOST) - 1300)
    run_to_completion(sched, ex, on_step=observe)
    assert all(len(r.output_token_ids) == 30 for r in reqs)
    assert sched.store.used(HOST) == 0 and sched.store.used("dev0") == 0
    return inflight, beyond


def test_deep_pool_holds_more_in_flight_than_the_device():
    inflight, _ = _run_pool()
    assert inflight > 8  # more in flight than the device alone could hold


@pytest.mark.parametrize("link", [50, 200])
def test_host_pool_is_capped_by_what_the_link_rotates_in_one_waiting_bound(link):
    # A slow link: in-flight KV beyond the device stays within link * max_wait_steps tokens
    # at admission (requests still grow by their 30 output tokens after it), nothing is lost.
    _, capped = _run_pool(prefetch_link_tokens=link, max_wait_steps=4)
    _, uncapped = _run_pool(max_wait_steps=4)
    assert capped <= link * 4 + 40 * 30
    assert capped < uncapped / 2


def test_prefetch_starts_copies_one_step_before_use():
    sched, ex = build("aligned", dev_tokens=1300, host_tokens=100_000, kv_reserve_tokens=16,
                      max_num_seqs=8)
    for i in range(30):
        sched.add_request(make_request(f"r{i}", 150 + 9 * i, 25))
    async_moves = 0
    begun: dict = {}

    def observe(plan):
        nonlocal async_moves
        for op in plan.kv_ops:
            if op.kind is KVOpKind.MOVE_BEGIN:
                begun[op.handle] = plan.step_id
            elif op.kind is KVOpKind.MOVE_END and begun.pop(op.handle) < plan.step_id:
                async_moves += 1
    run_to_completion(sched, ex, on_step=observe)
    assert async_moves > 0  # some copies overlapped a step's compute


def test_queue_is_bounded_and_says_so():
    sched, _ = build("aligned", max_queue=3)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10, 5))
    with pytest.raises(QueueFull):
        sched.add_request(make_request("r3", 10, 5))
    assert "r3" not in sched.requests


def test_merge_brings_lagging_cohorts_together():
    sched, ex = build("aligned", align_tolerance=0, catchup_window=8)
    # the longer cohort is held for 3 steps while the shorter one catches up; then they merge
    sched.add_request(make_request("a", 50, 60))
    sched.add_request(make_request("b", 53, 60))
    merged = False

    def observe(plan):
        nonlocal merged
        merged |= len(sched.cohorts) == 1 and sum(c.rows for c in sched.cohorts.values()) == 2
    run_to_completion(sched, ex, on_step=observe)
    assert merged


workloads = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 50), st.integers(0, 40),
                               st.booleans()), min_size=1, max_size=30)


@settings(max_examples=50, deadline=None)
@given(work=workloads, dev_tokens=st.integers(800, 4000), tol=st.integers(0, 4),
       rows=st.integers(4, 64), wait=st.integers(1, 8), cohort_rows=st.integers(1, 64))
# Two cases found on fresh example databases, once failing: device-resident cohorts that had
# just starved went before an older starving one on the host, taking turns indefinitely; and a
# merge on the host made a cohort larger than the device, so it could never run.
@example(work=[(97, 16, 0, False), (289, 16, 0, False), (289, 16, 0, False),
               (289, 16, 0, False), (290, 15, 0, False)], dev_tokens=800, tol=0, rows=4, wait=1,
         cohort_rows=4)
@example(work=[(1, 1, 0, False), (1, 1, 0, False), (1, 1, 0, False), (186, 50, 27, False),
               (176, 50, 33, False), (230, 46, 0, False), (266, 7, 26, False),
               (263, 10, 29, False), (257, 16, 29, False)], dev_tokens=803, tol=4, rows=22,
         wait=8, cohort_rows=16)
# Found by the replicated-server test: more same-length requests than max_num_seqs joined one
# cohort (max_cohort_rows was larger) that no step could run; it was dropped and recomputed
# forever.
@example(work=[(4, 8, 0, False)] * 10, dev_tokens=4000, tol=2, rows=4, wait=8, cohort_rows=64)
def test_random_workloads_tolerance_waiting_bound_and_no_loss(work, dev_tokens, tol, rows, wait,
                                                              cohort_rows):
    sched, ex = build("aligned", dev_tokens=dev_tokens, host_tokens=200_000, align_tolerance=tol,
                      max_num_seqs=rows, max_cohort_rows=cohort_rows, max_wait_steps=wait,
                      kv_reserve_tokens=16)
    pending = sorted((arrive, i, p, m, ab) for i, (p, m, arrive, ab) in enumerate(work))
    reqs, last_decode, max_cohorts, worst_wait = {}, {}, 0, 0
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, p, m, ab = pending.pop(0)
            reqs[i] = (make_request(f"r{i}", p, m), ab)
            sched.add_request(reqs[i][0])
        for r, ab in reqs.values():
            if ab and not r.is_finished and len(r.output_token_ids) == 3:
                sched.abort_request(r.request_id)
        ready = {r.request_id for c in sched.cohorts.values() for r in c.requests}
        max_cohorts = max(max_cohorts, len(sched.cohorts))
        plan = sched.schedule()
        for batch in plan.decode_batches:
            lengths = batch.kv_lengths()
            assert max(lengths) - min(lengths) <= tol
        decoded = {r.request_id for r in plan.decode_requests}
        for rid in ready:
            if rid in decoded:
                last_decode[rid] = step
            elif rid in last_decode:
                worst_wait = max(worst_wait, step - last_decode[rid])
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        sched.update(plan, ex.execute(plan))
        sched.store.check_invariants()
        step += 1
        assert step < 20_000
    assert worst_wait <= wait + max_cohorts + 1
    for r, ab in reqs.values():
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH:
            assert len(r.output_token_ids) == r.params.max_tokens
        else:
            assert ab and r.finish_reason is FinishReason.ABORT
    assert all(sched.store.used(t) == 0 for t in sched.store.tiers)


def test_gpu_prefetch_for_gpu_stages_on_a_peer_device():
    """Two devices, a narrow host link: cohorts are staged host -> dev1 -> dev0."""
    sched, ex = build("aligned", dev_tokens=1300, host_tokens=100_000, devices=2,
                      kv_reserve_tokens=16, max_num_seqs=8, prefetch_link_tokens=200)
    reqs = [make_request(f"r{i}", 120 + 9 * i, 25) for i in range(30)]
    for r in reqs:
        sched.add_request(r)
    hops = []

    def observe(plan):
        for op in plan.kv_ops:
            if op.kind is KVOpKind.MOVE_BEGIN:
                hops.append((op.handle, op.tier))
    run_to_completion(sched, ex, on_step=observe)
    staged = {h for h, t in hops if t == "dev1"}
    onward = {h for h, t in hops if t == "dev0" and h in staged}
    assert staged and onward  # some KV went to the peer first, then on to the compute device
    assert all(len(r.output_token_ids) == 25 for r in reqs)
    assert all(sched.store.used(t) == 0 for t in sched.store.tiers)


def test_no_cohort_outgrows_the_device():
    """Six equal requests (up to ~256 KV tokens each) on a 1000-token device: without the cap
    they merge into one cohort that can never be resident; with it a cohort takes at most what
    fits the device (4 rows while their caches are small, split as they grow), and every
    request completes."""
    sched, ex = build("aligned", dev_tokens=1000, host_tokens=100_000, align_tolerance=8,
                      max_num_seqs=8, max_cohort_rows=8, max_wait_steps=4, kv_reserve_tokens=16)
    requests = [make_request(f"r{i}", 200, 40) for i in range(6)]
    for r in requests:
        sched.add_request(r)
    biggest = 0

    def observe(plan):
        nonlocal biggest
        biggest = max([biggest, *(c.rows for c in sched.cohorts.values())])
    run_to_completion(sched, ex, on_step=observe)
    assert 2 <= biggest <= 4
    assert all(len(r.output_token_ids) == 40 for r in requests)


def test_split_members_cuts_the_fewest_parts_that_fit():
    from alignedserve.sched.cohort import split_members
    members = list(range(10))
    assert split_members(members, 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    parts = split_members(members, 16, fits=lambda g: len(g) <= 2)
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert split_members([5], 16, fits=lambda g: False) == [[5]]  # one request stands alone
