"""KVStore accounting: unit cases and a hypothesis state machine over random op sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from alignedserve.kv.store import HOST, KVOpKind, KVStore


def make_store(dev_tokens=1000, host_tokens=4000, granularity=16, devices=1):
    return KVStore.for_devices([dev_tokens * 10] * devices, host_tokens * 10, 10, granularity)


def test_allocate_rounds_and_accounts():
    store = make_store()
    h = store.allocate("dev0", 17)
    assert store.capacity_of(h) == 32 and store.used("dev0") == 32
    assert store.free("dev0") == store.total("dev0") - 32
    store.free_handle(h)
    assert store.used("dev0") == 0 and len(store) == 0
    store.check_invariants()


def test_allocate_fails_without_room_and_changes_nothing():
    store = make_store(dev_tokens=100)
    assert store.allocate("dev0", 200) is None
    assert store.used("dev0") == 0 and store.drain_ops() == []


def test_grow_and_move_log_ops_in_order():
    store = make_store()
    h = store.allocate("dev0", 10)
    assert store.grow(h, 40)
    assert store.begin_move(h, HOST)
    assert store.used("dev0") == 48 and store.used(HOST) == 48  # held in both while moving
    store.end_move(h)
    assert store.tier_of(h) == HOST and store.used("dev0") == 0
    kinds = [op.kind for op in store.drain_ops()]
    assert kinds == [KVOpKind.ALLOC, KVOpKind.GROW, KVOpKind.MOVE_BEGIN, KVOpKind.MOVE_END]


def test_grow_while_moving_is_an_error():
    store = make_store()
    h = store.allocate("dev0", 10)
    store.begin_move(h, HOST)
    with pytest.raises(RuntimeError):
        store.grow(h, 100)


def test_free_during_move_releases_both_tiers():
    store = make_store()
    h = store.allocate("dev0", 10)
    store.begin_move(h, HOST)
    store.free_handle(h)
    assert store.used("dev0") == 0 and store.used(HOST) == 0
    store.check_invariants()


def test_group_move_is_all_or_none():
    store = make_store(dev_tokens=1000, host_tokens=100)
    handles = [store.allocate("dev0", 48) for _ in range(3)]
    store.drain_ops()
    assert not store.begin_group_move(handles, HOST)  # 144 tokens > 100 free
    assert store.drain_ops() == [] and store.used(HOST) == 0
    assert store.begin_group_move(handles[:2], HOST)
    assert store.used(HOST) == 96 and all(store.is_moving(h) for h in handles[:2])
    store.end_group_move(handles[:2])
    assert [store.tier_of(h) for h in handles] == [HOST, HOST, "dev0"]
    store.check_invariants()


def test_parking_prefers_a_peer_device_then_the_host():
    store = make_store(dev_tokens=100, host_tokens=200, devices=2)
    assert store.parking_tier(64, "dev0") == "dev1"
    store.allocate("dev1", 64)
    assert store.parking_tier(64, "dev0") == HOST  # dev1 has 32 left
    store.allocate(HOST, 192)
    assert store.parking_tier(64, "dev0") is None


def test_staging_needs_room_and_link_budget():
    store = make_store(dev_tokens=100, devices=3)
    links = {"dev0": 0.0, "dev1": 10.0, "dev2": 80.0}
    assert store.staging_tier(64, "dev0", links) == "dev2"  # dev1's link is spent
    store.allocate("dev2", 96)
    assert store.staging_tier(64, "dev0", links) is None


def test_tokens_beyond_devices_counts_the_host_part_of_the_pool():
    store = make_store(dev_tokens=96, devices=2)
    store.allocate("dev0", 96)
    assert store.tokens_beyond_devices() == -96  # dev1 still empty
    store.allocate("dev1", 96)
    store.allocate(HOST, 32)
    assert store.tokens_beyond_devices() == 32


class StoreMachine(RuleBasedStateMachine):
    """Random allocate / grow / move / free / abort sequences keep the accounting exact."""

    def __init__(self):
        super().__init__()
        self.store = make_store(dev_tokens=600, host_tokens=1500, granularity=8, devices=2)
        self.model: dict = {}  # handle -> [tier, capacity, moving_to]

    @rule(tier=st.sampled_from(["dev0", "dev1", HOST]), tokens=st.integers(1, 300))
    def allocate(self, tier, tokens):
        free_before = self.store.free(tier)
        h = self.store.allocate(tier, tokens)
        cap = self.store.round_up(tokens)
        if h is None:
            assert cap > free_before
        else:
            self.model[h] = [tier, cap, None]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.integers(1, 400))
    def grow(self, data, tokens):
        h = data.draw(st.sampled_from(sorted(self.model, key=lambda x: x.id)))
        tier, cap, moving = self.model[h]
        if moving is not None:
            return
        if self.store.grow(h, tokens):
            self.model[h][1] = max(cap, self.store.round_up(tokens))
        else:
            assert self.store.capacity_of(h) == cap

    @precondition(lambda self: self.model)
    @rule(data=st.data(), dst=st.sampled_from(["dev0", "dev1", HOST]))
    def begin_move(self, data, dst):
        h = data.draw(st.sampled_from(sorted(self.model, key=lambda x: x.id)))
        tier, cap, moving = self.model[h]
        if moving is not None or dst == tier:
            return
        if self.store.begin_move(h, dst):
            self.model[h][2] = dst

    @precondition(lambda self: any(v[2] for v in self.model.values()))
    @rule(data=st.data())
    def end_move(self, data):
        moving = sorted((h for h, v in self.model.items() if v[2]), key=lambda x: x.id)
        h = data.draw(st.sampled_from(moving))
        self.store.end_move(h)
        self.model[h] = [self.model[h][2], self.model[h][1], None]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):  # a finish or an abort, possibly mid-move
        h = data.draw(st.sampled_from(sorted(self.model, key=lambda x: x.id)))
        self.store.free_handle(h)
        del self.model[h]

    @invariant()
    def accounting_matches_model(self):
        self.store.check_invariants()
        for tier in self.store.tiers:
            expected = sum(c for t, c, m in self.model.values() if t == tier)
            expected += sum(c for t, c, m in self.model.values() if m == tier)
            assert self.store.used(tier) == expected
            assert self.store.used(tier) + self.store.free(tier) == self.store.total(tier)

    def teardown(self):
        for h in list(self.model):
            self.store.free_handle(h)
        for tier in self.store.tiers:
            assert self.store.used(tier) == 0  # zero leaks once everything is released


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
