"""Huge-page memory (alignedserve.huge_pages) and the KV pool that uses it; no model needed
except for the weight move, which uses a tiny random one."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import alignedserve.executor.kv_pool as kv_pool_module
from alignedserve.executor.kv_pool import KVPool
from alignedserve.huge_pages import (HUGE_PAGE, HugePageArena, huge_pages_supported,
                                     move_to_huge_pages)
from alignedserve.kv.store import HOST, KVStore
from tests.model_utils import our_logits, ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE here")

SHAPE = (2, 2, 3, 1024, 64)  # ~1.5 MiB of bf16: one huge page


def test_empty_gives_writable_tensors_on_aligned_pages():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    a = arena.empty(SHAPE, torch.bfloat16)
    b = arena.empty((3, HUGE_PAGE), torch.uint8)  # 3 pages exactly
    assert a.shape == SHAPE and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() % HUGE_PAGE == 0
    a.fill_(1.5)
    b.fill_(7)
    assert a.float().sum().item() == 1.5 * a.numel() and int(b.sum()) == 7 * b.numel()
    assert arena.used_pages == 4 and arena.mapped_pages == 4  # both fit the first chunk
    assert arena.empty((0, 5), torch.float32).shape == (0, 5)


def test_freed_memory_returns_coalesced_and_is_reused():
    arena = HugePageArena(chunk_bytes=8 * HUGE_PAGE)
    tensors = [arena.empty(SHAPE, torch.bfloat16) for _ in range(4)]
    first = tensors[0].data_ptr()
    assert arena.free_extents() == [(0, 4, 4)]
    del tensors[1]  # a hole between live tensors
    assert arena.free_extents() == [(0, 1, 1), (0, 4, 4)]
    del tensors[1]  # its right neighbour: merges with the hole
    assert arena.free_extents() == [(0, 1, 2), (0, 4, 4)]
    del tensors[1]  # between two free extents: merges with both
    assert arena.free_extents() == [(0, 1, 7)]
    tensors.clear()
    assert arena.free_extents() == [(0, 0, 8)] and arena.used_pages == 0
    again = arena.empty(SHAPE, torch.bfloat16)
    assert again.data_ptr() == first and arena.mapped_pages == 8  # reused, nothing new mapped


def test_a_view_keeps_the_memory_until_it_is_gone():
    arena = HugePageArena(chunk_bytes=2 * HUGE_PAGE)
    cache = arena.empty(SHAPE, torch.bfloat16)
    row = cache[:, :, :, :10]
    del cache
    gc.collect()
    assert arena.used_pages == 1  # `row` still reads those pages
    row.fill_(3)
    other = arena.empty(SHAPE, torch.bfloat16)  # must not get the same memory
    other.fill_(4)
    assert bool((row == 3).all())
    del row
    assert arena.used_pages == 1


def test_tensors_bigger_than_a_chunk_get_their_own_mapping():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    big = arena.empty((5 * HUGE_PAGE - 1,), torch.uint8)
    assert arena.mapped_pages == 5 and arena.used_pages == 5
    big.fill_(1)
    del big
    assert arena.free_extents() == [(0, 0, 5)]


def test_reserve_faults_in_zeroed_memory_for_later_tensors():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    assert arena.reserve(3 * HUGE_PAGE - 5) == 3 * HUGE_PAGE
    assert arena.mapped_pages == 3 and arena.free_extents() == [(0, 0, 3)]
    t = arena.empty((3 * HUGE_PAGE,), torch.uint8)
    assert int(t.sum()) == 0 and arena.mapped_pages == 3  # served from the reservation
    assert arena.reserve(0) == 0


def test_memory_freed_in_another_thread_comes_back():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    box = [arena.empty(SHAPE, torch.bfloat16) for _ in range(4)]

    def drop() -> None:
        box.clear()  # the last references die here, as in the KV copier thread

    worker = threading.Thread(target=drop)
    worker.start()
    worker.join()
    assert arena.free_extents() == [(0, 0, 4)] and arena.used_pages == 0


def test_kv_pool_recycles_caches_through_alloc_grow_and_free():
    store = KVStore({"gpu0": 64 * 2048, HOST: 64 * 2048}, bytes_per_token=1, granularity=16)
    pool = KVPool({"gpu0": torch.device("cpu"), HOST: torch.device("cpu")}, 2, 3, 64,
                  torch.bfloat16)
    assert pool._arena is not None
    handle = store.allocate("gpu0", 100)
    pool.apply(store.drain_ops())
    pool.get(handle).fill_(2)
    assert store.grow(handle, 2000)
    pool.apply(store.drain_ops())
    cache = pool.get(handle)
    assert cache.shape == (2, 2, 3, 2000 // 16 * 16 + 16 * (2000 % 16 > 0), 64)
    assert bool((cache[:, :, :, :112] == 2).all())  # GROW kept the contents
    del cache
    used = pool._arena.used_pages
    store.free_handle(handle)
    pool.apply(store.drain_ops())
    assert pool._arena.used_pages < used and len(pool) == 0
    pool.close()


def test_kv_pool_without_huge_pages_uses_plain_memory(monkeypatch):
    monkeypatch.setattr(kv_pool_module, "huge_pages_supported", lambda: False)
    store = KVStore({"gpu0": 4096, HOST: 4096}, bytes_per_token=1, granularity=16)
    pool = KVPool({"gpu0": torch.device("cpu"), HOST: torch.device("cpu")}, 2, 3, 64,
                  torch.bfloat16)
    handle = store.allocate("gpu0", 100)
    pool.apply(store.drain_ops())
    assert pool._arena is None and pool.get(handle).shape[3] == 112
    assert pool.preallocate(HUGE_PAGE) == 0
    pool.close()


def test_moving_weights_keeps_values_and_tied_weights():
    torch.manual_seed(0)
    model = ours_from_hf(tiny_hf_model(tie_word_embeddings=True))
    ids = torch.randint(0, model.config.vocab_size, (12,))
    before = our_logits(model, ids)
    old_ptr = model.embed_tokens.weight.data_ptr()
    assert move_to_huge_pages(model) > 0
    embed = model.embed_tokens.weight
    assert embed.data_ptr() != old_ptr and isinstance(embed, torch.nn.Parameter)
    if model.lm_head is not None:  # tied: the head reads the embedding matrix
        assert model.lm_head.weight.data_ptr() == embed.data_ptr()
    assert torch.equal(our_logits(model, ids), before)
