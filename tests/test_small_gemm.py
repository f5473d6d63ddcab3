"""The AMX small-batch linear (kernels/csrc/small_gemm.cpp): F.linear's result up to one
bf16 rounding, independent of the batch a row is in, clear errors for bad inputs. Runs on the
amx path only: on emulated tiles where the CPU lacks AMX (conftest), skipped (saying why) where
it cannot run that either."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alignedserve.kernels import kernels_for_path
from alignedserve.kernels.linear import (AMX_MAX_ROWS, AMX_MAX_ROWS_LM_HEAD, PackedLinear,
                                         pack_linears)
from tests.conftest import path_skip_reason
from tests.model_utils import ours_from_hf, tiny_hf_model

_WHY_NOT = path_skip_reason("amx")
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")
amx = None if _WHY_NOT else kernels_for_path("amx")
kernels = None if amx is None else amx.ext


def _case(rows: int, out_features: int, in_features: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    return x, weight, bias


def _within_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums in a different order, then one rounding to bf16 (relative 2^-8).
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 128, 300])
@pytest.mark.parametrize("out_features", [48, 96])  # 3 column tiles: an odd last pair
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_linear(rows: int, out_features: int, with_bias: bool) -> None:
    x, weight, bias = _case(rows, out_features, 96, seed=rows)
    b = bias if with_bias else None
    got = kernels.amx_linear(x, kernels.pack_weight(weight), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    _within_bf16_rounding(got, want)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    x, weight, _ = _case(70, 64, 128)
    packed = kernels.pack_weight(weight)
    whole = kernels.amx_linear(x, packed, None)
    for lo, hi in [(0, 1), (3, 20), (16, 48), (69, 70)]:
        assert torch.equal(kernels.amx_linear(x[lo:hi].contiguous(), packed, None), whole[lo:hi])


def test_rows_with_a_stride_wider_than_the_features() -> None:
    wide, weight, bias = _case(33, 32, 160)
    x = wide[:, 32:128]  # stride(0) == 160, stride(1) == 1
    got = kernels.amx_linear(x, kernels.pack_weight(weight[:, 32:128].contiguous()), bias)
    want = F.linear(x.float(), weight[:, 32:128].float(), bias.float())
    _within_bf16_rounding(got, want)


def test_a_single_row_with_strided_features() -> None:
    """One row may have any element stride (a column of a wider tensor): it is copied, then
    padded to a whole tile, and gives the same result as its contiguous copy."""
    _, weight, bias = _case(1, 32, 64)
    packed = kernels.pack_weight(weight)
    for _ in range(5):  # fresh tensors each time: a read of freed memory would show
        row = torch.randn(64, 4, dtype=torch.bfloat16).t()[1:2]
        assert row.stride(1) != 1
        assert torch.equal(kernels.amx_linear(row, packed, bias),
                           kernels.amx_linear(row.contiguous(), packed, bias))


def test_zero_rows() -> None:
    x, weight, _ = _case(0, 16, 32)
    assert kernels.amx_linear(x, kernels.pack_weight(weight), None).shape == (0, 16)


def test_bad_inputs_raise_value_errors() -> None:
    x, weight, _ = _case(4, 32, 64)
    packed = kernels.pack_weight(weight)
    with pytest.raises(ValueError, match="features"):
        kernels.amx_linear(x[:, :32].contiguous(), packed, None)
    with pytest.raises(ValueError, match="bf16"):
        kernels.amx_linear(x.float(), packed, None)
    with pytest.raises(ValueError, match="bias"):
        kernels.amx_linear(x, packed, torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="pack_weight"):
        kernels.amx_linear(x, weight, None)
    with pytest.raises(ValueError, match="% 16"):
        kernels.pack_weight(weight[:24])
    with pytest.raises(ValueError, match="% 32"):
        kernels.pack_weight(weight[:, :48])


def test_packed_linear_routes_small_batches_to_the_kernel(monkeypatch) -> None:
    x, weight, bias = _case(8, 64, 64)
    layer = PackedLinear(weight, bias, amx)
    assert layer.tiles is not None
    calls = []
    monkeypatch.setattr(layer, "_kernel", lambda *a: (
        calls.append(a[0].shape[0]) or kernels.amx_linear(*a)))
    layer(x)
    layer(torch.zeros(layer.kernel_max_rows + 1, 64, dtype=torch.bfloat16))
    assert calls == [8]


def test_odd_shapes_keep_the_onednn_path() -> None:
    _, weight, _ = _case(1, 40, 64)  # 40 output features: not whole 16-column tiles
    assert PackedLinear(weight, None, amx).tiles is None


def test_the_tied_lm_head_stops_earlier() -> None:
    model = ours_from_hf(tiny_hf_model(tie_word_embeddings=True)).bfloat16()
    pack_linears(model, amx)
    assert model.lm_head.kernel_max_rows == AMX_MAX_ROWS_LM_HEAD


def test_batch_invariant_kernels_take_every_row_count() -> None:
    """``batch_invariant``: the AMX linear takes steps past AMX_MAX_ROWS too (the LM head's
    included), so a row's bits are the same in a step of any size."""
    invariant = kernels_for_path("amx", batch_invariant=True)
    x, weight, bias = _case(AMX_MAX_ROWS + 100, 64, 64, seed=3)
    layer = PackedLinear(weight, bias, invariant)
    assert layer.kernel_max_rows > AMX_MAX_ROWS + 100 and layer.weight is not None
    assert layer.release_weight()  # its own kernel takes every call: the packing suffices
    whole = layer(x)
    assert torch.equal(whole[-5:], layer(x[-5:].contiguous()))
    model = ours_from_hf(tiny_hf_model(tie_word_embeddings=True)).bfloat16()
    pack_linears(model, invariant)
    assert model.lm_head.kernel_max_rows > AMX_MAX_ROWS
