"""The PyTorch reference of every kernel op: correct for any dtype, device and layout.

These are the semantics the compiled kernels implement (``csrc/``), and what runs wherever
they do not apply: float32 models (which must stay bit-identical to Hugging Face
transformers), other devices, the ``reference`` path. The elementwise ops are the model's
plain PyTorch code; the compiled bf16 ones round exactly where these do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from alignedserve.kernels import kv_layout


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [T, H] with weight [H]: ``w * r(x * rsqrt(mean(x^2) + eps))``, the
    statistics in float32 and the normalised value cast back to x's dtype before the weight
    (as Hugging Face Llama does). Returns a new tensor."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """``residual + x``, then its RMSNorm: returns (normed, new residual), inputs untouched."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (Hugging Face convention). x: [T, heads, D]; cos, sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split fused qkv [T, (H + 2 KVH) D] into q [T, H, D], k, v [T, KVH, D], RoPE on q and k;
    cos, sin: [T, D/2]. New q and k; v is a view of qkv."""
    t = qkv.shape[0]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim), dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    q = apply_rotary(q.view(t, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(t, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(t, num_kv_heads, head_dim)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU activation: gate_up [T, 2 I] = [gate | up] -> ``silu(gate) * up`` [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(logits: Tensor) -> list[int]:
    """Index of each row's largest value, the first on ties (``max`` is faster than
    ``argmax`` on CPU and picks the same index)."""
    return logits.max(dim=-1).indices.tolist()


def decode_attention(q: Tensor, k_new: Tensor, v_new: Tensor, caches: list[Tensor],
                     positions: Tensor, layer: int, scale: float, tiled: bool = False) -> Tensor:
    """Append each row's new K/V at ``positions[b]``, then attend over ``0..positions[b]``.

    Shapes: q [B, H, D]; k_new, v_new [B, KVH, D] (cast to the cache dtype); caches[b]
    [layers, 2, KVH, capacity_b, D]; positions int64 [B] on CPU. For every row, k_new / v_new
    land in ``caches[b][layer, 0/1, :, positions[b]]`` first (nothing else in any cache
    changes); then query head h attends over kv head ``h // (H // KVH)``, softmax(scale q.k)
    in float32. Returns [B, H, D] in q's dtype. ``tiled``: the caches use ``kv_layout``'s
    tiled layout (positions mean the same). All rows are validated before any is written.
    """
    rows, heads, dim = q.shape
    if len(caches) != rows or positions.numel() != rows:
        raise ValueError("decode_attention: need one cache and one position per row")
    pos_list = positions.tolist()
    for cache, pos in zip(caches, pos_list):
        if not 0 <= layer < cache.shape[0]:
            raise ValueError(f"decode_attention: layer {layer} out of range for {cache.shape[0]}")
        if not 0 <= pos < cache.shape[3]:
            raise ValueError(f"decode_attention: position {pos} outside capacity {cache.shape[3]}")
    out = torch.empty_like(q)
    for b, (cache, pos) in enumerate(zip(caches, pos_list)):
        if tiled:
            kv_layout.write(cache[layer, 0], pos, k_new[b].unsqueeze(1), kv_layout.KEYS)
            kv_layout.write(cache[layer, 1], pos, v_new[b].unsqueeze(1), kv_layout.VALUES)
            k = kv_layout.read(cache[layer, 0], pos + 1, kv_layout.KEYS).float()
            v = kv_layout.read(cache[layer, 1], pos + 1, kv_layout.VALUES).float()
        else:
            cache[layer, 0, :, pos].copy_(k_new[b])
            cache[layer, 1, :, pos].copy_(v_new[b])
            k = cache[layer, 0, :, : pos + 1].float()  # [kv_heads, n, dim]
            v = cache[layer, 1, :, : pos + 1].float()
        qg = q[b].float().reshape(k.shape[0], heads // k.shape[0], dim)
        probs = torch.softmax(torch.matmul(qg, k.transpose(1, 2)) * scale, dim=-1)
        out[b] = torch.matmul(probs, v).reshape(heads, dim).to(q.dtype)
    return out


def continuation_mask(start: int, num_tokens: int, dtype: torch.dtype,
                      device: torch.device) -> Tensor | None:
    """SDPA's causal mask for ``num_tokens`` queries at positions ``start..`` over keys
    ``0..start+num_tokens-1``: additive (0 / -inf), None when ``start`` is 0 (plain causal).
    Additive rather than boolean so that a caller can build it once per step and reuse it in
    every layer (SDPA converts a boolean mask on every call); the outputs are bit-identical."""
    if start == 0:
        return None
    rows = torch.arange(num_tokens).unsqueeze(1) + start
    cols = torch.arange(start + num_tokens).unsqueeze(0)
    mask = torch.zeros(rows.shape[0], cols.shape[1], dtype=dtype)
    return mask.masked_fill_(cols > rows, float("-inf")).to(device)


def prefill_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float,
                      mask: Tensor | None) -> Tensor:
    """Causal attention of prefill queries q [T, H, D] over keys / values [KVH, S, D]
    (token-major, S = start + T) with torch's SDPA and GQA; ``mask`` is
    ``continuation_mask(start, T, ...)`` (None for start 0). Returns [T, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def write_tiled(cache: Tensor, layer: int, k: Tensor, v: Tensor, start: int) -> None:
    """Store k, v [T, KVH, D] at positions start.. of a tiled cache's layer ``layer``."""
    kv_layout.write(cache[layer, 0], start, k.transpose(0, 1), kv_layout.KEYS)
    kv_layout.write(cache[layer, 1], start, v.transpose(0, 1), kv_layout.VALUES)
