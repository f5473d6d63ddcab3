"""The attention backend of one engine step, over per-request KV tensors.

The step's tokens are flattened as: every prefill chunk (in plan order), then every decode
row. Linear layers run once over all of them; attention runs per prefill chunk (over that
request's cache, causal: the path's prefill kernel, ``Kernels.prefill_attention``, where it
applies, torch's SDPA otherwise) and over all decode rows at once (one kernel call that
appends each row's new K/V and attends over exactly that row's length: no padding).
With ``tiled`` caches (``kv_layout``) a chunk is stored by ``write_tiled``; the compiled
prefill kernels read the tiled planes themselves, SDPA gets the earlier chunks' K/V as a
token-major copy (``kv_layout.read``) followed by the chunk's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignedserve.kernels import DecodeRows, Kernels, kv_layout, reference


@dataclass(slots=True)
class PrefillSegment:
    cache: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    start: int
    num_tokens: int


class StepAttention:
    """AttentionBackend (see ``alignedserve.model.llama``) for one step's flattened tokens."""

    def __init__(self, kernels: Kernels, prefills: list[PrefillSegment],
                 decode_caches: list[torch.Tensor], decode_positions: torch.Tensor, scale: float,
                 tiled: bool = False):
        self.kernels = kernels
        self.prefills = prefills
        self.tiled = tiled
        self.decode_caches = decode_caches
        self.decode_positions = decode_positions
        self.scale = scale
        # The decode rows in the kernel's form, prepared at the first layer for all of them.
        self._decode_rows: DecodeRows | None = None
        # Decided at the first layer (q's dtype is known there): whether the path's prefill
        # kernel takes the chunks, else SDPA's mask per chunk (None: plain causal), built once
        # for all layers.
        self._use_kernel: bool | None = None
        self._masks: list[torch.Tensor | None] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.prefills:  # a decode-only step: the kernel's output is the whole answer
            return self._decode(layer, q, k, v)
        if self._use_kernel is None:
            self._use_kernel = self.kernels.prefill_kernel_applies(q)
            if not self._use_kernel:
                self._masks = [reference.continuation_mask(s.start, s.num_tokens, q.dtype,
                                                           s.cache.device)
                               for s in self.prefills]
        out = torch.empty_like(q)
        offset = 0
        for i, seg in enumerate(self.prefills):
            end = offset + seg.num_tokens
            out[offset:end] = self._prefill(i, layer, q[offset:end], k[offset:end], v[offset:end])
            offset = end
        if self.decode_caches:
            out[offset:] = self._decode(layer, q[offset:], k[offset:], v[offset:])
        return out

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if self._decode_rows is None:
            self._decode_rows = self.kernels.decode_rows(self.decode_caches,
                                                         self.decode_positions, self.tiled)
        return self.kernels.decode_attention_over(q, k, v, self._decode_rows, layer, self.scale)

    def _prefill(self, i: int, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        seg = self.prefills[i]
        stop = seg.start + seg.num_tokens
        k_cache, v_cache = seg.cache[layer, 0], seg.cache[layer, 1]  # [kv_heads, cap, dim]
        if self.tiled:
            self.kernels.write_tiled(seg.cache, layer, k, v, seg.start)
            if self._use_kernel:  # every compiled prefill kernel reads the planes in place
                hi = kv_layout.round_up(stop)  # the kernel reads the planes' whole blocks
                return self.kernels.prefill_attention(q, k_cache[:, :hi], v_cache[:, :hi],
                                                      seg.start, self.scale, tiled=True)
            # SDPA over token-major K/V: the earlier chunks' from the planes, this chunk's as
            # computed.
            keys = _token_major(k_cache, seg.start, k, kv_layout.KEYS)
            values = _token_major(v_cache, seg.start, v, kv_layout.VALUES)
        else:
            k_cache[:, seg.start:stop].copy_(k.transpose(0, 1))
            v_cache[:, seg.start:stop].copy_(v.transpose(0, 1))
            # Attend over what the cache holds (an 8-bit cache is widened to q's dtype), so
            # prefill and decode see the same K/V values.
            keys, values = k_cache[:, :stop].to(q.dtype), v_cache[:, :stop].to(q.dtype)
            if self._use_kernel:
                return self.kernels.prefill_attention(q, keys, values, seg.start, self.scale)
        return reference.prefill_attention(q, keys, values, self.scale, self._masks[i])


def _token_major(plane: torch.Tensor, start: int, fresh: torch.Tensor,
                 shape: kv_layout.BlockShape) -> torch.Tensor:
    """Positions [0, start) of a tiled ``plane`` ([kv_heads, capacity, dim]) followed by
    ``fresh`` ([T, kv_heads, dim]), as one dense token-major [kv_heads, start + T, dim]."""
    if start == 0:
        return fresh.transpose(0, 1).contiguous()
    return torch.cat([kv_layout.read(plane, start, shape), fresh.transpose(0, 1)], dim=1)
