"""KV tensors that mirror the KVStore's bookkeeping.

Each request's KV is one contiguous tensor ``[layers, 2, kv_heads, capacity, head_dim]``
(index 0 = K, 1 = V) on the torch device of the tier that holds it. The pool replays the
store's op log in order. Tier moves are asynchronous: ``MOVE_BEGIN`` starts a copy (a CUDA copy
stream, or a background thread on CPU, where both tiers are RAM but the copy is real) and
``MOVE_END`` waits for it; the time spent waiting is reported so steps can account for it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from alignedserve.huge_pages import HugePageArena, huge_pages_supported
from alignedserve.kv.store import KVHandle, KVOp, KVOpKind


@dataclass(slots=True)
class _PendingMove:
    dst: torch.Tensor
    done: Future | torch.cuda.Event


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copier thread's work: a single-threaded byte copy (numpy, GIL released).

    Not ``dst.copy_(src)``: a torch copy this large starts an OpenMP region, and the copier
    thread would get a worker pool of its own; with more OpenMP threads than CPUs libgomp stops
    spinning between regions in every pool, which slows the engine thread's step (see
    ``alignedserve.async_engine``). Both tensors are contiguous caches of the same dtype.
    """
    np.copyto(_bytes(dst), _bytes(src))


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(torch.uint8).numpy()


class KVPool:
    """Handle id -> tensor, kept in sync with the store by ``apply``."""

    def __init__(self, tier_devices: dict[str, torch.device], num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, tiled: bool = False):
        self.tier_devices = tier_devices
        self.tiled = tiled  # element order inside each plane: alignedserve.kernels.kv_layout
        self.shape = (num_layers, 2, num_kv_heads, head_dim)
        self.dtype = dtype
        self._tensors: dict[KVHandle, torch.Tensor] = {}
        self._moves: dict[KVHandle, _PendingMove] = {}
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
        self._cuda_stream = torch.cuda.Stream() if any(
            d.type == "cuda" for d in tier_devices.values()) else None
        # CPU caches come from recycled huge pages: the decode step streams them from DRAM, and
        # huge pages read faster (alignedserve/huge_pages.py). With CUDA, host caches are pinned.
        self._arena = (HugePageArena() if self._cuda_stream is None and huge_pages_supported()
                       else None)

    def _empty(self, tier: str, capacity: int) -> torch.Tensor:
        layers, two, heads, dim = self.shape
        shape = (layers, two, heads, capacity, dim)
        on_cpu = self.tier_devices[tier].type == "cpu"
        if on_cpu and self._arena is not None:
            return self._arena.empty(shape, self.dtype)
        pin = on_cpu and self._cuda_stream is not None  # host memory for async CUDA copies
        return torch.empty(shape, dtype=self.dtype, device=self.tier_devices[tier],
                           pin_memory=pin)

    def preallocate(self, nbytes: int) -> int:
        """Fault in ``nbytes`` of CPU cache memory now (0 where caches are not arena-backed);
        returns the bytes reserved."""
        return self._arena.reserve(nbytes) if self._arena is not None else 0

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
            self._moves[op.handle] = _PendingMove(dst, self._copier.submit(_copy, dst, src))
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
