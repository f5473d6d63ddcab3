"""The prefill-attention kernels (AMX, AVX512-BF16, AVX2) against torch's SDPA (float32 on
the same bf16 inputs), on every compiled path this CPU has.

The kernel's own error must stay at the level of torch's bf16 SDPA: the output rounding (half
a bf16 ulp) plus the bf16 rounding of the probabilities. A query's output must not depend on
how its prompt was cut into chunks or on the thread count (batch invariance).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alignedserve.executor.attention import PrefillSegment, StepAttention
from alignedserve.kernels import Kernels, kv_layout


@pytest.fixture
def ext(compiled: Kernels) -> Kernels:
    """Each compiled path with a prefill kernel (its ops, not the raw build)."""
    if not compiled.prefill_kernel_applies(torch.empty(1, 1, 64, dtype=torch.bfloat16)):
        pytest.skip(f"the {compiled.path} path has no prefill kernel (SDPA runs there)")
    return compiled


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
              scale: float) -> torch.Tensor:
    """float32 SDPA with the bottom-right causal mask of a chunk at ``start``."""
    rows = torch.arange(q.shape[0]).unsqueeze(1) + start
    mask = torch.arange(k.shape[1]).unsqueeze(0) <= rows
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0),
        attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def bf16_sdpa_error(q, k, v, start, scale, want) -> float:
    rows = torch.arange(q.shape[0]).unsqueeze(1) + start
    mask = torch.arange(k.shape[1]).unsqueeze(0) <= rows
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                       v.unsqueeze(0), attn_mask=mask, scale=scale,
                                       enable_gqa=True).squeeze(0).transpose(0, 1)
    return (o.float() - want).abs().max().item()


@pytest.mark.parametrize("tokens,start,heads,kv_heads,dim", [
    (1, 0, 9, 3, 64), (5, 0, 9, 3, 64), (16, 0, 4, 4, 64), (37, 100, 9, 3, 64),
    (300, 0, 9, 3, 64), (250, 777, 9, 3, 64), (33, 31, 8, 2, 128), (70, 13, 12, 4, 32),
    (3, 61, 6, 1, 256), (40, 9, 10, 2, 64)])
def test_matches_sdpa(ext, tokens: int, start: int, heads: int, kv_heads: int, dim: int):
    torch.manual_seed(tokens * 7 + start)
    keys = start + tokens
    # A cache slab with spare capacity (strided heads) and a query view of a fused qkv row.
    cache = torch.randn(2, kv_heads, keys + 9, dim, dtype=torch.bfloat16) * 2
    k, v = cache[0, :, :keys], cache[1, :, :keys]
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=torch.bfloat16) * 2
    q = qkv[:, :heads]
    scale = dim ** -0.5
    got = ext.prefill_attention(q, k, v, start, scale)
    want = reference(q, k, v, start, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    err = (got.float() - want).abs().max().item()
    assert err <= 1.25 * bf16_sdpa_error(q, k, v, start, scale, want) + 1e-3


def test_rejects_bad_inputs(ext):
    q = torch.randn(4, 6, 64, dtype=torch.bfloat16)
    k = torch.randn(3, 10, 64, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match="S == start"):
        ext.prefill_attention(q, k, k, 5, 0.125)  # 5 + 4 != 10 keys
    with pytest.raises((RuntimeError, ValueError), match="multiple of kv heads"):
        ext.prefill_attention(torch.randn(4, 7, 64, dtype=torch.bfloat16), k[:, :4], k[:, :4],
                              0, 0.125)
    with pytest.raises((RuntimeError, ValueError), match="bf16"):
        ext.prefill_attention(q.float(), k[:, :4], k[:, :4], 0, 0.125)
    with pytest.raises((RuntimeError, ValueError), match="scale must be positive"):
        ext.prefill_attention(q, k[:, :4], k[:, :4], 0, -0.125)  # the max would not commute


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_step_attention_routes_bf16_chunks_to_the_kernel(ext, monkeypatch, dtype):
    """bf16 chunks of any size take the kernel, float32 ones SDPA (with the additive mask for
    the continuation chunk); both give SDPA's answer through StepAttention (cache write
    included)."""
    calls = []
    real = ext.prefill_attention
    monkeypatch.setattr(ext, "prefill_attention",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    torch.manual_seed(0)
    layers, kv_heads, heads, dim = 2, 3, 9, 64
    segs = [PrefillSegment(torch.zeros(layers, 2, kv_heads, 1200, dim, dtype=dtype),
                           start, n) for start, n in ((0, 40), (500, 400))]
    for seg in segs:  # earlier context of the continuation chunk
        seg.cache[:, :, :, :seg.start] = torch.randn(layers, 2, kv_heads, seg.start, dim)
    tokens = sum(s.num_tokens for s in segs)
    q = torch.randn(tokens, heads, dim, dtype=dtype)
    k = torch.randn(tokens, kv_heads, dim, dtype=dtype)
    v = torch.randn(tokens, kv_heads, dim, dtype=dtype)
    out = StepAttention(ext, segs, [], torch.zeros(0, dtype=torch.int64), 0.125)(1, q, k, v)
    assert calls == ([40, 400] if dtype == torch.bfloat16 else [])
    offset = 0
    for seg in segs:
        end = offset + seg.num_tokens
        stop = seg.start + seg.num_tokens
        cache_k, cache_v = seg.cache[1, 0, :, :stop], seg.cache[1, 1, :, :stop]
        assert torch.equal(cache_k[:, seg.start:], k[offset:end].transpose(0, 1))
        want = reference(q[offset:end], cache_k, cache_v, seg.start, 0.125)
        assert (out[offset:end].float() - want).abs().max().item() < 0.03
        offset = end


def test_a_querys_output_does_not_depend_on_its_chunk(ext):
    """A 1000-token prompt in one chunk, in uneven chunks, and on one thread: bit-identical."""
    torch.manual_seed(5)
    heads, kv_heads, dim, n = 9, 3, 64, 1000
    k = torch.randn(kv_heads, n, dim, dtype=torch.bfloat16) * 2
    v = torch.randn(kv_heads, n, dim, dtype=torch.bfloat16)
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16) * 2
    whole = ext.prefill_attention(q, k, v, 0, 0.125)
    parts, start = [], 0
    for size in (300, 1, 450, 249):
        stop = start + size
        parts.append(ext.prefill_attention(q[start:stop], k[:, :stop], v[:, :stop], start,
                                           0.125))
        start = stop
    assert torch.equal(torch.cat(parts), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ext.prefill_attention(q, k, v, 0, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, whole)


def tiled_planes(k: torch.Tensor, v: torch.Tensor, capacity: int) -> torch.Tensor:
    """[2, kv_heads, capacity, dim] tiled K and V planes holding k, v [kv_heads, S, dim]; every
    position past S holds a stale NaN or inf (memory a finished request left behind)."""
    kv_heads, keys, dim = k.shape
    planes = torch.full((2, kv_heads, capacity, dim), float("nan"), dtype=torch.bfloat16)
    planes[:, :, keys + 1:] = float("inf")
    kv_layout.write(planes[0], 0, k, kv_layout.KEYS)
    kv_layout.write(planes[1], 0, v, kv_layout.VALUES)
    return planes


@pytest.mark.parametrize("tokens,start", [(1, 0), (17, 0), (300, 0), (37, 100), (211, 300),
                                          (48, 1000), (128, 128)])
def test_reads_tiled_planes_in_place(ext, tokens: int, start: int):
    """Every compiled path reads a tiled cache in place: its answer over the planes is the one
    over token-major K/V (to rounding; on avx2 bit for bit), and stale data past the prompt
    never reaches it."""
    torch.manual_seed(tokens + start)
    heads, kv_heads, dim, keys = 9, 3, 64, start + tokens
    k = torch.randn(kv_heads, keys, dim, dtype=torch.bfloat16) * 2
    v = torch.randn(kv_heads, keys, dim, dtype=torch.bfloat16)
    q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16) * 2
    planes = tiled_planes(k, v, kv_layout.round_up(keys) + 32)
    hi = kv_layout.round_up(keys)
    got = ext.prefill_attention(q, planes[0, :, :hi], planes[1, :, :hi], start, 0.125,
                                tiled=True)
    assert not got.isnan().any()
    want = reference(q, k, v, start, 0.125)
    assert (got.float() - want).abs().max().item() <= (
        1.25 * bf16_sdpa_error(q, k, v, start, 0.125, want) + 1e-3)
    if ext.avx2:  # fp32 FMA chains over the same elements: the layout changes no bit
        assert torch.equal(got, ext.prefill_attention(q, k, v, start, 0.125))


def test_over_tiled_planes_a_querys_output_does_not_depend_on_its_chunk(ext):
    """The batch invariance of the test above, when the kernel reads a tiled cache."""
    torch.manual_seed(6)
    heads, kv_heads, dim, n = 9, 3, 64, 1000
    k = torch.randn(kv_heads, n, dim, dtype=torch.bfloat16) * 2
    v = torch.randn(kv_heads, n, dim, dtype=torch.bfloat16)
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16) * 2
    planes = tiled_planes(k, v, 1024)
    whole = ext.prefill_attention(q, planes[0], planes[1], 0, 0.125, tiled=True)
    parts, start = [], 0
    for size in (300, 1, 450, 249):
        stop = start + size
        hi = kv_layout.round_up(stop)
        parts.append(ext.prefill_attention(q[start:stop], planes[0, :, :hi], planes[1, :, :hi],
                                           start, 0.125, tiled=True))
        start = stop
    assert torch.equal(torch.cat(parts), whole)
