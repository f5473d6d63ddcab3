"""The tiled bf16 KV layout (alignedserve.kernels.kv_layout) and the kernels that read it.

The layout helpers are pure PyTorch and always tested; the compiled writer on every compiled
path. The tiled decode kernel runs on every compiled path (amx: tile products; avx512_bf16:
vdpbf16ps; avx2: fp32 FMA), each skipped, saying why, on CPUs without it. The prefill kernel
reads the tiled planes itself on amx and avx512_bf16; on avx2 the kernel layer hands it a
token-major copy.
"""

from __future__ import annotations

import random

import pytest
import torch

from alignedserve.kernels import Kernels, kernels_for_path, kv_layout, reference
from tests.conftest import kernel_path_params

decode_attention_reference = reference.decode_attention

KV_HEADS, HEADS, DIM, LAYERS = 3, 9, 64, 2


def random_bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [kv_layout.KEYS, kv_layout.VALUES])
def test_write_then_read_is_token_major(shape):
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    cap = 96
    for _ in range(40):
        plane = random_bf16(KV_HEADS, cap, DIM, gen=gen)
        expect = kv_layout.read(plane, cap, shape).clone()
        start = rng.randrange(cap)
        x = random_bf16(KV_HEADS, rng.randrange(1, cap - start + 1), DIM, gen=gen)
        kv_layout.write(plane, start, x, shape)
        expect[:, start:start + x.shape[1]] = x
        assert torch.equal(kv_layout.read(plane, cap, shape), expect), (start, x.shape)


def test_element_offsets_are_the_documented_ones():
    """K: 16-token blocks stored [dim/2][16][2]; V: token pairs stored [dim][2]."""
    tokens = torch.arange(32 * DIM, dtype=torch.float32).view(1, 32, DIM).to(torch.bfloat16)
    for shape, offset in [
        (kv_layout.KEYS, lambda t, d: t // 16 * 16 * DIM + d // 2 * 32 + t % 16 * 2 + d % 2),
        (kv_layout.VALUES, lambda t, d: t // 2 * 2 * DIM + d * 2 + t % 2),
    ]:
        plane = torch.zeros(1, 32, DIM, dtype=torch.bfloat16)
        kv_layout.write(plane, 0, tokens, shape)
        flat = plane.view(-1)
        for t, d in [(0, 0), (1, 0), (0, 1), (17, 37), (31, 63), (6, 40)]:
            assert flat[offset(t, d)] == tokens[0, t, d]


TILED_PATHS = ("amx", "avx512_bf16", "avx512", "avx2")


@pytest.fixture(scope="module", params=kernel_path_params(TILED_PATHS))
def tiled_kernels(request) -> Kernels:
    """A path whose decode kernel reads tiled caches."""
    kernels = kernels_for_path(request.param)
    assert kernels.amx == (request.param == "amx"), "the amx path loaded without AMX kernels"
    return kernels


@pytest.fixture(scope="module")
def ext(tiled_kernels: Kernels):
    return tiled_kernels.ext


def test_compiled_writer_matches_layout(compiled: Kernels):
    gen = torch.Generator().manual_seed(1)
    for start, count in [(0, 1), (0, 16), (5, 40), (15, 2), (31, 33), (64, 100), (3, 61),
                         (16, 32), (1, 30), (0, 171)]:
        cache = random_bf16(LAYERS, 2, KV_HEADS, 176, DIM, gen=gen)
        expect = cache.clone()
        k = random_bf16(count, KV_HEADS, DIM, gen=gen)
        v = random_bf16(count, KV_HEADS, DIM, gen=gen)
        if count % 2:  # rows a fused qkv's width apart, as the engine passes them
            qkv = random_bf16(count, 3 * KV_HEADS, DIM, gen=gen)
            qkv[:, KV_HEADS:2 * KV_HEADS], qkv[:, 2 * KV_HEADS:] = k, v
            k, v = qkv[:, KV_HEADS:2 * KV_HEADS], qkv[:, 2 * KV_HEADS:]
        compiled.write_tiled(cache, 1, k, v, start)
        kv_layout.write(expect[1, 0], start, k.transpose(0, 1), kv_layout.KEYS)
        kv_layout.write(expect[1, 1], start, v.transpose(0, 1), kv_layout.VALUES)
        assert torch.equal(cache.view(torch.int16), expect.view(torch.int16)), (start, count)


def tiled_rows(lengths: list[int], gen: torch.Generator,
               kv_heads: int = KV_HEADS) -> list[torch.Tensor]:
    """Tiled caches whose slots from position length-1 on hold NaN (read one: NaN output)."""
    caches = []
    for i, n in enumerate(lengths):
        cache = random_bf16(LAYERS, 2, kv_heads, kv_layout.round_up(n + 3 * i), DIM, gen=gen)
        for layer in range(LAYERS):
            for j, shape in enumerate((kv_layout.KEYS, kv_layout.VALUES)):
                plane = cache[layer, j]
                tail = torch.full((kv_heads, plane.shape[1] - n + 1, DIM), float("nan"))
                kv_layout.write(plane, n - 1, tail, shape)
        caches.append(cache)
    return caches


# Lengths around the 16-token K blocks, the 32-token P.V rounds, the 2048-token span limit
# (longer rows are split and merged) and rows that fill their capacity.
LENGTH_SETS = [[1], [2, 15, 16, 17], [31, 32, 33, 64, 300], [2049, 5000, 17], [1000] * 8]


@pytest.mark.parametrize("lengths", LENGTH_SETS)
def test_tiled_decode_matches_reference(ext, lengths):
    check_tiled_decode(ext, lengths, HEADS, KV_HEADS)


# GQA groups of one head up to 16 (the kernels take heads in register-sized chunks).
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (7, 1), (12, 1), (16, 1)])
def test_tiled_decode_takes_every_group_size(ext, heads, kv_heads):
    check_tiled_decode(ext, [1, 31, 2100], heads, kv_heads)


@pytest.fixture
def two_threads():
    """Two intra-op threads, so the calls of 16 and 40 rows below run as row units (at least
    four rows per thread) on a machine of any size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


# How the dot-product kernel may read (the other kernels take and ignore the same arguments):
# per-head items; a call of many rows as row units (every kv head of a row in one work item);
# per-head items keeping a distance requested ahead of their reads.
READ_ORDERS = {"items": {}, "row units": {"row_units": True}, "read ahead": {"read_ahead": 8192}}

# Odd, partial-block and split rows through each read order, for GQA groups units take (up to
# 6 heads, 16 heads per row) and one they leave to per-head items (7).
MANY_ROWS = [1, 2, 15, 16, 17, 31, 32, 33, 64, 300, 2049, 5000, 9, 100, 640, 1000]


@pytest.mark.parametrize("order", READ_ORDERS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (12, 2), (16, 4), (7, 1)])
def test_tiled_decode_of_many_rows(ext, two_threads, heads, kv_heads, order):
    check_tiled_decode(ext, MANY_ROWS, heads, kv_heads, **READ_ORDERS[order])


@pytest.mark.parametrize("order", READ_ORDERS)
def test_tiled_rows_give_the_same_bits_alone_and_in_a_batch(ext, two_threads, order):
    """Batch invariance across the item shapes: a row alone is a few (row, kv head) items,
    among many rows one row unit where asked; each score and sum runs in the same order."""
    caches, q, k_new, v_new, pos = decode_inputs([1 + (i * 617) % 5000 for i in range(40)],
                                                 torch.Generator().manual_seed(11))
    batch = ext.decode_attention(q, k_new, v_new, [c.clone() for c in caches], pos, 1,
                                 DIM ** -0.5, True, **READ_ORDERS[order])
    for b in (0, 7, 13, 39):
        alone = ext.decode_attention(q[b:b + 1], k_new[b:b + 1], v_new[b:b + 1],
                                     [caches[b].clone()], pos[b:b + 1], 1, DIM ** -0.5, True,
                                     **READ_ORDERS[order])
        assert torch.equal(alone[0].view(torch.int16), batch[b].view(torch.int16)), b


def test_read_orders_give_the_same_bits(ext, two_threads):
    """Row units and read-ahead distances (under a line, the usual one, past every row) only
    change how the kernel reads, not any sum."""
    caches, q, k_new, v_new, pos = decode_inputs([1 + (i * 389) % 3000 for i in range(24)],
                                                 torch.Generator().manual_seed(12))
    orders = [*READ_ORDERS.values(), {"read_ahead": 1}, {"read_ahead": 1 << 30}]
    out = [ext.decode_attention(q, k_new, v_new, [c.clone() for c in caches], pos, 1,
                                DIM ** -0.5, True, **order) for order in orders]
    for other, order in zip(out[1:], orders[1:]):
        assert torch.equal(out[0].view(torch.int16), other.view(torch.int16)), order


def test_negative_read_ahead_is_refused(ext):
    caches, q, k_new, v_new, pos = decode_inputs([40], torch.Generator().manual_seed(13))
    with pytest.raises(ValueError, match="read_ahead"):
        ext.decode_attention(q, k_new, v_new, caches, pos, 1, DIM ** -0.5, True, False, -1)


def test_rows_prepared_once_serve_every_layer(tiled_kernels: Kernels, two_threads):
    """Kernels.decode_rows + decode_attention_over (the engine's per-step form) give every
    layer the bits and cache writes of one decode_attention call per layer."""
    caches, q, k_new, v_new, pos = decode_inputs([1 + (i * 211) % 2500 for i in range(20)],
                                                 torch.Generator().manual_seed(14))
    per_call = [c.clone() for c in caches]
    rows = tiled_kernels.decode_rows(caches, pos, tiled=True)
    assert rows.compiled is not None
    for layer in range(LAYERS):
        got = tiled_kernels.decode_attention_over(q, k_new, v_new, rows, layer, DIM ** -0.5)
        want = tiled_kernels.decode_attention(q, k_new, v_new, per_call, pos, layer,
                                              DIM ** -0.5, True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), layer
    for got, want in zip(caches, per_call):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_prepared_rows_check_their_inputs(ext):
    caches, q, k_new, v_new, pos = decode_inputs([40, 7], torch.Generator().manual_seed(15))
    with pytest.raises(ValueError, match="outside capacity"):
        ext.DecodeRows(caches, torch.tensor([39, 4000]), True)
    with pytest.raises(ValueError, match="one position per row"):
        ext.DecodeRows(caches, pos[:1], True)
    rows = ext.DecodeRows(caches, pos, True)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        ext.decode_attention_rows(q, k_new, v_new, rows, LAYERS, DIM ** -0.5)
    with pytest.raises(ValueError, match="one cache and one position per row"):
        ext.decode_attention_rows(q[:1], k_new[:1], v_new[:1], rows, 0, DIM ** -0.5)


def test_the_reference_takes_prepared_rows_too():
    kernels = kernels_for_path("reference")
    caches, q, k_new, v_new, pos = decode_inputs([5, 33], torch.Generator().manual_seed(16))
    expect_caches = [c.clone() for c in caches]
    rows = kernels.decode_rows(caches, pos, tiled=True)
    assert rows.compiled is None
    got = kernels.decode_attention_over(q, k_new, v_new, rows, 1, DIM ** -0.5)
    want = decode_attention_reference(q, k_new, v_new, expect_caches, pos, 1, DIM ** -0.5,
                                      tiled=True)
    assert torch.equal(got, want)


def decode_inputs(lengths: list[int], gen: torch.Generator, heads: int = HEADS,
                  kv_heads: int = KV_HEADS) -> tuple:
    """Tiled bf16 rows of ``lengths`` tokens and one decode step's inputs for them:
    (caches, q, k_new, v_new, pos), each row's new token at its last position."""
    caches = tiled_rows(lengths, gen, kv_heads)
    q = (torch.randn(len(lengths), heads, DIM, generator=gen) * 2).to(torch.bfloat16)
    k_new = random_bf16(len(lengths), kv_heads, DIM, gen=gen)
    v_new = random_bf16(len(lengths), kv_heads, DIM, gen=gen)
    return caches, q, k_new, v_new, torch.tensor([n - 1 for n in lengths])


def check_tiled_decode(ext, lengths: list[int], heads: int, kv_heads: int,
                       **read_order: int) -> None:
    caches, q, k_new, v_new, pos = decode_inputs(
        lengths, torch.Generator().manual_seed(len(lengths) + heads), heads, kv_heads)
    expect_caches = [c.clone() for c in caches]
    out = ext.decode_attention(q, k_new, v_new, caches, pos, 1, DIM ** -0.5, True, **read_order)
    expect = decode_attention_reference(q, k_new, v_new, expect_caches, pos, 1, DIM ** -0.5,
                                        tiled=True)
    # bf16 output rounding plus the bf16 rounding of q.k's probabilities (as in prefill)
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
    for got, want in zip(caches, expect_caches):  # the new tokens, and nothing else, written
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_reference_reads_the_same_values_in_either_layout():
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 40]
    flat = [random_bf16(LAYERS, 2, KV_HEADS, 48, DIM, gen=gen) for _ in lengths]
    tiled = [torch.empty_like(c) for c in flat]
    for src, dst in zip(flat, tiled):
        for layer in range(LAYERS):
            kv_layout.write(dst[layer, 0], 0, src[layer, 0], kv_layout.KEYS)
            kv_layout.write(dst[layer, 1], 0, src[layer, 1], kv_layout.VALUES)
    q = random_bf16(2, HEADS, DIM, gen=gen)
    k_new, v_new = random_bf16(2, KV_HEADS, DIM, gen=gen), random_bf16(2, KV_HEADS, DIM, gen=gen)
    pos = torch.tensor([n - 1 for n in lengths])
    a = decode_attention_reference(q, k_new, v_new, flat, pos, 0, 0.125)
    b = decode_attention_reference(q, k_new, v_new, tiled, pos, 0, 0.125, tiled=True)
    assert torch.equal(a, b)


def test_tiled_decode_rejects_what_it_cannot_take(ext):
    gen = torch.Generator().manual_seed(4)
    q = random_bf16(1, HEADS, DIM, gen=gen)
    kv = random_bf16(1, KV_HEADS, DIM, gen=gen)
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.decode_attention(q, kv, kv, [random_bf16(1, 2, KV_HEADS, 40, DIM, gen=gen)],
                             torch.tensor([3]), 0, 0.125, True)
    with pytest.raises(ValueError, match="bf16 with head_dim 64"):
        ext.decode_attention(q.float(), kv.float(), kv.float(),
                             [torch.zeros(1, 2, KV_HEADS, 32, DIM)], torch.tensor([3]), 0,
                             0.125, True)


@pytest.mark.parametrize("start,count", [(0, 100), (0, 700), (37, 500), (1024, 1023), (900, 77)])
def test_prefill_kernel_reads_tiled_planes(tiled_kernels: Kernels, start, count):
    """Bit-identical to the kernel on the same values laid out token-major."""
    gen = torch.Generator().manual_seed(start + count)
    stop = start + count
    keys = random_bf16(KV_HEADS, stop, DIM, gen=gen)
    values = random_bf16(KV_HEADS, stop, DIM, gen=gen)
    cache = random_bf16(LAYERS, 2, KV_HEADS, kv_layout.round_up(stop + 20), DIM, gen=gen)
    tiled_kernels.write_tiled(cache, 1, keys.transpose(0, 1), values.transpose(0, 1), 0)
    q = random_bf16(count, HEADS, DIM, gen=gen)
    hi = kv_layout.round_up(stop)
    got = tiled_kernels.prefill_attention(q, cache[1, 0, :, :hi], cache[1, 1, :, :hi], start,
                                          0.125, tiled=True)
    assert torch.equal(got, tiled_kernels.prefill_attention(q, keys, values, start, 0.125))


def test_engine_uses_tiled_caches_only_where_they_apply(compiled: Kernels):
    cpu = torch.device("cpu")
    assert compiled.tiled_kv_applies(torch.bfloat16, 64, 16, cpu) == (
        compiled.path in TILED_PATHS)
    assert not compiled.tiled_kv_applies(torch.float32, 64, 16, cpu)
    assert not compiled.tiled_kv_applies(torch.float8_e5m2, 64, 16, cpu)
    assert not compiled.tiled_kv_applies(torch.bfloat16, 128, 16, cpu)
    assert not compiled.tiled_kv_applies(torch.bfloat16, 64, 8, cpu)
