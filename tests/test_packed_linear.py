"""Prepacked bf16 linear layers: same results as F.linear, on both of their paths."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from alignedserve.model.packed_linear import PACKED_MAX_ROWS, PackedLinear, pack_linears
from alignedserve.model.packed_linear import packing_supported
from tests.model_utils import our_logits, ours_from_hf, tiny_hf_model

needs_packing = pytest.mark.skipif(
    not packing_supported(torch.empty(1, dtype=torch.bfloat16)),
    reason="this torch has no oneDNN bf16 prepacking")


@needs_packing
@pytest.mark.parametrize("rows", [1, 37, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("amx_max_rows", [0, 512])  # 0: oneDNN's prepacked path only
def test_matches_plain_linear(rows: int, with_bias: bool, amx_max_rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    got = PackedLinear(weight, bias, amx_max_rows=amx_max_rows)(x).float()
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # Both accumulate in fp32 and round once to bf16; allow that rounding.
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@needs_packing
def test_pack_linears_keeps_the_model_output() -> None:
    model = ours_from_hf(tiny_hf_model(tie_word_embeddings=True)).bfloat16()
    plain = copy.deepcopy(model)
    assert pack_linears(model) == len([m for m in plain.modules()
                                       if isinstance(m, torch.nn.Linear)])
    assert isinstance(model.lm_head, PackedLinear)  # tied head gets a packed view too
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(our_logits(model, ids), our_logits(plain, ids),
                                   rtol=0.05, atol=0.05)


def test_float32_models_are_not_packed() -> None:
    model = ours_from_hf(tiny_hf_model())
    assert pack_linears(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
