"""Linear layers prepared for each kernel path (alignedserve.kernels.linear): F.linear's
result up to one bf16 rounding at every batch size, on every compiled path this CPU has."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from alignedserve.kernels import Kernels, kernels_for_path
from alignedserve.kernels.linear import (AMX_MAX_ROWS, AMX_MAX_ROWS_LM_HEAD, PACKED_MAX_ROWS,
                                         PackedLinear, deinterleave_gate_up,
                                         interleave_gate_up, pack_linears, swap_rotary_quarters)
from tests.conftest import kernel_path_params
from tests.model_utils import our_logits, ours_from_hf, tiny_hf_model

def epilogues_apply(kernels: Kernels, out_features: int, in_features: int, rows: int,
                    lm_head: bool = False) -> bool:
    """Whether the path's own kernel takes this layer at this batch size with its epilogues:
    the AVX-512 one always; the AMX one where its tiles take the shape and up to the rows
    where it hands over to oneDNN."""
    if kernels.avx512:
        return True
    if kernels.amx:
        return (out_features % 16 == 0 and in_features % 32 == 0
                and rows <= (AMX_MAX_ROWS_LM_HEAD if lm_head else AMX_MAX_ROWS))
    return False


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


def test_pack_linears_holds_each_weight_once(compiled: Kernels) -> None:
    """Where the path's own kernel takes every batch size, the packing is the only copy of a
    layer's weight, and N-d or strided inputs still work. (The packed model's output and its
    tied head: test_pack_linears_keeps_the_model_output.)"""
    model = ours_from_hf(tiny_hf_model(tie_word_embeddings=True)).bfloat16()
    plain = copy.deepcopy(model)
    pack_linears(model, compiled)
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, PackedLinear) and name != "lm_head"}
    takes_all = compiled.path in ("avx512_bf16", "avx512", "avx2")
    assert all((m.weight is None) == takes_all for m in layers.values())
    for name, layer in layers.items():
        weight = plain.get_submodule(name).weight
        x = torch.randn(2, 3, 2 * weight.shape[1], generator=torch.Generator().manual_seed(1))
        x = x.bfloat16()[..., ::2]  # 3-d and strided
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), weight.float()),
                                   rtol=1e-2, atol=1e-2)


def test_float32_models_are_not_packed(compiled: Kernels) -> None:
    model = ours_from_hf(tiny_hf_model())
    assert pack_linears(model, compiled) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_reference_path_packs_nothing(reference_kernels: Kernels) -> None:
    model = ours_from_hf(tiny_hf_model()).bfloat16()
    assert pack_linears(model, reference_kernels) == 0


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (576, 1536), (40, 34)])
def test_a_rows_result_does_not_depend_on_its_batch(compiled: Kernels, out_features: int,
                                                    in_features: int) -> None:
    """Batch invariance: up to the path's own kernel's row limit, a row's bits are the same
    alone, at any position of any batch, and on one thread."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    layer = PackedLinear(weight, torch.randn(out_features, generator=gen).bfloat16(), compiled)
    if layer.tiles is None:
        pytest.skip(f"the {compiled.path} path runs this shape on oneDNN, whose rounding "
                    "depends on the batch")
    rows = min(layer.kernel_max_rows, 700)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    whole = layer(x)
    for lo, hi in [(0, 1), (3, 20), (16, 48), (rows - 1, rows), (5, rows)]:
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", ["avx512", "avx2"])
def test_the_path_kernels_reject_bad_inputs(compiled: Kernels, kernel: str) -> None:
    if not getattr(compiled, kernel):
        pytest.skip(f"the {compiled.path} path does not use the {kernel} linear")
    ext = compiled.ext
    pack, linear = getattr(ext, f"pack_weight_{kernel}"), getattr(ext, f"linear_{kernel}")
    weight = torch.randn(32, 64).bfloat16()
    packed = pack(weight)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError):
        linear(x[:, :32].contiguous(), packed, None)  # K does not match
    with pytest.raises(ValueError):
        linear(x.float(), packed, None)
    with pytest.raises(ValueError):
        linear(x, weight, None)  # not a packed weight
    with pytest.raises(ValueError):
        linear(x, packed, torch.zeros(31))
    with pytest.raises(ValueError):
        pack(weight.float())
    assert linear(x[:0], packed, None).shape == (0, 32)


def test_the_epilogues_reject_bad_arguments(compiled: Kernels) -> None:
    """The AVX-512 and AMX linears check their epilogue arguments alike (checks.h)."""
    if not (compiled.avx512 or compiled.amx):
        pytest.skip(f"the {compiled.path} path's linear has no epilogues")
    ext = compiled.ext
    linear, pack = ((ext.amx_linear, ext.pack_weight) if compiled.amx
                    else (ext.linear_avx512, ext.pack_weight_avx512))
    x = torch.randn(4, 64).bfloat16()
    table = torch.randn(4, 64).bfloat16()
    cos, sin = table[:, :32], table[:, 32:]
    with pytest.raises(ValueError, match="swiglu epilogue needs"):
        linear(x, pack(torch.randn(48, 64).bfloat16()), None, True)  # N % 32 != 0
    packed = pack(torch.randn(192, 64).bfloat16())
    with pytest.raises(ValueError, match="together"):
        linear(x, packed, None, False, cos, None, 128)
    with pytest.raises(ValueError, match="rotary_cols must be"):
        linear(x, packed, None, False, cos, sin, 96)
    with pytest.raises(ValueError, match="rotary_cols must be"):
        linear(x, packed, None, True, cos, sin, 128)  # not with swiglu
    with pytest.raises(ValueError, match="cos / sin must be"):
        linear(x, packed, None, False, cos[:2], sin[:2], 128)
    assert linear(x, packed, None, False, cos, sin, 128).shape == (4, 192)


def pair_dot_sequence(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """linear_avx512's arithmetic written out in torch: each output starts at fp32 +0 and, per
    depth pair p in order, adds x[2p+1] w[2p+1] and then x[2p] w[2p] (the SDM's vdpbf16ps
    order; a product of two bf16 is exact in fp32, so each step rounds once, as an FMA does),
    then the bias in fp32, rounded once to bf16."""
    xf, wf = x.float(), weight.float()
    if xf.shape[1] % 2:
        xf, wf = F.pad(xf, (0, 1)), F.pad(wf, (0, 1))
    acc = torch.zeros(xf.shape[0], wf.shape[0])
    for p in range(xf.shape[1] // 2):
        for e in (2 * p + 1, 2 * p):
            acc += xf[:, e, None] * wf[None, :, e]
    return (acc if bias is None else acc + bias.float()).bfloat16()


@pytest.mark.parametrize("path", kernel_path_params(("avx512",)))
@pytest.mark.parametrize("out_features,in_features,rows,with_bias",
                         [(96, 64, 7, True), (200, 33, 13, False), (64, 576, 64, True),
                          (200, 33, 41, True), (96, 64, 37, False)])
def test_the_emulated_pair_dot_is_vdpbf16ps_arithmetic(path: str, out_features: int,
                                                       in_features: int, rows: int,
                                                       with_bias: bool) -> None:
    """Without AVX512-BF16 the AVX-512 linear builds each vdpbf16ps from two FMAs: its
    outputs are that instruction's sequence of roundings exactly (normal numbers), both below
    and from the row count where the kernel widens its operands to fp32 first (36)."""
    gen = torch.Generator().manual_seed(out_features * rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    ext = kernels_for_path(path).ext
    got = ext.linear_avx512(x, ext.pack_weight_avx512(weight), bias)
    assert torch.equal(got, pair_dot_sequence(x, weight, bias))


@pytest.mark.parametrize("out_features,in_features,rows,with_bias",
                         [(3072, 576, 64, False), (3072, 576, 1, False), (64, 40, 7, True),
                          (96, 33, 13, True), (32, 576, 700, True), (64, 64, 1100, True)])
def test_fused_swiglu_is_bit_identical_to_linear_then_silu_mul(
        compiled: Kernels, out_features: int, in_features: int, rows: int,
        with_bias: bool) -> None:
    """A [gate | up] projection packed for the SwiGLU epilogue: its fused call equals
    silu_mul of the plain layer's output bit for bit, its plain forward equals the plain
    layer's, and rows do not depend on their batch; paths without the epilogue say None."""
    gen = torch.Generator().manual_seed(out_features + rows)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    plain, fused = PackedLinear(weight, bias, compiled), PackedLinear(weight, bias, compiled,
                                                                      swiglu=True)
    want = compiled.silu_mul(plain(x))
    assert torch.equal(compiled.swiglu(fused, x), want)
    assert torch.equal(fused(x), plain(x))
    if not epilogues_apply(compiled, out_features, in_features, rows):
        assert fused.silu_mul(x) is None
        return
    assert fused.fused_swiglu
    got = fused.silu_mul(x)
    assert torch.equal(got, want)
    assert torch.equal(fused.silu_mul(x[rows // 2:]), got[rows // 2:])
    assert fused.silu_mul(x[:, ::2]) is None  # strided rows: the caller falls back


def test_gate_up_interleaving_round_trips() -> None:
    t = torch.arange(96.0)
    order = interleave_gate_up(t)
    assert order[:32].tolist() == list(range(16)) + list(range(48, 64))
    assert torch.equal(deinterleave_gate_up(order.view(1, 96)).view(96), t)


def test_pack_linears_fuses_only_gate_up(compiled: Kernels) -> None:
    model = ours_from_hf(tiny_hf_model()).bfloat16()
    pack_linears(model, compiled)
    fused = {name for name, m in model.named_modules()
             if isinstance(m, PackedLinear) and m.fused_swiglu}
    if compiled.avx512 or compiled.amx:
        assert fused and all(name.endswith("gate_up_proj") for name in fused)
    else:
        assert not fused


@pytest.mark.parametrize("heads,kv_heads,in_features,rows,with_bias",
                         [(9, 3, 576, 64, False), (9, 3, 576, 1, False), (2, 1, 40, 7, True),
                          (2, 2, 33, 13, True), (1, 1, 64, 700, True)])
def test_fused_rotary_is_bit_identical_to_linear_then_rotary_qkv(
        compiled: Kernels, heads: int, kv_heads: int, in_features: int, rows: int,
        with_bias: bool) -> None:
    """A qkv projection packed for the rotary epilogue (heads of 64 dims): its fused call
    equals rotary_qkv of the plain layer's output bit for bit (cos / sin as the model passes
    them: strided views of one table), its plain forward equals the plain layer's, and rows
    do not depend on their batch; paths without the epilogue say None."""
    out_features, rotary_cols = (heads + 2 * kv_heads) * 64, (heads + kv_heads) * 64
    gen = torch.Generator().manual_seed(out_features + rows)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    table = torch.randn(rows, 64, generator=gen).bfloat16()
    cos, sin = table[:, :32], table[:, 32:]
    plain = PackedLinear(weight, bias, compiled)
    fused = PackedLinear(weight, bias, compiled, rotary_cols=rotary_cols)
    want = compiled.rotary_qkv(plain(x), cos, sin, heads, kv_heads, 64)
    got = compiled.qkv_rotary(fused, x, cos, sin, heads, kv_heads, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(fused(x), plain(x))
    if not epilogues_apply(compiled, out_features, in_features, rows):
        assert fused.rotary(x, cos, sin, heads, kv_heads) is None
        return
    assert fused.fused_rotary_cols == rotary_cols
    whole = fused.rotary(x, cos, sin, heads, kv_heads)
    half = fused.rotary(x[rows // 2:], cos[rows // 2:], sin[rows // 2:], heads, kv_heads)
    assert all(torch.equal(a, b[rows // 2:]) for a, b in zip(half, whole))
    assert fused.rotary(x[:, ::2], cos, sin, heads, kv_heads) is None  # strided rows
    assert fused.rotary(x, cos.float(), sin.float(), heads, kv_heads) is None
    assert fused.rotary(x, cos, sin, heads + 1, kv_heads) is None  # not its heads
    with pytest.raises(ValueError, match="cos / sin must be"):
        fused.rotary(x, cos[:, :16], sin[:, :16], heads, kv_heads)


def test_rotary_quarters_swap_and_round_trip() -> None:
    t = torch.arange(160.0)  # two rotary heads, then 32 other entries
    order = swap_rotary_quarters(t, 128)
    head = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
    assert order.tolist() == head + [64 + i for i in head] + list(range(128, 160))
    assert torch.equal(swap_rotary_quarters(order.view(1, 160), 128, dim=1).view(160), t)


def test_pack_linears_packs_qkv_for_the_rotary_epilogue(compiled: Kernels) -> None:
    """Heads of 64 dims: each layer's qkv_proj takes the epilogue where the path has it, and
    the packed model's greedy forward is the plain packing's (the epilogue is bit-identical)."""
    model = ours_from_hf(tiny_hf_model(hidden_size=256, num_attention_heads=4,
                                       num_key_value_heads=2)).bfloat16()
    plain = copy.deepcopy(model)
    pack_linears(model, compiled)
    fused = {name: m.fused_rotary_cols for name, m in model.named_modules()
             if isinstance(m, PackedLinear) and m.fused_rotary_cols}
    if not (compiled.avx512 or compiled.amx):
        assert not fused
        return
    assert set(fused) == {f"layers.{i}.self_attn.qkv_proj" for i in range(2)}
    assert set(fused.values()) == {(4 + 2) * 64}
    for module in plain.modules():  # the same packing without the epilogue
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias, compiled,
                                                   swiglu=name == "gate_up_proj"))
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(our_logits(model, ids), our_logits(plain, ids))


@pytest.mark.parametrize("out_features,in_features,rows,bias_kind",
                         [(49152, 576, 64, None), (1000, 577, 1, "bf16"), (4099, 64, 7, "fp32"),
                          (777, 33, 130, "bf16"), (16, 2, 3, None), (4096, 64, 7, "fp32"),
                          (1008, 64, 130, "bf16")])
def test_greedy_epilogue_is_the_argmax_of_the_lm_heads_logits(
        compiled: Kernels, out_features: int, in_features: int, rows: int,
        bias_kind: str | None) -> None:
    """An LM head's greedy epilogue gives, per row, the index `argmax_rows` takes from the
    head's bf16 logits (first maximum on ties, across the threads' column ranges too) without
    storing them; rows do not depend on their batch; a NaN output, strided rows or a head
    without the epilogue say None (the caller takes the logits)."""
    gen = torch.Generator().manual_seed(out_features + rows)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    bias = {None: None, "bf16": torch.randn(out_features, generator=gen).bfloat16(),
            "fp32": torch.randn(out_features, generator=gen)}[bias_kind]
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    # Ties: row 0's winner appears three times, once in each half of the columns (the two
    # threads' ranges) and once near the end.
    winner = x[0].float() * 8
    for col in (out_features // 5, out_features // 2 + 3, out_features - 1):
        weight[col] = winner.bfloat16()
        if bias is not None:
            bias[col] = 0
    head = PackedLinear(weight, bias, compiled, lm_head=True)
    want = compiled.argmax_rows(head(x))
    if not epilogues_apply(compiled, out_features, in_features, rows, lm_head=True):
        assert head.argmax(x) is None
        return
    got = head.argmax(x)
    assert got == want
    if out_features > 16:
        assert got[0] == out_features // 5
    assert head.argmax(x[rows // 2:]) == want[rows // 2:]
    assert head.argmax(x[:, ::2]) is None  # strided rows
    assert PackedLinear(weight, bias, compiled).argmax(x) is None  # not packed as a head
    poisoned = weight.clone()
    poisoned[out_features // 3, 0] = float("nan")
    assert PackedLinear(poisoned, bias, compiled, lm_head=True).argmax(x) is None


def test_greedy_steps_take_the_lm_heads_epilogue(compiled: Kernels) -> None:
    """A packed model's greedy tokens come from the head's epilogue where the path has one,
    and equal the sampler's argmax over `compute_logits`."""
    model = ours_from_hf(tiny_hf_model()).bfloat16()
    pack_linears(model, compiled)
    hidden = torch.randn(5, model.config.hidden_size).bfloat16()
    tokens = model.greedy_tokens(hidden)
    want = compiled.argmax_rows(model.compute_logits(hidden, widen=False))
    assert tokens == (want if compiled.avx512 or compiled.amx else None)
