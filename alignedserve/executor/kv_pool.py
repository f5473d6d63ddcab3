"""KV tensors that mirror the KVStore's bookkeeping.

Each request's KV is one contiguous tensor ``[layers, 2, kv_heads, capacity, head_dim]``
(index 0 = K, 1 = V) on the torch device of the tier that holds it. The pool replays the
store's op log in order. Tier moves are asynchronous: ``MOVE_BEGIN`` starts a copy (a CUDA copy
stream, or a background thread on CPU, where both tiers are RAM but the copy is real) and
``MOVE_END`` waits for it; the time spent waiting is reported so steps can account for it.
"""

from __future__ import annotations

import math
import mmap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from alignedserve.kv.store import KVHandle, KVOp, KVOpKind


HUGE_PAGE = 2 << 20
HUGE_PAGE_MIN_BYTES = 8 << 20  # smaller tensors would waste too much to rounding


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, backed by transparent huge pages where Linux allows.

    The decode kernel streams every row's KV each step (~1 GB for 64 rows of ~900 tokens);
    with 4 KiB pages that is a TLB miss every 4 KiB. Measured on the 2-core VM: 30 layers of
    decode attention over 64 such rows took 72 ms on huge pages against 76-83 ms. The memory
    is an anonymous mapping (rounded up to 2 MiB) owned by the tensor's storage, so it is
    returned to the OS when the last view of the tensor goes away.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE,
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)  # advice only: without THP this is plain memory
    except OSError:  # a kernel built without THP rejects the advice; the mapping still works
        pass
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


@dataclass(slots=True)
class _PendingMove:
    dst: torch.Tensor
    done: Future | torch.cuda.Event


class KVPool:
    """Handle id -> tensor, kept in sync with the store by ``apply``."""

    def __init__(self, tier_devices: dict[str, torch.device], num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        self.tier_devices = tier_devices
        self.shape = (num_layers, 2, num_kv_heads, head_dim)
        self.dtype = dtype
        self._tensors: dict[KVHandle, torch.Tensor] = {}
        self._moves: dict[KVHandle, _PendingMove] = {}
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
        self._cuda_stream = torch.cuda.Stream() if any(
            d.type == "cuda" for d in tier_devices.values()) else None

    def _empty(self, tier: str, capacity: int) -> torch.Tensor:
        layers, two, heads, dim = self.shape
        shape = (layers, two, heads, capacity, dim)
        device = self.tier_devices[tier]
        if device.type == "cpu" and self._cuda_stream is None:
            return huge_page_tensor(shape, self.dtype)
        pin = device.type == "cpu"  # host tier of a CUDA engine: pinned for async copies
        return torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin)

    def get(self, handle: KVHandle) -> torch.Tensor:
        return self._tensors[handle]

    def __len__(self) -> int:
        return len(self._tensors)

    def apply(self, ops: list[KVOp]) -> tuple[float, int]:
        """Replay ``ops`` in order; return (seconds waited on copies, bytes copied)."""
        waited, copied = 0.0, 0
        for op in ops:
            if op.kind is KVOpKind.ALLOC:
                self._tensors[op.handle] = self._empty(op.tier, op.capacity)
            elif op.kind is KVOpKind.GROW:
                old = self._tensors[op.handle]
                new = self._empty(op.tier, op.capacity)
                new[:, :, :, : old.shape[3]].copy_(old)
                self._tensors[op.handle] = new
                copied += old.numel() * old.element_size()
            elif op.kind is KVOpKind.MOVE_BEGIN:
                copied += self._begin_move(op)
            elif op.kind is KVOpKind.MOVE_END:
                waited += self._end_move(op.handle)
            elif op.kind is KVOpKind.FREE:
                if op.handle in self._moves:
                    waited += self._end_move(op.handle)
                del self._tensors[op.handle]
        return waited, copied

    def _begin_move(self, op: KVOp) -> int:
        src = self._tensors[op.handle]
        dst = self._empty(op.tier, op.capacity)
        if self._cuda_stream is not None and (src.is_cuda or dst.is_cuda):
            self._cuda_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._cuda_stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._moves[op.handle] = _PendingMove(dst, event)
        else:
            self._moves[op.handle] = _PendingMove(dst, self._copier.submit(dst.copy_, src))
        return src.numel() * src.element_size()

    def _end_move(self, handle: KVHandle) -> float:
        move = self._moves.pop(handle)
        start = time.perf_counter()
        if isinstance(move.done, Future):
            move.done.result()
        else:
            torch.cuda.current_stream().wait_event(move.done)
        self._tensors[handle] = move.dst
        return time.perf_counter() - start

    def close(self) -> None:
        self._copier.shutdown(wait=True)
