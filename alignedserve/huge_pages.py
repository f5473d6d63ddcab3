"""KV caches and model weights on transparent huge pages (CPU).

A decode step streams every request's KV and every weight matrix from DRAM once. On 4 KiB
pages each new page of those streams costs a TLB miss whose page walk also misses the caches;
on 2 MiB pages that is gone (`benchmarks/attention_micro.py --huge-pages-ab` measures it;
numbers in docs/architecture.md, "Huge pages").

Linux gives anonymous memory huge pages when the mapping is private and advised
``MADV_HUGEPAGE`` (with ``transparent_hugepage/enabled`` = ``madvise`` or ``always``; with
``never`` the advice is ignored and only the speed differs). glibc's allocator asks for
neither, so:

* `HugePageArena` hands out KV caches from huge-page mappings it keeps and reuses. Faulting
  fresh huge pages in is slow on this VM (~1.4 s per GiB, vs 0.2 s on 4 KiB pages; no memory
  compaction was recorded, so probably the hypervisor backing guest memory not used before): a
  fresh mapping per request made the uniform benchmark's prefill ~3 s slower. So memory is
  faulted in once and recycled, as a serving engine's KV pool should be anyway.
* `move_to_huge_pages` copies the model's dense parameters and buffers into one such mapping.

``ALIGNEDSERVE_HUGE_PAGES=0`` in the environment turns both off (for A/B runs, or a kernel
where huge pages misbehave).
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
import os
import threading
import weakref

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each weight starts on a cache line


def huge_pages_supported() -> bool:
    """True where Python can ask for transparent huge pages (Linux), unless the environment
    sets ``ALIGNEDSERVE_HUGE_PAGES=0`` (then caches and weights use torch's own memory)."""
    return (os.environ.get("ALIGNEDSERVE_HUGE_PAGES", "1") != "0"
            and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE"))


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping advised MADV_HUGEPAGE with ``nbytes`` usable from a 2 MiB
    boundary: (mapping, offset of that boundary). Over-allocated by one huge page to align."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return mapping, -address % HUGE_PAGE


class HugePageArena:
    """CPU tensors carved from huge-page chunks, their memory reused once they are freed.

    Memory is handed out in whole huge pages. A tensor's pages return to the free list when
    its storage is freed (the last view of it gone: a weakref finalizer on the memoryview the
    tensor is built on), so callers use the tensors as they would ``torch.empty``'s. Chunks of
    at least ``chunk_bytes`` are mapped as needed and kept (faulted in once, then recycled).

    Invariants: free extents are disjoint, sorted, and coalesced (no two adjacent); a page is
    either in exactly one live tensor or in a free extent. Thread-safe (finalizers run in
    whichever thread drops the last reference, e.g. the KV copier thread).
    """

    def __init__(self, chunk_bytes: int = 256 << 20):
        self.chunk_pages = max(1, -(-chunk_bytes // HUGE_PAGE))
        self._chunks: list[tuple[mmap.mmap, int]] = []  # (mapping, aligned offset)
        self._free: list[tuple[int, int, int]] = []  # (chunk, first page, pages), sorted
        self._lock = threading.Lock()
        self.mapped_pages = 0
        self.used_pages = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` on huge pages."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        pages = -(-nbytes // HUGE_PAGE)
        with self._lock:
            chunk, first = self._take(pages)
            self.used_pages += pages
        mapping, base = self._chunks[chunk]
        start = base + first * HUGE_PAGE
        view = memoryview(mapping)[start:start + nbytes]
        weakref.finalize(view, self._give_back, chunk, first, pages)
        return torch.frombuffer(view, dtype=dtype).view(shape)

    def reserve(self, nbytes: int) -> int:
        """Map at least ``nbytes`` (whole huge pages) now and fault it in, as free memory for
        later tensors, so that serving never waits on page faults; returns the bytes mapped."""
        pages = -(-nbytes // HUGE_PAGE)
        if pages <= 0:
            return 0
        with self._lock:
            chunk = self._map(pages)
            self._free.append((chunk, 0, pages))  # the newest chunk sorts last
        mapping, base = self._chunks[chunk]
        torch.frombuffer(mapping, dtype=torch.uint8)[base:base + pages * HUGE_PAGE].zero_()
        return pages * HUGE_PAGE

    def _map(self, pages: int) -> int:
        """Maps a chunk of ``pages`` huge pages; returns its index. Lock held."""
        self._chunks.append(_huge_mapping(pages * HUGE_PAGE))
        self.mapped_pages += pages
        return len(self._chunks) - 1

    def _take(self, pages: int) -> tuple[int, int]:
        """First fit in the free list; maps a new chunk when nothing fits. Lock held."""
        for i, (chunk, first, n) in enumerate(self._free):
            if n >= pages:
                if n == pages:
                    del self._free[i]
                else:
                    self._free[i] = (chunk, first + pages, n - pages)
                return chunk, first
        size = max(pages, self.chunk_pages)
        chunk = self._map(size)
        if size > pages:
            self._free.append((chunk, pages, size - pages))  # the newest chunk sorts last
        return chunk, 0

    def _give_back(self, chunk: int, first: int, pages: int) -> None:
        """Return an extent, merging it with free neighbours in the same chunk."""
        with self._lock:
            self.used_pages -= pages
            i = bisect.bisect(self._free, (chunk, first, pages))
            if i < len(self._free):
                c, f, n = self._free[i]
                if c == chunk and f == first + pages:
                    pages += n
                    del self._free[i]
            if i > 0:
                c, f, n = self._free[i - 1]
                if c == chunk and f + n == first:
                    self._free[i - 1] = (c, f, n + pages)
                    return
            self._free.insert(i, (chunk, first, pages))

    def free_extents(self) -> list[tuple[int, int, int]]:
        """(chunk, first page, pages) of every free extent, sorted (for tests and stats)."""
        with self._lock:
            return list(self._free)


def _movable(t: Tensor | None) -> bool:
    """Dense CPU tensors that own plain strided memory (not oneDNN's opaque layouts)."""
    return (t is not None and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_mkldnn and t.is_contiguous() and t.numel() > 0)


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy ``model``'s contiguous CPU parameters and buffers into one huge-page mapping and
    point the model at them; returns the bytes moved (0 where unsupported or nothing moved).

    Invariant afterwards: every moved tensor has the same values, dtype and shape as before,
    and tensors that were one memory with one shape (tied weights) are still one. (A second
    view of a moved tensor with another shape would keep the old memory; the model has none.)
    """
    if not huge_pages_supported():
        return 0
    slots: list[tuple[nn.Module, str, bool, int]] = []  # (owner, name, is_parameter, data_ptr)
    unique: dict[int, Tensor] = {}  # data_ptr -> tensor to copy (first seen wins)
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if _movable(t):
                    slots.append((module, name, is_param, t.data_ptr()))
                    unique.setdefault(t.data_ptr(), t)
    offsets, total = {}, 0
    for ptr, t in unique.items():
        offsets[ptr] = total
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total == 0:
        return 0
    arena = HugePageArena(chunk_bytes=total).empty((total,), torch.uint8)
    copies: dict[int, Tensor] = {}
    for ptr, t in unique.items():
        nbytes = t.numel() * t.element_size()
        view = arena[offsets[ptr]:offsets[ptr] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        copies[ptr] = view
    for module, name, is_param, ptr in slots:
        table = module._parameters if is_param else module._buffers
        old, new = table[name], copies[ptr]
        if old.data_ptr() == new.data_ptr() or new.shape != old.shape:
            continue  # moved already (one Parameter under two names), or another view of it
        if is_param:
            old.data = new
        else:
            table[name] = new
    log.info("model weights on huge pages: %.0f MiB", total / 2**20)
    return total
