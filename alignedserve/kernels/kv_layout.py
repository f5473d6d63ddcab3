"""The tiled layout of bf16 KV caches, read by the decode kernels of every compiled path.

A tiled cache keeps the shape ``[layers, 2, kv_heads, capacity, head_dim]`` (capacity a
multiple of 16); only the order of the elements inside each kv head's ``[capacity, head_dim]``
plane changes, and only within small token blocks:

* **K** (index 0): blocks of 16 tokens, each stored ``[head_dim / 2][16 tokens][2 dims]``;
* **V** (index 1): pairs of tokens, each stored ``[head_dim][2 tokens]``.

Pairs of the summed dimension sit side by side, as both bf16 product instructions take them
(AMX's tile product, where these are its "B" operands, and AVX512-BF16's ``vdpbf16ps``; on AVX2
a shift and a mask split a pair into two fp32 vectors of one dimension each), so the
decode kernel (``alignedserve/kernels/csrc/attention.cpp``) streams K blocks and V pairs from the
cache straight into the products: 16 tokens of a head's scores come out together, with no
reshuffling per step. Whole blocks stay where the token-major layout has them, so slicing a
plane by multiples of 16 tokens (growing a cache, copying it between tiers) works unchanged.

Writers and readers other than the compiled kernels go through :func:`write` and :func:`read`
(prefill chunks, the reference decode path, tests); the kernels take the layout's addressing
from ``csrc/tiled_layout.h``, which must agree with :data:`KEYS` and :data:`VALUES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockShape:
    """A block of ``tokens`` tokens stored ``[head_dim / dims][tokens][dims]``."""

    tokens: int
    dims: int


KEYS = BlockShape(tokens=16, dims=2)
VALUES = BlockShape(tokens=2, dims=1)
CAPACITY_MULTIPLE = 16  # every block shape divides it


def _token_major_view(plane: torch.Tensor, lo: int, hi: int, shape: BlockShape) -> torch.Tensor:
    """Tokens [lo, hi) of ``plane`` ([kv_heads, capacity, dim]; lo, hi multiples of
    ``shape.tokens``) as a view [kv_heads, blocks, tokens, dim / dims, dims]."""
    kv_heads, _, dim = plane.shape
    stored = plane[:, lo:hi].view(kv_heads, (hi - lo) // shape.tokens, dim // shape.dims,
                                  shape.tokens, shape.dims)
    return stored.permute(0, 1, 3, 2, 4)


def round_up(n: int, multiple: int = CAPACITY_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def write(plane: torch.Tensor, start: int, x: torch.Tensor, shape: BlockShape) -> None:
    """Store ``x`` ([kv_heads, T, dim], token-major) at positions [start, start + T) of a tiled
    ``plane`` ([kv_heads, capacity, dim]): at most three copies (a partial first block, the
    whole blocks, a partial last block)."""
    stop = start + x.shape[1]
    lo = start // shape.tokens * shape.tokens
    view = _token_major_view(plane, lo, round_up(stop, shape.tokens), shape)
    src = x.unflatten(2, (-1, shape.dims))  # [kv_heads, T, dim / dims, dims]
    t = start
    while t < stop:
        block, offset = divmod(t - lo, shape.tokens)
        if offset == 0 and stop - t >= shape.tokens:
            count = (stop - t) // shape.tokens
            n = count * shape.tokens
            whole = src[:, t - start:t - start + n].unflatten(1, (count, -1))
            view[:, block:block + count].copy_(whole)
        else:
            n = min(shape.tokens - offset, stop - t)
            view[:, block, offset:offset + n].copy_(src[:, t - start:t - start + n])
        t += n


def read(plane: torch.Tensor, stop: int, shape: BlockShape) -> torch.Tensor:
    """Positions [0, stop) of a tiled ``plane`` as a new token-major [kv_heads, stop, dim]."""
    kv_heads, _, dim = plane.shape
    hi = round_up(stop, shape.tokens)
    if shape.dims == 2 and plane.element_size() == 2:
        # A pair of dims as one 32-bit word makes the reorder a plain transpose of words per
        # block, which torch copies several times faster than 2-byte elements.
        words = plane[:, :hi].view(torch.int32)
        blocks = _token_major_view(words, 0, hi, BlockShape(shape.tokens, 1))
        dense = blocks.contiguous().view(kv_heads, hi, dim // 2).view(plane.dtype)
        return dense[:, :stop]
    return _token_major_view(plane, 0, hi, shape).reshape(kv_heads, hi, dim)[:, :stop]
