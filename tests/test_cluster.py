"""Scale-out pieces without a Ray cluster: the routing decision (pure), the front end's retry and
metrics merging over a fake Serve handle, and one engine replica on the fake engine.

The same code against real Ray Serve replicas of the real model: tests/test_replicas_e2e.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from alignedserve.cluster.routing import ReplicaLoad, RoundRobin, Router, RoutingBook
from alignedserve.entrypoints.engine_state import RecentLatencies
from alignedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from alignedserve.sampling_params import SamplingParams
from tests.server_fakes import FakeEngine

ray_exceptions = pytest.importorskip("ray.exceptions")

# ---- routing (pure) ----------------------------------------------------------------------------

_loads = st.lists(st.builds(
    ReplicaLoad, replica_id=st.uuids().map(str), kv_tokens=st.integers(0, 10_000),
    kv_capacity=st.integers(1, 10_000), running=st.integers(0, 64), waiting=st.integers(0, 64),
    groups=st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 64)), max_size=6).map(tuple)),
    min_size=1, max_size=12, unique_by=lambda r: r.replica_id)


@settings(max_examples=200, deadline=None)
@given(loads=_loads, prompt=st.none() | st.integers(1, 4096), seed=st.integers(0, 2**32),
       policy=st.sampled_from(["kv", "kv+length"]))
def test_rank_lists_every_replica_once_and_prefers_light_ones(loads, prompt, seed, policy):
    router = Router(policy)
    order = router.rank(loads, prompt, random.Random(seed))
    assert sorted(order) == sorted(r.replica_id for r in loads)
    by_id = {r.replica_id: r for r in loads}
    lightest = min(r.load for r in loads)
    first = by_id[order[0]]
    near = [r for r in loads if r.load <= lightest + router.imbalance
            and prompt is not None and router.matching_rows(r, prompt) > 0]
    if policy == "kv+length" and near:
        # affinity: the near-lightest replica the prompt meets the most rows on
        assert first in near
        assert router.matching_rows(first, prompt) == max(router.matching_rows(r, prompt)
                                                          for r in near)
    elif len(loads) > 1:
        # power of two choices: the lighter of two distinct draws is never the heaviest
        # replica unless it is tied with another
        assert sum(r.load >= first.load for r in loads) >= 2
    # the fallback tail is in order of load
    tail = [by_id[i].load for i in order[1:]]
    assert tail == sorted(tail)


def test_power_of_two_picks_the_lighter_of_its_two_draws():
    loads = [ReplicaLoad("a", 900, 1000), ReplicaLoad("b", 100, 1000)]
    assert all(Router("kv").rank(loads, 10, random.Random(s))[0] == "b" for s in range(20))


def test_length_affinity_prefers_a_replica_decoding_at_the_prompt_length():
    near = ReplicaLoad("near", 150, 1000, groups=((500, 8),))
    far = ReplicaLoad("far", 100, 1000, groups=((2000, 8),))
    rng = random.Random(0)
    assert Router("kv+length").rank([near, far], 510, rng)[0] == "near"
    assert Router("kv").rank([near, far], 510, rng)[0] == "far"
    # ... but not at any price: beyond the imbalance the lighter replica wins
    heavy = ReplicaLoad("near", 600, 1000, groups=((500, 8),))
    assert Router("kv+length").rank([heavy, far], 510, rng)[0] == "far"
    # a group the prompt cannot meet (too long already) does not attract it
    assert Router("kv+length").matching_rows(near, 400) == 0
    assert Router("kv+length").matching_rows(near, 520) == 8


def test_routing_book_counts_what_reports_do_not_yet_include():
    book = RoutingBook()
    book.note_sent("a", 300)
    book.note_sent("a", 200)
    report = ReplicaLoad("a", kv_tokens=1000, kv_capacity=4000, received_tokens=300)
    assert book.with_in_flight(report).kv_tokens == 1200  # the 200 not received yet
    caught_up = ReplicaLoad("a", kv_tokens=1500, kv_capacity=4000, received_tokens=500)
    assert book.with_in_flight(caught_up) == caught_up
    book.forget("a")
    assert book.with_in_flight(report) == report


def test_a_burst_between_reports_is_spread():
    """Without the book every request of a burst would see the same stale "lightest" replica."""
    router, book, rng = Router("kv"), RoutingBook(), random.Random(1)
    reports = [ReplicaLoad(i, 0, 10_000) for i in "abcd"]
    sent = {i: 0 for i in "abcd"}
    for _ in range(200):
        choice = router.rank([book.with_in_flight(r) for r in reports], 100, rng)[0]
        book.note_sent(choice, 100)
        sent[choice] += 1
    assert max(sent.values()) - min(sent.values()) <= 10, sent


def test_stats_round_trip_and_bad_policy():
    load = ReplicaLoad("r", 5, 10, 2, 1, ((7, 2),), 40)
    assert ReplicaLoad.from_stats("r", load.to_stats()) == load
    assert ReplicaLoad.from_stats("r", {}) == ReplicaLoad("r")
    with pytest.raises(ValueError):
        Router("fastest")


def test_round_robin_cycles():
    rr = RoundRobin()
    assert [rr.rank(["b", "a", "c"])[0] for _ in range(4)] == ["a", "b", "c", "a"]


# ---- the front end over a fake Serve handle -----------------------------------------------------

def _out(request_id: str, tokens: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "x" * tokens,
                         list(range(tokens)), None, "length" if finished else None)],
                         finished, RequestMetrics(0.0, 0.1, 0.2 if finished else None))


class _Stream:
    def __init__(self, items):
        self.items, self.cancelled = items, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self):
        self.cancelled = True


class _Handle:
    """Stands in for ``DeploymentHandle``: each call plays the next script."""

    def __init__(self, *scripts):
        self.scripts, self.calls = list(scripts), []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args, **kwargs):
        self.calls.append(kwargs)
        stream = _Stream(self.scripts.pop(0))
        self.last = stream
        return stream


def _collect(engine, prompt=(1, 2, 3)):
    async def run():
        return [o async for o in engine.generate("r", list(prompt), SamplingParams())]
    return asyncio.run(run())


def _replicated(handle):
    from alignedserve.cluster.replicated import ReplicatedEngine

    return ReplicatedEngine(handle, board=None, facts={})


def test_a_request_lost_before_its_first_output_is_sent_again():
    handle = _Handle([ray_exceptions.ActorDiedError()], [_out("r", 1, False), _out("r", 2, True)])
    outs = _collect(_replicated(handle))
    assert [o.finished for o in outs] == [False, True]
    assert [c["prompt_tokens"] for c in handle.calls] == [3, 3]  # the router's hint, twice


def test_a_request_lost_after_output_ends_with_an_error():
    from alignedserve.cluster.replicated import ReplicaLost

    handle = _Handle([_out("r", 1, False), ray_exceptions.ActorDiedError()])
    with pytest.raises(ReplicaLost):
        _collect(_replicated(handle))
    assert len(handle.calls) == 1 and handle.last.cancelled


def test_engine_errors_pass_through_unretried():
    handle = _Handle([ValueError("prompt too long")])
    with pytest.raises(ValueError):
        _collect(_replicated(handle))
    assert len(handle.calls) == 1


def test_leaving_the_stream_cancels_the_replica_call():
    handle = _Handle([_out("r", 1, False), _out("r", 2, False), _out("r", 3, True)])
    engine = _replicated(handle)

    async def first_only():
        stream = engine.generate("r", [1], SamplingParams())
        out = await stream.__anext__()
        await stream.aclose()
        return out

    assert not asyncio.run(first_only()).finished
    assert handle.last.cancelled


def test_metrics_are_labelled_by_replica_and_state_is_summed():
    from alignedserve.cluster.replicated import merged_snapshot, relabel_by_replica

    def families(value):
        g = GaugeMetricFamily("alignedserve:num_requests_running", "d", labels=["model_name"])
        g.add_metric(["m"], value)
        c = CounterMetricFamily("alignedserve:engine_steps", "d", labels=["model_name"])
        c.add_metric(["m"], value * 10)
        return [g, c]

    merged = list(relabel_by_replica({"r1": {"families": families(2)},
                                      "r2": {"families": families(3)}}))
    assert len(merged) == 2  # one family per name, both replicas' samples in it
    running = {s.labels["replica"]: s.value for s in merged[0].samples}
    assert running == {"r1": 2, "r2": 3}

    def snap(replica, running, rows, bubble):
        return {"time": 1.0, "replica": replica, "policy": "aligned", "dtype": "bfloat16",
                "kv_cache_dtype": "bfloat16", "kernel_path": "avx2", "running": running,
                "waiting": 1, "groups": [{"rows": rows, "min_len": 5, "max_len": 6,
                                          "tier": "dev0"}],
                "last_step": [], "kv": {"dev0": {"used_bytes": 1, "total_bytes": 2}},
                "bubble_recent": bubble, "output_tok_s": 10.0, "steps": 4}

    state = merged_snapshot([snap("r1", 2, 2, 0.5), snap("r2", 6, 6, 0.1)], "m",
                            RecentLatencies())
    assert state["running"] == 8 and state["waiting"] == 2 and state["steps"] == 8
    assert state["bubble_recent"] == pytest.approx((0.5 * 2 + 0.1 * 6) / 8)
    assert set(state["kv"]) == {"r1/dev0", "r2/dev0"}
    assert [g["replica"] for g in state["groups"]] == ["r1", "r2"]


# ---- one replica on the fake engine --------------------------------------------------------------

def _replica(**kwargs):
    from alignedserve.cluster.replica import EngineReplica

    engine = FakeEngine(**kwargs)
    return EngineReplica(None, "fake", max_pending=64, make_engine=lambda: engine), engine


def test_replica_streams_to_the_end_and_reports_load():
    replica, engine = _replica(step_s=0.001)
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def run():
        outs = [o async for o in replica.generate("a", [3, 4, 5], params, prompt_tokens=3)]
        return outs, replica.load()

    try:
        outs, load = asyncio.run(run())
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        # cumulative outputs: whatever was skipped, each one extends the previous
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)
        assert load.received_tokens == 3 and load.kv_tokens == 0 and replica.healthy()
        stats = replica.record_routing_stats()
        assert stats["healthy"] and stats["received_tokens"] == 3
    finally:
        replica.engine.shutdown()


def test_replica_abort_on_early_exit_and_unhealthy_after_a_failed_step():
    replica, engine = _replica(step_s=0.01)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def leave_early():
        stream = replica.generate("a", [3, 4], params)
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if "a" in engine.aborted:
                return True
            await asyncio.sleep(0.01)
        return False

    async def failing_step():
        engine.fail_next_step = True
        with pytest.raises(RuntimeError, match="step failed"):
            async for _ in replica.generate("b", [3], params):
                pass

    try:
        assert asyncio.run(leave_early())
        assert replica.healthy()
        asyncio.run(failing_step())
        assert not replica.healthy()
        with pytest.raises(RuntimeError, match="failed a step"):
            replica.check_health()
    finally:
        replica.engine.shutdown()
