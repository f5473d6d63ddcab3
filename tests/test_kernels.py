"""Decode attention on every compiled kernel path vs the PyTorch reference.

``compiled`` (tests/conftest.py) runs each test on every path this CPU supports (amx,
avx512_bf16, avx512, avx2) and skips, saying why, the ones it lacks. The first run on a machine
builds each path's extension (cached under $ALIGNEDSERVE_CACHE); a failed build fails
these tests rather than skipping them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from alignedserve.kernels import Kernels, build, dispatch, reference

decode_attention_reference = reference.decode_attention

LENGTHS = (1, 2, 17, 300, 1000)
FP8 = torch.float8_e5m2
CACHE_DTYPES = [torch.float32, torch.bfloat16, FP8]
LAYERS, LAYER = 3, 1  # attend to a middle layer so writes to the wrong layer would show


@dataclass
class Case:
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    caches: list[torch.Tensor]
    positions: torch.Tensor
    scale: float

    def fresh_caches(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.caches]


def make_case(dtype: torch.dtype, lengths: tuple[int, ...], heads: int, kv_heads: int,
              dim: int, q_dtype: torch.dtype | None = None, seed: int = 0) -> Case:
    """Rows of the given KV lengths; the new token goes at position length-1.

    Capacities vary per row; the longest row is full (position == capacity - 1), so a read
    or write past a row's end would leave the tensor. Unused cache slots hold NaN: reading one
    would poison the output.
    """
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for i, n in enumerate(lengths):
        cap = n if n == max(lengths) else n + 1 + 7 * i
        cache = torch.randn(LAYERS, 2, kv_heads, cap, dim, generator=gen).to(dtype)
        cache[:, :, :, n - 1:] = float("nan")
        caches.append(cache)
    rows = len(lengths)
    q = torch.randn(rows, heads, dim, generator=gen) * 2  # sharper softmax than unit scale
    k_new = torch.randn(rows, kv_heads, dim, generator=gen)
    v_new = torch.randn(rows, kv_heads, dim, generator=gen)
    q_dtype = q_dtype or (torch.bfloat16 if dtype == FP8 else dtype)  # fp8 is a cache type only
    return Case(q.to(q_dtype), k_new.to(dtype), v_new.to(dtype), caches,
                torch.tensor([n - 1 for n in lengths], dtype=torch.int64), dim ** -0.5)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: summation-order noise only; bf16 outputs (also over fp8 caches, whose values both
    sides read exactly): one rounding step (2^-8 relative)."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


def run_both(kernels: Kernels, case: Case) -> tuple[torch.Tensor, list[torch.Tensor],
                                                    torch.Tensor, list[torch.Tensor]]:
    """(kernel out, kernel caches, reference out, reference caches) on separate cache copies."""
    k_caches, r_caches = case.fresh_caches(), case.fresh_caches()
    args = (case.k_new, case.v_new)
    out = kernels.ext.decode_attention(case.q, *args, k_caches, case.positions, LAYER, case.scale)
    ref = decode_attention_reference(case.q, *args, r_caches, case.positions, LAYER, case.scale)
    return out, k_caches, ref, r_caches


def expected_caches(case: Case) -> list[torch.Tensor]:
    """The input caches with exactly the new K/V rows written."""
    caches = case.fresh_caches()
    for b, pos in enumerate(case.positions.tolist()):
        caches[b][LAYER, 0, :, pos] = case.k_new[b].to(caches[b].dtype)
        caches[b][LAYER, 1, :, pos] = case.v_new[b].to(caches[b].dtype)
    return caches


def assert_same_caches(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        if g.dtype == FP8:  # bit patterns (NaN slots included) must match
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        else:
            assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))  # NaN slots must stay NaN


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("group,dim", [(1, 64), (3, 64), (1, 128), (3, 128), (7, 64), (8, 128)])
def test_kernel_matches_reference(compiled: Kernels, dtype: torch.dtype, group: int,
                                  dim: int) -> None:
    case = make_case(dtype, LENGTHS, heads=2 * group, kv_heads=2, dim=dim)
    out, k_caches, ref, r_caches = run_both(compiled, case)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert_same_caches(k_caches, expected_caches(case))
    assert_same_caches(r_caches, expected_caches(case))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_long_rows_split_into_spans(compiled: Kernels, dtype: torch.dtype) -> None:
    """A few long rows are cut into spans merged afterwards; thread count must not matter."""
    case = make_case(dtype, (5000, 3, 2100), heads=8, kv_heads=2, dim=64, seed=1)
    out, k_caches, ref, _ = run_both(compiled, case)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert_same_caches(k_caches, expected_caches(case))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single, _, _, _ = run_both(compiled, case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, out)  # where a row is cut does not depend on the threads


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_a_rows_output_does_not_depend_on_its_batch(compiled: Kernels, dtype: torch.dtype):
    """Batch invariance: each row alone gives the bits it gets among 40 mixed-length rows."""
    lengths = tuple(1 + (i * 617) % 5000 for i in range(40))
    case = make_case(dtype, lengths, heads=9, kv_heads=3, dim=64, seed=3)
    batch = compiled.ext.decode_attention(case.q, case.k_new, case.v_new, case.fresh_caches(),
                                          case.positions, LAYER, case.scale)
    for b in (0, 7, 13, 39):
        alone = compiled.ext.decode_attention(
            case.q[b:b + 1], case.k_new[b:b + 1], case.v_new[b:b + 1], [case.caches[b].clone()],
            case.positions[b:b + 1], LAYER, case.scale)
        assert torch.equal(alone[0], batch[b]), f"row {b} ({lengths[b]} tokens)"


@pytest.mark.parametrize("dim", [48, 96, 256])
def test_uncommon_head_dims(compiled: Kernels, dim: int) -> None:
    """Head dims without a specialised build (runtime vector count, 16- and 32-multiples)."""
    for dtype in CACHE_DTYPES:
        case = make_case(dtype, (5, 40, 129), heads=4, kv_heads=1, dim=dim, seed=dim)
        out, k_caches, ref, _ = run_both(compiled, case)
        torch.testing.assert_close(out, ref, **tolerance(dtype))
        assert_same_caches(k_caches, expected_caches(case))


def test_fp32_query_on_bf16_cache(compiled: Kernels) -> None:
    """q stays fp32 (output fp32), k_new/v_new arrive fp32 and are rounded into the cache."""
    case = make_case(torch.bfloat16, LENGTHS, heads=6, kv_heads=2, dim=64, q_dtype=torch.float32)
    case.k_new, case.v_new = case.k_new.float() + 1e-3, case.v_new.float() - 1e-3
    out, k_caches, ref, _ = run_both(compiled, case)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert_same_caches(k_caches, expected_caches(case))


def test_rows_of_a_cohort_slab(compiled: Kernels) -> None:
    """caches[b] may be a strided view slab[:, :, b] of [layers, 2, rows, kv_heads, cap, dim]."""
    lengths = (7, 64, 33)
    slab = torch.randn(LAYERS, 2, len(lengths), 2, 80, 64)
    case = make_case(torch.float32, lengths, heads=4, kv_heads=2, dim=64)
    case.caches = [slab[:, :, b] for b in range(len(lengths))]
    out, k_caches, ref, _ = run_both(compiled, case)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    assert_same_caches(k_caches, expected_caches(case))


@pytest.mark.parametrize("dtype,tiled", [(torch.bfloat16, False), (torch.float32, False),
                                         (FP8, False), (torch.bfloat16, True)])
def test_row_views_of_a_fused_qkv(compiled: Kernels, dtype: torch.dtype, tiled: bool) -> None:
    """q, k_new, v_new as row views of one [B, (H + 2 KVH) * D] projection (how the model
    passes them; read in place) give bit-identical outputs and caches to contiguous copies,
    including rows long enough to be split into spans."""
    heads, kv_heads, dim = 9, 3, 64
    lengths = (1, 17, 300, 2100)
    case = make_case(torch.bfloat16 if tiled else dtype, lengths, heads, kv_heads, dim)
    if tiled:  # a zeroed cache in the tile layout, room for every row's new token
        case.caches = [torch.zeros(LAYERS, 2, kv_heads, (n + 15) // 16 * 16, dim,
                                   dtype=torch.bfloat16) for n in lengths]
    rows = len(lengths)
    # (over an fp8 cache the projection is bf16; the kernel rounds the new K/V into the cache)
    fused = torch.cat([case.q.reshape(rows, -1), case.k_new.to(case.q.dtype).reshape(rows, -1),
                       case.v_new.to(case.q.dtype).reshape(rows, -1)], dim=1)
    q, k, v = fused.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=1)
    views = (q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim))
    assert not views[0].is_contiguous()
    outs = []
    for args in (views, tuple(t.contiguous() for t in views)):
        caches = case.fresh_caches()
        out = compiled.ext.decode_attention(*args, caches, case.positions, LAYER, case.scale,
                                            tiled)
        outs.append((out, caches))
    assert outs[0][0].dtype == case.q.dtype
    assert torch.equal(outs[0][0], outs[1][0])
    assert_same_caches(outs[0][1], outs[1][1])


def test_unsupported_head_dim_falls_back(compiled: Kernels,
                                         caplog: pytest.LogCaptureFixture) -> None:
    dispatch._warn_once.cache_clear()  # the reason is logged once per process
    case = make_case(torch.float32, (3, 20), heads=2, kv_heads=1, dim=40)
    with caplog.at_level("WARNING", logger=dispatch.__name__):
        out = compiled.decode_attention(case.q, case.k_new, case.v_new, case.fresh_caches(),
                                        case.positions, LAYER, case.scale)
    ref = decode_attention_reference(case.q, case.k_new, case.v_new, case.fresh_caches(),
                                     case.positions, LAYER, case.scale)
    assert torch.equal(out, ref)
    assert any("head_dim 40" in r.getMessage() for r in caplog.records)


@pytest.fixture(params=["compiled", "reference"])
def any_kernels(request: pytest.FixtureRequest, compiled: Kernels,
                reference_kernels: Kernels) -> Kernels:
    return compiled if request.param == "compiled" else reference_kernels


def test_bad_inputs_raise_value_error(any_kernels: Kernels) -> None:
    case = make_case(torch.float32, (4, 9), heads=2, kv_heads=1, dim=64)
    past_end = torch.tensor([4, 9])  # row 1's capacity is 9
    caches = case.fresh_caches()
    with pytest.raises(ValueError, match="capacity"):
        any_kernels.decode_attention(case.q, case.k_new, case.v_new, caches, past_end, LAYER,
                                     case.scale)
    # Rejected before any write: row 0 (valid) did not get its new token either.
    assert all(torch.equal(c.nan_to_num(7.0), f.nan_to_num(7.0))  # unwritten slots hold NaN
               for c, f in zip(caches, case.fresh_caches()))
    with pytest.raises(ValueError, match="one cache"):
        any_kernels.decode_attention(case.q, case.k_new, case.v_new, case.caches[:1],
                                     case.positions, LAYER, case.scale)


def test_empty_batch(compiled: Kernels) -> None:
    q = torch.empty(0, 4, 64)
    kv = torch.empty(0, 2, 64)
    out = compiled.decode_attention(q, kv, kv, [], torch.empty(0, dtype=torch.int64), 0, 0.125)
    assert out.shape == (0, 4, 64)


def test_the_interpreters_own_ninja_goes_first_on_path(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path) -> None:
    """Another ninja earlier on PATH must not build: two ninja versions rebuild each other's
    objects (their .ninja_log command hashes differ), ~30 s per switch."""
    import shutil
    import sys
    from pathlib import Path

    own = Path(sys.executable).parent / "ninja"
    if not own.exists():
        pytest.skip("no ninja installed next to this interpreter")
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin")
    build._ensure_ninja_on_path()
    assert shutil.which("ninja") == str(own)
