"""Fused bf16 elementwise kernels (kernels/csrc/fused.cpp) on every compiled path vs their
PyTorch references (alignedserve.kernels.reference, the model's original code).

On torch's x86 builds the kernels are bit-identical to them; the asserts allow what fused.cpp
documents for another ATen: rms_norm 1 bf16 ulp (sum-of-squares order), silu_mul 1 ulp on at
most 1e-4 of the elements (exp on ATen's scalar tails). ``compiled`` runs each test on every
path this CPU supports (tests/conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from alignedserve.kernels import Kernels, reference

BF16 = torch.bfloat16
TOKENS = (1, 7, 64, 1031)  # 1031: an odd split over threads and grains
HIDDEN, EPS = 576, 1e-5
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
INTERMEDIATE = 1536
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def rand(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 units in the last place (bit patterns mapped to a monotone integer)."""
    def ordinal(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)
    return (ordinal(a) - ordinal(b)).abs()


def rope(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] as the model slices them: halves of a [T, D] table (row stride D)."""
    table = rand(tokens, HEAD_DIM, seed=seed)
    cos, sin = table.chunk(2, dim=-1)
    return cos, sin


# --- kernel path == reference ---------------------------------------------------------------

@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", (HIDDEN, 100, 4100))  # 4100: deep sum cascade + scalar tail
def test_rms_norm_matches_reference(compiled, tokens, hidden):
    x, w = rand(tokens, hidden, seed=1, scale=3.0), rand(hidden, seed=2)
    out = compiled.ext.rms_norm(x, w, EPS)
    assert ulps(out, reference.rms_norm(x, w, EPS)).max() <= 1
    assert torch.equal(compiled.rms_norm(x, w, EPS), out)


@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_updates_residual_in_place(compiled, tokens):
    x, w = rand(tokens, HIDDEN, seed=3), rand(HIDDEN, seed=4)
    residual = rand(tokens, HIDDEN, seed=5, scale=4.0)
    before = residual.clone()
    want_out, want_residual = reference.add_rms_norm(x, before, w, EPS)
    out, returned = compiled.add_rms_norm(x, residual, w, EPS)
    assert returned is residual
    assert torch.equal(residual, want_residual)  # the bf16 sum is exact
    assert ulps(out, want_out).max() <= 1


@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_qkv_in_place_matches_reference(compiled, tokens):
    qkv = rand(tokens, QKV, seed=6, scale=2.0)
    cos, sin = rope(tokens, seed=7)
    original = qkv.clone()
    want = reference.rotary_qkv(original, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
    got = compiled.rotary_qkv(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for view in got:  # views of qkv, not copies
        assert view.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    v_start = (HEADS + KV_HEADS) * HEAD_DIM
    assert torch.equal(qkv[:, v_start:], original[:, v_start:])  # v untouched


def test_rotary_qkv_accepts_model_shaped_cos_sin(compiled):
    qkv = rand(5, QKV, seed=8)
    cos, sin = rope(5, seed=9)
    want = reference.rotary_qkv(qkv.clone(), cos, sin, HEADS, KV_HEADS, HEAD_DIM)
    got = compiled.rotary_qkv(qkv, cos[:, None], sin[:, None], HEADS, KV_HEADS, HEAD_DIM)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", (INTERMEDIATE, 1000))  # 1000: masked row tail
def test_silu_mul_matches_reference(compiled, tokens, inter):
    gate_up = rand(tokens, 2 * inter, seed=10, scale=4.0)
    diff = ulps(compiled.ext.silu_mul(gate_up), reference.silu_mul(gate_up))
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-4


def test_silu_mul_every_bf16_gate(compiled):
    """Every finite bf16 gate value (NaN lanes compared as NaN), up = 1 and random."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(BF16)[None]
    for up in (torch.ones_like(gate), rand(*gate.shape, seed=11)):
        gate_up = torch.cat((gate, up), dim=-1)
        got, want = compiled.ext.silu_mul(gate_up), reference.silu_mul(gate_up)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        diff = ulps(got[~nan], want[~nan])
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-4


def test_non_finite_values_propagate(compiled):
    """NaN and inf land where the reference puts them (NaN bit patterns may differ)."""
    x, w = rand(4, HIDDEN, seed=31), rand(HIDDEN, seed=32)
    x[1, 7], x[2, 9] = float("nan"), float("inf")
    qkv = rand(4, QKV, seed=33)
    qkv[0, 3], qkv[3, HEADS * HEAD_DIM + 40] = float("nan"), float("-inf")
    cos, sin = rope(4, seed=34)
    got = [compiled.ext.rms_norm(x, w, EPS),
           *compiled.rotary_qkv(qkv.clone(), cos, sin, HEADS, KV_HEADS, HEAD_DIM)]
    want = [reference.rms_norm(x, w, EPS),
            *reference.rotary_qkv(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM)]
    for g, r in zip(got, want):
        assert torch.equal(g.isnan(), r.isnan())
        finite = ~r.isnan()
        assert ulps(g[finite], r[finite]).max() <= 1


# --- layouts ----------------------------------------------------------------------------------

def test_strided_rows_take_the_kernel(compiled):
    """Row-strided views (a column slice of a wider tensor) are handled without copies."""
    wide = rand(33, 2 * HIDDEN, seed=12)
    x, w = wide[:, :HIDDEN], rand(HIDDEN, seed=13)
    assert ulps(compiled.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS)).max() <= 1
    wide_res = rand(33, HIDDEN + 8, seed=14)
    residual = wide_res[:, 8:]
    want_residual = residual + x
    _, returned = compiled.add_rms_norm(x, residual, w, EPS)
    assert returned is residual and torch.equal(wide_res[:, 8:], want_residual)
    gate_up = rand(33, 2 * INTERMEDIATE + 64, seed=15)[:, 64:]
    assert ulps(compiled.silu_mul(gate_up), reference.silu_mul(gate_up)).max() <= 1


def test_unsupported_layouts_fall_back(compiled):
    """Non-unit last-dim strides and overlapping in-place rows take the reference."""
    x = rand(HIDDEN, 16, seed=16).t()  # [16, H], column stride 16
    w = rand(HIDDEN, seed=17)
    assert torch.equal(compiled.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS))
    residual = rand(1, HIDDEN, seed=18).expand(16, HIDDEN)  # every row aliases one
    out, new_residual = compiled.add_rms_norm(x, residual, w, EPS)
    want_out, want_residual = reference.add_rms_norm(x, residual, w, EPS)
    assert new_residual is not residual and torch.equal(new_residual, want_residual)
    assert torch.equal(out, want_out)
    gate_up = rand(2 * INTERMEDIATE, 4, seed=19).t()
    assert torch.equal(compiled.silu_mul(gate_up), reference.silu_mul(gate_up))


def test_kernel_rejects_bad_shapes(compiled):
    x = rand(4, HIDDEN, seed=20)
    with pytest.raises(ValueError, match="weight"):
        compiled.ext.rms_norm(x, rand(HIDDEN - 1, seed=21), EPS)
    with pytest.raises(ValueError, match="bfloat16"):
        compiled.ext.silu_mul(x.float())
    with pytest.raises(ValueError, match="qkv"):
        compiled.ext.rotary_qkv_(x, *rope(4, seed=22), HEADS, KV_HEADS, HEAD_DIM)


# --- reference paths --------------------------------------------------------------------------

def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Fresh, seeded inputs of every op: x, w, residual, qkv, cos, sin, gate_up."""
    x, w = rand(9, HIDDEN, seed=23, dtype=dtype), rand(HIDDEN, seed=24, dtype=dtype)
    residual = rand(9, HIDDEN, seed=25, dtype=dtype)
    qkv = rand(9, QKV, seed=26, dtype=dtype)
    cos, sin = (t.to(dtype) for t in rope(9, seed=27))
    return x, w, residual, qkv, cos, sin, rand(9, 2 * INTERMEDIATE, seed=28, dtype=dtype)


def run_all(kernels: Kernels, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every op through ``kernels`` on fresh inputs of `dtype`, plus those inputs."""
    x, w, residual, qkv, cos, sin, gate_up = _inputs(dtype)
    return [kernels.rms_norm(x, w, EPS), *kernels.add_rms_norm(x, residual, w, EPS),
            *kernels.rotary_qkv(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM),
            kernels.silu_mul(gate_up), residual, qkv]


def run_references(dtype: torch.dtype) -> list[torch.Tensor]:
    x, w, residual, qkv, cos, sin, gate_up = _inputs(dtype)
    return [reference.rms_norm(x, w, EPS), *reference.add_rms_norm(x, residual, w, EPS),
            *reference.rotary_qkv(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM),
            reference.silu_mul(gate_up), residual, qkv]


class _OnlyDeclines:
    """Stands in for a path's build: its ``try_*`` entry points (which decide whether a kernel
    takes the inputs) run and must decline; running any kernel fails the test."""

    def __init__(self, build) -> None:
        self._build = build

    def __getattr__(self, name: str):
        if not name.startswith("try_"):
            raise AssertionError(f"a reference route used the compiled {name}")

        def declines(*args, **kwargs):
            result = getattr(self._build, name)(*args, **kwargs)
            assert result is None, f"the compiled {name} took inputs meant for the reference"
            return None
        return declines


def without_build(kernels: Kernels) -> Kernels:
    """``kernels`` whose compiled ops all fail: what still works took the reference."""
    untouchable = copy.copy(kernels)
    untouchable.ext = _OnlyDeclines(kernels.ext)
    return untouchable


def test_float32_always_takes_the_reference(compiled):
    untouchable = without_build(compiled)
    for got, want in zip(run_all(untouchable, torch.float32), run_references(torch.float32)):
        assert torch.equal(got, want)  # inputs (the last two) untouched too


def test_reference_path_is_the_reference(reference_kernels):
    for got, want in zip(run_all(reference_kernels, BF16), run_references(BF16)):
        assert torch.equal(got, want)


def test_argmax_takes_the_reference_where_the_kernel_does_not_apply(compiled):
    untouchable = without_build(compiled)
    logits = rand(5, 300, seed=40)
    for x in (logits.float(), logits.t().contiguous().t()):  # float32; columns strided
        assert untouchable.argmax_rows(x) == x.max(dim=-1).indices.tolist()
    assert compiled.argmax_rows(logits) == logits.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("vocab", [1, 15, 16, 63, 64, 65, 200, 49152])
def test_argmax_is_the_first_maximum_under_many_ties(compiled, vocab):
    """Rows of a few distinct values (ties everywhere, at every lane and vector position the
    kernel's chains see), -inf rows and rows whose maximum is their last element: the
    compiled argmax is torch's first maximum."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 4, (12, vocab), generator=gen).to(torch.bfloat16)
    logits[0] = float("-inf")
    logits[1, -1] = 9.0
    logits[2, : vocab // 2] = -1.0
    assert compiled.argmax_rows(logits) == logits.max(dim=-1).indices.tolist()


def test_kernel_errors_name_the_misfit(compiled):
    rows = rand(4, HIDDEN, seed=41)
    with pytest.raises(ValueError, match="x must be 2-d"):
        compiled.ext.rms_norm(rows[0], rand(HIDDEN, seed=42), EPS)
    with pytest.raises(ValueError, match="contiguous last dim"):
        compiled.ext.silu_mul(rand(HIDDEN, 4, seed=43).t())
    overlapping = rand(HIDDEN + 3, seed=44).as_strided((4, HIDDEN), (1, 1))
    with pytest.raises(ValueError, match="residual has overlapping rows"):
        compiled.ext.add_rms_norm(rows, overlapping, rand(HIDDEN, seed=45), EPS)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        compiled.ext.rms_norm(rows, rand(2 * HIDDEN, seed=46)[::2], EPS)


def test_autograd_takes_the_reference(compiled):
    untouchable = without_build(compiled)
    x = rand(3, HIDDEN, seed=29).requires_grad_()
    out = untouchable.rms_norm(x, rand(HIDDEN, seed=30), EPS)
    out.float().sum().backward()
    assert x.grad is not None
