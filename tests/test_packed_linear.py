"""Linear layers prepared for each kernel path (alignedserve.kernels.linear): F.linear's
result up to one bf16 rounding at every batch size, on every compiled path this CPU has."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from alignedserve.kernels import Kernels
from alignedserve.kernels.linear import (PACKED_MAX_ROWS, PackedLinear, onednn_packing_supported,
                                         pack_linears)
from tests.model_utils import our_logits, ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(
    not onednn_packing_supported(torch.empty(1, dtype=torch.bfloat16)),
    reason="this torch has no oneDNN bf16 support")


@pytest.mark.parametrize("rows", [1, 37, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 1100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_plain_linear(compiled: Kernels, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    got = PackedLinear(weight, bias, compiled)(x).float()
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # Both accumulate in fp32 and round once to bf16; allow that rounding.
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_pack_linears_keeps_the_model_output(compiled: Kernels) -> None:
    model = ours_from_hf(tiny_hf_model(tie_word_embeddings=True)).bfloat16()
    plain = copy.deepcopy(model)
    assert pack_linears(model, compiled) == len([m for m in plain.modules()
                                                 if isinstance(m, torch.nn.Linear)])
    assert isinstance(model.lm_head, PackedLinear)  # tied head gets a packed view too
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(our_logits(model, ids), our_logits(plain, ids),
                                   rtol=0.05, atol=0.05)


def test_float32_models_are_not_packed(compiled: Kernels) -> None:
    model = ours_from_hf(tiny_hf_model())
    assert pack_linears(model, compiled) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_reference_path_packs_nothing(reference_kernels: Kernels) -> None:
    model = ours_from_hf(tiny_hf_model()).bfloat16()
    assert pack_linears(model, reference_kernels) == 0
